"""Experiment configuration: presets in ``configs/``, validated at the boundary.

A preset names a dataset, how many clients each domain is cut into, the node
splits and the local training recipe (FedIA paper, Appendix A.1). Every value is
checked here, once, with a message that names the value and what is allowed,
so the simulation itself never sees a bad configuration.
"""

import dataclasses
import pathlib
from typing import Any, Mapping, Optional

import yaml

from fedjax_graph import models

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
DATASET_DOMAINS = {  # the same names as data_prep.DATASETS, kept free of its import cost
    "twitch": ("DE", "EN", "ES", "FR", "PT", "RU"),
    "wikinet": ("chameleon", "squirrel", "crocodile"),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """One federation and its local training recipe.

  Attributes:
    dataset: ``twitch`` or ``wikinet``.
    setting: preset name (``s1``/``s2``/``s3`` for Twitch, ``default`` for WikiNet).
    clients_per_domain: number of clients each domain is cut into.
    split: (train, val, test) fractions of each client's nodes.
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
  """
  dataset: str
  setting: str
  clients_per_domain: Mapping[str, int]
  split: tuple[float, float, float]
  backbone: str = "pmlp_gcn"
  norm: str = "batch"
  norm_rows: str = "train"
  hidden: int = 128
  num_layers: int = 3
  dropout: float = 0.5
  local_steps: int = 5
  lr: float = 0.05
  momentum: float = 0.9
  weight_decay: float = 1e-5
  max_buckets: int = 3
  allow_empty_clients: bool = False
  participation: float = 1.0

  def __post_init__(self):
    if self.dataset not in DATASET_DOMAINS:
      raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {sorted(DATASET_DOMAINS)}")
    domains = DATASET_DOMAINS[self.dataset]
    unknown = sorted(set(self.clients_per_domain) - set(domains))
    if unknown:
      raise ValueError(f"unknown {self.dataset} domain(s) {unknown}; valid: {list(domains)}")
    missing = [d for d in domains if d not in self.clients_per_domain]
    if missing:
      raise ValueError(f"clients_per_domain has no count for {missing}")
    for domain, count in self.clients_per_domain.items():
      if not isinstance(count, int) or count < 1:
        raise ValueError(f"clients_per_domain[{domain!r}] = {count!r}; must be an integer >= 1")
    split = tuple(float(f) for f in self.split)
    if len(split) != 3 or min(split) < 0 or abs(sum(split) - 1) > 1e-6 or split[0] == 0:
      raise ValueError(f"split = {list(self.split)}; must be 3 fractions >= 0 summing to 1, train > 0")
    object.__setattr__(self, "split", split)
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

  @property
  def domains(self) -> tuple[str, ...]:
    return tuple(self.clients_per_domain)

  @property
  def num_clients(self) -> int:
    return sum(self.clients_per_domain.values())

  def model(self, num_classes: int) -> models.NodeClassifier:
    """The backbone of this recipe for K = ``num_classes``."""
    return models.make_model(self.backbone, num_classes, self.hidden, self.num_layers,
                             self.dropout, self.norm)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"clients_per_domain": dict(self.clients_per_domain)}


def _check(ok: bool, name: str, value, allowed: str) -> None:
  if not ok:
    raise ValueError(f"{name} = {value!r}; must be {allowed}")


def preset_names() -> dict[str, list[str]]:
  """The available presets, ``{dataset: [setting, ...]}``, read from ``configs/``."""
  names: dict[str, list[str]] = {}
  for path in sorted(CONFIG_DIR.glob("*.yaml")):
    with open(path) as f:
      raw = yaml.safe_load(f)
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
  with open(CONFIG_DIR / f"{dataset}_{setting}.yaml") as f:
    raw = yaml.safe_load(f)
  raw.update({k: v for k, v in overrides.items() if v is not None})
  fields = {f.name for f in dataclasses.fields(Config)}
  unknown = sorted(set(raw) - fields)
  if unknown:
    raise ValueError(f"unknown config field(s) {unknown}; valid: {sorted(fields)}")
  return Config(**raw)
