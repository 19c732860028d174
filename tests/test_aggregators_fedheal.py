"""FedHEAL on two and three clients: masks, history, weights and aggregate by hand."""

from fractions import Fraction as F

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import aggregators as agg

NAN5 = [np.nan] * 5


def _u(*rows):
  """Client updates over five coordinates, split over two leaves (3 + 2)."""
  x = jnp.array(rows, jnp.float32)
  return {"a": x[:, :3], "b": x[:, 3:]}


def _flat(tree):
  return np.concatenate([np.asarray(tree["a"]), np.asarray(tree["b"])], axis=-1)


def _init(num_clients):
  return agg.fedheal().init(num_clients, {"a": jnp.zeros(3), "b": jnp.zeros(2)})


def _close(actual, fractions, rtol=1e-6):
  np.testing.assert_allclose(actual, [float(f) for f in fractions], rtol=rtol, atol=1e-7)


# Round 1 for two clients: u0 = (1, 2, -2, 0, 0), u1 = (-1, 0, 0, 0, 0).
ROUND1 = ((1, 2, -2, 0, 0), (-1, 0, 0, 0, 0))
# Round 2: u0 = (3, -1, -4, 0, -7), u1 = (1, 5, 0, -2, -9).
ROUND2 = ((3, -1, -4, 0, -7), (1, 5, 0, -2, -9))


def test_fedheal_first_round():
  # First round: masks all ones; d = (||u0||, ||u1||) = (3, 1).
  # delta = beta d / sum d = 0.4 (3/4, 1/4) = (0.3, 0.1); p starts at 1/|S| = 1/2;
  # p + delta = (0.8, 0.6), renormalised: q = (4/7, 3/7).
  fedheal = agg.fedheal()
  assert dict(fedheal.hparams) == {"tau": 0.3, "beta": 0.4}
  out, state, diag = fedheal.update(_u(*ROUND1), _init(2))
  _close(diag.weights, [F(4, 7), F(3, 7)])
  _close(diag.distances, [3, 1])
  _close(diag.kept, [1, 1])
  assert float(diag.mask_coverage) == 1.0
  # Every coordinate is kept by both: u = q0 u0 + q1 u1.
  _close(_flat(out), [F(1, 7), F(8, 7), F(-8, 7), 0, 0])
  # History: u >= 0 counts (0 counts as >= 0), one round each.
  np.testing.assert_array_equal(_flat(state.positive), [[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]])
  np.testing.assert_array_equal(state.rounds, [1, 1])
  _close(state.delta, [F(3, 10), F(1, 10)])
  _close(state.weight, [F(4, 7), F(3, 7)])


def test_fedheal_second_round_history_masks_and_fallback():
  fedheal = agg.fedheal()
  _, state, _ = fedheal.update(_u(*ROUND1), _init(2))
  out, state, diag = fedheal.update(_u(*ROUND2), state, 0.3, 0.4)
  # Client 0: h = (1, 1, 0, 1, 1); u >= 0 at (1, 0, 0, 1, 0), so the
  # consistency c = h there and 1 - h elsewhere: (1, 0, 1, 1, 0) -> m0 =
  # (1, 0, 1, 1, 0) (c > 0.3). Masked (3, 0, -4, 0, 0): d0 = 5.
  # Client 1: h = (0, 1, 1, 1, 1); u >= 0 at (1, 1, 1, 0, 0): c = (0, 1, 1, 0, 0)
  # -> m1 = (0, 1, 1, 0, 0). Masked (0, 5, 0, 0, 0): d1 = 5.
  _close(diag.distances, [5, 5])
  _close(diag.kept, [F(3, 5), F(2, 5)])
  # delta = 0.6 (0.3, 0.1) + 0.4 (1/2, 1/2) = (0.38, 0.26);
  # p + delta = (4/7 + 0.38, 3/7 + 0.26) = (666, 482) / 700 -> q = (333, 241) / 574.
  q0, q1 = F(333, 574), F(241, 574)
  _close(diag.weights, [q0, q1])
  # Per coordinate over the clients that keep it: d0 only client 0 (3); d1 only
  # client 1 (5); d2 both, (q0 (-4) + q1 0) / (q0 + q1); d3 only client 0 (0);
  # d4 nobody: the coordinate does not move (not the unmasked -7 q0 - 9 q1).
  _close(_flat(out), [3, 5, -4 * q0 / (q0 + q1), 0, 0])
  np.testing.assert_allclose(diag.mask_coverage, 4 / 5, rtol=1e-6)
  np.testing.assert_array_equal(_flat(state.positive), [[2, 1, 0, 2, 1], [1, 2, 2, 1, 1]])
  np.testing.assert_array_equal(state.rounds, [2, 2])
  _close(state.delta, [F(38, 100), F(26, 100)])
  _close(state.weight, [q0, q1])

  # Round 3 without client 1 (NaN row), tau = 1/2: client 0's history is
  # (2, 1, 0, 2, 1) / 2 and u0 >= 0 everywhere, so c = (1, 1/2, 0, 1, 1/2):
  # the test is strict, so m0 = (1, 0, 0, 1, 0). Alone, q0 = 1.
  skipped = state
  out, state, diag = fedheal.update(_u((1, 1, 1, 1, 1), NAN5), state, tau=0.5,
                                    participating=jnp.array([True, False]))
  _close(_flat(out), [1, 0, 0, 1, 0])
  _close(diag.weights, [1, 0])
  _close(diag.kept, [F(2, 5), 0])
  # delta0 = 0.6 * 0.38 + 0.4 * 1; p0 = 1 after renormalising over {0}.
  _close(state.delta, [F(628, 1000), F(26, 100)])
  _close(state.weight, [1, q1])
  # The client that skipped keeps its whole history.
  jax.tree.map(lambda new, old: np.testing.assert_array_equal(new[1], old[1]), state, skipped)
  np.testing.assert_array_equal(state.rounds, [3, 2])


