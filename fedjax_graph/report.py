"""Host-side reporting for FedAvg vs FedAvg+FedIA grid sweeps.

Turns the per-round arrays produced by the simulator into summary rows, a CSV,
a terminal table, a ΔAVG heatmap over the ρ×β grid, learning curves, warnings
about runs that end at a constant prediction, and atomic ``.npz`` / JSON
artefacts. The statistics themselves are ``fedjax_graph.analysis``'s. Works on
numpy arrays only: this module deliberately does not import jax so it can run
on machines without an accelerator stack (e.g. to re-plot saved histories).

Shape legend used in docstrings (``fedjax_graph/types.py``):
  G: grid cells (ρ×β combinations, row-major), S: seeds, T: rounds,
  D: domains.

Accuracies come in as fractions in [0, 1] and are reported in percent.
Diverged runs carry NaN; NaN is propagated on purpose so a non-converged cell
is visible as such rather than silently averaged away.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NamedTuple

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fedjax_graph import analysis

Row = dict[str, Any]

FEDAVG = "fedavg"
FEDIA = "fedavg+fedia"
AVG = "avg"
METRICS = ("", "_bacc", "_f1")  # column infixes: accuracy, balanced accuracy, macro-F1
HYPERPARAM_COLUMNS = ("rho", "beta")
SCIENTIFIC_COLUMNS = ("train_loss_slope",)  # 4 decimals would print 0.0000
MIN_COLOR_LIMIT = 0.5  # Accuracy points; smallest |ΔAVG| colour-scale limit.


class Runs(NamedTuple):
  """Per-round arrays of FedAvg (leading [S]) or of all grid cells (leading [G, S]).

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


def _check_inputs(fedavg: Runs, fedia: Runs, rho: np.ndarray,
                  beta: np.ndarray, domains: Sequence[str]) -> None:
  """Checks that the simulator outputs agree with each other.

  Args:
    fedavg: FedAvg's arrays, [S, T, D] (train_loss [S, T]).
    fedia: the cells' arrays, [G, S, T, D] (train_loss [G, S, T]).
    rho: float [G].
    beta: float [G].
    domains: D names.

  Raises:
    ValueError: On any rank/shape disagreement or unusable domain names.
  """
  if fedavg.acc.ndim != 3:
    raise ValueError(
        f"fedavg.acc must be [S, T, D], got shape {fedavg.acc.shape}")
  if fedia.acc.ndim != 4:
    raise ValueError(
        f"fedia.acc must be [G, S, T, D], got shape {fedia.acc.shape}")
  if fedia.acc.shape[1:] != fedavg.acc.shape:
    raise ValueError(
        f"fedia.acc shape {fedia.acc.shape} does not match fedavg.acc shape "
        f"{fedavg.acc.shape} on [S, T, D]")
  for runs, name in ((fedavg, "fedavg"), (fedia, "fedia")):
    for field in Runs._fields[1:]:
      want = runs.acc.shape[:-1] if field == "train_loss" else runs.acc.shape
      if getattr(runs, field).shape != want:
        raise ValueError(f"{name}.{field} has shape {getattr(runs, field).shape}; "
                         f"expected {want} like {name}.acc")
  num_cells = fedia.acc.shape[0]
  if rho.shape != (num_cells,) or beta.shape != (num_cells,):
    raise ValueError(
        f"rho shape {rho.shape} and beta shape {beta.shape} must both be "
        f"(G,)=({num_cells},)")
  if len(domains) != fedavg.acc.shape[2]:
    raise ValueError(
        f"got {len(domains)} domain names {list(domains)} but D="
        f"{fedavg.acc.shape[2]}")
  names = [str(d) for d in domains]
  # Duplicates or a domain called "avg" would silently overwrite columns.
  if len(set(names)) != len(names) or AVG in names:
    raise ValueError(
        f"domain names {names} must be unique and must not be {AVG!r}")
  for name, arr in (("fedavg.acc", fedavg.acc), ("fedia.acc", fedia.acc)):
    if arr.shape[0] == 0 or arr.shape[-1] == 0 or arr.shape[-2] == 0:
      raise ValueError(f"{name} has an empty axis: shape {arr.shape}")


