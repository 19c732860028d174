"""Only the sampled clients train (fixed slots), and evaluation every k rounds.

Both replace a path that is kept callable (every client trains:
``make_simulation(_every_client_trains=True)``; every round evaluated: the
default ``EvalSchedule``), and both must give its results. Compiles are the
cost here: the sweeps have one aggregator group each, share programs, and
are compiled without LLVM's optimisations (``_quick``: a third of the
compile time, the same program).
"""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from conftest import usage_error
from fedjax_graph import cells as cells_lib
from fedjax_graph import (cli, comparison, config, data, experiment, graphs, report, rundir,
                          simulation, sweep, tables)
from fedjax_graph.controls import RunControls
from fedjax_graph.simulation import EvalSchedule, make_simulation

QUIET = RunControls(progress=False)
ROUNDS, LAST, EVERY = 7, 2, 3  # rounds 3, 6 (multiples of 3) and 6, 7 (the last 2) evaluated
EVALUATED = np.array([False, False, True, False, False, True, True])
SCORES = ("test_acc", "val_acc", "test_bacc", "test_f1")


def _quick(sim: simulation.Simulation) -> simulation.Simulation:
  """``sim`` with ``run_chunk`` compiled at XLA's backend optimisation level 0.

  ``init`` stays jitted: the sweep's memory estimate traces it abstractly.
  """
  compiled = {}

  def run_chunk(state, first, batch, data, num_rounds, schedule=EvalSchedule()):
    key = (num_rounds, schedule)
    if key not in compiled:
      compiled[key] = sim.run_chunk.lower(state, first, batch, data, num_rounds=num_rounds,
                                          schedule=schedule).compile(
          compiler_options={"xla_backend_optimization_level": 0})
    return compiled[key](state, first, batch, data)

  return sim._replace(run_chunk=run_chunk)


def _config(**overrides):
  # Small to compile; on tiny_wikinet two size buckets: clients of 20, 20, 30, 30 and 45, 45 nodes.
  return config.load_preset("wikinet", hidden=8, num_layers=2, local_steps=2, max_buckets=2,
                            **overrides)


@pytest.fixture(scope="module")
def sampled(tiny_wikinet):
  """q = 0.3 (m = round(1.8) = 2 of 6 clients), 2 seeds, FedAvg; histories computed once."""
  cfg = _config(participation=0.3)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0, 1])
  assert len(federation.bucket_clients) == 2
  cells = cells_lib.Cells([cells_lib.cell("fedavg")])
  histories = {}

  def history(every_client_trains=False, eval_every=1):
    key = (every_client_trains, eval_every)
    if key not in histories:
      sim = _quick(make_simulation(cfg, federation, _every_client_trains=every_client_trains))
      histories[key] = sweep.run_sweep(cfg, federation, cells, ROUNDS,
                                       QUIET.replace(eval_every=eval_every), simulation=sim,
                                       last=LAST)
    return histories[key]

  return cfg, federation, cells, history


def _assert_same(a, b, exact=("predicted_classes", "nonfinite")):
  for name in ("test_acc", "val_acc", "test_bacc", "test_f1", "train_loss", "alpha", *exact):
    x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
    if name in exact:
      np.testing.assert_array_equal(x, y, err_msg=name)
    else:  # a participant may be padded to a larger slot: float rounding only
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)


