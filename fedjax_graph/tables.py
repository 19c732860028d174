"""Paper-style result tables (FedIA paper, Tables 2-6) as Markdown, CSV and LaTeX.

A table is a list of ``TableRow``: one per method (e.g. "FedProx" and
"FedProx+FedIA", or a reference such as "Majority"), built from a sweep's
``RunResult`` by ``make_row`` and then ``add_deltas``. A row holds accuracy
and balanced accuracy per domain and AVG (mean +- std over seeds, percent),
its paired changes against its base method and against FedAvg with their 95 %
t-intervals (``fedjax_graph.analysis``), how many seeds end at a constant
prediction on each domain, and a status that replaces the numbers when a run
did not converge. Shapes follow ``fedjax_graph/types.py``; G' is the number of
cells of one sweep.
"""

import csv
import io
import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

from fedjax_graph import aggregators, analysis, report

REFERENCE = "reference"  # Majority, Local, Centralized: a floor or ceiling, no "+FedIA"
METRICS = (("acc", "", "Test accuracy (%)"), ("bacc", "bacc_", "Balanced accuracy (%)"))


class RunResult(NamedTuple):
  """The saved arrays of one sweep (``runs/<key>.npz``), its G' cells in order.

  Attributes:
    test_acc, val_acc: f32[S, G', T, D] accuracy fractions.
    predicted_classes: i32[S, G', T, D] distinct classes predicted on each
      domain's test nodes.
    test_bacc, test_f1: f32[S, G', T, D] balanced accuracy and macro-F1
      fractions on the test nodes.
    train_loss: f32[S, G', T] mean over clients of the training loss.
    nonfinite: bool[S, G', T, C]. alpha: f32[S, G', T, C].
    labels: str[G'] the cells' labels (``cells.Cell``).
    aggregators: str[G'] each cell's aggregator.
    hparams: ``{name: f64[G']}`` each hyper-parameter of any cell, NaN where
      a cell has none.
    seconds: wall time of the sweep (s).
    argmax_acc: f32[S, G', T, D] the classifier's argmax test accuracy of a
      method that predicts otherwise (``Method.predict``, e.g. FGGP's
      k-nearest prototypes, which ``test_acc`` scores), else None.
  """
  test_acc: np.ndarray
  val_acc: np.ndarray
  predicted_classes: np.ndarray
  test_bacc: np.ndarray
  test_f1: np.ndarray
  train_loss: np.ndarray
  nonfinite: np.ndarray
  alpha: np.ndarray
  labels: np.ndarray
  aggregators: np.ndarray
  hparams: dict
  seconds: float
  argmax_acc: Optional[np.ndarray] = None


class Scores(NamedTuple):
  """One metric of one row, in percent.

  Attributes:
    per_seed: f64[S, D + 1] each seed's mean over the final rounds, per domain
      then AVG (``analysis.final_rounds``): what the paired deltas use.
    mean: f64[D + 1] mean over seeds.
    std: f64[D + 1] population std over seeds, or over the final rounds
      with one seed (``analysis.spread``).
    delta_base: change against the base method's row of the same seeds
      (None for a base or reference row).
    delta_fedavg: change against FedAvg's base row (None for that row and
      without one).
  """
  per_seed: np.ndarray
  mean: np.ndarray
  std: np.ndarray
  delta_base: Optional[analysis.PairedDelta] = None
  delta_fedavg: Optional[analysis.PairedDelta] = None


