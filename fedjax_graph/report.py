"""Host-side reporting for grid sweeps: a base method against aggregator cells.

A sweep runs a base method (e.g. FedAvg) and G cells of one method (e.g.
FedAvg+FedIA, FedAvg+GMA) that differ in named hyper-parameters (FedIA: rho,
beta; GMA: tau; FedHEAL: tau, beta). This module turns the per-round arrays
produced by the simulator into summary rows, a CSV, a terminal table, a ΔAVG
heatmap over the cells' hyper-parameters, learning curves, warnings about runs
that end at a constant prediction, and atomic ``.npz`` / JSON artefacts. The
statistics themselves are ``fedjax_graph.analysis``'s. Works on numpy arrays
only: this module deliberately does not import jax so it can run on machines
without an accelerator stack (e.g. to re-plot saved histories).

Shape legend used in docstrings (``fedjax_graph/types.py``):
  G: grid cells (hyper-parameter combinations, e.g. ρ×β row-major),
  S: seeds, T: rounds, D: domains.

Accuracies come in as fractions in [0, 1] and are reported in percent.
Diverged runs carry NaN; NaN is propagated on purpose so a non-converged cell
is visible as such rather than silently averaged away.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any, NamedTuple

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from fedjax_graph import analysis
from fedjax_graph.io import atomic_write as _atomic_write

Row = dict[str, Any]

FEDAVG = "fedavg"
FEDIA = "fedavg+fedia"
AVG = "avg"
METRICS = ("", "_bacc", "_f1")  # column infixes: accuracy, balanced accuracy, macro-F1
# Display names of the parts of a method (``aggregators.DISPLAY``, which this jax-free module cannot
# import; a test keeps them equal) and symbols of hyper-parameters; other names show as they are.
DISPLAY_NAMES = {"fedavg": "FedAvg", "fedia": "FedIA", "fedia_im": "FedIA-IM",
                 "fedia_cam": "FedIA-CAM", "gma": "GMA", "fedheal": "FedHEAL"}
SYMBOLS = {"rho": "ρ", "beta": "β", "tau": "τ"}
SCIENTIFIC_COLUMNS = ("train_loss_slope",)  # 4 decimals would print 0.0000
MIN_COLOR_LIMIT = 0.5  # Accuracy points; smallest |ΔAVG| colour-scale limit.


class Runs(NamedTuple):
  """Per-round arrays of the base method (leading [S]) or of all grid cells (leading [G, S]).

  Attributes:
    acc: float [(G,) S, T, D] test accuracy fractions.
    bacc: float [(G,) S, T, D] test balanced accuracy (mean recall over the
      domain's classes) fractions.
    f1: float [(G,) S, T, D] test macro-F1 fractions.
    predicted_classes: int [(G,) S, T, D] distinct classes predicted on each
      domain's test nodes.
    train_loss: float [(G,) S, T] mean over clients of the training loss.
  """
  acc: np.ndarray
  bacc: np.ndarray
  f1: np.ndarray
  predicted_classes: np.ndarray
  train_loss: np.ndarray


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _check_inputs(base: Runs, cells: Runs, hparams: Mapping[str, np.ndarray],
                  domains: Sequence[str]) -> None:
  """Checks that the simulator outputs agree with each other.

  Args:
    base: the base method's arrays, [S, T, D] (train_loss [S, T]).
    cells: the cells' arrays, [G, S, T, D] (train_loss [G, S, T]).
    hparams: name -> float [G] hyper-parameter values of the cells.
    domains: D names.

  Raises:
    ValueError: On any rank/shape disagreement, unusable domain names or
      hyper-parameter names that would clash with a summary column.
  """
  if base.acc.ndim != 3:
    raise ValueError(f"base.acc must be [S, T, D], got shape {base.acc.shape}")
  if cells.acc.ndim != 4:
    raise ValueError(f"cells.acc must be [G, S, T, D], got shape {cells.acc.shape}")
  if cells.acc.shape[1:] != base.acc.shape:
    raise ValueError(
        f"cells.acc shape {cells.acc.shape} does not match base.acc shape "
        f"{base.acc.shape} on [S, T, D]")
  for runs, name in ((base, "base"), (cells, "cells")):
    for field in Runs._fields[1:]:
      want = runs.acc.shape[:-1] if field == "train_loss" else runs.acc.shape
      if getattr(runs, field).shape != want:
        raise ValueError(f"{name}.{field} has shape {getattr(runs, field).shape}; "
                         f"expected {want} like {name}.acc")
  num_cells = cells.acc.shape[0]
  for name, values in hparams.items():
    if values.shape != (num_cells,):
      raise ValueError(f"hyper-parameter {name!r} has shape {values.shape}; "
                       f"expected (G,)=({num_cells},)")
  if len(domains) != base.acc.shape[2]:
    raise ValueError(
        f"got {len(domains)} domain names {list(domains)} but D="
        f"{base.acc.shape[2]}")
  names = [str(d) for d in domains]
  # Duplicates or a domain called "avg" would silently overwrite columns.
  if len(set(names)) != len(names) or AVG in names:
    raise ValueError(
        f"domain names {names} must be unique and must not be {AVG!r}")
  # A hyper-parameter column must neither overwrite a statistic nor end in
  # "_mean", which marks where the statistics begin (``hparam_names``).
  taken = set(summary_columns(domains, ()))
  clash = [n for n in hparams if n in taken or n.endswith("_mean")]
  if clash:
    raise ValueError(f"hyper-parameter names {clash} clash with the summary columns")
  for name, arr in (("base.acc", base.acc), ("cells.acc", cells.acc)):
    if arr.shape[0] == 0 or arr.shape[-1] == 0 or arr.shape[-2] == 0:
      raise ValueError(f"{name} has an empty axis: shape {arr.shape}")


# --------------------------------------------------------------------------
# Summary rows
# --------------------------------------------------------------------------


def summary_columns(domains: Sequence[str], hparams: Sequence[str]) -> list[str]:
  """Column names of a summary row, in CSV order (see ``summarize``).

  Args:
    domains: D domain names.
    hparams: the cells' hyper-parameter names, e.g. ``("rho", "beta")``.

  Returns:
    ``method``, then ``hparams``; ``<d>_mean, <d>_std`` per domain, then
    ``avg_mean, avg_std``; the same with ``_bacc`` and then ``_f1`` before
    ``_mean`` / ``_std``; ``std_over, delta_avg, delta_avg_ci, delta_bacc,
    constant_domains, oscillating_domains, train_loss_slope, skipped_updates``.
  """
  cols = ["method", *hparams]
  for metric in METRICS:
    for name in [str(d) for d in domains] + [AVG]:
      cols += [f"{name}{metric}_mean", f"{name}{metric}_std"]
  return cols + ["std_over", "delta_avg", "delta_avg_ci", "delta_bacc",
                 "constant_domains", "oscillating_domains", "train_loss_slope",
                 "skipped_updates"]


def hparam_names(row: Mapping[str, Any]) -> list[str]:
  """The hyper-parameter columns of a summary row, in column order.

  Args:
    row: a row from ``summarize`` (or read back from its CSV).

  Returns:
    The keys between ``method`` and the first ``<d>_mean`` column; none for a
    row that does not start with ``method``.
  """
  keys = list(row)
  if not keys or keys[0] != "method":  # not a summary row (e.g. a dissection CSV)
    return []
  keys = keys[1:]
  end = next((i for i, key in enumerate(keys) if key.endswith("_mean")), len(keys))
  return keys[:end]


def _summary_row(method: str, hparams: Mapping[str, Any], domains: Sequence[str],
                 run: Runs, base: Runs | None, last: int, skipped: int) -> Row:
  """One summary row, keys in ``summary_columns`` order.

  Args:
    method: the row's method.
    hparams: name -> the row's hyper-parameter value (``""`` on the base row).
    domains: D domain names.
    run: one method's arrays, [S, T, D] (train_loss [S, T]).
    base: the base method's arrays to pair with; None for the base row itself.
    last: Number of final rounds, already validated.
    skipped: non-finite client updates left out, over all rounds and seeds.
  """
  names = [str(d) for d in domains] + [AVG]
  row: Row = {"method": method, **hparams}
  for metric, values in zip(METRICS, (run.acc, run.bacc, run.f1)):
    mean, std, std_over = analysis.spread(values, last)
    for name, m, s in zip(names, mean, std):
      row[f"{name}{metric}_mean"], row[f"{name}{metric}_std"] = float(m), float(s)
  row["std_over"] = std_over
  if base is None:  # the base against itself: no interval to report
    row.update(delta_avg=0.0, delta_avg_ci="", delta_bacc=0.0)
  else:
    acc = analysis.paired_delta(run.acc, base.acc, last)
    bacc = analysis.paired_delta(run.bacc, base.bacc, last)
    row.update(delta_avg=float(acc.mean[-1]), delta_avg_ci=float(acc.half_width[-1]),
               delta_bacc=float(bacc.mean[-1]))
  row["constant_domains"] = int(
      analysis.constant_domains(run.predicted_classes, last).sum())
  row["oscillating_domains"] = int(analysis.oscillating_domains(run.acc, last).sum())
  row["train_loss_slope"] = float(analysis.loss_slope(run.train_loss, last).mean())
  row["skipped_updates"] = int(skipped)
  return row


def _as_runs(runs: Runs) -> Runs:
  return Runs(*(np.asarray(x, np.float64) if name != "predicted_classes"
                else np.asarray(x) for name, x in zip(Runs._fields, runs)))


def summarize(base: Runs, cells: Runs, hparams: Mapping[str, Any],
              domains: Sequence[str], last: int,
              skipped: Sequence[int] | None = None, *,
              cell_method: str = FEDIA, base_method: str = FEDAVG) -> list[Row]:
  """Summarises the final rounds of the base method and every grid cell.

  Each seed's values are averaged over the last ``last`` rounds, per domain
  and for AVG (unweighted mean over domains); statistics are
  ``analysis.spread`` and ``analysis.paired_delta``. Columns, in order
  (percent unless said otherwise; NaN from diverged runs propagates):

  * ``method``: ``base_method`` or ``cell_method``; then one column per
    hyper-parameter, in ``hparams`` order: the cell's value as a Python
    float (``""`` on the base row).
  * ``<d>_mean``, ``<d>_std`` per domain, then ``avg_mean``, ``avg_std``:
    test accuracy, mean over seeds of the per-seed final-rounds means; std:
    population std (ddof=0) over seeds of those means when S >= 2, else
    over the final rounds of the single seed.
  * ``<d>_bacc_mean`` ... ``avg_bacc_std``: the same for balanced accuracy;
    ``<d>_f1_mean`` ... ``avg_f1_std``: for macro-F1.
  * ``std_over``: ``seeds`` or ``rounds``, what the stds are taken over.
  * ``delta_avg``: AVG accuracy minus the base's (points), the mean over
    seeds of the paired per-seed differences; 0 on the base row.
  * ``delta_avg_ci``: half-width (points) of the paired 95 % t-interval of
    ``delta_avg`` over seeds; NaN with one seed, ``""`` on the base row.
  * ``delta_bacc``: AVG balanced accuracy minus the base's (points).
  * ``constant_domains``: number of (seed, domain) pairs whose model predicts
    at most one class on the domain's test nodes in every final round.
  * ``oscillating_domains``: number of (seed, domain) pairs whose accuracy
    changes by more than ``analysis.OSCILLATION_POINTS`` points from one
    final round to the next on average (near-constant models taking turns,
    which ``constant_domains`` does not count).
  * ``train_loss_slope``: mean over seeds of the least-squares slope of the
    training loss over the final rounds (loss per round; > 0: rising).
  * ``skipped_updates``: non-finite client updates left out, all rounds and
    seeds.

  Args:
    base: the base method's arrays, [S, T, D] (train_loss [S, T]).
    cells: the cells' arrays, [G, S, T, D] (train_loss [G, S, T]), seed s
      paired with the base's seed s.
    hparams: name -> float [G] the cells' hyper-parameters, e.g.
      ``{"rho": rho, "beta": beta}`` (FedIA) or ``{"tau": tau}`` (GMA);
      may be empty.
    domains: D domain names.
    last: Number of final rounds summarised, 1 <= last <= T.
    skipped: int [1 + G] non-finite client updates left out per method (the
      base first, then the cells), over all rounds and seeds; zeros if None.
    cell_method: the cells' ``method`` value.
    base_method: the base row's ``method`` value; must differ from
      ``cell_method`` (rows are told apart by it).

  Returns:
    1 + G rows (the base first, then cells in input order), each a dict with
    keys ``summary_columns(domains, list(hparams))`` in order.

  Raises:
    ValueError: If ``last`` is outside [1, T] (message names the value),
      the shapes disagree, a hyper-parameter name clashes with a column or
      the two methods are equal.
  """
  if cell_method == base_method:
    raise ValueError(f"cell_method and base_method are both {base_method!r}")
  base, cells = _as_runs(base), _as_runs(cells)
  hparams = {str(name): np.asarray(values, np.float64).reshape(-1)
             for name, values in hparams.items()}
  _check_inputs(base, cells, hparams, domains)
  last = analysis.check_last(last, base.acc.shape[1])

  num_cells = cells.acc.shape[0]
  skipped = np.zeros(1 + num_cells, int) if skipped is None else np.asarray(skipped)
  if skipped.shape != (1 + num_cells,):
    raise ValueError(f"skipped has shape {skipped.shape}; expected ({1 + num_cells},)")

  rows = [_summary_row(base_method, dict.fromkeys(hparams, ""), domains, base, None, last,
                       skipped[0])]
  for g in range(num_cells):
    rows.append(_summary_row(cell_method, {n: float(v[g]) for n, v in hparams.items()},
                             domains, Runs(*(x[g] for x in cells)), base, last,
                             skipped[1 + g]))
  return rows


def degenerate_warnings(base: Runs, cells: Runs, labels: Sequence[str],
                        domains: Sequence[str], last: int,
                        seeds: Sequence[int] | None = None,
                        base_label: str = "FedAvg") -> list[str]:
  """One line per (seed, run) that ends constant or oscillating on some domain.

  E.g. ``seed 0, FedIA ρ=0.3, β=0.5: constant prediction on EN, ES through
  the last 20 rounds`` or ``...: accuracy swings by > 10 points per round on
  DE through the last 20 rounds`` (``analysis.constant_domains``,
  ``analysis.oscillating_domains``). Such a domain's final-rounds accuracy is
  a class share, or the mean of two, not a measure of aggregation.

  Args:
    base, cells, domains, last: as for ``summarize``.
    labels: G names of the cells, e.g. ``"GMA " + format_hparams({"tau": 0.1})``.
    seeds: S seed values to name; None: the seed indices 0..S-1.
    base_label: the base method's name.

  Returns:
    The lines, seed by seed, the base before the cells in input order; empty
    when no run ends constant or oscillating.

  Raises:
    ValueError: If there is not one label per cell.
  """
  classes = [np.asarray(base.predicted_classes)] + list(np.asarray(cells.predicted_classes))
  acc = [np.asarray(base.acc)] + list(np.asarray(cells.acc))
  if len(labels) != len(classes) - 1:
    raise ValueError(f"got {len(labels)} labels for G={len(classes) - 1} cells")
  # [S, 1+G, D] each
  constant = np.stack([analysis.constant_domains(c, last) for c in classes], axis=1)
  oscillating = np.stack([analysis.oscillating_domains(a, last) for a in acc], axis=1)
  seeds = range(constant.shape[0]) if seeds is None else seeds
  names = np.asarray([str(d) for d in domains])
  lines = []
  for s, seed in enumerate(seeds):
    for g, label in enumerate([base_label, *labels]):
      parts = [f"{what} on {', '.join(names[flags])}" for what, flags in (
          ("constant prediction", constant[s, g]),
          (f"accuracy swings by > {analysis.OSCILLATION_POINTS:g} points per round",
           oscillating[s, g])) if flags.any()]
      if parts:
        lines.append(f"seed {seed}, {label}: {'; '.join(parts)} through the last {last} rounds")
  return lines


# --------------------------------------------------------------------------
# Atomic file writing
# --------------------------------------------------------------------------


def _format_cell(column: str, value: Any, exact: Sequence[str]) -> Any:
  """Formats one CSV value.

  Metrics get 4 decimals (NaN as ``nan``), the loss slope 5 significant
  digits. Hyper-parameters keep their shortest exact repr: 4 decimals would
  collapse e.g. 1e-5 to 0.0000 and break round trips.

  Args:
    column: Column name.
    value: Raw value.
    exact: the columns written with their exact repr.

  Returns:
    The value to hand to ``csv.writer``.
  """
  if isinstance(value, (float, np.floating)):
    value = float(value)
    if math.isnan(value):
      return "nan"
    if column in exact:
      return repr(value)
    if column in SCIENTIFIC_COLUMNS:
      return f"{value:.4e}"
    return f"{value:.4f}"
  return value


def write_summary_csv(rows: Sequence[Mapping[str, Any]],
                      path: str | os.PathLike) -> None:
  """Atomically writes summary rows as CSV.

  Columns follow the key order of the first row. Floats are written with 4
  decimals and NaN as ``nan``; the hyper-parameter columns (``hparam_names``)
  keep their exact repr.

  Args:
    rows: Rows as returned by ``summarize``.
    path: Destination ``.csv`` path.

  Raises:
    ValueError: If ``rows`` is empty (there would be no header).
  """
  if not rows:
    raise ValueError("no rows to write")
  fields = list(rows[0].keys())
  exact = hparam_names(rows[0])

  def write(f: IO) -> None:
    writer = csv.writer(f)
    writer.writerow(fields)
    for row in rows:
      writer.writerow([_format_cell(c, row[c], exact) for c in fields])

  _atomic_write(path, write, binary=False)


def write_history(path: str | os.PathLike, /, **arrays: Any) -> None:
  """Atomically saves arrays with ``np.savez``.

  The file is written to exactly ``path`` (numpy's automatic ``.npz``
  suffix is bypassed by writing through a file object).

  Args:
    path: Destination, conventionally ``*.npz``.
    **arrays: Named arrays, e.g. ``fedia_test=[G, S, T, D]``.
  """
  _atomic_write(path, lambda f: np.savez(f, **arrays), binary=True)


def write_text(path: str | os.PathLike, text: str) -> None:
  """Atomically writes ``text`` (UTF-8) to ``path``."""
  _atomic_write(path, lambda f: f.write(text), binary=False)


def _json_default(obj: Any) -> Any:
  """Converts numpy values that ``json`` cannot serialise natively."""
  if isinstance(obj, np.ndarray):
    return obj.tolist()
  if isinstance(obj, np.generic):
    return obj.item()
  raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Atomically writes ``obj`` as JSON with sorted keys and indent 2.

  Numpy scalars/arrays are converted to Python values. NaN is written as
  ``NaN`` (Python's ``json`` default), which ``json.load`` reads back.

  Args:
    path: Destination ``.json`` path.
    obj: JSON-serialisable object.

  Raises:
    TypeError: If ``obj`` is not serialisable; nothing is written then.
  """
  # Serialise before opening anything so a bad object never touches disk.
  text = json.dumps(obj, sort_keys=True, indent=2, default=_json_default)
  _atomic_write(path, lambda f: f.write(text + "\n"), binary=False)


def save_figure(fig: Figure, path: str | os.PathLike) -> None:
  """Atomically saves a figure; the format follows ``path``'s suffix.

  Args:
    fig: Figure to render.
    path: Destination, e.g. ``*.png``.
  """
  fmt = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
  _atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=150,
                                            bbox_inches="tight"),
                binary=True)