def test_slots_hold_any_sample_each_client_padded_to_its_slot(tiny_wikinet):
  cfg = _config()
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  small, large = federation.bucket_clients
  # Slot j is shaped like the j-th largest client's bucket: 2 large slots, then 1 small.
  groups = simulation.slot_groups(federation, 3)
  assert [(g.bucket, g.first, g.size) for g in groups] == [(1, 0, 2), (0, 2, 1)]
  shards = jax.tree.map(lambda leaf: leaf[0], federation.client_shards)
  num_domains = len(federation.domains)
  for chosen in ([small[0], small[1], small[3]], [large[1], small[2], large[0]]):
    sampled = np.zeros(federation.num_clients, bool)
    sampled[chosen] = True
    slots = simulation.take_slots(federation, shards, sampled, 3)
    assert sorted(np.concatenate(slots.clients).tolist()) == sorted(chosen)
    for group, ids, shard in zip(groups, slots.clients, slots.shards):
      assert shard.x.shape[:2] == (group.size, group.n_node)
      assert shard.senders.shape == (group.size, group.n_edge)
      for j, k in enumerate(np.asarray(ids)):
        b = 0 if k in small else 1
        own = jax.tree.map(lambda leaf: np.asarray(leaf[federation.bucket_clients[b].index(k)]),
                           shards[b])
        got = jax.tree.map(lambda leaf: np.asarray(leaf[j]), shard)
        n, e = own.x.shape[0], own.senders.shape[0]
        # The client's own shard, then padding (the slot's operator is rebuilt from the padded
        # edges: tests/test_dense_propagation.py).
        for name in (f for f in own._fields if f != "operator"):
          cut = e if name in ("senders", "receivers", "edge_weight") else n
          np.testing.assert_array_equal(getattr(got, name)[:cut], getattr(own, name), name)
        assert not got.x[n:].any() and not got.train[n:].any() and not got.self_weight[n:].any()
        assert (got.node_domain[n:] == num_domains).all()
        assert not got.edge_weight[e:].any() and (got.senders[e:] == group.n_node - 1).all()


@pytest.mark.parametrize("kinds", [("dense", "csr"), ("csr", "dense"), ("csr", "csr")])
def test_slot_operators_are_their_buckets_padded_whatever_form_each_bucket_takes(tiny_wikinet,
                                                                                  kinds):
  # A group of slots takes clients from its bucket and every smaller one; each slot's operator
  # (the bucket's padded, or built again where a smaller bucket's form differs) propagates as the
  # slot's own padded edge list does.
  federation = data.build_federation(_config(backbone="gcn"), tiny_wikinet, seeds=[0])
  federation = dataclasses.replace(federation, client_shards=tuple(
      graphs.with_operator(shard, kind) for shard, kind in zip(federation.client_shards, kinds)))
  shards = jax.tree.map(lambda leaf: leaf[0], federation.client_shards)
  small, large = federation.bucket_clients
  sampled = np.zeros(federation.num_clients, bool)
  sampled[[small[0], large[1], small[2]]] = True  # the large group holds a small client
  slots = simulation.take_slots(federation, shards, sampled, 3)
  for group, shard in zip(simulation.slot_groups(federation, 3), slots.shards):
    assert graphs.kind_of(shard.operator) == kinds[group.bucket]
    h = jax.random.normal(jax.random.key(group.bucket), shard.x.shape[:2] + (5,))
    np.testing.assert_allclose(jax.vmap(graphs.propagate)(h, shard),
                               jax.vmap(graphs.propagate)(h, shard._replace(operator=None)),
                               rtol=1e-5, atol=1e-6)


def test_only_sampled_clients_train_with_todays_results(sampled):
  cfg, federation, _, history = sampled
  slotted = history()
  _assert_same(slotted, history(every_client_trains=True))
  # Two of the six clients take part in each round, not always the same ones.
  weights = slotted.alpha[:, 0]  # [S, T, C]
  assert ((weights > 0).sum(-1) == 2).all()
  assert len({tuple(w > 0) for w in weights.reshape(-1, federation.num_clients)}) > 1