# --------------------------------------------------------------------------
# Summary rows
# --------------------------------------------------------------------------


def summary_columns(domains: Sequence[str]) -> list[str]:
  """Column names of a summary row, in CSV order (see ``summarize``).

  Args:
    domains: D domain names.

  Returns:
    ``method, rho, beta``; ``<d>_mean, <d>_std`` per domain, then ``avg_mean,
    avg_std``; the same with ``_bacc`` and then ``_f1`` before ``_mean`` /
    ``_std``; ``std_over, delta_avg, delta_avg_ci, delta_bacc,
    constant_domains, train_loss_slope, skipped_updates``.
  """
  cols = ["method", "rho", "beta"]
  for metric in METRICS:
    for name in [str(d) for d in domains] + [AVG]:
      cols += [f"{name}{metric}_mean", f"{name}{metric}_std"]
  return cols + ["std_over", "delta_avg", "delta_avg_ci", "delta_bacc",
                 "constant_domains", "train_loss_slope", "skipped_updates"]


def _summary_row(method: str, rho: Any, beta: Any, domains: Sequence[str],
                 run: Runs, fedavg: Runs | None, last: int,
                 skipped: int) -> Row:
  """One summary row, keys in ``summary_columns`` order.

  Args:
    method, rho, beta: the row's first three values.
    domains: D domain names.
    run: one method's arrays, [S, T, D] (train_loss [S, T]).
    fedavg: FedAvg's arrays to pair with; None for FedAvg's own row.
    last: Number of final rounds, already validated.
    skipped: non-finite client updates left out, over all rounds and seeds.
  """
  names = [str(d) for d in domains] + [AVG]
  row: Row = {"method": method, "rho": rho, "beta": beta}
  for metric, values in zip(METRICS, (run.acc, run.bacc, run.f1)):
    mean, std, std_over = analysis.spread(values, last)
    for name, m, s in zip(names, mean, std):
      row[f"{name}{metric}_mean"], row[f"{name}{metric}_std"] = float(m), float(s)
  row["std_over"] = std_over
  if fedavg is None:  # FedAvg against itself: no interval to report
    row.update(delta_avg=0.0, delta_avg_ci="", delta_bacc=0.0)
  else:
    acc = analysis.paired_delta(run.acc, fedavg.acc, last)
    bacc = analysis.paired_delta(run.bacc, fedavg.bacc, last)
    row.update(delta_avg=float(acc.mean[-1]), delta_avg_ci=float(acc.half_width[-1]),
               delta_bacc=float(bacc.mean[-1]))
  row["constant_domains"] = int(
      analysis.constant_domains(run.predicted_classes, last).sum())
  row["train_loss_slope"] = float(analysis.loss_slope(run.train_loss, last).mean())
  row["skipped_updates"] = int(skipped)
  return row


def _as_runs(runs: Runs) -> Runs:
  return Runs(*(np.asarray(x, np.float64) if name != "predicted_classes"
                else np.asarray(x) for name, x in zip(Runs._fields, runs)))


