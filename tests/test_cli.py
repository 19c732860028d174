"""Command lines: comma lists, --config/--set, flags a resume refuses, Ctrl-C, bad checkpoints."""

import argparse
import json
import pathlib

import numpy as np
import pytest

from fedjax_graph import checkpoint, cli, experiment, io, report

from conftest import script_main, usage_error

WIKINET = """\
dataset: wikinet
setting: mine
clients_per_domain: {chameleon: 2, squirrel: 2, crocodile: 2}
split: [0.6, 0.2, 0.2]
weight_decay: 1e-5
hidden: 16
"""


def _parser() -> argparse.ArgumentParser:
  """grid.py's shared flags."""
  parser = argparse.ArgumentParser(prog="grid.py")
  cli.add_federation_flags(parser)
  cli.add_sweep_flags(parser)
  cli.add_output_flags(parser)
  return parser


@pytest.mark.parametrize("parse", [cli.float_list, cli.int_list, cli.str_list])
@pytest.mark.parametrize("text", ["1,,3", "1,3,", ",1", ""])
def test_comma_lists_refuse_empty_items(parse, text):
  with pytest.raises(argparse.ArgumentTypeError, match=f"empty item in {text!r}"):
    parse(text)


def test_comma_lists_parse():
  assert cli.float_list("0.1, 0.3") == [0.1, 0.3] and cli.int_list("0,1") == [0, 1]
  assert cli.str_list("fedavg,fedprox") == ["fedavg", "fedprox"]


@pytest.mark.parametrize("flags, message", [
    (["--rho", "0.1,,0.3"], "argument --rho: empty item in '0.1,,0.3'"),
    (["--seeds", "0,1,"], "argument --seeds: empty item in '0,1,'"),
    (["--set", "hidden=64.5"], "hidden = 64.5; must be an integer (--set hidden=...)"),
    (["--set", "colour=red"], "unknown config field 'colour' in 'colour=red'; valid: dataset, "),
    (["--set", "lr"], "argument --set: 'lr' is not key=value"),
    (["--backbone", "gcn", "--set", "backbone=mlp"],
     "backbone is set twice (--backbone and --set backbone=...); give it once"),
    (["--set", "lr=0.1", "--set", "lr=0.2"], "lr is set twice (--set lr=... and --set lr=...)"),
    (["--config", "x.yaml"], "give --config FILE or --dataset/--setting, not both"),
    (["--set", "dataset=twitch"], "--set dataset=... cannot change the dataset: choose it with "
                                  "--dataset"),
    (["--set", "setting=s3"], "--set setting=... cannot change the setting"),
    (["--set", "allow_empty_clients=no"], "allow_empty_clients = 'no'; must be true or false"),
    (["--set", "lr=.inf"], "lr = inf; must be a finite number (--set lr=...)"),
    (["--participation", "2"], "participation = 2.0; must be in (0, 1] (--participation)"),
    (["--set", "clients_per_domain={chameleon: 0, squirrel: 1, crocodile: 1}"],
     "clients_per_domain['chameleon'] = 0; must be an integer >= 1 (--set clients_per_domain=...)"),
])
def test_grid_usage_errors_before_any_file(flags, message, tmp_path, capsys):
  argv = ["--dataset", "wikinet", "--out", str(tmp_path / "x"), *flags]
  assert message in usage_error("grid", argv, capsys)
  assert not (tmp_path / "x").exists()


def test_a_missing_config_file_is_a_usage_error(tmp_path, capsys):
  err = usage_error("grid", ["--config", str(tmp_path / "none.yaml")], capsys)
  assert f"--config {tmp_path / 'none.yaml'}: No such file or directory" in err


def test_config_file_then_shortcuts_then_set(tmp_path):
  path = tmp_path / "mine.yaml"
  path.write_text(WIKINET)
  parser = _parser()
  args = cli.parse_args(parser, ["--config", str(path), "--backbone", "gcn", "--set", "lr=0.01",
                                 "--set", "clients_per_domain={chameleon: 1, squirrel: 2, "
                                 "crocodile: 3}"])
  cfg = cli.config_from_args(parser, args)
  assert (cfg.dataset, cfg.setting, cfg.backbone, cfg.hidden) == ("wikinet", "mine", "gcn", 16)
  assert cfg.lr == 0.01 and cfg.weight_decay == 1e-5 and cfg.num_clients == 6
  preset = cli.config_from_args(parser, cli.parse_args(parser, [
      "--dataset", "twitch", "--setting", "s3", "--set", "weight_decay=1e-4", "--norm", "none"]))
  assert (preset.setting, preset.weight_decay, preset.norm) == ("s3", 1e-4, "none")


