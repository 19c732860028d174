"""A rho x beta grid and a batch of seeds as one compiled program.

``run_sweep`` advances every (seed, cell) run together, a chunk of rounds per
call of the one compiled ``run_chunk``; Python only loops over chunks (progress
bar, non-finite check, checkpoints, collecting history).
"""

import pathlib
import time
from typing import NamedTuple, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from fedjax_graph import checkpoint as ckpt
from fedjax_graph.config import Config
from fedjax_graph.data import Federation
from fedjax_graph.simulation import (Cells, DiagnosticsSpec, RoundMetrics, Simulation,
                                     make_simulation, sim_data)

NONFINITE_POLICIES = ("error", "skip")


class NonFiniteUpdateError(RuntimeError):
  """A client sent a NaN or Inf update under the ``error`` policy."""


class History(NamedTuple):
  """Per-round records of a sweep (host numpy arrays).

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
    seconds: wall time of each chunk run in this call (the first includes
      compilation).
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


def make_cells(settings: Sequence[tuple]) -> Cells:
  """Cells from ``(fedia, rho, beta)`` or ``(fedia, rho, beta, momentum)`` tuples.

  ``fedia`` False is the base method (rho and beta ignored); ``momentum``
  (default: ``fedia``) False with ``fedia`` True is FedIA's mask alone (IM,
  an ablation; beta ignored).

  Raises:
    ValueError: for a rho outside (0, 1], a beta outside [0, 1], no cell, or a
      cell given twice.
  """
  if not settings:
    raise ValueError("at least one cell is needed")
  settings = [tuple(s) + (s[0],) * (len(s) == 3) for s in settings]
  for fedia, rho, beta, momentum in settings:
    if momentum and not fedia:
      raise ValueError(f"cell {(fedia, rho, beta, momentum)}: CAM (momentum) is only run with "
                       "the mask (fedia); use rho = 1 for CAM alone")
    if fedia and not 0 < rho <= 1:
      raise ValueError(f"rho = {rho}; the mask ratio must be in (0, 1]")
    if momentum and not 0 <= beta <= 1:
      raise ValueError(f"beta = {beta}; the momentum must be in [0, 1]")
  # What a cell does: rho only with the mask, beta only with CAM.
  effective = [(f, rho if f else 1.0, beta if m else 1.0, m) for f, rho, beta, m in settings]
  if len(set(effective)) != len(effective):
    raise ValueError(f"a cell is given twice in {list(settings)}")
  return Cells(rho=np.array([e[1] for e in effective], np.float32),
               beta=np.array([e[2] for e in effective], np.float32),
               fedia=np.array([e[0] for e in effective]),
               momentum=np.array([e[3] for e in effective]))


def describe_cell(cells: Cells, g: int, base: str = "FedAvg") -> str:
  """'FedAvg', 'FedAvg+IM rho=0.5' or 'FedIA rho=0.5, beta=0.3' for cell g."""
  if not cells.fedia[g]:
    return base
  if not cells.momentum[g]:
    return f"{base}+IM rho={cells.rho[g]:g}"
  return f"FedIA rho={cells.rho[g]:g}, beta={cells.beta[g]:g}"


def grid_cells(rhos: Sequence[float], betas: Sequence[float], with_fedavg: bool = True) -> Cells:
  """FedIA cells of the rho x beta grid (rho-major), then one FedAvg cell.

  Raises:
    ValueError: if a rho is outside (0, 1] or a beta outside [0, 1], a list
      is empty or holds a value twice.
  """
  if not rhos or not betas:
    raise ValueError(f"the grid needs at least one rho and one beta, got {rhos} and {betas}")
  for name, values in (("rho", rhos), ("beta", betas)):
    if len(set(values)) != len(values):
      raise ValueError(f"{name} = {list(values)}; a value is given twice")
  settings = [(True, float(r), float(b)) for r in rhos for b in betas]
  return make_cells(settings + [(False, 1.0, 1.0)] * with_fedavg)


def describe_nonfinite(nonfinite: np.ndarray, first_round: int, federation: Federation,
                       cells: Cells) -> str:
  """Names the first non-finite client update of a chunk: round, client, domain, seed, cell.

  Args:
    nonfinite: bool[S, G', L, C] of a chunk starting at round ``first_round``.
  """
  s, g, t, k = np.argwhere(nonfinite)[0]
  cell = describe_cell(cells, g)
  domain = ("all domains, pooled" if federation.pooled
            else f"domain {federation.domains[federation.client_domain[k]]}")
  return (f"client {k} ({domain}) sent a non-finite update in round {first_round + t + 1} "
          f"(seed {federation.seeds[s]}, {cell}); {int(nonfinite.sum())} such update(s) in "
          f"rounds {first_round + 1}-{first_round + nonfinite.shape[2]}. The update was left out "
          f"of the aggregate. To go on and count such updates: --resume DIR --nonfinite skip")


def check_sweep_args(rounds: int, chunk: int = 1, checkpoint_every: int = 1,
                     nonfinite: str = "error") -> None:
  """Checks a sweep's run controls.

  Raises:
    ValueError: naming the first bad value and what is allowed.
  """
  for name, value in (("rounds", rounds), ("chunk", chunk), ("checkpoint_every", checkpoint_every)):
    if value < 1:
      raise ValueError(f"{name} = {value}; must be >= 1")
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(f"nonfinite = {nonfinite!r}; choose one of {NONFINITE_POLICIES}")


def run_sweep(config: Config, federation: Federation, cells: Cells, rounds: int,
              chunk: int = 10, progress: bool = True, description: Optional[str] = None,
              simulation: Optional[Simulation] = None, nonfinite: str = "error",
              checkpoint_path: Optional[pathlib.Path] = None, checkpoint_every: int = 1,
              fingerprint: str = "", diagnostics: Optional[DiagnosticsSpec] = None,
              method: str = "fedavg", method_hparams: Optional[dict] = None) -> History:
  """Runs every (seed, cell) of the batch for ``rounds`` rounds.

  Args:
    config: model and local training recipe.
    federation: the padded federation; its seeds are the batch's seeds.
    cells: the G' aggregation settings (see ``grid_cells``).
    rounds: T >= 1.
    chunk: rounds per compiled call (a remainder chunk compiles once more).
    progress: show a progress bar over rounds.
    description: label of the progress bar.
    simulation: a ``make_simulation(config, federation)`` to reuse (and not
      compile again); built here if None.
    nonfinite: ``error``: stop after the chunk in which a client update held a
      NaN or Inf, naming it; ``skip``: leave such updates out and go on (they
      are counted in ``History.nonfinite``). Either way no such update ever
      reaches a global model.
    checkpoint_path: if given, the state and history are saved there every
      ``checkpoint_every`` chunks and at the end; if the file exists, the sweep
      resumes from it (its fingerprint must equal ``fingerprint``).
    checkpoint_every: chunks between checkpoints, >= 1.
    fingerprint: identifies the sweep's setup (``checkpoint.fingerprint``).
    diagnostics: compute update diagnostics at these rounds (not with
      checkpoints, which keep only the plain history).
    method, method_hparams: the base method (``methods.make_method``).

  Returns:
    The full history (rounds from a resumed checkpoint included).

  Raises:
    ValueError: for ``rounds``, ``chunk`` or ``checkpoint_every`` < 1, an
      unknown policy, or a checkpoint of another setup.
    NonFiniteUpdateError: under the ``error`` policy.
  """
  check_sweep_args(rounds, chunk, checkpoint_every, nonfinite)
  if diagnostics is not None and checkpoint_path is not None:
    raise ValueError("diagnostics runs are not checkpointed; drop one of the two")
  sim = simulation or make_simulation(config, federation, diagnostics, method, method_hparams)
  data = sim_data(federation)
  device_cells = jax.device_put(cells)
  state = sim.init(np.asarray(federation.seeds, np.int32), device_cells)
  parts, start = [], 0
  if checkpoint_path is not None and pathlib.Path(checkpoint_path).exists():
    saved = ckpt.load(checkpoint_path, state)
    if saved.fingerprint != fingerprint:
      raise ValueError(f"checkpoint {checkpoint_path} was written by a different setup; "
                       "resume with the run's own config.json")
    state, start = jax.device_put(saved.state), saved.next_round
    parts.append(RoundMetrics(**saved.metrics))

  seconds = []
  bar = tqdm(total=rounds, initial=start, desc=description, unit="round", disable=not progress)
  for index, first in enumerate(range(start, rounds, chunk)):
    size = min(chunk, rounds - first)
    begin = time.perf_counter()
    state, metrics = sim.run_chunk(state, np.int32(first), device_cells, data, num_rounds=size)
    metrics = jax.device_get(metrics)
    seconds.append(time.perf_counter() - begin)
    parts.append(metrics)
    bar.update(size)
    bar.set_postfix(avg_test=f"{100 * np.nanmean(metrics.test_acc[..., -1, :]):.1f}%")
    if nonfinite == "error" and metrics.nonfinite.any():
      bar.close()
      raise NonFiniteUpdateError(describe_nonfinite(metrics.nonfinite, first, federation, cells))
    done = first + size
    if checkpoint_path is not None and ((index + 1) % checkpoint_every == 0 or done == rounds):
      ckpt.save(checkpoint_path, ckpt.Checkpoint(
          state=jax.device_get(state), metrics=_join(parts)._asdict(), next_round=done,
          fingerprint=fingerprint))
  bar.close()
  return History(**_join(parts)._asdict(), seconds=seconds)


def _join(parts: list[RoundMetrics]) -> RoundMetrics:
  """Concatenates chunks' metrics along the round axis (axis 2 of [S, G', L, ...])."""
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=2), *parts)