def test_stateful_method_and_aggregator_keep_their_clients_state(tiny_wikinet):
  # SCAFFOLD's control variates c_k and FedIA's alpha per client; GCN trains on the graph, so
  # the slots' edges are padded too.
  cfg = _config(participation=0.5, backbone="gcn")  # m = 3 of 6: slots of both buckets
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  cells = cells_lib.Cells([cells_lib.cell("fedia", rho=0.5, beta=0.5, label="SCAFFOLD+FedIA")])
  batch, arrays = jax.device_put(cells.batch()), simulation.sim_data(federation)
  results, state = {}, None
  for every in (False, True):
    sim = _quick(make_simulation(cfg, federation, method="scaffold", _every_client_trains=every))
    state = state or sim.init(np.asarray(federation.seeds, np.int32), batch)  # the same init
    results[every] = jax.device_get(sim.run_chunk(state, np.int32(0), batch, arrays,
                                                  num_rounds=3))
  (state, metrics), (state_today, metrics_today) = results[False], results[True]
  _assert_same(metrics, metrics_today)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  jax.tree.map(close, state, state_today)  # the model, c, every c_k, alpha and the keys
  took_part = (metrics.alpha[0, 0] > 0).any(axis=0)  # [C]: in some round (seed 0)
  c_k = np.asarray(jax.tree.leaves(state[0].method.clients)[0][0, 0])  # [C, ...]
  assert c_k[took_part].any() and not c_k[~took_part].any()


def test_skipped_evaluation_stays_a_branch_and_k_1_has_none(sampled):
  cfg, federation, cells, _ = sampled
  sim = make_simulation(cfg, federation)
  batch = cells.batch()
  state = sim.init(np.asarray(federation.seeds, np.int32), batch)
  jaxpr = lambda schedule: str(jax.make_jaxpr(functools.partial(
      sim.run_chunk, num_rounds=2, schedule=schedule))(
          state, np.int32(0), batch, simulation.sim_data(federation)))
  # Under vmap a batched predicate would turn the cond into a select that computes both sides.
  assert "cond[" in jaxpr(EvalSchedule(EVERY, ROUNDS - LAST))
  assert "cond[" not in jaxpr(EvalSchedule())  # k = 1: today's program, no branch at all
  np.testing.assert_array_equal(EvalSchedule(EVERY, ROUNDS - LAST).evaluated(np.arange(ROUNDS)),
                                EVALUATED)


def test_eval_every_k_equals_every_round_where_evaluated_and_the_summary(sampled, tmp_path):
  cfg, federation, _, history = sampled
  every, sparse = history(), history(eval_every=EVERY)
  for name in SCORES:  # [S, G', T, D]
    values = getattr(sparse, name)
    np.testing.assert_array_equal(values[:, :, EVALUATED], getattr(every, name)[:, :, EVALUATED])
    assert np.isnan(values[:, :, ~EVALUATED]).all() and not np.isnan(getattr(every, name)).any()
  np.testing.assert_array_equal(sparse.predicted_classes[:, :, EVALUATED],
                                every.predicted_classes[:, :, EVALUATED])
  assert (sparse.predicted_classes[:, :, ~EVALUATED] == -1).all()
  for name in ("train_loss", "alpha", "nonfinite"):  # training is the same in every round
    np.testing.assert_allclose(getattr(sparse, name), getattr(every, name), rtol=1e-6, atol=1e-7)
  # The summary reads only the last rounds: the same rows (the cell against itself as a grid).
  runs = lambda h: report.Runs(h.test_acc[:, 0], h.test_bacc[:, 0], h.test_f1[:, 0],
                               h.predicted_classes[:, 0], h.train_loss[:, 0])
  summary = lambda h: report.summarize(runs(h), jax.tree.map(lambda a: a[None], runs(h)), {},
                                       list(federation.domains), LAST)
  assert summary(sparse) == summary(every)
  rows = summary(sparse)
  labels = report.plot_curves(runs(sparse).acc, runs(sparse).acc[None], rows, tmp_path / "c.png",
                              "t", last=LAST, evaluated=EVALUATED)
  assert len(labels) == 2 and (tmp_path / "c.png").stat().st_size > 0


