"""Helpers shared by the aggregator tests: small random updates and tree comparisons."""

import chex
import jax
import jax.numpy as jnp
import numpy as np


def random_updates(seed, num_clients=4):
  """A small two-layer 'model' of client updates, leaves f32[C, ...]."""
  rng = np.random.default_rng(seed)
  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return {
      "dense": {"kernel": normal(num_clients, 4, 3), "bias": normal(num_clients, 3)},
      "out": normal(num_clients, 5),
  }


def tree_allclose(a, b, rtol=1e-6, atol=1e-7):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def tree_equal(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
