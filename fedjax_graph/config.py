"""Experiment configuration: presets, config files and overrides, validated at the boundary.

A preset (``configs/<dataset>_<setting>.yaml``) names a dataset, how many
clients each domain is cut into, the node splits and the local training recipe
(FedIA paper, Appendix A.1). A config file anywhere (``load_config``) has the
same fields, and ``key=value`` overrides (``parse_override``, the scripts'
``--set``) replace any of them. Every value is checked once, when a ``Config``
is made: first its type, strictly (pydantic; "no" is not False, 64.5 is not
64, "0.1" is not 0.1, while an integer is a number), then its range, each
failure one line naming the field and what is allowed, so the simulation
itself never sees a bad configuration.

All YAML here is read by ``load_yaml``: PyYAML follows YAML 1.1, in which
``1e-5`` (no dot) is a string and ``no`` is False; ``load_yaml`` reads
scalars as YAML 1.2 does.
"""

import dataclasses
import math
import pathlib
import re
from typing import Annotated, Any, Mapping, Optional

import pydantic
import yaml

from data_prep.registry import DATASETS
from fedjax_graph import graphs, models


def _config_dir() -> pathlib.Path:
  # Installed, the presets are package data beside this module (pyproject.toml
  # maps configs/ to fedjax_graph/configs); in the source tree they sit at its root.
  here = pathlib.Path(__file__).resolve().parent
  installed = here / "configs"
  return installed if installed.is_dir() else here.parent / "configs"


CONFIG_DIR = _config_dir()
"""The presets ``<dataset>_<setting>.yaml`` and the method config ``methods/defaults.yaml``."""


class YamlLoader(yaml.SafeLoader):
  """PyYAML's safe loader, with booleans, integers and floats as YAML 1.2's core schema has them.

  YAML 1.1 (PyYAML) reads ``1e-5`` (no dot) as a string, ``no``/``on``/``off``
  as booleans and ``1_000`` or ``1:30`` as integers. Here only ``true``/``false``
  (also ``True``, ``TRUE``, ...) are booleans, integers are decimal, ``0o``
  octal or ``0x`` hexadecimal, and floats include ``1e-5``, ``1E3`` and ``.5``;
  anything else is a string, which the ``Config`` check then rejects by name.
  A key given twice in one mapping is an error, as in YAML 1.2.
  """


_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
# Integers before floats, so that ``1`` stays an int.
YamlLoader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                 list("-+0123456789"))
YamlLoader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
  # PyYAML's own constructor reads a leading 0 as octal (YAML 1.1); 1.2 is decimal.
  text = loader.construct_scalar(node)
  return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


YamlLoader.add_constructor(_INT, _construct_int)


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
  # YAML 1.2 keys are unique; PyYAML keeps the last of two silently (``lr: 0.1`` then ``lr: 0.2``).
  seen = set()
  for key_node, _ in node.value:
    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
      continue  # construct_mapping rejects unhashable keys itself and merges ``<<``
    key = loader.construct_object(key_node, deep=True)
    if key in seen:
      raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                              key_node.start_mark)
    seen.add(key)
  return loader.construct_mapping(node, deep=True)


YamlLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def load_yaml(stream) -> Any:
  """Parses YAML (a string or an open file) with ``YamlLoader``: safe, YAML 1.2 floats."""
  return yaml.load(stream, Loader=YamlLoader)  # Safe: YamlLoader is a SafeLoader.


# Strict types: no value is coerced ("no" to False, 64.5 to 64, "1" to 1);
# an integer is still a number.
Integer = Annotated[int, pydantic.Strict()]
Number = Annotated[float, pydantic.Strict()]
Flag = Annotated[bool, pydantic.Strict()]
Text = Annotated[str, pydantic.Strict()]


