"""A batch of runs on several devices, and in sub-batches that fit in memory.

A sweep's batch is S seeds x G' cells of runs (``sweep.run_sweep``). On one
device, with room for all of them, it is today's program (``run_chunk``:
a ``vmap`` over seeds and over each group's cells), unchanged. Otherwise its
runs are laid out flat (``RunLayout``): group g's S * G_g runs, seed-major,
are padded by repeating real runs to k sub-batches of m_g runs each, m_g a
multiple of the N devices; every sub-batch has the same shape, so it is one
compiled program (``Simulation.run_runs`` under ``jax.shard_map`` over a 1-D
mesh of N devices, runs split along it, the federation's arrays replicated),
and the k sub-batches run one after another each chunk. No collective runs
inside the program: each device advances its own runs with its own copy of
the data (a plain ``NamedSharding`` + ``jit`` makes XLA all-gather inside the
batched CSR evaluation; ``collectives`` finds them in a compiled program's HLO).
The padding is dropped when the results come back, so histories, checkpoints
and saved arrays have today's shapes ([S, G', ...]).

Memory: ``Estimate`` is an analytic estimate from shapes (``jax.eval_shape``:
the replicated data, each run's state, the clients' outputs and the
aggregator's work on them, the activations of the largest bucket, the
evaluation, the metrics) made before anything compiles, which chooses the
split; the program then compiles and, where the backend reports it
(``Compiled.memory_analysis()``: CPU and GPU do), XLA's own figure is checked
against the budget too and, rescaled to it, the estimate may choose another
split (``plan_batch``). Both figures go into the plan that config.json records.

Multi-host: the mesh spans ``jax.devices()`` (every process's), arrays are
placed with ``jax.make_array_from_callback`` and brought back with
``multihost_utils.process_allgather``, so the same code runs under
``jax.distributed.initialize``; only process 0 writes files (``io.is_writer``).
"""

import math
import os
import re
import time
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_graph.cells import CellBatch
from fedjax_graph.controls import OverBudgetError
from fedjax_graph.data import Federation
from fedjax_graph.simulation import EvalSchedule, Simulation, host_data

AXIS = "runs"
"""The name of the mesh axis the runs are split along."""
DEFAULT_SHARE = 0.8
"""The default memory budget: this share of a device's memory."""
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
"""HLO ops that move data between devices."""

def device_mesh(count: Optional[int] = None) -> Mesh:
  """A 1-D mesh over the first ``count`` devices (None: all of them).

  Raises:
    ValueError: for a count < 1 or above the devices there are.
  """
  available = jax.devices()
  count = len(available) if count is None else count
  if not 1 <= count <= len(available):
    raise ValueError(f"devices = {count}; this process sees {len(available)} "
                     f"{available[0].platform} device(s): choose 1 to {len(available)}")
  return Mesh(np.array(available[:count]), (AXIS,))


def format_size(num_bytes: Optional[float]) -> str:
  """1.5 * 2**30 -> '1.50 GiB'."""
  if num_bytes is None:
    return "n/a"
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes >= scale:
      return f"{num_bytes / scale:.2f} {unit}"
  return f"{int(num_bytes)} B"


