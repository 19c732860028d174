"""Throughput of the vectorised sweep vs a Python loop over clients and runs.

  python experiments/bench.py --raw-dir ../shared/datasets/musae --cache-dir /tmp/fjg_cache
  python experiments/bench.py --dataset wikinet --setting default --rounds 2 --skip-loop

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

  python experiments/bench.py --backbones gcn,pmlp_gcn --propagations auto,dense,sparse --only-backbones
"""

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_graph import cells as cells_lib  # noqa: E402
from fedjax_graph import cli  # noqa: E402
from fedjax_graph import graphs, models  # noqa: E402
from fedjax_graph.data import build_federation, load_dataset  # noqa: E402
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
  parser.add_argument("--backbones", type=lambda text: text.split(","), default=None,
                      help="compare these backbones' round-cell times, the last the reference, "
                      "e.g. gcn,pmlp_gcn (default: no comparison)")
  parser.add_argument("--propagations", type=lambda text: text.split(","), default=["auto", "sparse"],
                      help="training propagations (Config.propagation) of the backbone "
                      "comparison (default: auto,sparse)")
  parser.add_argument("--only-backbones", action="store_true",
                      help="run only the backbone comparison")
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds {args.rounds}: must be >= 1")
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


if __name__ == "__main__":
  main()
