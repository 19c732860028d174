"""Throughput of the vectorised sweep vs a Python loop over clients and runs; where the time goes.

  python experiments/bench.py --raw-dir ../shared/datasets/musae --cache-dir /tmp/fjg_cache
  python experiments/bench.py --dataset wikinet --setting default --rounds 2 --skip-loop
  python experiments/bench.py --skip-loop --skip-schedule --scaling --plot scaling.png
  python experiments/bench.py --backbones gcn,pmlp_gcn --propagations auto,dense,sparse --only-backbones
  python experiments/bench.py --dataset wikinet --kernels

Times the first ``run_chunk`` call (compile + run) and a second of the same
shape (run only), then the same rounds with every client, cell and seed in a
Python loop (same keys, so the final accuracies must agree), and prints the
speed-up. Then the round time with a share q of clients sampled (only they
train, ``--compare-participation``) against q = 1, and with evaluation every
k rounds (``--compare-eval-every``) against every round, each a ratio of
chunks of ``--schedule-rounds`` rounds. With ``--backbones gcn,pmlp_gcn`` it first
times a round-cell of each backbone with each training propagation of
``--propagations`` (``Config.propagation``; default auto,sparse) and prints the
gcn / pmlp_gcn ratio per propagation (``--only-backbones``: nothing else).
Every number is measured in this run.

Where the time goes (``breakdown``, skipped with ``--skip-breakdown``): one
round's three parts, local training (every client's steps), aggregation (the
cells' aggregators and the server step) and evaluation (every run on the full
graphs), are each jitted alone on the shapes of the batch (``round_pieces``:
the same vmaps over seeds x cells x clients as the round) and timed after
their compile, best of ``--repeats``; their shares are of the three's sum,
printed beside the fused round (``run_chunk`` of one round), which XLA may
schedule better or worse than the parts. The local training's matmul FLOPs
are counted from the shapes (``training_flops``: the dense layers, forward
and backward; XLA's own cost analysis counts a ``lax.scan`` body once, not
per step) and set against this machine's matmul peak measured in the same run
(``matmul_peak``: a large square f32 product, best of ``--repeats``).

Edge kernels (``--kernels``, nothing else runs): the per-edge dot and the
neighbour sum, each as a gather of every edge's rows against
``graphs.edge_dot`` and ``graphs.csr_product``, on the bucket with the most
edge slots (``kernel_ratios``), with their ratios.

Scaling (``--scaling``): seconds per round, one compile per point and
``--scaling-rounds`` timed rounds, against the number of clients (Twitch DE
cut into 20, 80, 320 clients, the other countries as the preset, FedAvg and
FedIA(0.5, 0.5), 1 seed), the number of runs in the batch (1: FedAvg; 26: the
5 x 5 FedIA grid + FedAvg; 78 and 260: the same with 3 and 10 seeds) and the
number of devices (1, 2, 4 forced host devices, each in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``: on one CPU they
share its cores, so this checks correctness, the final accuracies against 1
device, not speed). Printed as a table and drawn to ``--plot`` (PNG).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import NamedTuple, Optional, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_graph import cells as cells_lib  # noqa: E402
from fedjax_graph import cli  # noqa: E402
from fedjax_graph import graphs, models  # noqa: E402
from fedjax_graph.controls import RunControls  # noqa: E402
from fedjax_graph.data import build_federation, load_dataset  # noqa: E402
from fedjax_graph.sweep import run_sweep  # noqa: E402
from fedjax_graph.simulation import (EvalSchedule, client_keys, for_each_client,  # noqa: E402
                                     make_simulation, participant_count, sim_data, slot_groups)


def timed(fn, *args, **kwargs):
  """(fn(...) with every leaf ready, seconds)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, time.perf_counter() - start


def rates(label, seconds, rounds, runs, clients, local_steps):
  """Prints and returns (round-cells/s, client-steps/s) of ``rounds`` rounds of ``runs`` runs."""
  round_cells = rounds * runs
  rc_per_s, steps_per_s = round_cells / seconds, round_cells * clients * local_steps / seconds
  print(f"  {label}: {seconds:.3f} s for {rounds} rounds x {runs} runs -> "
        f"{rounds / seconds:.3f} rounds/s (whole batch), {rc_per_s:.2f} round-cells/s "
        f"({seconds / round_cells * 1e3:.1f} ms per round-cell), {steps_per_s:.0f} client-steps/s")
  return rc_per_s, steps_per_s


def seed_data(data, s):
  """The SimData of seed ``s``: shards [C_b, ...], eval masks [N]."""
  return data._replace(client_shards=jax.tree.map(lambda leaf: leaf[s], data.client_shards),
                       eval_val=data.eval_val[s], eval_test=data.eval_test[s],
                       eval_owner=data.eval_owner[s])


