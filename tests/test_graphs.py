"""Tests of fedjax_graph.graphs: GCN weights, propagation, padding, buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import graphs
from fedjax_graph.types import Shard
from conftest import dense_norm_adj, random_graph

# A 3-node path 0 - 1 - 2 plus an isolated node 3, both directions of each edge.
PATH_EDGES = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])
PATH_N = 4
S6 = 1 / np.sqrt(6)
# D^-1/2 (A+I) D^-1/2 by hand: degrees (with self-loop) 2, 3, 2, 1.
PATH_DENSE = np.array([
    [1 / 2, S6, 0, 0],
    [S6, 1 / 3, S6, 0],
    [0, S6, 1 / 2, 0],
    [0, 0, 0, 1],
])



def _masks(n, num_train, num_val):
  rows = np.arange(n)
  return dict(train=rows < num_train, val=(rows >= num_train) & (rows < num_train + num_val),
              test=rows >= num_train + num_val)


def _pad_path(n_node=16, n_edge=10, num_domains=3, domain=1, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((PATH_N, 5)).astype(np.float32)
  y = np.array([2, 0, 1, 2])
  shard = graphs.pad_graph(x, y, PATH_EDGES, _masks(PATH_N, 2, 1), np.full(PATH_N, domain),
                           num_domains, n_node, n_edge)
  return x, y, shard



class TestGcnWeights:

  def test_hand_computed_path_with_isolated_node(self):
    edge_weight, self_weight = graphs.gcn_weights(PATH_EDGES, PATH_N)
    np.testing.assert_allclose(edge_weight, [S6, S6, S6, S6], rtol=1e-6)
    np.testing.assert_allclose(self_weight, [1 / 2, 1 / 3, 1 / 2, 1.0], rtol=1e-6)
    assert self_weight[3] == 1.0
    assert np.all(np.isfinite(edge_weight)) and np.all(np.isfinite(self_weight))
    assert edge_weight.dtype == np.float32 and self_weight.dtype == np.float32

  def test_all_isolated(self):
    edge_weight, self_weight = graphs.gcn_weights(np.zeros((2, 0), np.int64), 3)
    assert edge_weight.shape == (0,)
    np.testing.assert_array_equal(self_weight, [1.0, 1.0, 1.0])

  def test_matches_dense_normalisation(self):
    ei = random_graph(12, 20, seed=1)
    edge_weight, self_weight = graphs.gcn_weights(ei, 12)
    dense = dense_norm_adj(ei, 12)
    np.testing.assert_allclose(self_weight, np.diag(dense), rtol=1e-6)
    np.testing.assert_allclose(edge_weight, dense[ei[1], ei[0]], rtol=1e-6)


class TestPropagate:

  def test_shard_equals_dense_and_zero_on_padding(self):
    _, _, shard = _pad_path(n_node=16, n_edge=10)
    h = np.random.default_rng(3).standard_normal((16, 6)).astype(np.float32)  # padding rows too
    out = np.asarray(graphs.propagate(jnp.asarray(h), jax.tree.map(jnp.asarray, shard)))
    np.testing.assert_allclose(out[:PATH_N], PATH_DENSE @ h[:PATH_N], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[PATH_N:], 0.0)

  def test_shard_onrandom_graph(self):
    n = 13
    ei = random_graph(n, 25, seed=2)
    x = np.random.default_rng(4).standard_normal((n, 3)).astype(np.float32)
    shard = graphs.pad_graph(x, np.zeros(n), ei, _masks(n, 5, 3), np.zeros(n), 1, 24, 64)
    h = np.random.default_rng(5).standard_normal((24, 4)).astype(np.float32)
    out = np.asarray(graphs.propagate(jnp.asarray(h), shard))
    np.testing.assert_allclose(out[:n], dense_norm_adj(ei, n) @ h[:n], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[n:], 0.0)

  def test_csr_graph_path_equals_shard_path(self):
    n_node = 16
    _, _, shard = _pad_path(n_node=n_node, n_edge=10)
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, n_node)
    assert csr.indptr.shape == (n_node + 1,)
    # Padding rows of the CSR matrix are empty.
    np.testing.assert_array_equal(csr.indptr[PATH_N:], csr.indptr[PATH_N])
    h = jnp.asarray(np.random.default_rng(6).standard_normal((n_node, 7)).astype(np.float32))
    via_csr = np.asarray(graphs.propagate(h, csr))
    via_shard = np.asarray(graphs.propagate(h, shard))
    np.testing.assert_allclose(via_csr, via_shard, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(via_csr[:PATH_N], PATH_DENSE @ np.asarray(h)[:PATH_N], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(via_csr[PATH_N:], 0.0)

  def test_csr_rows_are_receivers(self):
    # On a symmetric graph A_hat = A_hat^T hides a sender/receiver swap; one-way edges do not.
    # Both containers document row = receiver, column = sender.
    edges = np.array([[0, 0, 2], [1, 2, 3]])
    n, n_node = 4, 8
    shard = graphs.pad_graph(np.zeros((n, 1)), np.zeros(n), edges, _masks(n, 1, 1), np.zeros(n),
                             1, n_node, 4)
    csr = graphs.csr_graph(edges, n, n_node)
    h = jnp.asarray(np.random.default_rng(13).standard_normal((n_node, 2)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(graphs.propagate(h, csr)),
                               np.asarray(graphs.propagate(h, shard)), rtol=1e-6, atol=1e-7)
    # Node 0 has no in-edge: it only keeps its own state (self weight 1/1).
    np.testing.assert_allclose(np.asarray(graphs.propagate(h, csr))[0], np.asarray(h)[0],
                               rtol=1e-6)

  def test_csr_vmap_over_h_equals_loop(self):
    n_rows = 16
    ei = random_graph(11, 18, seed=7)
    csr = graphs.csr_graph(ei, 11, n_rows)
    hs = jnp.asarray(np.random.default_rng(8).standard_normal((3, n_rows, 5)).astype(np.float32))
    batched = np.asarray(jax.vmap(graphs.propagate, in_axes=(0, None))(hs, csr))
    loop = np.stack([np.asarray(graphs.propagate(h, csr)) for h in hs])
    np.testing.assert_allclose(batched, loop, rtol=1e-6, atol=1e-7)
    dense = dense_norm_adj(ei, 11)
    for b in range(3):
      np.testing.assert_allclose(batched[b, :11], dense @ np.asarray(hs[b, :11]), rtol=1e-5,
                                 atol=1e-6)
    np.testing.assert_array_equal(batched[:, 11:], 0.0)

  def test_csr_vmap_puts_models_side_by_side(self):
    # The custom_vmap rule turns B products A @ h_b into one A @ [h_1 | ... | h_B].
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, 6)
    hs = jnp.ones((3, 6, 5), jnp.float32)
    jaxpr = str(jax.make_jaxpr(jax.vmap(graphs.propagate, in_axes=(0, None)))(hs, csr))
    assert jaxpr.count("bcsr_dot_general") == 1
    assert "f32[6,15]" in jaxpr

  def test_csr_vmap_under_jit(self):
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, 8)
    hs = jnp.asarray(np.random.default_rng(9).standard_normal((2, 8, 3)).astype(np.float32))
    out = np.asarray(jax.jit(jax.vmap(graphs.propagate, in_axes=(0, None)))(hs, csr))
    for b in range(2):
      np.testing.assert_allclose(out[b, :PATH_N], PATH_DENSE @ np.asarray(hs[b, :PATH_N]),
                                 rtol=1e-5, atol=1e-6)

  def test_csr_nested_vmap_equals_loop(self):
    n_rows = 8
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, n_rows)
    hs = jnp.asarray(np.random.default_rng(10).standard_normal((2, 3, n_rows, 4))
                     .astype(np.float32))
    inner = jax.vmap(graphs.propagate, in_axes=(0, None))
    batched = np.asarray(jax.vmap(inner, in_axes=(0, None))(hs, csr))
    loop = np.stack([np.stack([np.asarray(graphs.propagate(hs[i, j], csr)) for j in range(3)])
                     for i in range(2)])
    np.testing.assert_allclose(batched, loop, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(batched[1, 2, :PATH_N], PATH_DENSE @ np.asarray(hs[1, 2, :PATH_N]),
                               rtol=1e-5, atol=1e-6)

  def test_csr_vmap_with_unbatched_h(self):
    # vmap over something else: h and the graph are both unbatched in the rule.
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, 8)
    h = jnp.asarray(np.random.default_rng(11).standard_normal((8, 3)).astype(np.float32))
    scales = jnp.array([1.0, 2.0, -1.0])
    out = np.asarray(jax.vmap(lambda a: graphs.propagate(h, csr) * a)(scales))
    ref = np.asarray(graphs.propagate(h, csr))
    for i, a in enumerate([1.0, 2.0, -1.0]):
      np.testing.assert_allclose(out[i], ref * a, rtol=1e-6)

  def test_csr_vmap_over_batched_graph(self):
    csr = graphs.csr_graph(PATH_EDGES, PATH_N, 8)
    batched_graph = graphs.CSRGraph(*[np.stack([leaf, leaf]) for leaf in csr])
    hs = jnp.asarray(np.random.default_rng(12).standard_normal((2, 8, 3)).astype(np.float32))
    out = np.asarray(jax.vmap(graphs.propagate, in_axes=(0, 0))(hs, batched_graph))
    graph_only = np.asarray(jax.vmap(graphs.propagate, in_axes=(None, 0))(hs[0], batched_graph))
    for b in range(2):
      np.testing.assert_allclose(out[b], np.asarray(graphs.propagate(hs[b], csr)), rtol=1e-6)
      np.testing.assert_allclose(graph_only[b], np.asarray(graphs.propagate(hs[0], csr)),
                                 rtol=1e-6)


class TestPaddingBudget:

  @pytest.mark.parametrize("n,multiple,expected", [
      (0, 8, 8), (1, 8, 8), (7, 8, 8), (8, 8, 16), (9, 8, 16), (15, 8, 16), (16, 8, 24),
      (5, 4, 8), (3, 1, 4), (100, 32, 128), (128, 32, 160),
  ])
  def test_values(self, n, multiple, expected):
    assert graphs.padding_budget(n, multiple) == expected

  def test_default_multiple_is_8(self):
    assert graphs.padding_budget(8) == 16
    assert graphs.padding_budget(10) == 16


class TestPadGraph:

  def test_real_rows_intact_and_padding_rows_masked(self):
    x, y, shard = _pad_path(n_node=16, n_edge=10, num_domains=3, domain=1)
    assert isinstance(shard, Shard)
    assert shard.x.shape == (16, 5) and shard.senders.shape == (10,)
    np.testing.assert_array_equal(shard.x[:PATH_N], x)
    np.testing.assert_array_equal(shard.x[PATH_N:], 0.0)
    np.testing.assert_array_equal(shard.y[:PATH_N], y)
    np.testing.assert_array_equal(shard.y[PATH_N:], 0)
    np.testing.assert_array_equal(shard.train[:PATH_N], [True, True, False, False])
    np.testing.assert_array_equal(shard.val[:PATH_N], [False, False, True, False])
    np.testing.assert_array_equal(shard.test[:PATH_N], [False, False, False, True])
    for mask in (shard.train, shard.val, shard.test):
      assert mask.dtype == bool
      assert not mask[PATH_N:].any()
    np.testing.assert_array_equal(shard.node_domain, [1] * PATH_N + [3] * (16 - PATH_N))
    # Edges: the real ones first, with their GCN weights.
    np.testing.assert_array_equal(shard.senders[:4], PATH_EDGES[0])
    np.testing.assert_array_equal(shard.receivers[:4], PATH_EDGES[1])
    np.testing.assert_allclose(shard.edge_weight[:4], [S6] * 4, rtol=1e-6)
    np.testing.assert_allclose(shard.self_weight[:PATH_N], [1 / 2, 1 / 3, 1 / 2, 1.0], rtol=1e-6)
    # Padding: zero weights, edges between padding nodes only.
    np.testing.assert_array_equal(shard.edge_weight[4:], 0.0)
    np.testing.assert_array_equal(shard.self_weight[PATH_N:], 0.0)
    assert np.all(shard.senders[4:] >= PATH_N) and np.all(shard.receivers[4:] >= PATH_N)
    assert np.all(shard.senders < 16) and np.all(shard.receivers < 16)
    assert shard.y.dtype == np.int32 and shard.node_domain.dtype == np.int32

  def test_exact_budget(self):
    # n + 1 nodes and exactly E edges is the smallest padding jraph accepts.
    x, _, shard = _pad_path(n_node=PATH_N + 1, n_edge=4)
    assert shard.x.shape[0] == PATH_N + 1 and shard.senders.shape == (4,)
    np.testing.assert_array_equal(shard.node_domain[PATH_N], 3)

  @pytest.mark.parametrize("n_node,n_edge", [(PATH_N, 8), (8, 3)])
  def test_too_small_budget_raises(self, n_node, n_edge):
    with pytest.raises(RuntimeError):
      _pad_path(n_node=n_node, n_edge=n_edge)

  def test_stack(self):
    _, _, a = _pad_path(seed=0)
    _, _, b = _pad_path(seed=1)
    stacked = graphs.stack([a, b])
    assert stacked.x.shape == (2, 16, 5)
    np.testing.assert_array_equal(stacked.x[1], b.x)
    np.testing.assert_array_equal(stacked.node_domain[0], a.node_domain)


def _padded_total(sizes, buckets):
  return sum(len(b) * max(sizes[i] for i in b) for b in buckets)


TWITCH_S3_SIZES = [475] * 20 + [3563, 3563, 2324, 2324, 3276, 3276, 956, 956, 2193, 2193]


class TestSizeBuckets:

  def test_equal_sizes_one_bucket(self):
    assert graphs.size_buckets([50] * 7, max_buckets=3) == [list(range(7))]

  def test_twitch_s3_three_buckets(self):
    sizes = TWITCH_S3_SIZES
    buckets = graphs.size_buckets(sizes, max_buckets=3)
    # Hand-computed optimum: 20 x 475 | 956, 956, 2193, 2193, 2324, 2324 | 3276 x 2, 3563 x 2,
    # padded total 9500 + 6 * 2324 + 4 * 3563 = 37696 (one bucket: 30 * 3563 = 106890).
    assert buckets == [list(range(20)), [26, 27, 28, 29, 22, 23], [24, 25, 20, 21]]
    assert _padded_total(sizes, buckets) == 37696
    assert _padded_total(sizes, buckets) < _padded_total(sizes, [list(range(30))]) == 106890
    assert sorted(i for b in buckets for i in b) == list(range(30))

  def test_twitch_s3_two_buckets(self):
    buckets = graphs.size_buckets(TWITCH_S3_SIZES, max_buckets=2)
    assert buckets == [list(range(20)), [26, 27, 28, 29, 22, 23, 24, 25, 20, 21]]
    assert _padded_total(TWITCH_S3_SIZES, buckets) == 9500 + 10 * 3563

  def test_max_buckets_one(self):
    buckets = graphs.size_buckets(TWITCH_S3_SIZES, max_buckets=1)
    assert len(buckets) == 1
    assert sorted(buckets[0]) == list(range(30))

  def test_every_client_once_and_smallest_first(self):
    sizes = [30, 5, 200, 7, 31, 190, 6]
    buckets = graphs.size_buckets(sizes, max_buckets=3)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(sizes)))
    maxes = [max(sizes[i] for i in b) for b in buckets]
    assert maxes == sorted(maxes)
    assert buckets == [[1, 6, 3], [0, 4], [5, 2]]

  def test_min_saving(self):
    # Two buckets would save 1 of 22 (< 10 %): keep one.
    assert graphs.size_buckets([10, 11], max_buckets=2) == [[0, 1]]
    # 101 of 200 saves ~50 %: split, smallest first.
    assert graphs.size_buckets([100, 1], max_buckets=2) == [[1], [0]]
    assert graphs.size_buckets([100, 1], max_buckets=2, min_saving=0.6) == [[1, 0]]

  def test_more_buckets_than_clients(self):
    assert graphs.size_buckets([3, 300], max_buckets=5) == [[0], [1]]
    assert graphs.size_buckets([9], max_buckets=3) == [[0]]

  @pytest.mark.parametrize("max_buckets", [0, -1])
  def test_bad_max_buckets(self, max_buckets):
    with pytest.raises(ValueError, match="max_buckets"):
      graphs.size_buckets([1, 2, 3], max_buckets=max_buckets)

  def test_no_clients(self):
    with pytest.raises(ValueError):
      graphs.size_buckets([], max_buckets=2)


@pytest.mark.parametrize("num_edges", [5, graphs.EDGE_BLOCK + 3])  # one block, a partial second
def test_edge_dot_equals_the_gathered_rows_product_and_its_gradient(num_edges):
  rng = np.random.default_rng(0)
  n, h = 11, 4
  a, b = (jnp.asarray(rng.standard_normal((2, n, h)), jnp.float32) for _ in range(2))
  senders, receivers = (jnp.asarray(rng.integers(0, n, num_edges), jnp.int32) for _ in range(2))
  weights = jnp.asarray(rng.standard_normal(num_edges), jnp.float32)
  gathered = lambda a, b: jnp.sum(a[senders] * b[receivers], axis=-1)
  blocked = lambda a, b: graphs.edge_dot(a, b, senders, receivers)
  # A non-linear loss, so the cotangent differs edge by edge; two models side by side (vmap).
  loss = lambda dot: jax.vmap(jax.value_and_grad(
      lambda a, b: jnp.sum(jnp.sin(dot(a, b)) * weights), argnums=(0, 1)))
  (value, grads), (expected, expected_grads) = loss(blocked)(a, b), loss(gathered)(a, b)
  np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(expected_grads[0]))) > 0.1
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), grads,
               expected_grads)
