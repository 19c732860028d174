"""Cells: the ways of aggregating that one compiled program runs side by side.

A *cell* is an aggregator (a name in ``aggregators.REGISTRY``), its
hyper-parameters and the label its results go by (``FedAvg``, ``FedIA ρ=0.3,
β=0.5``, ``FedAvg+GMA τ=0.1``). A batch of cells runs with a batch of seeds in
one program: cells of one aggregator form a *group*, run under one ``vmap``
with their hyper-parameters as traced values, and the groups run one after
another inside the round. Cells are paired: within a seed they share every
random number (initial model, dropout, client sample) and differ only in how
the server aggregates.

Results are addressed by label, never by position.
"""

from typing import Mapping, NamedTuple, Sequence

import jax
import numpy as np

from fedjax_graph import aggregators

BASE = "fedavg"  # the aggregator of a method's own averaging


class Cell(NamedTuple):
  """One way to aggregate.

  Attributes:
    aggregator: a name in ``aggregators.REGISTRY``.
    hparams: its hyper-parameters, every one of ``aggregators.get(name).hparams``
      (missing ones filled with the defaults by ``cell``), as (name, value) pairs.
    label: what results go by; unique in a batch.
  """
  aggregator: str
  hparams: tuple[tuple[str, float], ...]
  label: str

  @property
  def hparam_dict(self) -> dict[str, float]:
    return dict(self.hparams)


def _symbol(name: str) -> str:
  return {"rho": "ρ", "beta": "β", "tau": "τ"}.get(name, name)


def describe(aggregator: str, hparams: Mapping[str, float], base: str = "FedAvg") -> str:
  """The default label: ``FedAvg`` for the base aggregator, ``FedIA ρ=0.3, β=0.5``, ..."""
  if aggregator == BASE:
    return base
  values = ", ".join(f"{_symbol(k)}={v:g}" for k, v in hparams.items())
  display = aggregators.DISPLAY.get(aggregator, aggregator)
  return f"{display} {values}" if values else display


def cell(aggregator: str, label: str = "", **hparams: float) -> Cell:
  """A cell of ``aggregator``; hyper-parameters not given take the aggregator's defaults.

  Raises:
    ValueError: for an unknown aggregator or hyper-parameter, or a value out
      of its range (naming it and what is allowed).
  """
  agg = aggregators.get(aggregator)
  unknown = sorted(set(hparams) - set(agg.hparams))
  if unknown:
    raise ValueError(f"{aggregator}: unknown hyper-parameter(s) {unknown}; valid: "
                     f"{list(agg.hparams)}")
  values = {name: float(hparams.get(name, default)) for name, default in agg.hparams.items()}
  aggregators.check_hparams(aggregator, values)
  return Cell(aggregator, tuple(values.items()), label or describe(aggregator, values))


class Group(NamedTuple):
  """The cells of one aggregator in a batch (static: part of the compiled program's shape).

  Attributes:
    aggregator: its name.
    hparam_names: the order of its hyper-parameters.
    size: how many cells (G_g).
  """
  aggregator: str
  hparam_names: tuple[str, ...]
  size: int


@jax.tree_util.register_pytree_node_class
class CellBatch:
  """What the compiled program sees of a batch of cells: its groups and their values.

  A pytree whose leaves are the hyper-parameter values (``values[g][name]``
  f32[G_g], traced: new values reuse the compiled program) and whose static
  part is the layout (``groups``: a new layout compiles once more).
  """

  def __init__(self, groups: tuple[Group, ...], values: tuple[dict, ...]):
    self.groups = groups
    self.values = values

  def tree_flatten(self):
    return (self.values,), self.groups

  @classmethod
  def tree_unflatten(cls, groups, children):
    return cls(groups, children[0])


class Cells:
  """An ordered batch of cells (host side): labels, groups and the order of results.

  Args:
    cells: the cells, labels unique.

  Raises:
    ValueError: for no cell, a label given twice, or the same settings twice.
  """

  def __init__(self, cells: Sequence[Cell]):
    cells = tuple(cells)
    if not cells:
      raise ValueError("at least one cell is needed")
    labels = [c.label for c in cells]
    if len(set(labels)) != len(labels):
      raise ValueError(f"cell labels must be unique, got {labels}")
    settings = [(c.aggregator, c.hparams) for c in cells]
    if len(set(settings)) != len(settings):
      raise ValueError(f"a cell is given twice in {labels}")
    self.cells = cells
    names = list(dict.fromkeys(c.aggregator for c in cells))  # first-appearance order
    self.members = tuple(tuple(i for i, c in enumerate(cells) if c.aggregator == name)
                         for name in names)
    self.groups = tuple(Group(name, tuple(name_ for name_, _ in cells[idx[0]].hparams), len(idx))
                        for name, idx in zip(names, self.members))

  def __len__(self) -> int:
    return len(self.cells)

  @property
  def labels(self) -> list[str]:
    return [c.label for c in self.cells]

  def index(self, label: str) -> int:
    """Position of the cell labelled ``label`` in results (raises ValueError naming the labels)."""
    labels = self.labels
    if label not in labels:
      raise ValueError(f"no cell labelled {label!r}; cells: {labels}")
    return labels.index(label)

  def batch(self) -> CellBatch:
    """The groups and their traced values."""
    values = tuple({name: np.array([self.cells[i].hparam_dict[name] for i in idx], np.float32)
                    for name in group.hparam_names}
                   for group, idx in zip(self.groups, self.members))
    return CellBatch(self.groups, values)

  def order(self) -> np.ndarray:
    """int[G']: result row j (groups concatenated) -> position j in ``cells`` is ``order()[j]``;
    ``np.argsort(order())`` puts group-concatenated results back in cell order."""
    return np.concatenate(self.members)

  def hparam_table(self) -> dict[str, np.ndarray]:
    """``{name: f64[G']}`` of every hyper-parameter of any cell, NaN where a cell has none."""
    names = list(dict.fromkeys(n for c in self.cells for n, _ in c.hparams))
    return {n: np.array([c.hparam_dict.get(n, np.nan) for c in self.cells]) for n in names}


def grid(aggregator: str, base_label: str = "FedAvg", **values: Sequence[float]) -> Cells:
  """The product grid of ``aggregator``'s hyper-parameters (first name slowest), then the base cell.

  ``grid("fedia", rho=[0.1, 0.5], beta=[0.3])`` gives FedIA (0.1, 0.3), (0.5,
  0.3) and FedAvg.

  Raises:
    ValueError: for an empty list, a value given twice, or a bad value.
  """
  import itertools

  for name, vs in values.items():
    if not len(vs):
      raise ValueError(f"{name} = []; give at least one value")
    if len(set(vs)) != len(vs):
      raise ValueError(f"{name} = {list(vs)}; a value is given twice")
  names = list(values)
  combos = itertools.product(*(values[n] for n in names))
  return Cells([cell(aggregator, **dict(zip(names, combo))) for combo in combos]
               + [cell(BASE, label=base_label)])