# --------------------------------------------------------------------------
# Selection and text table
# --------------------------------------------------------------------------


def _cell_rows(rows: Sequence[Row], base_method: str) -> list[Row]:
  """Returns the grid-cell rows (method other than ``base_method``), in input order."""
  return [r for r in rows if r["method"] != base_method]


def _base_row(rows: Sequence[Row], base_method: str) -> Row | None:
  """The base method's row, or None if ``rows`` have none."""
  return next((r for r in rows if r["method"] == base_method), None)


def _best_cell_index(rows: Sequence[Row], key: str, base_method: str) -> int:
  """Index into ``_cell_rows(rows, base_method)`` of the cell maximising ``key``.

  Args:
    rows: Summary rows.
    key: Numeric column to maximise; NaN cells are ignored.
    base_method: the base row's method.

  Returns:
    The index; ties go to the first cell in row order.

  Raises:
    ValueError: If there is no grid cell with a finite ``key``.
  """
  cells = _cell_rows(rows, base_method)
  values = np.array([float(r[key]) for r in cells], dtype=np.float64)
  if not np.isfinite(values).any():
    raise ValueError(
        f"no grid cell with a finite {key!r} among {len(cells)} cells")
  return int(np.argmax(np.where(np.isfinite(values), values, -np.inf)))