@dataclasses.dataclass(frozen=True)
class Config:
  """One federation and its local training recipe.

  Attributes:
    dataset: a dataset of ``data_prep.registry`` (``twitch``, ``wikinet``).
    setting: preset name (``s1``/``s2``/``s3`` for Twitch, ``default`` for
      WikiNet; a config file's own name by default).
    clients_per_domain: number of clients each domain is cut into.
    split: (train, val, test) fractions of each client's nodes (a list or tuple).
    backbone: one of ``models.BACKBONES``.
    norm: ``batch`` (default, every backbone): batch norm without scale or
      shift after each hidden layer, with the statistics of the graph being
      processed (PMLP's reference code); ``none``. The default is the same
      for GCN and MLP, so the three backbones differ only in where they
      propagate (MLP and PMLP-GCN clients then send identical updates).
    norm_rows: the rows a backbone that does not propagate in training
      (PMLP-GCN, MLP) takes its batch-norm statistics over in training:
      ``train`` (default), the client's training nodes, the only rows its loss
      needs, so the rest are never computed; ``all``, all of the client's
      nodes, as PMLP's reference code (1.5x the local work; measured: the same
      accuracy, see README). Propagating backbones always use all nodes.
    hidden: width of the hidden layers.  num_layers: linear layers in total.
    dropout: drop rate in [0, 1) after each hidden activation in training.
    local_steps: full-batch SGD steps per client and round.
    lr: learning rate eta of the local SGD and of the server step (eq. 8).
    momentum: SGD momentum in [0, 1).  weight_decay: L2 coefficient >= 0.
    max_buckets: most client size buckets (each one batched computation).
    allow_empty_clients: a client whose split leaves it no training node is an
      error (False) or takes part with weight 0 and never enters an aggregate
      (True).
    participation: share of clients sampled to take part in each round, in
      (0, 1]: max(1, round(participation * C)) clients, seeded per seed and
      round (1: every client, every round).
    precision: ``f32`` (default) or ``bf16``: the matmul inputs (features and
      weights) of the backbone's dense layers, cast to bfloat16 with f32
      accumulation (``models.dense``); parameters, propagation, batch norm,
      aggregation and the optimisers stay f32. Meant for accelerators (on a
      CPU it is no faster; README "Speed").
    propagation: how a client's training step propagates over its graph,
      per size bucket (``graphs.operator_kind``): ``auto`` (default: a dense
      block for small graphs, else a CSR product; the rule and its
      measurements are in ``graphs``), ``dense``, ``csr`` or ``sparse`` (the
      padded edge list, gather and segment-sum). All give the same results up
      to float rounding; only the speed and memory differ.

  Raises:
    ValueError: (on construction) one line per bad value, naming the field and
      what is allowed.
  """
  dataset: Text
  setting: Text
  clients_per_domain: Mapping[Text, Integer]
  split: tuple[Number, ...]
  backbone: Text = "pmlp_gcn"
  norm: Text = "batch"
  norm_rows: Text = "train"
  hidden: Integer = 128
  num_layers: Integer = 3
  dropout: Number = 0.5
  local_steps: Integer = 5
  lr: Number = 0.05
  momentum: Number = 0.9
  weight_decay: Number = 1e-5
  max_buckets: Integer = 3
  allow_empty_clients: Flag = False
  participation: Number = 1.0
  precision: Text = "f32"
  propagation: Text = "auto"

  def __post_init__(self):
    """Checks every field (see the class docstring); inf and NaN are out of every range."""
    try:
      checked = _TYPES.model_validate(vars(self))
    except pydantic.ValidationError as err:
      raise ValueError("; ".join(_describe(e) for e in err.errors())) from None
    for name, value in checked:  # The values as checked: a tuple split, float numbers.
      object.__setattr__(self, name, value)
    if self.dataset not in DATASETS:
      raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {sorted(DATASETS)}")
    domains = DATASETS[self.dataset]
    unknown = sorted(set(self.clients_per_domain) - set(domains))
    if unknown:
      raise ValueError(f"unknown {self.dataset} domain(s) {unknown}; valid: {list(domains)}")
    missing = [d for d in domains if d not in self.clients_per_domain]
    if missing:
      raise ValueError(f"clients_per_domain has no count for {missing}")
    for domain, count in self.clients_per_domain.items():
      if count < 1:
        raise ValueError(f"clients_per_domain[{domain!r}] = {count!r}; must be an integer >= 1")
    for name, value in vars(self).items():
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} = {value!r}; must be a finite number")
    split = self.split
    if (len(split) != 3 or not all(math.isfinite(f) for f in split) or min(split) < 0
        or abs(sum(split) - 1) > 1e-6 or split[0] == 0 or split[2] == 0):
      raise ValueError(f"split = {list(split)}; must be 3 fractions >= 0 summing to 1, "
                       "train > 0 and test > 0")
    object.__setattr__(self, "clients_per_domain",
                       {d: self.clients_per_domain[d] for d in domains})
    if self.backbone not in models.BACKBONES:
      raise ValueError(f"Unsupported model: {self.backbone!r}; choose one of "
                       f"{sorted(models.BACKBONES)}")
    _check(self.norm in models.NORMS, "norm", self.norm, f"one of {list(models.NORMS)}")
    _check(self.norm_rows in ("train", "all"), "norm_rows", self.norm_rows, "'train' or 'all'")
    _check(self.hidden >= 1, "hidden", self.hidden, "an integer >= 1")
    _check(self.num_layers >= 1, "num_layers", self.num_layers, "an integer >= 1")
    _check(0 <= self.dropout < 1, "dropout", self.dropout, "in [0, 1)")
    _check(self.local_steps >= 1, "local_steps", self.local_steps, "an integer >= 1")
    _check(self.lr > 0, "lr", self.lr, "> 0")
    _check(0 <= self.momentum < 1, "momentum", self.momentum, "in [0, 1)")
    _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
    _check(self.max_buckets >= 1, "max_buckets", self.max_buckets, "an integer >= 1")
    _check(0 < self.participation <= 1, "participation", self.participation, "in (0, 1]")
    _check(self.precision in models.PRECISIONS, "precision", self.precision,
           f"one of {list(models.PRECISIONS)}")
    _check(self.propagation in graphs.PROPAGATION, "propagation", self.propagation,
           f"one of {list(graphs.PROPAGATION)}")
    self.model(2)  # combinations a backbone refuses (sfpd's norm and precision), before any file

  def __hash__(self) -> int:
    # The dataclass hash fails on the clients_per_domain dict; hash its items instead.
    return hash(tuple(tuple(v.items()) if isinstance(v, dict) else v for v in vars(self).values()))

  @property
  def domains(self) -> tuple[str, ...]:
    return tuple(self.clients_per_domain)

  @property
  def num_clients(self) -> int:
    return sum(self.clients_per_domain.values())

  def model(self, num_classes: int) -> models.NodeClassifier:
    """The backbone of this recipe for K = ``num_classes``."""
    return models.make_model(self.backbone, num_classes, self.hidden, self.num_layers,
                             self.dropout, self.norm, self.precision)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"clients_per_domain": dict(self.clients_per_domain)}