def device_memory(mesh: Mesh) -> tuple[int, str]:
  """A device's memory in bytes, and what that figure is.

  The device's allocator limit (``memory_stats()["bytes_limit"]``: GPUs,
  TPUs); else, on CPU, the host's RAM (``os.sysconf``) shared by the mesh's
  devices of this host.
  """
  device = mesh.devices.flat[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = stats.get("bytes_limit") if stats else None
  if limit:
    return limit, f"the {device.platform} device's {format_size(limit)}"
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return (ram // local, f"the host's {format_size(ram)} RAM"
          + (f" over {local} devices" if local > 1 else ""))


def default_budget(mesh: Mesh) -> tuple[int, str]:
  """``DEFAULT_SHARE`` of a device's memory (``device_memory``), in bytes, and its source."""
  limit, what = device_memory(mesh)
  return int(DEFAULT_SHARE * limit), f"{DEFAULT_SHARE:.0%} of {what}"


class RunLayout(NamedTuple):
  """Where each run of a batch goes (host, static).

  Group g's runs are r = s * G_g + c for seed s and cell c (seed-major),
  R_g = S * G_g of them. They fill ``splits`` sub-batches of ``per_batch[g]``
  slots each; slot i computes run ``i % R_g``, so the first R_g slots are
  the runs in order and the rest repeat real runs (padding, dropped when the
  results come back).

  Attributes:
    num_seeds: S.
    group_sizes: (G_g) per group.
    devices: N.
    splits: k, the sub-batches run one after another.
    per_batch: (m_g) slots of group g per sub-batch, each a multiple of N.
  """
  num_seeds: int
  group_sizes: tuple[int, ...]
  devices: int
  splits: int
  per_batch: tuple[int, ...]

  @property
  def trivial(self) -> bool:
    """One device, one batch: today's program runs the batch as it is."""
    return self.devices == 1 and self.splits == 1

  @property
  def runs(self) -> int:
    return self.num_seeds * sum(self.group_sizes)

  @property
  def padding(self) -> int:
    return self.splits * sum(self.per_batch) - self.runs

  def source(self, g: int) -> np.ndarray:
    """int[k * m_g]: the run each slot of group g computes."""
    return np.arange(self.splits * self.per_batch[g]) % (self.num_seeds * self.group_sizes[g])

  def to_runs(self, states) -> list:
    """Today's states (per group leaves [S, G_g, ...]) -> per sub-batch, per group [m_g, ...]."""
    out = [[] for _ in range(self.splits)]
    for g, state in enumerate(states):
      flat = jax.tree.map(lambda a: np.asarray(a).reshape((-1,) + a.shape[2:])[self.source(g)],
                          state)
      for b in range(self.splits):
        m = self.per_batch[g]
        out[b].append(jax.tree.map(lambda a: a[b * m:(b + 1) * m], flat))
    return [tuple(parts) for parts in out]

  def from_runs(self, sub_batches) -> tuple:
    """Per sub-batch, per group leaves [m_g, ...] (host) -> per group [S, G_g, ...]: padding dropped.

    Also takes metrics (leaves [m_g, L, ...] -> [S, G_g, L, ...]).
    """
    out = []
    for g, size in enumerate(self.group_sizes):
      joined = jax.tree.map(lambda *parts: np.concatenate(parts),
                            *(batch[g] for batch in sub_batches))
      out.append(jax.tree.map(
          lambda a: a[:self.num_seeds * size].reshape((self.num_seeds, size) + a.shape[1:]),
          joined))
    return tuple(out)

  def inputs(self, batch: CellBatch) -> list:
    """Per sub-batch: (a ``CellBatch`` of each slot's hyper-parameters f32[m_g], seed rows i32[m_g])."""
    out = []
    for b in range(self.splits):
      values, seeds = [], []
      for g, size in enumerate(self.group_sizes):
        m = self.per_batch[g]
        run = self.source(g)[b * m:(b + 1) * m]
        values.append({name: np.asarray(v)[run % size] for name, v in batch.values[g].items()})
        seeds.append((run // size).astype(np.int32))
      out.append((CellBatch(batch.groups, tuple(values)), tuple(seeds)))
    return out


def layout(num_seeds: int, group_sizes, devices: int, splits: int) -> RunLayout:
  """The layout of S x (G_g) runs on ``devices`` in ``splits`` equal sub-batches."""
  per_batch = tuple(devices * math.ceil(math.ceil(num_seeds * g / splits) / devices)
                    for g in group_sizes)
  return RunLayout(num_seeds, tuple(group_sizes), devices, splits, per_batch)


def finest_split(num_seeds: int, group_sizes, devices: int) -> int:
  """The most sub-batches worth having: N runs of the largest group each."""
  return max(math.ceil(num_seeds * g / devices) for g in group_sizes)


def place(tree, sharding):
  """Host arrays -> global arrays laid out by ``sharding`` (one process or several)."""
  def one(leaf):
    leaf = np.asarray(leaf)
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
  return jax.tree.map(one, tree)


def to_host(tree):
  """Global arrays -> numpy, whole on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


_SHARDED: dict = {}


def sharded_chunk(sim: Simulation, mesh: Mesh) -> Callable:
  """``sim.run_runs`` over ``mesh``: runs split along ``AXIS``, data and the first round replicated.

  Returns the jitted ``chunk(states, first_round, batch, seed_index, data,
  num_rounds, schedule=EvalSchedule())`` -> ``(states, metrics)`` of ``Simulation.run_runs`` with
  every run-indexed leaf (states, batch values, seed rows, metrics) split
  along its axis 0; memoised per simulation and mesh.
  """
  key = (sim.run_runs, tuple(d.id for d in mesh.devices.flat))
  if key not in _SHARDED:
    runs, same = PartitionSpec(AXIS), PartitionSpec()

    def chunk(states, first_round, batch, seed_index, data, num_rounds,
              schedule=EvalSchedule()):
      body = lambda *args: sim.run_runs(*args, num_rounds=num_rounds, schedule=schedule)
      # check_vma off: the body never communicates, so there is nothing for
      # the varying-axes check to guard (and no psum for it to insert).
      return jax.shard_map(body, mesh=mesh, in_specs=(runs, same, runs, runs, same),
                           out_specs=runs, check_vma=False)(states, first_round, batch,
                                                            seed_index, data)

    _SHARDED[key] = jax.jit(chunk, static_argnames=("num_rounds", "schedule"))
  return _SHARDED[key]


def collectives(hlo_text: str) -> list[str]:
  """The cross-device ops (``COLLECTIVES``) a compiled program's HLO text holds."""
  return sorted({op for op in COLLECTIVES if re.search(rf"\b{op}(-start)?\(", hlo_text)})


def xla_bytes(compiled) -> Optional[int]:
  """Device bytes of a compiled program by XLA's buffer assignment (arguments + outputs +
  temporaries - aliased + code), or None where the backend does not report it."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, AttributeError, RuntimeError):  # backends without it
    return None
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes
             + stats.generated_code_size_in_bytes)


def tree_bytes(tree) -> int:
  """Bytes of a pytree of arrays or ``jax.ShapeDtypeStruct``s."""
  return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
                 for leaf in jax.tree.leaves(tree)))


# Calibration of the analytic estimate (see ``estimate``) against XLA's buffer
# assignment on CPU (README, "Devices and memory").
STATE_COPIES = 2       # a run's state: the scan's carry and the output
OUTPUT_COPIES = 3      # the clients' stacked outputs and the aggregator's work on them
ACTIVATION_COPIES = 2  # per hidden layer: its values and what its backward pass keeps
EVAL_COPIES = 3        # per evaluation row: the layer's input, its propagation, its output


class Estimate(NamedTuple):
  """An analytic estimate of a batch's device memory, from shapes (``jax.eval_shape``).

  Attributes:
    data: bytes of the federation's arrays (on every device).
    gathered: bytes of one seed's client rows that a run of the flat layout
      gathers for itself (the training rows and, where used, the graph).
    per_run: per group, bytes one run needs while its sub-batch runs: its
      state, its clients' outputs, the larger of the training activations of
      the largest bucket and the evaluation's (XLA reuses the one's buffers
      for the other), the metrics of a chunk.
    state: per group, bytes of one run's state (kept while other sub-batches run).
  """
  data: int
  gathered: int
  per_run: tuple[int, ...]
  state: tuple[int, ...]

  def total(self, run_layout: RunLayout) -> int:
    """Bytes per device of the batch laid out as ``run_layout``."""
    per_device = [m / run_layout.devices for m in run_layout.per_batch]
    working = sum(n * (p + (0 if run_layout.trivial else self.gathered))
                  for n, p in zip(per_device, self.per_run))
    waiting = (run_layout.splits - 1) * sum(n * s for n, s in zip(per_device, self.state))
    return int(self.data + working + waiting)


def estimate(sim: Simulation, federation: Federation, batch: CellBatch,
             num_rounds: int) -> Estimate:
  """The analytic memory estimate of a batch (nothing is compiled).

  Args:
    sim: the simulation (its ``init`` and ``local_update`` are traced
      abstractly, ``jax.eval_shape``; ``sim.config`` gives the hidden width,
      layers and the backbone's training input, a method's own recipe
      included).
    federation: its federation (shapes only).
    batch: the cells' ``CellBatch``.
    num_rounds: rounds per chunk (the metrics kept on the device).
  """
  from fedjax_graph import models
  from fedjax_graph.simulation import RoundMetrics, client_keys, for_each_client

  config = sim.config
  data = host_data(federation)
  one_seed = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  states = jax.eval_shape(sim.init, jax.ShapeDtypeStruct((1,), np.int32), batch)
  state = [tree_bytes(s) // g.size for s, g in zip(states, batch.groups)]
  one_run = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), states[0])

  def outputs(run, shards):
    start = run.method.clients if sim.method.personal else run.params
    keys = client_keys(run.key, 0, federation.num_clients)
    return for_each_client(sim.local_update, federation, sim.training_input, start, run.params,
                           shards, keys, run.method.clients, run.method.server,
                           per_client_start=sim.method.personal)

  client_outputs = tree_bytes(jax.eval_shape(outputs, one_run, one_seed(data.client_shards)))
  features, hidden = federation.eval_x.shape[-1], config.hidden
  with_graph = (models.BACKBONES[config.backbone].training_input == "graph"
                or sim.method.needs_graph)
  training, gathered = 0, 0
  for shard, rows in zip(data.client_shards, federation.bucket_train_rows):
    clients, nodes, edges = shard.x.shape[1], shard.x.shape[2], shard.senders.shape[2]
    if with_graph or config.norm_rows == "all":
      rows = nodes
    # The shard's graph part, its training operator included (a dense block
    # is N^2 floats per client, a CSR form E + N entries: graphs.operator_kind).
    graph = (tree_bytes(one_seed(shard)) // clients - 4 * nodes * features) if with_graph else 0
    gathered += clients * (4 * rows * features + graph)
    # A propagating backbone also holds each layer's messages, one per edge,
    # unless it propagates with the bucket's CSR or dense operator. SFPD's typed
    # CSR products are counted with them: XLA:CPU keeps per-entry temporaries
    # (FedSPA on WikiNet, 6 runs: 263 MiB without them, XLA 1.65 GiB, 2.49 GiB
    # with). A method that needs the graph is too (FGSSL's edge-list views;
    # FGGP's, CSR, overcounted).
    messages = with_graph and (shard.operator is None or sim.method.needs_graph)
    per_client = rows * hidden + (edges * hidden if messages else 0)
    training = max(training, 4 * clients * (rows * features + ACTIVATION_COPIES
                                            * config.num_layers * per_client))
  nodes = federation.eval_x.shape[0]
  evaluation = 4 * EVAL_COPIES * nodes * max(features, hidden)
  if sim.method.personal:  # every client's prediction of every node
    evaluation += 4 * federation.num_clients * nodes
  domains, clients = len(federation.domains), federation.num_clients
  metrics = num_rounds * tree_bytes(RoundMetrics(
      *(np.zeros(domains, np.float32) for _ in range(4)), np.zeros((), np.float32),
      np.zeros(clients, np.float32), np.zeros((), np.float32), np.zeros(clients, bool),
      np.zeros(domains, np.int32)))
  common = OUTPUT_COPIES * client_outputs + max(training, evaluation) + metrics
  return Estimate(data=tree_bytes(data), gathered=gathered,
                  per_run=tuple(STATE_COPIES * s + common for s in state), state=tuple(state))


class Plan(NamedTuple):
  """How a batch runs: its layout, the memory budget and both memory figures (bytes per device).

  Attributes:
    layout: the ``RunLayout``.
    budget: the budget; ``budget_source`` says where it comes from.
    estimate: the analytic estimate (``Estimate.total``).
    xla: XLA's figure for the compiled program (plus the waiting sub-batches'
      states), None where the backend gives none.
    seconds: the time spent choosing the layout, compilation included.
    first_round: the round this call of the sweep started from (> 0 when resumed).
  """
  layout: RunLayout
  budget: int
  budget_source: str
  estimate: int
  xla: Optional[int]
  seconds: float = 0.0
  first_round: int = 0

  def record(self) -> dict:
    """What config.json keeps of the plan."""
    lay = self.layout
    return {"devices": lay.devices, "runs": lay.runs, "sub_batches": lay.splits,
            "runs_per_sub_batch": sum(lay.per_batch), "padding_runs": lay.padding,
            "group_runs_per_sub_batch": list(lay.per_batch),
            "memory_budget_bytes": self.budget, "memory_budget": self.budget_source,
            "memory_estimate_bytes": self.estimate, "memory_xla_bytes": self.xla,
            "plan_seconds": self.seconds, "first_round": self.first_round}

  def describe(self) -> str:
    """One line: runs, devices, split, memory."""
    lay = self.layout
    where = f"{lay.runs} runs ({lay.num_seeds} seed(s) x {sum(lay.group_sizes)} cells) on " \
            f"{lay.devices} device(s)"
    if lay.splits > 1:
      where += (f" in {lay.splits} sub-batches of {sum(lay.per_batch)} runs"
                f" ({lay.padding} padding run(s) repeat real ones)")
    elif lay.padding:
      where += f" padded to {sum(lay.per_batch)} runs (repeating real ones)"
    return (f"batch: {where}; memory per device: estimate {format_size(self.estimate)}, XLA "
            f"{format_size(self.xla)}, budget {format_size(self.budget)} ({self.budget_source})")


class SingleRunner:
  """Today's program: the whole batch on one device (``Simulation.run_chunk``)."""

  def __init__(self, sim: Simulation, state, batch: CellBatch, data,
               schedule: EvalSchedule = EvalSchedule()):
    self.sim, self.batch, self.data, self.schedule = sim, batch, data, schedule
    self._state = jax.device_put(state)

  def compiled_bytes(self, first: int, size: int) -> Optional[int]:
    """Compiles the chunk of ``size`` rounds (the later call reuses it) and returns XLA's bytes."""
    lower = getattr(self.sim.run_chunk, "lower", None)  # tests may wrap run_chunk
    if lower is None:
      return None
    return xla_bytes(lower(self._state, np.int32(first), self.batch, self.data,
                           num_rounds=size, schedule=self.schedule).compile())

  def run(self, first: int, size: int):
    """``size`` rounds from round ``first``: metrics (host) [S, G', L, ...], groups in order."""
    self._state, metrics = self.sim.run_chunk(self._state, np.int32(first), self.batch,
                                              self.data, num_rounds=size, schedule=self.schedule)
    return jax.device_get(metrics)

  def state(self):
    """The state (host), per group leaves [S, G_g, ...]."""
    return jax.device_get(self._state)


class ShardedRunner:
  """The flat layout: sub-batches one after another, each split over the mesh."""

  def __init__(self, sim: Simulation, mesh: Mesh, run_layout: RunLayout, state,
               batch: CellBatch, federation: Federation,
               schedule: EvalSchedule = EvalSchedule()):
    self.layout, self.chunk, self.schedule = run_layout, sharded_chunk(sim, mesh), schedule
    runs = NamedSharding(mesh, PartitionSpec(AXIS))
    self.data = place(host_data(federation), NamedSharding(mesh, PartitionSpec()))
    self.states = [place(s, runs) for s in run_layout.to_runs(to_host(state))]
    self.inputs = [place(i, runs) for i in run_layout.inputs(batch)]
    self.waiting = (run_layout.splits - 1) * tree_bytes(self.states[0]) // run_layout.devices

  def compiled_bytes(self, first: int, size: int) -> Optional[int]:
    compiled = self.chunk.lower(self.states[0], np.int32(first), *self.inputs[0], self.data,
                                num_rounds=size, schedule=self.schedule).compile()
    measured = xla_bytes(compiled)
    return None if measured is None else measured + self.waiting

  def run(self, first: int, size: int):
    parts = []
    for b, inputs in enumerate(self.inputs):
      self.states[b], metrics = self.chunk(self.states[b], np.int32(first), *inputs, self.data,
                                           num_rounds=size, schedule=self.schedule)
      if self.layout.splits > 1:  # one sub-batch's temporaries at a time
        jax.block_until_ready(metrics)
      parts.append(metrics)
    groups = self.layout.from_runs(to_host(parts))
    return jax.tree.map(lambda *g: np.concatenate(g, axis=1), *groups)

  def state(self):
    return self.layout.from_runs(to_host(self.states))


def plan_batch(sim: Simulation, federation: Federation, batch: CellBatch, state,
               first: int, size: int, devices: Optional[int] = None,
               max_memory: Optional[int] = None, schedule: EvalSchedule = EvalSchedule(),
               attempts: int = 3):
  """Chooses the layout of a batch, compiles its program and returns ``(runner, Plan)``.

  The analytic ``estimate`` picks the fewest sub-batches that fit the budget
  (one device and one batch: today's program), before anything compiles. The
  program of that shape then compiles (the first chunk reuses it) and, where
  XLA reports its buffers, the estimate is rescaled to XLA's figure; if that
  predicts another split (finer, for a program over the budget; coarser, for
  an estimate that was too high), that one compiles too, at most ``attempts``
  programs in all (and, when none fits, the unsplit one, so that the error
  names the least need found). The fewest sub-batches that XLA found to fit win.

  Args:
    sim, federation, batch: the sweep's.
    state: its initial (or resumed) state, per group leaves [S, G_g, ...].
    first, size: the first chunk's round and length (its shape is compiled).
    devices: N (None: all devices).
    max_memory: the budget in bytes per device (None: ``default_budget``).
    schedule: the rounds evaluated (``simulation.EvalSchedule``).
    attempts: the most programs compiled to find the split (>= 1).

  Raises:
    ValueError: for a bad device count.
    controls.OverBudgetError: (a ValueError) for a batch whose programs tried
      all need more than the budget.
  """
  begin = time.perf_counter()
  mesh = device_mesh(devices)
  budget, source = ((max_memory, "--max-memory") if max_memory is not None
                    else default_budget(mesh))
  limit, what = device_memory(mesh)
  if budget > limit:
    # The budget only splits batches; it cannot add memory the device lacks.
    warnings.warn(f"--max-memory {format_size(budget)} is above {what}; a batch that needs "
                  f"more than the device has fails with an out-of-memory error, not a split")
  num_seeds, sizes, n = len(federation.seeds), [g.size for g in batch.groups], mesh.size
  est = estimate(sim, federation, batch, max(size, 1))
  finest = finest_split(num_seeds, sizes, n)
  lay = lambda k: layout(num_seeds, sizes, n, k)
  fewest = lambda bytes_of: next((k for k in range(1, finest + 1) if bytes_of(lay(k)) <= budget),
                                 None)
  splits, need, best = fewest(est.total) or finest, {}, None

  def attempt(splits):
    nonlocal best
    runner = (SingleRunner(sim, state, batch, jax.device_put(host_data(federation)), schedule)
              if lay(splits).trivial else
              ShardedRunner(sim, mesh, lay(splits), state, batch, federation, schedule))
    measured = runner.compiled_bytes(first, size) if size > 0 else None
    need[splits] = est.total(lay(splits)) if measured is None else measured
    if need[splits] <= budget and (best is None or splits < best[1].layout.splits):
      best = (runner, Plan(lay(splits), budget, source, est.total(lay(splits)), measured))
    return measured

  for _ in range(attempts):
    measured = attempt(splits)
    if measured is None:
      break
    # The estimate's run-dependent part, rescaled to XLA's figure.
    scale = (measured - est.data) / max(est.total(lay(splits)) - est.data, 1)
    rescaled = fewest(lambda l: est.data + scale * (est.total(l) - est.data))
    if need[splits] > budget:  # finer
      rescaled = max(rescaled or finest, splits + 1) if splits < finest else None
    elif rescaled is not None and rescaled >= splits:  # it fits; only coarser would be better
      rescaled = None
    if rescaled is None or rescaled in need:
      break
    splits = rescaled
  if best is None and 1 not in need and size > 0:
    # The estimate may overstate what one batch needs (sub-batches hold the waiting states
    # too): measure it before saying what to raise the budget to.
    attempt(1)
  if best is None:
    least = min(need, key=need.get)
    runs = sum(lay(least).per_batch)
    advice = ("raise --max-memory" + (", use more --devices" if n < len(jax.devices()) else "")
              + (", or run fewer seeds or cells at once" if num_seeds * sum(sizes) > 1 else ""))
    raise OverBudgetError(
        f"the batch needs at least {format_size(need[least])} per device (the least of the "
        f"layouts tried: {least} sub-batch(es) of {runs} runs), over the budget of "
        f"{format_size(budget)} ({source}); {advice}")
  runner, plan = best
  return runner, plan._replace(seconds=time.perf_counter() - begin, first_round=first)