def best_cell(rows: Sequence[Row], key: str = "avg_mean", *,
              base_method: str = FEDAVG) -> Row:
  """The grid cell with the highest ``key``.

  The base row is never returned; non-converged (NaN) cells are skipped.

  Args:
    rows: Summary rows from ``summarize``.
    key: Numeric column to maximise.
    base_method: the base row's method (as passed to ``summarize``).

  Returns:
    The winning row (the same dict object as in ``rows``).

  Raises:
    ValueError: If no cell has a finite ``key``.
  """
  return _cell_rows(rows, base_method)[_best_cell_index(rows, key, base_method)]


def _domain_names(row: Row) -> list[str]:
  """Domain names encoded in a row's accuracy ``<d>_mean`` keys, in column order."""
  names = []
  for key in row:  # the accuracy block comes first and ends at avg_mean
    if key == f"{AVG}_mean":
      return names
    if key.endswith("_mean"):
      names.append(key[:-len("_mean")])
  return names


def display_name(method: str) -> str:
  """A method as printed, e.g. ``fedavg+gma`` -> ``FedAvg+GMA`` (``DISPLAY_NAMES``)."""
  return "+".join(DISPLAY_NAMES.get(part, part) for part in method.split("+"))


def _symbol(name: str) -> str:
  """A hyper-parameter's symbol (``SYMBOLS``), else its name."""
  return SYMBOLS.get(name, name)


