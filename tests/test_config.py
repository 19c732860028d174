"""Configs a user owns: YAML 1.2 floats, strict types, config files, key=value overrides."""

import dataclasses
import json
import re

import pytest
import yaml

from data_prep import registry
from fedjax_graph import config

from conftest import REPO

WIKINET = """\
dataset: wikinet
clients_per_domain: {chameleon: 2, squirrel: 2, crocodile: 2}
split: [0.6, 0.2, 0.2]
"""


def test_yaml_reads_floats_as_yaml_1_2():
  values = config.load_yaml("a: 1e-5\nb: 1E3\nc: .5\nd: -1.5e+2\ne: .inf\nf: 1\ng: '1e-5'\nh: 1e5x")
  assert values == {"a": 1e-5, "b": 1000.0, "c": 0.5, "d": -150.0, "e": float("inf"), "f": 1,
                    "g": "1e-5", "h": "1e5x"}
  assert isinstance(values["f"], int) and isinstance(values["b"], float)


def test_yaml_booleans_and_integers_are_yaml_1_2():
  values = config.load_yaml("a: no\nb: on\nc: True\nd: false\ne: 1_000\nf: 0x10\ng: 010\n"
                            "h: 1:30\ni: -7")
  assert values == {"a": "no", "b": "on", "c": True, "d": False, "e": "1_000", "f": 16, "g": 10,
                    "h": "1:30", "i": -7}


@pytest.mark.parametrize("value, message", [
    ("no", "allow_empty_clients = 'no'; must be true or false"),
    ("off", "allow_empty_clients = 'off'; must be true or false")])
def test_yaml_1_1_booleans_are_not_booleans(value, message):
  with pytest.raises(ValueError, match=message):
    config.load_preset("wikinet", **dict([config.parse_override(f"allow_empty_clients={value}")]))