def looped_runs(sim, federation, state0, cells, data, rounds, warmup):
  """Final test accuracy f32[S, G', D] of every run (cells in order), clients and runs in Python loops.

  With ``warmup``, runs one round of the first cell of each aggregator group only (to
  compile) and returns None.
  """
  local_update, evaluate = jax.jit(sim.local_update), jax.jit(sim.evaluate)
  aggregate = jax.jit(sim.aggregate, static_argnums=1)  # the aggregator's name
  num_seeds = len(federation.seeds)
  final = np.zeros((num_seeds, len(cells), len(federation.domains)), np.float32)
  batch = cells.batch()
  for s in range(1 if warmup else num_seeds):
    data_s = seed_data(data, s)
    for group_state, group, values, members in zip(state0, batch.groups, batch.values,
                                                   cells.members):
      for j, g in enumerate(members[:1] if warmup else members):
        state = jax.tree.map(lambda leaf: leaf[s, j], group_state)
        hparams = {name: v[j] for name, v in values.items()}
        for t in range(1 if warmup else rounds):
          outputs = for_each_client(local_update, federation, sim.training_input, state.params,
                                    state.params, data_s.client_shards,
                                    client_keys(state.key, t, federation.num_clients),
                                    backend="loop")
          state, _ = aggregate(state, group.aggregator, hparams, outputs, data_s.train_counts)
          test, _ = evaluate(state.params, data_s.eval_val, data_s.eval_test, data_s.eval_owner,
                             data_s)
        final[s, g] = np.asarray(test.acc)
  return None if warmup else final


def round_seconds(sim, batch, data, seeds, rounds, schedule):
  """Seconds per round of a chunk of ``rounds``: its second call (run only; the first compiles)."""
  state = sim.init(np.asarray(seeds, np.int32), batch)
  state, _ = timed(sim.run_chunk, state, np.int32(0), batch, data, num_rounds=rounds,
                   schedule=schedule)[0]
  _, seconds = timed(sim.run_chunk, state, np.int32(rounds), batch, data, num_rounds=rounds,
                     schedule=schedule)
  return seconds / rounds


def schedule_ratios(config, federation, cells, data, seeds, q, k, rounds):
  """Prints round times with q of the clients sampled and with evaluation every k rounds, vs 1."""
  batch = jax.device_put(cells.batch())
  # Evaluate every k rounds; the final rounds (none here: final_from is past the chunks) aside.
  schedules = {1: EvalSchedule(), k: EvalSchedule(k, 10**9)}
  times = {}
  for share in (1.0, q):
    sim = make_simulation(dataclasses.replace(config, participation=share), federation)
    for every, schedule in schedules.items():
      times[share, every] = round_seconds(sim, batch, data, seeds, rounds, schedule)
      print(f"  q={share:g}, evaluation every {every} round(s): {times[share, every]:.3f} s per "
            f"round ({rounds}-round chunks, {len(cells)} cells x {len(seeds)} seed(s))")
  m, C = participant_count(q, federation.num_clients), federation.num_clients
  groups = slot_groups(federation, m)
  # Local training's work: the training rows a rows backbone (PMLP-GCN) steps over, padded.
  slot_rows = sum(g.size * g.train_rows for g in groups)
  all_rows = sum(len(c) * r for c, r in zip(federation.bucket_clients,
                                            federation.bucket_train_rows))
  print(f"  q={q:g}: m={m} of C={C} clients train, in {len(groups)} slot group(s) "
        f"{[(g.size, g.train_rows) for g in groups]} (slots, training rows each): "
        f"{slot_rows} of {all_rows} padded training rows = {slot_rows / all_rows:.2f} of the "
        f"local work (m/C = {m / C:.2f})")
  for every in schedules:
    print(f"  round time q={q:g} / q=1, evaluation every {every}: "
          f"{times[q, every] / times[1.0, every]:.2f} (a 1/q speed-up would be {m / C:.2f}, "
          f"the slots' share of the local work is {slot_rows / all_rows:.2f})")
  for share in (1.0, q):
    print(f"  round time evaluation every {k} / every round, q={share:g}: "
          f"{times[share, k] / times[share, 1]:.2f}")
  return times


class RoundPieces(NamedTuple):
  """One round of a batch in three separately jittable parts (``round_pieces``).

  Attributes:
    train: ``train(states, data, t)`` -> per group the clients' ``ClientOutput``
      (leaves [S, G_g, C, ...]): every client's local steps.
    aggregate: ``aggregate(states, values, outputs, data)`` -> the new states:
      each cell's aggregation and the method's server step.
    evaluate: ``evaluate(states, data)`` -> per group (test ``Scores``,
      validation accuracy) of every run on the full graphs.
  """
  train: callable
  aggregate: callable
  evaluate: callable


def round_pieces(sim, federation, batch) -> RoundPieces:
  """The parts of ``sim``'s round for ``batch``, vmapped over seeds x cells as ``run_chunk`` is.

  Every client trains (participation 1, the path of ``run_group`` without
  slots), so with q < 1 the local part is that of q = 1.
  """
  C, method = federation.num_clients, sim.method

  def train(states, data, t):
    def per_run(s, shards):
      start = s.method.clients if method.personal else s.params
      return for_each_client(sim.local_update, federation, sim.training_input, start, s.params,
                             shards, client_keys(s.key, t, C), s.method.clients,
                             s.method.server, per_client_start=method.personal)
    per_cell = jax.vmap(per_run, in_axes=(0, None))
    return tuple(jax.vmap(per_cell)(state, data.client_shards) for state in states)

  def aggregate(states, values, outputs, data):
    new = []
    for state, group, hparams, out in zip(states, batch.groups, values, outputs):
      per_cell = jax.vmap(lambda s, h, o, name=group.aggregator: sim.aggregate(
          s, name, h, o, data.train_counts)[0])
      new.append(jax.vmap(per_cell, in_axes=(0, None, 0))(state, hparams, out))
    return tuple(new)

  def evaluate(states, data):
    per_cell = jax.vmap(sim.evaluate, in_axes=(0, None, None, None, None, 0))
    per_seed = jax.vmap(per_cell, in_axes=(0, 0, 0, 0, None, 0))
    return tuple(per_seed(state.method.clients if method.personal else state.params,
                          data.eval_val, data.eval_test, data.eval_owner, data,
                          state.method.server) for state in states)

  return RoundPieces(train, aggregate, evaluate)


