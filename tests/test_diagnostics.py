"""Tests of fedjax_graph.diagnostics: hand-computed numbers and jit/vmap use."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import diagnostics as dg

# The 3-client, 5-coordinate example of the dilution tests (two leaves: the
# first 3 coordinates and the last 2). With top=0.4, k = round(2.0) = 2:
#   S_0 = {0, 2}, S_1 = {0, 1}, S_2 = {0, 3}; coordinate 4 is nobody's.
U3 = np.array([[2.0, 0.0, 1.0, 0.0, 0.1],
               [4.0, 1.0, 0.0, 0.0, -0.1],
               [-2.0, 0.5, 0.0, 3.0, 0.2]], np.float32)
W3 = np.array([1.0, 1.0, 2.0], np.float32)  # q = [1/4, 1/4, 1/2].
MASK3 = np.array([[1, 0, 1, 0, 0],
                  [1, 1, 0, 0, 0],
                  [1, 0, 0, 1, 0]], bool)


def _tree3():
  return {"a": jnp.asarray(U3[:, :3]), "b": jnp.asarray(U3[:, 3:])}


def _random_updates(seed, num_clients=4):
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return {"dense": {"kernel": normal(num_clients, 6, 5),
                    "bias": normal(num_clients, 5)},
          "out": normal(num_clients, 7)}


# ----------------------------------------------------------------------------
# Flattening and salient sets.
# ----------------------------------------------------------------------------


def test_flatten_and_leaf_sizes():
  tree = _random_updates(0, 3)
  flat = dg.flatten_clients(tree)
  assert flat.shape == (3, 30 + 5 + 7) and flat.dtype == jnp.float32
  # Leaves in jax.tree.leaves order: dense/bias, dense/kernel, out.
  assert dg.leaf_sizes(tree) == (5, 30, 7)
  np.testing.assert_array_equal(flat[:, :5], tree["dense"]["bias"])
  np.testing.assert_array_equal(flat[:, 5:35],
                                tree["dense"]["kernel"].reshape(3, 30))
  with pytest.raises(ValueError):
    dg.flatten_clients({"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))})


def test_salient_mask_keeps_exactly_k_largest_magnitudes():
  x = jnp.array([[0.1, -5.0, 3.0, 0.2, -0.3, 4.0],
                 [1.0, 1.0, -1.0, 0.0, 2.0, 0.5]])
  mask = dg.salient_mask(x, 0.5)  # k = round(3.0) = 3.
  np.testing.assert_array_equal(
      mask, [[0, 1, 1, 0, 0, 1],
             [1, 1, 0, 0, 1, 0]])  # Ties among |1| go to lower indices.
  np.testing.assert_array_equal(dg.salient_mask(U3, 0.4), MASK3)
  # k = max(1, round(top * P)): at least one coordinate.
  assert int(dg.salient_mask(x, 0.01).sum(axis=1)[0]) == 1
  rng = np.random.default_rng(1)
  big = rng.standard_normal((3, 1000)).astype(np.float32)
  mask = np.asarray(dg.salient_mask(big, 0.05))
  assert (mask.sum(axis=1) == 50).all()
  for row, m in zip(np.abs(big), mask):
    assert row[m].min() > row[~m].max()
  with pytest.raises(ValueError):
    dg.salient_mask(x, 0.0)
  with pytest.raises(TypeError):
    dg.salient_mask(x, jnp.float32(0.5))


# ----------------------------------------------------------------------------
# Jaccard overlap (eq. 2).
# ----------------------------------------------------------------------------


def test_jaccard_identical_disjoint_and_partial():
  masks = jnp.array([[1, 1, 1, 0, 0, 0],   # {0, 1, 2}
                     [0, 1, 1, 1, 0, 0],   # {1, 2, 3}
                     [1, 1, 1, 0, 0, 0],   # {0, 1, 2} again
                     [0, 0, 0, 0, 1, 1],   # {4, 5}
                     [0, 0, 0, 0, 0, 0]], bool)  # empty
  j = np.asarray(dg.jaccard(masks))
  np.testing.assert_allclose(np.diag(j), 1.0)
  assert j[0, 2] == 1.0  # Identical sets.
  assert j[0, 3] == 0.0 and j[1, 3] == 0.0  # Disjoint sets.
  np.testing.assert_allclose(j[0, 1], 2 / 4)  # |{1,2}| / |{0,1,2,3}|.
  np.testing.assert_allclose(j[1, 3], 0.0)
  assert j[3, 4] == 0.0 and np.isfinite(j).all()  # 0/0 -> 0 off the diagonal.
  np.testing.assert_array_equal(j, j.T)


def test_random_top_sets_overlap_matches_reference():
  top = 0.05
  assert dg.random_overlap_reference(top) == pytest.approx(0.05 / 1.95)
  rng = np.random.default_rng(2024)
  flat = jnp.asarray(rng.standard_normal((2, 200_000)), jnp.float32)
  j = dg.jaccard(dg.salient_mask(flat, top))
  summary = dg.pair_summary(np.asarray(j), [0, 1])
  assert abs(summary["mean_offdiag"] - 0.05 / 1.95) < 0.003


# ----------------------------------------------------------------------------
# Cosines (Figs. 3-4).
# ----------------------------------------------------------------------------


def test_cosine_matrix_hand_computed():
  flat = jnp.array([[1.0, 0.0], [1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]])
  cos = np.asarray(dg.cosine_matrix(flat))
  s = 1 / math.sqrt(2)
  expected = np.array([[1, s, -1, 0],
                       [s, 1, -s, 0],
                       [-1, -s, 1, 0],
                       [0, 0, 0, 0]])
  np.testing.assert_allclose(cos, expected, atol=1e-6)
  # Large values do not overflow the norm.
  np.testing.assert_allclose(dg.cosine_matrix(flat * 1e30), expected, atol=1e-6)


def test_cosine_to_reference():
  flat = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0], [0.0, 0.0]])
  s = 1 / math.sqrt(2)
  np.testing.assert_allclose(dg.cosine_to(flat, jnp.array([0.0, 3.0])),
                             [0.0, s, -1.0, 0.0], atol=1e-6)
  np.testing.assert_array_equal(dg.cosine_to(flat, jnp.zeros(2)), np.zeros(4))


# ----------------------------------------------------------------------------
# Signal dilution (eqs. 3-4) on the 3-client example.
# ----------------------------------------------------------------------------
#
# q = [1/4, 1/4, 1/2]. Per coordinate d (A_d the clients with d salient):
#   d  A_d      r_d   mu_act,d                   u_bar_d            ratio
#   0  {0,1,2}  1     (2/4 + 4/4 - 2/2)/1 = 0.5  0.5                1
#   1  {1}      1/4   (1/4)/(1/4) = 1            1/4 + 0.5/2 = 0.5  0.5
#   2  {0}      1/4   (1/4)/(1/4) = 1            1/4                0.25
#   3  {2}      1/2   (3/2)/(1/2) = 3            3/2                0.5
#   4  {}       0     0 (no active client)       0.1 (see below)    0, excluded
# (u_bar_4 = 0.1/4 - 0.1/4 + 0.2/2 = 0.1 is unused: mu_act,4 = 0.)
R3 = [1.0, 0.25, 0.25, 0.5, 0.0]
MU3 = [0.5, 1.0, 1.0, 3.0, 0.0]
RATIO3 = [1.0, 0.5, 0.25, 0.5, 0.0]


def test_active_share_active_mean_and_dilution_ratio_by_hand():
  np.testing.assert_allclose(dg.active_share(MASK3, W3), R3, atol=1e-7)
  np.testing.assert_allclose(dg.active_mean(U3, MASK3, W3), MU3, atol=1e-6)
  np.testing.assert_allclose(dg.dilution_ratio(U3, MASK3, W3), RATIO3,
                             atol=1e-6)
  # Weights that sum to 0: everything 0, nothing NaN.
  zero = np.zeros(3, np.float32)
  assert not np.asarray(dg.active_share(MASK3, zero)).any()
  assert not np.asarray(dg.dilution_ratio(U3, MASK3, zero)).any()


def test_zero_weight_client_with_nan_does_not_leak():
  u = U3.copy()
  u[1] = np.nan
  w = np.array([1.0, 0.0, 2.0], np.float32)  # Client 1 absent.
  for out in (dg.active_share(MASK3, w), dg.active_mean(u, MASK3, w),
              dg.dilution_ratio(u, MASK3, w)):
    assert np.isfinite(np.asarray(out)).all()
  diag = dg.round_diagnostics({"w": jnp.asarray(u)}, w, 0.4)
  assert np.isfinite(np.asarray(diag.cos_to_aggregate)[[0, 2]]).all()
  assert np.isfinite(np.asarray(diag.dilution_hist)).all()


def test_layer_histograms_by_hand():
  # r = [1, .25, .25 | .5, 0] with edges 0, .1, ..., 1:
  # leaf 0 -> bins 9, 2, 2; leaf 1 -> bins 5, 0.
  hist = np.asarray(dg.layer_histograms(jnp.asarray(R3), (3, 2),
                                        dg.ACTIVE_SHARE_EDGES))
  expected = np.zeros((2, 10))
  expected[0, [9, 2]] = [1, 2]
  expected[1, [5, 0]] = [1, 1]
  np.testing.assert_array_equal(hist, expected)
  # Out-of-range values are clipped into the end bins; NaN and invalid
  # coordinates are not counted; an edge value goes to the bin above it.
  values = jnp.array([-5.0, 0.0, 0.5, 1.0, 7.0, jnp.nan, 0.2])
  valid = jnp.array([True, True, True, True, True, True, False])
  hist = np.asarray(dg.layer_histograms(values, (7,), [0.0, 0.5, 1.0], valid))
  np.testing.assert_array_equal(hist, [[2, 3]])
  # A value one ulp below an interior edge counts as the edge value would.
  below = np.nextafter(np.float32(0.3), np.float32(0))
  hist = dg.layer_histograms(jnp.array([below]), (1,), dg.ACTIVE_SHARE_EDGES)
  assert int(np.argmax(hist[0])) == 3
  with pytest.raises(ValueError):
    dg.layer_histograms(values, (3,), [0.0, 1.0])


def test_retention_by_hand():
  masks = jnp.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]],
                    bool)
  agg = jnp.array([1, 0, 1, 0], bool)
  np.testing.assert_allclose(dg.retention(masks, agg), [0.5, 0.5, 1.0, 0.0])


# ----------------------------------------------------------------------------
# round_diagnostics.
# ----------------------------------------------------------------------------


def _reference_round(tree, weights, top):
  """round_diagnostics composed from the public primitives."""
  flat = dg.flatten_clients(tree)
  masks = dg.salient_mask(flat, top)
  q = weights / jnp.sum(weights)
  u_bar = jnp.sum(q[:, None] * flat, axis=0)
  mu = dg.active_mean(flat, masks, weights)
  sizes = dg.leaf_sizes(tree)
  return dg.RoundDiagnostics(
      jaccard=dg.jaccard(masks), cosine=dg.cosine_matrix(flat),
      cos_to_aggregate=dg.cosine_to(flat, u_bar),
      retention=dg.retention(masks, dg.salient_mask(u_bar[None], top)[0]),
      active_share_hist=dg.layer_histograms(
          dg.active_share(masks, weights), sizes, dg.ACTIVE_SHARE_EDGES),
      dilution_hist=dg.layer_histograms(
          dg.dilution_ratio(flat, masks, weights), sizes, dg.DILUTION_EDGES,
          valid=mu != 0))


def _assert_diag_close(a, b):
  for name, x, y in zip(dg.RoundDiagnostics._fields, a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5,
                               err_msg=name)


def test_round_diagnostics_hand_example():
  diag = dg.round_diagnostics(_tree3(), W3, 0.4)
  assert diag.active_share_hist.shape == (2, 10)
  assert diag.dilution_hist.shape == (2, 12)
  expected = np.zeros((2, 10))
  expected[0, [9, 2]] = [1, 2]
  expected[1, [5, 0]] = [1, 1]
  np.testing.assert_array_equal(diag.active_share_hist, expected)
  # Ratios [1, .5, .25 | .5, (excluded)] on 12 bins of width .25 from -1:
  # bins 8, 6, 5 | 6.
  expected = np.zeros((2, 12))
  expected[0, [8, 6, 5]] = 1
  expected[1, 6] = 1
  np.testing.assert_array_equal(diag.dilution_hist, expected)
  np.testing.assert_allclose(diag.jaccard, dg.jaccard(MASK3))
  _assert_diag_close(diag, _reference_round(_tree3(), W3, 0.4))


def test_round_diagnostics_jit_vmap_and_cond():
  trees = [_random_updates(s) for s in (3, 4)]
  weights = jnp.array([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 1.0, 0.5]])
  top = 0.1
  fn = jax.jit(lambda t, w: dg.round_diagnostics(t, w, top))
  single = [fn(t, w) for t, w in zip(trees, weights)]

  # As in a sweep: vmapped over runs, behind an unbatched round-level switch
  # (so the cond stays a real cond), the flag traced so one compile serves.
  def maybe(flag, t, w):
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, t, w))
    return jax.lax.cond(flag, lambda: fn(t, w), lambda: zeros)

  batched = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  run = jax.jit(jax.vmap(maybe, in_axes=(None, 0, 0)))
  out = run(True, batched, weights)
  for b in range(2):
    _assert_diag_close(jax.tree.map(lambda x, b=b: x[b], out), single[b])
  off = run(False, batched, weights)
  assert not any(np.asarray(x).any() for x in off)


# ----------------------------------------------------------------------------
# Host-side summaries.
# ----------------------------------------------------------------------------

COS4 = np.array([[1.0, 0.5, -0.2, 0.1],
                 [0.5, 1.0, 0.3, -0.4],
                 [-0.2, 0.3, 1.0, 0.8],
                 [0.1, -0.4, 0.8, 1.0]])
DOMAIN4 = np.array([0, 0, 1, 1])


def test_pair_summary_and_frac_negative_by_hand():
  s = dg.pair_summary(COS4, DOMAIN4)
  # Pairs: 01 .5, 02 -.2, 03 .1, 12 .3, 13 -.4, 23 .8.
  assert s["mean_offdiag"] == pytest.approx(1.1 / 6)
  assert s["mean_within_domain"] == pytest.approx((0.5 + 0.8) / 2)
  assert s["mean_cross_domain"] == pytest.approx((-0.2 + 0.1 + 0.3 - 0.4) / 4)
  assert s["frac_negative_cross_domain"] == pytest.approx(0.5)
  assert dg.frac_negative_cross_domain(COS4, DOMAIN4) == pytest.approx(0.5)
  np.testing.assert_allclose(dg.cross_domain_abs_cosine(COS4, DOMAIN4),
                             [0.2, 0.1, 0.3, 0.4])
  # No cross-domain pair: NaN. Leading axes are kept.
  one = dg.pair_summary(COS4, [0, 0, 0, 0])
  assert math.isnan(one["mean_cross_domain"])
  assert math.isnan(one["frac_negative_cross_domain"])
  stacked = dg.pair_summary(np.stack([COS4, -COS4]), DOMAIN4)
  np.testing.assert_allclose(stacked["mean_within_domain"], [0.65, -0.65])
  np.testing.assert_allclose(stacked["frac_negative_cross_domain"], [0.5, 0.5])


def test_edge_homophily_by_hand():
  # Undirected edges 0-1 (same), 1-2 (diff), 2-3 (same), 0-2 (diff): h = 2/4.
  # Both directions, a repeated edge and a self-loop count as listed above.
  edges = np.array([[0, 1, 1, 2, 2, 3, 0, 2, 0, 3],
                    [1, 0, 2, 1, 3, 2, 2, 0, 1, 3]])
  assert dg.edge_homophily(edges, np.array([0, 0, 1, 1])) == pytest.approx(0.5)
  assert dg.edge_homophily(edges, np.zeros(4, int)) == pytest.approx(1.0)


def test_js_divergence_known_values():
  assert dg.js_divergence([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]) == pytest.approx(
      0.0, abs=1e-12)
  assert dg.js_divergence([0.5, 0.5, 0, 0], [0, 0, 0.3, 0.7]) == pytest.approx(
      1.0)
  # m = [.75, .25]: H(m) - (H(p) + H(q))/2 = 0.811278... - 0.5.
  h_m = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
  assert dg.js_divergence([1, 1], [1, 0]) == pytest.approx(h_m - 0.5)


def _domain(x, y, edges):
  return dict(x=np.asarray(x, np.float32), y=np.asarray(y, np.int32),
              edge_index=np.asarray(edges, np.int32))


def test_domain_factors_by_hand():
  path = [[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]]  # Path 0-1-2-3.
  star = [[0, 0, 0, 1, 2, 3], [1, 2, 3, 0, 0, 0]]  # Star around 0.
  graphs = {
      "a": _domain(np.zeros((4, 2)), [0, 0, 1, 1], path),  # h = 2/3
      "b": _domain(np.ones((4, 2)), [0, 1, 1, 1], path),   # h = 2/3
      "c": _domain([[3, 4]] * 4, [2, 2, 2, 2], star),      # h = 1
  }
  f = dg.domain_factors(graphs, num_bins=4)
  assert set(f) == {"homophily_gap", "feature_distance", "label_js",
                    "degree_distance"}
  for m in f.values():
    assert m.shape == (3, 3)
    np.testing.assert_allclose(m, m.T)
    np.testing.assert_allclose(np.diag(m), 0.0)
  np.testing.assert_allclose(f["homophily_gap"][0], [0, 0, 1 / 3])
  np.testing.assert_allclose(f["feature_distance"][0],
                             [0, math.sqrt(2), 5.0])
  np.testing.assert_allclose(f["label_js"][0, 2], 1.0)  # Disjoint labels.
  # p = [.5, .5, 0], q = [.25, .75, 0]: m = [.375, .625] on the support.
  m = np.array([0.375, 0.625])
  h = lambda v: -np.sum(v * np.log2(v))
  expected = h(m) - (h(np.array([0.5, 0.5])) + h(np.array([0.25, 0.75]))) / 2
  np.testing.assert_allclose(f["label_js"][0, 1], expected)
  assert f["degree_distance"][0, 1] == 0.0  # Same degree sequence.
  assert f["degree_distance"][0, 2] > 0.0


def test_factor_association_spearman():
  factors = {
      # Client mean discrepancy to the other present domains:
      # domain 0: (1 + 2)/2 = 1.5, domain 1: (1 + 4)/2 = 2.5, 2: (2 + 4)/2 = 3.
      "grows": np.array([[0, 1, 2], [1, 0, 4], [2, 4, 0]], float),
      "flat": np.ones((3, 3)) - np.eye(3),
  }
  client_domain = np.array([0, 0, 1, 1, 2, 2])
  np.testing.assert_allclose(
      dg.client_discrepancy(factors["grows"], client_domain),
      [1.5, 1.5, 2.5, 2.5, 3, 3])
  retention = np.array([0.9, 0.9, 0.5, 0.5, 0.2, 0.2])
  out = dg.factor_association(factors, retention, client_domain)
  assert out["grows"] == pytest.approx(-1.0)
  assert math.isnan(out["flat"])  # Constant discrepancy.
  # [R, C] retention is averaged per client first.
  runs = np.stack([retention, retention + 0.05])
  assert dg.factor_association(factors, runs, client_domain)["grows"] == (
      pytest.approx(-1.0))
  # A domain with no client does not enter the others' means.
  np.testing.assert_allclose(
      dg.client_discrepancy(factors["grows"], np.array([0, 1])), [1.0, 1.0])