class TableRow(NamedTuple):
  """One method's row.

  Attributes:
    label: the method as printed, e.g. ``FedProx+FedIA``.
    method: the base method's key, e.g. ``fedprox``.
    variant: ``base`` (the method's own averaging), ``reference``, or
      ``+<aggregator>`` (e.g. ``+fedia``, ``+gma``, ``+fedia_im``).
    hparams: the cell's hyper-parameters as (name, value) pairs (none for a
      base or reference row).
    acc: test accuracy. bacc: balanced accuracy.
    argmax: test accuracy of the classifier's argmax where the method
      predicts otherwise (``RunResult.argmax_acc``; ``acc`` is then the
      method's own prediction), else None.
    constant: i64[D] number of seeds whose model predicts one class on that
      domain's test nodes through all of the final rounds.
    oscillating: i64[D] number of seeds whose accuracy on that domain swings
      by more than ``analysis.OSCILLATION_POINTS`` between consecutive final
      rounds on average (two near-constant models taking turns).
    loss_slope: mean over seeds of the training loss's least-squares slope
      over the final rounds (loss per round; > 0: rising).
    status: ``ok``, or why the run did not converge (the numbers are then
      not shown), e.g. ``NC: constant prediction (2/3 seeds)``.
  """
  label: str
  method: str
  variant: str
  hparams: tuple
  acc: Scores
  bacc: Scores
  constant: np.ndarray
  oscillating: np.ndarray
  loss_slope: float
  status: str = "ok"
  argmax: Optional[Scores] = None

  @property
  def num_seeds(self) -> int:
    return self.acc.per_seed.shape[0]

  @property
  def hparam_dict(self) -> dict:
    return dict(self.hparams)


# --------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------


def convergence_status(test_acc: np.ndarray, predicted_classes: np.ndarray, nonfinite_updates: int,
                       last: int) -> str:
  """``ok`` or the reason a run is reported as non-converged (NC).

  NC when, in any seed, the accuracy is NaN in the final rounds, or the global
  model predicts one class on every domain's test nodes through all of the
  final ``last`` rounds (a collapsed model: its accuracy is only the majority
  share). A constant prediction on only some domains is not NC; the tables
  mark those cells (``TableRow.constant``). Skipped non-finite client updates
  are noted but are not NC.

  Args:
    test_acc: [S, T, D]. predicted_classes: [S, T, D] distinct predicted
      classes per domain. nonfinite_updates: client updates left out.
  """
  seeds = test_acc.shape[0]
  nan = np.isnan(test_acc[:, -last:]).any(axis=(1, 2))
  constant = analysis.constant_domains(predicted_classes, last).all(axis=1)
  if nan.any():
    return f"NC: NaN accuracy ({int(nan.sum())}/{seeds} seeds)"
  if constant.any():
    return f"NC: constant prediction ({int(constant.sum())}/{seeds} seeds)"
  if nonfinite_updates:
    return f"ok ({nonfinite_updates} non-finite client updates skipped)"
  return "ok"


def converged(row: TableRow) -> bool:
  return row.status.startswith("ok")


def _label(row: TableRow) -> str:
  """The row's label, with the non-finite client updates it skipped where there were any."""
  note = row.status[len("ok ("):-1] if row.status.startswith("ok (") else ""
  return f"{row.label} ({note})" if note else row.label


def validation_avg(result: RunResult, g: int, last: int) -> float:
  """Cell g's validation AVG (%): mean over seeds of the final-rounds mean."""
  return float(analysis.final_rounds(result.val_acc[:, g], last)[:, -1].mean())


def select_cell(result: RunResult, aggregator: str, select: str, last: int) -> int:
  """Index of the reported cell of ``aggregator``: the only one (fixed) or the best validation AVG (val)."""
  candidates = np.flatnonzero(np.asarray(result.aggregators) == aggregator)
  if not len(candidates):
    raise ValueError(f"no cell of aggregator {aggregator!r} in {list(result.labels)}")
  if select == "fixed" or len(candidates) == 1:
    return int(candidates[0])
  val_avg = np.array([validation_avg(result, g, last) for g in candidates])
  if np.isnan(val_avg).all():  # every cell failed: report the first, shown as NC
    return int(candidates[0])
  return int(candidates[int(np.nanargmax(val_avg))])


def _scores(values: np.ndarray, last: int) -> Scores:
  mean, std, _ = analysis.spread(values, last)
  return Scores(analysis.final_rounds(values, last), mean, std)