def summarize(fedavg: Runs, fedia: Runs, rho: Any, beta: Any,
              domains: Sequence[str], last: int,
              skipped: Sequence[int] | None = None) -> list[Row]:
  """Summarises the final rounds of FedAvg and every FedAvg+FedIA grid cell.

  Each seed's values are averaged over the last ``last`` rounds, per domain
  and for AVG (unweighted mean over domains); statistics are
  ``analysis.spread`` and ``analysis.paired_delta``. Columns, in order
  (percent unless said otherwise; NaN from diverged runs propagates):

  * ``method``: ``fedavg`` or ``fedavg+fedia``; ``rho``, ``beta``: the cell's
    ρ and β as Python floats (``""`` for FedAvg).
  * ``<d>_mean``, ``<d>_std`` per domain, then ``avg_mean``, ``avg_std``:
    test accuracy, mean over seeds of the per-seed final-rounds means; std:
    population std (ddof=0) over seeds of those means when S >= 2, else
    over the final rounds of the single seed.
  * ``<d>_bacc_mean`` ... ``avg_bacc_std``: the same for balanced accuracy;
    ``<d>_f1_mean`` ... ``avg_f1_std``: for macro-F1.
  * ``std_over``: ``seeds`` or ``rounds``, what the stds are taken over.
  * ``delta_avg``: AVG accuracy minus FedAvg's (points), the mean over seeds
    of the paired per-seed differences; 0 on FedAvg's row.
  * ``delta_avg_ci``: half-width (points) of the paired 95 % t-interval of
    ``delta_avg`` over seeds; NaN with one seed, ``""`` on FedAvg's row.
  * ``delta_bacc``: AVG balanced accuracy minus FedAvg's (points).
  * ``constant_domains``: number of (seed, domain) pairs whose model predicts
    at most one class on the domain's test nodes in every final round.
  * ``train_loss_slope``: mean over seeds of the least-squares slope of the
    training loss over the final rounds (loss per round; > 0: rising).
  * ``skipped_updates``: non-finite client updates left out, all rounds and
    seeds.

  Args:
    fedavg: FedAvg's arrays, [S, T, D] (train_loss [S, T]).
    fedia: the FedAvg+FedIA cells' arrays, [G, S, T, D] (train_loss
      [G, S, T]), seed s paired with FedAvg's seed s.
    rho: float [G] ρ of each cell.
    beta: float [G] β of each cell.
    domains: D domain names.
    last: Number of final rounds summarised, 1 <= last <= T.
    skipped: int [1 + G] non-finite client updates left out per method (FedAvg
      first, then the cells), over all rounds and seeds; zeros if None.

  Returns:
    1 + G rows (FedAvg first, then cells in input order), each a dict with
    keys ``summary_columns(domains)`` in order.

  Raises:
    ValueError: If ``last`` is outside [1, T] (message names the value) or
      the shapes disagree.
  """
  fedavg, fedia = _as_runs(fedavg), _as_runs(fedia)
  rho = np.asarray(rho, dtype=np.float64).reshape(-1)
  beta = np.asarray(beta, dtype=np.float64).reshape(-1)
  _check_inputs(fedavg, fedia, rho, beta, domains)
  last = analysis.check_last(last, fedavg.acc.shape[1])

  num_cells = fedia.acc.shape[0]
  skipped = np.zeros(1 + num_cells, int) if skipped is None else np.asarray(skipped)
  if skipped.shape != (1 + num_cells,):
    raise ValueError(f"skipped has shape {skipped.shape}; expected ({1 + num_cells},)")

  rows = [_summary_row(FEDAVG, "", "", domains, fedavg, None, last, skipped[0])]
  for g in range(num_cells):
    cell = Runs(*(x[g] for x in fedia))
    rows.append(_summary_row(FEDIA, float(rho[g]), float(beta[g]), domains, cell,
                             fedavg, last, skipped[1 + g]))
  return rows


def constant_warnings(fedavg: Runs, fedia: Runs, rho: Any, beta: Any,
                      domains: Sequence[str], last: int,
                      seeds: Sequence[int] | None = None) -> list[str]:
  """One line per (seed, run) whose prediction ends constant on some domain.

  E.g. ``seed 0, FedIA rho=0.3, beta=0.5: constant prediction on EN, ES
  through the last 20 rounds``. Such a domain's accuracy is a class share,
  not a measure of aggregation. Only ``predicted_classes`` is read.

  Args:
    fedavg, fedia, rho, beta, domains, last: as for ``summarize``.
    seeds: S seed values to name; None: the seed indices 0..S-1.

  Returns:
    The lines, seed by seed, FedAvg before the cells in input order; empty
    when no run ends constant.
  """
  classes = [np.asarray(fedavg.predicted_classes)] + list(np.asarray(fedia.predicted_classes))
  labels = ["FedAvg"] + [f"FedIA rho={float(r):g}, beta={float(b):g}"
                         for r, b in zip(np.ravel(rho), np.ravel(beta))]
  constant = np.stack([analysis.constant_domains(c, last) for c in classes], axis=1)  # [S, 1+G, D]
  seeds = range(constant.shape[0]) if seeds is None else seeds
  names = np.asarray([str(d) for d in domains])
  return [f"seed {seed}, {label}: constant prediction on {', '.join(names[flags])} "
          f"through the last {last} rounds"
          for seed, per_run in zip(seeds, constant)
          for label, flags in zip(labels, per_run) if flags.any()]


