"""A batch of cells and seeds as one compiled program.

``run_sweep`` advances every (seed, cell) run together, a chunk of rounds per
call of the one compiled ``run_chunk``; Python only loops over chunks (progress
bar, non-finite check, checkpoints, collecting history). Results come in the
order of the cells, and are addressed by their labels (``Cells.index``).
"""

import pathlib
import time
from typing import Callable, NamedTuple, Optional

import jax
import numpy as np
from tqdm.auto import tqdm

from fedjax_graph import checkpoint as ckpt
from fedjax_graph import devices as devices_lib
from fedjax_graph.cells import Cells
from fedjax_graph.config import Config
from fedjax_graph.controls import RunControls
from fedjax_graph.data import Federation
from fedjax_graph.simulation import (DiagnosticsSpec, EvalSchedule, RoundMetrics, Simulation,
                                     make_simulation)


class NonFiniteUpdateError(RuntimeError):
  """A client sent a NaN or Inf update under the ``error`` policy."""


class History(NamedTuple):
  """Per-round records of a sweep (host numpy arrays), cells in ``labels`` order.

  Attributes:
    test_acc: f32[S, G', T, D] test accuracy per domain, in [0, 1].
    val_acc: f32[S, G', T, D] validation accuracy per domain.
    test_bacc: f32[S, G', T, D] balanced test accuracy per domain.
    test_f1: f32[S, G', T, D] macro-F1 on the test nodes per domain.
    train_loss: f32[S, G', T] mean last-step local loss over aggregated clients.
    alpha: f32[S, G', T, C] aggregation weights per round.
    mask_coverage: f32[S, G', T] share of coordinates aggregated.
    nonfinite: bool[S, G', T, C] client updates left out for NaN/Inf.
    predicted_classes: i32[S, G', T, D] distinct classes predicted on each
      domain's test nodes.
    diagnostics: ``diagnostics.RoundDiagnostics`` with leaves [S, G', T, ...]
      (zeros outside the requested rounds), or None.
    seconds: wall time of each chunk run in this call (the first chunk's
      program is compiled before, while the plan is chosen: ``plan``'s
      ``plan_seconds``; a shorter last chunk compiles in its own time).
    labels: the G' cell labels.
    plan: how the batch ran (``devices.Plan.record()``: devices, sub-batches,
      padding, memory budget and figures).
    argmax_acc: f32[S, G', T, D] the classifier's argmax test accuracy when
      the method predicts otherwise (``Method.predict``, e.g. FGGP's
      k-nearest prototypes, which ``test_acc`` then scores), else None.
  """
  test_acc: np.ndarray
  val_acc: np.ndarray
  test_bacc: np.ndarray
  test_f1: np.ndarray
  train_loss: np.ndarray
  alpha: np.ndarray
  mask_coverage: np.ndarray
  nonfinite: np.ndarray
  predicted_classes: np.ndarray
  diagnostics: object
  seconds: list
  labels: list
  plan: Optional[dict] = None
  argmax_acc: Optional[np.ndarray] = None


def describe_nonfinite(nonfinite: np.ndarray, first_round: int, federation: Federation,
                       cells: Cells) -> str:
  """Names the first non-finite client update of a chunk: round, client, domain, seed, cell.

  Args:
    nonfinite: bool[S, G', L, C] of a chunk starting at round ``first_round``,
      cells in ``cells`` order.
  """
  s, g, t, k = np.argwhere(nonfinite)[0]
  domain = ("all domains, pooled" if federation.pooled
            else f"domain {federation.domains[federation.client_domain[k]]}")
  return (f"client {k} ({domain}) sent a non-finite update in round {first_round + t + 1} "
          f"(seed {federation.seeds[s]}, {cells.labels[g]}); {int(nonfinite.sum())} such "
          f"update(s) in rounds {first_round + 1}-{first_round + nonfinite.shape[2]}. The update "
          "was left out of the aggregate. To go on and count such updates: --resume DIR "
          "--nonfinite skip")


