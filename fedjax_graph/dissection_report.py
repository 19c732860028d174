"""Dissection report: the update-field figures of Sec. 3.2 (Figs. 2-5, eqs 2-4).

Plots and tabulates the checkpoint diagnostics of
``diagnostics.round_diagnostics`` for several ``<backbone>/<aggregator>``
runs: salient-set overlap (GSI, Finding 1), directional alignment (Finding 2),
domain factors vs retention (Finding 3) and the signal-dilution histograms
(eqs. 3-4). Every plotted number also goes to a CSV; all writes are atomic.

The summaries come from the host-side half of ``fedjax_graph.diagnostics``,
which imports jax at load time; it is imported lazily, so importing this
module stays jax-free while calling :func:`write_dissection` needs jax
installed (no accelerator).

Shapes follow ``fedjax_graph/types.py`` (C clients, D domains, S seeds, T
rounds) plus K recorded checkpoints and L parameter leaves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from fedjax_graph import report

FACTOR_LABELS = {"homophily_gap": "homophily gap\n|h_a − h_b|",
                 "feature_distance": "feature-mean\nL2 distance",
                 "label_js": "label JS\ndivergence",
                 "degree_distance": "log-degree hist.\nL1 distance"}
OVERLAP_COLUMNS = ("run", "backbone", "aggregator", "round", "seed",
                   "mean_offdiag", "mean_within_domain", "mean_cross_domain",
                   "random_reference", "frac_negative_cross_domain",
                   "mean_abs_cos_cross_domain", "mean_cos_to_aggregate",
                   "mean_retention")
_COLORS = colormaps["tab10"].colors


def _diagnostics():
  # Deferred: diagnostics imports jax at module level (see module docstring).
  from fedjax_graph import diagnostics
  return diagnostics


def _figure(width: float, height: float, rows: int = 1, cols: int = 1,
            head: float = 1.0, sharey: bool = False,
            **grid: Any) -> tuple[Figure, np.ndarray]:
  """An Agg figure and its [rows, cols] axes, ``head`` inches left on top.

  Spacing is set by hand: constrained layout costs one more full draw per
  figure, and ``report.save_figure`` already crops to a tight box.
  """
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig, fig.subplots(rows, cols, squeeze=False, sharey=sharey,
                           gridspec_kw={"top": 1.0 - head / height, **grid})


def _save(fig: Figure, path: str, suptitle: str) -> None:
  """Saves atomically with ``suptitle`` just above the top row's titles."""
  # Anchored at the top edge and growing upwards, so no figure needs to
  # reserve room for it; the tight bounding box then includes it.
  fig.suptitle(suptitle, y=1.0, va="bottom", fontsize=10)
  report.save_figure(fig, path)


def _check(runs, num_k, client_domain, domains, num_l, factors) -> None:
  """Raises ValueError naming the first inconsistent input."""
  dg = _diagnostics()
  num_c, num_d = client_domain.size, len(domains)
  if not runs or not num_k or not factors:
    raise ValueError("runs, checkpoints and factors must all be non-empty")
  if client_domain.min(initial=0) < 0 or client_domain.max(initial=0) >= num_d:
    raise ValueError(f"client_domain must index the {num_d} domains")
  for name, m in factors.items():
    if np.shape(m) != (num_d, num_d):
      raise ValueError(f"factor {name} has shape {np.shape(m)}, not (D, D)")
  for key, run in runs.items():
    if key.count("/") != 1:
      raise ValueError(f"run key {key!r} must be '<backbone>/<aggregator>'")
    s = max(np.shape(run.get("jaccard"))[:1] + (1,))
    want = {"jaccard": (s, num_k, num_c, num_c),
            "cosine": (s, num_k, num_c, num_c),
            "cos_to_aggregate": (s, num_k, num_c),
            "retention": (s, num_k, num_c),
            "active_share_hist": (s, num_k, num_l,
                                  dg.ACTIVE_SHARE_EDGES.size - 1),
            "dilution_hist": (s, num_k, num_l, dg.DILUTION_EDGES.size - 1)}
    for name, shape in want.items():
      if np.shape(run.get(name)) != shape:  # A missing array has shape ().
        raise ValueError(f"{key}: {name} has shape "
                         f"{np.shape(run.get(name))}, expected {shape}")


