"""Tests of fedjax_graph.models: padding invariance, where each backbone propagates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import graphs, models
from conftest import dense_norm_adj

N = 9          # real nodes; node 8 is isolated
F = 6          # features
K = 3          # classes
HIDDEN = 8     # >= F: the first layer propagates x, the last one h @ W
# Undirected edges among nodes 0..7 (node 8 has none), both directions.
_UNDIRECTED = np.array([[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [1, 5]]).T
EDGES = np.concatenate([_UNDIRECTED, _UNDIRECTED[::-1]], axis=1)
# The NodeClassifier backbones (batch norm, CSR graph at evaluation); SFPD's padding
# and CSR equalities are in tests/test_methods_fedspa.py (it needs a LabelledGraph).
NODE_CLASSIFIERS = sorted(name for name, b in models.BACKBONES.items() if not b.eval_labels)
OTHER_EDGES = np.concatenate([np.array([[0, 7], [2, 4]]).T, np.array([[7, 0], [4, 2]]).T], axis=1)


def _features(seed=0, n=N):
  return np.random.default_rng(seed).standard_normal((n, F)).astype(np.float32)


def _shard(x, edge_index, n_node, n_edge):
  n = x.shape[0]
  rows = np.arange(n)
  masks = dict(train=rows < 5, val=(rows >= 5) & (rows < 7), test=rows >= 7)
  return graphs.pad_graph(x, np.zeros(n), edge_index, masks, np.zeros(n), 1, n_node, n_edge)


def _padded_x(x, n_node, seed=1):
  """x padded to n_node rows with garbage on padding rows (they must not matter)."""
  pad = np.random.default_rng(seed).standard_normal((n_node - x.shape[0], F)).astype(np.float32)
  return np.concatenate([x, 100 * pad])



def _init(model, x, graph):
  return model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, graph,
                    train=False)


def _apply(model, params, x, graph, train, groups=None, num_groups=1):
  return np.asarray(model.apply(params, jnp.asarray(x), graph, train=train, groups=groups,
                                num_groups=num_groups, rngs={"dropout": jax.random.key(7)}))


def _real(n_rows, n_real=N):
  """Batch-norm groups: the first n_real rows are one graph, the rest padding."""
  return jnp.where(jnp.arange(n_rows) < n_real, 0, 1)


@pytest.fixture(scope="module")
def tight_and_padded():
  """The same graph as a Shard with n + 1 nodes and as one padded to 40 nodes."""
  x = _features()
  tight = _shard(x, EDGES, N + 1, EDGES.shape[1])
  padded = _shard(x, EDGES, 40, 64)
  return x, tight, padded


class TestMakeModel:

  @pytest.mark.parametrize("name", sorted(models.BACKBONES))
  def test_flags(self, name):
    norm = "none" if name == "sfpd" else "batch"  # SFPD has no batch norm
    model = models.make_model(name, num_classes=K, hidden=HIDDEN, num_layers=2, dropout=0.1,
                              norm=norm)
    assert (model.propagate_train, model.propagate_eval) == models.BACKBONES[name][:2]
    assert (model.num_classes, model.hidden, model.num_layers, model.dropout) == (K, HIDDEN, 2,
                                                                                  0.1)

  def test_backbones_table(self):
    assert models.BACKBONES == {"mlp": (False, False, "rows", False, False),
                                "gcn": (True, True, "graph", False, True),
                                "pmlp_gcn": (False, True, "rows", False, False),
                                "sfpd": (True, True, "graph", True, False)}
    assert [name for name, b in models.BACKBONES.items() if b.eval_labels] == ["sfpd"]

  def test_unknown_name_raises(self):
    with pytest.raises(ValueError) as err:
      models.make_model("bogus", num_classes=K)
    msg = str(err.value)
    assert "bogus" in msg
    for name in ("gcn", "mlp", "pmlp_gcn"):
      assert name in msg

  def test_param_shapes(self):
    model = models.make_model("gcn", num_classes=K, hidden=HIDDEN, num_layers=3)
    shard = _shard(_features(), EDGES, 16, 32)
    params = _init(model, shard.x, shard)["params"]
    assert sorted(params) == ["layer_0", "layer_1", "layer_2"]
    assert params["layer_0"]["kernel"].shape == (F, HIDDEN)
    assert params["layer_1"]["kernel"].shape == (HIDDEN, HIDDEN)
    assert params["layer_2"]["kernel"].shape == (HIDDEN, K)
    assert params["layer_2"]["bias"].shape == (K,)

  def test_propagating_without_graph_raises(self):
    model = models.make_model("gcn", num_classes=K, hidden=HIDDEN)
    x = _features()
    shard = _shard(x, EDGES, 16, 32)
    params = _init(model, shard.x, shard)
    with pytest.raises(ValueError, match="needs a graph"):
      model.apply(params, x, None, train=False)
    # PMLP trains without a graph, but needs one at inference.
    pmlp = models.make_model("pmlp_gcn", num_classes=K, hidden=HIDDEN, dropout=0.0)
    out = pmlp.apply(params, x, None, train=True, rngs={"dropout": jax.random.key(0)})
    assert out.shape == (N, K)
    with pytest.raises(ValueError, match="needs a graph"):
      pmlp.apply(params, x, None, train=False)


class TestPaddingInvariance:

  @pytest.mark.parametrize("name", NODE_CLASSIFIERS)
  @pytest.mark.parametrize("train", [False, True])
  def test_padded_equals_unpadded(self, tight_and_padded, name, train):
    x, tight, padded = tight_and_padded
    model = models.make_model(name, num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    params = _init(model, tight.x, tight)
    small = _apply(model, params, tight.x, tight, train, _real(N + 1))
    big = _apply(model, params, _padded_x(x, 40), padded, train, _real(40))
    assert small.shape == (N + 1, K) and big.shape == (40, K)
    assert np.all(np.isfinite(small)) and np.all(np.isfinite(big))
    np.testing.assert_allclose(big[:N], small[:N], rtol=1e-5, atol=1e-5)

  @pytest.mark.parametrize("name", NODE_CLASSIFIERS)
  def test_csr_graph_equals_shard(self, tight_and_padded, name):
    x, _, padded = tight_and_padded
    model = models.make_model(name, num_classes=K, hidden=HIDDEN, num_layers=3)
    params = _init(model, padded.x, padded)
    csr = graphs.csr_graph(EDGES, N, 40)
    xp = _padded_x(x, 40)
    via_csr = _apply(model, params, xp, csr, train=False, groups=_real(40))
    via_shard = _apply(model, params, xp, padded, train=False, groups=_real(40))
    np.testing.assert_allclose(via_csr[:N], via_shard[:N], rtol=1e-5, atol=1e-5)

  def test_vmapped_models_on_csr_graph(self, tight_and_padded):
    # A batch of models sharing the evaluation graph goes through the custom_vmap rule of the
    # CSR product. HIDDEN >= F: layer 0 propagates the shared (unbatched) x, layer 1 the
    # batched h, layer 2 the batched h @ W.
    x, _, padded = tight_and_padded
    model = models.make_model("pmlp_gcn", num_classes=K, hidden=HIDDEN, num_layers=3)
    singles = [model.init(jax.random.key(b), padded.x, padded, train=False) for b in range(3)]
    params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *singles)
    csr = graphs.csr_graph(EDGES, N, 40)
    xp = jnp.asarray(_padded_x(x, 40))
    apply = jax.jit(jax.vmap(lambda p: model.apply(p, xp, csr, train=False, groups=_real(40))))
    batched = np.asarray(apply(params))
    assert batched.shape == (3, 40, K)
    for b in range(3):
      single = np.asarray(model.apply(singles[b], xp, padded, train=False, groups=_real(40)))
      np.testing.assert_allclose(batched[b, :N], single[:N], rtol=1e-5, atol=1e-5)
    assert not np.allclose(batched[0, :N], batched[1, :N], atol=1e-4)

  def test_no_nan_with_isolated_node_and_padding(self, tight_and_padded):
    x, _, padded = tight_and_padded
    assert padded.self_weight[N - 1] == 1.0  # node 8 is isolated
    model = models.make_model("gcn", num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    params = _init(model, padded.x, padded)
    xp = _padded_x(x, 40)
    for train in (False, True):
      out = _apply(model, params, xp, padded, train, _real(40))
      assert np.all(np.isfinite(out))
      np.testing.assert_array_equal(out[N:], np.broadcast_to(params["params"]["layer_2"]["bias"],
                                                             (40 - N, K)))

  def test_isolated_node_gcn_equals_mlp_row(self):
    # An isolated node's GCN row is its own MLP row: A_hat has a 1 on its diagonal only
    # (without batch norm, whose statistics would mix in the other rows).
    x = _features()
    shard = _shard(x, EDGES, 16, 32)
    gcn = models.make_model("gcn", num_classes=K, hidden=HIDDEN, num_layers=3, norm="none")
    mlp = models.make_model("mlp", num_classes=K, hidden=HIDDEN, num_layers=3, norm="none")
    params = _init(gcn, shard.x, shard)
    out_gcn = _apply(gcn, params, shard.x, shard, train=False)
    out_mlp = _apply(mlp, params, shard.x, shard, train=False)
    np.testing.assert_allclose(out_gcn[N - 1], out_mlp[N - 1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out_gcn[0], out_mlp[0], atol=1e-4)


class TestWhereBackbonesPropagate:

  @pytest.fixture(scope="class")
  def two_graphs(self):
    x = _features(seed=4)
    return x, _shard(x, EDGES, 16, 32), _shard(x, OTHER_EDGES, 16, 32)

  def _outputs(self, name, two_graphs, train):
    x, g1, g2 = two_graphs
    model = models.make_model(name, num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    params = _init(model, g1.x, g1)
    return _apply(model, params, g1.x, g1, train)[:N], _apply(model, params, g1.x, g2, train)[:N]

  def test_pmlp_train_ignores_edges_eval_uses_them(self, two_graphs):
    a, b = self._outputs("pmlp_gcn", two_graphs, train=True)
    np.testing.assert_array_equal(a, b)
    a, b = self._outputs("pmlp_gcn", two_graphs, train=False)
    assert not np.allclose(a, b, atol=1e-4)

  @pytest.mark.parametrize("train", [False, True])
  def test_gcn_uses_edges(self, two_graphs, train):
    a, b = self._outputs("gcn", two_graphs, train)
    assert not np.allclose(a, b, atol=1e-4)

  @pytest.mark.parametrize("train", [False, True])
  def test_mlp_ignores_edges(self, two_graphs, train):
    a, b = self._outputs("mlp", two_graphs, train)
    np.testing.assert_array_equal(a, b)

  def test_pmlp_train_equals_mlp_and_eval_equals_gcn(self, two_graphs):
    x, g1, _ = two_graphs
    kw = dict(num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    pmlp, mlp, gcn = (models.make_model(n, **kw) for n in ("pmlp_gcn", "mlp", "gcn"))
    params = _init(pmlp, g1.x, g1)
    np.testing.assert_allclose(_apply(pmlp, params, g1.x, g1, True),
                               _apply(mlp, params, g1.x, g1, True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_apply(pmlp, params, g1.x, g1, False),
                               _apply(gcn, params, g1.x, g1, False), rtol=1e-6, atol=1e-6)

  def test_mlp_rows_depend_on_each_other_only_through_batch_norm(self, two_graphs):
    x, g1, _ = two_graphs
    kw = dict(num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    plain = models.make_model("mlp", norm="none", **kw)
    params = _init(plain, g1.x, g1)
    full = _apply(plain, params, x, None, train=True)
    np.testing.assert_allclose(_apply(plain, params, x[:5], None, train=True), full[:5],
                               rtol=1e-6, atol=1e-6)
    normed = models.make_model("mlp", **kw)
    full = _apply(normed, params, x, None, train=True)
    # The first 5 rows alone as the batch: other statistics, other outputs ...
    assert not np.allclose(_apply(normed, params, x[:5], None, train=True), full[:5], atol=1e-4)
    # ... but rows 5.. excluded from the statistics by their group give the same.
    np.testing.assert_allclose(
        _apply(normed, params, x, None, train=True, groups=_real(N, 5))[:5],
        _apply(normed, params, x[:5], None, train=True), rtol=1e-5, atol=1e-5)


class TestBatchNorm:

  def test_hand_computed_groups_and_padding(self):
    h = jnp.array([[1.0, 0.0], [3.0, 4.0], [10.0, 5.0], [20.0, 5.0], [7.0, 7.0]])
    out = np.asarray(models.batch_norm(h, jnp.array([0, 0, 1, 1, 2]), num_groups=2))
    # Group 0: mean (2, 2), var (1, 4); group 1: mean (15, 5), var (25, 0); row 4 is padding.
    eps = models.BATCH_NORM_EPS
    expected = [[-1 / np.sqrt(1 + eps), -2 / np.sqrt(4 + eps)],
                [1 / np.sqrt(1 + eps), 2 / np.sqrt(4 + eps)],
                [-5 / np.sqrt(25 + eps), 0.0], [5 / np.sqrt(25 + eps), 0.0], [0.0, 0.0]]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    alone = models.batch_norm(h[:2])
    np.testing.assert_allclose(out[:2], alone, rtol=1e-6)

  @pytest.mark.parametrize("groups, num_groups", [
      (None, 1), ([0, 0, 0, 0, 1, 1], 1), ([0, 2, 0, 2, 0, 3], 3), ([1, 1, 0, 0, 1, 0], 2)])
  def test_closed_form_gradient_equals_autodiff(self, groups, num_groups):
    # The custom VJP against autodiff of the textbook two-pass formula, with
    # padding rows (id num_groups) and an empty group (1 in the third case).
    h = jnp.asarray(np.random.default_rng(3).standard_normal((6, 4)) * 5 + 2, jnp.float32)
    g = jnp.asarray(np.random.default_rng(4).standard_normal((6, 4)), jnp.float32)
    groups = None if groups is None else jnp.asarray(groups)

    def reference(h):
      ids = jnp.zeros(6, jnp.int32) if groups is None else groups
      out = jnp.zeros_like(h)
      for k in range(num_groups):
        rows = (ids == k)[:, None]
        n = jnp.maximum(jnp.sum(rows), 1)
        mean = jnp.sum(jnp.where(rows, h, 0), 0) / n
        var = jnp.sum(jnp.where(rows, (h - mean) ** 2, 0), 0) / n
        out = jnp.where(rows, (h - mean) / jnp.sqrt(var + models.BATCH_NORM_EPS), out)
      return out

    ours = lambda h: models.batch_norm(h, groups, num_groups)
    np.testing.assert_allclose(ours(h), reference(h), rtol=1e-5, atol=1e-5)
    grad = lambda f: jax.grad(lambda h: jnp.sum(jnp.sin(f(h)) * g))(h)
    np.testing.assert_allclose(grad(ours), grad(reference), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jax.jit(lambda: grad(ours))(), grad(reference), rtol=1e-4,
                               atol=1e-5)
    if groups is not None:  # padding rows get no gradient
      assert np.all(np.asarray(grad(ours))[np.asarray(groups) == num_groups] == 0)

  def test_one_domain_train_equals_domain_groups(self):
    # A client's training rows are one domain: one group below D gives the same
    # logits and gradients as that domain's id among D groups; two domains
    # would not (the flag is only for federations whose clients hold one domain).
    model = models.make_model("mlp", num_classes=K, hidden=HIDDEN, num_layers=3)
    fast = model.clone(one_domain_train=True)
    x = _padded_x(_features(seed=5), 12)
    params = _init(model, x, None)
    one = jnp.where(jnp.arange(12) < N, 2, 4)  # domain 2 of D = 4, then padding
    grads = lambda m, groups: jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(
        p, x, None, train=True, groups=groups, num_groups=4, rngs={"dropout": jax.random.key(7)}
    )[:N])))(params)
    np.testing.assert_allclose(_apply(fast, params, x, None, True, one, 4)[:N],
                               _apply(model, params, x, None, True, one, 4)[:N], rtol=1e-5,
                               atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads(fast, one)), jax.tree.leaves(grads(model, one))):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    two = jnp.where(jnp.arange(12) < 4, 0, one)
    assert not np.allclose(_apply(fast, params, x, None, True, two, 4)[:N],
                           _apply(model, params, x, None, True, two, 4)[:N], atol=1e-3)
    # At evaluation the flag changes nothing: domains keep their own statistics.
    np.testing.assert_array_equal(_apply(fast, params, x, None, False, two, 4),
                                  _apply(model, params, x, None, False, two, 4))

  def test_unknown_norm_raises(self):
    with pytest.raises(ValueError, match="Unsupported norm: 'layer'"):
      models.make_model("gcn", num_classes=K, norm="layer")

  @pytest.mark.parametrize("name", ["pmlp_gcn", "gcn"])
  def test_domains_fused_equal_each_alone(self, name):
    # Two graphs with features 1000x apart, evaluated as one disjoint union with one group per
    # domain (the fused evaluation), give what each gives alone: no statistic crosses domains.
    x_a, x_b = _features(seed=8), 1000.0 * _features(seed=9) + 50.0
    union = np.concatenate([x_a, x_b])
    edges = np.concatenate([EDGES, EDGES + N], axis=1)
    model = models.make_model(name, num_classes=K, hidden=HIDDEN, num_layers=3, dropout=0.0)
    shard = _shard(x_a, EDGES, 16, 32)
    params = _init(model, shard.x, shard)
    domains = jnp.concatenate([jnp.zeros(N, jnp.int32), jnp.ones(N, jnp.int32),
                               jnp.full(40 - 2 * N, 2)])
    fused = _apply(model, params, _padded_x(union, 40), graphs.csr_graph(edges, 2 * N, 40),
                   False, groups=domains, num_groups=2)
    for d, x in enumerate((x_a, x_b)):
      alone = _apply(model, params, x, graphs.csr_graph(EDGES, N, N), False)
      np.testing.assert_allclose(fused[d * N:(d + 1) * N], alone, rtol=1e-4, atol=1e-4)
    # One group over both domains would mix their statistics.
    mixed = _apply(model, params, _padded_x(union, 40), graphs.csr_graph(edges, 2 * N, 40),
                   False, groups=_real(40, 2 * N))
    assert not np.allclose(mixed[:N], fused[:N], atol=1e-2)


class TestGraphLinear:

  @pytest.mark.parametrize("features", [2, F, 11])  # narrower output, equal, wider output
  def test_equals_dense_propagation_after_matmul(self, features):
    x = _features(seed=5)
    shard = _shard(x, EDGES, 16, 32)
    layer = models.GraphLinear(features)
    rng = np.random.default_rng(features)
    kernel = rng.standard_normal((F, features)).astype(np.float32)
    # A non-zero bias so "bias after propagation" is tested too.
    bias = np.arange(features, dtype=np.float32) / 10
    params = {"params": {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}}
    out = np.asarray(layer.apply(params, jnp.asarray(shard.x), shard))
    expected = dense_norm_adj(EDGES, N) @ (x.astype(np.float64) @ kernel) + bias
    np.testing.assert_allclose(out[:N], expected, rtol=1e-5, atol=1e-5)
    # Padding rows: propagation gives 0, then the bias.
    np.testing.assert_allclose(out[N:], np.broadcast_to(bias, (16 - N, features)), atol=1e-6)
    # The propagation (a scatter-add) runs on the narrower side: F or ``features`` columns.
    jaxpr = str(jax.make_jaxpr(layer.apply)(params, shard.x, shard))
    width = min(F, features)
    assert f"f32[16,{width}] = scatter-add" in jaxpr
    assert jaxpr.count("scatter-add") == 1

  def test_without_graph_is_affine(self):
    x = _features(seed=6)
    kernel = np.random.default_rng(0).standard_normal((F, 5)).astype(np.float32)
    bias = np.array([1.0, -1.0, 0.5, 0.0, 2.0], np.float32)
    params = {"params": {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}}
    out = np.asarray(models.GraphLinear(5).apply(params, jnp.asarray(x), None))
    np.testing.assert_allclose(out, x @ kernel + bias, rtol=1e-5, atol=1e-5)

  def test_predict(self, tight_and_padded):
    x, _, padded = tight_and_padded
    model = models.make_model("gcn", num_classes=K, hidden=HIDDEN)
    params = _init(model, padded.x, padded)
    pred = np.asarray(models.predict(model, params, jnp.asarray(padded.x), padded))
    logits = _apply(model, params, padded.x, padded, train=False)
    np.testing.assert_array_equal(pred, logits.argmax(-1))
    assert pred.shape == (40,)
