"""FGGP: its losses, upload, FINCH, queue, kNN prediction and personal classifier, on tiny inputs and real WikiNet."""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import vmapped_and_looped
from fedjax_graph import aggregators, cells as cells_lib, client, config, data, graphs, methods
from fedjax_graph import models, simulation
from fedjax_graph.methods import base, fggp_server

fggp_lib = importlib.import_module("fedjax_graph.methods.fggp")  # the package exports the factory as fggp

# Jitted once each: eager execution compiles every small op on its own.
finch = jax.jit(fggp_server.finch)
class_clusters = jax.jit(fggp_server.class_clusters)
enqueue = jax.jit(fggp_server.enqueue)
knn_scores = jax.jit(fggp_server.knn_scores, static_argnums=(2, 3))
knn_indices = jax.jit(fggp_lib.knn_indices, static_argnums=(2, 3))
candidate_pairs = jax.jit(fggp_lib.candidate_pairs)
graph_loss = jax.jit(fggp_lib.graph_loss)
proto_align_loss = jax.jit(fggp_lib.proto_align_loss, static_argnums=3)
sample_edges = jax.jit(fggp_lib.sample_edges, static_argnums=(3, 4))
negative_pairs = jax.jit(fggp_lib.negative_pairs, static_argnums=3)

close = lambda a, b, **kw: np.testing.assert_allclose(a, b, **{"rtol": 1e-5, "atol": 1e-6, **kw})


# ---------------------------------------------------------------- server: FINCH, queue, kNN


def _unit(degrees):
  angles = np.radians(np.asarray(degrees, np.float32))
  return jnp.asarray(np.stack([np.cos(angles), np.sin(angles)], axis=1))


def test_finch_splits_four_unit_vectors_into_their_two_pairs():
  points = _unit([0, 10, 90, 100])
  labels = finch(points, jnp.ones(4, bool))
  # Level 0: first neighbours 0<->1, 2<->3; level 1 would merge all into one: dropped.
  np.testing.assert_array_equal(labels, [0, 0, 2, 2])
  # Invalid slots (here: copies that would be everyone's first neighbour) join nothing.
  padded = jnp.concatenate([_unit([5, 95]), points])
  labels = finch(padded, jnp.array([False, False, True, True, True, True]))
  np.testing.assert_array_equal(labels[2:], [2, 2, 4, 4])


def test_finch_takes_the_last_level_with_more_than_one_cluster():
  # Level 0: four pairs; level 1: {0..3}, {4..7} (the pairs' means at 1, 21 and 91, 111 degrees).
  points = _unit([0, 2, 20, 22, 90, 92, 110, 112])
  labels = finch(points, jnp.ones(8, bool))
  np.testing.assert_array_equal(labels, [0, 0, 0, 0, 4, 4, 4, 4])
  # A lone point is its own cluster; two points are one (level 0 is kept even then).
  np.testing.assert_array_equal(finch(points[:1], jnp.ones(1, bool)), [0])
  np.testing.assert_array_equal(finch(points[:2], jnp.ones(2, bool)), [0, 0])


def test_class_clusters_normalised_raw_means_and_absent_classes():
  protos = jnp.zeros((3, 3, 2))
  protos = protos.at[0, 0].set([1.0, 0.0]).at[1, 0].set([3.0, 1.0])  # class 0: clients 0, 1
  protos = protos.at[2, 1].set([0.0, 3.0])  # class 1: client 2 only; class 2: nobody
  present = jnp.array([[True, False, False], [True, False, False], [False, True, False]])
  clusters, valid = class_clusters(protos, present)
  np.testing.assert_array_equal(valid, [[True, False, False], [False, False, True],
                                        [False, False, False]])
  close(clusters[0, 0], np.array([2.0, 0.5]) / math.hypot(2.0, 0.5))  # raw mean, then normalised
  close(clusters[1, 2], [0.0, 1.0])


