"""FedSPA: the SFPD backbone, the uploads (homophily proxy, Fisher), HBDA, and its composition with FedIA."""

import csv
import dataclasses
import importlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_domain, vmapped_and_looped

from fedjax_graph import aggregators, cells as cells_lib, comparison, config, data, devices, graphs
from fedjax_graph import methods, simulation, sfpd, tables
from fedjax_graph.controls import RunControls
# The module (``methods.fedspa`` is the factory of the same name).
fedspa_lib = importlib.import_module("fedjax_graph.methods.fedspa")

HP = {"hidden": 8}  # a small SFPD for the synthetic graphs


# ----------------------------------------------------------------------------
# The backbone.
# ----------------------------------------------------------------------------


def test_edge_types_on_a_4_node_graph():
  # Nodes 0, 1, 2 train (labels 0, 0, 1); node 3 not (its label 0 must not count).
  y = jnp.array([0, 0, 1, 0])
  train = jnp.array([True, True, True, False])
  senders = jnp.array([0, 1, 0, 2, 2, 3, 1, 3])
  receivers = jnp.array([1, 0, 2, 0, 3, 2, 3, 0])
  types = sfpd.edge_types(senders, receivers, y, train)
  expected = [[0, 1, 0], [0, 1, 0],  # 0-1: both train, same label: be
              [1, 0, 0], [1, 0, 0],  # 0-2: both train, different: fr
              [0, 0, 1], [0, 0, 1],  # 2-3: 3 is not a training node: unk
              [0, 0, 1], [0, 0, 1]]  # 1-3, 3-0: same label, but unk
  np.testing.assert_array_equal(types, expected)


def _small_graph(n=7, seed=0, features=4):
  rng = np.random.default_rng(seed)
  edges = np.array([[0, 1], [1, 2], [2, 0], [2, 3], [3, 4], [5, 6], [1, 4]]).T
  edges = np.concatenate([edges, edges[::-1]], axis=1)
  x = rng.standard_normal((n, features)).astype(np.float32)
  y = np.array([0, 1, 0, 1, 1, 0, 1], np.int32)[:n]
  masks = dict(train=np.array([1, 1, 1, 0, 1, 0, 1], bool), val=np.zeros(n, bool),
               test=np.array([0, 0, 0, 1, 0, 1, 0], bool))
  return x, y, edges, masks


