"""Shape legend and the small array containers shared by every module.

Every docstring in fedjax-graph writes array shapes with these letters:

  C  clients                 N  nodes (padded where a container says so)
  E  directed edges          F  node features (128 for the MUSAE presets)
  K  classes                 D  domains (graphs of one source: a country, a wiki)
  G  grid cells (rho, beta)  S  seeds
  T  rounds                  B  size buckets of clients (a static Python tuple)

A padded container always carries the mask that says which rows are real, and
padding never changes the output of a real row.
"""

from typing import NamedTuple, Optional

import jax

Array = jax.Array
PyTree = object


class Shard(NamedTuple):
  """Padded graphs stacked along a leading batch axis (clients or domains).

  Node rows are ordered train nodes first, then validation, test and padding,
  so a model that does not propagate while training only needs the first
  ``train_rows`` rows of a client (see ``ClientBucket``).

  Attributes:
    x: f32[..., N, F] node features; zero on padding rows.
    y: i32[..., N] labels in [0, K); 0 on padding rows (sanitised for the loss).
    senders: i32[..., E] source node of each directed edge; padding edges point
      at a padding node.
    receivers: i32[..., E] target node of each directed edge.
    edge_weight: f32[..., E] GCN normalisation 1/sqrt(d_s d_r) of each edge,
      with d = in-degree + 1 (self-loop); 0 on padding edges.
    self_weight: f32[..., N] GCN self-loop weight 1/d; 0 on padding rows.
    train: bool[..., N] training nodes.
    val: bool[..., N] validation nodes.
    test: bool[..., N] test nodes.
    node_domain: i32[..., N] domain index of each node; D on padding rows, so a
      ``segment_sum`` with ``num_segments=D`` drops them.
    operator: None, or the same graph's matrix D^-1/2 (A+I) D^-1/2 in the form
      its size bucket propagates with in training (``graphs.operator_kind``):
      a ``graphs.DenseAdjacency`` (f32[..., N, N]) or a ``graphs.CSRGraph``
      (leaves [..., E + N] and [..., N + 1]). ``graphs.propagate`` uses it in
      place of the edge list, so code that changes the edges or their
      weights (``shard._replace(edge_weight=...)``) must drop it
      (``operator=None``) or rebuild it (``graphs.make_operator``).
  """
  x: Array
  y: Array
  senders: Array
  receivers: Array
  edge_weight: Array
  self_weight: Array
  train: Array
  val: Array
  test: Array
  node_domain: Array
  operator: Optional[PyTree] = None
