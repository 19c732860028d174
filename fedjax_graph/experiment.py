"""The rho x beta grid experiment: FedAvg vs FedAvg+FedIA, end to end.

Data → federation → one compiled sweep over every (seed, cell) → files:
``config.json``, ``history.npz``, ``summary.csv``, ``heatmap.png``,
``curves.png``. The simulation state is checkpointed while it runs, so an
interrupted run continues with ``resume_grid``. ``experiments/grid.py`` is its
command line.
"""

import datetime
import importlib.metadata
import json
import pathlib
import subprocess
import time
from typing import Optional, Sequence

import numpy as np

from fedjax_graph import report
from fedjax_graph.checkpoint import fingerprint
from fedjax_graph.config import Config
from fedjax_graph.data import build_federation, load_dataset
from fedjax_graph.sweep import check_sweep_args, grid_cells, run_sweep

PACKAGES = ("jax", "jaxlib", "flax", "optax", "jraph", "numpy", "scipy")


def default_out_dir(config: Config, kind: str = "") -> pathlib.Path:
  """``results/<dataset>-<setting>[-<kind>]-<timestamp>``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  name = "-".join(part for part in (config.dataset, config.setting, kind, stamp) if part)
  return pathlib.Path("results") / name


def provenance() -> dict:
  """Package versions and the git commit, for config.json."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    commit = None
  return {"packages": versions, "git_commit": commit}


CHECKPOINT = "checkpoint.msgpack"
OUTPUTS = ("config.json", "history.npz", "summary.csv", "heatmap.png", "curves.png", CHECKPOINT)


def prepare_out_dir(out_dir: pathlib.Path, resume: bool, overwrite: bool,
                    finished_marker: str = "summary.csv", resumable: bool = True) -> None:
  """Refuses to clobber a run: a finished one needs ``overwrite``, an unfinished one ``resume``.

  Nothing is deleted here: with ``overwrite``, the caller removes its own
  outputs (``remove_outputs``) once the data has loaded, and makes the
  folder, so a failure before that leaves everything as it was.

  Raises:
    ValueError: naming the folder and the flag that would proceed.
  """
  finished = (out_dir / finished_marker).exists()
  unfinished = not finished and ((out_dir / CHECKPOINT).exists()
                                 or (out_dir / "config.json").exists())
  if overwrite:
    return
  if resume:
    if finished:
      raise ValueError(f"{out_dir} holds a finished run; nothing to resume "
                       "(to run it again, start it anew with --out and --overwrite)")
    if not unfinished:
      raise ValueError(f"{out_dir} holds no run to resume")
  elif finished:
    raise ValueError(f"{out_dir} holds a finished run; pass --overwrite to replace it or "
                     "choose another --out")
  elif unfinished and not resumable:
    raise ValueError(f"{out_dir} holds an unfinished run that cannot be resumed; pass "
                     "--overwrite to replace it or choose another --out")
  elif unfinished:
    raise ValueError(f"{out_dir} holds an unfinished run; continue it with --resume {out_dir} "
                     "or pass --overwrite to start again")


def remove_outputs(out_dir: pathlib.Path, names) -> None:
  """Deletes the named files of a previous run in ``out_dir`` (others' files are left alone)."""
  for name in names:
    (out_dir / name).unlink(missing_ok=True)


MAX_SEED = 2**31 - 1


def check_run_args(rounds: int, last: int, seeds: Sequence[int], chunk: int = 1,
                   checkpoint_every: int = 1, nonfinite: str = "error") -> None:
  """Checks a run's settings before anything is written.

  Raises:
    ValueError: naming the first bad value and what is allowed.
  """
  check_sweep_args(rounds, chunk, checkpoint_every, nonfinite)
  if not 1 <= last <= rounds:
    raise ValueError(f"last = {last}; must be in [1, rounds = {rounds}]")
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"seeds = {list(seeds)}; give at least one, without repeats")
  bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
  if bad:
    raise ValueError(f"seeds = {list(seeds)}; each must be in [0, {MAX_SEED}]")


