"""The interface every registered aggregator shares: shapes, checks, jit, vmap, clients."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aggregator_testing import random_updates, tree_allclose, tree_equal
from fedjax_graph import aggregators as agg

NAMES = list(agg.REGISTRY)
C = 4
HPARAMS = {
    "fedavg": {}, "fedia": {"rho": 0.5, "beta": 0.5}, "fedia_im": {"rho": 0.5},
    "fedia_cam": {"beta": 0.5}, "gma": {"tau": 0.1}, "fedheal": {"tau": 0.3, "beta": 0.4},
}
# Values inside each range that differ from the defaults (so a test sees them used).
OTHER = {"rho": 0.3, "beta": 0.7, "tau": 0.2}
OUT_OF_RANGE = {"rho": (0.0, -0.1, 1.5, float("nan")), "beta": (-0.1, 1.01),
                "tau": (-0.1, 1.5)}
BOUNDS = {"rho": (1, 1e-6), "beta": (0, 1), "tau": (0.0, 1.0)}


def _init(aggregator, u):
  return aggregator.init(u["out"].shape[0], jax.tree.map(lambda x: x[0], u))


def _other(name):
  return {k: OTHER[k] for k in HPARAMS[name]}


def _run(aggregator, name, rounds, update=None, state=None, perm=None):
  """Runs rounds of (updates, weights, participating); returns per-round outputs."""
  update = update or aggregator.update
  state = _init(aggregator, rounds[0][0]) if state is None else state
  results = []
  for u, w, part in rounds:
    out, state, diag = update(u, state, weights=w, participating=part, **_other(name))
    results.append((out, state, diag))
  return results


def _rounds(seed, num_rounds=3):
  parts = [[True] * C, [True, False, True, True], [False, True, True, False]]
  weights = jnp.array([3.0, 1.0, 4.0, 5.0])
  return [(random_updates(seed + t), weights, jnp.array(parts[t % 3])) for t in range(num_rounds)]


def _close(a, b):
  tree_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_registry_names_defaults_and_get():
  assert NAMES == ["fedavg", "fedia", "fedia_im", "fedia_cam", "gma", "fedheal"]
  assert set(agg.DISPLAY) == set(NAMES)
  for name in NAMES:
    assert dict(agg.get(name).hparams) == HPARAMS[name]
    assert list(agg.get(name).hparams) == list(HPARAMS[name])  # the positional order
  with pytest.raises(ValueError, match="unknown aggregator 'krum'; choose from fedavg, fedia, "
                     "fedia_im, fedia_cam, gma, fedheal"):
    agg.get("krum")
  assert dict(agg.get("fedia", use_mask=False).hparams) == {"beta": 0.5}
  assert agg.check_hparams("fedheal", {"beta": 0.9}) == {"tau": 0.3, "beta": 0.9}
  with pytest.raises(ValueError, match=r"gma: unknown hyper-parameter\(s\) \['rho'\]; "
                     "allowed: tau"):
    agg.check_hparams("gma", {"rho": 0.5})
  with pytest.raises(ValueError, match=r"^tau = 2; must be in \[0, 1\]$"):
    agg.check_hparams("gma", {"tau": 2})


@pytest.mark.parametrize("name", NAMES)
def test_init_and_update_shapes(name):
  aggregator = agg.get(name)
  u = random_updates(0)
  state = _init(aggregator, u)
  for leaf in jax.tree.leaves(state):
    assert leaf.shape[0] == C  # every per-client leaf is indexed by client id
  out, new_state, diag = aggregator.update(u, state)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, jax.tree.map(lambda x: x[0], u))
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  assert diag.weights.shape == (C,) and diag.weights.dtype == jnp.float32
  assert diag.mask_coverage.shape == () and diag.mask_coverage.dtype == jnp.float32
  assert diag.excluded.shape == (C,) and diag.excluded.dtype == jnp.bool_
  np.testing.assert_allclose(jnp.sum(diag.weights), 1.0, rtol=1e-6)
  assert 0.0 < float(diag.mask_coverage) <= 1.0 and not np.any(diag.excluded)
  # bf16 updates keep their dtype.
  u16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), u)
  out16, _, _ = aggregator.update(u16, _init(aggregator, u16))
  chex.assert_trees_all_equal_shapes_and_dtypes(out16, jax.tree.map(lambda x: x[0], u16))


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameter_binding_and_errors(name):
  aggregator = agg.get(name)
  u = random_updates(1)
  state = _init(aggregator, u)
  allowed = ", ".join(HPARAMS[name]) or "none"
  with pytest.raises(ValueError, match=rf"unknown hyper-parameter\(s\) \['bogus'\]; "
                     rf"allowed: {allowed}\."):
    aggregator.update(u, state, bogus=0.1)
  with pytest.raises(ValueError, match="positional"):
    aggregator.update(u, state, *([0.5] * (len(HPARAMS[name]) + 1)))
  # Positional (in hparams order), named and default values agree.
  other = _other(name)
  by_name = aggregator.update(u, state, **other)
  tree_equal(aggregator.update(u, state, *other.values()), by_name)
  tree_equal(aggregator.update(u, state), aggregator.update(u, state, **HPARAMS[name]))
  for hp in HPARAMS[name]:
    with pytest.raises(ValueError, match="given twice"):
      aggregator.update(u, state, *other.values(), **{hp: other[hp]})
    for bad in OUT_OF_RANGE[hp]:
      with pytest.raises(ValueError, match=f"^{hp} = .*; must be in"):
        aggregator.update(u, state, **{hp: bad})
      with pytest.raises(ValueError, match=f"^{hp} = .*; must be in"):
        aggregator.update(u, state, **{hp: np.float32(bad)})
    with pytest.raises(ValueError, match=f"{hp} must be a scalar"):
      aggregator.update(u, state, **{hp: jnp.array([0.1, 0.2])})
    for ok in BOUNDS[hp]:
      aggregator.update(u, state, **{hp: ok})
    # Traced values are not (cannot be) checked.
    jax.jit(lambda v, hp=hp: aggregator.update(u, state, **{hp: v}))(OUT_OF_RANGE[hp][-1])
  with pytest.raises(ValueError, match="participating must have shape"):
    aggregator.update(u, state, participating=jnp.ones(3, bool))
  with pytest.raises(ValueError, match="weights must have shape"):
    aggregator.update(u, state, weights=jnp.ones(5))
  with pytest.raises(ValueError, match="leading"):
    aggregator.update({"a": jnp.zeros((4, 2)), "b": jnp.zeros((3, 2))}, state)
  with pytest.raises(ValueError, match="num_clients"):
    aggregator.init(0, jax.tree.map(lambda x: x[0], u))
  if jax.tree.leaves(state):
    with pytest.raises(ValueError, match=r"state.* must have shape"):
      aggregator.update(random_updates(1, num_clients=5), state)


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_no_jit_over_rounds(name):
  aggregator = agg.get(name)
  rounds = _rounds(10)
  eager = _run(aggregator, name, rounds)
  jitted = _run(aggregator, name, rounds, update=jax.jit(aggregator.update))
  for (out, state, diag), (out_j, state_j, diag_j) in zip(eager, jitted):
    _close(out_j, out)
    _close(state_j, state)
    _close(diag_j, diag)


@pytest.mark.parametrize("name", [n for n in NAMES if HPARAMS[n]])
def test_vmap_over_one_hyperparameter_compiles_once(name):
  aggregator = agg.get(name)
  u = random_updates(20)
  state = _run(aggregator, name, _rounds(21, 2))[-1][1]  # a state with history
  part = jnp.array([True, True, False, True])
  hp = next(iter(HPARAMS[name]))
  traces = []

  def one_cell(value):
    traces.append(None)  # Python side effect: runs once per trace.
    return aggregator.update(u, state, participating=part, **{hp: value})

  sweep = jax.jit(jax.vmap(one_cell))
  values = [0.1, 0.4, 0.8, 1.0]
  out, new_state, diag = sweep(jnp.array(values))
  for g, value in enumerate(values):
    out_g, state_g, diag_g = aggregator.update(u, state, participating=part, **{hp: value})
    _close(jax.tree.map(lambda x: x[g], out), out_g)
    _close(jax.tree.map(lambda x: x[g], new_state), state_g)
    _close(jax.tree.map(lambda x: x[g], diag), diag_g)
  sweep(jnp.array([0.2, 0.3, 0.6, 0.9]))
  assert len(traces) == 1
  # The README's form: positional, over the first hyper-parameter.
  positional = jax.jit(jax.vmap(aggregator.update, in_axes=(None, None, 0)))
  out_p, _, _ = positional(u, state, jnp.array(values))
  for g, value in enumerate(values):
    _close(jax.tree.map(lambda x: x[g], out_p), aggregator.update(u, state, value)[0])


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_stacked_states(name):
  # Cells and seeds each carry their own state: fixed shapes stack and vmap.
  aggregator = agg.get(name)
  u = random_updates(30)
  s0 = _init(aggregator, u)
  s1 = _run(aggregator, name, _rounds(31, 2))[-1][1]
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), s0, s1)
  out, new_state, _ = jax.vmap(lambda s: aggregator.update(u, s), axis_size=2)(stacked)
  for g, s in enumerate((s0, s1)):
    out_g, state_g, _ = aggregator.update(u, s)
    _close(jax.tree.map(lambda x: x[g], out), out_g)
    _close(jax.tree.map(lambda x: x[g], new_state), state_g)


@pytest.mark.parametrize("name", NAMES)
def test_permuting_clients_permutes_weights_and_state(name):
  aggregator = agg.get(name)
  perm = np.array([3, 0, 2, 1])
  permute = lambda tree: jax.tree.map(lambda x: x[perm], tree)
  rounds = _rounds(40)
  permuted = [(permute(u), w[perm], part[perm]) for u, w, part in rounds]
  state0 = _run(aggregator, name, rounds[:1])[0][1]
  plain = _run(aggregator, name, rounds[1:], state=state0)
  swapped = _run(aggregator, name, permuted[1:], state=permute(state0))
  for (out, state, diag), (out_p, state_p, diag_p) in zip(plain, swapped):
    _close(out_p, out)
    _close(state_p, permute(state))
    np.testing.assert_allclose(diag_p.weights, diag.weights[perm], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(diag_p.excluded, diag.excluded[perm])
    np.testing.assert_allclose(diag_p.mask_coverage, diag.mask_coverage, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_non_participant_row_is_never_read(name):
  aggregator = agg.get(name)
  state = _run(aggregator, name, _rounds(50, 2))[-1][1]
  u = random_updates(52)
  part = jnp.array([True, False, True, True])
  nan_row = jax.tree.map(lambda x: x.at[1].set(jnp.nan), u)
  zero_row = jax.tree.map(lambda x: x.at[1].set(0.0), u)
  out, new_state, diag = aggregator.update(nan_row, state, participating=part, **_other(name))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((out, diag)))
  tree_equal((out, new_state, diag),
              aggregator.update(zero_row, state, participating=part, **_other(name)))
  tree_equal(jax.tree.map(lambda x: x[1], new_state), jax.tree.map(lambda x: x[1], state))
  assert float(diag.weights[1]) == 0.0 and not diag.excluded[1]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, 3e38])
def test_a_non_finite_norm_is_excluded_like_an_absent_client(name, bad):
  # NaN, Inf, and a finite update whose norm (3e38 * sqrt(n)) exceeds float32.
  aggregator = agg.get(name)
  state = _run(aggregator, name, _rounds(60, 2))[-1][1]
  u = jax.tree.map(lambda x: x.at[2].set(bad), random_updates(62))
  out, new_state, diag = aggregator.update(u, state, **_other(name))
  np.testing.assert_array_equal(diag.excluded, [False, False, True, False])
  assert float(diag.weights[2]) == 0.0
  np.testing.assert_allclose(jnp.sum(diag.weights), 1.0, rtol=1e-6)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((out, diag.weights)))
  absent = jnp.array([True, True, False, True])
  out_a, state_a, diag_a = aggregator.update(u, state, participating=absent, **_other(name))
  tree_equal((out, new_state, diag.weights), (out_a, state_a, diag_a.weights))
  assert not np.any(diag_a.excluded)


@pytest.mark.parametrize("name", NAMES)
def test_a_3e19_update_keeps_every_weight_finite(name):
  # Fault 6(a): its sum of squares overflows float32, its stable norm does not.
  aggregator = agg.get(name)
  u = random_updates(70)
  u["out"] = u["out"].at[0, 0].set(3e19)
  state = _init(aggregator, u)
  for _ in range(2):
    out, state, diag = aggregator.update(u, state)
    assert not np.any(diag.excluded)
    assert np.all(np.isfinite(diag.weights)) and float(jnp.sum(diag.weights)) == pytest.approx(1)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((out, state)))


@pytest.mark.parametrize("name", NAMES)
def test_no_participant_changes_nothing(name):
  aggregator = agg.get(name)
  state = _run(aggregator, name, _rounds(80, 2))[-1][1]
  u = jax.tree.map(lambda x: x.at[0].set(jnp.nan), random_updates(82))
  out, new_state, diag = aggregator.update(u, state, participating=jnp.zeros(C, bool))
  tree_equal(out, jax.tree.map(lambda x: jnp.zeros_like(x[0]), u))
  tree_equal(new_state, state)
  np.testing.assert_array_equal(diag.weights, np.zeros(C))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(diag))
