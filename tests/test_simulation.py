"""The vectorised simulation: equivalences, determinism and one compile per sweep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import aggregators, config, data, simulation, sweep


@pytest.fixture(scope="module")
def setup(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0, 1])
  sim = simulation.make_simulation(cfg, federation)
  return cfg, federation, sim, simulation.sim_data(federation)


def _seed_slice(tree, s):
  return jax.tree.map(lambda leaf: leaf[s], tree)


@pytest.mark.parametrize("backbone, norm_rows", [("pmlp_gcn", "train"), ("pmlp_gcn", "all"),
                                                ("gcn", "train")])
def test_vmapped_clients_equal_python_loop(tiny_wikinet, backbone, norm_rows):
  cfg = config.load_preset("wikinet", hidden=8, backbone=backbone, norm_rows=norm_rows)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[3])
  sim = simulation.make_simulation(cfg, federation)
  shards = _seed_slice(simulation.sim_data(federation).client_shards, 0)
  params = sim.model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8)), None, train=False)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  args = (federation, sim.model.propagate_train, params, shards, keys)
  vmapped = jax.jit(lambda p, sh, k: simulation.client_updates(
      sim.local_update, federation, sim.model.propagate_train, p, sh, k,
      rows_only=norm_rows == "train"))(params, shards, keys)
  looped = simulation.client_updates_loop(jax.jit(sim.local_update), *args,
                                          rows_only=norm_rows == "train")
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  jax.tree.map(chex_close, vmapped, looped)
  # Clients differ (distinct data and dropout keys) and the update is not trivial.
  kernel = vmapped[0]["params"]["layer_0"]["kernel"]
  assert np.abs(kernel).max() > 0
  assert not np.allclose(kernel[0], kernel[1])


@pytest.mark.parametrize("norm", ["none", "batch"])
def test_training_rows_only_changes_only_the_batch_norm_statistics(tiny_wikinet, norm):
  # Without batch norm the rows are independent: training on the first rows only gives the
  # update of training on every row. With it, the statistics (train nodes vs all nodes) differ.
  updates = {}
  for rows in ("train", "all"):
    cfg = config.load_preset("wikinet", hidden=8, norm=norm, norm_rows=rows, dropout=0.0)
    federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
    sim = simulation.make_simulation(cfg, federation)
    params = sim.model.clone(propagate_eval=False).init(jax.random.PRNGKey(0), jnp.zeros((1, 8)),
                                                        None, train=False)
    keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
    updates[rows] = simulation.client_updates(
        sim.local_update, federation, False, params,
        _seed_slice(simulation.sim_data(federation).client_shards, 0), keys,
        rows_only=rows == "train")[0]
  same = jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-4, atol=1e-6), updates["train"],
                      updates["all"])
  assert all(jax.tree.leaves(same)) == (norm == "none")


def test_one_compile_for_a_grid_over_many_chunks(setup):
  cfg, federation, sim, sim_arrays = setup
  cells = jax.device_put(sweep.grid_cells([0.2, 0.6], [0.1, 0.9]))
  before = sim.trace_count[0]
  state = sim.init(np.array(federation.seeds, np.int32), cells)
  for first in range(0, 6, 2):
    state, metrics = sim.run_chunk(state, np.int32(first), cells, sim_arrays, num_rounds=2)
  other_cells = jax.device_put(sweep.grid_cells([0.3, 0.9], [0.5, 0.7]))  # new values, same shape
  sim.run_chunk(state, np.int32(6), other_cells, sim_arrays, num_rounds=2)
  assert sim.trace_count[0] - before <= 1
  assert metrics.test_acc.shape == (2, 5, 2, 3)  # [S, G', L, D]
  assert np.all(np.isfinite(metrics.test_acc))
  assert np.all((metrics.test_acc >= 0) & (metrics.test_acc <= 1))


def test_sweep_is_deterministic_and_batched_seeds_equal_single_seed(setup, tiny_wikinet):
  cfg, federation, sim, _ = setup
  cells = sweep.grid_cells([0.5], [0.5])
  first = sweep.run_sweep(cfg, federation, cells, rounds=3, progress=False, simulation=sim)
  again = sweep.run_sweep(cfg, federation, cells, rounds=3, progress=False, simulation=sim)
  np.testing.assert_array_equal(first.test_acc, again.test_acc)
  np.testing.assert_array_equal(first.alpha, again.alpha)
  alone = sweep.run_sweep(cfg, data.build_federation(cfg, tiny_wikinet, seeds=[1]), cells,
                          rounds=3, progress=False)
  np.testing.assert_allclose(first.train_loss[1], alone.train_loss[0], rtol=1e-4)
  np.testing.assert_allclose(first.alpha[1], alone.alpha[0], rtol=1e-4, atol=1e-6)
  # The two seeds are different runs (partition, init and dropout all differ).
  assert not np.allclose(first.train_loss[0], first.train_loss[1])


def test_fedavg_cell_records_train_count_weights_and_full_coverage(setup):
  cfg, federation, sim, _ = setup
  history = sweep.run_sweep(cfg, federation, sweep.grid_cells([0.3], [0.5]), rounds=2,
                            progress=False, simulation=sim)
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
  state = simulation.SimState(params, aggregators.fedia().init(num_clients),
                              sim.method.init(params, num_clients), jax.random.PRNGKey(0),
                              jax.random.PRNGKey(1))
  losses = jnp.zeros((num_clients, cfg.local_steps))
  equal_counts = jnp.ones(num_clients)
  run = jax.jit(sim.aggregate)
  fedia_cell = simulation.Cells(jnp.float32(1.0), jnp.float32(1.0), jnp.bool_(True),
                                jnp.bool_(True))
  fedavg_cell = simulation.Cells(jnp.float32(1.0), jnp.float32(1.0), jnp.bool_(False),
                                 jnp.bool_(False))
  new_ia, _ = run(state, fedia_cell, updates, losses, equal_counts)
  new_avg, _ = run(state, fedavg_cell, updates, losses, equal_counts)
  expected = params["w"] - cfg.lr * updates["w"].mean(0)
  np.testing.assert_allclose(new_ia.params["w"], expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new_avg.params["w"], expected, rtol=1e-6, atol=1e-7)
  # Unjitted gives the same server step.
  unjitted, _ = sim.aggregate(state, fedia_cell, updates, losses, equal_counts)
  np.testing.assert_allclose(unjitted.params["w"], new_ia.params["w"], rtol=1e-6)


def test_grid_cells_validate_and_order():
  cells = sweep.grid_cells([0.1, 0.5], [0.3, 0.9])
  np.testing.assert_allclose(cells.rho, [0.1, 0.1, 0.5, 0.5, 1.0])
  np.testing.assert_allclose(cells.beta, [0.3, 0.9, 0.3, 0.9, 1.0])
  np.testing.assert_array_equal(cells.fedia, [True, True, True, True, False])
  with pytest.raises(ValueError, match="rho = 0"):
    sweep.grid_cells([0.0], [0.5])
  with pytest.raises(ValueError, match="beta = 1.5"):
    sweep.grid_cells([0.5], [1.5])
  with pytest.raises(ValueError, match=r"rho = \[0.3, 0.3\]; a value is given twice"):
    sweep.grid_cells([0.3, 0.3], [0.5])


def test_a_cell_gives_the_same_result_in_any_grid(setup):
  cfg, federation, sim, _ = setup
  run = lambda cells: sweep.run_sweep(cfg, federation, cells, rounds=2, progress=False,
                                      simulation=sim)
  big = run(sweep.grid_cells([0.3, 0.7], [0.5, 0.9]))   # cells (0.3, 0.5) at 0, FedAvg at 4
  small = run(sweep.grid_cells([0.7, 0.3], [0.9, 0.5]))  # (0.3, 0.5) at 3, FedAvg at 4
  np.testing.assert_array_equal(big.test_acc[:, 0], small.test_acc[:, 3])
  np.testing.assert_array_equal(big.test_acc[:, 4], small.test_acc[:, 4])
  np.testing.assert_array_equal(big.alpha[:, 1], small.alpha[:, 2])  # (0.3, 0.9)