def test_typed_sums_mean_and_sum_by_hand_padded_and_on_the_csr_graph():
  # A star around node 0: 0-1 be (train, labels 0, 0), 0-2 fr (train, labels 0, 1),
  # 0-3 unk (3 is not a training node). deg = 3, 1, 1, 1; A_lo's weight 1/(deg + 1).
  y = np.array([0, 0, 1, 0], np.int32)
  masks = dict(train=np.array([1, 1, 1, 0], bool), val=np.zeros(4, bool),
               test=np.array([0, 0, 0, 1], bool))
  edges = np.array([[0, 1], [0, 2], [0, 3]]).T
  edges = np.concatenate([edges, edges[::-1]], axis=1)
  h = np.array([[1.0, -1.0], [2.0, 0.0], [4.0, 3.0], [8.0, 5.0]], np.float32)
  # Rows: nodes 0..3; columns of each channel: h's two features.
  by_hand = {
      "sum": {"fr": [[4, 3], [0, 0], [1, -1], [0, 0]],
              "be": [[2, 0], [1, -1], [0, 0], [0, 0]],
              "unk": [[8, 5], [0, 0], [0, 0], [1, -1]]},
      "mean": {"fr": [[1, 0.75], [0, 0], [0.5, -0.5], [0, 0]],
               "be": [[0.5, 0], [0.5, -0.5], [0, 0], [0, 0]],
               "unk": [[2, 1.25], [0, 0], [0, 0], [0.5, -0.5]]}}
  shard = _shard(h, y, edges, masks, 8, 12)  # padding rows and edges
  csr = sfpd.LabelledGraph(jax.tree.map(jnp.asarray, graphs.csr_graph(edges, 4, 8)), shard.y,
                           shard.train)
  for graph in (shard, csr):
    typed = sfpd.typed_edges(graph, 8)
    for neighbours, expected in by_hand.items():
      sums = sfpd.typed_sums(shard.x, typed, neighbours)
      for t, name in enumerate(sfpd.EDGE_TYPES):
        np.testing.assert_allclose(sums[t][:4], expected[name], atol=1e-6)
        np.testing.assert_array_equal(sums[t][4:], 0.0)  # padding rows get nothing
    # mean: the three channels add up to A_lo h without its diagonal term.
    total = sum(sfpd.typed_sums(shard.x, typed, "mean"))[:4]
    deg = np.array([3, 1, 1, 1])
    a_lo = (np.eye(4) + np.array([[0, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])) / (
        deg + 1)[:, None]
    np.testing.assert_allclose(total + h / (deg + 1)[:, None], a_lo @ h, atol=1e-6)
  with pytest.raises(ValueError, match="neighbours = 'max'"):
    sfpd.typed_sums(shard.x, sfpd.typed_edges(shard, 8), "max")


def _dense_layer(params, x, edges, y, train, neighbours):
  """An SFPD layer in float64 numpy from dense matrices, independently of sfpd.py."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "balance"}
  gate_k = np.asarray(params["balance"]["kernel"], np.float64)
  gate_b = np.asarray(params["balance"]["bias"], np.float64)
  n = x.shape[0]
  a = np.zeros((n, n))
  typed = {t: np.zeros((n, n)) for t in ("fr", "be", "unk")}
  for s, r in edges.T:
    a[r, s] = 1.0
    known = train[s] and train[r]
    typed["unk" if not known else ("be" if y[s] == y[r] else "fr")][r, s] = 1.0
  a_lo = (a + np.eye(n)) / (a.sum(1) + 1)[:, None]
  a_hi = np.eye(n) - a_lo
  if neighbours == "mean":  # each typed row scaled as A_lo's
    typed = {t: m / (a.sum(1) + 1)[:, None] for t, m in typed.items()}
  relu = lambda v: np.maximum(v, 0)
  sig = lambda v: 1 / (1 + np.exp(-v))
  low, high, mlp = relu(a_lo @ x @ p["w_low"]), relu(a_hi @ x @ p["w_high"]), relu(x @ p["w_mlp"])
  n_lo = {t: m @ low for t, m in typed.items()}
  n_hi = {t: m @ high for t, m in typed.items()}
  b1, b2 = sig(n_lo["unk"] @ gate_k + gate_b), sig(n_hi["unk"] @ gate_k + gate_b)
  scores = np.concatenate([
      n_lo["fr"] @ p["att_low_fr"], n_hi["fr"] @ p["att_high_fr"],
      n_lo["be"] @ p["att_low_be"], n_hi["be"] @ p["att_high_be"],
      b1 * (n_lo["unk"] @ p["att_low_fr"]) + (1 - b1) * (n_lo["unk"] @ p["att_low_be"]),
      b2 * (n_hi["unk"] @ p["att_high_fr"]) + (1 - b2) * (n_hi["unk"] @ p["att_high_be"]),
      mlp @ p["att_mlp"]], axis=1)
  logits = sig(scores) @ p["att_mix"] / 7
  att = np.exp(logits - logits.max(1, keepdims=True))
  att /= att.sum(1, keepdims=True)
  channels = [n_lo["fr"], n_hi["fr"], n_lo["be"], n_hi["be"], n_lo["unk"], n_hi["unk"], mlp]
  return 7 * sum(att[:, c:c + 1] * channels[c] for c in range(7))


def _shard(x, y, edges, masks, n_node, n_edge):
  return jax.tree.map(jnp.asarray, graphs.pad_graph(x, y, edges, masks, np.zeros(len(y), int), 1,
                                                    n_node, n_edge))


# Both sides of the propagate-narrower branch, both typed-sum scalings.
@pytest.mark.parametrize("features,neighbours", [(3, "mean"), (6, "mean"), (3, "sum"), (6, "sum")])
def test_sfpd_layer_matches_a_dense_hand_computation_padded_and_on_the_csr_graph(features,
                                                                                 neighbours):
  x, y, edges, masks = _small_graph(features=4)
  n = len(y)
  layer = sfpd.SFPDLayer(features, neighbours)
  shard = _shard(x, y, edges, masks, 16, 24)
  variables = layer.init(jax.random.PRNGKey(0), shard.x, sfpd.typed_edges(shard, 16))
  # Non-trivial gate bias and mixing, so every term matters.
  variables = jax.tree.map(lambda v: v + 0.3 * jax.random.normal(jax.random.PRNGKey(1), v.shape),
                           variables)
  expected = _dense_layer(variables["params"], x.astype(np.float64), edges, y, masks["train"],
                          neighbours)
  out = layer.apply(variables, shard.x, sfpd.typed_edges(shard, 16))
  np.testing.assert_allclose(out[:n], expected, rtol=1e-4, atol=1e-5)
  # More padding changes no real row.
  wider = _shard(x, y, edges, masks, 32, 40)
  np.testing.assert_allclose(layer.apply(variables, wider.x, sfpd.typed_edges(wider, 32))[:n],
                             out[:n], rtol=1e-5, atol=1e-6)
  # The evaluation form (CSR graph with self-loops + training labels) gives the same rows.
  csr = jax.tree.map(jnp.asarray, graphs.csr_graph(edges, n, 16))
  labelled = sfpd.LabelledGraph(csr, shard.y, shard.train)
  np.testing.assert_allclose(layer.apply(variables, shard.x, sfpd.typed_edges(labelled, 16))[:n],
                             out[:n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropped", [False, True])
def test_sfpd_gradient_matches_autodiff_of_the_dense_matrices(monkeypatch, dropped):
  # The typed products' custom VJP (the transpose's CSR product) against autodiff of the
  # same matrices, dense; ``dropped``: one direction of some edges dropped (FGSSL's views),
  # so the indicator matrices are not symmetric.
  x, y, edges, masks = _small_graph(features=4)
  n = len(y)
  shard = _shard(x, y, edges, masks, 16, 24)
  if dropped:
    shard = shard._replace(edge_weight=shard.edge_weight.at[jnp.array([0, 2, 5, 9])].set(0.0))
  model = sfpd.SFPD(num_classes=3, hidden=8)
  params = model.init(jax.random.PRNGKey(0), shard.x, shard, train=False)
  weights = jax.random.normal(jax.random.PRNGKey(2), (n, 3))
  loss = lambda params, x: jnp.sum(model.apply(params, x, shard, train=False)[:n] * weights)
  sparse = jax.grad(loss, argnums=(0, 1))(params, shard.x)

  def dense_product(h, edges, entries):
    rows = jnp.repeat(jnp.arange(16), jnp.diff(edges.indptr),
                      total_repeat_length=edges.indices.shape[0])
    return jnp.zeros((16, 16)).at[rows, edges.indices].add(entries) @ h

  monkeypatch.setattr(sfpd, "_product", dense_product)
  dense = jax.grad(loss, argnums=(0, 1))(params, shard.x)
  assert float(jnp.max(jnp.abs(dense[1]))) > 0.01  # the input gradient flows through the graph
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), sparse, dense)


def test_sfpd_reads_only_training_labels():
  x, y, edges, masks = _small_graph()
  model = sfpd.SFPD(num_classes=2, hidden=8)
  shard = _shard(x, y, edges, masks, 16, 24)
  params = model.init(jax.random.PRNGKey(0), shard.x, shard, train=False)
  other = shard._replace(y=jnp.where(shard.train, shard.y, 1 - shard.y))
  np.testing.assert_array_equal(model.apply(params, shard.x, shard, train=False),
                                model.apply(params, other.x, other, train=False))
  flipped = shard._replace(y=shard.y.at[0].set(1 - shard.y[0]))  # node 0 is a training node
  assert not np.allclose(model.apply(params, shard.x, shard, train=False),
                         model.apply(params, flipped.x, flipped, train=False))


def test_sfpd_needs_norm_none_a_graph_and_a_known_neighbours():
  with pytest.raises(ValueError, match="norm"):
    config.load_preset("wikinet", backbone="sfpd").model(5)
  model = config.load_preset("wikinet", backbone="sfpd", norm="none", hidden=8).model(2)
  assert model.neighbours == "mean"
  params = model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 4)), None, train=False)
  with pytest.raises(ValueError, match="needs a graph"):
    model.apply(params, jnp.zeros((3, 4)), None, train=False)
  with pytest.raises(ValueError, match="neighbours = 'max'"):
    model.clone(neighbours="max").apply(params, jnp.zeros((1, 4)), None, train=False)
  cfg = config.load_preset("wikinet")
  for name in ("fedspa", "fedspa_nohbda"):
    with pytest.raises(ValueError, match=f"{name}: neighbours = 'max'; must be 'mean'"):
      methods.make_method(name, cfg.model(5), cfg, {"neighbours": "max"})
    assert methods.method_defaults()["hparams"][name]["neighbours"] == "mean"


# ----------------------------------------------------------------------------
# The uploads.
# ----------------------------------------------------------------------------


def test_homophily_proxy_on_a_tiny_graph():
  # Path 0 - 1 - 2, both directions. Columns: [1, 0, 1] (x^T L x = 2, x^T x = 2:
  # quotient 1), zeros (left out), constant (quotient 0).
  x = jnp.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
  senders, receivers = jnp.array([0, 1, 1, 2]), jnp.array([1, 0, 2, 1])
  key = jax.random.PRNGKey(0)
  np.testing.assert_allclose(fedspa_lib.homophily_proxy(x, senders, receivers, 1.0, key), 0.5)
  # Half of the 2 qualifying columns: one of them, never the zero column.
  draws = {float(fedspa_lib.homophily_proxy(x, senders, receivers, 0.5, jax.random.PRNGKey(k)))
           for k in range(12)}
  assert draws == {0.0, 1.0}
  # Padding rows (zeros) and padding edges between them add nothing.
  padded = jnp.concatenate([x, jnp.zeros((2, 3))])
  s, r = jnp.concatenate([senders, jnp.array([3, 3])]), jnp.concatenate([receivers, jnp.array([4, 3])])
  np.testing.assert_allclose(fedspa_lib.homophily_proxy(padded, s, r, 1.0, key), 0.5)
  assert fedspa_lib.homophily_proxy(jnp.zeros((3, 3)), senders, receivers, 1.0, key) == 0.0


def _ctx(model, shard, params):
  return methods.ClientContext(params, params, shard.x, shard.y, shard.train, shard.node_domain,
                               1, shard, (), ())


def test_fisher_upload_uses_training_labels_only_and_is_the_squared_gradient():
  x, y, edges, masks = _small_graph()
  cfg = config.load_preset("wikinet", backbone="sfpd", norm="none", hidden=8, num_layers=2)
  model = cfg.model(2)
  method = methods.make_method("fedspa", model, cfg, HP)
  shard = _shard(x, y, edges, masks, 16, 24)
  params = model.init(jax.random.PRNGKey(0), shard.x, shard, train=False)
  _, upload = method.client_final(_ctx(model, shard, params), params, None)
  assert set(upload) == {"homophily", "fisher"}
  assert [f.shape for f in upload["fisher"]["fr"]] == [(8, 1), (8, 1), (2, 1), (2, 1)]
  # Against the gradient of the mean training log-likelihood written out here.
  def mean_log_p(p):
    log_p = jax.nn.log_softmax(model.apply(p, shard.x, shard, train=True, deterministic=True))
    return jnp.sum(jnp.where(shard.train, log_p[jnp.arange(16), shard.y], 0)) / shard.train.sum()
  grad = jax.grad(mean_log_p)(params)["params"]["layer_1"]["att_high_be"]
  np.testing.assert_allclose(upload["fisher"]["be"][3], grad**2, rtol=1e-5, atol=1e-12)
  assert float(jnp.sum(upload["fisher"]["be"][3])) > 0
  # The method's own forward pass is its model's: the typed sums' scaling counts.
  summed = model.clone(neighbours="sum")
  _, upload_sum = methods.make_method("fedspa", summed, cfg, {**HP, "neighbours": "sum"}
                                      ).client_final(_ctx(summed, shard, params), params, None)
  assert not np.allclose(upload_sum["fisher"]["be"][3], upload["fisher"]["be"][3])
  # Labels of non-training nodes change nothing.
  other = shard._replace(y=jnp.where(shard.train, shard.y, 1 - shard.y))
  _, upload2 = method.client_final(_ctx(model, other, params), params, None)
  jax.tree.map(np.testing.assert_array_equal, upload, upload2)
  # Without HBDA, nothing is uploaded besides the update.
  nohbda = methods.make_method("fedspa_nohbda", model, cfg, HP)
  assert nohbda.client_final(_ctx(model, shard, params), params, None)[1] == ()
  assert nohbda.leaf_weights is None


# ----------------------------------------------------------------------------
# HBDA.
# ----------------------------------------------------------------------------


def _softmin(v):
  v = np.asarray(v, np.float64)
  m = (v - v.min()) / (v.max() - v.min()) if v.max() > v.min() else np.zeros_like(v)
  return np.exp(-m) / np.exp(-m).sum()


def test_hbda_weights_by_hand_for_three_clients():
  # fr: F = 0, 1, 3 (one scalar tensor) plus a tensor equal for all; mean 4/3,
  # delta = |F - mean| = 4/3, 1/3, 5/3. be: all equal (no division by zero).
  fisher = {"fr": (jnp.array([[0.0], [1.0], [3.0]]), jnp.full((3, 2), 0.5)),
            "be": (jnp.full((3, 1), 2.0),)}
  homophily = jnp.array([0.5, -2.0, 1.0])
  w = fedspa_lib.hbda_weights(fisher, homophily, jnp.ones(3, bool))
  np.testing.assert_allclose(w["fr"], _softmin([4 / 3, 1 / 3, 5 / 3]), rtol=1e-6)
  np.testing.assert_allclose(w["fr"], np.exp(-np.array([0.75, 0, 1])) / np.exp(
      -np.array([0.75, 0, 1])).sum(), rtol=1e-6)
  np.testing.assert_allclose(w["be"], [1 / 3] * 3, rtol=1e-6)
  np.testing.assert_allclose(w["rest"], _softmin([0.5, 2.0, 1.0]), rtol=1e-6)  # |S|
  # Client 2 does not take part: its (huge) Fisher and S never count.
  fisher["fr"] = (jnp.array([[0.0], [1.0], [1e6]]), fisher["fr"][1])
  w = fedspa_lib.hbda_weights(fisher, jnp.array([0.5, -2.0, 1e6]), jnp.array([True, True, False]))
  np.testing.assert_allclose(w["fr"], [0.5, 0.5, 0.0], rtol=1e-6)  # deltas equal
  np.testing.assert_allclose(w["rest"], [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)),
                                         0.0], rtol=1e-6)
  # All Fisher information equal and all S equal: uniform, finite.
  same = {"fr": (jnp.ones((3, 4)),), "be": (jnp.zeros((3, 4)),)}
  w = fedspa_lib.hbda_weights(same, jnp.full(3, 0.7), jnp.ones(3, bool))
  for group in ("fr", "be", "rest"):
    np.testing.assert_allclose(w[group], [1 / 3] * 3, rtol=1e-6)


def test_hbda_groups_leaves_by_exact_name():
  model = sfpd.SFPD(num_classes=2, hidden=8)
  params = model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 4)), None, train=False)
  groups = fedspa_lib.leaf_groups(params)["params"]
  for layer in ("layer_0", "layer_1"):
    assert groups[layer]["att_low_fr"] == groups[layer]["att_high_fr"] == "fr"
    assert groups[layer]["att_low_be"] == groups[layer]["att_high_be"] == "be"
    assert {groups[layer][k] for k in ("w_low", "w_high", "w_mlp", "att_mlp", "att_mix")} == {
        "rest"}
    assert groups[layer]["balance"] == {"kernel": "rest", "bias": "rest"}


def test_aggregators_apply_leaf_weights_tensor_by_tensor():
  updates = {"a": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "b": jnp.array([1.0, 2.0, 9.0])}
  leaf = {"a": jnp.array([1.0, 1.0, 2.0]), "b": jnp.array([0.0, 1.0, 3.0])}
  part = jnp.array([True, True, False])
  avg = aggregators.get("fedavg")
  u, _, diag = avg.update(updates, avg.init(3), weights=jnp.array([1.0, 3.0, 1.0]),
                          participating=part, leaf_weights=leaf)
  np.testing.assert_allclose(u["a"], (1 * updates["a"][0] + 3 * updates["a"][1]) / 4)
  np.testing.assert_allclose(u["b"], 2.0)  # client 0 has weight 0 on b, client 2 is out
  # Reported weights: the coordinate-weighted mean over tensors (2 coordinates of a, 1 of b).
  np.testing.assert_allclose(diag.weights, [2 / 3 * 0.25, 2 / 3 * 0.75 + 1 / 3, 0.0], rtol=1e-6)
  # FedIA at rho = beta = 1 (alpha = 1/C, full mask) equals FedAvg with the same
  # leaf weights and uniform base weights.
  fedia = aggregators.get("fedia")
  v, _, _ = fedia.update(updates, fedia.init(3), 1.0, 1.0, participating=part, leaf_weights=leaf)
  w, _, _ = avg.update(updates, avg.init(3), participating=part, leaf_weights=leaf)
  jax.tree.map(lambda p, q: np.testing.assert_allclose(p, q, rtol=1e-6), v, w)
  with pytest.raises(ValueError, match="does not take"):
    aggregators.get("gma").update(updates, aggregators.get("gma").init(3), leaf_weights=leaf)
  with pytest.raises(ValueError, match="shape"):
    avg.update(updates, avg.init(3), leaf_weights={"a": jnp.ones(2), "b": jnp.ones(3)})


# ----------------------------------------------------------------------------
# In the simulation.
# ----------------------------------------------------------------------------

SIZES = {"chameleon": 30, "squirrel": 14, "crocodile": 20}  # 2 clients each: 15, 7, 10 nodes


@pytest.fixture(scope="module")
def one_bucket():
  """All clients in one size bucket: the local update compiles once per backend.

  (Bucket order against client order is ``for_each_client``'s, tested with
  several buckets in test_methods.py; uploads are reordered with the update.)
  """
  domain_graphs = {d: fake_domain(n, 2 * n, 5, 8, i) for i, (d, n) in enumerate(SIZES.items())}
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  return cfg, data.build_federation(cfg, domain_graphs, seeds=[0])


def test_fedspa_runs_on_its_own_backbone_with_its_neighbours(one_bucket):
  cfg, federation = one_bucket
  sim = simulation.make_simulation(cfg, federation, method="fedspa", method_hparams=HP)
  assert isinstance(sim.model, sfpd.SFPD) and sim.model.num_layers == 2
  assert sim.model.dropout == 0.1 and sim.model.hidden == 8 and sim.model.neighbours == "mean"
  summed = simulation.make_simulation(cfg, federation, method="fedspa_nohbda",
                                      method_hparams={**HP, "neighbours": "sum"})
  assert summed.model.neighbours == "sum"  # Method.model_options reach the model


def test_the_memory_estimate_counts_fedspa_on_its_own_backbone(one_bucket):
  cfg, federation = one_bucket
  batch = cells_lib.grid("fedia", rho=[0.5], beta=[0.5]).batch()

  def estimate(federation):
    sim = simulation.make_simulation(cfg, federation, method="fedspa", method_hparams=HP)
    return sim, devices.estimate(sim, federation, batch, 2)

  sim, base = estimate(federation)
  # The table passes the dataset's recipe; SFPD trains on the graph with its own,
  # which the estimate reads off the simulation.
  recipe = dataclasses.replace(cfg, **sim.method.recipe)
  assert sim.config == recipe and recipe.backbone == "sfpd" != cfg.backbone
  # Its typed products keep per-entry temporaries (XLA:CPU): more edges, more memory.
  denser = {d: fake_domain(n, 6 * n, 5, 8, i) for i, (d, n) in enumerate(SIZES.items())}
  more_edges = data.build_federation(cfg, denser, seeds=[0])
  (a,), (b,) = federation.client_shards, more_edges.client_shards
  extra = (4 * a.x.shape[1] * (b.senders.shape[2] - a.senders.shape[2]) * recipe.hidden
           * devices.ACTIVATION_COPIES * recipe.num_layers)
  assert extra > 0 and estimate(more_edges)[1].per_run[0] - base.per_run[0] == extra


# One SFPD layer in the round's tests: the local update's compiles are the cost
# of this file; two layers are the eager tests' and the real run's.
HP_ROUND = {"hidden": 8, "num_layers": 1}


class FirstRound(NamedTuple):
  params: dict
  vmapped: simulation.ClientOutput
  looped: simulation.ClientOutput


@pytest.fixture(scope="module")
def first_round(one_bucket):
  """FedSPA's local training of round 0 on every client, from the initial global model."""
  cfg, federation = one_bucket
  sim = simulation.make_simulation(cfg, federation, method="fedspa", method_hparams=HP_ROUND)
  batch = jax.device_put(cells_lib.Cells([cells_lib.cell("fedavg")]).batch())
  state = sim.init(np.array([0], np.int32), batch)[0]
  params = jax.tree.map(lambda leaf: leaf[0, 0], state.params)
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  vmapped, looped = vmapped_and_looped(sim, federation, params, params, shards, keys)
  return FirstRound(params, vmapped, looped)


def test_vmapped_clients_equal_python_loop_uploads_included(first_round):
  vmapped, looped = first_round.vmapped, first_round.looped
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               vmapped, looped)
  assert np.all(np.diff(np.asarray(vmapped.upload["homophily"])) != 0)  # per client