def _summaries(run, client_domain) -> dict[str, np.ndarray]:
  """Per-(seed, checkpoint) means of one run: ``{column: f64[S, K]}``."""
  dg = _diagnostics()
  jac = dg.pair_summary(run["jaccard"], client_domain)
  abs_cos = dg.cross_domain_abs_cosine(run["cosine"], client_domain)
  return {
      "mean_offdiag": jac["mean_offdiag"],
      "mean_within_domain": jac["mean_within_domain"],
      "mean_cross_domain": jac["mean_cross_domain"],
      "frac_negative_cross_domain": dg.frac_negative_cross_domain(
          run["cosine"], client_domain),
      # One domain: no cross pair; NaN rather than a mean-of-empty warning.
      "mean_abs_cos_cross_domain": (abs_cos.mean(-1) if abs_cos.shape[-1] else
                                    np.full(abs_cos.shape[:-1], np.nan)),
      "mean_cos_to_aggregate": np.mean(run["cos_to_aggregate"], axis=-1),
      "mean_retention": np.mean(run["retention"], axis=-1)}


def _matrix_panel(ax, matrix, order, sorted_domain, domains, cmap, norm):
  """Draws a [C, C] client matrix ordered by domain, domain blocks boxed.

  The diagonal (self-pairs) is masked grey so the off-diagonal pairs get the
  whole colour range. Returns the image for a colorbar.
  """
  m = np.asarray(matrix, np.float64)[np.ix_(order, order)]
  m[np.eye(m.shape[0], dtype=bool)] = np.nan
  image = ax.imshow(np.ma.masked_invalid(m), norm=norm, interpolation="none",
                    cmap=colormaps[cmap].with_extremes(bad="lightgrey"))
  ticks = []
  for d in np.unique(sorted_domain):
    idx = np.flatnonzero(sorted_domain == d)
    ax.add_patch(Rectangle((idx[0] - 0.5, idx[0] - 0.5), idx.size, idx.size,
                           fill=False, edgecolor="black", linewidth=1.5))
    ticks.append((idx.mean(), domains[d]))
  # One tick per domain block stays readable up to C=30 clients and beyond.
  pos, names = zip(*ticks)
  ax.set_xticks(pos, names, rotation=90, fontsize=7)
  ax.set_yticks(pos, names, fontsize=7)
  ax.set_xlabel("client (ordered by domain)")
  ax.set_ylabel("client (ordered by domain)")
  return image


def _offdiag_max(mats: np.ndarray) -> float:
  """Largest |off-diagonal entry| of f[..., C, C]; 1 when C = 1."""
  off = ~np.eye(mats.shape[-1], dtype=bool)
  return max(float(np.nanmax(np.abs(mats[..., off]))), 1e-6) if off.any() \
      else 1.0


def _plot_jaccard(path, key, jac, offdiag, checkpoints, order, sorted_domain,
                  domains, title) -> None:
  """Figure 2: seed-0 GSI matrix per checkpoint on one colour scale."""
  num_k = len(checkpoints)
  norm = Normalize(0.0, _offdiag_max(jac[0]))
  fig, axes = _figure(3.3 * num_k + 1.5, 3.4, 1, num_k, 0.45, wspace=0.45)
  for k, ax in enumerate(axes[0]):
    image = _matrix_panel(ax, jac[0, k], order, sorted_domain, domains,
                          "viridis", norm)
    ax.set_title(f"round {checkpoints[k]}\nmean off-diagonal "
                 f"{offdiag[0, k]:.3f}", fontsize=9)
    ax.set_anchor("N")  # Spare height goes to the bottom, which is cropped.
    if k:  # One y label per row: the panels sit close together.
      ax.set_ylabel("")
  fig.colorbar(image, ax=list(axes[0]), shrink=0.8, panchor=False,
               label="GSI = |S_i∩S_j| / |S_i∪S_j| (0–1)")
  _save(fig, path, f"{title}: {key}, overlap of top-salient coordinate sets "
        "(GSI, eq. 2), seed 0\nboxes = domain blocks, grey = self-pairs")