def best_seconds(fn, *args, repeats=3):
  """(fn(*args) ready, the fastest of ``repeats`` timed calls after one untimed call: its compile)."""
  out = jax.block_until_ready(fn(*args))
  return out, min(timed(fn, *args)[1] for _ in range(repeats))


class Breakdown(NamedTuple):
  """Seconds of one round of a batch, by part (``breakdown``).

  Attributes:
    train, aggregate, evaluate: seconds of each part jitted alone.
    round: seconds of the fused round (``run_chunk`` of 1 round).
    shares: {part: its share of train + aggregate + evaluate}, summing to 1.
  """
  train: float
  aggregate: float
  evaluate: float
  round: float
  shares: dict


def breakdown(sim, federation, batch, data, seeds, repeats=3, jit=jax.jit) -> Breakdown:
  """Times the three parts of a round (``round_pieces``) and the whole round on the same state.

  ``jit``: how each part (and the round) is compiled (tests pass a faster compile).
  """
  pieces = round_pieces(sim, federation, batch)
  states = jax.block_until_ready(sim.init(np.asarray(seeds, np.int32), batch))
  t = np.int32(0)
  outputs, train_s = best_seconds(jit(pieces.train), states, data, t, repeats=repeats)
  _, aggregate_s = best_seconds(jit(pieces.aggregate), states, batch.values, outputs, data,
                                repeats=repeats)
  _, evaluate_s = best_seconds(jit(pieces.evaluate), states, data, repeats=repeats)
  one_round = jit(lambda s, b, d: sim.run_chunk(s, t, b, d, num_rounds=1))
  _, round_s = best_seconds(one_round, states, batch, data, repeats=repeats)
  parts = {"local training": train_s, "aggregation": aggregate_s, "evaluation": evaluate_s}
  total = sum(parts.values())
  return Breakdown(train_s, aggregate_s, evaluate_s, round_s,
                   {name: seconds / total for name, seconds in parts.items()})


def training_flops(config, federation, num_runs: int) -> float:
  """Matmul FLOPs of one round's local training for ``num_runs`` runs (every client trains).

  Per client and local step, each dense layer d_in -> d_out over the r rows
  a step computes (the bucket's training rows for a ``rows`` backbone with
  ``norm_rows: train``, else its padded node rows) costs 2 r d_in d_out
  forward and twice that backward, but the first layer, whose input needs no
  gradient (once). Propagation, batch norm and elementwise work are not
  counted (for ``gcn`` the count is then a lower bound).
  """
  widths = [federation.eval_x.shape[-1]] + [config.hidden] * (config.num_layers - 1) + [
      federation.num_classes]
  layers = list(zip(widths[:-1], widths[1:]))
  per_row = sum(2 * a * b for a, b in layers) * 3 - 2 * layers[0][0] * layers[0][1]
  rows_backbone = models.BACKBONES[config.backbone].training_input == "rows"
  rows = 0
  for clients, shard, train_rows in zip(federation.bucket_clients, federation.client_shards,
                                        federation.bucket_train_rows):
    per_client = train_rows if rows_backbone and config.norm_rows == "train" else shard.x.shape[-2]
    rows += len(clients) * per_client
  return float(per_row) * rows * config.local_steps * num_runs


def matmul_peak(size=2048, repeats=3) -> float:
  """FLOP/s of a ``size`` x ``size`` f32 matmul on the default device, the best of ``repeats``."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.float32)
  _, seconds = best_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats)
  return 2 * size**3 / seconds


def print_breakdown(parts: Breakdown, flops: float, peak: float, runs: int) -> float:
  """Prints the parts' seconds and shares and the training FLOP/s; returns the share of the peak."""
  for name, seconds in zip(parts.shares, (parts.train, parts.aggregate, parts.evaluate)):
    print(f"  {name}: {seconds * 1e3:.1f} ms ({parts.shares[name]:.0%} of the three parts' "
          f"{(parts.train + parts.aggregate + parts.evaluate) * 1e3:.1f} ms)")
  print(f"  the fused round: {parts.round * 1e3:.1f} ms ({parts.round / runs * 1e3:.1f} ms per "
        f"round-cell, {runs} runs)")
  achieved = flops / parts.train
  print(f"  local training: {flops / 1e9:.2f} GFLOP of dense-layer matmuls per round "
        f"({flops / runs / 1e9:.2f} per round-cell) in {parts.train * 1e3:.1f} ms = "
        f"{achieved / 1e9:.1f} GFLOP/s; matmul peak measured now {peak / 1e9:.1f} GFLOP/s: "
        f"{achieved / peak:.0%} of it")
  return achieved / peak


SCALING_CLIENTS = (20, 80, 320)
SCALING_RUNS = (1, 26, 78, 260)
SCALING_DEVICES = (1, 2, 4)


class ScalingRow(NamedTuple):
  """One point of the scaling table: what varied, the batch, and its time."""
  axis: str
  value: int
  clients: int
  runs: int
  devices: int
  compile_s: float
  round_s: float
  max_diff: Optional[float] = None  # devices: max |final test acc - 1 device's|

  @property
  def round_cell_s(self) -> float:
    return self.round_s / self.runs