def test_tables_and_selection_read_only_the_evaluated_final_rounds():
  rng = np.random.default_rng(0)
  shape = (2, 3, ROUNDS, 3)  # [S, G', T, D]
  full = tables.RunResult(
      test_acc=rng.uniform(size=shape), val_acc=rng.uniform(size=shape),
      predicted_classes=rng.integers(1, 4, shape), test_bacc=rng.uniform(size=shape),
      test_f1=rng.uniform(size=shape), train_loss=rng.uniform(size=shape[:3]),
      nonfinite=np.zeros(shape[:3] + (6,), bool), alpha=np.zeros(shape[:3] + (6,)),
      labels=np.array(["FedIA ρ=0.1", "FedIA ρ=0.5", "FedAvg"]),
      aggregators=np.array(["fedia", "fedia", "fedavg"]),
      hparams={"rho": np.array([0.1, 0.5, np.nan]), "beta": np.array([0.5, 0.5, np.nan])},
      seconds=1.0)
  skip = lambda a, fill: np.where(EVALUATED[:, None], a, fill)
  sparse = full._replace(**{name: skip(getattr(full, name), np.nan) for name in SCORES},
                         predicted_classes=skip(full.predicted_classes, -1))
  for g, variant in ((0, "+fedia"), (2, "base")):
    rows = [tables.make_row(result, g, "fedavg", variant, LAST) for result in (sparse, full)]
    leaves = [jax.tree.leaves(row._asdict()) for row in rows]
    assert rows[0].status == rows[1].status == "ok"
    assert all(np.array_equal(a, b) for a, b in zip(*leaves))
  assert (tables.select_cell(sparse, "fedia", "val", LAST)
          == tables.select_cell(full, "fedia", "val", LAST))


class _Stop(Exception):
  pass


def test_runs_record_eval_every_and_resume_keeps_it(tiny_wikinet, tmp_path, monkeypatch):
  # The sweep itself is stood in for: what matters is what it is given.
  calls = []

  def fake_sweep(*args, last=None, **kwargs):
    calls.append((args[4].eval_every, last))
    raise _Stop

  cfg = _config()
  for module, run, resume in (
      (experiment, lambda c: experiment.run_grid(cfg, "gma", {"tau": [0.5]}, [0], 5, 2, c,
                                                 domain_graphs=tiny_wikinet),
       experiment.resume_grid),
      (comparison, lambda c: comparison.run_table(cfg, ["fedavg"], [0], 5, 2, controls=c,
                                                  domain_graphs=tiny_wikinet),
       comparison.resume_table),
      (comparison, lambda c: comparison.run_ablation([cfg], [0], 5, 2, controls=c,
                                                     domain_graphs=tiny_wikinet),
       comparison.resume_ablation)):
    monkeypatch.setattr(module, "run_sweep", fake_sweep)
    out = tmp_path / f"run{len(calls)}"
    with pytest.raises(_Stop):
      run(QUIET.replace(out_dir=out, eval_every=4))
    assert json.loads((out / "config.json").read_text())["eval_every"] == 4
    with pytest.raises(_Stop):
      resume(out, QUIET, domain_graphs=tiny_wikinet)
    assert calls[-2:] == [(4, 2), (4, 2)]


def test_eval_every_flag_and_checks(tmp_path, capsys):
  parser = cli.sweep_parser("x")
  args = cli.parse_args(parser, ["--dataset", "wikinet", "--eval-every", "5"])
  assert cli.run_controls(args, nonfinite="skip").eval_every == 5
  assert cli.run_controls(cli.parse_args(parser, ["--dataset", "wikinet"]), "skip").eval_every == 1
  for script in ("grid", "table", "ablation"):  # a resumed run keeps its own
    assert "--eval-every" in usage_error(script, ["--resume", str(tmp_path), "--eval-every", "2"],
                                         capsys)
  assert "eval_every = 0; must be >= 1" in usage_error(
      "grid", ["--dataset", "wikinet", "--eval-every", "0", "--out", str(tmp_path / "x")], capsys)
  record = {"chunk": 10, "nonfinite": "skip"}
  assert rundir.resumed(QUIET.replace(eval_every=4), record, tmp_path).eval_every == 1  # older runs
  with pytest.raises(ValueError, match="needs the final rounds"):
    sweep.run_sweep(_config(), None, None, 5, QUIET.replace(eval_every=2))