def _band(ax, x, values, color, style, label=None) -> None:
  """Mean over seeds of f[S, K], with a ±1 std band (ddof=0) when S >= 2."""
  mean = values.mean(axis=0)
  ax.plot(x, mean, style, color=color, marker="o", label=label)
  if values.shape[0] >= 2:
    std = values.std(axis=0)
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15,
                    linewidth=0)


def _plot_overlap(path, summaries, checkpoints, reference, top, title) -> None:
  """Mean GSI vs round per run: all pairs left, within/cross-domain right."""
  fig, ((left, right),) = _figure(11.0, 4.0, 1, 2, 0.35, True, wspace=0.05)
  for r, (key, s) in enumerate(summaries.items()):
    color = _COLORS[r % len(_COLORS)]
    _band(left, checkpoints, s["mean_offdiag"], color, "-",
          f"{key} (S={s['mean_offdiag'].shape[0]})")
    _band(right, checkpoints, s["mean_within_domain"], color, "--")
    _band(right, checkpoints, s["mean_cross_domain"], color, ":")
  ref = Line2D([], [], color="grey", label=f"random-set reference p/(2−p) = "
               f"{reference:.4f} (p = {top:g})")
  for ax in (left, right):
    ax.axhline(reference, color="grey", linewidth=1.2)
    ax.set_xticks(checkpoints)
    ax.set_xlabel("checkpoint (communication round)")
    ax.grid(alpha=0.3)
  left.legend(handles=left.get_legend_handles_labels()[0] + [ref], fontsize=8)
  right.legend(handles=[
      Line2D([], [], color="black", linestyle="--",
             label="within-domain pairs"),
      Line2D([], [], color="black", linestyle=":", label="cross-domain pairs"),
      ref], fontsize=8)
  left.set_ylim(bottom=0.0)
  left.set_ylabel("mean Jaccard overlap of top-p sets (0–1)")
  left.set_title("all client pairs i ≠ j (colour = run)", fontsize=9)
  right.set_title("within- vs cross-domain pairs (colours as left)",
                  fontsize=9)
  _save(fig, path, f"{title}: salient-set overlap (GSI) over training, mean "
        "over seeds (band: ±1 std when S ≥ 2)")


def _groups(keys) -> tuple[list[str], list[str]]:
  """Backbones and aggregators in order of first appearance in ``keys``."""
  parts = [k.split("/") for k in keys]
  return (list(dict.fromkeys(b for b, _ in parts)),
          list(dict.fromkeys(a for _, a in parts)))