def test_class_clusters_ignore_a_nan_prototype_of_a_client_left_out():
  # Client 2 diverged (NaN upload) and is left out (present False): no mean, hence no queue
  # row, may see its NaN (a 0 weight would keep it: 0 * NaN = NaN).
  protos = _unit([0, 10, 0])[:, None, :].repeat(2, axis=1).at[2].set(jnp.nan)
  present = jnp.array([[True, True], [True, False], [False, False]])
  clusters, valid = class_clusters(protos, present)
  np.testing.assert_array_equal(valid, [[True, False, False], [True, False, False]])
  assert np.isfinite(np.asarray(clusters)).all()
  close(clusters[0, 0], _unit([5])[0])
  close(clusters[1, 0], _unit([0])[0])


def test_enqueue_wraps_around_and_keeps_the_last_q_rows():
  queue = fggp_server.Queue(jnp.zeros((5, 1)), jnp.zeros(5, jnp.int32), jnp.int32(3))
  rows = jnp.arange(1.0, 7.0)[:, None]
  valid = jnp.array([True, False, True, True, False, True])
  new = enqueue(queue, rows, jnp.arange(6, dtype=jnp.int32), valid)
  # The 4 valid rows (1, 3, 4, 6) go to 3, 4, 0, 1; the pointer moves to 2.
  np.testing.assert_array_equal(new.memory[:, 0], [4, 6, 0, 1, 3])
  np.testing.assert_array_equal(new.labels, [3, 5, 0, 0, 2])
  assert int(new.pointer) == 2
  # 7 valid rows into 5: the last 5 (3..7) land at 0+2.. mod 5, each row written once.
  rows = jnp.arange(1.0, 8.0)[:, None]
  new = enqueue(queue._replace(pointer=jnp.int32(0)), rows,
                            jnp.arange(7, dtype=jnp.int32), jnp.ones(7, bool))
  np.testing.assert_array_equal(new.memory[:, 0], [6, 7, 3, 4, 5])
  assert int(new.pointer) == 2


def test_knn_scores_on_a_hand_made_queue():
  memory = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
  queue = fggp_server.Queue(memory, jnp.array([0, 1, 1], jnp.int32), jnp.int32(0))
  scores = knn_scores(jnp.array([[2.0, 0.0]]), queue, 3, k=2, temperature=0.1)
  # Top 2: cos 1 (class 0) and 0.6 (class 1); weights softmax([10, 6]).
  w0 = 1 / (1 + math.exp(-4))
  close(scores[0], [w0 + 1e-5, 1 - w0 + 1e-5, 1e-5])
  # k above Q: every row votes; one class with all the weight is clamped to 1.
  scores = knn_scores(jnp.array([[0.0, 1.0]]), queue._replace(
      labels=jnp.array([1, 1, 1], jnp.int32)), 3, k=40)
  close(scores[0], [1e-5, 1.0, 1e-5])


def test_init_queue_shape_and_range():
  queue = fggp_server.init_queue(jax.random.PRNGKey(0), 100, 12)
  bound = 1 / math.sqrt(12 / 3)
  assert queue.memory.shape == (100, 12) and float(jnp.abs(queue.memory).max()) <= bound
  assert not queue.labels.any() and int(queue.pointer) == 0


# ---------------------------------------------------------------- client: view, losses


def _pairs(candidates):
  """The valid candidate pairs as a set of (u, v), u <= v."""
  valid = np.asarray(candidates.valid)
  return set(zip(np.asarray(candidates.u)[valid].tolist(), np.asarray(candidates.v)[valid].tolist()))


FEATURES = jnp.array([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0], [1.0, 0.0]])
REAL = jnp.array([True, True, True, True, False])


