"""SFPD: FedSPA's spectral-filter, typed-edge backbone (``models.BACKBONES["sfpd"]``).

Each layer (FedSPA paper, Sec. 3; its code's ``GraphConvolution`` with
``model_type="acm_spa"``) computes, for node states H f32[N, F_in]:

  * three channels, L = ReLU(A_lo H W_lo) (low-pass), Hh = ReLU(A_hi H W_hi)
    (high-pass) and M = ReLU(H W_mlp), with A_lo = D~^-1 (A + I) row-normalised
    (D~ = degree + 1) and A_hi = I - A_lo;
  * the neighbour sums of L and Hh split by edge type: with ``neighbours =
    "sum"`` (the code's ``agg_func_spa``, ``.sum(1)``) unnormalised,
    N_t[v] = sum over edges u -> v of type t of L[u] (and of Hh[u]); with
    ``"mean"`` (the default) each term weighted by A_lo's 1/(deg_v + 1), so
    the three typed channels add up to the neighbour part of A_lo L and stay
    on the scale of L and Hh. Types from the TRAINING labels: ``be`` both
    endpoints are training nodes with the same label, ``fr`` both training
    nodes with different labels, ``unk`` otherwise;
  * attention over the 7 channels C = [N_lo_fr, N_hi_fr, N_lo_be, N_hi_be,
    N_lo_unk, N_hi_unk, M]: per channel the score C_c a_c (a_c f32[H', 1]),
    ``att = softmax(sigmoid(scores) @ W_7x7 / 7)`` and the output
    ``7 * sum_c att_c C_c``. The unk channels have no attention vector of
    their own: their scores mix those of fr and be with a gate
    b = sigmoid(Dense_{H'->1}(N_unk)), ``b_1 N_lo_unk a_lo_fr + (1 - b_1)
    N_lo_unk a_lo_be`` and ``b_2 N_hi_unk a_hi_fr + (1 - b_2) N_hi_unk
    a_hi_be`` (the code's form whenever attention lists are passed, i.e. in
    every training step; its ``N_hi_fr`` in the second term is a typo, not
    reproduced). One gate layer serves both, as in the code.

``mean`` departs from the code: on WikiNet (dense SVD features, degrees up
to 3546) the unnormalised sums give logits of ~1e7 after two layers (first
training loss 3e7) and the model predicts one class per domain (FedSPA, 30
rounds, seed 0: AVG test accuracy 16.9 % with ``sum``, 38.9 % with ``mean``;
issue 11); ``sum`` is kept to reproduce the code.

The net is ``dropout -> layer -> ReLU -> dropout -> layer`` (2 layers, hidden
128, dropout 0.1 in FedSPA's recipe), no batch norm; the last layer's output
are the logits. Kernels, attention vectors and W_7x7 are Xavier-uniform (the
code's constructors), the gate a Dense with a zero bias.

It propagates in training and at evaluation. In training the graph is the
client's padded ``Shard`` (its ``y`` and ``train`` give the edge types, so
only training labels are read); at evaluation a ``LabelledGraph``: the shared
CSR evaluation graph with the labels and training mask of the clients of each
domain (the fused evaluation of a domain's full graph types its edges with
the union of that domain's clients' training nodes, cross-client edges
included). Edge types are O(E) comparisons, computed once per forward and
shared by the layers (the code rebuilds a DGL block in every forward). Every
neighbour sum is a CSR sparse-dense product with a 0/1 indicator matrix
(``TypedEdges``; a shard's edges sorted by receiver in the step), not a
gather and segment-sum per edge: 3x faster per training step on WikiNet's
largest clients, the same values up to float rounding (issue 11).

References:
  Y. Tan, G. Wan, W. Huang, H. Li, X. Zhang, Y. Yang, M. Ye, "FedSPA:
  Generalizable Federated Graph Learning under Homophily Heterogeneity",
  CVPR 2025, pp. 15464-15475 (SFPD); code OakleyTan/FedSPA,
  Code/benchmark001/config.py. FGL_METHODS.md §5(b), (i).
"""