def test_ablation_takes_a_config_file_as_its_one_setting(tmp_path, capsys):
  path = tmp_path / "mine.yaml"
  path.write_text(WIKINET)
  err = usage_error("ablation", ["--config", str(path), "--settings", "default"], capsys)
  assert "with --config FILE the file is the one setting" in err
  assert "hidden = 0; must be an integer >= 1" in usage_error(
      "ablation", ["--config", str(path), "--set", "hidden=0"], capsys)


def test_the_chosen_config_is_what_config_json_records(tmp_path, tiny_wikinet, monkeypatch):
  monkeypatch.setattr(experiment, "load_dataset", lambda *a, **k: (tiny_wikinet, {}))
  path = tmp_path / "mine.yaml"
  path.write_text(WIKINET)
  out = tmp_path / "run"
  script_main("grid")(["--config", str(path), "--set", "hidden=8", "--set", "max_buckets=1",
                       "--rounds", "1", "--last", "1", "--chunk", "1", "--rho", "0.5", "--beta",
                       "0.5", "--no-progress", "--out", str(out)])
  recorded = json.loads((out / "config.json").read_text())["config"]
  assert recorded["hidden"] == 8 and recorded["weight_decay"] == 1e-5
  assert recorded["setting"] == "mine" and recorded["max_buckets"] == 1


@pytest.mark.parametrize("flags, refused", [
    (["--rounds", "50", "--rho", "0.9"], "--rounds, --rho"),
    (["--rounds", "200"], "--rounds"),  # its default value, still not applicable
    (["--round", "50"], "--rounds"),  # an abbreviation
    (["--set", "lr=0.1", "--overwrite"], "--overwrite, --set"),
])
def test_resume_refuses_flags_that_do_not_apply(flags, refused, tmp_path, capsys):
  err = usage_error("grid", ["--resume", str(tmp_path), *flags], capsys)
  assert (f"{refused}: not applicable to --resume, which continues the run with its own "
          "config.json; only --raw-dir, --cache-dir, --no-progress, --no-verify, --nonfinite, "
          "--devices, --max-memory apply") in err


def test_resume_takes_the_flags_that_apply(tmp_path):
  args = cli.parse_args(_parser(), ["--resume", str(tmp_path), "--raw-dir", "r", "--cache-dir",
                                    "c", "--no-progress", "--no-verify", "--nonfinite", "skip",
                                    "--devices", "1", "--max-memory", "2G"])
  assert args.resume == tmp_path and args.nonfinite == "skip" and args.rounds == 200
  controls = cli.resume_kwargs(args)["controls"]
  assert controls.devices == 1 and controls.max_memory == 2 * 2**30


@pytest.fixture
def ctrl_c(capsys, monkeypatch):
  """``ctrl_c(out)``: the line ``cli.guarded`` prints for a body Ctrl-C stops (``args.out = out``)."""

  def exit_now(status):  # os._exit would end pytest
    raise SystemExit(status)

  monkeypatch.setattr(cli, "exit_now", exit_now)

  def interrupt(out):
    def run():
      raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
      cli.guarded(_parser(), run, argparse.Namespace(resume=None, out=out))
    assert exit_info.value.code == cli.INTERRUPTED
    return capsys.readouterr().err.removesuffix("\n")

  return interrupt