@pytest.mark.parametrize("method", ["fedspa", "fedspa_nohbda"])
def test_plus_fedia_at_rho1_beta1_equals_the_method_and_absent_clients_weigh_nothing(
    one_bucket, first_round, method):
  # The server part of the round (simulation's ``aggregate``: base weights,
  # the method's leaf weights, participation) on the clients' real outputs;
  # run_chunk around it is the real-WikiNet test's.
  cfg, federation = one_bucket
  outputs, params, num_clients = first_round.vmapped, first_round.params, federation.num_clients
  if method == "fedspa_nohbda":  # the same local training; its clients upload nothing
    outputs = outputs._replace(upload=())
  sim = simulation.make_simulation(cfg, federation, method=method, method_hparams=HP_ROUND)
  sampled = jnp.array([True, False, True, True, False, False])  # half the clients take part
  train_counts = jnp.asarray(federation.train_counts)
  assert np.all(federation.train_counts > 0)
  server_part = jax.jit(sim.aggregate, static_argnums=1)

  def aggregate(aggregator, hparams):
    state = simulation.SimState(params, aggregators.get(aggregator).init(num_clients, params),
                                sim.method.init(params, num_clients), jax.random.PRNGKey(0),
                                jax.random.PRNGKey(1))
    state, (_, weights, _, _) = server_part(state, aggregator, hparams, outputs, train_counts,
                                            sampled)
    return state.params, np.asarray(weights)

  fedia, _ = aggregate("fedia", {"rho": 1.0, "beta": 1.0})
  half, _ = aggregate("fedia", {"rho": 0.5, "beta": 0.5})
  base, weights = aggregate("fedavg", {})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), fedia, base)
  far = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), half, base)
  assert max(jax.tree.leaves(far)) > 1e-4  # rho = 0.5 differs
  np.testing.assert_array_equal(weights > 0, sampled)
  np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-5)
  if method == "fedspa_nohbda":  # uniform over the round's participants
    np.testing.assert_allclose(weights[sampled], 1 / 3, rtol=1e-6)
  else:  # HBDA: not uniform
    assert np.ptp(weights[sampled]) > 1e-4


