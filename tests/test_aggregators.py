"""Tests of fedjax_graph.aggregators: hand-computed numbers and equivalences."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aggregator_testing import random_updates, tree_allclose, tree_equal
from fedjax_graph import aggregators as agg


def _masked_weighted_sum(updates, mask, coeff):
  """Reference sum_k coeff_k (u_k * M) in float64 numpy."""
  coeff = np.asarray(coeff, np.float64)
  return jax.tree.map(
      lambda u, m: np.einsum(
          "c,c...->...", coeff, np.asarray(u, np.float64) * np.asarray(m, np.float64)
      ),
      updates,
      mask,
  )


# ----------------------------------------------------------------------------
# fedavg.
# ----------------------------------------------------------------------------


def test_fedavg_weighted_by_counts_hand_computed():
  u = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}
  counts = jnp.array([1.0, 2.0, 3.0])
  # (1*[1,2] + 2*[3,4] + 3*[5,6]) / 6 = [22, 28] / 6.
  np.testing.assert_allclose(agg.fedavg(u, counts)["w"], [22 / 6, 28 / 6], rtol=1e-6)
  # Client 1 absent: (1*[1,2] + 3*[5,6]) / 4 = [4, 5].
  part = jnp.array([True, False, True])
  np.testing.assert_allclose(agg.fedavg(u, counts, part)["w"], [4.0, 5.0], rtol=1e-6)


def test_fedavg_zero_weights_and_nan_padding_give_no_nan():
  u = {"w": jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf], [5.0, 6.0]])}
  part = jnp.array([True, False, True])
  # Absent client's NaN/inf row is never read.
  out = agg.fedavg(u, jnp.array([1.0, 1.0, 1.0]), part)["w"]
  np.testing.assert_allclose(out, [3.0, 4.0], rtol=1e-6)
  # All participants' weights zero -> zeros, not NaN.
  out = agg.fedavg(u, jnp.array([0.0, 5.0, 0.0]), part)["w"]
  np.testing.assert_array_equal(out, [0.0, 0.0])
  out = agg.fedavg(u, jnp.zeros(3), part)["w"]
  np.testing.assert_array_equal(out, [0.0, 0.0])
  # Nobody participates -> zeros.
  out = agg.fedavg(u, jnp.ones(3), jnp.zeros(3, bool))["w"]
  np.testing.assert_array_equal(out, [0.0, 0.0])


def test_fedavg_aggregator_matches_fedavg_and_fedia_without_switches():
  u = random_updates(0, 4)
  counts = jnp.array([10.0, 20.0, 30.0, 40.0])
  part = jnp.array([True, True, False, True])
  fa = agg.fedavg_aggregator()
  assert dict(fa.hparams) == {}
  state = fa.init(4)
  out, new_state, diag = fa.update(u, state, weights=counts, participating=part)
  tree_equal(out, agg.fedavg(u, counts, part))
  assert new_state == state == ()
  assert isinstance(diag, agg.Diagnostics)
  np.testing.assert_allclose(diag.weights, [10 / 70, 20 / 70, 0.0, 40 / 70], rtol=1e-6)
  assert float(diag.mask_coverage) == 1.0 and not np.any(diag.excluded)
  plain = agg.fedia(use_mask=False, use_momentum=False)
  assert dict(plain.hparams) == {}
  out2, _, diag2 = plain.update(u, plain.init(4), weights=counts, participating=part)
  tree_equal(out, out2)
  np.testing.assert_array_equal(diag2.weights, diag.weights)
  np.testing.assert_array_equal(diag2.alpha, diag.weights)


# ----------------------------------------------------------------------------
# importance_mask (eq. 5).
# ----------------------------------------------------------------------------


def test_importance_mask_ties_go_to_lower_flat_index():
  # Mean |u| over the two clients: [[1, 2, 2], [2, 0, 2]] -> flat
  # [1, 2, 2, 2, 0, 2]; four coordinates tie at 2 (flat 1, 2, 3, 5).
  u = {"w": jnp.array([[[1.0, 3.0, 2.0], [3.0, 0.0, 1.0]],
                       [[-1.0, -1.0, 2.0], [-1.0, 0.0, -3.0]]])}
  def mask(rho):
    return np.asarray(agg.importance_mask(u, rho)["w"])
  # rho=0.5 -> k=3: flat 1, 2, 3 (flat 5 loses the tie).
  np.testing.assert_array_equal(mask(0.5), [[0, 1, 1], [1, 0, 0]])
  # rho=0.25 -> k=round(1.5)=2: flat 1, 2.
  np.testing.assert_array_equal(mask(0.25), [[0, 1, 1], [0, 0, 0]])
  # rho=0.75 -> k=round(4.5)=4 (half to even): all four tied 2s.
  np.testing.assert_array_equal(mask(0.75), [[0, 1, 1], [1, 0, 1]])
  # rho=0.9 -> k=round(5.4)=5: adds the 1 at flat 0; the 0 at flat 4 is out.
  np.testing.assert_array_equal(mask(0.9), [[1, 1, 1], [1, 0, 1]])


@pytest.mark.parametrize(
    "rho, k",
    [(0.5, 2), (0.3, 2), (0.7, 4), (0.01, 1), (0.1, 1), (0.2, 1), (0.6, 3), (1.0, 5), (1, 5)],
)
def test_importance_mask_rounding_of_k(rho, k):
  # n=5, importance strictly increasing with index, so the top k are the last k.
  # round is half-to-even: 0.5*5=2.5 -> 2, 0.3*5=1.5 -> 2, 0.7*5=3.5 -> 4,
  # 0.1*5=0.5 -> 0 -> clipped to 1.
  u = {"w": jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0], [-1.0, -2.0, -3.0, -4.0, -5.0]])}
  expected = np.zeros(5, np.float32)
  expected[5 - k:] = 1.0
  np.testing.assert_array_equal(agg.importance_mask(u, rho)["w"], expected)
  # The same k under jit with a traced rho.
  m = jax.jit(agg.importance_mask)(u, jnp.float32(rho))
  np.testing.assert_array_equal(m["w"], expected)


def test_importance_mask_budget_is_per_leaf():
  u = {
      "a": jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0]] * 2),  # n=5
      "b": jnp.array([[100.0, 200.0]] * 2),  # n=2, much larger values
      "c": jnp.array([0.0, 0.0]),  # scalar parameter, n=1
  }
  m = agg.importance_mask(u, 0.5)
  # A single top-k over all 8 coordinates would keep b entirely and a not
  # at all; per leaf, a keeps round(2.5)=2, b keeps round(1.0)=1, c keeps 1.
  np.testing.assert_array_equal(m["a"], [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(m["b"], [0, 1])
  np.testing.assert_array_equal(m["c"], 1.0)
  assert m["c"].shape == ()
  # Masks are shaped like one client's leaves and carry the leaf's dtype.
  u16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), u)
  for leaf, leaf_mask in zip(jax.tree.leaves(u16), jax.tree.leaves(agg.importance_mask(u16, 0.5))):
    assert leaf_mask.shape == leaf.shape[1:]
    assert leaf_mask.dtype == jnp.bfloat16


def test_importance_mask_excludes_non_participants():
  # Client 2 (absent) is huge on coordinate 0 and NaN on coordinate 1; the
  # participants are largest on coordinate 3.
  u = {"w": jnp.array([[0.0, 1.0, 0.0, 5.0],
                       [1.0, 0.0, 0.0, 3.0],
                       [1e6, jnp.nan, 0.0, 0.0]])}
  part = jnp.array([True, True, False])
  np.testing.assert_array_equal(agg.importance_mask(u, 0.25, part)["w"], [0, 0, 0, 1])
  # With everyone in (and no NaN), coordinate 0 wins.
  u_all = {"w": u["w"].at[2, 1].set(0.0)}
  np.testing.assert_array_equal(agg.importance_mask(u_all, 0.25)["w"], [1, 0, 0, 0])


# ----------------------------------------------------------------------------
# contribution_weights (eqs. 6-7).
# ----------------------------------------------------------------------------


def _three_client_example():
  # Mask keeps the first two coordinates; masked norms are s = [5, 1, 0]
  # (|(3, 4)| = 5, |(0, 1)| = 1, |(0, 0)| = 0). The masked-out 9s must not count.
  u = {"w": jnp.array([[3.0, 4.0, 9.0, 9.0],
                       [0.0, 1.0, 9.0, 9.0],
                       [0.0, 0.0, 9.0, 9.0]])}
  mask = {"w": jnp.array([1.0, 1.0, 0.0, 0.0])}
  return u, mask


def test_contribution_weights_hand_computed():
  u, mask = _three_client_example()
  scores, p = agg.contribution_scores(u, mask)
  np.testing.assert_allclose(scores, [5.0, 1.0, 0.0], rtol=1e-6)
  # p = (e^5, e^1, e^0) / (e^5 + e + 1).
  np.testing.assert_allclose(p, [0.97555875, 0.01786798, 0.00657326], rtol=1e-5)
  # alpha_prev = 0.2 each, beta = 0.5: alpha~ = 0.1 + 0.5 p sums to 0.8, so
  # alpha = (0.1 + 0.5 p) / 0.8.
  alpha = agg.contribution_weights(u, mask, jnp.full(3, 0.2), 0.5)
  np.testing.assert_allclose(alpha, [0.73472422, 0.13616749, 0.12910829], rtol=1e-5)
  np.testing.assert_allclose(jnp.sum(alpha), 1.0, rtol=1e-6)
  # beta = 0: alpha = p; beta = 1: alpha = alpha_prev renormalised.
  np.testing.assert_allclose(agg.contribution_weights(u, mask, jnp.full(3, 0.2), 0.0), p, rtol=1e-6)
  np.testing.assert_allclose(
      agg.contribution_weights(u, mask, jnp.array([0.1, 0.1, 0.2]), 1.0),
      [0.25, 0.25, 0.5], rtol=1e-6)


def test_contribution_weights_partial_participation_semantics():
  # Client 2 absent (its row is NaN padding). Participants: s = [5, 1],
  # p = (e^5, e) / (e^5 + e) = [0.98201379, 0.01798621];
  # alpha~ = 0.5 * [0.2, 0.2] + 0.5 p, sum 0.7; alpha = alpha~ / 0.7.
  u, mask = _three_client_example()
  u = {"w": u["w"].at[2].set(jnp.nan)}
  part = jnp.array([True, True, False])
  alpha_prev = jnp.array([0.2, 0.2, 0.6])
  scores, p = agg.contribution_scores(u, mask, part)
  np.testing.assert_allclose(scores, [5.0, 1.0, 0.0], rtol=1e-6)
  np.testing.assert_allclose(p, [0.98201379, 0.01798621, 0.0], rtol=1e-5)
  alpha = agg.contribution_weights(u, mask, alpha_prev, 0.5, part)
  np.testing.assert_allclose(alpha, [0.84429556, 0.15570444, 0.6], rtol=1e-5)
  # Semantics: the participants share the whole aggregate (their alpha sum
  # to 1); the absent client keeps its alpha_prev exactly, so the full vector
  # sums to 1 + 0.6.
  np.testing.assert_allclose(jnp.sum(alpha[:2]), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(alpha[2], alpha_prev[2])
  np.testing.assert_allclose(jnp.sum(alpha), 1.6, rtol=1e-6)


def test_contribution_weights_scores_1e4_apart_are_finite_and_one_hot():
  u = {"w": jnp.array([[0.0], [1e4], [2e4]])}
  scores, p = agg.contribution_scores(u)
  np.testing.assert_allclose(scores, [0.0, 1e4, 2e4])
  assert np.all(np.isfinite(p))
  np.testing.assert_allclose(p, [0.0, 0.0, 1.0], atol=1e-12)
  alpha = agg.contribution_weights(u, None, jnp.full(3, 1 / 3), 0.0)
  assert np.all(np.isfinite(alpha))
  np.testing.assert_allclose(alpha, [0.0, 0.0, 1.0], atol=1e-12)
  # The largest participant wins even if an absent client is larger.
  _, p = agg.contribution_scores(u, None, jnp.array([True, True, False]))
  np.testing.assert_allclose(p, [0.0, 1.0, 0.0], atol=1e-12)


def test_fedia_non_participant_keeps_alpha_and_has_no_weight():
  u = random_updates(1, 4)
  u = jax.tree.map(lambda x: x.at[1].set(jnp.nan), u)  # absent client's padding
  part = jnp.array([True, False, True, True])
  state = agg.FedIAState(alpha=jnp.array([0.1, 0.4, 0.2, 0.3]))
  out, new_state, diag = agg.fedia().update(u, state, 0.5, 0.3, participating=part)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
  np.testing.assert_array_equal(new_state.alpha[1], state.alpha[1])
  np.testing.assert_allclose(jnp.sum(new_state.alpha[part]), 1.0, rtol=1e-6)
  assert float(diag.softmax[1]) == 0.0 and float(diag.scores[1]) == 0.0
  # The aggregate uses the participants' alpha only.
  mask = agg.importance_mask(u, 0.5, part)
  coeff = np.where(np.asarray(part), np.asarray(new_state.alpha), 0.0)
  u_clean = jax.tree.map(lambda x: jnp.nan_to_num(x, nan=0.0), u)
  tree_allclose(out, _masked_weighted_sum(u_clean, mask, coeff), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# fedia (Algorithm 1) and its ablations.
# ----------------------------------------------------------------------------


def test_fedia_is_composition_of_its_parts():
  u = random_updates(2, 4)
  fedia = agg.fedia()
  state = agg.FedIAState(alpha=jnp.array([0.1, 0.3, 0.2, 0.4]))
  out, new_state, diag = fedia.update(u, state, 0.4, 0.6)
  mask = agg.importance_mask(u, 0.4)
  alpha = agg.contribution_weights(u, mask, state.alpha, 0.6)
  np.testing.assert_allclose(new_state.alpha, alpha, rtol=1e-6)
  np.testing.assert_allclose(diag.alpha, alpha, rtol=1e-6)
  tree_allclose(out, _masked_weighted_sum(u, mask, alpha), rtol=1e-5, atol=1e-6)
  # Coverage: round(0.4*12)=5 of 12, round(0.4*3)=1 of 3, round(0.4*5)=2 of 5.
  np.testing.assert_allclose(diag.mask_coverage, 8 / 20, rtol=1e-6)
  assert new_state.alpha.dtype == jnp.float32


def test_fedia_rho1_beta1_is_uniform_mean_over_rounds():
  # C = 4: 1/C is exact in float32, so the equality is bit for bit.
  fedia = agg.fedia()
  state = fedia.init(4)
  np.testing.assert_array_equal(state.alpha, np.full(4, 0.25, np.float32))
  for t in range(4):
    u = random_updates(10 + t, 4)
    out, state, diag = fedia.update(u, state, 1.0, 1.0)
    tree_equal(out, agg.fedavg(u, jnp.ones(4)))
    tree_allclose(out, jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), axis=0), u),
                   rtol=0, atol=1e-6)
    np.testing.assert_array_equal(state.alpha, np.full(4, 0.25, np.float32))
    assert float(diag.mask_coverage) == 1.0
  # C = 5: 1/C is rounded in float32; equal to the mean up to float32 rounding.
  state = fedia.init(5)
  for t in range(4):
    u = random_updates(20 + t, 5)
    out, state, _ = fedia.update(u, state, 1.0, 1.0)
    tree_allclose(out, jax.tree.map(lambda x: np.mean(np.asarray(x, np.float64), axis=0), u),
                   rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.alpha, np.full(5, 0.2), rtol=1e-7)


def test_fedia_im_only_is_fedavg_of_masked_updates():
  u = random_updates(3, 4)
  counts = jnp.array([10.0, 20.0, 30.0, 40.0])
  part = jnp.array([True, True, False, True])
  im_only = agg.fedia(use_momentum=False)
  assert dict(im_only.hparams) == {"rho": 0.5}  # beta is not used without momentum
  state = agg.FedIAState(alpha=jnp.array([0.1, 0.2, 0.3, 0.4]))
  out, new_state, diag = im_only.update(u, state, 0.3, weights=counts, participating=part)
  mask = agg.importance_mask(u, 0.3, part)
  masked = jax.tree.map(lambda x, m: x * m, u, mask)
  tree_equal(out, agg.fedavg(masked, counts, part))
  np.testing.assert_array_equal(new_state.alpha, state.alpha)  # passed through unchanged
  np.testing.assert_allclose(diag.weights, [10 / 70, 20 / 70, 0.0, 40 / 70], rtol=1e-6)
  np.testing.assert_array_equal(diag.alpha, diag.weights)
  # Uniform base weights when None.
  out, _, _ = im_only.update(u, state, rho=0.3, participating=part)
  tree_equal(out, agg.fedavg(masked, jnp.ones(4), part))
  with pytest.raises(ValueError, match=r"unknown hyper-parameter.*beta.*allowed: rho"):
    im_only.update(u, state, 0.3, beta=0.9)


def test_fedia_cam_only_has_mask_of_ones():
  u = random_updates(4, 4)
  cam_only = agg.fedia(use_mask=False)
  assert dict(cam_only.hparams) == {"beta": 0.5}  # rho is not used without a mask
  state = cam_only.init(4)
  out, new_state, diag = cam_only.update(u, state, 0.5)
  assert float(diag.mask_coverage) == 1.0
  ones = jax.tree.map(lambda x: jnp.ones(x.shape[1:], x.dtype), u)
  alpha = agg.contribution_weights(u, ones, state.alpha, 0.5)
  np.testing.assert_allclose(new_state.alpha, alpha, rtol=1e-6)
  np.testing.assert_array_equal(diag.weights, diag.alpha)
  tree_allclose(out, _masked_weighted_sum(u, ones, alpha), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"unknown hyper-parameter.*rho.*allowed: beta"):
    cam_only.update(u, state, rho=0.1)


def test_fedia_permutation_invariance():
  c = 4
  u = random_updates(5, c)
  part = jnp.array([True, True, False, True])
  state = agg.FedIAState(alpha=jnp.array([0.3, 0.1, 0.45, 0.15]))
  perm = np.array([3, 0, 2, 1])
  u_p = jax.tree.map(lambda x: x[perm], u)
  state_p = agg.FedIAState(alpha=state.alpha[perm])
  fedia = agg.fedia()
  out, new_state, diag = fedia.update(u, state, 0.3, 0.4, participating=part)
  out_p, new_state_p, diag_p = fedia.update(u_p, state_p, 0.3, 0.4, participating=part[perm])
  tree_allclose(out_p, out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new_state_p.alpha, new_state.alpha[perm], rtol=1e-6)
  np.testing.assert_allclose(diag_p.scores, diag.scores[perm], rtol=1e-6)
  assert float(diag_p.mask_coverage) == float(diag.mask_coverage)


def test_fedia_jit_equals_no_jit_over_rounds():
  fedia = agg.fedia()
  update = jax.jit(fedia.update)
  state = state_jit = fedia.init(4)
  counts = jnp.array([3.0, 1.0, 4.0, 5.0])
  for t in range(3):
    u = random_updates(30 + t, 4)
    part = jnp.array([[True, True, True, True],
                      [True, False, True, True],
                      [True, True, False, False]][t])
    out, state, diag = fedia.update(u, state, 0.3, 0.5, weights=counts, participating=part)
    out_j, state_jit, diag_j = update(u, state_jit, 0.3, 0.5, weights=counts,
                                      participating=part)
    tree_allclose(out_j, out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state_jit.alpha, state.alpha, rtol=1e-6)
    tree_allclose(diag_j, diag, rtol=1e-5, atol=1e-7)


def test_fedia_vmap_over_rho_beta_matches_loop_and_traces_once():
  u = random_updates(7, 4)
  fedia = agg.fedia()
  state = agg.FedIAState(alpha=jnp.array([0.1, 0.2, 0.3, 0.4]))
  part = jnp.array([True, True, False, True])
  traces = []

  def one_cell(rho, beta):
    traces.append(None)  # Python side effect: runs once per trace.
    return fedia.update(u, state, rho, beta, participating=part)

  sweep = jax.jit(jax.vmap(one_cell))
  rhos = jnp.array([0.1, 0.3, 0.5, 1.0])
  betas = jnp.array([0.0, 0.5, 0.9, 1.0])
  out, new_state, diag = sweep(rhos, betas)
  for g, (rho, beta) in enumerate(zip([0.1, 0.3, 0.5, 1.0], [0.0, 0.5, 0.9, 1.0])):
    out_g, state_g, diag_g = fedia.update(u, state, rho, beta, participating=part)
    tree_allclose(jax.tree.map(lambda x: x[g], out), out_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state.alpha[g], state_g.alpha, rtol=1e-6)
    np.testing.assert_allclose(diag.mask_coverage[g], diag_g.mask_coverage, rtol=1e-6)
  # Different cells really differ (the vmap does not collapse them).
  assert float(diag.mask_coverage[0]) < float(diag.mask_coverage[3]) == 1.0
  # New rho/beta values of the same shape: no retrace, no recompile.
  sweep(jnp.array([0.2, 0.4, 0.6, 0.8]), jnp.array([0.1, 0.2, 0.3, 0.4]))
  sweep(jnp.array([0.9, 0.7, 0.05, 0.35]), betas)
  assert len(traces) == 1

  # The same with chex's trace counter on the unbatched function.
  @jax.jit
  @chex.assert_max_traces(n=1)
  def cell(rho, beta):
    return fedia.update(u, state, rho, beta)

  cell(0.1, 0.2)
  cell(0.7, 0.9)


def test_aggregators_scan_over_rounds():
  # The state keeps its structure and dtype, so a lax.scan over rounds works.
  u_rounds = random_updates(8, 4 * 3)
  u_rounds = jax.tree.map(lambda x: x.reshape((3, 4) + x.shape[1:]), u_rounds)
  params = jax.tree.map(lambda x: x[0, 0], u_rounds)
  for name in agg.REGISTRY:
    aggregator = agg.get(name)
    def round_fn(state, u, aggregator=aggregator):
      out, state, diag = aggregator.update(u, state)  # default hyper-parameters
      return state, (out, diag)
    final, (outs, diags) = jax.lax.scan(round_fn, aggregator.init(4, params), u_rounds)
    assert diags.weights.shape == (3, 4) and diags.excluded.shape == (3, 4)
    assert outs["out"].shape == (3, 5)
    chex.assert_trees_all_equal_shapes_and_dtypes(final, aggregator.init(4, params))


def test_fedia_no_participants_gives_zeros_and_keeps_state():
  u = random_updates(9, 4)
  fedia = agg.fedia()
  state = fedia.init(4)
  out, new_state, diag = fedia.update(u, state, 0.5, 0.5, participating=jnp.zeros(4, bool))
  for x in jax.tree.leaves(out):
    np.testing.assert_array_equal(x, np.zeros_like(x))
  np.testing.assert_array_equal(new_state.alpha, state.alpha)
  assert np.all(np.isfinite(diag.softmax))


# ----------------------------------------------------------------------------
# Errors.
# ----------------------------------------------------------------------------


def test_static_errors():
  u = random_updates(11, 4)
  fedia = agg.fedia()
  state = fedia.init(4)
  bad = {"a": jnp.zeros((4, 2)), "b": jnp.zeros((3, 2))}
  with pytest.raises(ValueError, match="leading"):
    agg.fedavg(bad, jnp.ones(4))
  with pytest.raises(ValueError, match="leading"):
    fedia.update(bad, state, 0.5, 0.5)
  with pytest.raises(ValueError, match="scalar"):
    agg.importance_mask({"a": jnp.float32(1.0)}, 0.5)
  for rho in (0.0, -0.1, 1.5, float("nan")):
    with pytest.raises(ValueError, match="rho"):
      fedia.update(u, state, rho, 0.5)
    with pytest.raises(ValueError, match="rho"):
      agg.importance_mask(u, rho)
  for beta in (-0.1, 1.01):
    with pytest.raises(ValueError, match="beta"):
      fedia.update(u, state, 0.5, beta)
    with pytest.raises(ValueError, match="beta"):
      agg.contribution_weights(u, None, state.alpha, beta)
  with pytest.raises(ValueError, match="rho must be a scalar"):
    fedia.update(u, state, jnp.array([0.1, 0.2]), 0.5)
  with pytest.raises(ValueError, match="participating"):
    fedia.update(u, state, 0.5, 0.5, participating=jnp.ones(3, bool))
  with pytest.raises(ValueError, match="weights"):
    agg.fedavg(u, jnp.ones(2))
  with pytest.raises(ValueError, match=r"state\.alpha"):
    fedia.update(u, fedia.init(3), 0.5, 0.5)
  with pytest.raises(ValueError, match="num_clients"):
    fedia.init(0)
  # Boundary values are accepted; traced values are never checked (the clip
  # on k makes an out-of-range traced rho keep everything / one coordinate).
  fedia.update(u, state, 1, 0)
  fedia.update(u, state, 1.0, 1.0)
  m = jax.jit(agg.importance_mask)(u, 1.5)
  assert all(np.all(np.asarray(x) == 1) for x in jax.tree.leaves(m))


# ----------------------------------------------------------------------------
# Fault 6(a): norms that overflow float32.
# ----------------------------------------------------------------------------


def test_fedia_score_of_a_3e19_update_is_finite():
  # (3e19)^2 = 9e38 overflows float32 (max 3.4e38): a naive norm is inf, its
  # softmax NaN and every client's weight 0, healthy clients included.
  u = {"w": jnp.array([[3e19, 0.0], [1.0, 2.0], [0.5, -0.5]], jnp.float32)}
  with np.errstate(over="ignore"):
    assert np.isinf(np.sqrt(np.sum(np.square(np.asarray(u["w"][0])))))
  scores, p = agg.contribution_scores(u)
  np.testing.assert_allclose(scores, [3e19, np.sqrt(5.0), np.sqrt(0.5)], rtol=1e-6)
  np.testing.assert_allclose(p, [1.0, 0.0, 0.0], atol=1e-12)
  fedia = agg.fedia()
  out, state, diag = fedia.update(u, fedia.init(3), 1.0, 0.5)
  # alpha = (1/2)(1/3) + (1/2) p = [2/3, 1/6, 1/6]; it already sums to 1.
  np.testing.assert_allclose(diag.weights, [2 / 3, 1 / 6, 1 / 6], rtol=1e-6)
  np.testing.assert_allclose(state.alpha, [2 / 3, 1 / 6, 1 / 6], rtol=1e-6)
  assert not np.any(diag.excluded)
  # w_0 = (2/3) 3e19 + (1/6)(1 + 0.5); w_1 = (1/6)(2 - 0.5).
  np.testing.assert_allclose(out["w"], [2e19, 0.25], rtol=1e-6)
  # Masked (rho = 0.5 keeps coordinate 0), the same scores for client 0.
  _, _, diag = fedia.update(u, fedia.init(3), 0.5, 0.5)
  assert np.all(np.isfinite(diag.weights)) and np.all(np.isfinite(diag.scores))
  np.testing.assert_allclose(diag.scores, [3e19, 1.0, 0.5], rtol=1e-6)


def test_fedia_excludes_and_reports_an_inf_or_overflowing_norm():
  # Client 0 is finite but its norm 3e38 * sqrt(2) = 4.2e38 exceeds float32;
  # client 2 holds an Inf. Both are left out; the others are renormalised.
  big = 3e38
  u = {"w": jnp.array([[big, big], [1.0, 2.0], [jnp.inf, 0.0], [0.5, -0.5]], jnp.float32)}
  scores, p = agg.contribution_scores(u)
  assert np.isinf(scores[0]) and np.isinf(scores[2])
  # p_1 = e^√5 / (e^√5 + e^√0.5) = 1 / (1 + e^(√0.5 - √5)).
  np.testing.assert_allclose(p, [0.0, 0.82185427, 0.0, 0.17814573], rtol=1e-6)
  fedia = agg.fedia()
  left_out = np.array([0, 2])
  state = agg.FedIAState(alpha=jnp.array([0.1, 0.2, 0.3, 0.4]))
  out, new_state, diag = fedia.update(u, state, 0.5, 0.5)
  np.testing.assert_array_equal(diag.excluded, [True, False, True, False])
  np.testing.assert_array_equal(diag.weights[left_out], [0.0, 0.0])
  np.testing.assert_allclose(jnp.sum(diag.weights), 1.0, rtol=1e-6)
  np.testing.assert_array_equal(new_state.alpha[left_out], state.alpha[left_out])
  assert np.all(np.isfinite(out["w"])) and np.all(np.isfinite(diag.scores))
  # Exactly as if they had not taken part.
  absent = jnp.array([False, True, False, True])
  out2, state2, diag2 = fedia.update(u, state, 0.5, 0.5, participating=absent)
  tree_equal(out, out2)
  np.testing.assert_array_equal(new_state.alpha, state2.alpha)
  np.testing.assert_array_equal(diag.weights, diag2.weights)
  assert not np.any(diag2.excluded)
  # The public weights keep the excluded clients' alpha too.
  alpha = agg.contribution_weights(u, None, state.alpha, 0.5)
  np.testing.assert_array_equal(alpha[left_out], state.alpha[left_out])
  np.testing.assert_allclose(alpha[1] + alpha[3], 1.0, rtol=1e-6)