# --------------------------------------------------------------------------
# Atomic file writing
# --------------------------------------------------------------------------


def _atomic_write(path: str | os.PathLike, write: Callable[[IO], None],
                  binary: bool) -> None:
  """Writes a file so readers never observe a partial one.

  The content goes to a temporary file in the destination directory (same
  filesystem, so ``os.replace`` is an atomic rename) and keeps the
  destination's suffix so format-sniffing writers behave. On any failure the
  temporary file is removed and an existing destination is left untouched.

  Args:
    path: Destination path; missing parent directories are created.
    write: Callback that writes the whole content to the open file object.
    binary: Open the temporary file in ``"wb"`` rather than text mode.
  """
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  base = os.path.basename(path)
  _, suffix = os.path.splitext(base)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=suffix)
  try:
    mode = "wb" if binary else "w"
    # newline="" lets the csv module control line endings itself.
    kwargs = {} if binary else {"encoding": "utf-8", "newline": ""}
    with os.fdopen(fd, mode, **kwargs) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    # mkstemp creates 0600; artefacts are meant to be shared like any output.
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise


def _format_cell(column: str, value: Any) -> Any:
  """Formats one CSV value.

  Metrics get 4 decimals (NaN as ``nan``), the loss slope 5 significant
  digits. ρ and β keep their shortest exact repr: 4 decimals would collapse
  e.g. 1e-5 to 0.0000 and break round trips.

  Args:
    column: Column name.
    value: Raw value.

  Returns:
    The value to hand to ``csv.writer``.
  """
  if isinstance(value, (float, np.floating)):
    value = float(value)
    if math.isnan(value):
      return "nan"
    if column in HYPERPARAM_COLUMNS:
      return repr(value)
    if column in SCIENTIFIC_COLUMNS:
      return f"{value:.4e}"
    return f"{value:.4f}"
  return value


def write_summary_csv(rows: Sequence[Mapping[str, Any]],
                      path: str | os.PathLike) -> None:
  """Atomically writes summary rows as CSV.

  Columns follow the key order of the first row. Floats are written with 4
  decimals and NaN as ``nan`` (``rho``/``beta`` keep their exact repr).

  Args:
    rows: Rows as returned by ``summarize``.
    path: Destination ``.csv`` path.

  Raises:
    ValueError: If ``rows`` is empty (there would be no header).
  """
  if not rows:
    raise ValueError("no rows to write")
  fields = list(rows[0].keys())

  def write(f: IO) -> None:
    writer = csv.writer(f)
    writer.writerow(fields)
    for row in rows:
      writer.writerow([_format_cell(c, row[c]) for c in fields])

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


def _cell_rows(rows: Sequence[Row]) -> list[Row]:
  """Returns the FedAvg+FedIA grid-cell rows, in input order."""
  return [r for r in rows if r["method"] == FEDIA]


def _best_cell_index(rows: Sequence[Row], key: str) -> int:
  """Index into ``_cell_rows(rows)`` of the cell maximising ``key``.

  Args:
    rows: Summary rows.
    key: Numeric column to maximise; NaN cells are ignored.

  Returns:
    The index; ties go to the first cell in row order.

  Raises:
    ValueError: If there is no grid cell with a finite ``key``.
  """
  cells = _cell_rows(rows)
  values = np.array([float(r[key]) for r in cells], dtype=np.float64)
  if not np.isfinite(values).any():
    raise ValueError(
        f"no grid cell with a finite {key!r} among {len(cells)} cells")
  return int(np.argmax(np.where(np.isfinite(values), values, -np.inf)))


def best_cell(rows: Sequence[Row], key: str = "avg_mean") -> Row:
  """The FedAvg+FedIA grid cell with the highest ``key``.

  The FedAvg row is never returned; non-converged (NaN) cells are skipped.

  Args:
    rows: Summary rows from ``summarize``.
    key: Numeric column to maximise.

  Returns:
    The winning row (the same dict object as in ``rows``).

  Raises:
    ValueError: If no cell has a finite ``key``.
  """
  return _cell_rows(rows)[_best_cell_index(rows, key)]


