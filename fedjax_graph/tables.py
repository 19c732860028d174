"""Paper-style result tables (FedIA paper, Tables 2-6) as Markdown, CSV and LaTeX.

A table is a list of ``TableRow``: one per method (e.g. "FedProx" and
"FedProx+FedIA"), with per-domain and AVG mean +- std over seeds in percent,
the change of AVG against the row's base method and against FedAvg, and a
status that replaces the numbers when a run did not converge.
"""

import csv
import io
import math
from typing import NamedTuple, Optional, Sequence

import numpy as np

from fedjax_graph import report


class TableRow(NamedTuple):
  """One method's row.

  Attributes:
    label: the method as printed, e.g. ``FedProx+FedIA``.
    method: the base method's key, e.g. ``fedprox``.
    variant: ``base``, ``+IM`` or ``+FedIA``.
    rho, beta: FedIA's mask ratio and momentum (None where unused).
    mean: f64[D + 1] percent, per domain then AVG: mean over seeds of each
      seed's mean over the final rounds.
    std: f64[D + 1] percent: population std over seeds (0 for one seed).
    delta_base: f64[D + 1] percentage points against the base method's row
      (None for a base row).
    delta_fedavg: AVG change against FedAvg's base row (None without one).
    status: ``ok``, or why the run did not converge (the numbers are then
      not shown), e.g. ``NC: constant prediction (2/3 seeds)``.
  """
  label: str
  method: str
  variant: str
  rho: Optional[float]
  beta: Optional[float]
  mean: np.ndarray
  std: np.ndarray
  delta_base: Optional[np.ndarray]
  delta_fedavg: Optional[float]
  status: str = "ok"


def final_spread(test_acc: np.ndarray, last: int) -> tuple[np.ndarray, np.ndarray]:
  """Mean and std f64[D + 1] percent of one cell: over seeds, or over the final rounds for one seed.

  With 2+ seeds: mean and population std over seeds of each seed's mean over
  the final ``last`` rounds. With one seed (the paper's protocol) the only
  spread left is across the final rounds, as in grid.py's summary.csv.

  Args:
    test_acc: [S, T, D] accuracy fractions.
  """
  if test_acc.shape[0] >= 2:
    per_seed = final_accuracy(test_acc, last)
    return per_seed.mean(axis=0), per_seed.std(axis=0)
  per_round = final_accuracy(test_acc[0, -last:, None, :], 1)  # each final round as a "seed"
  return per_round.mean(axis=0), per_round.std(axis=0)


def final_accuracy(test_acc: np.ndarray, last: int) -> np.ndarray:
  """f64[S, D + 1] percent: each seed's mean over the final ``last`` rounds, then AVG.

  Args:
    test_acc: [S, T, D] accuracy fractions of one method.
  """
  per_domain = 100.0 * np.asarray(test_acc, np.float64)[:, -last:].mean(axis=1)
  return np.concatenate([per_domain, per_domain.mean(axis=-1, keepdims=True)], axis=-1)


def convergence_status(test_acc: np.ndarray, predicted_classes: np.ndarray, nonfinite_updates: int,
                       last: int) -> str:
  """``ok`` or the reason a run is reported as non-converged (NC).

  NC when, in any seed, the accuracy is NaN in the final rounds, or the global
  model predicts one class on every domain's test nodes through all of the
  final ``last`` rounds (a collapsed model: its accuracy is only the majority
  share). Skipped non-finite client updates are noted but are not NC.

  Args:
    test_acc: [S, T, D]. predicted_classes: [S, T, D] distinct predicted
      classes per domain. nonfinite_updates: client updates left out.
  """
  seeds = test_acc.shape[0]
  nan = np.isnan(test_acc[:, -last:]).any(axis=(1, 2))
  constant = (predicted_classes[:, -last:] <= 1).all(axis=(1, 2))
  if nan.any():
    return f"NC: NaN accuracy ({int(nan.sum())}/{seeds} seeds)"
  if constant.any():
    return f"NC: constant prediction ({int(constant.sum())}/{seeds} seeds)"
  if nonfinite_updates:
    return f"ok ({nonfinite_updates} non-finite client updates skipped)"
  return "ok"


def converged(row: TableRow) -> bool:
  return row.status.startswith("ok")


def _pm(mean: float, std: float) -> str:
  return "nan" if math.isnan(mean) else f"{mean:.2f}±{std:.2f}"


def _signed(value: Optional[float]) -> str:
  return "" if value is None or math.isnan(value) else f"{value:+.2f}"


def _mark(value: Optional[float]) -> str:
  """▲ gain, ▼ loss (at the table's 0.01 resolution), blank otherwise."""
  if value is None or math.isnan(value) or abs(value) < 0.005:
    return ""
  return "▲" if value > 0 else "▼"


def _hparams(row: TableRow) -> str:
  if row.rho is None:
    return ""
  return f"ρ={row.rho:g}" + ("" if row.beta is None else f", β={row.beta:g}")


