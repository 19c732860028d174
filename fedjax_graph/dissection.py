"""The dissection experiment: what clients upload, per backbone and aggregator.

Reproduces the update-level analysis of the FedIA paper (Sec. 3.2, Findings
1-3, Figures 2-5) on any dataset preset: for each backbone, one compiled sweep
runs the requested aggregators side by side with the diagnostics of
``fedjax_graph.diagnostics`` computed inside the jitted rounds at the
checkpoint rounds; the host then adds the domain discrepancies and writes the
figures and CSVs (``dissection_report``). ``experiments/diagnose.py`` is its
command line.
"""

import pathlib
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_graph import cells as cells_lib
from fedjax_graph import diagnostics, dissection_report, report
from fedjax_graph.config import load_preset
from fedjax_graph.controls import RunControls
from fedjax_graph.data import build_federation, load_dataset
from fedjax_graph.models import BACKBONES
from fedjax_graph.rundir import (check_run_args, claimed, default_out_dir, prepare_out_dir,
                                 provenance, remove_outputs)
from fedjax_graph.simulation import DiagnosticsSpec
from fedjax_graph.sweep import run_sweep

AGGREGATORS = ("fedavg", "fedia")


def leaf_names(params) -> list[str]:
  """'layer_0/kernel'-style names of the parameter leaves, in ``jax.tree.leaves`` order."""
  paths, _ = jax.tree_util.tree_flatten_with_path(params)
  return ["/".join(str(getattr(k, "key", k)) for k in path if getattr(k, "key", k) != "params")
          for path, _ in paths]


def run_diagnose(dataset: str, setting: Optional[str], backbones: Sequence[str],
                 aggregators: Sequence[str], checkpoints: Sequence[int], rounds: int,
                 seeds: Sequence[int], top: float = 0.05, rho: float = 0.5, beta: float = 0.5,
                 out_dir: Optional[pathlib.Path] = None, raw_dir=None, cache_dir=None,
                 chunk: int = 10, progress: bool = True, overwrite: bool = False,
                 domain_graphs=None, verify: bool = True) -> dict:
  """Runs every backbone x aggregator with diagnostics and writes the dissection.

  Args:
    dataset, setting: the preset (see ``config.load_preset``).
    backbones: names in ``models.BACKBONES`` (one compiled sweep each).
    aggregators: a subset of ``("fedavg", "fedia")``; FedIA uses ``rho``, ``beta``.
    checkpoints: 1-based rounds at which the diagnostics are taken, in [1, rounds].
    rounds: T. seeds: the S seeds (one batch).
    top: the salient share p of coordinates per client, in (0, 1).
    out_dir: output folder; default ``results/<dataset>-<setting>-diagnose-<timestamp>``.
    raw_dir, cache_dir, chunk, progress: as for the grid experiment.
    overwrite: replace a finished run in ``out_dir``.
    verify: check the raw files against the SNAP checksums.
    domain_graphs: already loaded domain graphs (skips ``load_dataset``).

  Returns:
    The headline numbers (see ``dissection_report.write_dissection``).

  Raises:
    ValueError: naming any bad value.
  """
  check_run_args(rounds, 1, seeds)
  controls = RunControls(chunk=chunk, progress=progress)
  checkpoints = sorted(set(int(c) for c in checkpoints))
  if not checkpoints or checkpoints[0] < 1 or checkpoints[-1] > rounds:
    raise ValueError(f"checkpoints = {checkpoints}; need at least one, each in [1, {rounds}]")
  if not 0 < top < 1:
    raise ValueError(f"top = {top}; the salient share must be in (0, 1)")
  unknown = [b for b in backbones if b not in BACKBONES]
  if unknown or not backbones:
    raise ValueError(f"backbones = {list(backbones)}; choose from {sorted(BACKBONES)}")
  unknown = [a for a in aggregators if a not in AGGREGATORS]
  if unknown or not aggregators or len(set(aggregators)) != len(aggregators):
    raise ValueError(f"aggregators = {list(aggregators)}; choose from {list(AGGREGATORS)}")
  # SFPD has no norm layer to take the preset's batch norm, and this tool has no --norm.
  configs = {b: load_preset(dataset, setting, backbone=b, **({"norm": "none"} if b == "sfpd" else {}))
             for b in backbones}
  first = configs[backbones[0]]
  cells = cells_lib.Cells([cells_lib.cell("fedia", rho=rho, beta=beta) if a == "fedia"
                           else cells_lib.cell(cells_lib.BASE) for a in aggregators])
  out_dir = pathlib.Path(out_dir) if out_dir else pathlib.Path(
      default_out_dir(first, "diagnose"))
  with claimed(out_dir):
    prepare_out_dir(out_dir, resume=False, overwrite=overwrite, finished_marker="headline.json",
                    resumable=False)
    meta = {}
    if domain_graphs is None:
      domain_graphs, meta = load_dataset(dataset, raw_dir, cache_dir, verify)
    if overwrite:
      remove_outputs(out_dir, ("headline.json", "config.json"))
    out_dir.mkdir(parents=True, exist_ok=True)

    spec = DiagnosticsSpec(rounds=tuple(checkpoints), top=top)
    index = np.asarray(checkpoints) - 1
    runs, seconds = {}, {}
    for backbone, config in configs.items():
      federation = build_federation(config, domain_graphs, seeds)
      start = time.perf_counter()
      history = run_sweep(config, federation, cells, rounds, controls, description=backbone,
                          diagnostics=spec)
      seconds[backbone] = time.perf_counter() - start
      for g, aggregator in enumerate(aggregators):
        arrays = {k: np.asarray(v[:, g][:, index])
                  for k, v in history.diagnostics._asdict().items()}
        runs[f"{backbone}/{aggregator}"] = {**arrays, "test_acc": history.test_acc[:, g]}

    model = first.model(federation.num_classes)
    names = leaf_names(model.clone(propagate_eval=False).init(
        jax.random.PRNGKey(0), jnp.zeros((1, federation.eval_x.shape[-1])), None, train=False))
    factors = diagnostics.domain_factors({d: domain_graphs[d] for d in federation.domains})
    record = {"dataset": dataset, "setting": first.setting, "backbones": list(backbones),
              "aggregators": list(aggregators), "checkpoints": checkpoints, "rounds": rounds,
              "seeds": list(seeds), "top": top, "rho": rho, "beta": beta,
              "configs": {b: c.to_dict() for b, c in configs.items()},
              "data": {"source_sha256": meta.get("source_sha256")},
              "wall_seconds": seconds, **provenance()}
    report.write_json(out_dir / "config.json", record)
    report.write_history(out_dir / "diagnostics.npz", client_domain=federation.client_domain,
                         domains=np.asarray(federation.domains),
                         checkpoints=np.asarray(checkpoints),
                         leaf_names=np.asarray(names),
                         **{f"{run}/{k}": v for run, arrays in runs.items()
                            for k, v in arrays.items()},
                         **{f"factor/{k}": v for k, v in factors.items()})
    title = f"{dataset} {first.setting}, {rounds} rounds, seeds {list(seeds)}"
    headline = dissection_report.write_dissection(
        out_dir, runs, checkpoints, federation.client_domain, list(federation.domains), names, top,
        factors, title)
    print(f"results in {out_dir}")
    return headline