from typing import NamedTuple, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_graph import graphs
from fedjax_graph.graphs import CSRGraph
from fedjax_graph.models import dropout_keep_mask, effective_rate
from fedjax_graph.types import Array, Shard

EDGE_TYPES = ("fr", "be", "unk")
# How the typed neighbour sums are scaled (module docstring).
NEIGHBOURS = ("mean", "sum")
# The attention vectors whose Fisher information HBDA compares, by edge-type
# group (exact parameter names, not a substring match as in the code).
ATTENTION_GROUPS = {"fr": ("att_low_fr", "att_high_fr"), "be": ("att_low_be", "att_high_be")}


class LabelledGraph(NamedTuple):
  """A CSR graph with the labels SFPD types its edges by (the evaluation graph).

  Attributes:
    graph: the ``CSRGraph`` (self-loops included, as ``graphs.csr_graph``).
    y: i32[N] labels (read only where ``train``).
    train: bool[N] training nodes (the clients' training nodes).
  """
  graph: CSRGraph
  y: Array
  train: Array


class TypedEdges(NamedTuple):
  """A graph as SFPD reads it: CSR rows (one per receiver) with typed neighbour indicators.

  Every product with it is a CSR sparse-dense product (a gather and
  segment-sum per edge is ~10x slower on CPU, README "Message passing in
  training"). The types are symmetric in their endpoints, but a shard's
  edge list need not be (FGSSL's views drop directed edges one by one), so
  a shard's products take their gradient through the transpose
  (``transposed``, ``graphs.directed_csr_product``); the evaluation graph,
  symmetric and never differentiated, has none.

  Attributes:
    indices: i32[nnz] the sender (column) of each entry, entries grouped by
      receiver row.
    indptr: i32[N + 1] row pointers.
    types: f32[3, nnz] 1 where the entry is a neighbour edge of type fr, be,
      unk (``EDGE_TYPES``), 0 on self-loop entries and padding edges.
    inv_degree: f32[N] 1/(deg + 1), A_lo's row weight; 0 on padding rows.
    transposed: ``graphs.Transposed`` of the structure, or None (symmetric).
  """
  indices: Array
  indptr: Array
  types: Array
  inv_degree: Array
  transposed: Optional[graphs.Transposed] = None


def edge_types(senders: Array, receivers: Array, y: Array, train: Array) -> Array:
  """One-hot type f32[E, 3] (fr, be, unk) of edges u -> v from training labels.

  ``be``: both endpoints are training nodes with the same label; ``fr``: both
  training nodes, different labels; ``unk``: any other edge.
  """
  known = train[senders] & train[receivers]
  same = y[senders] == y[receivers]
  fr, be = known & ~same, known & same
  return jnp.stack([fr, be, ~known], axis=-1).astype(jnp.float32)


def typed_edges(graph: Union[Shard, LabelledGraph, None], num_nodes: int) -> Optional[TypedEdges]:
  """The ``TypedEdges`` of a padded client shard or a labelled CSR graph; None for no graph (no edges).

  A shard's edge list is sorted by receiver here (in the compiled step: a
  sort of E integers, small beside the products it serves), so padding,
  partial participation and rebuilt shards need no operator of their own.
  """
  if graph is None:
    return None
  if isinstance(graph, LabelledGraph):
    csr = graph.graph
    counts = jnp.diff(csr.indptr)  # entries per row: degree + 1 (the self-loop); 0 on padding
    receivers = jnp.repeat(jnp.arange(num_nodes, dtype=jnp.int32), counts,
                           total_repeat_length=csr.indices.shape[0])
    senders, indptr = csr.indices, csr.indptr
    real = senders != receivers  # a neighbour, not the self-loop entry
    inv_degree = jnp.where(counts > 0, 1.0 / jnp.maximum(counts, 1), 0.0)
    y, train = graph.y, graph.train
  else:
    order = jnp.argsort(graph.receivers, stable=True)
    senders, receivers = graph.senders[order], graph.receivers[order]
    indptr = graphs.row_pointers(receivers, num_nodes)
    # Padding and dropped edges have weight 0: no neighbour (the old edge-list
    # form typed every slot, so FGGP's unsampled pairs counted as neighbours).
    real = graph.edge_weight[order] > 0
    # A shard's self_weight is 1/(deg + 1) exactly, and 0 on padding rows.
    inv_degree, y, train = graph.self_weight, graph.y, graph.train
  types = edge_types(senders, receivers, y, train) * real[:, None].astype(jnp.float32)
  transposed = (None if isinstance(graph, LabelledGraph)
                else graphs.transposed_layout(receivers, senders, num_nodes))
  return TypedEdges(senders, indptr, types.T, inv_degree, transposed)