FIELDS = tuple(f.name for f in dataclasses.fields(Config))
_REQUIRED = tuple(f.name for f in dataclasses.fields(Config) if f.default is dataclasses.MISSING)
# The field types above as a pydantic model, which checks them all at once.
_TYPES = pydantic.create_model("Config", **{f.name: (f.type, ...)
                                            for f in dataclasses.fields(Config)})
_ALLOWED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
            "string_type": "a string", "dict_type": "a mapping", "tuple_type": "a list"}


def _describe(error: Mapping) -> str:
  """One pydantic error as ``field[key] = value; must be <what is allowed>``."""
  name, *keys = error["loc"]
  where = str(name) + "".join(f"[{k!r}]" for k in keys if k != "[key]")
  allowed = _ALLOWED.get(error["type"], error["msg"].lower())
  return f"{where} = {error['input']!r}; must be {allowed}"


def _check(ok: bool, name: str, value, allowed: str) -> None:
  if not ok:
    raise ValueError(f"{name} = {value!r}; must be {allowed}")


def _read(path: pathlib.Path) -> dict:
  """The mapping a YAML config file holds (``load_yaml``)."""
  with open(path) as f:
    try:
      raw = load_yaml(f)
    except yaml.YAMLError as err:
      raise ValueError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
  if not isinstance(raw, dict):
    raise ValueError(f"{path} must hold a mapping of config fields (field: value), "
                     f"not {type(raw).__name__}")
  return raw