def _plot_abs_cosine(path, runs, client_domain, last_round, title) -> None:
  """Figure 3: |cos| of cross-domain pairs, violins grouped by backbone."""
  dg = _diagnostics()
  backbones, aggregators = _groups(runs)
  fig, ((ax,),) = _figure(max(5.0, 1.3 * len(runs) + 2.0), 4.4, head=0.6)
  for key, run in runs.items():
    b, a = key.split("/")
    pos = backbones.index(b) * (len(aggregators) + 1) + aggregators.index(a)
    vals = dg.cross_domain_abs_cosine(run["cosine"][:, -1],
                                      client_domain).ravel()
    if not vals.size:
      continue
    body = ax.violinplot([vals], [pos], showextrema=False)["bodies"][0]
    body.set_facecolor(_COLORS[aggregators.index(a) % len(_COLORS)])
    body.set_alpha(0.6)
    if vals.size <= 100:  # Dots only while they stay distinguishable.
      ax.scatter(np.full(vals.size, pos), vals, s=6, color="black",
                 alpha=0.4)
    ax.plot([pos - 0.3, pos + 0.3], [vals.mean()] * 2, color="black")
    ax.annotate(f"n={vals.size}\nmean {vals.mean():.3f}", (pos, 1.02),
                ha="center", fontsize=7)
  ax.set_xticks([i * (len(aggregators) + 1) + (len(aggregators) - 1) / 2
                 for i in range(len(backbones))], backbones)
  ax.set_xlabel("backbone")
  ax.set_ylim(0.0, 1.12)
  ax.set_yticks(np.linspace(0.0, 1.0, 6))
  ax.set_ylabel("|cos θ| between client updates (0–1)")
  ax.legend(handles=[Patch(color=_COLORS[i % len(_COLORS)], alpha=0.6, label=a)
                     for i, a in enumerate(aggregators)]
            + [Line2D([], [], color="black", label="mean")], fontsize=8,
            title="aggregator", loc="upper left", bbox_to_anchor=(1.01, 1.0))
  ax.set_title(f"{title}: cross-domain alignment magnitude at round "
               f"{last_round}\n(n pairs i<j of different domains, pooled over "
               "seeds; dots = pairs when n ≤ 100)", fontsize=10)
  report.save_figure(fig, path)


