"""FGSSL: its loss terms by hand on tiny graphs, the views, the client's graph, and a real WikiNet run."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_graph
from fedjax_graph import cells as cells_lib
from fedjax_graph import client, config, data, graphs, methods, models, simulation
from fedjax_graph.methods.fgssl import (ViewRates, augment, drop_edges, edge_kd_loss, fgsd_loss,
                                        fnsc_loss)

E = math.e
# Jitted: one compile per input shape instead of one per primitive (eager), for a fast file.
fnsc_loss = jax.jit(fnsc_loss, static_argnums=5)
fgsd_loss, edge_kd_loss, drop_edges = jax.jit(fgsd_loss), jax.jit(edge_kd_loss), jax.jit(drop_edges)
augment = jax.jit(augment, static_argnums=(3, 4))


def _shard(edge_index, num_nodes, n_node, n_edge, features=2):
  """A padded ``Shard`` (jnp) of a graph with zero features."""
  masks = {k: np.ones(num_nodes, bool) for k in ("train", "val", "test")}
  shard = graphs.pad_graph(np.zeros((num_nodes, features), np.float32),
                           np.zeros(num_nodes, np.int32), np.asarray(edge_index), masks,
                           np.zeros(num_nodes, np.int32), 1, n_node, n_edge)
  return jax.tree.map(jnp.asarray, shard)


PATH = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])  # the path 0 - 1 - 2, both directions


def _pad_rows(z, rows, seed=0):
  """``z`` with garbage rows appended (what padding rows may hold)."""
  extra = jax.random.normal(jax.random.PRNGKey(seed), (rows - z.shape[0], z.shape[1]))
  return jnp.concatenate([jnp.asarray(z, jnp.float32), 10 * extra])


# FNSC ---------------------------------------------------------------------------------------

def test_fnsc_by_hand_with_a_padding_row():
  # Nodes 0, 1, 2 train (classes 0, 1, 0), row 3 is not a training node. tau = 1,
  # cosines 0/1: anchor 0: positives {0, 2}, lse = log(e + 1 + e); anchor 1: {1}, log(1 + e + 1).
  z = jnp.array([[1.0, 0], [0, 1], [3, 0], [-5, 2]])  # row 2 scaled: cosines only
  y = jnp.array([0, 1, 0, 1])
  mask = jnp.array([True, True, True, False])
  expected = (2 * (math.log(2 * E + 1) - 1) + math.log(E + 2) - 1) / 3
  np.testing.assert_allclose(fnsc_loss(z, z, y, mask, 1.0, 2), expected, rtol=1e-6)
  # The non-training row changes nothing, whatever it holds.
  other = z.at[3].set(jnp.array([1.0, 1.0]))
  np.testing.assert_allclose(fnsc_loss(other, other, y, mask, 1.0, 2), expected,
                             rtol=1e-6)


def test_fnsc_anchors_are_local_samples_global_and_tau_scales():
  # s = local @ global.T = [[1, 0], [1, 0]]: anchor 0 (class 0) log(e+1) - 1, anchor 1
  # (class 1) log(e+1) - 0. Anchoring the global embeddings instead would give log 2.
  local, glob = jnp.array([[1.0, 0], [1, 0]]), jnp.array([[1.0, 0], [0, 1]])
  y, mask = jnp.array([0, 1]), jnp.array([True, True])
  np.testing.assert_allclose(fnsc_loss(local, glob, y, mask, 1.0, 2),
                             math.log(E + 1) - 0.5, rtol=1e-6)
  # tau = 0.5: s doubles: log(e^2 + 1) - 2 and log(e^2 + 1).
  np.testing.assert_allclose(fnsc_loss(local, glob, y, mask, 0.5, 2),
                             math.log(E**2 + 1) - 1, rtol=1e-6)


def test_fnsc_one_class_present_and_no_training_node():
  # One class on the client (the other absent): every training node is a positive.
  # z = [[1, 0], [0, 1]], both class 1: each anchor lse = log(e + 1), mean positive 1/2.
  z, y = jnp.array([[1.0, 0], [0, 1]]), jnp.array([1, 1])
  np.testing.assert_allclose(fnsc_loss(z, z, y, jnp.array([True, True]), 1.0, 3),
                             math.log(E + 1) - 0.5, rtol=1e-6)
  # No training node at all: 0 with a finite (zero) gradient.
  none = jnp.zeros(2, bool)
  loss, grad = jax.value_and_grad(lambda a: fnsc_loss(a, z, y, none, 0.1, 3))(z)
  assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)


# FGSD and edge KD on the path 0 - 1 - 2 ------------------------------------------------------

def test_fgsd_by_hand_on_a_path_ignores_padding():
  # Node 1's neighbours 0 and 2: global cosines (1, 0), local (0, 1). omega = 1:
  # p = softmax(1, 0), q = softmax(0, 1), KL = (e - 1)/(e + 1); nodes 0 and 2 have one
  # neighbour each (KL 0); mean over the 3 nodes with a neighbour.
  z_global = jnp.array([[1.0, 0], [1, 0], [0, 1]])
  z_local = jnp.array([[0.0, 1], [1, 0], [1, 0]])
  for n_node, n_edge in ((4, 4), (9, 13)):  # extra padding rows and edges change nothing
    graph = _shard(PATH, 3, n_node, n_edge)
    loss = lambda omega: fgsd_loss(_pad_rows(z_local, n_node),
                                             _pad_rows(z_global, n_node, 1), graph, omega)
    np.testing.assert_allclose(loss(1.0), (E - 1) / (E + 1) / 3, rtol=1e-6)
    # omega = 0.5: softmax(2, 0) vs softmax(0, 2), KL = 2 (e^2 - 1)/(e^2 + 1).
    np.testing.assert_allclose(loss(0.5), 2 * (E**2 - 1) / (E**2 + 1) / 3, rtol=1e-6)
  # Identical embeddings: no distillation loss; gradient finite.
  graph = _shard(PATH, 3, 4, 6)
  value, grad = jax.value_and_grad(lambda z: fgsd_loss(z, _pad_rows(z_global, 4),
                                                                 graph, 0.1))(
      _pad_rows(z_global, 4))
  assert abs(float(value)) < 1e-6 and np.all(np.isfinite(grad))


def test_fgsd_without_edges_is_zero():
  graph = _shard(np.zeros((2, 0), np.int64), 3, 4, 4)
  z = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
  assert float(fgsd_loss(z, -z, graph, 0.1)) == 0.0
  assert float(edge_kd_loss(z, -z, graph, 0.1)) == 0.0


def test_edge_kd_by_hand_on_a_path_ignores_padding():
  # |o_u - o_v| on edge 0-1: global (1, 0), local (0, 1): KL = (e - 1)/(e + 1) each way;
  # on edge 1-2 both (0, 1): KL 0. Mean over the 4 directed edges. tau = 1.
  o_global = jnp.array([[0.0, 0], [1, 0], [1, 1]])
  o_local = jnp.array([[0.0, 0], [0, 1], [0, 2]])
  for n_node, n_edge in ((4, 4), (9, 13)):
    graph = _shard(PATH, 3, n_node, n_edge)
    loss = lambda tau: edge_kd_loss(_pad_rows(o_local, n_node),
                                              _pad_rows(o_global, n_node, 1), graph, tau)
    np.testing.assert_allclose(loss(1.0), (E - 1) / (E + 1) / 2, rtol=1e-6)
    # tau = 0.5: softmax(2, 0) vs softmax(0, 2) on edge 0-1.
    np.testing.assert_allclose(loss(0.5), (E**2 - 1) / (E**2 + 1), rtol=1e-6)


# Views ---------------------------------------------------------------------------------------

def test_drop_edges_renormalises_as_the_kept_edge_list():
  n, edge_index = 12, random_graph(12, 20, seed=3)
  graph = _shard(edge_index, n, 16, 48)
  keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.5, (48,))
  dropped = drop_edges(graph, keep)
  kept = np.asarray(keep)[:edge_index.shape[1]]  # real edges come first
  edge_weight, self_weight = graphs.gcn_weights(edge_index[:, kept], n)
  np.testing.assert_allclose(np.asarray(dropped.edge_weight)[:edge_index.shape[1]][kept],
                             edge_weight, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(dropped.edge_weight)[:edge_index.shape[1]][~kept], 0)
  np.testing.assert_array_equal(np.asarray(dropped.edge_weight)[edge_index.shape[1]:], 0)
  np.testing.assert_allclose(np.asarray(dropped.self_weight)[:n], self_weight, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(dropped.self_weight)[n:], 0)


def test_views_are_a_function_of_the_key():
  n, edge_index = 40, random_graph(40, 200, seed=1)
  graph = _shard(edge_index, n, 48, 400, features=128)
  x = jax.random.normal(jax.random.PRNGKey(5), (48, 128))
  rates = ViewRates(edge=0.8, feature=0.5)
  view = lambda key, with_edges=True: augment(key, x, graph, rates, with_edges)
  a, b, c = view(jax.random.PRNGKey(1)), view(jax.random.PRNGKey(1)), view(jax.random.PRNGKey(2))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a[0], c[0])
  assert not np.array_equal(a[1].edge_weight, c[1].edge_weight)
  # Whole feature columns are masked, about half of them; about 80 % of the real edges dropped.
  dropped = np.all(np.asarray(a[0]) == 0, axis=0)
  np.testing.assert_array_equal(np.asarray(a[0])[:, ~dropped], np.asarray(x)[:, ~dropped])
  assert 40 < dropped.sum() < 88
  real = edge_index.shape[1]
  assert 0.7 < np.mean(np.asarray(a[1].edge_weight)[:real] == 0) < 0.9
  # Without edges (a backbone that does not propagate in training) the graph is untouched.
  jax.tree.map(np.testing.assert_array_equal, view(jax.random.PRNGKey(1), False)[1], graph)
  jax.tree.map(np.testing.assert_array_equal, view(jax.random.PRNGKey(1), False)[0], a[0])


# The method in the simulation -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  return cfg, data.build_federation(cfg, tiny_wikinet, seeds=[0])


def _params(sim):
  return sim.model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8)), None, train=False)


def _clients(sim, federation, params, backend="vmap"):
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  update = sim.local_update if backend == "vmap" else jax.jit(sim.local_update)
  run = lambda p: simulation.for_each_client(update, federation, sim.training_input, p, p,
                                             shards, keys, backend=backend)
  return (jax.jit(run) if backend == "vmap" else run)(params)


def test_the_client_gets_its_graph_and_keeps_its_training_rows(tiny):
  cfg, federation = tiny
  shard = jax.tree.map(lambda leaf: leaf[0, 0], federation.client_shards[0])
  rows = federation.bucket_train_rows[0]
  plain = simulation.make_training_input(cfg, 3)(shard, rows)
  with_graph = simulation.make_training_input(cfg, 3, needs_graph=True)(shard, rows)
  assert plain[4] is None and with_graph[4] is shard
  assert with_graph[0].shape[0] == rows < shard.x.shape[0]  # PMLP-GCN: the training rows
  jax.tree.map(np.testing.assert_array_equal, plain[:4], with_graph[:4])
  assert methods.make_method("fgssl", models.make_model("pmlp_gcn", 5, 8), cfg).needs_graph
  assert not methods.make_method("fedavg", models.make_model("pmlp_gcn", 5, 8), cfg).needs_graph


def test_fgssl_without_its_term_is_fedavg(tiny):
  # kd_weight 0: the same rows, dropout masks and cross-entropy as FedAvg's local step.
  cfg, federation = tiny
  fedavg = simulation.make_simulation(cfg, federation, method="fedavg")
  silent = simulation.make_simulation(cfg, federation, method="fgssl",
                                      method_hparams={"loss": "code", "kd_weight": 0.0})
  params = _params(fedavg)
  a, b = _clients(fedavg, federation, params), _clients(silent, federation, params)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7),
               a.update, b.update)


@pytest.mark.parametrize("backbone", ["pmlp_gcn", "gcn"])
def test_local_loss_views_keys_and_gradient(tiny_wikinet, backbone):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, backbone=backbone)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  model = cfg.model(federation.num_classes)
  shard = jax.tree.map(lambda leaf: leaf[0, 0], federation.client_shards[0])
  x, y, train, groups, graph = simulation.make_training_input(cfg, 3, needs_graph=True)(
      shard, federation.bucket_train_rows[0])
  params = model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8)), None, train=False)
  ctx = methods.ClientContext(params, params, x, y, train, groups, 3, graph, (), ())

  def loss(hparams, key, p):
    method = methods.make_method("fgssl", model, cfg, hparams)
    return method.local_loss(p, methods.StepOutput(None, None, key), ctx)

  value_and_grad = jax.jit(jax.value_and_grad(lambda p, key: loss((), key, p)))
  key0, key1 = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
  one, grads = value_and_grad(params, key0)
  assert float(one) == float(value_and_grad(params, key0)[0])  # the views: a function of the key
  assert float(one) != float(value_and_grad(params, key1)[0])
  assert np.isfinite(float(one)) and float(one) > 0
  # The term has a gradient for the local model (the global one is frozen).
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert np.abs(grads["params"]["layer_0"]["kernel"]).max() > 0
  # Edge drop changes the views only for a backbone that propagates in training.
  no_edge_drop = jax.jit(lambda key: loss({"strong_edge": 0.0, "weak_edge": 0.0}, key,
                                          params))(key0)
  assert (float(no_edge_drop) != float(one)) == (backbone == "gcn")
  with pytest.raises(ValueError, match="needs the client's graph"):
    methods.make_method("fgssl", model, cfg).local_loss(
        params, methods.StepOutput(None, None, key0), ctx._replace(graph=None))


def test_vmapped_clients_equal_python_loop(tiny):
  # (Bucket order against client order is the simulation's, tested with stateful methods.)
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method="fgssl")
  params = _params(sim)
  vmapped, looped = _clients(sim, federation, params), _clients(sim, federation, params, "loop")
  # atol: a bias followed by batch norm gets no gradient, so its update is rounding noise.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
               vmapped, looped)
  kernel = vmapped.update["params"]["layer_0"]["kernel"]
  assert np.all(np.isfinite(kernel)) and not np.allclose(kernel[0], kernel[1])


def test_plus_fedia_at_rho1_beta1_equals_fgssl_with_uniform_weights(tiny):
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method="fgssl",
                                   method_hparams={"weights": "uniform"})
  num_clients = federation.num_clients
  counts = jnp.arange(1.0, num_clients + 1)  # uniform weights must ignore these
  params = {"w": jnp.arange(12.0).reshape(3, 4)}  # the server part takes any pytree
  updates = jax.tree.map(
      lambda p: jax.random.normal(jax.random.PRNGKey(4), (num_clients,) + p.shape), params)
  outputs = client.ClientOutput(updates, jnp.zeros((num_clients, cfg.local_steps)),
                                sim.method.init(params, num_clients).clients, ())
  new = {}
  for aggregator, hparams in (("fedavg", {}), ("fedia", {"rho": 1.0, "beta": 1.0})):
    state = simulation.SimState(params, simulation.aggregators.get(aggregator).init(
        num_clients, params), sim.method.init(params, num_clients), jax.random.PRNGKey(2),
        jax.random.PRNGKey(3))
    new[aggregator], _ = sim.aggregate(state, aggregator, hparams, outputs, counts)
  mean = jax.tree.map(lambda w, u: w - cfg.lr * u.mean(0), params, updates)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  jax.tree.map(close, new["fedavg"].params, new["fedia"].params)
  jax.tree.map(close, new["fedavg"].params, mean)


def test_bad_hyper_parameters_are_rejected(tiny):
  cfg, _ = tiny
  model = models.make_model("pmlp_gcn", 5, 8)
  with pytest.raises(ValueError, match="fgssl: loss = 'both'; must be one of"):
    methods.make_method("fgssl", model, cfg, {"loss": "both"})
  with pytest.raises(ValueError, match="fgssl: omega = 0; must be > 0"):
    methods.make_method("fgssl", model, cfg, {"omega": 0})
  with pytest.raises(ValueError, match=r"fgssl: strong_edge = 1.5; must be in \[0, 1\]"):
    methods.make_method("fgssl", model, cfg, {"strong_edge": 1.5})
  assert methods.method_defaults()["hparams"]["fgssl"]["loss"] == "paper"


def test_a_short_run_on_real_wikinet(raw_dir, prepared_cache):
  # One cell, one bucket: the smallest program (FGSSL+FedIA is the same client part, checked
  # above; experiments/table.py --methods fgssl runs both).
  domains, _ = data.load_dataset("wikinet", raw_dir=raw_dir, cache_dir=prepared_cache)
  cfg = config.load_preset("wikinet", hidden=16, max_buckets=1)
  federation = data.build_federation(cfg, domains, seeds=[0])
  sim = simulation.make_simulation(cfg, federation, method="fgssl")
  batch = jax.device_put(cells_lib.Cells([cells_lib.cell("fedavg")]).batch())
  state = sim.init(np.array(federation.seeds, np.int32), batch)
  _, metrics = sim.run_chunk(state, np.int32(0), batch, simulation.sim_data(federation),
                             num_rounds=3)
  assert np.all(np.isfinite(metrics.train_loss)) and not metrics.nonfinite.any()
  assert np.all(np.isfinite(metrics.test_acc))
  assert np.all(metrics.predicted_classes[:, :, -1] > 1)  # [S, G', T, D]: no constant model
  avg = float(metrics.test_acc[0, 0, -1].mean())
  assert avg > 0.2, avg  # above chance (5 balanced classes)
  print(f"FGSSL on WikiNet, AVG test accuracy after 3 rounds: {avg:.4f}")
