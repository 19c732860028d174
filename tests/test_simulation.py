"""The vectorised simulation: equivalences, determinism and one compile per sweep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import cells as cells_lib
from fedjax_graph import client, config, data, simulation, sweep


@pytest.fixture(scope="module")
def setup(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0, 1])
  sim = simulation.make_simulation(cfg, federation)
  return cfg, federation, sim, simulation.sim_data(federation)


QUIET = sweep.RunControls(progress=False)


def _seed_slice(tree, s):
  return jax.tree.map(lambda leaf: leaf[s], tree)


def _init_params(sim):
  return sim.model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8)), None, train=False)


def _for_each_client(sim, federation, params, backend, **kwargs):
  shards = _seed_slice(simulation.sim_data(federation).client_shards, 0)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  update = sim.local_update if backend == "vmap" else jax.jit(sim.local_update)
  run = lambda p: simulation.for_each_client(update, federation, sim.training_input, p, p,
                                             shards, keys, backend=backend, **kwargs)
  return (jax.jit(run) if backend == "vmap" else run)(params)


@pytest.mark.parametrize("backbone, norm_rows", [("pmlp_gcn", "train"), ("pmlp_gcn", "all"),
                                                ("gcn", "train")])
def test_vmapped_clients_equal_python_loop(tiny_wikinet, backbone, norm_rows):
  cfg = config.load_preset("wikinet", hidden=8, backbone=backbone, norm_rows=norm_rows)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[3])
  sim = simulation.make_simulation(cfg, federation)
  params = _init_params(sim)
  vmapped = _for_each_client(sim, federation, params, "vmap")
  looped = _for_each_client(sim, federation, params, "loop")
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  jax.tree.map(chex_close, vmapped, looped)
  # Clients differ (distinct data and dropout keys) and the update is not trivial.
  kernel = vmapped.update["params"]["layer_0"]["kernel"]
  assert np.abs(kernel).max() > 0
  assert not np.allclose(kernel[0], kernel[1])
  with pytest.raises(ValueError, match="backend = 'pmap'"):
    _for_each_client(sim, federation, params, "pmap")


@pytest.mark.parametrize("norm", ["none", "batch"])
def test_training_rows_only_changes_only_the_batch_norm_statistics(tiny_wikinet, norm):
  # Without batch norm the rows are independent: training on the first rows only gives the
  # update of training on every row. With it, the statistics (train nodes vs all nodes) differ.
  updates = {}
  for rows in ("train", "all"):
    cfg = config.load_preset("wikinet", hidden=8, norm=norm, norm_rows=rows, dropout=0.0)
    federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
    sim = simulation.make_simulation(cfg, federation)
    updates[rows] = _for_each_client(sim, federation, _init_params(sim), "vmap").update
  same = jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-6), updates["train"],
                      updates["all"])
  assert all(jax.tree.leaves(same)) == (norm == "none")


def test_batch_norm_groups_are_domains_and_leave_out_padding(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8)
  pooled = data.build_federation(cfg, tiny_wikinet, seeds=[0], pooled=True)
  sim = simulation.make_simulation(cfg, pooled)
  shard = jax.tree.map(lambda leaf: leaf[0, 0], pooled.client_shards[0])
  _, _, train, groups, _ = sim.training_input(shard, pooled.bucket_train_rows[0])
  # The pooled client's training rows keep their domains: statistics never cross them.
  np.testing.assert_array_equal(np.asarray(groups)[np.asarray(train)],
                                np.asarray(shard.node_domain)[:len(train)][np.asarray(train)])
  assert set(np.asarray(groups)[np.asarray(train)].tolist()) == {0, 1, 2}
  assert (np.asarray(groups)[~np.asarray(train)] == 3).all()


def test_one_compile_for_a_grid_over_many_chunks(setup):
  cfg, federation, sim, sim_arrays = setup
  batch = jax.device_put(cells_lib.grid("fedia", rho=[0.2, 0.6], beta=[0.1, 0.9]).batch())
  before = sim.trace_count[0]
  state = sim.init(np.array(federation.seeds, np.int32), batch)
  for first in range(0, 6, 2):
    state, metrics = sim.run_chunk(state, np.int32(first), batch, sim_arrays, num_rounds=2)
  # New values, same layout: no new compile.
  other = jax.device_put(cells_lib.grid("fedia", rho=[0.3, 0.9], beta=[0.5, 0.7]).batch())
  sim.run_chunk(state, np.int32(6), other, sim_arrays, num_rounds=2)
  assert sim.trace_count[0] - before <= 1
  assert metrics.test_acc.shape == (2, 5, 2, 3)  # [S, G', L, D]
  assert np.all(np.isfinite(metrics.test_acc))
  assert np.all((metrics.test_acc >= 0) & (metrics.test_acc <= 1))


def test_sweep_is_deterministic_and_batched_seeds_equal_single_seed(setup, tiny_wikinet):
  cfg, federation, sim, _ = setup
  cells = cells_lib.grid("fedia", rho=[0.5], beta=[0.5])
  first = sweep.run_sweep(cfg, federation, cells, rounds=3, controls=QUIET, simulation=sim)
  again = sweep.run_sweep(cfg, federation, cells, rounds=3, controls=QUIET, simulation=sim)
  np.testing.assert_array_equal(first.test_acc, again.test_acc)
  np.testing.assert_array_equal(first.alpha, again.alpha)
  alone = sweep.run_sweep(cfg, data.build_federation(cfg, tiny_wikinet, seeds=[1]), cells,
                          rounds=3, controls=QUIET)
  np.testing.assert_allclose(first.train_loss[1], alone.train_loss[0], rtol=1e-4)
  np.testing.assert_allclose(first.alpha[1], alone.alpha[0], rtol=1e-4, atol=1e-6)
  # The two seeds are different runs (partition, init and dropout all differ).
  assert not np.allclose(first.train_loss[0], first.train_loss[1])


def test_fedavg_cell_records_train_count_weights_and_full_coverage(setup):
  cfg, federation, sim, _ = setup
  history = sweep.run_sweep(cfg, federation, cells_lib.grid("fedia", rho=[0.3], beta=[0.5]),
                            rounds=2, controls=QUIET, simulation=sim)
  fedavg_alpha = history.alpha[:, -1]  # [S, T, C]
  expected = federation.train_counts / federation.train_counts.sum()
  np.testing.assert_allclose(fedavg_alpha, np.broadcast_to(expected, fedavg_alpha.shape),
                             rtol=1e-6)
  np.testing.assert_array_equal(history.mask_coverage[:, -1], 1.0)
  # FedIA at rho=0.3 keeps about 30 % of the coordinates of every tensor.
  assert np.all(np.abs(history.mask_coverage[:, 0] - 0.3) < 0.02)
  np.testing.assert_allclose(history.alpha[:, 0].sum(-1), 1.0, rtol=1e-5)


def test_server_step_fedia_rho1_beta1_equals_uniform_fedavg(setup):
  cfg, federation, sim, _ = setup
  num_clients = federation.num_clients
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  updates = {"w": jax.random.normal(jax.random.PRNGKey(0), (num_clients, 2, 3))}
  outputs = client.ClientOutput(updates, jnp.zeros((num_clients, cfg.local_steps)), (), ())
  equal_counts = jnp.ones(num_clients)
  new = {}
  for name, hparams in (("fedia", {"rho": 1.0, "beta": 1.0}), ("fedavg", {})):
    state = simulation.SimState(params, simulation.aggregators.get(name).init(num_clients),
                                sim.method.init(params, num_clients), jax.random.PRNGKey(0),
                                jax.random.PRNGKey(1))
    run = jax.jit(lambda s, o, n=name: sim.aggregate(s, n, hparams, o, equal_counts))
    new[name], _ = run(state, outputs)
    # Unjitted gives the same server step.
    unjitted, _ = sim.aggregate(state, name, hparams, outputs, equal_counts)
    np.testing.assert_allclose(unjitted.params["w"], new[name].params["w"], rtol=1e-6)
  expected = params["w"] - cfg.lr * updates["w"].mean(0)
  for name in new:
    np.testing.assert_allclose(new[name].params["w"], expected, rtol=1e-6, atol=1e-7)


def test_grid_cells_validate_and_order():
  cells = cells_lib.grid("fedia", rho=[0.1, 0.5], beta=[0.3, 0.9])
  assert cells.labels == ["FedIA ρ=0.1, β=0.3", "FedIA ρ=0.1, β=0.9", "FedIA ρ=0.5, β=0.3",
                          "FedIA ρ=0.5, β=0.9", "FedAvg"]
  np.testing.assert_allclose(cells.hparam_table()["rho"], [0.1, 0.1, 0.5, 0.5, np.nan])
  assert [g.aggregator for g in cells.groups] == ["fedia", "fedavg"]
  with pytest.raises(ValueError, match="rho = 0.0; must be in"):
    cells_lib.grid("fedia", rho=[0.0], beta=[0.5])
  with pytest.raises(ValueError, match="beta = 1.5; must be in"):
    cells_lib.grid("fedia", rho=[0.5], beta=[1.5])
  with pytest.raises(ValueError, match=r"rho = \[0.3, 0.3\]; a value is given twice"):
    cells_lib.grid("fedia", rho=[0.3, 0.3], beta=[0.5])
  with pytest.raises(ValueError, match="unknown aggregator 'krum'"):
    cells_lib.cell("krum")
  with pytest.raises(ValueError, match="labels must be unique"):
    cells_lib.Cells([cells_lib.cell("fedavg"), cells_lib.cell("gma", label="FedAvg")])


def test_mixed_aggregators_run_in_one_program_and_results_come_in_cell_order(setup):
  cfg, federation, sim, _ = setup
  mixed = cells_lib.Cells([cells_lib.cell("gma", tau=0.2), cells_lib.cell("fedavg"),
                           cells_lib.cell("fedia", rho=0.3, beta=0.5),
                           cells_lib.cell("gma", tau=0.6)])
  before = sim.trace_count[0]
  history = sweep.run_sweep(cfg, federation, mixed, rounds=2, controls=QUIET, simulation=sim)
  assert sim.trace_count[0] - before == 1 and history.labels == mixed.labels
  # A cell alone gives its own rows of the mixed batch.
  alone = sweep.run_sweep(cfg, federation, cells_lib.Cells(mixed.cells[1::2]), rounds=2,
                          controls=QUIET, simulation=sim)
  for g, a in ((1, 0), (3, 1)):
    np.testing.assert_allclose(history.test_acc[:, g], alone.test_acc[:, a], atol=1e-6)
    np.testing.assert_allclose(history.train_loss[:, g], alone.train_loss[:, a], rtol=1e-5)
  # GMA's tau changes the aggregate (not the client weights): round 2 starts elsewhere.
  assert not np.allclose(history.train_loss[:, 0, -1], history.train_loss[:, 3, -1])


def test_a_cell_gives_the_same_result_in_any_grid(setup):
  cfg, federation, sim, _ = setup
  run = lambda cells: sweep.run_sweep(cfg, federation, cells, rounds=2, controls=QUIET,
                                      simulation=sim)
  big = run(cells_lib.grid("fedia", rho=[0.3, 0.7], beta=[0.5, 0.9]))   # (0.3, 0.5) at 0
  small = run(cells_lib.grid("fedia", rho=[0.7, 0.3], beta=[0.9, 0.5]))  # (0.3, 0.5) at 3
  np.testing.assert_array_equal(big.test_acc[:, 0], small.test_acc[:, 3])
  np.testing.assert_array_equal(big.test_acc[:, 4], small.test_acc[:, 4])
  np.testing.assert_array_equal(big.alpha[:, 1], small.alpha[:, 2])  # (0.3, 0.9)