def _fmt_hparam(value: Any) -> str:
  """Short text for a hyper-parameter value; empty on the base row."""
  return "" if value == "" else f"{float(value):g}"


def format_hparams(values: Mapping[str, Any]) -> str:
  """Hyper-parameters as printed, e.g. ``{"rho": 0.3, "beta": 0.5}`` -> ``ρ=0.3, β=0.5``."""
  return ", ".join(f"{_symbol(name)}={_fmt_hparam(v)}" for name, v in values.items())


def _fmt_pct(value: float, spec: str = ".2f") -> str:
  """Percent value for the table; NaN as "nan" (never "+nan")."""
  return "nan" if math.isnan(value) else format(value, spec)


def format_table(rows: Sequence[Row], max_rows: int | None = None, *,
                 base_method: str = FEDAVG) -> str:
  """Formats summary rows as an aligned text table for a terminal.

  Columns: method, the hyper-parameters (by symbol, e.g. ρ, β), each domain
  mean, AVG mean±std, ΔAVG, all in percent with 2 decimals. A footnote says
  what the ± std is taken over.

  Args:
    rows: Summary rows from ``summarize``.
    max_rows: If given, show only the best ``max_rows`` grid cells ranked by
      ``avg_mean`` (NaN last); the base row is always shown first. If None,
      all rows are shown in input order.
    base_method: the base row's method (as passed to ``summarize``).

  Returns:
    The table as a multi-line string (no trailing newline).
  """
  if not rows:
    return "(no rows)"
  domains = _domain_names(rows[0])
  names = hparam_names(rows[0])
  shown = list(rows)
  hidden = 0
  if max_rows is not None:
    cells = _cell_rows(rows, base_method)
    # NaN ranks after every finite value; sorted() is stable for ties.
    ranked = sorted(cells, key=lambda r: -r["avg_mean"]
                    if math.isfinite(r["avg_mean"]) else math.inf)
    keep = ranked[:max(0, max_rows)]
    hidden = len(cells) - len(keep)
    shown = [r for r in rows if r["method"] == base_method] + keep

  header = ["method"] + [_symbol(n) for n in names] + domains + ["AVG", "ΔAVG"]
  body = []
  for r in shown:
    body.append([r["method"]] + [_fmt_hparam(r[n]) for n in names] +
                [_fmt_pct(r[f"{d}_mean"]) for d in domains] +
                [f"{_fmt_pct(r['avg_mean'])}±{_fmt_pct(r['avg_std'])}",
                 _fmt_pct(r["delta_avg"], "+.2f")])
  widths = [max(len(line[i]) for line in [header] + body)
            for i in range(len(header))]

  def render(cells: list[str]) -> str:
    # Method left-aligned, numbers right-aligned so decimals line up.
    parts = [cells[0].ljust(widths[0])]
    parts += [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
    return "  ".join(parts).rstrip()

  lines = [render(header), "  ".join("-" * w for w in widths)]
  lines += [render(line) for line in body]
  if hidden:
    lines.append(f"... {hidden} more cell(s) not shown")
  over = sorted({str(r["std_over"]) for r in shown})
  lines.append(f"accuracy in %; ± = population std (ddof=0) over "
               f"{'/'.join(over)}; ΔAVG = AVG - {display_name(base_method)} AVG (points)")
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------


def _new_figure(width: float, height: float) -> tuple[Figure, Any]:
  """A standalone Agg figure and axes, bypassing pyplot's global state."""
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig, fig.add_subplot(1, 1, 1)


class DeltaGrid(NamedTuple):
  """The cells' ΔAVG over their hyper-parameters, as ``plot_heatmap`` draws and marks it.

  The rows are the cells' first hyper-parameter, the columns their second;
  with one hyper-parameter there is one row (R = 1) and it is the columns'.

  Attributes:
    row_values: float [R] sorted unique values of the first hyper-parameter
      ([0] with one hyper-parameter).
    col_values: float [B] sorted unique values of the columns' one.
    delta: float [R, B] ΔAVG (points); NaN where non-converged or missing.
    present: bool [R, B] whether a row exists for that combination.
    significant: bool [R, B] the paired 95 % interval of ΔAVG excludes 0
      (marked ``*``); never with one seed.
    constant: bool [R, B] some (seed, domain) of the cell ends at a
      constant prediction (marked ``c``).
    oscillating: bool [R, B] some (seed, domain) of the cell oscillates
      (``summarize``'s ``oscillating_domains``; marked ``o``).
    row_name: the rows' hyper-parameter, e.g. ``rho``; None with one.
    col_name: the columns' hyper-parameter, e.g. ``beta`` or ``tau``.
  """
  row_values: np.ndarray
  col_values: np.ndarray
  delta: np.ndarray
  present: np.ndarray
  significant: np.ndarray
  constant: np.ndarray
  oscillating: np.ndarray
  row_name: str | None
  col_name: str


def _grid_index(grid: DeltaGrid, row: Row) -> tuple[int, int]:
  """(row, column) of a cell's row on the grid."""
  i = int(np.searchsorted(grid.row_values, float(row[grid.row_name]))) if grid.row_name else 0
  return i, int(np.searchsorted(grid.col_values, float(row[grid.col_name])))


def _delta_grid(cells: Sequence[Row], names: Sequence[str]) -> DeltaGrid:
  """Lays the grid-cell rows out over their one or two hyper-parameters (see ``DeltaGrid``)."""
  row_name, col_name = (None, *names) if len(names) == 1 else names
  values = lambda name: np.unique([float(r[name]) for r in cells])
  row_values = values(row_name) if row_name else np.zeros(0)
  col_values = values(col_name)
  shape = (max(row_values.size, 1), col_values.size)
  grid = DeltaGrid(row_values, col_values, np.full(shape, np.nan),
                   *np.zeros((4, *shape), dtype=bool), row_name, col_name)
  for r in cells:
    i, j = _grid_index(grid, r)
    grid.delta[i, j] = float(r["delta_avg"])
    grid.present[i, j] = True
    # A NaN half-width (one seed) compares False: no mark.
    grid.significant[i, j] = abs(float(r["delta_avg"])) > float(r["delta_avg_ci"])
    grid.constant[i, j] = r["constant_domains"] > 0
    grid.oscillating[i, j] = r["oscillating_domains"] > 0
  return grid


def _constant_note(row: Row | None) -> str:
  count = row["constant_domains"] if row is not None else 0
  return f"constant on {count} (seed, domain) pair(s)" if count else ""


def plot_heatmap(rows: Sequence[Row], path: str | os.PathLike,
                 title: str = "", base_label: str = "FedAvg", *,
                 base_method: str = FEDAVG, boxed: Row | None = None,
                 boxed_by: str = "best test AVG, optimistic") -> DeltaGrid:
  """Atomically plots ΔAVG (each cell minus the base) over the cells' hyper-parameters.

  The first hyper-parameter runs down the rows, the second across the
  columns (ρ×β for FedIA); with one (e.g. GMA's τ) the cells form one row.
  The colormap is diverging and symmetric around 0 so gains and losses read
  alike. Non-converged (NaN) cells are grey and marked "NC"; combinations
  absent from a partial grid are left white and marked "n/a". The best cell
  by ``avg_mean`` (or ``boxed``) is boxed. A ``*`` follows a ΔAVG whose paired 95 %
  interval over seeds excludes 0 (none with one seed, which the title
  says); a ``c`` marks a cell that ends at a constant prediction on some
  (seed, domain), whose ΔAVG is partly a class share.

  Args:
    rows: Summary rows from ``summarize`` (at least one grid cell, all of
      one method).
    path: Destination image path, e.g. ``*.png``.
    title: Dataset/setting shown in the title.
    base_label: what the cells are compared with (the base row), e.g.
      ``FedProx`` for a table.py sweep of FedProx+FedIA.
    base_method: the base row's method (as passed to ``summarize``).
    boxed: the cell row to box instead of the best test one, e.g. the one a
      table reports (chosen on validation); ``boxed_by`` says why, in the title.

  Returns:
    The grid as drawn, marks included.

  Raises:
    ValueError: If ``rows`` has no grid cell, cells of several methods, or
      cells with no or more than two hyper-parameters.
  """
  cells = _cell_rows(rows, base_method)
  if not cells:
    raise ValueError(f"rows contain no grid cell (a method other than {base_method!r}) to plot")
  methods = sorted({r["method"] for r in cells})
  if len(methods) != 1:
    raise ValueError(f"a heatmap shows the cells of one method; got {methods}")
  names = hparam_names(cells[0])
  if len(names) not in (1, 2):
    raise ValueError(f"a heatmap needs cells with one or two hyper-parameters; got {names}")
  grid = _delta_grid(cells, names)
  delta, present = grid.delta, grid.present
  finite = np.isfinite(delta)
  lim = float(np.abs(delta[finite]).max()) if finite.any() else 0.0
  # The floor keeps noise-level deltas (and all-zero grids, which would give
  # a zero-width norm) from being painted at full saturation.
  lim = max(lim, MIN_COLOR_LIMIT)
  cmap = colormaps["RdBu"].with_extremes(bad="lightgrey")
  norm = Normalize(vmin=-lim, vmax=lim)

  fig, ax = _new_figure(max(4.5, 1.1 * delta.shape[1] + 3.0),
                        max(3.5, 0.8 * delta.shape[0] + 2.2))
  image = ax.imshow(np.ma.masked_invalid(delta), cmap=cmap, norm=norm,
                    aspect="auto", origin="lower")
  for i, j in np.ndindex(delta.shape):
    if not present[i, j]:
      ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                             edgecolor="none"))
      text, color = "n/a", "grey"
    elif not finite[i, j]:
      text, color = "NC", "black"
    else:
      text = (f"{delta[i, j]:+.2f}" + ("*" if grid.significant[i, j] else "")
              + (" c" if grid.constant[i, j] else "") + (" o" if grid.oscillating[i, j] else ""))
      # White text only where the fill is dark enough to need it.
      color = "white" if abs(delta[i, j]) > 0.6 * lim else "black"
    ax.text(j, i, text, ha="center", va="center", color=color, fontsize=9)

  best_note = "no converged cell"
  if any(np.isfinite(float(r["avg_mean"])) for r in cells):
    best = boxed or best_cell(rows, base_method=base_method)
    i, j = _grid_index(grid, best)
    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                           edgecolor="black", linewidth=2.5))
    best_note = (f"boxed ({boxed_by}): {format_hparams({n: best[n] for n in names})}, "
                 f"ΔAVG={best['delta_avg']:+.2f}")
  one_seed = all(r["std_over"] == "rounds" for r in rows)
  notes = ["1 seed: no interval, no * marks" if one_seed
           else "* paired 95 % interval over seeds excludes 0"]
  if grid.constant.any():
    notes.append("c: constant prediction on some (seed, domain)")
  if grid.oscillating.any():
    notes.append(f"o: accuracy swings > {analysis.OSCILLATION_POINTS:g} points per round on some "
                 "(seed, domain)")
  base_note = _constant_note(_base_row(rows, base_method))
  if base_note:
    notes.append(f"{base_label} {base_note}")

  ax.set_xticks(range(grid.col_values.size), [f"{v:g}" for v in grid.col_values])
  ax.set_xlabel(_symbol(grid.col_name))
  if grid.row_name:
    ax.set_yticks(range(grid.row_values.size), [f"{v:g}" for v in grid.row_values])
    ax.set_ylabel(_symbol(grid.row_name))
  else:
    ax.set_yticks([])
  head = f"{title}: " if title else ""
  cell_label = display_name(methods[0].split("+")[-1])
  ax.set_title(f"{head}{base_label}+{cell_label} ΔAVG over "
               f"{'×'.join(_symbol(n) for n in names)}\n{best_note}\n"
               + "; ".join(notes), fontsize=10)
  fig.colorbar(image, ax=ax, label=f"ΔAVG vs {base_label} (accuracy points, %)")
  save_figure(fig, path)
  return grid