def test_candidates_are_edges_neighbours_and_self_loops_of_real_nodes_once_each():
  senders, receivers = jnp.array([0, 2, 4]), jnp.array([2, 0, 4])  # 0<->2, a padding edge
  nearest, found = knn_indices(FEATURES, REAL, 1, 2)  # blocks of 2 rows (the last one padded)
  np.testing.assert_array_equal(nearest[:4, 0], [1, 0, 3, 2])
  np.testing.assert_array_equal(found[:, 0], REAL)
  whole = knn_indices(FEATURES, REAL, 1, 512)  # one block: the same
  np.testing.assert_array_equal(whole[0], nearest)
  candidates = candidate_pairs(senders, receivers, nearest, found, REAL)
  assert candidates.u.shape == (3 + 5 + 5,)  # E + kN + N slots
  assert _pairs(candidates) == {(0, 1), (2, 3), (0, 2), (0, 0), (1, 1), (2, 2), (3, 3)}
  keys = np.asarray(candidates.key)
  assert np.all(np.diff(keys) >= 0) and np.all(keys[~np.asarray(candidates.valid)] >= 0)
  # A lone real node has no neighbour: found is False, only its self-loop is a candidate.
  _, found = knn_indices(FEATURES, jnp.array([True, False, False, False, False]), 1, 512)
  assert not found.any()
  # More neighbours asked than the client has nodes: every other real node, the rest not found.
  nearest, found = knn_indices(FEATURES, REAL, 7, 2)
  assert nearest.shape == found.shape == (5, 7)
  np.testing.assert_array_equal(found[:4], np.broadcast_to(np.arange(7) < 3, (4, 7)))
  assert not found[4].any()
  np.testing.assert_array_equal(np.sort(nearest[0, :3]), [1, 2, 3])


def test_pair_graph_is_the_gcn_normalisation_and_the_sample_at_alpha_0_keeps_every_edge():
  senders, receivers = jnp.array([0, 2, 4]), jnp.array([2, 0, 4])
  candidates = candidate_pairs(senders, receivers, *knn_indices(FEATURES, REAL, 1, 512), REAL)
  # alpha = 0: P = A' = 1 (clamped) on every candidate pair, so the sample keeps them all.
  sampled = sample_edges(jax.random.PRNGKey(0), jnp.zeros(candidates.u.shape), candidates, 0.0,
                         1.0)
  edge = np.asarray(candidates.valid & (candidates.u != candidates.v))
  np.testing.assert_array_equal(np.asarray(sampled), edge.astype(np.float32))
  shard = _client_graph(5 + 1)._replace(x=jnp.eye(6))  # its edges are replaced
  graph = fggp_lib.pair_graph(shard, candidates, sampled, jnp.append(REAL, False))
  a = np.eye(6)
  a[5, 5] = a[4, 4] = 0.0
  for i, j in ((0, 1), (2, 3), (0, 2)):
    a[i, j] = a[j, i] = 1.0
  d = np.maximum(a.sum(1), 1)
  expected = a / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]
  close(graphs.propagate(jnp.eye(6), graph), expected)
  # alpha > 0: the gradient reaches the scores through the soft sample, finite.
  scores = jax.random.uniform(jax.random.PRNGKey(1), candidates.u.shape)
  grad = jax.grad(lambda s: jnp.sum(graphs.propagate(jnp.eye(6), fggp_lib.pair_graph(
      shard, candidates, sample_edges(jax.random.PRNGKey(2), s, candidates, 0.5, 1.0),
      jnp.append(REAL, False))) ** 2))(scores)
  assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0
  # The CSR operator (graphs.LearnedCSR's VJP) against autodiff of the edge list itself.
  h = jax.random.normal(jax.random.PRNGKey(3), (6, 3))
  def loss(s, h, operator):
    graph = fggp_lib.pair_graph(shard, candidates, sample_edges(
        jax.random.PRNGKey(2), s, candidates, 0.5, 1.0), jnp.append(REAL, False))
    if not operator:
      graph = graph._replace(operator=None)
    return jnp.sum(jnp.sin(graphs.propagate(h, graph)))
  by_csr = jax.grad(loss, argnums=(0, 1))(scores, h, True)
  by_edges = jax.grad(loss, argnums=(0, 1))(scores, h, False)
  assert np.abs(by_edges[0]).max() > 0
  jax.tree.map(lambda a, b: close(a, b, rtol=1e-5, atol=1e-6), by_csr, by_edges)