def make_row(result: RunResult, g: int, method: str, variant: str, last: int) -> TableRow:
  """The table row of cell ``g`` of a run, labelled as the cell (deltas filled in by ``add_deltas``).

  Raises:
    ValueError: for a variant other than ``base``, ``reference`` or ``+<aggregator>``.
  """
  if variant not in ("base", REFERENCE) and not variant.startswith("+"):
    raise ValueError(f"variant = {variant!r}; choose base, {REFERENCE} or +<aggregator>")
  # A reference row is shown whatever it predicts: the majority row is constant
  # by design, and the floor is what a constant model scores.
  classes = result.predicted_classes[:, g]
  status = convergence_status(result.test_acc[:, g],
                              np.maximum(classes, 2) if variant == "reference" else classes,
                              int(result.nonfinite[:, g].sum()), last)
  constant = analysis.constant_domains(result.predicted_classes[:, g], last).sum(axis=0)
  if method == "majority":  # one class per domain by construction: no news to flag
    constant = np.zeros_like(constant)
  oscillating = analysis.oscillating_domains(result.test_acc[:, g], last).sum(axis=0)
  loss_slope = float(analysis.loss_slope(result.train_loss[:, g], last).mean())
  # In the aggregator's own order (FedHEAL: tau, beta), whatever the saved order.
  aggregator = str(result.aggregators[g])
  order = list(aggregators.get(aggregator).hparams) if aggregator in aggregators.REGISTRY else []
  names = sorted(result.hparams, key=lambda n: order.index(n) if n in order else len(order))
  hparams = tuple((name, float(result.hparams[name][g])) for name in names
                  if not np.isnan(result.hparams[name][g]))
  return TableRow(str(result.labels[g]), method, variant, hparams,
                  _scores(result.test_acc[:, g], last), _scores(result.test_bacc[:, g], last),
                  constant, oscillating, loss_slope,
                  status, None if result.argmax_acc is None else _scores(result.argmax_acc[:, g],
                                                                          last))


def _paired(row: TableRow, other: TableRow, metric: str) -> analysis.PairedDelta:
  a, b = getattr(row, metric).per_seed, getattr(other, metric).per_seed
  if a.shape != b.shape:
    raise ValueError(f"{row.label} and {other.label} must share the seeds and domains to be "
                     f"paired; got {a.shape} and {b.shape}")
  return analysis.paired_interval(a - b)


def add_deltas(rows: Sequence[TableRow]) -> list[TableRow]:
  """Fills each row's paired change against its base method's row and against FedAvg's.

  The base row of a method is its row of variant ``base``; FedAvg's is the
  one of method ``fedavg`` and variant ``base`` (never found by position).
  Reference rows get only the change against FedAvg. No change is taken
  against a non-converged (NC) row: its numbers are not a learned model's.

  Raises:
    ValueError: if a non-base, non-reference row has no base row, or two
      rows to pair have different seeds.
  """
  base = {r.method: r for r in rows if r.variant == "base"}
  fedavg = base.get("fedavg")
  comparable = lambda other: other if other is not None and converged(other) else None
  out = []
  for row in rows:
    if row.variant not in ("base", REFERENCE) and row.method not in base:
      raise ValueError(f"{row.label}: no base row of method {row.method!r} to compare with")
    own_base = None if row.variant in ("base", REFERENCE) else comparable(base[row.method])
    versus_fedavg = None if row.method == "fedavg" and row.variant == "base" else comparable(fedavg)
    pair = lambda other, metric: None if other is None else _paired(row, other, metric)
    out.append(row._replace(**{
        metric: getattr(row, metric)._replace(delta_base=pair(own_base, metric),
                                              delta_fedavg=pair(versus_fedavg, metric))
        for metric, _, _ in METRICS}))
  return out


# --------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------


def _pm(mean: float, std: float) -> str:
  return "nan" if math.isnan(mean) else f"{mean:.2f}±{std:.2f}"