def _product(h: Array, edges: TypedEdges, weights: Array) -> Array:
  graph = CSRGraph(weights, edges.indices, edges.indptr)
  if edges.transposed is None:
    return graphs.csr_product(h, graph)
  return graphs.directed_csr_product(h, graph, edges.transposed)


def low_pass(h: Array, edges: Optional[TypedEdges]) -> Array:
  """A_lo h = D~^-1 (A + I) h, f32[N, H] (h itself without edges)."""
  if edges is None:
    return h
  neighbours = _product(h, edges, jnp.sum(edges.types, axis=0))
  return edges.inv_degree[:, None] * (neighbours + h)


def check_neighbours(neighbours: str) -> None:
  """Raises ValueError unless ``neighbours`` is one of ``NEIGHBOURS``."""
  if neighbours not in NEIGHBOURS:
    raise ValueError(f"neighbours = {neighbours!r}; choose 'mean' (each typed sum weighted by "
                     "1/(deg + 1), A_lo's weight) or 'sum' (unnormalised, FedSPA's code)")


def typed_sums(h: Array, edges: Optional[TypedEdges], neighbours: str = "mean") -> list[Array]:
  """[N_fr, N_be, N_unk], each f32[N, H]: the neighbour sums of ``h`` by edge type (0 without edges).

  ``neighbours``: ``sum``, N_t[v] = sum_{u -> v of type t} h[u]; ``mean``,
  each row times 1/(deg_v + 1), so N_fr + N_be + N_unk is A_lo h without
  its diagonal term.

  Raises:
    ValueError: for another ``neighbours``.
  """
  check_neighbours(neighbours)
  if edges is None:
    return [jnp.zeros_like(h) for _ in EDGE_TYPES]
  sums = [_product(h, edges, edges.types[t]) for t in range(len(EDGE_TYPES))]
  if neighbours == "mean":
    sums = [edges.inv_degree[:, None] * total for total in sums]
  return sums


class SFPDLayer(nn.Module):
  """One SFPD layer (module docstring): f32[N, F_in] -> f32[N, features].

  Attributes:
    features: output width.
    neighbours: ``mean`` or ``sum``, the typed sums' scaling (``typed_sums``).
  """
  features: int
  neighbours: str = "mean"

  @nn.compact
  def __call__(self, h: Array, edges: TypedEdges) -> Array:
    xavier = nn.initializers.xavier_uniform()
    kernel = lambda name: self.param(name, xavier, (h.shape[-1], self.features))
    vector = lambda name: self.param(name, xavier, (self.features, 1))
    w_low, w_high, w_mlp = kernel("w_low"), kernel("w_high"), kernel("w_mlp")
    # A(hW) = (Ah)W: propagate the narrower side.
    if h.shape[-1] <= self.features:
      low_h = low_pass(h, edges)
      low, high = low_h @ w_low, (h - low_h) @ w_high
    else:
      hw_high = h @ w_high
      low, high = low_pass(h @ w_low, edges), hw_high - low_pass(hw_high, edges)
    low, high, mlp = nn.relu(low), nn.relu(high), nn.relu(h @ w_mlp)
    # Low and high side by side: one product per edge type serves both.
    width = low.shape[-1]
    (low_fr, high_fr), (low_be, high_be), (low_unk, high_unk) = (
        (total[:, :width], total[:, width:])
        for total in typed_sums(jnp.concatenate([low, high], axis=-1), edges, self.neighbours))
    a = {name: vector(name) for group in ATTENTION_GROUPS.values() for name in group}
    gate = nn.Dense(1, name="balance", kernel_init=nn.initializers.variance_scaling(
        1 / 3, "fan_in", "uniform"))  # torch.nn.Linear's default range
    b_low, b_high = nn.sigmoid(gate(low_unk)), nn.sigmoid(gate(high_unk))
    scores = jnp.concatenate([
        low_fr @ a["att_low_fr"], high_fr @ a["att_high_fr"],
        low_be @ a["att_low_be"], high_be @ a["att_high_be"],
        b_low * (low_unk @ a["att_low_fr"]) + (1 - b_low) * (low_unk @ a["att_low_be"]),
        b_high * (high_unk @ a["att_high_fr"]) + (1 - b_high) * (high_unk @ a["att_high_be"]),
        mlp @ vector("att_mlp")], axis=-1)  # [N, 7]
    mix = self.param("att_mix", xavier, (7, 7))
    att = jax.nn.softmax(nn.sigmoid(scores) @ mix / 7, axis=-1)
    channels = jnp.stack([low_fr, high_fr, low_be, high_be, low_unk, high_unk, mlp], axis=1)
    return 7 * jnp.einsum("nc,nch->nh", att, channels)