def to_markdown(rows: Sequence[TableRow], domains: Sequence[str], title: str = "") -> str:
  """A Markdown table: mean±std per domain and AVG, ▲/▼ with the change against the base row."""
  header = ["Method", "(ρ, β)", *domains, "AVG", "Δ base", "Δ FedAvg"]
  lines = [f"**{title}**", ""] if title else []
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    if not converged(row):
      cells = [row.label, _hparams(row)] + [row.status] + [""] * (len(domains) + 2)
      lines.append("| " + " | ".join(cells) + " |")
      continue
    values = []
    for j in range(len(domains) + 1):
      delta = None if row.delta_base is None else row.delta_base[j]
      mark = f" {_mark(delta)}{_signed(delta)}" if _mark(delta) else ""
      values.append(_pm(row.mean[j], row.std[j]) + mark)
    delta_base = None if row.delta_base is None else row.delta_base[-1]
    lines.append("| " + " | ".join([row.label, _hparams(row), *values, _signed(delta_base),
                                    _signed(row.delta_fedavg)]) + " |")
  return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[TableRow], domains: Sequence[str]) -> str:
  """CSV text, one row per method, numbers unformatted (percent, percentage points)."""
  names = list(domains) + ["AVG"]
  columns = (["method", "base", "variant", "rho", "beta", "status"]
             + [f"{d}_{stat}" for d in names for stat in ("mean", "std")]
             + [f"{d}_delta_base" for d in names] + ["delta_fedavg"])
  out = io.StringIO()
  writer = csv.writer(out, lineterminator="\n")
  writer.writerow(columns)
  for row in rows:
    stats = [f"{v:.4f}" for pair in zip(row.mean, row.std) for v in pair]
    deltas = ([""] * len(names) if row.delta_base is None
              else [f"{v:.4f}" for v in row.delta_base])
    writer.writerow([row.label, row.method, row.variant,
                     "" if row.rho is None else f"{row.rho:g}",
                     "" if row.beta is None else f"{row.beta:g}", row.status, *stats, *deltas,
                     "" if row.delta_fedavg is None else f"{row.delta_fedavg:.4f}"])
  return out.getvalue()


def _latex_escape(text: str) -> str:
  for plain, latex in (("_", r"\_"), ("%", r"\%"), ("&", r"\&"), ("ρ", r"$\rho$"),
                       ("β", r"$\beta$")):
    text = text.replace(plain, latex)
  return text


def to_latex(rows: Sequence[TableRow], domains: Sequence[str], caption: str = "") -> str:
  """A LaTeX ``table`` (booktabs): mean$\\pm$std, gains/losses against the base row as superscripts.

  The last column is the change of AVG against FedAvg.
  """
  names = [_latex_escape(d) for d in domains] + ["AVG"]
  lines = [r"% needs \usepackage{booktabs}", r"\begin{table}[t]", r"\centering", r"\small",
           r"\begin{tabular}{l" + "c" * (len(names) + 1) + "}", r"\toprule",
           "Method & " + " & ".join(names) + r" & $\Delta$ FedAvg \\", r"\midrule"]
  for i, row in enumerate(rows):
    label = _latex_escape(row.label + (f" ({_hparams(row)})" if _hparams(row) else ""))
    if not converged(row):
      lines.append(f"{label} & \\multicolumn{{{len(names) + 1}}}{{c}}"
                   f"{{{_latex_escape(row.status)}}}" r" \\")
      continue
    cells = []
    for j in range(len(names)):
      cell = f"${row.mean[j]:.2f}_{{\\pm {row.std[j]:.2f}}}"
      delta = None if row.delta_base is None else row.delta_base[j]
      if _mark(delta):
        arrow = r"\uparrow" if delta > 0 else r"\downarrow"
        cell += f"^{{{arrow}{abs(delta):.2f}}}"
      cells.append(cell + "$")
    cells.append(f"${_signed(row.delta_fedavg)}$" if _signed(row.delta_fedavg) else "")
    lines.append(f"{label} & " + " & ".join(cells) + r" \\")
    if row.variant == "+FedIA" and i + 1 < len(rows):
      lines.append(r"\midrule")
  lines += [r"\bottomrule", r"\end{tabular}"]
  if caption:
    lines.append(f"\\caption{{{_latex_escape(caption)}}}")
  lines.append(r"\end{table}")
  return "\n".join(lines) + "\n"


def write_tables(rows: Sequence[TableRow], domains: Sequence[str], stem, title: str) -> None:
  """Writes ``<stem>.csv``, ``<stem>.tex`` and, last (it marks a finished run), ``<stem>.md``."""
  report.write_text(f"{stem}.csv", to_csv(rows, domains))
  report.write_text(f"{stem}.tex", to_latex(rows, domains, title))
  report.write_text(f"{stem}.md", to_markdown(rows, domains, title))