def _avg_curve(acc: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
  """Per-round AVG accuracy across seeds.

  Args:
    acc: float [S, T, D] accuracy fractions.

  Returns:
    mean: float [T] percent, mean over seeds of the per-round domain mean.
    std: float [T] population std across seeds, or None when S == 1.
  """
  avg = 100.0 * np.asarray(acc, dtype=np.float64).mean(axis=-1)  # [S, T]
  std = avg.std(axis=0, ddof=0) if avg.shape[0] >= 2 else None
  return avg.mean(axis=0), std


def plot_curves(base_acc: np.ndarray, cells_acc: np.ndarray,
                rows: Sequence[Row], path: str | os.PathLike, title: str,
                *, last: int | None = None, base_method: str = FEDAVG,
                evaluated: np.ndarray | None = None) -> list[str]:
  """Atomically plots AVG accuracy per round: the base method vs the best grid cell.

  The best cell is chosen by ``avg_mean`` in ``rows``. Lines are means over
  seeds; with S >= 2 a band shows ±1 population std across seeds. Each line
  is labelled with its method's ``display_name``, the best cell's with its
  hyper-parameters too (e.g. ``FedAvg+GMA (τ=0.1)``). A run that ends at a
  constant prediction on some (seed, domain) says so in its legend entry
  (``constant_domains`` of its row).

  Args:
    base_acc: float [S, T, D] the base method's accuracy fractions.
    cells_acc: float [G, S, T, D] the cells' accuracy fractions, in the same
      order as the grid-cell rows of ``rows``.
    rows: Summary rows from ``summarize`` on these arrays.
    path: Destination image path, e.g. ``*.png``.
    title: Dataset/setting shown as the title.
    last: Number of final rounds that ``summarize`` used; when given, that
      span is shaded. (Rows do not record it, hence the argument.)
    base_method: the base row's method (as passed to ``summarize``).
    evaluated: bool [T], the rounds evaluated (``--eval-every``); only they
      are plotted, with a marker on each when some are left out. None:
      every round.

  Returns:
    The legend labels of the base and best-cell lines.

  Raises:
    ValueError: On shape mismatch, ``last`` out of range, ``evaluated`` not
      [T], or no converged cell to plot.
  """
  base_acc = np.asarray(base_acc, dtype=np.float64)
  cells_acc = np.asarray(cells_acc, dtype=np.float64)
  if base_acc.ndim != 3 or cells_acc.ndim != 4 or cells_acc.shape[1:] != base_acc.shape:
    raise ValueError(f"expected base_acc [S, T, D] and cells_acc [G, S, T, D], got "
                     f"{base_acc.shape} and {cells_acc.shape}")
  cells = _cell_rows(rows, base_method)
  if len(cells) != cells_acc.shape[0]:
    raise ValueError(f"rows have {len(cells)} grid cells but cells_acc has "
                     f"G={cells_acc.shape[0]}")
  num_rounds = base_acc.shape[1]
  g = _best_cell_index(rows, "avg_mean", base_method)
  best = cells[g]
  rounds = np.arange(1, num_rounds + 1)
  shown = np.ones(num_rounds, bool) if evaluated is None else np.asarray(evaluated, bool)
  if shown.shape != (num_rounds,):
    raise ValueError(f"evaluated has shape {shown.shape}; expected (T,)=({num_rounds},)")
  marker = None if shown.all() else "o"

  fig, ax = _new_figure(7.0, 4.2)
  if last is not None:
    last = analysis.check_last(last, num_rounds)
    ax.axvspan(num_rounds - last + 0.5, num_rounds + 0.5, color="grey",
               alpha=0.15, label=f"last {last} rounds (summarised)")
  hparams = format_hparams({n: best[n] for n in hparam_names(best)})
  label_best = display_name(best["method"]) + (f" ({hparams})" if hparams else "")
  labels = []
  for acc, label, row, color in (
      (base_acc, display_name(base_method), _base_row(rows, base_method), "tab:blue"),
      (cells_acc[g], label_best, best, "tab:orange")):
    note = _constant_note(row)
    labels.append(f"{label}: {note}" if note else label)
    mean, std = _avg_curve(acc[:, shown])
    ax.plot(rounds[shown], mean, color=color, linewidth=1.6, marker=marker, markersize=3,
            label=labels[-1])
    if std is not None:
      ax.fill_between(rounds[shown], mean - std, mean + std, color=color, alpha=0.2,
                      linewidth=0)
  num_seeds = base_acc.shape[0]
  spread = f"mean ± 1 std over {num_seeds} seeds" if num_seeds >= 2 \
      else "single seed"
  ax.set_xlabel("Communication round")
  ax.set_ylabel("AVG test accuracy (%)")
  ax.set_xlim(0.5, num_rounds + 0.5)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
  if marker:
    spread += f", {int(shown.sum())} of {num_rounds} rounds evaluated"
  ax.set_title(f"{title}\nAVG over domains, {spread}" if title
               else f"AVG over domains, {spread}", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(loc="best", fontsize=9)
  save_figure(fig, path)
  return labels