def _domain_names(row: Row) -> list[str]:
  """Domain names encoded in a row's accuracy ``<d>_mean`` keys, in column order."""
  names = []
  for key in row:  # the accuracy block comes first and ends at avg_mean
    if key == f"{AVG}_mean":
      return names
    if key.endswith("_mean"):
      names.append(key[:-len("_mean")])
  return names


def _fmt_hparam(value: Any) -> str:
  """Short text for ρ/β; empty for the FedAvg row."""
  return "" if value == "" else f"{float(value):g}"


def _fmt_pct(value: float, spec: str = ".2f") -> str:
  """Percent value for the table; NaN as "nan" (never "+nan")."""
  return "nan" if math.isnan(value) else format(value, spec)


def format_table(rows: Sequence[Row], max_rows: int | None = None) -> str:
  """Formats summary rows as an aligned text table for a terminal.

  Columns: method, ρ, β, each domain mean, AVG mean±std, ΔAVG, all in
  percent with 2 decimals. A footnote says what the ± std is taken over.

  Args:
    rows: Summary rows from ``summarize``.
    max_rows: If given, show only the best ``max_rows`` grid cells ranked by
      ``avg_mean`` (NaN last); the FedAvg row is always shown first. If
      None, all rows are shown in input order.

  Returns:
    The table as a multi-line string (no trailing newline).
  """
  if not rows:
    return "(no rows)"
  domains = _domain_names(rows[0])
  shown = list(rows)
  hidden = 0
  if max_rows is not None:
    cells = _cell_rows(rows)
    # NaN ranks after every finite value; sorted() is stable for ties.
    ranked = sorted(cells, key=lambda r: -r["avg_mean"]
                    if math.isfinite(r["avg_mean"]) else math.inf)
    keep = ranked[:max(0, max_rows)]
    hidden = len(cells) - len(keep)
    shown = [r for r in rows if r["method"] != FEDIA] + keep

  header = ["method", "ρ", "β"] + domains + ["AVG", "ΔAVG"]
  body = []
  for r in shown:
    body.append([r["method"], _fmt_hparam(r["rho"]), _fmt_hparam(r["beta"])] +
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
               f"{'/'.join(over)}; ΔAVG = AVG - FedAvg AVG (points)")
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
  """The cells' ΔAVG on the ρ×β grid, as ``plot_heatmap`` draws and marks it.

  Attributes:
    rhos: float [R] sorted unique ρ.
    betas: float [B] sorted unique β.
    delta: float [R, B] ΔAVG (points); NaN where non-converged or missing.
    present: bool [R, B] whether a row exists for that (ρ, β).
    significant: bool [R, B] the paired 95 % interval of ΔAVG excludes 0
      (marked ``*``); never with one seed.
    constant: bool [R, B] some (seed, domain) of the cell ends at a
      constant prediction (marked ``c``).
  """
  rhos: np.ndarray
  betas: np.ndarray
  delta: np.ndarray
  present: np.ndarray
  significant: np.ndarray
  constant: np.ndarray


def _delta_grid(cells: Sequence[Row]) -> DeltaGrid:
  """Lays the grid-cell rows out on the ρ×β grid (see ``DeltaGrid``)."""
  rhos = np.unique([float(r["rho"]) for r in cells])
  betas = np.unique([float(r["beta"]) for r in cells])
  grid = DeltaGrid(rhos, betas, np.full((rhos.size, betas.size), np.nan),
                   *np.zeros((3, rhos.size, betas.size), dtype=bool))
  for r in cells:
    i = int(np.searchsorted(rhos, float(r["rho"])))
    j = int(np.searchsorted(betas, float(r["beta"])))
    grid.delta[i, j] = float(r["delta_avg"])
    grid.present[i, j] = True
    # A NaN half-width (one seed) compares False: no mark.
    grid.significant[i, j] = abs(float(r["delta_avg"])) > float(r["delta_avg_ci"])
    grid.constant[i, j] = r["constant_domains"] > 0
  return grid