def test_negative_pairs_avoid_candidates_self_and_padding():
  senders, receivers = jnp.array([0, 2, 4]), jnp.array([2, 0, 4])
  candidates = candidate_pairs(senders, receivers, *knn_indices(FEATURES, REAL, 1, 512), REAL)
  u, v, valid = negative_pairs(jax.random.PRNGKey(0), candidates, REAL, 16)
  pairs = set(zip(np.asarray(u)[np.asarray(valid)].tolist(), np.asarray(v)[np.asarray(valid)].tolist()))
  # The only real non-candidate pairs: {0,3}, {1,2}, {1,3}; all of them drawn among 4 x 16.
  assert pairs == {(0, 3), (1, 2), (1, 3)}
  assert not np.asarray(valid)[4].any()


def test_graph_loss_by_hand():
  positive, negative = jnp.array([0.0, 1.0, 50.0]), jnp.array([[2.0, -1.0], [7.0, 3.0]])
  sp = lambda v: math.log1p(math.exp(v))
  expected = 0.5 * ((sp(0) + sp(-1)) / 2 + (sp(2) + sp(-1) + sp(3)) / 3)
  close(graph_loss(positive, jnp.array([True, True, False]), negative,
                   jnp.array([[True, True], [False, True]])), expected)
  # It is the dense weighted BCE (pos_w, norm_w) when the negatives are all non-edges.
  s = np.array([[0.5, 1.0], [-1.0, 2.0]])
  target = np.array([[1.0, 0.0], [1.0, 1.0]])
  n2, e = 4, 3
  pos_w, norm_w = (n2 - e) / e, n2 / (2 * (n2 - e))
  dense = norm_w * np.mean(pos_w * target * np.log1p(np.exp(-s))
                           + (1 - target) * np.log1p(np.exp(s)))
  close(graph_loss(jnp.array(s[target > 0]), jnp.ones(3, bool), jnp.array(s[target == 0]),
                   jnp.ones(1, bool)), dense)


def test_proto_align_loss_by_hand_with_absent_classes():
  p = jnp.array([[2.0, 0.0], [0.0, 3.0], [5.0, 5.0]])
  present = jnp.array([True, True, False])
  # Per present class: logits [1, 0, 0] / 0.5 over (positive, the other class twice).
  close(proto_align_loss(p, p, present, 0.5), math.log(math.exp(2) + 2) - 2)
  close(proto_align_loss(p, p, jnp.array([True, False, False]), 0.5), 0.0)
  close(proto_align_loss(p, p, jnp.zeros(3, bool), 0.5), 0.0)
  # Views that disagree cost more.
  assert float(proto_align_loss(p, p[::-1], jnp.ones(3, bool), 0.5)) > float(
      proto_align_loss(p, p, jnp.ones(3, bool), 0.5))


def test_pseudo_labels_and_confidence_weights():
  logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [9.0, 0.0]])
  labels, weights = fggp_lib.pseudo_labelled(logits, jnp.array([1, 0, 0, 0]),
                                             jnp.array([True, False, False, False]),
                                             jnp.array([True, True, True, False]))
  np.testing.assert_array_equal(labels[:3], [1, 1, 1])  # y on training nodes, else the argmax
  close(weights, [1.0, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-3)), 0.0])


# ---------------------------------------------------------------- client on a small padded graph


