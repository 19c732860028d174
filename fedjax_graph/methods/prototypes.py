"""Class prototypes with fixed shapes: a client's weighted class means and the server's mean over clients.

Shared by the prototype methods (FedProto, FedProc, FGGP). Every class has a
row, present or not, so shapes never depend on the data; a presence mask
says which rows mean something.

References:
  FedProto (Tan et al., AAAI 2022), eqs. (4) and (6); FGL_METHODS.md §1(i).
"""

import jax
import jax.numpy as jnp

from fedjax_graph.types import Array


def class_prototypes(z: Array, y: Array, weights: Array, num_classes: int) -> tuple[Array, Array]:
  """Weighted class means of node embeddings.

  Args:
    z: f32[N, H] node embeddings.
    y: i32[N] class of each node (any value where ``weights`` is 0).
    weights: f32[N] (or bool[N]) weight of each node; 0 leaves a node out
      (padding, nodes outside the training set).
    num_classes: K, static.

  Returns:
    (prototypes f32[K, H], mass f32[K]): row c is
    ``sum_i w_i [y_i = c] z_i / sum_i w_i [y_i = c]`` and 0 where the class has
    no weight; ``mass`` is that denominator (the count for 0/1 weights).
  """
  onehot = jax.nn.one_hot(y, num_classes, dtype=z.dtype) * weights.astype(z.dtype)[:, None]
  mass = jnp.sum(onehot, axis=0)
  prototypes = onehot.T @ z / jnp.where(mass > 0, mass, 1.0)[:, None]
  return prototypes, mass


def mean_over_clients(prototypes: Array, present: Array, participating: Array) -> tuple[Array, Array]:
  """The server's global prototypes: per class, the unweighted mean over the clients that hold it.

  Args:
    prototypes: f32[C, K, H] every client's prototypes.
    present: bool[C, K] client k has class c (its mass is > 0).
    participating: bool[C] clients whose upload counts this round.

  Returns:
    (global f32[K, H], has bool[K]): a class no participant holds has a zero
    row and ``has`` False (FedProto eq. 6 as all its public codes do it).
    Rows of clients that do not hold a class or do not participate are never
    read, so they may be anything, NaN included.
  """
  holds = present & participating[:, None]
  total = jnp.sum(holds, axis=0)
  # where, not a 0/1 product: a left-out client's rows may be NaN (a diverged
  # local model), and 0 * NaN would poison every class.
  summed = jnp.sum(jnp.where(holds[..., None], prototypes, 0.0), axis=0)
  return summed / jnp.maximum(total, 1).astype(prototypes.dtype)[:, None], total > 0
