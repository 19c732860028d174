"""A rho x beta grid and a batch of seeds as one compiled program.

``run_sweep`` advances every (seed, cell) run together, a chunk of rounds per
call of the one compiled ``run_chunk``; Python only loops over chunks (progress
bar, collecting history).
"""

import time
from typing import NamedTuple, Optional, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from fedjax_graph.config import Config
from fedjax_graph.data import Federation
from fedjax_graph.simulation import Cells, Simulation, make_simulation, sim_data


class History(NamedTuple):
  """Per-round records of a sweep (host numpy arrays).

  Attributes:
    test_acc: f32[S, G', T, D] test accuracy per domain, in [0, 1].
    val_acc: f32[S, G', T, D] validation accuracy per domain.
    train_loss: f32[S, G', T] mean last-step local loss over clients.
    alpha: f32[S, G', T, C] aggregation weights per round.
    mask_coverage: f32[S, G', T] share of coordinates aggregated.
    seconds: wall time of each chunk (the first includes compilation).
  """
  test_acc: np.ndarray
  val_acc: np.ndarray
  train_loss: np.ndarray
  alpha: np.ndarray
  mask_coverage: np.ndarray
  seconds: list


def grid_cells(rhos: Sequence[float], betas: Sequence[float], with_fedavg: bool = True) -> Cells:
  """FedIA cells of the rho x beta grid (rho-major), then one FedAvg cell.

  Raises:
    ValueError: if a rho is outside (0, 1] or a beta outside [0, 1], or a list is empty.
  """
  if not rhos or not betas:
    raise ValueError(f"the grid needs at least one rho and one beta, got {rhos} and {betas}")
  for rho in rhos:
    if not 0 < rho <= 1:
      raise ValueError(f"rho = {rho}; the mask ratio must be in (0, 1]")
  for beta in betas:
    if not 0 <= beta <= 1:
      raise ValueError(f"beta = {beta}; the momentum must be in [0, 1]")
  rho, beta = (np.array(v, np.float32).ravel() for v in np.meshgrid(rhos, betas, indexing="ij"))
  fedia = np.ones(len(rho), bool)
  if with_fedavg:
    rho, beta = np.append(rho, 1.0).astype(np.float32), np.append(beta, 1.0).astype(np.float32)
    fedia = np.append(fedia, False)
  return Cells(rho=rho, beta=beta, fedia=fedia)


def run_sweep(config: Config, federation: Federation, cells: Cells, rounds: int,
              chunk: int = 10, progress: bool = True, description: Optional[str] = None,
              simulation: Optional[Simulation] = None) -> History:
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

  Raises:
    ValueError: if ``rounds`` or ``chunk`` < 1.
  """
  if rounds < 1:
    raise ValueError(f"rounds = {rounds}; must be >= 1")
  if chunk < 1:
    raise ValueError(f"chunk = {chunk}; must be >= 1")
  sim = simulation or make_simulation(config, federation)
  data = sim_data(federation)
  cells = jax.device_put(cells)
  state = sim.init(np.asarray(federation.seeds, np.int32), cells)
  parts, seconds = [], []
  bar = tqdm(total=rounds, desc=description, unit="round", disable=not progress)
  for first in range(0, rounds, chunk):
    size = min(chunk, rounds - first)
    start = time.perf_counter()
    state, metrics = sim.run_chunk(state, np.int32(first), cells, data, num_rounds=size)
    parts.append(jax.device_get(metrics))
    seconds.append(time.perf_counter() - start)
    bar.update(size)
    bar.set_postfix(avg_test=f"{100 * parts[-1].test_acc[..., -1, :].mean():.1f}%")
  bar.close()
  joined = jax.tree.map(lambda *xs: np.concatenate(xs, axis=2), *parts)
  return History(joined.test_acc, joined.val_acc, joined.train_loss, joined.alpha,
                 joined.mask_coverage, seconds)
