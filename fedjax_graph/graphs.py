"""Padded graph shards: GCN normalisation, padding with jraph, size buckets.

Everything here except ``propagate`` runs once on the host with numpy, so that
every shape the simulation sees is fixed before the first compile.

References:
  Kipf & Welling, "Semi-Supervised Classification with Graph Convolutional
  Networks", ICLR 2017, eq. (2): the normalised adjacency D^-1/2 (A+I) D^-1/2.
"""

import itertools
import warnings
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import scipy.sparse
from jax.experimental import sparse as jsparse

from fedjax_graph.types import Array, Shard


class CSRGraph(NamedTuple):
  """The normalised adjacency D^-1/2 (A+I) D^-1/2 of one graph in CSR form.

  Used for a graph that every model in a batch shares (the evaluation graph):
  propagation is then one sparse-dense product with all models' features side
  by side, which XLA runs as a single CSR kernel call.

  Attributes:
    data: f32[nnz] normalised weights (self-loops included).
    indices: i32[nnz] column (sender) of each entry.
    indptr: i32[N+1] row (receiver) pointers; padding rows are empty.
  """
  data: Array
  indices: Array
  indptr: Array


def gcn_weights(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
  """Weights of D^-1/2 (A+I) D^-1/2 for a graph whose edges come in both directions.

  Args:
    edge_index: int[2, E] directed edges (sender row 0, receiver row 1), no self-loops.
    num_nodes: N.

  Returns:
    edge_weight f32[E] = 1/sqrt(d_s d_r) and self_weight f32[N] = 1/d, where d
    is the in-degree plus one for the self-loop, so an isolated node has d = 1
    and no division by zero can occur.
  """
  deg = np.bincount(edge_index[1], minlength=num_nodes).astype(np.float64) + 1.0
  inv_sqrt = 1.0 / np.sqrt(deg)
  edge_weight = inv_sqrt[edge_index[0]] * inv_sqrt[edge_index[1]]
  return edge_weight.astype(np.float32), (1.0 / deg).astype(np.float32)


def csr_graph(edge_index: np.ndarray, num_nodes: int, num_rows: int) -> CSRGraph:
  """``CSRGraph`` of a graph with ``num_nodes`` real nodes padded to ``num_rows`` (host).

  Args:
    edge_index: int[2, E] directed edges, both directions, no self-loops.
    num_nodes: N real nodes.
    num_rows: padded row count >= N; the extra rows are empty.
  """
  edge_weight, self_weight = gcn_weights(edge_index, num_nodes)
  nodes = np.arange(num_nodes)
  matrix = scipy.sparse.csr_matrix(
      (np.concatenate([edge_weight, self_weight]),
       (np.concatenate([edge_index[1], nodes]), np.concatenate([edge_index[0], nodes]))),
      shape=(num_rows, num_rows), dtype=np.float32)
  matrix.sort_indices()
  return CSRGraph(data=matrix.data, indices=matrix.indices.astype(np.int32),
                  indptr=matrix.indptr.astype(np.int32))


def _sparse_product(h: Array, data: Array, indices: Array, indptr: Array) -> Array:
  matrix = jsparse.BCSR((data, indices, indptr), shape=(indptr.shape[0] - 1, h.shape[0]))
  return matrix @ h


_csr_matmul = jax.custom_batching.custom_vmap(_sparse_product)


def _block_diagonal(axis_size, in_batched, h, data, indices, indptr):
  """A batch of B graphs as one block-diagonal CSR matrix, h [B, N, W] as [B N, W]."""
  h_batched, *graph_batched = in_batched
  rows = indptr.shape[-1] - 1
  grow = lambda leaf, batched: leaf if batched else jnp.broadcast_to(
      leaf, (axis_size,) + leaf.shape)
  h, data, indices, indptr = (grow(leaf, b) for leaf, b in
                              zip((h, data, indices, indptr), in_batched))
  nnz = data.shape[-1]
  block = jnp.arange(axis_size, dtype=indices.dtype)[:, None]
  flat_indptr = jnp.concatenate([(indptr[:, :-1] + block * nnz).reshape(-1),
                                 jnp.full((1,), axis_size * nnz, indptr.dtype)])
  return (h.reshape((axis_size * rows,) + h.shape[2:]), data.reshape(-1),
          (indices + block * rows).reshape(-1), flat_indptr)


@_csr_matmul.def_vmap
def _csr_matmul_vmap(axis_size, in_batched, h, data, indices, indptr):
  h_batched, *graph_batched = in_batched
  if any(graph_batched):
    # A batch of graphs (a size bucket's clients): one product with their
    # block-diagonal matrix, i.e. one CSR kernel call for the whole batch (a
    # vmapped sparse product would run graph by graph).
    flat_h, *flat_graph = _block_diagonal(axis_size, in_batched, h, data, indices, indptr)
    out = _csr_matmul(flat_h, *flat_graph)
    return out.reshape((axis_size, indptr.shape[-1] - 1) + out.shape[1:]), True
  if not h_batched:
    return _csr_matmul(h, data, indices, indptr), False
  # A batch of models over one shared graph: put the models side by side in
  # the feature axis, A @ [h_1 | ... | h_B], so one CSR kernel call serves all.
  side_by_side = jnp.moveaxis(h, 0, 1)
  flat = side_by_side.reshape(side_by_side.shape[0], -1)
  out = _csr_matmul(flat, data, indices, indptr).reshape(side_by_side.shape)
  return jnp.moveaxis(out, 1, 0), True


@jax.custom_vjp
def _symmetric_csr_matmul(h, data, indices, indptr):
  return _csr_matmul(h, data, indices, indptr)


def _symmetric_fwd(h, data, indices, indptr):
  return _csr_matmul(h, data, indices, indptr), (data, indices, indptr)


def _symmetric_bwd(graph, cotangent):
  # d(A h)/dh^T g = A^T g = A g: a client's normalised adjacency is symmetric
  # (undirected graph, D^-1/2 (A+I) D^-1/2). The graph's weights are data, not
  # parameters: no cotangent for them.
  return (_csr_matmul(cotangent, *graph), None, None, None)


_symmetric_csr_matmul.defvjp(_symmetric_fwd, _symmetric_bwd)


def row_pointers(sorted_rows: Array, num_rows: int) -> Array:
  """i32[N + 1] CSR row pointers of entries whose rows ``sorted_rows`` i32[nnz] are ascending."""
  return jnp.searchsorted(sorted_rows, jnp.arange(num_rows + 1), side="left").astype(jnp.int32)


class Transposed(NamedTuple):
  """Where a CSR matrix's entries go in its transpose (``transposed_layout``).

  Attributes:
    order: i32[nnz] the matrix's entries (row-sorted order) sorted by column.
    indices: i32[nnz] their rows, in that order (the transpose's columns).
    indptr: i32[N + 1] the transpose's row pointers.
  """
  order: Array
  indices: Array
  indptr: Array


def transposed_layout(rows: Array, indices: Array, num_rows: int) -> Transposed:
  """The ``Transposed`` of a square CSR matrix's structure: its entries' ``rows`` i32[nnz]
  (row-sorted) and columns ``indices`` (a sort of the nnz columns)."""
  order = jnp.argsort(indices, stable=True)
  return Transposed(order.astype(jnp.int32), rows[order], row_pointers(indices[order], num_rows))


@jax.custom_vjp
def _directed_csr_matmul(h, data, indices, indptr, t_order, t_indices, t_indptr):
  return _csr_matmul(h, data, indices, indptr)


def _directed_fwd(h, data, indices, indptr, t_order, t_indices, t_indptr):
  return _csr_matmul(h, data, indices, indptr), (data, t_order, t_indices, t_indptr)


def _directed_bwd(residuals, cotangent):
  data, t_order, t_indices, t_indptr = residuals
  # A^T g, with A^T's entries in its own row order: no symmetry assumed.
  return (_csr_matmul(cotangent, data[t_order], t_indices, t_indptr),) + (None,) * 6


_directed_csr_matmul.defvjp(_directed_fwd, _directed_bwd)


def directed_csr_product(h: Array, graph: CSRGraph, transposed: Transposed) -> Array:
  """``graph @ h``, f32[N, W], for any square CSR matrix, differentiable in ``h``.

  The gradient is the transpose's product (``transposed``:
  ``transposed_layout(rows, graph.indices, N)``), so the matrix need
  not be symmetric (an edge list with one direction of a pair dropped); none
  flows to the entries.
  """
  return _directed_csr_matmul(h, *graph, *transposed)


# Edges per block of ``edge_dot``: the block's gathered rows stay in cache.
EDGE_BLOCK = 2048


def _edge_dot_forward(a, b, senders, receivers):
  a, b = jnp.asarray(a), jnp.asarray(b)  # numpy rows cannot take traced indices
  n_edge = senders.shape[0]
  grow = (-n_edge) % EDGE_BLOCK
  blocks = lambda idx: jnp.pad(jnp.asarray(idx), (0, grow)).reshape(-1, EDGE_BLOCK)
  dots = jax.lax.map(lambda sr: jnp.sum(a[sr[0]] * b[sr[1]], axis=-1),
                     (blocks(senders), blocks(receivers)))
  return dots.reshape(-1)[:n_edge]


def _by_row(rows, cols, values, num_rows):
  """(data, indices, indptr) of the N x N matrix with ``values`` at (rows, cols)."""
  rows, cols = jnp.asarray(rows), jnp.asarray(cols)
  order = jnp.argsort(rows, stable=True)
  return values[order], cols[order].astype(jnp.int32), row_pointers(rows[order], num_rows)


@jax.custom_vjp
def edge_dot(a: Array, b: Array, senders: Array, receivers: Array) -> Array:
  """f32[E] ``<a[senders_e], b[receivers_e]>`` for node rows a, b f32[N, H], without an [E, H] copy.

  The edges run in blocks of ``EDGE_BLOCK`` (a gather of every edge's rows
  at once writes E x H floats, 6-8x slower on CPU); the gradient is two CSR
  products (g's entries sorted by sender, then by receiver), not a
  scatter per edge. Indices must be in [0, N).

  Raises:
    ValueError: if ``a`` and ``b`` differ in shape.
  """
  if a.shape != b.shape:
    raise ValueError(f"edge_dot: a {a.shape} and b {b.shape} must have the same shape")
  return _edge_dot_forward(a, b, senders, receivers)


def _edge_dot_fwd(a, b, senders, receivers):
  return _edge_dot_forward(a, b, senders, receivers), (a, b, senders, receivers)


def _edge_dot_bwd(residuals, cotangent):
  a, b, senders, receivers = residuals
  n = a.shape[0]
  d_a = _csr_matmul(b, *_by_row(senders, receivers, cotangent, n))
  d_b = _csr_matmul(a, *_by_row(receivers, senders, cotangent, n))
  return d_a, d_b, None, None


edge_dot.defvjp(_edge_dot_fwd, _edge_dot_bwd)


class LearnedCSR(NamedTuple):
  """A symmetric matrix in CSR form whose entries are differentiable: a learned graph's operator.

  As ``CSRGraph`` (``data`` f32[nnz], ``indices`` i32[nnz], ``indptr``
  i32[N + 1]); ``propagate`` then returns gradients for ``data`` too
  (FGGP's sampled second view, whose edge weights come from its augmentor).
  """
  data: Array
  indices: Array
  indptr: Array


@jax.custom_vjp
def _learned_csr_matmul(h, data, indices, indptr):
  return _csr_matmul(h, data, indices, indptr)


def _learned_fwd(h, data, indices, indptr):
  return _csr_matmul(h, data, indices, indptr), (h, data, indices, indptr)


def _learned_bwd(residuals, cotangent):
  h, data, indices, indptr = residuals
  rows = jnp.repeat(jnp.arange(indptr.shape[0] - 1, dtype=indices.dtype), jnp.diff(indptr),
                    total_repeat_length=indices.shape[0])
  # d<g, A h>/dA_rc = <g_r, h_c>: one dot per entry; A^T = A for the rest.
  return (_csr_matmul(cotangent, data, indices, indptr),
          _edge_dot_forward(cotangent, h, rows, indices), None, None)


_learned_csr_matmul.defvjp(_learned_fwd, _learned_bwd)


class DenseAdjacency(NamedTuple):
  """A client's normalised adjacency D^-1/2 (A+I) D^-1/2 as a dense block.

  Attributes:
    matrix: f32[..., N, N], row = receiver, column = sender; padding rows and
      columns are 0.
  """
  matrix: Array


Graph = Union[Shard, CSRGraph]
Operator = Union[DenseAdjacency, CSRGraph]

PROPAGATION = ("auto", "dense", "csr", "sparse")
"""Values of ``Config.propagation``: how a client's training step propagates (``operator_kind``)."""

# ``auto`` takes the dense block when N^2 <= DENSE_RATIO * nnz (nnz = E + N
# entries of the CSR form, self-loops included) and the bucket's blocks fit in
# DENSE_MAX_BYTES. Measured on this project's 2-core CPU (jax 0.10, forward +
# backward of one propagation, 2 models side by side, width 128, the Twitch S3
# and WikiNet buckets): the dense batched matmul ran at 29-39 GFLOP/s, the
# block-diagonal CSR product at 0.55-2.3 ns per entry and feature, the
# gather/segment-sum at 23-35 ns; so dense wins below N^2/nnz ~ 10-40 and the
# CSR form wins on every real bucket (N^2/nnz = 68-391), 4-15x faster than
# dense and 10-20x faster than the gather/segment-sum.
DENSE_RATIO = 16
DENSE_MAX_BYTES = 256 * 2**20


def operator_kind(mode: str, n_node: int, n_edge: int, num_graphs: int) -> str:
  """How a size bucket's client graphs propagate in training (host, static shapes only).

  Args:
    mode: one of ``PROPAGATION``: ``dense`` (a dense block per client, a
      batched matmul), ``csr`` (a CSR matrix per client, the bucket's clients
      as one block-diagonal CSR product), ``sparse`` (the padded edge list,
      gather and segment-sum: no operator), ``auto`` (dense when N^2 <=
      ``DENSE_RATIO`` (E + N) and ``num_graphs`` N^2 f32 fit in
      ``DENSE_MAX_BYTES``, else csr; see the measurements above them).
    n_node, n_edge: the bucket's padded node and edge counts N, E.
    num_graphs: how many graphs the bucket holds (seeds x clients).

  Returns:
    ``dense``, ``csr`` or ``sparse``.

  Raises:
    ValueError: for a ``mode`` not in ``PROPAGATION``.
  """
  if mode not in PROPAGATION:
    raise ValueError(f"propagation = {mode!r}; must be one of {list(PROPAGATION)}")
  if mode != "auto":
    return mode
  small = n_node * n_node <= DENSE_RATIO * (n_edge + n_node)
  fits = 4 * num_graphs * n_node * n_node <= DENSE_MAX_BYTES
  return "dense" if small and fits else "csr"


def _entries(senders, receivers, edge_weight, self_weight, xp):
  """(rows, columns, values) of the padded graph's matrix: its edges, then the self-loops."""
  nodes = xp.arange(self_weight.shape[-1], dtype=senders.dtype)
  return (xp.concatenate([receivers, nodes]), xp.concatenate([senders, nodes]),
          xp.concatenate([edge_weight, self_weight]))


def make_operator(shard: Shard, kind: str, xp=jnp) -> Optional[Operator]:
  """The training propagation operator of one unbatched padded shard (``operator_kind``).

  The matrix is D^-1/2 (A+I) D^-1/2 with the shard's own weights: entry
  (receiver, sender) = edge weight, diagonal = self weight; padding edges
  (weight 0, at the last node, a padding row) add nothing. The CSR form has
  E + N entries, row-sorted (a stable sort: edges in their order, then the
  self-loop), so every shard of a bucket has the same nnz.

  Args:
    shard: one client's ``Shard`` without a leading axis.
    kind: ``dense``, ``csr`` or ``sparse`` (None: no operator).
    xp: ``numpy`` (on the host, once) or ``jax.numpy`` (in a compiled round:
      ``simulation.take_slots``); both give the same arrays.

  Returns:
    A ``DenseAdjacency``, a ``CSRGraph`` or None.
  """
  if kind == "sparse":
    return None
  n = shard.self_weight.shape[-1]
  rows, cols, values = _entries(shard.senders, shard.receivers, shard.edge_weight,
                                shard.self_weight, xp)
  if kind == "dense":
    if xp is np:
      matrix = np.zeros((n, n), np.float32)
      np.add.at(matrix, (rows, cols), values)
    else:
      matrix = jnp.zeros((n, n), values.dtype).at[rows, cols].add(values)
    return DenseAdjacency(matrix)
  order = (np.argsort(rows, kind="stable") if xp is np else jnp.argsort(rows, stable=True))
  indptr = xp.searchsorted(rows[order], xp.arange(n + 1), side="left")
  return CSRGraph(data=values[order].astype(xp.float32), indices=cols[order].astype(xp.int32),
                  indptr=indptr.astype(xp.int32))


def kind_of(operator: Optional[Operator]) -> str:
  """``dense``, ``csr`` or ``sparse``: the kind of a shard's ``operator`` (``make_operator``)."""
  if operator is None:
    return "sparse"
  return "dense" if isinstance(operator, DenseAdjacency) else "csr"


def with_operator(shard: Shard, kind: str) -> Shard:
  """Stacked numpy shards (leaves [..., N, ...]) with their ``operator`` of ``kind`` (host)."""
  if kind == "sparse":
    return shard._replace(operator=None)
  lead = shard.x.shape[:-2]
  flat = jax.tree.map(lambda leaf: leaf.reshape((-1,) + leaf.shape[len(lead):]),
                      shard._replace(operator=None))
  ops = [make_operator(jax.tree.map(lambda leaf: leaf[i], flat), kind, np)
         for i in range(flat.x.shape[0])]
  stacked = jax.tree.map(lambda *leaves: np.stack(leaves).reshape(lead + leaves[0].shape), *ops)
  return shard._replace(operator=stacked)


def pad_operator(operator: Optional[Operator], n_node: int, n_edge: int
                 ) -> Optional[Operator]:
  """Stacked operators (leading axis k) of graphs padded to ``n_node`` rows and ``n_edge`` edges.

  The matrix of the graph padded as ``simulation._pad_shard`` pads it (new
  rows empty): a dense block grows by zero rows and columns; a CSR form gets
  ``(n_edge + n_node) - nnz`` zero entries, all in the last (padding) row,
  as ``make_operator`` places the padding edges. Same product on every row as
  ``make_operator`` of the padded shard, without rebuilding it.

  Args:
    operator: None, a ``DenseAdjacency`` with matrix f32[k, N, N] or a
      ``CSRGraph`` with leaves [k, E + N] and [k, N + 1].
    n_node, n_edge: the padded sizes, >= the graphs' N and E.
  """
  if operator is None:
    return None
  if isinstance(operator, DenseAdjacency):
    grow = n_node - operator.matrix.shape[-1]
    return DenseAdjacency(jnp.pad(operator.matrix, [(0, 0), (0, grow), (0, grow)]))
  extra = n_edge + n_node - operator.data.shape[-1]
  nnz = operator.indptr[:, -1:]  # the graph's entries, its padding edges included
  new_rows = n_node + 1 - operator.indptr.shape[-1]
  indptr = jnp.concatenate([operator.indptr[:, :-1],
                            jnp.broadcast_to(nnz, (nnz.shape[0], new_rows)), nnz + extra], axis=-1)
  return CSRGraph(data=jnp.pad(operator.data, [(0, 0), (0, extra)]),
                  indices=jnp.pad(operator.indices, [(0, 0), (0, extra)],
                                  constant_values=n_node - 1),
                  indptr=indptr)


def csr_product(h: Array, graph: CSRGraph) -> Array:
  """``graph @ h``, f32[N, W], for a SYMMETRIC matrix in CSR form, differentiable in ``h``.

  The gradient is the same product (A^T = A), none flows to the matrix's
  entries. Batched (vmap) graphs run as one block-diagonal product, a batch
  of ``h`` over one graph as one product of the side-by-side features.
  """
  return _symmetric_csr_matmul(h, *graph)


def propagate(h: Array, graph: Graph) -> Array:
  """One GCN propagation D^-1/2 (A+I) D^-1/2 h on a padded graph.

  Args:
    h: f32[N, H] node states.
    graph: an unbatched ``Shard`` (padding edges have weight 0 and padding rows
      self-weight 0, so padding contributes nothing to real rows), or a
      ``CSRGraph`` (not differentiable; for inference on a shared graph).
      A ``Shard`` with an ``operator`` propagates with it: a dense block, a
      matmul; a CSR matrix, a sparse product whose gradient in ``h`` is the
      same product (the matrix is symmetric), none in the graph's weights
      but for a ``LearnedCSR``; without one, a gather over the edges and a
      segment-sum.

  Returns:
    f32[N, H]; zero on padding rows.
  """
  if isinstance(graph, CSRGraph):
    return _csr_matmul(h, *graph)
  operator = graph.operator
  if isinstance(operator, DenseAdjacency):
    return operator.matrix @ h
  if isinstance(operator, CSRGraph):
    return csr_product(h, operator)
  if isinstance(operator, LearnedCSR):
    return _learned_csr_matmul(h, *operator)
  messages = h[graph.senders] * graph.edge_weight[:, None]
  return jax.ops.segment_sum(messages, graph.receivers, num_segments=h.shape[0]) + (
      graph.self_weight[:, None] * h)


def padding_budget(n: int, multiple: int = 8) -> int:
  """Smallest multiple of ``multiple`` strictly above ``n`` (jraph needs one padding node)."""
  return (n // multiple + 1) * multiple


def pad_graph(x: np.ndarray, y: np.ndarray, edge_index: np.ndarray, masks: dict[str, np.ndarray],
              node_domain: np.ndarray, num_domains: int, n_node: int, n_edge: int) -> Shard:
  """Pads one graph to ``n_node`` nodes and ``n_edge`` edges with jraph (host).

  Args:
    x: f32[N, F] features.  y: int[N] labels.  edge_index: int[2, E].
    masks: bool[N] arrays under the keys ``train``, ``val``, ``test``.
    node_domain: int[N] domain index of each node.
    num_domains: D, written on padding rows of ``node_domain``.
    n_node: padded node count, > N.  n_edge: padded edge count, >= E.

  Returns:
    A numpy ``Shard`` without a leading axis.

  Raises:
    RuntimeError: (from jraph) if the budget is too small.
  """
  num_nodes = x.shape[0]
  edge_weight, self_weight = gcn_weights(edge_index, num_nodes)
  graph = jraph.GraphsTuple(
      nodes=dict(x=x.astype(np.float32), y=y.astype(np.int32), self_weight=self_weight,
                 node_domain=node_domain.astype(np.int32),
                 **{k: masks[k].astype(bool) for k in ("train", "val", "test")}),
      edges=dict(weight=edge_weight),
      senders=edge_index[0].astype(np.int32), receivers=edge_index[1].astype(np.int32),
      n_node=np.array([num_nodes], np.int32), n_edge=np.array([edge_index.shape[1]], np.int32),
      globals=None)
  padded = jraph.pad_with_graphs(graph, n_node=n_node, n_edge=n_edge)
  real = np.arange(n_node) < num_nodes
  nodes = padded.nodes
  return Shard(x=nodes["x"], y=nodes["y"], senders=np.asarray(padded.senders),
               receivers=np.asarray(padded.receivers), edge_weight=padded.edges["weight"],
               self_weight=nodes["self_weight"], train=nodes["train"], val=nodes["val"],
               test=nodes["test"],
               node_domain=np.where(real, nodes["node_domain"], num_domains).astype(np.int32))


def stack(shards: Sequence[Shard]) -> Shard:
  """Stacks equally padded shards along a new leading axis (host)."""
  return jax.tree.map(lambda *leaves: np.stack(leaves), *shards)


def size_buckets(sizes: Sequence[int], max_buckets: int, min_saving: float = 0.1) -> list[list[int]]:
  """Groups clients into at most ``max_buckets`` buckets of similar size.

  Sizes are sorted and cut into contiguous runs; the cut points minimise the
  padded total sum(len(bucket) * max(bucket)), the work a vmap over each bucket
  does. One more bucket is taken only if it saves more than ``min_saving`` of
  the padded total, since each bucket is a separate batched computation.
  Exhaustive over cut points, cheap for the tens of clients of a cross-silo
  federation.

  Args:
    sizes: the size (node count) of each client.
    max_buckets: the most buckets allowed, >= 1.
    min_saving: the fraction of padded work an extra bucket must save.

  Returns:
    Lists of client indices, one per bucket, smallest clients first.

  Raises:
    ValueError: if ``max_buckets`` < 1 or there are no clients.
  """
  if max_buckets < 1:
    raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
  if not sizes:
    raise ValueError("no clients to bucket")
  order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
  ordered = [sizes[i] for i in order]

  def padded_total(bounds):
    return sum((hi - lo) * ordered[hi - 1] for lo, hi in zip(bounds, bounds[1:]))

  best = (0, len(sizes))
  for num_cuts in range(1, min(max_buckets, len(sizes))):
    bounds = min(((0,) + cuts + (len(sizes),)
                  for cuts in itertools.combinations(range(1, len(sizes)), num_cuts)),
                 key=padded_total)
    if padded_total(bounds) < (1 - min_saving) * padded_total(best):
      best = bounds
  return [order[lo:hi] for lo, hi in zip(best, best[1:])]


def check_domain_graphs(domain_graphs: Mapping[str, Mapping[str, np.ndarray]],
                        domains: Sequence[str]) -> Mapping[str, Mapping[str, np.ndarray]]:
  """Checks user-supplied domain graphs and cleans their edges (host, once).

  ``gcn_weights`` and ``propagate`` take a simple undirected graph: every edge
  in both directions, once, and no self-loop (the normalisation adds I
  itself). ``data_prep`` builds its graphs so; graphs given to
  ``data.build_federation`` directly are held to the same rules here:

  * self-loops and duplicate edges are removed, with a ``UserWarning`` that
    counts them (a self-loop would count twice in D^-1/2 (A+I) D^-1/2, a
    duplicate would double its edge's weight and its nodes' degrees);
  * a one-way edge (u -> v without v -> u) is an error: whether a directed
    graph may be made undirected is the caller's decision (to do so, add the
    reverse edges, ``np.concatenate([ei, ei[::-1]], axis=1)``; the duplicates
    this makes are removed);
  * ``x`` must be [N, F], ``y`` integer labels >= 0 [N], ``edge_index`` an
    integer [2, E] array of node ids in [0, N).

  Args:
    domain_graphs: ``{domain: {"x": f32[N, F], "y": i32[N], "edge_index": i32[2, E]}}``.
    domains: the domains to check; those absent are left to the caller to report.

  Returns:
    ``domain_graphs`` itself when every graph is clean, else a copy in which
    each cleaned graph has a new ``edge_index`` (the first of each edge kept,
    in the given order).

  Raises:
    ValueError: naming the domain, the array and what is wrong with it.
  """
  cleaned = {}
  for domain in domains:
    if domain in domain_graphs:
      graph = domain_graphs[domain]
      edge_index = _clean_edges(domain, graph)
      if edge_index is not graph["edge_index"]:
        cleaned[domain] = {**graph, "edge_index": edge_index}
  return {**domain_graphs, **cleaned} if cleaned else domain_graphs


def _clean_edges(domain: str, graph: Mapping[str, np.ndarray]) -> np.ndarray:
  """``graph``'s edge_index without self-loops and duplicates (itself if it has none)."""
  missing = [k for k in ("x", "y", "edge_index") if k not in graph]
  if missing:
    raise ValueError(f"graph of domain {domain!r} has no {missing}; it needs x, y and edge_index")
  x, y, edge_index = (np.asarray(graph[k]) for k in ("x", "y", "edge_index"))
  if x.ndim != 2:
    raise ValueError(f"{domain}: x has shape {x.shape}; must be [N, F]")
  n = x.shape[0]
  if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer) or (n and y.min() < 0):
    raise ValueError(f"{domain}: y is {y.dtype}{list(y.shape)}; must be integer labels >= 0 of "
                     f"shape [{n}] (one per row of x)")
  if edge_index.ndim != 2 or edge_index.shape[0] != 2 or not (
      np.issubdtype(edge_index.dtype, np.integer) or edge_index.size == 0):
    raise ValueError(f"{domain}: edge_index is {edge_index.dtype}{list(edge_index.shape)}; "
                     "must be integers of shape [2, E] (senders, receivers)")
  if edge_index.size and (edge_index.min() < 0 or edge_index.max() >= n):
    bad = edge_index[(edge_index < 0) | (edge_index >= n)][0]
    raise ValueError(f"{domain}: edge_index holds node id {bad}; must be in [0, {n})")
  src, dst = edge_index.astype(np.int64)
  keys = src * n + dst
  proper = np.flatnonzero(src != dst)
  _, first = np.unique(keys[proper], return_index=True)
  kept = np.sort(proper[first])
  one_way = ~np.isin(dst[kept] * n + src[kept], keys[kept])
  if one_way.any():
    e = kept[np.argmax(one_way)]
    raise ValueError(f"{domain}: {int(one_way.sum())} edge(s) of edge_index have no reverse, e.g. "
                     f"{src[e]} -> {dst[e]}; graphs must be undirected, every edge in both "
                     "directions (to make it so, add the reversed edges: np.concatenate("
                     "[edge_index, edge_index[::-1]], axis=1); duplicates are then removed)")
  loops, duplicates = len(keys) - len(proper), len(proper) - len(kept)
  if not loops and not duplicates:
    return edge_index
  warnings.warn(f"{domain}: removed {loops} self-loop(s) and {duplicates} duplicate edge(s) "
                "from edge_index (the GCN normalisation adds each node's self-loop itself)",
                stacklevel=4)  # the caller of build_federation
  return edge_index[:, kept]
