"""Reference rows: the majority class, local training alone, centralised training."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from conftest import fake_domain
from fedjax_graph import cells as cells_lib
from fedjax_graph import config, data, methods, models, references, simulation, sweep

QUIET = sweep.RunControls(progress=False)
BASE = cells_lib.Cells([cells_lib.cell("fedavg")])


@pytest.fixture(scope="module")
def skewed():
  """Three small domains whose labels are mostly class 0, 1 and 2 respectively."""
  graphs = {}
  for i, (domain, n) in enumerate({"chameleon": 40, "squirrel": 60, "crocodile": 90}.items()):
    graph = fake_domain(n, 2 * n, 5, 8, i)
    rng = np.random.default_rng(10 + i)
    graph["y"] = np.where(rng.random(n) < 0.7, i, rng.integers(0, 5, n)).astype(np.int32)
    graphs[domain] = graph
  return graphs


@pytest.fixture(scope="module")
def cfg():
  return config.load_preset("wikinet", hidden=8, max_buckets=2)


def test_majority_is_the_most_frequent_training_label_and_scores_its_share(cfg, skewed):
  federation = data.build_federation(cfg, skewed, seeds=[0, 1])
  majority = references.majority_classes(federation)
  np.testing.assert_array_equal(majority, [[0, 1, 2], [0, 1, 2]])
  history = references.majority_history(federation, rounds=3)
  assert history["test_acc"].shape == (2, 1, 3, 3)
  for s in range(2):
    for d in range(3):
      test = federation.eval_test[s] & (federation.eval_domain == d)
      share = np.mean(federation.eval_y[test] == d)
      np.testing.assert_allclose(history["test_acc"][s, 0, :, d], share, rtol=1e-6)
      # One class predicted: recall 1 on it, 0 on the others present.
      present = len(np.unique(federation.eval_y[test]))
      np.testing.assert_allclose(history["test_bacc"][s, 0, :, d], 1 / present, rtol=1e-6)
  np.testing.assert_array_equal(history["predicted_classes"], 1)
  assert np.isnan(history["train_loss"]).all()


def test_majority_counts_training_nodes_only_and_a_tie_goes_to_the_lower_class():
  # One seed, one bucket of two clients: domain 0's training labels tie (3, 1, 3, 1); domain 1
  # has 2, 2, 0 for training and many 0s among its other (and padding) rows.
  shard = types.SimpleNamespace(
      y=np.array([[[3, 1, 3, 1, 0, 0], [2, 2, 0, 0, 0, 0]]]),
      train=np.array([[[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]], bool),
      node_domain=np.array([[[0, 0, 0, 0, 0, 2], [1, 1, 1, 1, 1, 2]]]))
  federation = types.SimpleNamespace(seeds=(0,), domains=("a", "b"), num_classes=4,
                                     client_shards=(shard,))
  np.testing.assert_array_equal(references.majority_classes(federation), [[1, 2]])


@pytest.mark.parametrize("backbone", ["pmlp_gcn", "gcn"])
def test_local_equals_each_client_training_alone(cfg, skewed, backbone):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=2, backbone=backbone)
  federation = data.build_federation(cfg, skewed, seeds=[3])
  rounds = 3
  history = sweep.run_sweep(cfg, federation, BASE, rounds, QUIET, method="local")
  sim = simulation.make_simulation(cfg, federation, method="local")
  state = sim.init(np.asarray(federation.seeds, np.int32), jax.device_put(BASE.batch()))[0]
  init, run_key = jax.tree.map(lambda leaf: leaf[0, 0], (state.params, state.key))
  local_update = jax.jit(sim.local_update)
  model = sim.model
  owner_pred = np.zeros(len(federation.eval_y), np.int32)
  for clients, rows, shard in zip(federation.bucket_clients, federation.bucket_train_rows,
                                  federation.client_shards):
    for j, k in enumerate(clients):
      one = jax.tree.map(lambda leaf: leaf[0, j], shard)
      params = init
      for t in range(rounds):
        key = simulation.client_keys(run_key, t, federation.num_clients)[k]
        update = local_update(params, params, *sim.training_input(one, rows), key).update
        params = jax.tree.map(lambda w, u: w - cfg.lr * u, params, update)
      pred = np.asarray(models.predict(model, params, federation.eval_x, federation.eval_graph,
                                       federation.eval_domain, len(federation.domains)))
      mine = federation.eval_owner[0] == k
      owner_pred[mine] = pred[mine]
  expected = simulation.domain_scores(owner_pred, federation.eval_y, federation.eval_test[0],
                                      federation.eval_domain, 3, federation.num_classes)
  np.testing.assert_allclose(history.test_acc[0, 0, -1], expected.acc, atol=1e-6)
  np.testing.assert_allclose(history.test_f1[0, 0, -1], expected.f1, atol=1e-6)
  # The global model never moves, and every client's own model did.
  assert not np.allclose(history.train_loss[0, 0, 0], history.train_loss[0, 0, -1])


def test_local_is_a_personal_method_without_hyper_parameters(cfg):
  method = methods.make_method("local", cfg.model(2), cfg)
  assert method.personal and method.hparams == {}
  with pytest.raises(ValueError, match="unknown hyper-parameter"):
    methods.make_method("local", cfg.model(2), cfg, {"mu": 1})


def test_pooled_federation_is_one_client_with_every_clients_nodes_and_edges(cfg, skewed):
  split = data.build_federation(cfg, skewed, seeds=[0, 1])
  pooled = data.build_federation(cfg, skewed, seeds=[0, 1], pooled=True)
  assert pooled.pooled and pooled.num_clients == 1 and pooled.bucket_clients == ((0,),)
  np.testing.assert_array_equal(pooled.train_counts, [split.train_counts.sum()])
  for name in ("eval_val", "eval_test", "eval_owner", "eval_y", "eval_domain"):
    np.testing.assert_array_equal(getattr(pooled, name), getattr(split, name), err_msg=name)
  shard = jax.tree.map(lambda leaf: leaf[:, 0], pooled.client_shards[0])  # [S, N, ...]
  for s in range(2):
    num_train = int(pooled.train_counts[0])
    assert shard.train[s, :num_train].all() and not shard.train[s, num_train:].any()
    # Its training rows are the clients' training rows (features and labels).
    train_rows = [tuple(r) for r in shard.x[s, :num_train]]
    expected = [tuple(r) for b, clients in enumerate(split.bucket_clients)
                for j in range(len(clients))
                for r in split.client_shards[b].x[s, j][split.client_shards[b].train[s, j]]]
    assert sorted(train_rows) == sorted(expected)
    # Edges: exactly the clients' own, none across clients.
    real_edges = int((shard.edge_weight[s] > 0).sum())
    assert real_edges == sum(int((b.edge_weight[s] > 0).sum()) for b in split.client_shards)
    domains = shard.node_domain[s]
    senders, receivers = shard.senders[s], shard.receivers[s]
    real = shard.edge_weight[s] > 0
    np.testing.assert_array_equal(domains[senders[real]], domains[receivers[real]])


def test_batch_norm_groups_training_rows_by_domain_only_where_a_client_mixes_domains(cfg, skewed):
  # Every client of a partition holds one domain: its training rows are one batch-norm group.
  # The pooled client holds three: its rows keep their domains' groups.
  split = data.build_federation(cfg, skewed, seeds=[0, 1])
  pooled = data.build_federation(cfg, skewed, seeds=[0, 1], pooled=True)
  assert split.one_domain_clients and not pooled.one_domain_clients
  assert simulation.make_simulation(cfg, split).model.one_domain_train
  assert not simulation.make_simulation(cfg, pooled).model.one_domain_train
  # A pooled client whose real rows all lie in one domain qualifies again; padding does not count.
  shard = pooled.client_shards[0]
  one_domain = np.where(shard.node_domain < 3, 1, 3)
  relabelled = dataclasses.replace(pooled, client_shards=(shard._replace(node_domain=one_domain),))
  assert relabelled.one_domain_clients


def test_centralized_one_round_is_full_batch_training_on_the_union(cfg, skewed):
  pooled = data.build_federation(cfg, skewed, seeds=[0], pooled=True)
  history = sweep.run_sweep(cfg, pooled, BASE, rounds=1, controls=QUIET)
  sim = simulation.make_simulation(cfg, pooled)
  state = sim.init(np.asarray([0], np.int32), jax.device_put(BASE.batch()))[0]
  params, run_key = jax.tree.map(lambda leaf: leaf[0, 0], (state.params, state.key))
  one = jax.tree.map(lambda leaf: leaf[0, 0], pooled.client_shards[0])
  key = simulation.client_keys(run_key, 0, 1)[0]
  update, losses, _, _ = sim.local_update(
      params, params, *sim.training_input(one, pooled.bucket_train_rows[0]), key)
  np.testing.assert_allclose(history.train_loss[0, 0, 0], losses[-1], rtol=1e-5)
  trained = jax.tree.map(lambda w, u: w - cfg.lr * u, params, update)
  pred = models.predict(sim.model, trained, pooled.eval_x, pooled.eval_graph,
                        pooled.eval_domain, 3)
  expected = simulation.domain_scores(pred, pooled.eval_y, pooled.eval_test[0],
                                      pooled.eval_domain, 3, pooled.num_classes)
  np.testing.assert_allclose(history.test_acc[0, 0, 0], expected.acc, atol=1e-6)