def point_cells(runs_per_seed: int):
  """1: FedAvg alone; 2: FedAvg and FedIA(0.5, 0.5); 26: the 5 x 5 FedIA grid + FedAvg."""
  if runs_per_seed == 1:
    return cells_lib.Cells([cells_lib.cell("fedavg")])
  if runs_per_seed == 2:
    return cells_lib.grid("fedia", rho=[0.5], beta=[0.5])
  values = [0.1, 0.3, 0.5, 0.7, 0.9]
  assert runs_per_seed == 26, runs_per_seed
  return cells_lib.grid("fedia", rho=values, beta=values)


def runs_layout(runs: int) -> tuple[int, int]:
  """(cells per seed, seeds) of a batch of ``runs`` runs: 1 -> (1, 1), 26 k -> (26, k), else (2, runs / 2)."""
  if runs == 1:
    return 1, 1
  if runs % 26 == 0:
    return 26, runs // 26
  if runs % 2 == 0:
    return 2, runs // 2
  raise ValueError(f"a batch of {runs} runs: use 1, a multiple of 26 or an even number")


def scaling_point(config, domain_graphs, runs: int, rounds: int, axis: str, value: int):
  """Compile and per-round seconds of a batch of ``runs`` runs of ``config`` (one device)."""
  per_seed, num_seeds = runs_layout(runs)
  seeds = list(range(num_seeds))
  cells = point_cells(per_seed)
  federation = build_federation(config, domain_graphs, seeds)
  sim = make_simulation(config, federation)
  data, batch = sim_data(federation), jax.device_put(cells.batch())
  state = sim.init(np.asarray(seeds, np.int32), batch)
  (state, _), first_s = timed(sim.run_chunk, state, np.int32(0), batch, data, num_rounds=rounds)
  _, second_s = timed(sim.run_chunk, state, np.int32(rounds), batch, data, num_rounds=rounds)
  return ScalingRow(axis, value, federation.num_clients, runs, 1, first_s - second_s,
                    second_s / rounds)


def devices_point(config, domain_graphs, devices: int, rounds: int, seeds=(0, 1)):
  """(compile s, seconds per round, final test acc f32[S, G', D]) on ``devices`` devices.

  FedAvg and FedIA(0.5, 0.5) for ``seeds``, through ``run_sweep`` (the
  ``--devices`` path), two chunks of ``rounds``: the second is the timed one;
  the compile (with the setup) is the time outside the chunks.
  """
  cells = point_cells(2)
  federation = build_federation(config, domain_graphs, list(seeds))
  start = time.perf_counter()
  history = run_sweep(config, federation, cells, 2 * rounds,
                      RunControls(chunk=rounds, progress=False, devices=devices))
  wall = time.perf_counter() - start
  # run_sweep compiles before its first chunk: compile and setup are the time outside the chunks.
  return (wall - sum(history.seconds), history.seconds[1] / rounds,
          np.asarray(history.test_acc[..., -1, :]))


def devices_row(devices: int, argv: Sequence[str], reference=None) -> tuple:
  """Runs ``devices_point`` in a subprocess with ``devices`` forced host devices.

  ``argv``: this script's data and config flags. Returns (ScalingRow without
  max_diff, final accuracies).
  """
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                     f" --xla_force_host_platform_device_count={devices}")}
  done = subprocess.run([sys.executable, __file__, *argv, "--devices-point", str(devices)],
                        env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"the {devices}-device point failed:\n{done.stderr[-3000:]}")
  line = [l for l in done.stdout.splitlines() if l.startswith("DEVICES_POINT ")][-1]
  got = json.loads(line.split(" ", 1)[1])
  acc = np.asarray(got["final_acc"])
  return ScalingRow("devices", devices, got["clients"], acc.shape[0] * acc.shape[1], devices,
                    got["compile_s"], got["round_s"]), acc


def scaling_table(config, domain_graphs, *, domain: Optional[str] = None, clients=SCALING_CLIENTS,
                  runs=SCALING_RUNS, devices=SCALING_DEVICES, rounds: int = 2,
                  argv: Sequence[str] = ()) -> list[ScalingRow]:
  """The scaling rows: ``clients`` (``domain`` cut into that many, FedAvg + FedIA, 1 seed),
  ``runs`` in the batch (``config`` as given) and ``devices`` (subprocesses; ``argv`` their flags).

  ``domain`` None: the dataset's first (Twitch: DE).
  """
  domain = domain or config.domains[0]
  rows = []
  for count in clients:
    cut = dataclasses.replace(config, clients_per_domain={**config.clients_per_domain,
                                                          domain: count})
    rows.append(scaling_point(cut, domain_graphs, 2, rounds, "clients", count))
    print_row(rows[-1])
  for count in runs:
    rows.append(scaling_point(config, domain_graphs, count, rounds, "runs", count))
    print_row(rows[-1])
  reference = None
  for count in devices:
    row, acc = devices_row(count, argv)
    reference = acc if reference is None else reference
    rows.append(row._replace(max_diff=float(np.max(np.abs(acc - reference)))))
    print_row(rows[-1])
  return rows