def _constant_note(row: Row) -> str:
  count = row["constant_domains"]
  return f"constant on {count} (seed, domain) pair(s)" if count else ""


def plot_heatmap(rows: Sequence[Row], path: str | os.PathLike,
                 title: str = "", base_label: str = "FedAvg") -> DeltaGrid:
  """Atomically plots ΔAVG (FedAvg+FedIA minus FedAvg) over the ρ×β grid.

  ρ runs down the rows, β across the columns. The colormap is diverging and
  symmetric around 0 so gains and losses read alike. Non-converged (NaN)
  cells are grey and marked "NC"; (ρ, β) pairs absent from a partial grid
  are left white and marked "n/a". The best cell by ``avg_mean`` is boxed.
  A ``*`` follows a ΔAVG whose paired 95 % interval over seeds excludes 0
  (none with one seed, which the title says); a ``c`` marks a cell that ends
  at a constant prediction on some (seed, domain), whose ΔAVG is partly a
  class share.

  Args:
    rows: Summary rows from ``summarize`` (at least one grid cell).
    path: Destination image path, e.g. ``*.png``.
    title: Dataset/setting shown in the title.
    base_label: what the cells are compared with (the FedAvg row), e.g.
      ``FedProx`` for a table.py sweep of FedProx+FedIA.

  Returns:
    The grid as drawn, marks included.

  Raises:
    ValueError: If ``rows`` has no grid cell.
  """
  cells = _cell_rows(rows)
  if not cells:
    raise ValueError("rows contain no FedAvg+FedIA grid cell to plot")
  grid = _delta_grid(cells)
  rhos, betas, delta, present = grid.rhos, grid.betas, grid.delta, grid.present
  finite = np.isfinite(delta)
  lim = float(np.abs(delta[finite]).max()) if finite.any() else 0.0
  # The floor keeps noise-level deltas (and all-zero grids, which would give
  # a zero-width norm) from being painted at full saturation.
  lim = max(lim, MIN_COLOR_LIMIT)
  cmap = colormaps["RdBu"].with_extremes(bad="lightgrey")
  norm = Normalize(vmin=-lim, vmax=lim)

  fig, ax = _new_figure(max(4.5, 1.1 * betas.size + 3.0),
                        max(3.5, 0.8 * rhos.size + 2.2))
  image = ax.imshow(np.ma.masked_invalid(delta), cmap=cmap, norm=norm,
                    aspect="auto", origin="lower")
  for i in range(rhos.size):
    for j in range(betas.size):
      if not present[i, j]:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                               edgecolor="none"))
        text, color = "n/a", "grey"
      elif not finite[i, j]:
        text, color = "NC", "black"
      else:
        text = (f"{delta[i, j]:+.2f}" + ("*" if grid.significant[i, j] else "")
                + (" c" if grid.constant[i, j] else ""))
        # White text only where the fill is dark enough to need it.
        color = "white" if abs(delta[i, j]) > 0.6 * lim else "black"
      ax.text(j, i, text, ha="center", va="center", color=color, fontsize=9)

  best_note = "no converged cell"
  if any(np.isfinite(float(r["avg_mean"])) for r in cells):
    best = best_cell(rows)
    i = int(np.searchsorted(rhos, float(best["rho"])))
    j = int(np.searchsorted(betas, float(best["beta"])))
    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                           edgecolor="black", linewidth=2.5))
    best_note = (f"best (boxed): ρ={_fmt_hparam(best['rho'])}, "
                 f"β={_fmt_hparam(best['beta'])}, "
                 f"ΔAVG={best['delta_avg']:+.2f}")
  one_seed = all(r["std_over"] == "rounds" for r in rows)
  notes = ["1 seed: no interval, no * marks" if one_seed
           else "* paired 95 % interval over seeds excludes 0"]
  if grid.constant.any():
    notes.append("c: constant prediction on some (seed, domain)")
  base = [r for r in rows if r["method"] == FEDAVG]
  if base and _constant_note(base[0]):
    notes.append(f"{base_label} {_constant_note(base[0])}")

  ax.set_xticks(range(betas.size), [f"{b:g}" for b in betas])
  ax.set_yticks(range(rhos.size), [f"{r:g}" for r in rhos])
  ax.set_xlabel("β")
  ax.set_ylabel("ρ")
  head = f"{title}: " if title else ""
  ax.set_title(f"{head}{base_label}+FedIA ΔAVG over ρ×β\n{best_note}\n"
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


def plot_curves(fedavg_acc: np.ndarray, fedia_acc: np.ndarray,
                rows: Sequence[Row], path: str | os.PathLike, title: str,
                *, last: int | None = None) -> list[str]:
  """Atomically plots AVG accuracy per round: FedAvg vs the best grid cell.

  The best cell is chosen by ``avg_mean`` in ``rows``. Lines are means over
  seeds; with S >= 2 a band shows ±1 population std across seeds. A run
  that ends at a constant prediction on some (seed, domain) says so in its
  legend entry (``constant_domains`` of its row).

  Args:
    fedavg_acc: float [S, T, D] FedAvg accuracy fractions.
    fedia_acc: float [G, S, T, D] FedAvg+FedIA accuracy fractions, cells in
      the same order as the grid-cell rows of ``rows``.
    rows: Summary rows from ``summarize`` on these arrays.
    path: Destination image path, e.g. ``*.png``.
    title: Dataset/setting shown as the title.
    last: Number of final rounds that ``summarize`` used; when given, that
      span is shaded. (Rows do not record it, hence the argument.)

  Returns:
    The legend labels of the FedAvg and best-cell lines.

  Raises:
    ValueError: On shape mismatch, ``last`` out of range, or no converged
      cell to plot.
  """
  fedavg_acc = np.asarray(fedavg_acc, dtype=np.float64)
  fedia_acc = np.asarray(fedia_acc, dtype=np.float64)
  if fedavg_acc.ndim != 3 or fedia_acc.ndim != 4 or \
      fedia_acc.shape[1:] != fedavg_acc.shape:
    raise ValueError(f"expected fedavg_acc [S, T, D] and fedia_acc "
                     f"[G, S, T, D], got {fedavg_acc.shape} and "
                     f"{fedia_acc.shape}")
  cells = _cell_rows(rows)
  if len(cells) != fedia_acc.shape[0]:
    raise ValueError(f"rows have {len(cells)} grid cells but fedia_acc has "
                     f"G={fedia_acc.shape[0]}")
  num_rounds = fedavg_acc.shape[1]
  g = _best_cell_index(rows, "avg_mean")
  best = cells[g]
  base = [r for r in rows if r["method"] == FEDAVG]
  rounds = np.arange(1, num_rounds + 1)

  fig, ax = _new_figure(7.0, 4.2)
  if last is not None:
    last = analysis.check_last(last, num_rounds)
    ax.axvspan(num_rounds - last + 0.5, num_rounds + 0.5, color="grey",
               alpha=0.15, label=f"last {last} rounds (summarised)")
  label_best = (f"FedAvg+FedIA (ρ={_fmt_hparam(best['rho'])}, "
                f"β={_fmt_hparam(best['beta'])})")
  labels = []
  for acc, label, row, color in (
      (fedavg_acc, "FedAvg", base[0] if base else None, "tab:blue"),
      (fedia_acc[g], label_best, best, "tab:orange")):
    note = _constant_note(row) if row is not None else ""
    labels.append(f"{label}: {note}" if note else label)
    mean, std = _avg_curve(acc)
    ax.plot(rounds, mean, color=color, linewidth=1.6, label=labels[-1])
    if std is not None:
      ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2,
                      linewidth=0)
  num_seeds = fedavg_acc.shape[0]
  spread = f"mean ± 1 std over {num_seeds} seeds" if num_seeds >= 2 \
      else "single seed"
  ax.set_xlabel("Communication round")
  ax.set_ylabel("AVG test accuracy (%)")
  ax.set_xlim(0.5, num_rounds + 0.5)
  ax.set_title(f"{title}\nAVG over domains, {spread}" if title
               else f"AVG over domains, {spread}", fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(loc="best", fontsize=9)
  save_figure(fig, path)
  return labels