def run_grid(config: Config, rhos: Sequence[float], betas: Sequence[float],
             seeds: Sequence[int], rounds: int, last: int, out_dir: Optional[pathlib.Path] = None,
             raw_dir=None, cache_dir=None, chunk: int = 10, progress: bool = True,
             domain_graphs=None, nonfinite: str = "error", checkpoint_every: int = 1,
             resume: bool = False, overwrite: bool = False, verify: bool = True) -> pathlib.Path:
  """Runs FedAvg and FedAvg+FedIA at every (rho, beta) for every seed and writes the results.

  Args:
    config: the federation preset and training recipe.
    rhos, betas: the grid (G = len(rhos) * len(betas) cells, rho-major).
    seeds: the S seeds (vmapped with the cells).
    rounds: T. last: rounds summarised at the end, 1 <= last <= T.
    out_dir: where to write; default ``results/<dataset>-<setting>-<timestamp>``.
    raw_dir, cache_dir: data locations (see ``data.load_dataset``).
    chunk: rounds per compiled call.
    progress: show a progress bar.
    domain_graphs: already loaded domain graphs (skips ``load_dataset``).
    nonfinite: ``error`` or ``skip`` (see ``sweep.run_sweep``).
    checkpoint_every: chunks between checkpoints of the whole simulation state.
    resume: continue the unfinished run in ``out_dir`` from its checkpoint.
    overwrite: replace a finished or unfinished run in ``out_dir``.
    verify: check the raw files against the SNAP checksums.

  Returns:
    The output directory.

  Raises:
    ValueError: for an invalid grid, seed list, ``rounds`` or ``last``, or an
      output folder that holds a run and no ``resume``/``overwrite``.
    sweep.NonFiniteUpdateError: under ``nonfinite="error"``.
  """
  check_run_args(rounds, last, seeds, chunk, checkpoint_every, nonfinite)
  cells = grid_cells(rhos, betas)
  out_dir = pathlib.Path(out_dir) if out_dir else default_out_dir(config)
  prepare_out_dir(out_dir, resume, overwrite)
  meta = {}
  if domain_graphs is None:
    domain_graphs, meta = load_dataset(config.dataset, raw_dir, cache_dir, verify)
  federation = build_federation(config, domain_graphs, seeds)
  if overwrite:
    remove_outputs(out_dir, OUTPUTS)
  out_dir.mkdir(parents=True, exist_ok=True)

  setup = {"config": config.to_dict(), "rho": [float(r) for r in rhos],
           "beta": [float(b) for b in betas], "seeds": [int(s) for s in seeds],
           "rounds": rounds, "chunk": chunk}
  record = {**setup, "last": last, "nonfinite": nonfinite, "status": "running",
            "raw_dir": raw_dir and str(raw_dir), "cache_dir": cache_dir and str(cache_dir),
            "num_clients": federation.num_clients,
            "buckets": [len(b) for b in federation.bucket_clients],
            "data": {"source_sha256": meta.get("source_sha256"),
                     "format_version": meta.get("format_version")},
            **provenance()}
  report.write_json(out_dir / "config.json", record)

  start = time.perf_counter()
  history = run_sweep(config, federation, cells, rounds, chunk=chunk, progress=progress,
                      description=f"{config.dataset}-{config.setting}", nonfinite=nonfinite,
                      checkpoint_path=out_dir / CHECKPOINT, checkpoint_every=checkpoint_every,
                      fingerprint=fingerprint(setup))
  wall = time.perf_counter() - start

  num_fedia = len(cells.rho) - 1
  # The history's cells are the FedIA grid, then FedAvg: [S, G+1, ...].
  fedia_of = lambda a: np.moveaxis(a[:, :num_fedia], 0, 1)  # [G, S, ...]
  fedavg_of = lambda a: a[:, -1]  # [S, ...]
  per_round = (history.test_acc, history.test_bacc, history.test_f1, history.predicted_classes,
               history.train_loss)
  fedavg = report.Runs(*map(fedavg_of, per_round))
  fedia = report.Runs(*map(fedia_of, per_round))
  # The user's values, not their float32 copies (0.3, not 0.30000001).
  rho = np.repeat(np.asarray(rhos, float), len(betas))
  beta = np.tile(np.asarray(betas, float), len(rhos))
  skipped = history.nonfinite.sum(axis=(0, 2, 3))  # [G'] FedIA cells, then FedAvg
  domains = list(federation.domains)

  report.write_history(out_dir / "history.npz", fedia_test=fedia.acc,
                       fedia_val=fedia_of(history.val_acc), fedavg_test=fedavg.acc,
                       fedavg_val=fedavg_of(history.val_acc), fedia_test_bacc=fedia.bacc,
                       fedia_test_f1=fedia.f1, fedavg_test_bacc=fedavg.bacc,
                       fedavg_test_f1=fedavg.f1, rho=rho, beta=beta, seeds=np.asarray(seeds),
                       domains=np.asarray(domains), train_loss=history.train_loss,
                       alpha=history.alpha, predicted_classes=history.predicted_classes,
                       mask_coverage=history.mask_coverage, nonfinite=history.nonfinite)
  rows = report.summarize(fedavg, fedia, rho, beta, domains, last,
                          skipped=np.concatenate([skipped[-1:], skipped[:-1]]))
  report.write_summary_csv(rows, out_dir / "summary.csv")
  title = f"{config.dataset} {config.setting}, {config.backbone}, {rounds} rounds, seeds {list(seeds)}"
  report.plot_heatmap(rows, out_dir / "heatmap.png", title=title)
  report.plot_curves(fedavg.acc, fedia.acc, rows, out_dir / "curves.png", title, last=last)
  report.write_json(out_dir / "config.json", {**record, "status": "finished",
                                              "wall_seconds_this_call": wall,
                                              "chunk_seconds_this_call": history.seconds})
  (out_dir / CHECKPOINT).unlink(missing_ok=True)

  for warning in report.constant_warnings(fedavg, fedia, rho, beta, domains, last, seeds):
    print(f"warning: {warning}")
  best = report.best_cell(rows)
  print(report.format_table(rows, max_rows=10))
  print(f"best cell: rho={best['rho']:g}, beta={best['beta']:g}: AVG {best['avg_mean']:.2f}% "
        f"({best['delta_avg']:+.2f} vs FedAvg); {rounds} rounds of {len(cells.rho)} cells x "
        f"{len(seeds)} seed(s) in {wall:.1f} s")
  if skipped.sum():
    print(f"{int(skipped.sum())} non-finite client update(s) were left out (see summary.csv)")
  print(f"results in {out_dir}")
  return out_dir


