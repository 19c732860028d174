"""GMA on three clients: agreement, mask and aggregate computed by hand."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import aggregators as agg

# Three clients, six coordinates split over two leaves. Base weights 1, 1, 2
# give q = (1/4, 1/4, 1/2); the signs per coordinate and their agreement
# A = |sum_k q_k sign(u_k)| (sign(0) = 0):
#   d0 (+,+,+) 1 | d1 (+,+,-) 0 | d2 (+,-,+) 1/2 | d3 (-,0,+) 1/4 |
#   d4 (+,0,0) 1/4 | d5 (0,+,+) 3/4.
U = {"a": jnp.array([[1.0, 1.0, 1.0, -1.0], [2.0, 1.0, -1.0, 0.0], [3.0, -1.0, 2.0, 4.0]]),
     "b": jnp.array([[2.0, 0.0], [0.0, 3.0], [0.0, 1.0]])}
W = jnp.array([1.0, 1.0, 2.0])
# The weighted mean sum_k q_k u_k per coordinate.
MEAN = np.array([2.25, 0.0, 1.0, 1.75, 0.5, 1.25])


def _flat(tree):
  return np.concatenate([np.asarray(tree["a"]), np.asarray(tree["b"])])


@pytest.mark.parametrize("tau, mask", [
    # tau = 1/2: d2 sits at tau and is kept whole (>=); d3, d4 below keep A.
    (0.5, [1.0, 0.0, 1.0, 0.25, 0.25, 1.0]),
    # tau = 1/4: d3 and d4 sit at tau: whole.
    (0.25, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
    # tau = 0.6: d2 (1/2) falls below; d5 (3/4) stays above.
    (0.6, [1.0, 0.0, 0.5, 0.25, 0.25, 1.0]),
    # tau = 1: only the unanimous d0 is whole.
    (1.0, [1.0, 0.0, 0.5, 0.25, 0.25, 0.75]),
])
def test_gma_mask_at_above_and_below_tau(tau, mask):
  gma = agg.gma()
  out, state, diag = gma.update(U, gma.init(3), tau, weights=W)
  np.testing.assert_allclose(_flat(out), np.array(mask) * MEAN, rtol=1e-6)
  assert state == ()
  np.testing.assert_allclose(diag.weights, [0.25, 0.25, 0.5], rtol=1e-6)
  np.testing.assert_allclose(diag.mask_coverage, 5 / 6, rtol=1e-6)  # d1 has A = 0
  np.testing.assert_allclose(diag.mask_mean, np.mean(mask), rtol=1e-6)
  assert not np.any(diag.excluded)


def test_gma_tau_0_is_fedavg_and_default_weights_are_uniform():
  gma = agg.gma()
  out, _, diag = gma.update(U, gma.init(3), 0.0, weights=W)
  np.testing.assert_allclose(_flat(out), MEAN, rtol=1e-6)
  np.testing.assert_allclose(_flat(out), _flat(agg.fedavg(U, W)), rtol=1e-6)
  # Uniform q = 1/3: d1 (+,+,-) has A = 1/3 < 1/2, so d1's mean (1 + 1 - 1)/3
  # is scaled by 1/3; d0 (A = 1) keeps its mean 2.
  out, _, diag = gma.update(U, gma.init(3), tau=0.5)
  np.testing.assert_allclose(_flat(out)[:2], [2.0, 1 / 9], rtol=1e-6)
  np.testing.assert_allclose(diag.weights, np.full(3, 1 / 3), rtol=1e-6)
  assert dict(gma.hparams) == {"tau": 0.1}  # the reference code's default


def test_gma_non_participant_is_left_out():
  # Client 2 absent (its row NaN): q = (1/2, 1/2); agreement per coordinate
  # 1, 1, 0, 1/2, 1/2, 1/2 and mean 1.5, 1, 0, -0.5, 1, 1.5; at tau = 1/2
  # every mask is 1 except d2 (A = 0).
  u = {k: v.at[2].set(jnp.nan) for k, v in U.items()}
  gma = agg.gma()
  out, _, diag = gma.update(u, gma.init(3), 0.5, weights=W,
                            participating=jnp.array([True, True, False]))
  np.testing.assert_allclose(_flat(out), [1.5, 1.0, 0.0, -0.5, 1.0, 1.5], rtol=1e-6)
  np.testing.assert_allclose(diag.weights, [0.5, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_allclose(diag.mask_coverage, 5 / 6, rtol=1e-6)
