"""FGGP's server side with fixed shapes: FINCH over the clients' prototypes, the prototype queue, kNN scores.

Every class has C slots (one per client), valid or not, so FINCH, the cluster
means and the queue's writes never depend on how many clients hold a class.

References:
  M. S. Sarfraz, V. Sharma, R. Stiefelhagen, "Efficient Parameter-free
  Clustering Using First Neighbor Relations" (FINCH), CVPR 2019, eq. (1) and
  Algorithm 1 (as its reference code ``FINCH(..., distance='cosine',
  ensure_early_exit=False)``, the call of FGGP's code).
  G. Wan, W. Huang, M. Ye, "Federated Graph Learning under Domain Shift with
  Generalizable Prototypes" (FGGP), AAAI 2024; its code's ``MomentumQueue``
  (backbone/knn.py) and ``proto_aggregation`` (models/fggp.py);
  FGL_METHODS.md §4(d), (e), (g), (i).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_graph.types import Array


class Queue(NamedTuple):
  """The server's circular memory of L2-normalised cluster prototypes.

  Attributes:
    memory: f32[Q, H] prototypes (the random initial rows are not normalised,
      as the reference code's).
    labels: i32[Q] their classes (0 for the initial rows).
    pointer: i32[] the next row written.
  """
  memory: Array
  labels: Array
  pointer: Array


def init_queue(key: Array, size: int, dim: int) -> Queue:
  """Q = ``size`` rows drawn Uniform(-1/sqrt(H/3), 1/sqrt(H/3)), labels 0 (``MomentumQueue``)."""
  bound = 1.0 / math.sqrt(dim / 3)
  return Queue(jax.random.uniform(key, (size, dim), jnp.float32, -bound, bound),
               jnp.zeros((size,), jnp.int32), jnp.zeros((), jnp.int32))


def _normalise(x: Array, eps: float = 1e-12) -> Array:
  """Rows of ``x`` over their L2 norm (torch's F.normalize; a zero row stays 0)."""
  return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps**2))


def _closure_steps(n: int) -> int:
  """Squarings of a reachability matrix that reach paths of length n - 1: ceil(log2 n)."""
  return max(1, math.ceil(math.log2(max(n, 2))))


def first_neighbour_partition(points: Array, valid: Array) -> Array:
  """One FINCH partition: connected components of the first-neighbour graph (FINCH eq. 1).

  Args:
    points: f32[C, H] one row per slot.
    valid: bool[C] slots that exist; the others join nothing.

  Returns:
    i32[C] the cluster of each slot, named by its smallest member's index
    (a slot with no valid neighbour, or an invalid one, is its own cluster).
    Nodes i, j are linked when j is i's first neighbour (cosine distance),
    i is j's, or they share it; components by ceil(log2 C) boolean squarings.
  """
  n = points.shape[0]
  unit = _normalise(points)
  distance = 1.0 - unit @ unit.T
  others = valid[None, :] & ~jnp.eye(n, dtype=bool)
  first = jnp.argmin(jnp.where(others, distance, jnp.inf), axis=1)
  first = jnp.where(jnp.any(others, axis=1) & valid, first, jnp.arange(n))
  step = (jax.nn.one_hot(first, n) + jnp.eye(n)) * valid[:, None]
  linked = (step @ step.T > 0) | jnp.eye(n, dtype=bool)
  for _ in range(_closure_steps(n)):
    linked = linked.astype(jnp.float32) @ linked.astype(jnp.float32) > 0
  return jnp.argmax(linked, axis=1).astype(jnp.int32)  # the first reachable index


def _cluster_means(points: Array, members: Array, labels: Array) -> tuple[Array, Array]:
  """Slot j: the mean of the member points labelled j (f32[C, H]), and whether it has any (bool[C]).

  Rows off ``members`` never reach a mean, not even a NaN one (a client left
  out for a non-finite update): a weight of 0 would keep it (0 * NaN = NaN).
  """
  n = points.shape[0]
  onehot = jax.nn.one_hot(labels, n, dtype=points.dtype) * members[:, None]
  count = jnp.sum(onehot, axis=0)
  points = jnp.where(members[:, None], points, 0.0)
  return onehot.T @ points / jnp.maximum(count, 1.0)[:, None], count > 0