def _client_graph(n_node):
  """5 real nodes (class 1 absent), all training nodes but node 4, padded to ``n_node``."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 4)).astype(np.float32)
  y = np.array([0, 0, 2, 2, 0])
  edges = np.array([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]])
  masks = {"train": np.array([True, True, True, True, False]), "val": np.zeros(5, bool),
           "test": np.zeros(5, bool)}
  shard = jax.tree.map(jnp.asarray, graphs.pad_graph(x, y, edges, masks, np.zeros(5), 1,
                                                     n_node, 16))
  return shard


@pytest.fixture(scope="module")
def small():
  cfg = config.load_preset("wikinet", hidden=8, dropout=0.0)
  model = models.make_model("pmlp_gcn", 3, 8, dropout=0.0)
  method = methods.make_method("fggp", model, cfg, {"alpha": 0.0})
  params = model.clone(propagate_eval=False).init(jax.random.PRNGKey(0), jnp.zeros((1, 4)), None,
                                                   train=False)
  params = method.extend_params(params, jax.random.PRNGKey(1))
  return cfg, model, method, params


def _with_ctx(fn):
  """``fn(ctx, *args)`` jitted; ``num_groups`` (a static int) is put back inside."""
  return jax.jit(lambda ctx, *args: fn(ctx._replace(num_groups=1), *args))


def _ctx(method, params, shard):
  state = method.init(params, 1)
  own = jax.tree.map(lambda leaf: leaf[0], state.clients)
  # PMLP-GCN's rows (the 4 training nodes) and, as FGGP needs, the whole shard.
  train_input = simulation.make_training_input(config.load_preset("wikinet"), 1, needs_graph=True)
  x, y, train, groups, graph = train_input(shard, 4)
  ctx = methods.ClientContext(params, params, x, y, train, groups, 1, graph, own, state.server)
  return ctx._replace(prepared=_with_ctx(method.prepare)(ctx))


@pytest.mark.parametrize("prototype_pass", ["inference", "training"])
def test_upload_is_keyed_by_class_id_with_absent_classes_zero(small, prototype_pass):
  cfg, model, _, params = small
  method = methods.make_method("fggp", model, cfg, {"alpha": 0.0,
                                                    "prototype_pass": prototype_pass})
  # Nothing predicts class 1 either (node 4, not a training node, is pseudo-labelled).
  params = jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf.at[1].set(-100.0) if base.path_names(path) == (
          "params", "layer_2", "bias") else leaf, params)
  ctx = _ctx(method, params, _client_graph(8))
  state, (protos, present) = _with_ctx(method.client_final)(ctx, params, None)
  # The inference form of PMLP-GCN (the form of the kNN queries) propagates over the
  # client's graph; the training form is the MLP.
  inference = prototype_pass == "inference"
  hidden, logits = model.apply(params, ctx.graph.x, ctx.graph if inference else None,
                               train=not inference, deterministic=True, with_hidden=True,
                               groups=ctx.graph.node_domain, num_groups=1)
  other, _ = model.apply(params, ctx.graph.x, None if inference else ctx.graph,
                         train=inference, deterministic=True, with_hidden=True,
                         groups=ctx.graph.node_domain, num_groups=1)
  assert np.abs(np.asarray(hidden[:5]) - np.asarray(other[:5])).max() > 1e-2  # the forms differ
  np.testing.assert_array_equal(present, [True, False, True])  # class 1: no node
  np.testing.assert_array_equal(protos[1], 0.0)
  # Node 4 (not training) enters with its own argmax and softmax confidence.
  probs = np.asarray(jax.nn.softmax(logits[4]))
  weights = np.array([1, 1, 0, 0, 0.0]), np.array([0, 0, 1, 1, 0.0])
  weights[int(probs.argmax()) // 2][4] = probs.max()  # classes 0 and 2 are rows 0 and 1
  for row, w in zip((0, 2), weights):
    close(protos[row], (w[:, None] * np.asarray(hidden[:5])).sum(0) / w.sum(), rtol=1e-4)
  # The state is the client's classifier, nothing else.
  assert set(base.path_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)) == {
      ("params", "layer_2", "bias"), ("params", "layer_2", "kernel")}


def test_local_loss_and_upload_do_not_depend_on_padding(small):
  cfg, model, method, params = small
  out = []
  for n_node in (8, 24):
    ctx = _ctx(method, params, _client_graph(n_node))
    step = methods.StepOutput(None, None, jax.random.PRNGKey(3))  # FGGP runs its own view 1
    loss, grads = _with_ctx(lambda c, p: jax.value_and_grad(
        lambda q: method.local_loss(q, step, c))(p))(ctx, params)
    out.append((loss, grads, _with_ctx(method.client_final)(ctx, params, None)[1]))
  (loss8, grads8, up8), (loss24, grads24, up24) = out
  assert np.isfinite(loss8) and loss8 > 0
  close(loss8, loss24, rtol=1e-4)
  jax.tree.map(lambda a, b: close(a, b, rtol=1e-3, atol=1e-5), grads8, grads24)
  jax.tree.map(lambda a, b: close(a, b, rtol=1e-4), up8, up24)
  # The augmentor is trained by the loss; the backbone's own CE is weighed 0 (view 1's is inside).
  assert np.abs(grads8["augmentor"]["v1"]).max() > 0
  assert float(method.ce_weight(None)) == 0.0


# ---------------------------------------------------------------- the round: aggregation, +FedIA


@pytest.fixture(scope="module")
def tiny(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  return cfg, data.build_federation(cfg, tiny_wikinet, seeds=[0])


HEAD = ("params", "layer_2")
shared_part = lambda tree: base.select(tree, lambda p: p[:2] != HEAD)


@pytest.fixture(scope="module")
def server(tiny):
  """FGGP (uniform weights) on the tiny federation, one run's initial state and random client outputs."""
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method="fggp",
                                   method_hparams={"weights": "uniform"})
  num_clients, num_classes = federation.num_clients, federation.num_classes
  batch = jax.device_put(cells_lib.Cells([cells_lib.cell("fedavg")]).batch())
  state = jax.tree.map(lambda leaf: leaf[0, 0], sim.init(np.array([0], np.int32), batch)[0])
  key = lambda i: jax.random.PRNGKey(10 + i)
  updates = jax.tree.map(lambda p: jax.random.normal(key(0), (num_clients,) + p.shape),
                         state.params)
  heads = jax.tree.map(lambda p: jax.random.normal(key(1), p.shape), state.method.clients)
  protos = jax.random.normal(key(2), (num_clients, num_classes, 8))
  # Class 0 is absent on every client.
  present = jax.random.bernoulli(key(3), 0.7, (num_clients, num_classes)).at[:, 0].set(False)
  outputs = client.ClientOutput(updates, jnp.zeros((num_clients, 5)), heads, (protos, present))
  with_aggregator = lambda name: state._replace(
      aggregator=aggregators.get(name).init(num_clients, shared_part(state.params)))
  return cfg, sim, with_aggregator, outputs