def resume_grid(out_dir: pathlib.Path, raw_dir=None, cache_dir=None, progress: bool = True,
                domain_graphs=None, verify: bool = True,
                nonfinite: Optional[str] = None) -> pathlib.Path:
  """Continues the unfinished grid run in ``out_dir`` with the setup in its config.json.

  Args:
    out_dir: the run's folder.
    raw_dir, cache_dir: data locations; None: those the run was started with.
    progress, domain_graphs, verify: as for ``run_grid``.
    nonfinite: a new non-finite policy (it does not change the trajectory,
      e.g. ``skip`` to get past a run stopped by ``error``); None keeps the run's.

  Raises:
    ValueError: if ``out_dir`` holds no unfinished run.
  """
  out_dir = pathlib.Path(out_dir)
  try:
    record = json.loads((out_dir / "config.json").read_text())
  except FileNotFoundError:
    raise ValueError(f"{out_dir} holds no config.json: not a grid run to resume")
  config = Config(**record["config"])
  return run_grid(config, record["rho"], record["beta"], record["seeds"], record["rounds"],
                  record["last"], out_dir=out_dir, raw_dir=raw_dir or record.get("raw_dir"),
                  cache_dir=cache_dir or record.get("cache_dir"), chunk=record["chunk"],
                  progress=progress, domain_graphs=domain_graphs,
                  nonfinite=nonfinite or record["nonfinite"], resume=True, verify=verify)