def _delta_text(delta: Optional[analysis.PairedDelta], j: int) -> str:
  """``▲+1.20±0.80`` where the paired interval excludes 0, ``+0.10±0.30`` or ``+0.10 (1 seed)`` else."""
  if delta is None:
    return ""
  text = analysis.format_delta(delta, j)
  if text and analysis.significant(delta)[j]:
    return ("▲" if delta.mean[j] > 0 else "▼") + text
  return text


MARKS = (("constant", "ᶜ", "c"), ("oscillating", "ᵒ", "o"))  # field, Markdown mark, LaTeX mark


def _marks(row: TableRow, j: int, latex: bool = False) -> str:
  """`` ᶜ2/3``: constant in 2 of 3 seeds on domain j; `` ᵒ1/3``: oscillating in 1 (not on AVG)."""
  out = ""
  for field, mark, latex_mark in MARKS:
    counts = getattr(row, field)
    if j < len(counts) and counts[j]:
      k = f"{int(counts[j])}/{row.num_seeds}"
      out += f"\\,\\textsuperscript{{{latex_mark}}}{k}" if latex else f" {mark}{k}"
  return out


SYMBOLS = {"rho": "ρ", "beta": "β", "tau": "τ"}


def _hparams(row: TableRow) -> str:
  return ", ".join(f"{SYMBOLS.get(name, name)}={value:g}" for name, value in row.hparams)


def _flag_list(rows: Sequence[TableRow], domains: Sequence[str], field: str) -> str:
  """``FedAvg: A 1/3, B 2/3; ...`` naming every (row, domain) flagged by ``field`` in some seed."""
  return "; ".join(
      f"{row.label}: " + ", ".join(f"{d} {int(k)}/{row.num_seeds}"
                                   for d, k in zip(domains, getattr(row, field)) if k)
      for row in rows if getattr(row, field).any())


def _footnote(rows: Sequence[TableRow], domains: Sequence[str]) -> str:
  note = ("Changes (points) follow each value against the row's base method, and against "
          "FedAvg's base row in Δ FedAvg: the mean over seeds of the paired per-seed "
          "differences ± the half-width of their 95 % t-interval; ▲/▼ only where that "
          "interval excludes 0; (1 seed): no interval, no arrow.")
  constant = _flag_list(rows, domains, "constant")
  if constant:
    note += (" ᶜk/S: in k of S seeds the model predicts one class on that domain's test nodes "
             "in every final round, so its score there is a class share, not a learned model. "
             f"Constant: {constant}.")
  oscillating = _flag_list(rows, domains, "oscillating")
  if oscillating:
    note += (f" ᵒk/S: in k of S seeds the accuracy on that domain changes by more than "
             f"{analysis.OSCILLATION_POINTS:g} points from one final round to the next on "
             "average (models taking turns), so its mean over those rounds is not a learned "
             f"model's score either. Oscillating: {oscillating}.")
  return note