def test_a_table_refuses_hbda_next_to_an_aggregator_without_leaf_weights():
  cfg, defaults = config.load_preset("wikinet"), methods.method_defaults()
  for aggregator in ("gma", "fedheal"):
    assert not aggregators.get(aggregator).per_leaf
    with pytest.raises(ValueError, match=f"fedspa .*{aggregator} does not take"):
      comparison.check_methods(["fedspa"], ["fedia", aggregator], cfg, defaults)
  comparison.check_methods(["fedspa"], ["fedia"], cfg, defaults)
  comparison.check_methods(["fedspa_nohbda"], ["fedia", "gma", "fedheal"], cfg, defaults)


# ----------------------------------------------------------------------------
# In the tables: "FedIA (repl.)" and the backbone.
# ----------------------------------------------------------------------------


def test_row_labels_name_fedia_repl_in_both_selections():
  assert comparison.row_label("fedspa_nohbda") == "FedSPA w/o HBDA"
  assert comparison.row_label("fedspa_nohbda", "fedia") == "FedIA (repl.)"
  assert comparison.row_label("fedspa_nohbda", "gma") == "FedSPA w/o HBDA+GMA"
  assert comparison.row_label("fedspa", "fedia") == "FedSPA+FedIA"
  settings = {"fedia": {"rho": 0.5, "beta": 0.5}}
  assert comparison.method_cells("fedspa_nohbda", ["fedia"], settings, "fixed").labels == [
      "FedIA (repl.)", "FedSPA w/o HBDA"]
  val = comparison.method_cells("fedspa_nohbda", ["fedia"], settings, "val").labels
  assert len(val) == 26 and all(label.startswith("FedIA (repl.) ρ=") for label in val[:-1])