class SFPD(nn.Module):
  """FedSPA's backbone: ``num_layers`` SFPD layers (module docstring).

  Attributes:
    num_classes: K.  hidden: width of the hidden layers.
    num_layers: SFPD layers in total (the last one's output are the logits).
    dropout: drop rate on the input and after each hidden ReLU in training.
    propagate_train, propagate_eval: with False the layers see no edges (an
      edgeless graph: A_lo = I, no neighbour sums); only the parameter
      initialisation uses that, where the graph is not needed.
    norm: must be ``none`` (SFPD has no batch norm).
    neighbours: ``mean`` (default) or ``sum``: how the typed neighbour sums
      are scaled (module docstring; FedSPA sets it, ``Method.model_options``).
  """
  num_classes: int
  hidden: int = 128
  num_layers: int = 2
  dropout: float = 0.1
  propagate_train: bool = True
  propagate_eval: bool = True
  norm: str = "none"
  neighbours: str = "mean"

  @nn.compact
  def __call__(self, x: Array, graph: Optional[Union[Shard, LabelledGraph]], train: bool,
               deterministic: bool = False, with_hidden: bool = False,
               groups: Optional[Array] = None, num_groups: int = 1):
    """Logits f32[N, K] for node features ``x`` f32[N, F] (``NodeClassifier``'s signature).

    ``graph``: the client's ``Shard`` (training) or a ``LabelledGraph``
    (evaluation). ``groups``/``num_groups`` are accepted and unused (no batch
    norm). With ``with_hidden``: ``(hidden f32[N, H], logits)``, hidden the
    first layer's ReLU output before dropout (``x`` with one layer).

    Raises:
      ValueError: if this configuration propagates and ``graph`` is None, or
        for a ``neighbours`` other than mean or sum.
    """
    check_neighbours(self.neighbours)
    propagates = self.propagate_train if train else self.propagate_eval
    if propagates and graph is None:
      raise ValueError("SFPD propagates here and needs a graph, got None")
    edges = typed_edges(graph if propagates else None, x.shape[0])

    def drop(h):
      if not train or deterministic or self.dropout == 0:
        return h
      keep = dropout_keep_mask(self.make_rng("dropout"), h.shape, self.dropout)
      return jnp.where(keep, h / (1 - effective_rate(self.dropout)), 0.0)

    h = hidden = x
    for i in range(self.num_layers - 1):
      layer = SFPDLayer(self.hidden, self.neighbours, name=f"layer_{i}")
      h = hidden = nn.relu(layer(drop(h), edges))
    logits = SFPDLayer(self.num_classes, self.neighbours,
                       name=f"layer_{self.num_layers - 1}")(drop(h), edges)
    return (hidden, logits) if with_hidden else logits