def test_plus_fedia_at_rho1_beta1_equals_fggp_with_uniform_weights(server):
  cfg, sim, with_aggregator, outputs = server
  counts = jnp.arange(1.0, outputs.losses.shape[0] + 1)  # uniform weights ignore these
  new = [jax.jit(lambda s, o, a=a, h=h: sim.aggregate(s, a, h, o, counts))(with_aggregator(a),
                                                                          outputs)[0]
         for a, h in (("fedavg", {}), ("fedia", {"rho": 1.0, "beta": 1.0}))]
  jax.tree.map(lambda a, b: close(a, b, rtol=2e-6, atol=1e-6), new[0].params, new[1].params)
  jax.tree.map(lambda a, b: close(a, b, rtol=2e-6, atol=1e-6), new[0].method, new[1].method)
  # Class 0, absent on every client, enters the queue nowhere; the others do.
  queue = new[0].method.server
  written = int(queue.pointer)
  assert written > 0 and not np.any(np.asarray(queue.labels[:written]) == 0)
  # The queue holds per class FINCH's normalised cluster means of the uploads.
  protos, present = outputs.upload
  clusters, valid = fggp_server.class_clusters(protos, present)
  close(queue.memory[:written], np.asarray(clusters)[np.asarray(valid)])


def test_the_classifier_is_personal_and_no_aggregator_sees_it(server):
  cfg, sim, with_aggregator, outputs = server
  counts = jnp.ones(outputs.losses.shape[0])
  state = with_aggregator("fedia")
  new, (_, weights, coverage, _) = jax.jit(lambda s, o: sim.aggregate(
      s, "fedia", {"rho": 0.3, "beta": 0.5}, o, counts))(state, outputs)
  head = lambda tree: tree["params"]["layer_2"]
  equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  equal(head(new.params), head(state.params))  # the global classifier never moves
  equal(head(new.method.clients), head(outputs.client_state))  # clients keep their own
  # FedIA on the shared tensors alone gives the same weights, coverage and model.
  update, _, diag = aggregators.get("fedia").update(shared_part(outputs.update), state.aggregator,
                                                    0.3, 0.5, weights=counts)
  close(weights, diag.weights)
  close(coverage, diag.mask_coverage)
  expected = jax.tree.map(lambda w, u: w - cfg.lr * u, shared_part(state.params), update)
  jax.tree.map(close, shared_part(new.params), expected)
  # FedHEAL's model-shaped state is built on the shared tensors only.
  state = with_aggregator("fedheal")
  assert all(leaf.shape[-1] != 5 for leaf in jax.tree.leaves(state.aggregator))  # K = 5: the head
  new, _ = jax.jit(lambda s, o: sim.aggregate(s, "fedheal", {"tau": 0.3, "beta": 0.4}, o,
                                              counts))(state, outputs)
  equal(head(new.params), head(state.params))