def _plot_alignment(path, runs, summaries, order, sorted_domain, domains,
                    last_round, title) -> None:
  """Figure 4: seed-0 signed cosine matrix and cos(u_k, ū) bars per run."""
  num_c = sorted_domain.size
  lim = max(_offdiag_max(r["cosine"][0, -1]) for r in runs.values())
  fig, axes = _figure(11.0, 3.6 * len(runs), len(runs), 2, 0.5,
                      width_ratios=[1.0, 1.6], hspace=0.6, wspace=0.55)
  for (key, run), (mat_ax, bar_ax) in zip(runs.items(), axes):
    image = _matrix_panel(mat_ax, run["cosine"][0, -1], order, sorted_domain,
                          domains, "RdBu_r", Normalize(-lim, lim))
    mat_ax.set_title(f"{key}\nsigned cosine of client updates, seed 0",
                     fontsize=9)
    cta = np.asarray(run["cos_to_aggregate"], np.float64)[:, -1][:, order]
    bar_ax.bar(np.arange(num_c), cta.mean(axis=0),
               yerr=cta.std(axis=0) if cta.shape[0] >= 2 else None,
               color=[_COLORS[d % len(_COLORS)] for d in sorted_domain])
    bar_ax.axhline(0.0, color="black", linewidth=0.8)
    bar_ax.set_xticks(np.arange(0, num_c, max(1, -(-num_c // 15))))
    bar_ax.set_xlabel("client (ordered by domain)")
    bar_ax.set_ylabel("cos(u_k, ū), ū = FedAvg-weighted\nmean of this run's updates")
    s = summaries[key]
    bar_ax.set_title(
        f"{key} (means over S={cta.shape[0]} seeds)\nnegative cross-domain "
        f"pairs {100 * s['frac_negative_cross_domain'][:, -1].mean():.1f}%, "
        f"mean cos(u_k, ū) {s['mean_cos_to_aggregate'][:, -1].mean():.3f}",
        fontsize=9)
    fig.colorbar(image, ax=mat_ax, location="right", pad=0.04, fraction=0.05,
                 label="signed cosine")
  axes[0, 1].legend(handles=[Patch(color=_COLORS[d % len(_COLORS)],
                                   label=domains[d])
                             for d in np.unique(sorted_domain)],
                    fontsize=7, title="domain", title_fontsize=7,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
  _save(fig, path, f"{title}: directional alignment at round {last_round} "
        "(boxes = domain blocks; error bars = ±1 std over seeds)")


def _plot_factors(path, assoc, title) -> None:
  """Figure 5: Spearman ρ per factor, a bar per backbone, a panel per agg."""
  backbones, aggregators = _groups(assoc)
  factors = list(next(iter(assoc.values())))
  width = 0.8 / len(backbones)
  fig, axes = _figure(4.2 * len(aggregators) + 0.8, 3.8, 1, len(aggregators),
                      0.35, True, wspace=0.05)
  for ax, a in zip(axes[0], aggregators):
    for i, b in enumerate(backbones):
      rho = np.array([assoc.get(f"{b}/{a}", {}).get(f, np.nan)
                      for f in factors])
      x = np.arange(len(factors)) + (i - (len(backbones) - 1) / 2) * width
      ax.bar(x, np.nan_to_num(rho), width, color=_COLORS[i % len(_COLORS)],
             label=b)
      for xi in x[~np.isfinite(rho)]:
        ax.annotate("n/a", (xi, 0.02), ha="center", fontsize=7)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(factors)),
                  [FACTOR_LABELS.get(f, f.replace("_", " ")) for f in factors],
                  fontsize=8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xlabel("domain factor")
    ax.set_title(f"aggregator: {a}", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  axes[0, 0].set_ylabel("Spearman ρ with retention (−1 to 1)")
  axes[0, 0].legend(title="backbone", fontsize=8, title_fontsize=8)
  _save(fig, path, f"{title}: domain factors vs salient-set retention after "
        "aggregation\none point per client: its domain's mean discrepancy to "
        "the other domains vs its retention\n(mean over checkpoints and "
        "seeds); n/a: ρ undefined, one side constant up to float noise; few "
        "domains give few distinct values")


def _plot_dilution(path, hists, leaf_names, last_round, title) -> None:
  """Eqs. 3-4: per-leaf r_d and dilution-ratio histograms as % of the leaf."""
  dg = _diagnostics()
  fig, axes = _figure(11.0, 3.4 * len(hists), len(hists), 2, 0.5,
                      hspace=0.7, wspace=0.35)
  for (key, (active, ratio)), (ax_r, ax_d) in zip(hists.items(), axes):
    for ax, counts, edges in ((ax_r, active, dg.ACTIVE_SHARE_EDGES),
                              (ax_d, ratio, dg.DILUTION_EDGES)):
      for leaf, row in zip(leaf_names, counts):
        ax.stairs(100 * row / max(row.sum(), 1), edges, label=leaf,
                  linewidth=1.5)
      ax.set_xticks(edges, [f"{e:g}" for e in edges], fontsize=7, rotation=45)
      ax.set_ylabel("% of the leaf's counted coordinates")
      ax.grid(alpha=0.3)
    ax_r.set_xlabel("active share r_d (eq. 3): weight of clients with d "
                    "salient")
    ax_d.set_xlabel("dilution ratio ū_d / μ_act,d (eq. 4; end bins open)")
    ax_r.set_title(f"{key}\nactive share r_d per coordinate", fontsize=9)
    # active counts every coordinate, so the difference is the excluded ones.
    ax_d.set_title(f"{key}\ndilution ratio; no active client (μ_act = 0), "
                   f"excluded: {active.sum() - ratio.sum():.0f} of "
                   f"{active.sum():.0f}", fontsize=9)
  # Same leaves in every row: one legend, outside, hides no bin.
  axes[0, 1].legend(title="parameter leaf", fontsize=8, title_fontsize=8,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
  _save(fig, path, f"{title}: signal dilution at round {last_round}, "
        "coordinate counts summed over seeds")


def _run_rows(key, run, s, checkpoints, client_domain, domains, leaf_names,
              reference):
  """Rows of overlap.csv, pairs.csv, clients.csv and dilution.csv for a run."""
  dg = _diagnostics()
  b, a = key.split("/")
  names = [domains[d] for d in client_domain]
  overlap, pairs, clients, dilution = [], [], [], []
  for seed in range(run["jaccard"].shape[0]):
    for k, rnd in enumerate(checkpoints):
      cells = {"run": key, "backbone": b, "aggregator": a, "round": rnd,
               "seed": seed, "random_reference": reference,
               **{c: v[seed, k] for c, v in s.items()}}
      overlap.append({c: cells[c] for c in OVERLAP_COLUMNS})
      head = {"run": key, "round": rnd, "seed": seed}
      pairs += [{**head, "i": i, "j": j, "domain_i": names[i],
                 "domain_j": names[j],
                 "jaccard": run["jaccard"][seed, k, i, j],
                 "cosine": run["cosine"][seed, k, i, j]}
                for i, j in np.ndindex(len(names), len(names))]
      clients += [{**head, "client": c, "domain": names[c],
                   "cos_to_aggregate": run["cos_to_aggregate"][seed, k, c],
                   "retention": run["retention"][seed, k, c]}
                  for c in range(len(names))]
  for k, rnd in enumerate(checkpoints):
    for kind, hist, edges in (
        ("active_share", run["active_share_hist"], dg.ACTIVE_SHARE_EDGES),
        ("dilution_ratio", run["dilution_hist"], dg.DILUTION_EDGES)):
      for leaf, row in zip(leaf_names, np.sum(hist[:, k], axis=0)):
        dilution += [{"run": key, "round": rnd, "leaf": leaf, "kind": kind,
                      "bin_lo": lo, "bin_hi": hi, "count": int(round(n)),
                      "share": n / row.sum() if row.sum() else np.nan}
                     for lo, hi, n in zip(edges[:-1], edges[1:], row)]
  return overlap, pairs, clients, dilution


def write_dissection(out_dir: str | os.PathLike,
                     runs: Mapping[str, Mapping[str, Any]],
                     checkpoints: Sequence[int], client_domain: Any,
                     domains: Sequence[str], leaf_names: Sequence[str],
                     top: float, factors: Mapping[str, Any],
                     title: str) -> dict[str, Any]:
  """Writes the Sec. 3.2 dissection figures, CSVs and headline numbers.

  Files in ``out_dir``: ``jaccard_<backbone>_<aggregator>.png`` per run,
  ``overlap_curves.png``, ``abs_cosine.png``, ``alignment.png``,
  ``factor_association.png``, ``dilution.png``; ``overlap.csv``,
  ``pairs.csv``, ``clients.csv`` (every seed and checkpoint),
  ``factor_association.csv``, ``domain_factors.csv``, ``dilution.csv``
  (every checkpoint, counts summed over seeds, plus ``share``: the count
  over its leaf's counted coordinates, as plotted); ``headline.json``.
  Matrix panels show seed 0; CSV floats have 4 decimals, NaN as ``nan``.

  Args:
    out_dir: Destination directory, created if missing.
    runs: ``{"<backbone>/<aggregator>": run}``; each run holds ``jaccard``
      f[S, K, C, C], ``cosine`` f[S, K, C, C], ``cos_to_aggregate``
      f[S, K, C], ``retention`` f[S, K, C], ``active_share_hist``
      f[S, K, L, 10] and ``dilution_hist`` f[S, K, L, 12] (bins of
      ``diagnostics.ACTIVE_SHARE_EDGES`` / ``DILUTION_EDGES``). Other keys
      (``test_acc``) are ignored; S may differ between runs.
    checkpoints: The K recorded rounds, 1-based, increasing.
    client_domain: int[C] domain index of each client.
    domains: The D domain names.
    leaf_names: The L parameter-leaf names, e.g. ``"layer_0/kernel"``.
    top: Salient share p in (0, 1].
    factors: ``{name: f[D, D]}`` from ``diagnostics.domain_factors``.
    title: Dataset/setting, shown in every figure title.

  Returns:
    The content of ``headline.json``: ``title``, ``top``,
    ``random_reference`` (p/(2−p)), ``first_round``, ``last_round`` and
    ``runs``, per run the mean over seeds of ``mean_offdiag_first`` and
    ``mean_offdiag_last`` (GSI at the first/last checkpoint),
    ``frac_negative_cross_domain_last`` and ``mean_cos_to_aggregate_last``.

  Raises:
    ValueError: On inconsistent shapes, a malformed run key or empty input;
      nothing is written then.
  """
  dg = _diagnostics()
  client_domain = np.asarray(client_domain).astype(np.int64).reshape(-1)
  checkpoints = [int(c) for c in checkpoints]
  _check(runs, len(checkpoints), client_domain, domains, len(leaf_names),
         factors)
  runs = {k: {n: np.asarray(v, np.float64) for n, v in r.items()}
          for k, r in runs.items()}
  out = lambda name: os.path.join(os.fspath(out_dir), name)
  reference = dg.random_overlap_reference(top)
  order = np.argsort(client_domain, kind="stable")
  sorted_domain, last = client_domain[order], checkpoints[-1]
  summaries = {k: _summaries(r, client_domain) for k, r in runs.items()}
  tables = {n: [] for n in ("overlap", "pairs", "clients", "dilution")}
  assoc, headline = {}, {
      "title": title, "top": float(top), "random_reference": reference,
      "first_round": checkpoints[0], "last_round": last, "runs": {}}
  for key, run in runs.items():
    s = summaries[key]
    _plot_jaccard(out(f"jaccard_{key.replace('/', '_')}.png"), key,
                  run["jaccard"], s["mean_offdiag"], checkpoints, order,
                  sorted_domain, domains, title)
    for name, rows in zip(tables, _run_rows(key, run, s, checkpoints,
                                            client_domain, domains,
                                            leaf_names, reference)):
      tables[name] += rows
    # Mean over checkpoints per seed; factor_association then averages the
    # seeds, so each client is one observation.
    assoc[key] = dg.factor_association(factors, run["retention"].mean(axis=1),
                                       client_domain)
    headline["runs"][key] = {
        "mean_offdiag_first": float(s["mean_offdiag"][:, 0].mean()),
        "mean_offdiag_last": float(s["mean_offdiag"][:, -1].mean()),
        "frac_negative_cross_domain_last": float(
            s["frac_negative_cross_domain"][:, -1].mean()),
        "mean_cos_to_aggregate_last": float(
            s["mean_cos_to_aggregate"][:, -1].mean())}
  _plot_overlap(out("overlap_curves.png"), summaries, checkpoints, reference,
                top, title)
  _plot_abs_cosine(out("abs_cosine.png"), runs, client_domain, last, title)
  _plot_alignment(out("alignment.png"), runs, summaries, order, sorted_domain,
                  domains, last, title)
  _plot_factors(out("factor_association.png"), assoc, title)
  _plot_dilution(out("dilution.png"), {
      k: (r["active_share_hist"][:, -1].sum(0),
          r["dilution_hist"][:, -1].sum(0))
      for k, r in runs.items()}, leaf_names, last, title)
  tables["factor_association"] = [
      {"backbone": k.split("/")[0], "aggregator": k.split("/")[1],
       "factor": f, "spearman_rho": rho}
      for k, per in assoc.items() for f, rho in per.items()]
  tables["domain_factors"] = [
      {"factor": f, "domain_i": domains[i], "domain_j": domains[j],
       "value": np.asarray(m, np.float64)[i, j]}
      for f, m in factors.items() for i, j in np.ndindex(np.shape(m))]
  for name, rows in tables.items():
    report.write_summary_csv(rows, out(f"{name}.csv"))
  report.write_json(out("headline.json"), headline)
  return headline