def _yaml_problem(err: yaml.YAMLError) -> str:
  mark = getattr(err, "problem_mark", None)
  where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
  return f"{getattr(err, 'problem', None) or err}{where}"


def _make(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> Config:
  raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
  unknown = sorted(set(raw) - set(FIELDS))
  if unknown:
    raise ValueError(f"unknown config field(s) {unknown}; valid: {sorted(FIELDS)}")
  missing = [name for name in _REQUIRED if name not in raw]
  if missing:  # a config file's setting defaults to its name: not required of the user
    required = [name for name in _REQUIRED if name != "setting"]
    raise ValueError(f"config field(s) {missing} missing; required: {required}")
  return Config(**raw)


def preset_names() -> dict[str, list[str]]:
  """The available presets, ``{dataset: [setting, ...]}``, read from ``CONFIG_DIR``."""
  names: dict[str, list[str]] = {}
  for path in sorted(CONFIG_DIR.glob("*.yaml")):
    raw = _read(path)
    names.setdefault(raw["dataset"], []).append(raw["setting"])
  return names


def load_preset(dataset: str, setting: Optional[str] = None, **overrides) -> Config:
  """Reads the preset ``configs/<dataset>_<setting>.yaml`` and applies overrides.

  Args:
    dataset: ``twitch`` or ``wikinet``.
    setting: preset name; None picks the dataset's first preset (``s1`` for
      Twitch, ``default`` for WikiNet).
    **overrides: field values replacing the preset's (None values are ignored).

  Raises:
    ValueError: for an unknown dataset, setting or field, or an invalid value.
  """
  names = preset_names()
  if dataset not in names:
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(names)}")
  setting = setting or names[dataset][0]
  if setting not in names[dataset]:
    raise ValueError(f"unknown {dataset} setting {setting!r}; choose one of {names[dataset]}")
  return _make(_read(CONFIG_DIR / f"{dataset}_{setting}.yaml"), overrides)


def load_config(path: pathlib.Path, **overrides) -> Config:
  """Reads a config file anywhere, with the fields of a preset, and applies overrides.

  Args:
    path: a YAML mapping of ``Config`` fields; ``dataset``,
      ``clients_per_domain`` and ``split`` are required, ``setting`` defaults
      to the file's name without its suffix, the rest to ``Config``'s defaults.
    **overrides: field values replacing the file's (None values are ignored).

  Raises:
    ValueError: for invalid YAML, an unknown or missing field, or an invalid value.
    OSError: if the file cannot be read.
  """
  path = pathlib.Path(path)
  raw = _read(path)
  try:
    return _make({"setting": path.stem, **raw}, overrides)
  except ValueError as err:
    raise ValueError(f"{path}: {err}") from None


def parse_override(text: str) -> tuple[str, Any]:
  """``"key=value"`` -> ``(key, value)``, the value read as YAML (``load_yaml``).

  E.g. ``lr=0.01`` -> ``("lr", 0.01)``, ``weight_decay=1e-5`` -> a float,
  ``clients_per_domain={DE: 4, EN: 2}`` -> a dict, ``split=[0.5, 0.25, 0.25]``
  -> a list. The value's type and range are checked when the ``Config`` is made.

  Raises:
    ValueError: without ``=``, for an unknown key (listing the valid ones), or
      an empty or unparsable value.
  """
  key, sep, value = text.partition("=")
  key = key.strip()
  if not sep:
    raise ValueError(f"{text!r} is not key=value")
  if key not in FIELDS:
    raise ValueError(f"unknown config field {key!r} in {text!r}; valid: {', '.join(FIELDS)}")
  try:
    parsed = load_yaml(value)
  except yaml.YAMLError as err:
    raise ValueError(f"{text!r}: the value is not valid YAML: {_yaml_problem(err)}") from None
  if parsed is None:  # No field takes null, and load_preset reads None as "not set".
    raise ValueError(f"{text!r} gives {key} no value")
  return key, parsed