@pytest.mark.parametrize("overrides, message", [
    ({"lr": float("inf")}, "lr = inf; must be a finite number"),
    ({"weight_decay": float("inf")}, "weight_decay = inf; must be a finite number"),
    ({"dropout": float("nan")}, "dropout = nan; must be a finite number"),
    ({"split": [float("nan"), 0.5, 0.5]}, "split = [nan, 0.5, 0.5]; must be 3 fractions"),
])
def test_non_finite_numbers_are_out_of_range(overrides, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    config.load_preset("wikinet", **overrides)


@pytest.mark.parametrize("split", [(0.8, 0.2, 0.0), (0.0, 0.5, 0.5), (0.6, 0.2, 0.3)])
def test_a_split_must_train_and_test(split):
  with pytest.raises(ValueError, match=re.escape(
      f"split = {list(split)}; must be 3 fractions >= 0 summing to 1, train > 0 and test > 0")):
    config.load_preset("wikinet", split=split)
  config.load_preset("wikinet", split=(0.8, 0.0, 0.2))  # no validation nodes is allowed


def test_a_config_file_anywhere_with_weight_decay_1e_5(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text(WIKINET + "weight_decay: 1e-5\nhidden: 16\nlr: 1\n")
  cfg = config.load_config(path, hidden=8)
  assert cfg.weight_decay == 1e-5 and cfg.hidden == 8 and cfg.setting == "mine"
  assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an integer is a number
  assert cfg.split == (0.6, 0.2, 0.2) and cfg.num_clients == 6


@pytest.mark.parametrize("line, message", [
    ("hidden: 64.5", "hidden = 64.5; must be an integer"),
    ("backbone: [gcn]", "backbone = ['gcn']; must be a string"),
    ('allow_empty_clients: "no"', "allow_empty_clients = 'no'; must be true or false"),
    ("lr: fast", "lr = 'fast'; must be a number"),
    ("weight_decay: '1e-5'", "weight_decay = '1e-5'; must be a number"),
    ("dropout: true", "dropout = True; must be a number"),
    ("split: 0.6", "split = 0.6; must be a list"),
    ("clients_per_domain: {chameleon: 2.5, squirrel: 2, crocodile: 2}",
     "clients_per_domain['chameleon'] = 2.5; must be an integer"),
])
def test_wrong_types_are_one_line_errors_naming_field_and_what_is_allowed(tmp_path, line,
                                                                          message):
  path = tmp_path / "bad.yaml"
  key = line.split(":")[0]
  kept = [kept for kept in WIKINET.splitlines() if not kept.startswith(f"{key}:")]
  path.write_text("\n".join([*kept, line]) + "\n")
  with pytest.raises(ValueError) as err:
    config.load_config(path)
  assert message in str(err.value) and "\n" not in str(err.value)
  assert str(err.value).startswith(f"{path}: ")


def test_every_type_error_is_reported_at_once():
  with pytest.raises(ValueError, match=r"^hidden = 64.5; must be an integer; lr = 'x'; must be a "
                                       r"number$"):
    config.load_preset("wikinet", hidden=64.5, lr="x")


@pytest.mark.parametrize("text, message", [
    ("dataset: wikinet\nsplit: [0.6, 0.2, 0.2]\n",
     "config field(s) ['clients_per_domain'] missing; required: ['dataset', 'clients_per_domain', "
     "'split']"),
    (WIKINET + "lr: 0.1\nlr: 0.2\n", "is not valid YAML: duplicate key 'lr' (line "),
    (WIKINET + "colour: red\n", "unknown config field(s) ['colour']; valid: ["),
    ("- dataset\n", "must hold a mapping of config fields (field: value), not list"),
    (WIKINET + "hidden: [8\n", "is not valid YAML: expected ',' or ']'"),
    (WIKINET.replace("wikinet", "cora"), "unknown dataset 'cora'; choose one of ['twitch', "
                                         "'wikinet']"),
])
def test_bad_config_files_are_named(tmp_path, text, message):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(ValueError) as err:
    config.load_config(path)
  assert message in str(err.value) and "\n" not in str(err.value)


def test_a_config_survives_config_json_and_replace():
  cfg = config.load_preset("twitch", "s2", weight_decay=1e-4, participation=0.5)
  # Resume rebuilds it from config.json, where the split is a list.
  again = config.Config(**json.loads(json.dumps({"config": cfg.to_dict()}))["config"])
  assert again == cfg and again.split == (0.6, 0.1, 0.3) and hash(again) == hash(cfg)
  assert dataclasses.replace(cfg, hidden=8).hidden == 8
  with pytest.raises(ValueError, match="hidden = 8.0; must be an integer"):
    dataclasses.replace(cfg, hidden=8.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.hidden = 8


@pytest.mark.parametrize("text, key, value", [
    ("lr=0.01", "lr", 0.01),
    ("weight_decay=1e-5", "weight_decay", 1e-5),
    ("norm=none", "norm", "none"),
    ("allow_empty_clients=true", "allow_empty_clients", True),
    ("split=[0.5, 0.25, 0.25]", "split", [0.5, 0.25, 0.25]),
    ("clients_per_domain={DE: 4, EN: 2}", "clients_per_domain", {"DE": 4, "EN": 2}),
    (" hidden = 64", "hidden", 64),
])
def test_overrides_are_yaml_values(text, key, value):
  assert config.parse_override(text) == (key, value)


@pytest.mark.parametrize("text, message", [
    ("lr", "'lr' is not key=value"),
    ("colour=red", "unknown config field 'colour' in 'colour=red'; valid: dataset, setting, "),
    ("lr=", "'lr=' gives lr no value"),
    ("split=[0.5", "'split=[0.5': the value is not valid YAML"),
])
def test_bad_overrides_are_named(text, message):
  with pytest.raises(ValueError) as err:
    config.parse_override(text)
  assert message in str(err.value) and "\n" not in str(err.value)


def test_dataset_names_come_from_the_data_registry():
  assert config.DATASETS is registry.DATASETS
  assert not hasattr(config, "DATASET_DOMAINS")
  for dataset, settings in config.preset_names().items():
    for setting in settings:
      assert config.load_preset(dataset, setting).domains == registry.DATASETS[dataset]


def test_presets_are_found_in_the_source_tree():
  assert config.CONFIG_DIR == REPO / "configs"
  assert config.preset_names() == {"twitch": ["s1", "s2", "s3"], "wikinet": ["default"]}


def test_a_duplicate_key_is_an_error_but_merges_and_unhashable_keys_keep_their_handling():
  with pytest.raises(yaml.YAMLError, match="duplicate key 'lr'"):
    config.load_yaml("lr: 0.1\nhidden: 8\nlr: 0.2\n")
  assert config.load_yaml("base: &b {lr: 1}\nother: {<<: *b, hidden: 2}") == {
      "base": {"lr": 1}, "other": {"lr": 1, "hidden": 2}}
  with pytest.raises(yaml.YAMLError, match="unhashable key"):
    config.load_yaml("? [a, b]\n: 1\n")