def _fake_run_cells(config, federation, cells, key, method, hparams, rounds, out_dir, setup,
                    controls, record=None, last=None):
  """A RunResult of made-up accuracies for ``cells``: the tables without any training."""
  s, g, t, d = len(federation.seeds), len(cells.cells), rounds, len(federation.domains)
  c = federation.num_clients
  acc = np.linspace(0.3, 0.6, s * g * t * d, dtype=np.float32).reshape(s, g, t, d)
  return tables.RunResult(acc, acc, np.full((s, g, t, d), 3), acc, acc,
                          np.zeros((s, g, t), np.float32), np.zeros((s, g, t, c), bool),
                          np.zeros((s, g, t, c), np.float32), np.asarray(cells.labels),
                          np.asarray([cell.aggregator for cell in cells.cells]),
                          cells.hparam_table(), 0.0)


def test_a_table_names_fedia_repl_and_the_sfpd_rows_in_every_format(tmp_path, monkeypatch,
                                                                      tiny_wikinet):
  plotted = {}
  monkeypatch.setattr(comparison, "run_cells", _fake_run_cells)
  monkeypatch.setattr(tables, "plot_table", lambda rows, path, title: plotted.update(
      labels=[r.label for r in rows], title=title))
  names = ["fedavg", "fedspa", "fedspa_nohbda"]
  out = comparison.run_table(config.load_preset("wikinet"), names, [0], 2, 1,
                             controls=RunControls(out_dir=tmp_path / "t"),
                             domain_graphs=tiny_wikinet)
  labels = ["FedAvg", "FedAvg+FedIA", "FedSPA", "FedSPA+FedIA", "FedSPA w/o HBDA",
            "FedIA (repl.)"]
  note = "pmlp_gcn (sfpd: FedSPA, FedSPA+FedIA, FedSPA w/o HBDA, FedIA (repl.))"
  assert plotted["labels"] == labels and note in plotted["title"]  # table.png
  with open(out / "table.csv") as f:
    assert [row["method"] for row in csv.DictReader(f)] == labels  # the label column
  for suffix, escaped in (("md", note), ("tex", note.replace("_", r"\_"))):
    text = (out / f"table.{suffix}").read_text()
    assert escaped in text and all(label in text for label in labels)
  # On the config's own backbone nothing is noted.
  sfpd_config = config.load_preset("wikinet", backbone="sfpd", norm="none")
  assert comparison.own_backbones(names, sfpd_config, methods.method_defaults()) == {}
  assert comparison.own_backbones(names, config.load_preset("wikinet"),
                                  methods.method_defaults()) == {"fedspa": "sfpd",
                                                                 "fedspa_nohbda": "sfpd"}