def print_row(row: ScalingRow) -> None:
  diff = "" if row.max_diff is None else f"  max |acc - 1 device| {row.max_diff:.1e}"
  print(f"  {row.axis:>8} {row.value:>5}: C={row.clients:<4} runs={row.runs:<4} "
        f"devices={row.devices}  compile {row.compile_s:6.1f} s  {row.round_s:8.3f} s/round  "
        f"{row.round_cell_s * 1e3:8.1f} ms/round-cell{diff}", flush=True)


def peak_memory() -> str:
  """The default device's peak memory in use (an allocator's statistic: GPU/TPU), else the host's."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return f"{stats['peak_bytes_in_use'] / 2**30:.2f} GiB (device peak_bytes_in_use)"
  import resource  # CPU: no allocator statistics; the process's peak resident memory instead
  return (f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (host peak RSS: "
          "no device statistics on CPU)")


def full_run(config, domain_graphs, cells, seeds, rounds: int) -> dict:
  """Every cell x seed for ``rounds`` rounds through ``run_sweep`` (the grid's path), timed.

  Four equal chunks (or chunks of 1 round when ``rounds`` is not a multiple
  of 4): compile time is the wall time outside the chunks (``run_sweep``
  compiles before the first, with the initial state and the memory check);
  round-cells/s is over the chunks after the first. Prints and returns the
  figures.
  """
  chunk = rounds // 4 if rounds % 4 == 0 else 1  # equal chunks: one compiled shape
  federation = build_federation(config, domain_graphs, seeds)
  start = time.perf_counter()
  history = run_sweep(config, federation, cells, rounds, RunControls(chunk=chunk, progress=False))
  wall = time.perf_counter() - start
  seconds, runs = list(history.seconds), len(cells) * len(seeds)
  # run_sweep compiles the program before its first chunk (its memory check): the time
  # outside the chunks is the compile and the setup (the initial state, the estimate).
  compile_s = wall - sum(seconds)
  steady = seconds[1:] or seconds  # the first chunk may still warm up
  rc_per_s = len(steady) * chunk * runs / sum(steady)
  final = np.asarray(history.test_acc[..., -1, :])
  out = dict(wall_s=wall, compile_s=compile_s, round_cells_per_s=rc_per_s, runs=runs,
             rounds=rounds, chunk=chunk, finite=bool(np.isfinite(final).all()),
             avg_final_acc=float(np.mean(final)), peak_memory=peak_memory())
  print(f"== full run: {config.dataset} {config.setting}, {len(cells)} cells x {len(seeds)} "
        f"seed(s) = {runs} runs x {rounds} rounds on {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind})")
  print(f"  wall time {wall:.1f} s (data on the host to results, compile included); "
        f"compile and setup {compile_s:.1f} s; {rc_per_s:.1f} round-cells/s "
        f"({1e3 / rc_per_s:.2f} ms per round-cell) in chunks of {chunk} rounds after the first")
  print(f"  peak memory: {out['peak_memory']}; final test accuracy, mean over runs and domains: "
        f"{out['avg_final_acc']:.4f}; all finite: {out['finite']}")
  print("FULL_RUN " + json.dumps(out))
  return out


def plot_scaling(rows: Sequence[ScalingRow], path: pathlib.Path, title: str) -> None:
  """Seconds per round against each axis, one panel per axis (log-log where it spans decades)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  axes_names = [a for a in ("clients", "runs", "devices") if any(r.axis == a for r in rows)]
  fig, axes = plt.subplots(1, len(axes_names), figsize=(4.2 * len(axes_names), 3.6),
                           squeeze=False)
  labels = {"clients": "clients C", "runs": "runs in the batch",
            "devices": "forced host devices (same cores)"}
  for ax, name in zip(axes[0], axes_names):
    points = [r for r in rows if r.axis == name]
    x = [r.clients if name == "clients" else r.value for r in points]
    ax.plot(x, [r.round_s for r in points], "o-", label="s per round")
    if name == "runs":
      ax.plot(x, [r.round_cell_s for r in points], "s--", label="s per round-cell")
      ax.legend()
    if name == "runs":  # spans decades in both
      ax.set_yscale("log")
    else:
      ax.set_ylim(bottom=0)
    if name != "devices":
      ax.set_xscale("log")
      ax.minorticks_off()
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel(labels[name])
    ax.set_ylabel("seconds")
    ax.grid(True, alpha=0.3)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def backbone_ratios(config, domain_graphs, seeds, cells, rounds, backbones, propagations):
  """Prints seconds per round-cell of each backbone x training propagation and the ratios.

  Each (backbone, ``Config.propagation``) pair is a federation and a program of its own,
  timed on its second chunk of ``rounds`` rounds (the first compiles). The ratio of each
  backbone to the last one (e.g. gcn / pmlp_gcn) is taken per propagation, all measured in
  this run; the final accuracies of one backbone must agree across propagations (they
  differ only in float rounding). Returns ``{(backbone, propagation): seconds}``.
  """
  batch = jax.device_put(cells.batch())
  runs = len(cells) * len(seeds)
  times, finals = {}, {}
  for propagation in propagations:
    federation = build_federation(dataclasses.replace(config, propagation=propagation),
                                  domain_graphs, seeds)
    kinds = [graphs.kind_of(shard.operator) for shard in federation.client_shards]
    data = sim_data(federation)
    for backbone in backbones:
      run_config = dataclasses.replace(config, backbone=backbone, propagation=propagation)
      sim = make_simulation(run_config, federation)
      state = sim.init(np.asarray(seeds, np.int32), batch)
      (state, _), first_s = timed(sim.run_chunk, state, np.int32(0), batch, data,
                                  num_rounds=rounds)
      (_, metrics), second_s = timed(sim.run_chunk, state, np.int32(rounds), batch, data,
                                     num_rounds=rounds)
      times[backbone, propagation] = second_s / (rounds * runs)
      finals[backbone, propagation] = np.asarray(metrics.test_acc[..., -1, :])
      print(f"  {backbone}, propagation {propagation} (buckets: {', '.join(kinds)}): "
            f"{times[backbone, propagation] * 1e3:.1f} ms per round-cell (compile ~ "
            f"{first_s - second_s:.1f} s), final AVG test acc "
            f"{100 * finals[backbone, propagation].mean():.2f}")
  base = backbones[-1]
  for propagation in propagations:
    for backbone in backbones[:-1]:
      print(f"  {backbone} / {base} round-cell time, propagation {propagation}: "
            f"{times[backbone, propagation] / times[base, propagation]:.2f}")
  for backbone in backbones:
    diffs = [float(np.max(np.abs(finals[backbone, p] - finals[backbone, propagations[0]])))
             for p in propagations[1:]]
    if diffs:
      print(f"  {backbone}: max |final test acc - {propagations[0]}'s| over "
            f"{list(propagations[1:])}: {max(diffs):.2e}")
  return times


def kernel_ratios(federation, width: int, models_side_by_side: int, repeats: int) -> None:
  """The edge kernels on the bucket with the most edge slots: per-edge gathers vs the blocked and CSR forms.

  Forward and backward of (1) the per-edge dot <z_u, z_v> (FGSSL's cosines,
  FGGP's scores): all edges' rows gathered at once vs ``graphs.edge_dot``;
  (2) a neighbour sum (SFPD's typed sums, FGGP's second view): gather and
  segment-sum vs ``graphs.csr_product``; each over ``models_side_by_side``
  models (vmap), width ``width``, best of ``repeats``, with the ratio.
  """
  b = int(np.argmax([shard.senders.shape[-1] for shard in federation.client_shards]))
  shard = federation.client_shards[b]
  senders, receivers = (jnp.asarray(np.asarray(leaf)[0, 0]) for leaf in (shard.senders,
                                                                         shard.receivers))
  n, e = shard.x.shape[-2], senders.shape[0]
  order = jnp.argsort(receivers, stable=True)
  csr = graphs.CSRGraph(jnp.ones((e,)), senders[order], graphs.row_pointers(receivers[order], n))
  z = jax.random.normal(jax.random.PRNGKey(0), (models_side_by_side, n, width))
  weights = jax.random.normal(jax.random.PRNGKey(1), (e,))
  # The graph is an argument (a constant would be folded at compile time, sorts included).
  graph = (senders, receivers, order, csr)
  per_edge = {
      "per-edge dot, all rows gathered": lambda z, g: jnp.sum(z[g[0]] * z[g[1]], axis=-1),
      "per-edge dot, graphs.edge_dot": lambda z, g: graphs.edge_dot(z, z, g[0], g[1])}
  neighbour = {
      "neighbour sum, gather + segment-sum": lambda z, g: jax.ops.segment_sum(
          z[g[0][g[2]]], g[1][g[2]], num_segments=n),
      "neighbour sum, graphs.csr_product": lambda z, g: graphs.csr_product(z, g[3])}
  print(f"== edge kernels: bucket {b}, {n} rows, {e} edge slots, {models_side_by_side} models, "
        f"width {width}, forward + backward (best of {repeats})")
  for family, reduce in ((per_edge, lambda out: jnp.sum(jnp.sin(out) * weights)),
                         (neighbour, lambda out: jnp.sum(jnp.sin(out)))):
    seconds = {}
    for name, fn in family.items():
      step = jax.jit(jax.vmap(jax.grad(lambda z, g, fn=fn: reduce(fn(z, g))), in_axes=(0, None)))
      seconds[name] = best_seconds(step, z, graph, repeats=repeats)[1]
      print(f"  {name:38s} {seconds[name] * 1e3:9.1f} ms")
    slow, fast = seconds.values()
    print(f"  ratio: {slow / fast:.1f}x")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dataset", default=None, choices=list(cli.DATASETS),
                      help="the preset's dataset (default: twitch)")
  parser.add_argument("--setting", default=None,
                      help="preset in configs/ (default: s3 for twitch, else the first)")
  cli.add_config_flags(parser)
  parser.add_argument("--rounds", type=int, default=4, help="rounds per timed call (default: 4)")
  parser.add_argument("--rho", type=cli.float_list, default="0.1,0.5")
  parser.add_argument("--beta", type=cli.float_list, default="0.3,0.9")
  parser.add_argument("--seeds", type=cli.int_list, default="0")
  parser.add_argument("--raw-dir", type=pathlib.Path, default=None)
  parser.add_argument("--cache-dir", type=pathlib.Path, default=None)
  parser.add_argument("--skip-loop", action="store_true", help="skip the Python-loop reference")
  # Not --participation: that one is the config's (cli.SHORTCUTS), for every measurement.
  parser.add_argument("--compare-participation", type=float, default=0.2,
                      help="share q of clients sampled, timed against q = 1 (default: %(default)s)")
  parser.add_argument("--compare-eval-every", type=int, default=10,
                      help="evaluation interval k timed against every round (default: %(default)s)")
  parser.add_argument("--schedule-rounds", type=int, default=10,
                      help="rounds per timed chunk of those two comparisons (default: %(default)s)")
  parser.add_argument("--skip-schedule", action="store_true",
                      help="skip the participation and evaluation-interval timings")
  parser.add_argument("--skip-breakdown", action="store_true",
                      help="skip the round's breakdown and the FLOP/s against the matmul peak")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed calls per breakdown part and peak, the best kept (default: 3)")
  parser.add_argument("--scaling", action="store_true",
                      help="time per round vs clients, runs in the batch and devices; table, plot")
  parser.add_argument("--scaling-rounds", type=int, default=2,
                      help="timed rounds per scaling point (default: %(default)s)")
  parser.add_argument("--scaling-clients", type=cli.int_list, default="20,80,320",
                      help="clients the DE graph is cut into (default: %(default)s)")
  parser.add_argument("--scaling-runs", type=cli.int_list, default="1,26,78,260",
                      help="runs per batch: 1, multiples of 26 or even (default: %(default)s)")
  parser.add_argument("--scaling-devices", type=cli.int_list, default="1,2,4",
                      help="forced host devices; the first is the reference (default: %(default)s)")
  parser.add_argument("--plot", type=pathlib.Path, default=pathlib.Path("results/bench-scaling.png"),
                      help="the scaling plot (default: %(default)s)")
  parser.add_argument("--full-run", type=int, default=None, metavar="ROUNDS",
                      help="only time the whole --rho x --beta grid + FedAvg x --seeds for ROUNDS "
                           "rounds through run_sweep (experiments/bench_gpu.sh)")
  parser.add_argument("--devices-point", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--backbones", type=lambda text: text.split(","), default=None,
                      help="compare these backbones' round-cell times, the last the reference, "
                      "e.g. gcn,pmlp_gcn (default: no comparison)")
  parser.add_argument("--propagations", type=lambda text: text.split(","), default=["auto", "sparse"],
                      help="training propagations (Config.propagation) of the backbone "
                      "comparison (default: auto,sparse)")
  parser.add_argument("--only-backbones", action="store_true",
                      help="run only the backbone comparison")
  parser.add_argument("--kernels", action="store_true",
                      help="run only the edge-kernel comparison: per-edge gathers against "
                           "graphs.edge_dot and graphs.csr_product on the bucket with the most "
                           "edges (12 models side by side, width --set hidden)")
  raw_argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(raw_argv)
  if args.rounds < 1 or args.scaling_rounds < 1 or args.repeats < 1:
    parser.error("--rounds, --scaling-rounds and --repeats must be >= 1")
  if (not 0 < args.compare_participation < 1 or args.compare_eval_every < 2
      or args.schedule_rounds < 1):
    parser.error("--compare-participation must be in (0, 1), --compare-eval-every >= 2 and "
                 "--schedule-rounds >= 1")
  if args.config is None:
    args.dataset = args.dataset or "twitch"
    args.setting = args.setting or ("s3" if args.dataset == "twitch" else None)
  config = cli.config_from_args(parser, args)
  try:
    cells = cells_lib.grid("fedia", rho=args.rho, beta=args.beta)
  except ValueError as err:
    parser.error(str(err))
  domain_graphs, _ = load_dataset(config.dataset, args.raw_dir, args.cache_dir)
  if args.devices_point is not None:  # a subprocess of --scaling, with forced host devices
    compile_s, round_s, acc = devices_point(config, domain_graphs, args.devices_point,
                                            args.scaling_rounds)
    print("DEVICES_POINT " + json.dumps({"compile_s": compile_s, "round_s": round_s,
                                         "clients": config.num_clients,
                                         "final_acc": acc.tolist()}))
    return
  if args.full_run is not None:
    full_run(config, domain_graphs, cells, args.seeds, args.full_run)
    return
  federation = build_federation(config, domain_graphs, args.seeds)
  C, G, S, R, steps = (federation.num_clients, len(cells), len(args.seeds), args.rounds,
                       config.local_steps)
  print(f"== setup: {config.dataset} {config.setting}, {config.backbone}, jax {jax.__version__} "
        f"on {jax.devices()[0].platform} ({len(jax.devices())} device(s))")
  print(f"  clients C={C}, local steps={steps}, buckets={len(federation.bucket_clients)}")
  for b, (clients, shard) in enumerate(zip(federation.bucket_clients, federation.client_shards)):
    print(f"    bucket {b}: {len(clients)} clients, {shard.x.shape[-2]} padded node rows, "
          f"{federation.bucket_train_rows[b]} train rows, {shard.senders.shape[-1]} edge slots")
  print(f"  eval graph: {federation.eval_x.shape[0]} rows; cells G'={G} "
        f"({len(args.rho)} rho x {len(args.beta)} beta + FedAvg); seeds S={S} {args.seeds}")

  if args.kernels:
    kernel_ratios(federation, config.hidden, 12, args.repeats)
    return

  if args.backbones:
    print(f"== backbones {args.backbones} x training propagations {args.propagations} "
          f"({R} rounds per timed chunk, {G} cells x {S} seed(s))")
    bad = [b for b in args.backbones if b not in models.BACKBONES] + [
        p for p in args.propagations if p not in graphs.PROPAGATION]
    if bad:
      parser.error(f"unknown backbone(s) or propagation(s) {bad}; backbones: "
                   f"{sorted(models.BACKBONES)}, propagations: {list(graphs.PROPAGATION)}")
    backbone_ratios(config, domain_graphs, args.seeds, cells, R, args.backbones,
                    args.propagations)
    if args.only_backbones:
      return

  print("== vectorised (vmap over seeds x cells x clients, scan over rounds)")
  sim = make_simulation(config, federation)
  data = sim_data(federation)
  batch = jax.device_put(cells.batch())
  state0 = jax.block_until_ready(sim.init(np.asarray(federation.seeds, np.int32), batch))
  (state, first_metrics), first_s = timed(sim.run_chunk, state0, np.int32(0), batch, data,
                                          num_rounds=R)
  _, second_s = timed(sim.run_chunk, state, np.int32(R), batch, data, num_rounds=R)
  traces = sim.trace_count[0]  # the timings below trace chunks of other shapes
  assert traces == 1, f"run_chunk traced {traces} times"
  print(f"  first call (compile + run): {first_s:.3f} s; second call (run): {second_s:.3f} s; "
        f"compile ~ {first_s - second_s:.3f} s; trace_count = {traces}")
  vec_rc, vec_steps = rates("second call", second_s, R, G * S, C, steps)
  # The program returns the cells group by group; put them in cell order.
  vec_final = np.asarray(first_metrics.test_acc[:, np.argsort(cells.order()), -1])  # [S, G', D]

  parts = None
  if not args.skip_breakdown:
    print("== where a round's time goes (each part jitted alone, same shapes; best of "
          f"{args.repeats})")
    parts = breakdown(sim, federation, batch, data, federation.seeds, args.repeats)
    peak = matmul_peak(repeats=args.repeats)
    flops = training_flops(config, federation, G * S)
    peak_share = print_breakdown(parts, flops, peak, G * S)

  loop = None
  if not args.skip_loop:
    print("== Python loop (jitted local_update per client, aggregate and evaluate per run)")
    _, warm_s = timed(looped_runs, sim, federation, state0, cells, data, 1, warmup=True)
    print(f"  warm-up round of run (0, 0) (compile + run): {warm_s:.3f} s")
    loop_final, loop_s = timed(looped_runs, sim, federation, state0, cells, data, R, warmup=False)
    loop_rc, loop_steps = rates("timed rounds", loop_s, R, G * S, C, steps)
    max_diff = float(np.max(np.abs(loop_final - vec_final)))
    match = max_diff <= 1e-4
    print(f"  final test accuracies of all {G * S} runs after {R} rounds: max |loop - vectorised| "
          f"= {max_diff:.2e}; results match: {match}")
    loop = (warm_s, loop_s, loop_rc, loop_steps, match, max_diff)

  schedule = None
  if not args.skip_schedule:
    q, k = args.compare_participation, args.compare_eval_every
    print(f"== only sampled clients train (q={q:g}) and evaluation every {k} rounds, against "
          "q=1 and every round")
    schedule = schedule_ratios(config, federation, cells, data, args.seeds, q, k,
                               args.schedule_rounds)

  print(f"== summary ({config.dataset} {config.setting}: C={C}, G'={G}, S={S}, {R} rounds/call, "
        f"{steps} local steps)")
  print(f"  vectorised: compile ~{first_s - second_s:.2f} s, {second_s:.3f} s per {R} rounds, "
        f"{vec_rc:.2f} round-cells/s ({second_s / (R * G * S) * 1e3:.1f} ms each), "
        f"{vec_steps:.0f} client-steps/s, trace_count {traces}")
  if loop:
    warm_s, loop_s, loop_rc, loop_steps, match, max_diff = loop
    print(f"  python loop: warm-up {warm_s:.2f} s, {loop_s:.3f} s per {R} rounds, "
          f"{loop_rc:.2f} round-cells/s ({loop_s / (R * G * S) * 1e3:.1f} ms each), "
          f"{loop_steps:.0f} client-steps/s")
    print(f"  speed-up (round-cells/s): {vec_rc / loop_rc:.1f}x; results match: {match} "
          f"(max diff {max_diff:.1e})")
  if schedule:
    q, k = args.compare_participation, args.compare_eval_every
    print(f"  round time q={q:g} / q=1: {schedule[q, 1] / schedule[1.0, 1]:.2f} (evaluating every "
          f"round), {schedule[q, k] / schedule[1.0, k]:.2f} (every {k}); evaluation every {k} / "
          f"every round: {schedule[1.0, k] / schedule[1.0, 1]:.2f} (q=1)")
  if parts:
    shares = ", ".join(f"{name} {share:.0%}" for name, share in parts.shares.items())
    print(f"  a round: {shares}; local training at {peak_share:.0%} of the measured matmul peak "
          f"({peak / 1e9:.0f} GFLOP/s)")

  if args.scaling:
    print(f"== scaling ({args.scaling_rounds} timed rounds per point after its compile; "
          f"precision {config.precision})")
    rows = scaling_table(config, domain_graphs, clients=args.scaling_clients,
                         runs=args.scaling_runs, devices=args.scaling_devices,
                         rounds=args.scaling_rounds, argv=raw_argv)
    plot_scaling(rows, args.plot, f"{config.dataset} {config.setting}, {config.backbone}, "
                 f"{jax.devices()[0].platform}: seconds per round")
    print(f"  plot: {args.plot}")


if __name__ == "__main__":
  main()