def test_vmapped_clients_equal_the_python_loop(tiny):
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method="fggp")
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  batch = jax.device_put(cells_lib.Cells([cells_lib.cell("fedavg")]).batch())
  state = jax.tree.map(lambda leaf: leaf[0, 0], sim.init(np.array([0], np.int32), batch)[0])
  heads = jax.tree.map(lambda leaf: leaf + 0.1 * jax.random.normal(jax.random.PRNGKey(7),
                                                                   leaf.shape),
                       state.method.clients)  # each client's own classifier
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  vmapped, looped = vmapped_and_looped(sim, federation, state.params, state.params, shards, keys,
                                       heads, state.method.server)
  jax.tree.map(lambda a, b: close(a, b, rtol=1e-4, atol=1e-5), vmapped, looped)
  assert np.all(np.isfinite(vmapped.losses))
  # Each client started from its own classifier: its state moved from there.
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(),
                       vmapped.client_state, heads)
  assert 0 < max(jax.tree.leaves(moved)) < 10


# ---------------------------------------------------------------- end to end on real WikiNet


ROUNDS = 2


def test_fggp_plus_fedia_on_real_wikinet(raw_dir, prepared_cache):
  graphs_, _ = data.load_dataset("wikinet", raw_dir=raw_dir, cache_dir=prepared_cache)
  # The preset's 6 clients (crocodile's two: N = 5,824 each), a narrow 2-layer model: short.
  cfg = config.load_preset("wikinet", hidden=8, num_layers=2, local_steps=2)
  federation = data.build_federation(cfg, graphs_, seeds=[0])
  sim = simulation.make_simulation(cfg, federation, method="fggp")
  cells = cells_lib.Cells([cells_lib.cell("fedia", rho=0.5, beta=0.5)])  # FGGP+FedIA
  batch = jax.device_put(cells.batch())
  state = sim.init(np.array([0], np.int32), batch)
  state, metrics = sim.run_chunk(state, np.int32(0), batch, simulation.sim_data(federation),
                                 num_rounds=ROUNDS)
  knn, argmax = np.asarray(metrics.test_acc), np.asarray(metrics.argmax_acc)  # [S, G', T, D]
  assert np.all(np.isfinite(knn)) and np.all(np.isfinite(argmax))
  assert np.all(np.isfinite(metrics.train_loss)) and not metrics.nonfinite.any()
  assert np.all(np.asarray(metrics.predicted_classes)[..., -1, :] > 1)
  # Two predictions of one model: the k nearest queue prototypes and the
  # classifier's argmax (whether FGGP learns is measured over 30+ rounds in the
  # README; two rounds of two steps do not get past chance).
  assert not np.array_equal(knn, argmax)