def _markdown_table(rows: Sequence[TableRow], domains: Sequence[str], metric: str) -> list[str]:
  names = {n for row in rows for n, _ in row.hparams}
  header = ["Method", "(ρ, β)" if names <= {"rho", "beta"} else "Hyper-parameters", *domains,
            "AVG", "Δ FedAvg"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    if not converged(row):
      cells = [_label(row), _hparams(row), row.status] + [""] * (len(domains) + 1)
      lines.append("| " + " | ".join(cells) + " |")
      continue
    scores = getattr(row, metric)
    values = []
    for j in range(len(domains) + 1):
      delta = _delta_text(scores.delta_base, j)
      values.append(_pm(scores.mean[j], scores.std[j]) + _marks(row, j)
                    + (f" {delta}" if delta else ""))
    lines.append("| " + " | ".join([_label(row), _hparams(row), *values,
                                    _delta_text(scores.delta_fedavg, -1)]) + " |")
  return lines


def to_markdown(rows: Sequence[TableRow], domains: Sequence[str], title: str = "") -> str:
  """Two Markdown tables, accuracy then balanced accuracy, each with its footnote.

  A cell reads e.g. ``62.10±0.40 ᶜ1/3 ▲+1.20±0.80``: mean±std, the constant
  (ᶜ) or oscillating (ᵒ) mark, the paired change against the base method.
  """
  lines = [f"**{title}**", ""] if title else []
  note = _footnote(rows, domains)
  for metric, _, caption in METRICS:
    lines += [f"{caption}:", "", *_markdown_table(rows, domains, metric), "", note, ""]
  return "\n".join(lines)


def _number(value: Optional[float], spec: str = ".4f") -> str:
  return "" if value is None else format(float(value), spec)


def to_csv(rows: Sequence[TableRow], domains: Sequence[str]) -> str:
  """CSV text, one row per method, numbers unformatted (percent, percentage points).

  Per metric (accuracy, then balanced accuracy with ``bacc_`` after the
  domain): ``<d>_mean``, ``<d>_std``; ``<d>_delta_base`` and its interval
  half-width ``<d>_delta_base_ci``; ``delta_fedavg``, ``delta_fedavg_ci``
  (AVG). Then ``<d>_constant`` (seeds constant), ``<d>_oscillating`` (seeds
  oscillating), ``num_seeds`` and
  ``train_loss_slope`` (loss per round). Where a row has ``argmax`` (a
  method predicting otherwise than by its classifier's argmax: FGGP), last
  ``<d>_argmax_mean`` and ``<d>_argmax_std`` (empty for the other rows).
  """
  names = list(domains) + ["AVG"]
  hparam_names = list(dict.fromkeys(name for row in rows for name, _ in row.hparams))
  columns = ["method", "base", "variant", *hparam_names, "status"]
  for _, prefix, _ in METRICS:
    columns += ([f"{d}_{prefix}{stat}" for d in names for stat in ("mean", "std")]
                + [f"{d}_{prefix}delta_base{ci}" for d in names for ci in ("", "_ci")]
                + [f"{prefix}delta_fedavg", f"{prefix}delta_fedavg_ci"])
  columns += ([f"{d}_{field}" for field, _, _ in MARKS for d in domains]
              + ["num_seeds", "train_loss_slope"])
  with_argmax = any(row.argmax is not None for row in rows)
  if with_argmax:
    columns += [f"{d}_argmax_{stat}" for d in names for stat in ("mean", "std")]
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(columns)
  for row in rows:
    values = [row.label, row.method, row.variant,
              *(_number(row.hparam_dict.get(name), "g") for name in hparam_names), row.status]
    for metric, _, _ in METRICS:
      scores = getattr(row, metric)
      values += [_number(v) for pair in zip(scores.mean, scores.std) for v in pair]
      for delta, entries in ((scores.delta_base, range(len(names))), (scores.delta_fedavg, [-1])):
        for j in entries:
          values += (["", ""] if delta is None
                     else [_number(delta.mean[j]), _number(delta.half_width[j])])
    values += ([int(k) for field, _, _ in MARKS for k in getattr(row, field)]
               + [row.num_seeds, _number(row.loss_slope, ".4e")])
    if with_argmax:
      values += (["", ""] * len(names) if row.argmax is None else
                 [_number(v) for pair in zip(row.argmax.mean, row.argmax.std) for v in pair])
    writer.writerow(values)
  return out.getvalue()


def _latex_escape(text: str) -> str:
  for plain, latex in (("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("ρ", r"$\rho$"),
                       ("β", r"$\beta$"), ("τ", r"$\tau$"), ("±", r"$\pm$")):
    text = text.replace(plain, latex)
  return text


def _latex_delta(delta: Optional[analysis.PairedDelta], j: int) -> str:
  """``\\uparrow+1.20 \\pm 0.80`` (math mode), as ``_delta_text``."""
  if delta is None or math.isnan(delta.mean[j]):
    return ""
  arrow = ""
  if analysis.significant(delta)[j]:
    arrow = r"\uparrow" if delta.mean[j] > 0 else r"\downarrow"
  spread = (rf" \pm {delta.half_width[j]:.2f}" if delta.num_seeds >= 2
            else r"\,(1\,\mathrm{seed})")
  return f"{arrow}{delta.mean[j]:+.2f}{spread}"


LATEX_NOTE = (r"Superscripts: change against the base method, last column against FedAvg: mean "
              r"of the paired per-seed differences $\pm$ half-width of the 95\,\% $t$-interval; "
              r"arrows only where it excludes 0. \textsuperscript{c}$k/S$: one class predicted "
              r"on that domain through the final rounds in $k$ of $S$ seeds; "
              rf"\textsuperscript{{o}}$k/S$: its accuracy there changes by more than "
              rf"{analysis.OSCILLATION_POINTS:g} points per final round on average.")


def _latex_table(rows: Sequence[TableRow], domains: Sequence[str], metric: str,
                 caption: str) -> list[str]:
  names = [_latex_escape(d) for d in domains] + ["AVG"]
  lines = [r"\begin{table}[t]", r"\centering", r"\small",
           r"\begin{tabular}{l" + "c" * (len(names) + 1) + "}", r"\toprule",
           "Method & " + " & ".join(names) + r" & $\Delta$ FedAvg \\", r"\midrule"]
  for i, row in enumerate(rows):
    label = _latex_escape(_label(row) + (f" ({_hparams(row)})" if _hparams(row) else ""))
    if not converged(row):
      lines.append(f"{label} & \\multicolumn{{{len(names) + 1}}}{{c}}"
                   f"{{{_latex_escape(row.status)}}}" r" \\")
      continue
    scores, cells = getattr(row, metric), []
    for j in range(len(names)):
      delta = _latex_delta(scores.delta_base, j)
      cell = f"${scores.mean[j]:.2f}_{{\\pm {scores.std[j]:.2f}}}" + (f"^{{{delta}}}$"
                                                                       if delta else "$")
      cells.append(cell + _marks(row, j, latex=True))
    delta = _latex_delta(scores.delta_fedavg, -1)
    cells.append(f"${delta}$" if delta else "")
    lines.append(f"{label} & " + " & ".join(cells) + r" \\")
    if i + 1 < len(rows) and rows[i + 1].method != row.method:  # one block per method
      lines.append(r"\midrule")
  lines += [r"\bottomrule", r"\end{tabular}", f"\\caption{{{caption}}}", r"\end{table}"]
  return lines


def to_latex(rows: Sequence[TableRow], domains: Sequence[str], caption: str = "") -> str:
  """Two LaTeX ``table`` environments (booktabs), accuracy then balanced accuracy.

  Cells are mean$\\pm$std with the change against the base row as a
  superscript; the last column is the change of AVG against FedAvg.
  """
  lines = [r"% needs \usepackage{booktabs}"]
  for metric, _, name in METRICS:
    head = f"{_latex_escape(caption)}. " if caption else ""
    lines += _latex_table(rows, domains, metric, f"{head}{_latex_escape(name)}. {LATEX_NOTE}")
  return "\n".join(lines) + "\n"


def write_tables(rows: Sequence[TableRow], domains: Sequence[str], stem, title: str) -> None:
  """Writes ``<stem>.csv``, ``<stem>.tex`` and, last (it marks a finished run), ``<stem>.md``."""
  report.write_text(f"{stem}.csv", to_csv(rows, domains))
  report.write_text(f"{stem}.tex", to_latex(rows, domains, title))
  report.write_text(f"{stem}.md", to_markdown(rows, domains, title))


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------


def plot_table(rows: Sequence[TableRow], path, title: str) -> None:
  """Bar chart of AVG accuracy (mean, error bar ±std) per row in order; NC rows hatched at 0."""
  fig = Figure(figsize=(1.2 + 0.55 * len(rows), 3.6))
  ax = fig.add_subplot()
  names = {"base": "base method", REFERENCE: "reference (Majority, Local, Centralized)"}
  variants = list(dict.fromkeys(row.variant for row in rows))
  palette = dict(zip([v for v in variants if v not in names],
                     ["#2171b5", "#6baed6", "#31a354", "#756bb1", "#e7ba52", "#843c39"]))
  colors = {"base": "#8c8c8c", REFERENCE: "#e6550d", **palette}
  seen = set()
  for i, row in enumerate(rows):
    ok = converged(row)
    name = names.get(row.variant) or "+" + aggregators.DISPLAY.get(row.variant[1:],
                                                                   row.variant[1:])
    label = name if row.variant not in seen else None
    seen.add(row.variant)
    ax.bar(i, row.acc.mean[-1] if ok else 0.0, yerr=row.acc.std[-1] if ok else None, capsize=3,
           color=colors.get(row.variant, "#636363"), hatch=None if ok else "//", label=label)
    if not ok:
      ax.text(i, 0, "NC", ha="center", va="bottom", fontsize=8)
  ax.set_xticks(range(len(rows)), [r.label for r in rows], rotation=45, ha="right", fontsize=8)
  ax.set_ylabel("AVG test accuracy (%), ± std")
  ax.set_ylim(0, 100)
  ax.legend(fontsize=7, loc="upper right")
  ax.set_title(title, fontsize=7, wrap=True)
  report.save_figure(fig, path)


def plot_grid_heatmap(result: RunResult, domains: Sequence[str], last: int, path,
                      title: str = "", base_label: str = "FedAvg", *,
                      aggregator: str = "fedia",
                      reported: Optional[int] = None) -> report.DeltaGrid:
  """grid.py's ΔAVG heatmap for a ``--select val`` sweep: one aggregator's cells against the base cell.

  Args:
    result: a sweep with cells of ``aggregator`` (the grid) and one cell of
      the base method's own averaging (aggregator ``fedavg``).
    domains: D domain names. last: final rounds summarised.
    path: destination image, e.g. ``heatmap-fedprox.png``.
    title: dataset/setting. base_label: the base method as printed.
    aggregator: whose cells form the grid; the heatmap's axes are its
      hyper-parameters (ρ×β for FedIA, τ for GMA), in its own order.
    reported: the cell the table reports (``select_cell``, on validation),
      boxed; None boxes the best test cell.

  Returns:
    The grid as drawn (``report.plot_heatmap``).

  Raises:
    ValueError: if the sweep has no cell of ``aggregator`` or not exactly one
      base cell.
  """
  kinds = np.asarray(result.aggregators)
  grid = np.flatnonzero(kinds == aggregator)
  base = np.flatnonzero(kinds == report.FEDAVG)  # ``cells.BASE``
  if len(base) != 1 or not len(grid):
    raise ValueError(f"need {aggregator} grid cells and one base cell; got {len(grid)} and "
                     f"{len(base)}")

  def runs(cells: np.ndarray) -> report.Runs:  # [S, G', ...] -> [len(cells), S, ...]
    return report.Runs(*(np.moveaxis(getattr(result, name)[:, cells], 1, 0) for name in (
        "test_acc", "test_bacc", "test_f1", "predicted_classes", "train_loss")))

  hparams = {name: np.asarray(result.hparams[name], np.float64)[grid]
             for name in aggregators.get(aggregator).hparams if name in result.hparams}
  skipped = np.asarray(result.nonfinite).sum(axis=(0, 2, 3))  # [G']
  rows = report.summarize(report.Runs(*(x[0] for x in runs(base))), runs(grid), hparams, domains,
                          last, skipped=np.concatenate([skipped[base], skipped[grid]]),
                          cell_method=f"{report.FEDAVG}+{aggregator}")
  boxed = None if reported is None else rows[1 + list(grid).index(reported)]
  return report.plot_heatmap(rows, path, title, base_label, boxed=boxed,
                             boxed_by="reported: best validation AVG")