def test_a_config_field_that_fedspa_replaces_is_named():
  """``--set hidden=64`` does not reach FedSPA's SFPD (its recipe's 128): the note says so."""
  wikinet, defaults = config.load_preset("wikinet", hidden=64), methods.method_defaults()
  lines = comparison.recipe_overrides(["fedavg", "fedspa"], wikinet, defaults,
                                      {"hidden": 64, "lr": 0.1})
  assert lines == ["fedspa runs with hidden=128, not the hidden=64 given (set it by "
                   "hparams.fedspa.hidden in --method-config)"]
  norm = comparison.recipe_overrides(["fedspa"], wikinet, defaults, {"norm": "batch"})
  assert norm == ["fedspa runs with norm='none', not the norm='batch' given (set it by the "
                  "method's recipe)"]
  # The method's own value, or fields it leaves alone, give no note.
  assert comparison.recipe_overrides(["fedspa", "fedavg"], wikinet, defaults,
                                     {"hidden": 128, "lr": 0.1}) == []


# ----------------------------------------------------------------------------
# On real WikiNet.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_wikinet_run(raw_dir):
  """FedSPA (HBDA, ``neighbours: mean``, one FedAvg cell) on real WikiNet: 2 rounds, hidden 8.

  One size bucket, one cell and a narrow SFPD keep the compile short.
  """
  domain_graphs, _ = data.load_dataset("wikinet", raw_dir)
  cfg = config.load_preset("wikinet", max_buckets=1)
  federation = data.build_federation(cfg, domain_graphs, seeds=[0])
  cells = cells_lib.Cells([cells_lib.cell("fedavg")])
  sim = simulation.make_simulation(cfg, federation, method="fedspa", method_hparams=HP)
  batch = jax.device_put(cells.batch())
  state = sim.init(np.array([0], np.int32), batch)
  _, metrics = sim.run_chunk(state, np.int32(0), batch, simulation.sim_data(federation),
                             num_rounds=2)
  print("FedSPA test accuracy per domain, round 1 and 2:", np.asarray(metrics.test_acc[0, 0]),
        "classes predicted:", np.asarray(metrics.predicted_classes[0, 0]),
        "train loss:", np.asarray(metrics.train_loss[0, 0]))
  return metrics


def test_short_run_on_real_wikinet_is_finite_and_predicts_more_than_one_class(real_wikinet_run):
  metrics = real_wikinet_run
  assert np.all(np.isfinite(np.asarray(metrics.test_acc)))
  assert np.all(np.isfinite(np.asarray(metrics.train_loss)))
  assert np.all(np.asarray(metrics.train_loss) < 10)  # sum gave ~5e7 here
  assert np.all(np.asarray(metrics.predicted_classes[0, 0, -1]) > 1)  # every domain
