"""The grid experiment: FedAvg vs FedAvg+<aggregator> over its hyper-parameters, end to end.

Data → federation → one compiled sweep over every (seed, cell) → files:
``config.json``, ``history.npz``, ``summary.csv``, ``heatmap.png``,
``curves.png``. The simulation state is checkpointed while it runs, so an
interrupted run continues with ``resume_grid``. ``experiments/grid.py`` is its
command line.
"""

import pathlib
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from fedjax_graph import cells as cells_lib
from fedjax_graph import graphs, models, report
from fedjax_graph.checkpoint import fingerprint
from fedjax_graph.io import remove_file
from fedjax_graph.config import Config
from fedjax_graph.controls import RunControls
from fedjax_graph.data import build_federation, load_dataset
from fedjax_graph.rundir import (CHECKPOINT, check_run_args, claimed, default_out_dir,
                                 earlier_plans, marks_stopped, prepare_out_dir, provenance,
                                 read_record, record_plan, remove_outputs, resumed)
from fedjax_graph.simulation import EvalSchedule
from fedjax_graph.sweep import run_sweep

OUTPUTS = ("config.json", "history.npz", "summary.csv", "heatmap.png", "curves.png", CHECKPOINT)


def run_grid(config: Config, aggregator: str, grid: Mapping[str, Sequence[float]],
             seeds: Sequence[int], rounds: int, last: int,
             controls: RunControls = RunControls(), domain_graphs=None) -> pathlib.Path:
  """Runs FedAvg and FedAvg+<aggregator> at every grid point for every seed and writes the results.

  Args:
    config: the federation preset and training recipe.
    aggregator: a name in ``aggregators.REGISTRY`` (e.g. ``fedia``, ``gma``).
    grid: values of each of its hyper-parameters to cross (e.g. ``{"rho":
      [0.1, 0.5], "beta": [0.3, 0.9]}``: G = 4 cells, first name slowest);
      hyper-parameters left out take their defaults.
    seeds: the S seeds (vmapped with the cells).
    rounds: T. last: rounds summarised at the end, 1 <= last <= T.
    controls: data and output locations, chunks, checkpoints, policies, the
      evaluation interval (with ``eval_every`` k > 1, history.npz holds NaN
      scores and -1 predicted classes in rounds neither a multiple of k nor
      among the last; the summary reads only the last).
    domain_graphs: already loaded domain graphs (skips ``load_dataset``).

  Returns:
    The output directory.

  Raises:
    ValueError: for an invalid grid, seed list, ``rounds`` or ``last``, or an
      output folder that holds a run and no ``resume``/``overwrite``.
    sweep.NonFiniteUpdateError: under ``nonfinite="error"``.
  """
  check_run_args(rounds, last, seeds)
  grid = {name: [float(v) for v in values] for name, values in grid.items()}
  cells = cells_lib.grid(aggregator, **grid)
  out_dir = controls.out_dir or default_out_dir(config)
  with claimed(out_dir, controls.resume):
    prepare_out_dir(out_dir, controls.resume, controls.overwrite, record_key="grid")
    meta = {}
    if domain_graphs is None:
      domain_graphs, meta = load_dataset(config.dataset, controls.raw_dir, controls.cache_dir,
                                         controls.verify)
    federation = build_federation(config, domain_graphs, seeds)
    plans = earlier_plans(out_dir, controls.resume)
    if controls.overwrite:
      remove_outputs(out_dir, OUTPUTS)
    out_dir.mkdir(parents=True, exist_ok=True)

    setup = {"config": config.to_dict(), "aggregator": aggregator, "grid": grid,
             "seeds": [int(s) for s in seeds], "rounds": rounds, "chunk": controls.chunk}
    record = {**setup, "last": last, "eval_every": controls.eval_every,
              "nonfinite": controls.nonfinite, "max_memory": controls.max_memory,
              "status": "running",
              "raw_dir": controls.raw_dir and str(controls.raw_dir),
              "cache_dir": controls.cache_dir and str(controls.cache_dir),
              "num_clients": federation.num_clients,
              "buckets": [len(b) for b in federation.bucket_clients],
              # How each bucket propagates in training (graphs.operator_kind), as chosen.
              "bucket_propagation": [graphs.kind_of(shard.operator)
                                     if models.BACKBONES[config.backbone].operator else "none"
                                     for shard in federation.client_shards],
              "labels": cells.labels,
              "data": {"source_sha256": meta.get("source_sha256"),
                       "format_version": meta.get("format_version")},
              **provenance(), **plans}
    report.write_json(out_dir / "config.json", record)

    def on_plan(plan):  # how the batch runs (devices, sub-batches, memory), once chosen
      record_plan(record, plan)
      report.write_json(out_dir / "config.json", record)

    start = time.perf_counter()
    with marks_stopped(out_dir, record):
      history = run_sweep(config, federation, cells, rounds, controls,
                          description=f"{config.dataset}-{config.setting}",
                          checkpoint_path=out_dir / CHECKPOINT, fingerprint=fingerprint(setup),
                          on_plan=on_plan, last=last)
    wall = time.perf_counter() - start

    base = cells.index("FedAvg")
    grid_cells = [g for g in range(len(cells)) if g != base]
    of_grid = lambda a: np.moveaxis(a[:, grid_cells], 0, 1)  # [G, S, ...]
    of_base = lambda a: a[:, base]  # [S, ...]
    per_round = (history.test_acc, history.test_bacc, history.test_f1, history.predicted_classes,
                 history.train_loss)
    base_runs = report.Runs(*map(of_base, per_round))
    grid_runs = report.Runs(*map(of_grid, per_round))
    # The user's values, not their float32 copies (0.3, not 0.30000001).
    hparams = {name: values[grid_cells] for name, values in cells.hparam_table().items()}
    skipped = history.nonfinite.sum(axis=(0, 2, 3))  # [G'] in cell order
    domains = list(federation.domains)
    labels = [cells.labels[g] for g in grid_cells]

    prefix = aggregator  # e.g. fedia_test, gma_test
    report.write_history(
        out_dir / "history.npz", **{f"{prefix}_test": grid_runs.acc,
                                    f"{prefix}_val": of_grid(history.val_acc),
                                    f"{prefix}_test_bacc": grid_runs.bacc,
                                    f"{prefix}_test_f1": grid_runs.f1},
        fedavg_test=base_runs.acc, fedavg_val=of_base(history.val_acc),
        fedavg_test_bacc=base_runs.bacc, fedavg_test_f1=base_runs.f1, **hparams,
        seeds=np.asarray(seeds), domains=np.asarray(domains), labels=np.asarray(cells.labels),
        train_loss=history.train_loss, alpha=history.alpha,
        predicted_classes=history.predicted_classes, mask_coverage=history.mask_coverage,
        nonfinite=history.nonfinite)
    method = f"fedavg+{aggregator}"
    rows = report.summarize(base_runs, grid_runs, hparams, domains, last,
                            skipped=np.concatenate([skipped[[base]], skipped[grid_cells]]),
                            cell_method=method)
    title = (f"{config.dataset} {config.setting}, {config.backbone}, {rounds} rounds, "
             f"seeds {list(seeds)}")
    report.plot_heatmap(rows, out_dir / "heatmap.png", title=title)
    evaluated = EvalSchedule(controls.eval_every, rounds - last).evaluated(np.arange(rounds))
    report.plot_curves(base_runs.acc, grid_runs.acc, rows, out_dir / "curves.png", title, last=last,
                       evaluated=evaluated)
    report.write_json(out_dir / "config.json", {**record, "status": "finished",
                                                "wall_seconds_this_call": wall,
                                                "chunk_seconds_this_call": history.seconds})
    # summary.csv marks the run finished (rundir.prepare_out_dir): written last, so a run
    # stopped before it can still be resumed from its checkpoint.
    report.write_summary_csv(rows, out_dir / "summary.csv")
    remove_file(out_dir / CHECKPOINT)

    for warning in report.degenerate_warnings(base_runs, grid_runs, labels, domains, last, seeds):
      print(f"warning: {warning}")
    best = report.best_cell(rows)
    print(report.format_table(rows, max_rows=10))
    values = ", ".join(f"{name}={best[name]:g}" for name in hparams)
    if len(seeds) > 1:
      ci = best["delta_avg_ci"]
      spread = (f" ± {ci:.2f}, paired 95 % interval over seeds"
                + ("; it includes 0" if abs(best["delta_avg"]) <= ci else ""))
    else:
      spread = "; 1 seed: no interval"
    print(f"best cell on test AVG (optimistic): {values}: AVG {best['avg_mean']:.2f}% "
          f"({best['delta_avg']:+.2f}{spread} vs FedAvg); {rounds} rounds of {len(cells)} cells x "
          f"{len(seeds)} seed(s) in {wall:.1f} s")
    if skipped.sum():
      print(f"{int(skipped.sum())} non-finite client update(s) were left out (see summary.csv)")
    print(f"results in {out_dir}")
    return out_dir


def resume_grid(out_dir: pathlib.Path, controls: RunControls = RunControls(),
                domain_graphs=None, nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished grid run in ``out_dir`` with the setup in its config.json.

  Args:
    out_dir: the run's folder.
    controls: only ``raw_dir``, ``cache_dir`` (None: those the run was started
      with), ``progress`` and ``verify`` apply; the rest is the run's own.
    domain_graphs: as for ``run_grid``.
    nonfinite: a new non-finite policy (it does not change the trajectory,
      e.g. ``skip`` to get past a run stopped by ``error``); None keeps the run's.

  Raises:
    ValueError: if ``out_dir`` holds no unfinished run.
  """
  out_dir = pathlib.Path(out_dir)
  record = read_record(out_dir, "grid")
  controls = resumed(controls, record, out_dir, nonfinite)
  return run_grid(Config(**record["config"]), record["aggregator"], record["grid"],
                  record["seeds"], record["rounds"], record["last"], controls, domain_graphs)