def test_fedheal_client_first_seen_late_starts_fresh_with_own_count():
  fedheal = agg.fedheal()
  # Round 1: client 2 is absent; clients 0 and 1 as in the first-round test.
  u1 = _u(*ROUND1, NAN5)
  _, state, _ = fedheal.update(u1, _init(3), participating=jnp.array([True, True, False]))
  _close(state.weight, [F(4, 7), F(3, 7), 0])
  np.testing.assert_array_equal(state.rounds, [1, 1, 0])
  # Round 2, all three: client 2's first round (its own count is 0, whatever the
  # global round): mask all ones, p starts at 1/|S| = 1/3, delta at 0. Its update
  # (0, 0, 0, 3, -4) has d2 = 5; clients 0 and 1 as in round 2 (d = 5 each).
  out, state, diag = fedheal.update(_u(*ROUND2, (0, 0, 0, 3, -4)), state)
  # delta = 0.6 (0.3, 0.1, 0) + 0.4 / 3 = (47, 29, 20) / 150;
  # p + delta = (4/7 + 47/150, 3/7 + 29/150, 1/3 + 20/150) = (929, 653, 490) / 1050.
  q = [F(929, 2072), F(653, 2072), F(490, 2072)]
  _close(diag.weights, q)
  _close(diag.kept, [F(3, 5), F(2, 5), 1])
  # d0: clients 0 (3) and 2 (0); d1: 1 (5) and 2 (0); d2: 0 (-4), 1 (0), 2 (0);
  # d3: 0 (0) and 2 (3); d4: client 2 only (-4).
  _close(_flat(out), [3 * q[0] / (q[0] + q[2]), 5 * q[1] / (q[1] + q[2]), -4 * q[0],
                      3 * q[2] / (q[0] + q[2]), -4])
  assert float(diag.mask_coverage) == 1.0
  np.testing.assert_array_equal(_flat(state.positive)[2], [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(state.rounds, [2, 2, 1])


def test_fedheal_init_needs_the_model_and_rejects_another():
  with pytest.raises(ValueError, match=r"init\(num_clients, params\)"):
    agg.fedheal().init(2)
  state = _init(2)
  shapes = jax.tree.map(lambda x: x.shape, state.positive)
  assert shapes == {"a": (2, 3), "b": (2, 2)}
  # Abstract params work too (shapes only).
  abstract = agg.fedheal().init(2, {"a": jax.ShapeDtypeStruct((3,), jnp.float32),
                                    "b": jax.ShapeDtypeStruct((2,), jnp.float32)})
  jax.tree.map(np.testing.assert_array_equal, abstract, state)
  with pytest.raises(ValueError,
                     match=r"state\.positive\['a'\] must have shape \(2, 4\), got \(2, 3\)"):
    agg.fedheal().update({"a": jnp.zeros((2, 4)), "b": jnp.zeros((2, 2))}, state)