def test_ctrl_c_says_what_was_kept_and_names_the_folder(tmp_path, ctrl_c):
  out = tmp_path / "run"
  assert ctrl_c(None) == "interrupted before the run chose its output folder; nothing was saved"
  assert ctrl_c(out) == f"interrupted before anything was written to {out}; nothing was saved"
  out.mkdir()
  (out / "config.json").write_text(json.dumps({"status": "running"}))
  assert ctrl_c(out) == (
      f"interrupted before the first checkpoint: no round was saved; python experiments/grid.py "
      f"--resume {out} starts the run again from round 1 with its config.json")
  (out / "checkpoint.msgpack").write_bytes(b"x")
  assert ctrl_c(out) == (f"interrupted; {out} keeps checkpoint.msgpack: continue with python "
                         f"experiments/grid.py --resume {out}")
  (out / "checkpoint.msgpack").unlink()
  (out / "runs").mkdir()
  (out / "runs" / "fedavg.npz").write_bytes(b"x")
  (out / "checkpoint-fedprox.msgpack").write_bytes(b"x")
  assert ctrl_c(out) == (f"interrupted; {out} keeps checkpoint-fedprox.msgpack, runs/fedavg.npz: "
                         f"continue with python experiments/grid.py --resume {out}")
  (out / "config.json").write_text(json.dumps({"status": "finished"}))
  assert ctrl_c(out) == f"interrupted; {out} still holds the finished run it held"


def test_a_batch_over_the_budget_is_a_one_line_error_not_a_usage_error(capsys):
  from fedjax_graph.controls import OverBudgetError

  def run():
    raise OverBudgetError("the batch needs at least 2 MiB per device")

  with pytest.raises(SystemExit) as exit_info:
    cli.guarded(_parser(), run, argparse.Namespace(resume=None, out=None))
  assert exit_info.value.code == "error: the batch needs at least 2 MiB per device"
  assert "usage:" not in capsys.readouterr().err


def test_a_stopped_sweep_says_so_in_config_json(tmp_path, ctrl_c):
  from fedjax_graph.rundir import marks_stopped
  record = {"status": "running", "seeds": [0]}
  with pytest.raises(KeyboardInterrupt), marks_stopped(tmp_path, record):
    raise KeyboardInterrupt
  assert json.loads((tmp_path / "config.json").read_text()) == {
      "status": "stopped: KeyboardInterrupt", "seeds": [0]}
  assert ctrl_c(tmp_path).startswith("interrupted before the first checkpoint")


def test_ctrl_c_in_a_script_names_the_default_folder(ctrl_c, monkeypatch, capsys):
  def stopped(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(experiment, "run_grid", stopped)
  with pytest.raises(SystemExit) as exit_info:
    script_main("grid")(["--dataset", "wikinet"])
  assert exit_info.value.code == cli.INTERRUPTED
  message = capsys.readouterr().err
  assert message.startswith("interrupted before anything was written to results/wikinet-default-")
  assert "DIR" not in message


def test_a_truncated_checkpoint_names_the_file_and_the_way_out(tmp_path):
  path = tmp_path / "run" / "checkpoint.msgpack"
  state = {"w": np.arange(100, dtype=np.float32)}
  checkpoint.save(path, checkpoint.Checkpoint(state, {"acc": np.ones((1, 1, 2))}, 2, "f"))
  assert [p.name for p in path.parent.iterdir()] == ["checkpoint.msgpack"]  # no temp file left
  assert checkpoint.load(path, state).next_round == 2
  path.write_bytes(path.read_bytes()[:200])
  with pytest.raises(ValueError) as err:
    checkpoint.load(path, state)
  assert str(err.value) == (
      f"{path} is truncated, damaged or not a fedjax-graph checkpoint (format 1) (Unpack failed: "
      "incomplete input); the state it held is lost: delete it and continue with --resume "
      f"{path.parent} (its sweep starts again from round 1), or start the run again with "
      "--overwrite (and not --resume)")


def test_one_atomic_write_helper():
  assert report._atomic_write is io.atomic_write


def test_data_folders_are_absolute_folders_so_a_resume_works_from_anywhere(tmp_path, monkeypatch):
  from fedjax_graph.controls import RunControls

  monkeypatch.chdir(tmp_path)
  controls = RunControls(raw_dir="../raw", cache_dir="~/cache", out_dir="out")
  assert controls.raw_dir == tmp_path / ".." / "raw"
  assert controls.cache_dir == pathlib.Path.home() / "cache"
  assert controls.out_dir == pathlib.Path("out")  # as given: messages name it as the user did
  (tmp_path / "afile").write_text("")
  for name in ("out_dir", "raw_dir", "cache_dir"):
    with pytest.raises(ValueError, match=f"^{name} = .*afile; must be a folder, not a file$"):
      RunControls(**{name: tmp_path / "afile"})