def run_sweep(config: Config, federation: Federation, cells: Cells, rounds: int,
              controls: RunControls = RunControls(), *, method: str = "fedavg",
              method_hparams: Optional[dict] = None, description: Optional[str] = None,
              simulation: Optional[Simulation] = None,
              checkpoint_path: Optional[pathlib.Path] = None, fingerprint: str = "",
              diagnostics: Optional[DiagnosticsSpec] = None,
              on_plan: Optional[Callable[[dict], None]] = None,
              last: Optional[int] = None) -> History:
  """Runs every (seed, cell) of the batch for ``rounds`` rounds.

  Args:
    config: model and local training recipe.
    federation: the padded federation; its seeds are the batch's seeds.
    cells: the G' cells (``cells.grid``, ``cells.cell``).
    rounds: T >= 1.
    controls: chunk size (a remainder chunk compiles once more), progress
      bar, non-finite policy, checkpoint interval, evaluation interval,
      devices and memory budget (``RunControls``); the data and output
      locations are not used here.
    method, method_hparams: the method (``methods.make_method``).
    description: label of the progress bar.
    simulation: a ``make_simulation(...)`` to reuse (and not compile again);
      built here if None.
    checkpoint_path: if given, the state and history are saved there every
      ``controls.checkpoint_every`` chunks and at the end; if the file
      exists, the sweep resumes from it (its fingerprint must equal
      ``fingerprint``).
    fingerprint: identifies the sweep's setup (``checkpoint.fingerprint``).
    diagnostics: compute update diagnostics at these rounds (not with
      checkpoints, which keep only the plain history).
    last: the final rounds the summaries read, all evaluated whatever
      ``controls.eval_every`` (needed when it is > 1).
    on_plan: called with ``devices.Plan.record()`` once the batch's layout is
      chosen (before the first chunk runs), e.g. to record it in config.json;
      the plan's line is printed too.

  The runs are split over ``controls.devices`` devices and, if they would not
  fit ``controls.max_memory``, into sub-batches run one after another
  (``devices.plan_batch``); one device and one batch is the plain program.
  Results, checkpoints and histories do not depend on the layout (but for
  float rounding when it is not the plain program).

  Returns:
    The full history (rounds from a resumed checkpoint included); with
    ``controls.eval_every`` k > 1, rounds neither a multiple of k nor among
    the ``last`` hold NaN scores and -1 predicted classes
    (``simulation.EvalSchedule``).

  Raises:
    ValueError: for ``rounds`` < 1, ``controls.eval_every`` > 1 without
      ``last`` in [1, rounds], a checkpoint of another setup, a device count
      above the devices there are, or a batch over the memory budget even in
      the finest split.
    NonFiniteUpdateError: under the ``error`` policy.
  """
  if rounds < 1:
    raise ValueError(f"rounds = {rounds}; must be >= 1")
  schedule = EvalSchedule()
  if controls.eval_every > 1:
    if last is None or not 1 <= last <= rounds:
      raise ValueError(f"eval_every = {controls.eval_every} needs the final rounds to evaluate: "
                       f"last = {last}; must be in [1, rounds = {rounds}]")
    schedule = EvalSchedule(controls.eval_every, rounds - last)
  if diagnostics is not None and checkpoint_path is not None:
    raise ValueError("diagnostics runs are not checkpointed; drop one of the two")
  sim = simulation or make_simulation(config, federation, diagnostics, method, method_hparams)
  batch = jax.device_put(cells.batch())
  to_cell_order = np.argsort(cells.order())  # the program runs the cells group by group
  state = sim.init(np.asarray(federation.seeds, np.int32), batch)
  parts, start = [], 0
  if checkpoint_path is not None and pathlib.Path(checkpoint_path).exists():
    saved = ckpt.load(checkpoint_path, state)
    if saved.fingerprint != fingerprint:
      raise ValueError(f"checkpoint {checkpoint_path} was written by a different setup; "
                       "resume with the run's own config.json")
    state, start = jax.device_put(saved.state), saved.next_round
    parts.append(RoundMetrics(**saved.metrics))

  seconds, chunk = [], controls.chunk
  runner, plan = devices_lib.plan_batch(sim, federation, batch, state, start,
                                        min(chunk, rounds - start), controls.devices,
                                        controls.max_memory, schedule)
  prefix = f"{description}: " if description else ""
  resumes = f"; resumes at round {start + 1} of {rounds}" if start else ""
  print(prefix + plan.describe() + resumes)
  if on_plan is not None:
    on_plan(plan.record())
  bar = tqdm(total=rounds, initial=start, desc=description, unit="round",
             disable=not controls.progress)
  for index, first in enumerate(range(start, rounds, chunk)):
    size = min(chunk, rounds - first)
    begin = time.perf_counter()
    metrics = jax.tree.map(lambda m: m[:, to_cell_order], runner.run(first, size))
    seconds.append(time.perf_counter() - begin)
    parts.append(metrics)
    bar.update(size)
    shown = np.flatnonzero(schedule.evaluated(np.arange(first, first + size)))
    if len(shown):  # the chunk's last evaluated round
      bar.set_postfix(avg_test=f"{100 * np.nanmean(metrics.test_acc[..., shown[-1], :]):.1f}%")
    if controls.nonfinite == "error" and metrics.nonfinite.any():
      bar.close()
      raise NonFiniteUpdateError(describe_nonfinite(metrics.nonfinite, first, federation, cells))
    done = first + size
    if checkpoint_path is not None and ((index + 1) % controls.checkpoint_every == 0
                                        or done == rounds):
      ckpt.save(checkpoint_path, ckpt.Checkpoint(
          state=runner.state(), metrics=_join(parts)._asdict(), next_round=done,
          fingerprint=fingerprint))
  bar.close()
  return History(**_join(parts)._asdict(), seconds=seconds, labels=cells.labels,
                 plan=plan.record())


def _join(parts: list[RoundMetrics]) -> RoundMetrics:
  """Concatenates chunks' metrics along the round axis (axis 2 of [S, G', L, ...])."""
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=2), *parts)