def finch(points: Array, valid: Array) -> Array:
  """FINCH's last partition of the valid points, with fixed shapes.

  Level 0 is the first-neighbour partition of the points; each further level
  takes the first-neighbour partition of the current clusters' means and is
  kept while it has more than one cluster and fewer than the level before
  (the reference code drops a level that reaches one cluster or merges
  nothing, and stops there; level 0 is kept in any case). Each kept level at
  least halves the clusters, so ceil(log2 C) levels after the first suffice;
  they run with a stop flag.

  Args:
    points: f32[C, H].  valid: bool[C].

  Returns:
    i32[C] each point's cluster, named by its smallest member's index.
  """
  n = points.shape[0]
  labels = first_neighbour_partition(points, valid)
  count = jnp.sum(valid & (labels == jnp.arange(n)))
  going = jnp.asarray(True)
  for _ in range(_closure_steps(n)):
    means, exists = _cluster_means(points, valid, labels)
    merged = first_neighbour_partition(means, exists)[labels]
    merged_count = jnp.sum(valid & (merged == jnp.arange(n)))
    going = going & (merged_count > 1) & (merged_count < count)
    labels = jnp.where(going, merged, labels)
    count = jnp.where(going, merged_count, count)
  return labels


def class_clusters(prototypes: Array, present: Array) -> tuple[Array, Array]:
  """Per class, FINCH over the clients' prototypes and the L2-normalised means of its clusters.

  Args:
    prototypes: f32[C, K, H] every client's class prototypes.
    present: bool[C, K] client k's prototype of class c counts (it holds the
      class and took part).

  Returns:
    (clusters f32[K, C, H], valid bool[K, C]): for class c, slot j holds the
    normalised raw mean of the cluster whose smallest member is client j. A
    class held by one client gives its prototype (normalised); by none,
    nothing.
  """
  def one_class(points, valid):
    means, exists = _cluster_means(points, valid, finch(points, valid))
    return _normalise(means), exists & valid
  return jax.vmap(one_class, in_axes=(1, 1))(prototypes, present)


def enqueue(queue: Queue, rows: Array, labels: Array, valid: Array) -> Queue:
  """Writes the valid rows into the circular queue, in order, from its pointer on.

  Args:
    queue: the ``Queue`` (Q rows).
    rows: f32[M, H] candidates, e.g. ``class_clusters``' flattened class-major.
    labels: i32[M] their classes.
    valid: bool[M] which are written.

  Returns:
    The queue with the r-th valid row at (pointer + r) mod Q and the pointer
    moved on by their count (mod Q). When more than Q are valid, only the
    last Q are written (each row once: what a FIFO of size Q would keep).
  """
  size = queue.memory.shape[0]
  rank = jnp.cumsum(valid) - 1
  total = jnp.sum(valid)
  write = valid & (rank >= total - size)
  # Rows not written go to index Q, out of range, which the scatter drops.
  at = jnp.where(write, (queue.pointer + rank) % size, size)
  return Queue(queue.memory.at[at].set(rows, mode="drop"),
               queue.labels.at[at].set(labels, mode="drop"),
               ((queue.pointer + total) % size).astype(jnp.int32))


def knn_scores(hidden: Array, queue: Queue, num_classes: int, k: int = 40,
               temperature: float = 0.1) -> Array:
  """FGGP's k-nearest-prototype class scores of nodes (``MomentumQueue.forward``).

  Args:
    hidden: f32[N, H] node features of the global model.
    queue: the prototype ``Queue`` (Q rows; k is capped at Q).
    num_classes: K, static.
    k: neighbours, static.
    temperature: of the softmax over the k cosine similarities.

  Returns:
    f32[N, K]: ``min(sum_j softmax(sim_topk / temperature)_j [label_j = c]
    + 1e-5, 1)``; the argmax is the prediction.
  """
  similarity = _normalise(hidden) @ queue.memory.T  # the memory rows are (mostly) normalised
  top, index = jax.lax.top_k(similarity, min(k, queue.memory.shape[0]))
  weights = jax.nn.softmax(top / temperature, axis=-1)
  votes = jax.nn.one_hot(queue.labels[index], num_classes, dtype=weights.dtype)
  return jnp.minimum(jnp.einsum("nk,nkc->nc", weights, votes) + 1e-5, 1.0)
