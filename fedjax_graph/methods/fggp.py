"""FGGP: a learned second view of each client's graph, prototype alignment, clustered prototypes, kNN prediction.

Client (FGL_METHODS.md §4(b)): each round a second view of the client's graph
is built from the global model's features: every node's 3 cosine nearest
neighbours and a self-loop, OR-ed with the client's edges (A'). An augmentor
(two bias-free GCN layers V1, V2 over A''s normalisation) scores the pairs
of A' only (a fixed, padded list of at most E + 3N + N pairs, never the N x N
matrix), S_uv = <h_u, h_v>, and samples a graph on them from P = alpha S /
max S + (1 - alpha) A' (relaxed Bernoulli, straight-through). The local loss
is

  L = CE(view 1) + CE(view 2) + L_pa + L_ga,

L_pa aligning the two views' class prototypes (pseudo-label weighted) and
L_ga the augmentor's weighted BCE reconstruction of A' (against sampled
negative pairs). Upload: the final
local model's class prototypes, keyed by class. Server: per class, FINCH
over the clients' prototypes; the clusters' means, L2-normalised, enter a
circular queue. Prediction: the k nearest queue entries of a node's global
features vote (``fggp_server.knn_scores``). The classifier stays per client.

References:
  G. Wan, W. Huang, M. Ye, "Federated Graph Learning under Domain Shift with
  Generalizable Prototypes", AAAI 2024 (its text beyond the abstract was not
  reachable; everything here follows its code, GuanchengWan/FGGP, and the
  FedIA code's port, as FGL_METHODS.md §4 reads them).
  T. Zhao et al., "Data Augmentation for Graph Neural Networks" (GAug), AAAI
  2021: the augmentor, its edge probabilities and the BCE weights.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_graph import graphs
from fedjax_graph.config import Config
from fedjax_graph.methods import base, fggp_server, prototypes
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array

# float32's eps, as pyro's clamp_probs: keeps logit(p) finite where S = 0 or P = 1.
_EPS = float(jnp.finfo(jnp.float32).eps)
# Which form of the backbone gives the uploaded prototypes (``fggp``'s ``prototype_pass``).
PROTOTYPE_PASSES = ("inference", "training")
# Rows of the cosine-similarity matrix computed at once by ``knn_indices``.
KNN_BLOCK = 512


class Candidates(NamedTuple):
  """A client's candidate pairs: its edges, its nodes' nearest neighbours and self-loops, unordered, once each.

  M = E + kN + N slots (E the shard's padded edge count, k neighbours, N
  rows), sorted by ``key``; a slot is a pair u <= v.

  Attributes:
    u, v: i32[M] the pair's nodes, u <= v (u = v: a self-loop).
    valid: bool[M] a real pair, first of its duplicates.
    key: i32[M] u N + v on valid slots, N^2 elsewhere; ascending (for
      ``jnp.searchsorted``).
  """
  u: Array
  v: Array
  valid: Array
  key: Array


def knn_indices(features: Array, real: Array, neighbours: int,
                block: int = KNN_BLOCK) -> tuple[Array, Array]:
  """Each node's ``neighbours`` cosine nearest real nodes (self excluded), ``block`` rows at a time.

  Args:
    features: f32[N, H] the global model's node features.
    real: bool[N] real (not padding) nodes.
    neighbours: k, static, <= N.
    block: rows per block, static: memory O(block N), not O(N^2).

  Returns:
    (nearest i32[N, k], found bool[N, k]): ``found`` is False where fewer
    than k other real nodes exist (k may exceed N). Similarities are compared rounded to 5
    decimals, so float noise (a batched and an unbatched product differ in
    the last bits) cannot flip a near-tie, e.g. between the all-zero features
    of dead ReLUs; exact ties go to the lower index (top_k's rule).
  """
  n = features.shape[0]
  searched = min(neighbours, n)
  unit = fggp_server._normalise(features)
  block = min(block, n)
  blocks = -(-n // block)
  rows = jnp.arange(blocks * block).reshape(blocks, block)

  def one_block(index):
    similarity = jnp.round(unit[jnp.minimum(index, n - 1)] @ unit.T, 5)
    others = real[None, :] & (jnp.arange(n)[None, :] != index[:, None])
    return jax.lax.top_k(jnp.where(others, similarity, -jnp.inf), searched)

  top, nearest = jax.lax.map(one_block, rows)
  top, nearest = top.reshape(-1, searched)[:n], nearest.reshape(-1, searched)[:n]
  missing = ((0, 0), (0, neighbours - searched))  # k > N: no more candidates to find
  top = jnp.pad(top, missing, constant_values=-jnp.inf)
  return jnp.pad(nearest, missing).astype(jnp.int32), (top > -jnp.inf) & real[:, None]


def candidate_pairs(senders: Array, receivers: Array, nearest: Array, found: Array,
                    real: Array) -> Candidates:
  """The ``Candidates`` of a client: edges, kNN links and self-loops of real nodes, deduplicated.

  Args:
    senders, receivers: i32[E] the client's directed edges (padding edges
      point at a padding node).
    nearest, found: ``knn_indices``' output, [N, k].
    real: bool[N].
  """
  n, k = nearest.shape
  nodes = jnp.arange(n, dtype=jnp.int32)
  a = jnp.concatenate([senders, jnp.repeat(nodes, k), nodes])
  b = jnp.concatenate([receivers, nearest.reshape(-1), nodes])
  ok = jnp.concatenate([real[senders] & real[receivers], found.reshape(-1), real])
  u, v = jnp.minimum(a, b), jnp.maximum(a, b)
  key = jnp.where(ok, u * n + v, n * n)  # int32: exact for N < 46,341
  order = jnp.argsort(key)
  key, u, v = key[order], u[order], v[order]
  first = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
  return Candidates(u, v, (key < n * n) & first, key)


class PairLayout(NamedTuple):
  """Where the entries of ``pair_graph``'s matrix go in CSR form (fixed for a round's candidates).

  The matrix's 2M + N entries are, in order, (v, u) and (u, v) of every
  pair, then the diagonal; ``order`` i32[2M + N] sorts them by row.

  Attributes:
    order: i32[2M + N].  indices: i32[2M + N] their columns, sorted.
    indptr: i32[N + 1] row pointers.
  """
  order: Array
  indices: Array
  indptr: Array


def pair_layout(pairs: Candidates, num_nodes: int) -> PairLayout:
  """The ``PairLayout`` of the candidates (a sort of 2M + N integers, once per round)."""
  nodes = jnp.arange(num_nodes, dtype=jnp.int32)
  rows = jnp.concatenate([pairs.v, pairs.u, nodes])
  order = jnp.argsort(rows, stable=True)
  return PairLayout(order, jnp.concatenate([pairs.u, pairs.v, nodes])[order],
                    graphs.row_pointers(rows[order], num_nodes))


def pair_graph(shard, pairs: Candidates, weight: Array, real: Array, layout: PairLayout = None):
  """The shard with the GCN-normalised symmetric graph I + sum_e w_e (e_uv + e_vu) as its edges.

  Args:
    shard: the client's ``Shard`` (its edges are replaced).
    pairs: the ``Candidates``.
    weight: f32[M] each pair's weight (used on valid non-self pairs only);
      the result is differentiable in it.
    real: bool[N].
    layout: ``pair_layout(pairs, N)`` (computed here when None).

  Returns:
    A ``Shard`` with 2M directed edges u -> v and v -> u of weight
    w / sqrt(d_u d_v), d = 1 + the weighted degree, and self weight 1/d (0
    on padding rows): D^-1/2 (A + I) D^-1/2, as ``graphs.gcn_weights``; its
    ``operator`` is the same matrix as a ``graphs.LearnedCSR``, so
    ``graphs.propagate`` runs a CSR product, differentiable in ``weight``
    (a gather and segment-sum over the 2M edges is several times slower).
  """
  n = real.shape[0]
  w = jnp.where(pairs.valid & (pairs.u != pairs.v), weight, 0.0)
  degree = (1.0 + jax.ops.segment_sum(w, pairs.u, num_segments=n)
            + jax.ops.segment_sum(w, pairs.v, num_segments=n))
  inv_sqrt = jax.lax.rsqrt(degree)
  edge = w * inv_sqrt[pairs.u] * inv_sqrt[pairs.v]
  self_weight = jnp.where(real, 1.0 / degree, 0.0)
  layout = pair_layout(pairs, n) if layout is None else layout
  entries = jnp.concatenate([edge, edge, self_weight])[layout.order]
  return shard._replace(senders=jnp.concatenate([pairs.u, pairs.v]),
                        receivers=jnp.concatenate([pairs.v, pairs.u]),
                        edge_weight=jnp.concatenate([edge, edge]), self_weight=self_weight,
                        operator=graphs.LearnedCSR(entries, layout.indices, layout.indptr))


def _uniform_by_id(key: Array, ids: Array) -> Array:
  """f32[...] Uniform(eps, 1 - eps), one per id from ``fold_in(key, id)``: independent of the array's shape and order (padding)."""
  draw = lambda i: jax.random.uniform(jax.random.fold_in(key, i), (), jnp.float32, _EPS, 1 - _EPS)
  return jax.vmap(draw)(ids.reshape(-1)).reshape(ids.shape)


def sample_edges(key: Array, scores: Array, pairs: Candidates, alpha: float,
                 temperature: float) -> Array:
  """The augmentor's sampled edge weights on the candidates, f32[M] in {0, 1}, differentiable in ``scores``.

  P = alpha S / (max S + 1e-6) + (1 - alpha) A' on candidate pairs (A' = 1
  there; the max over valid pairs), clamped to [eps, 1 - eps]; a relaxed
  Bernoulli sample sigmoid((logit P + Logistic) / temperature), rounded in
  the forward pass with the soft sample's gradient (pyro's
  ``RelaxedBernoulliStraightThrough``); 0 on invalid slots and self-loops
  (the self-loop is always kept, ``pair_graph``). A pair's noise comes from
  its key, so the sample does not depend on padding.

  Args:
    key: PRNG key.  scores: f32[M] S_uv = <h_u, h_v>.  pairs: ``Candidates``.
    alpha: in [0, 1].  temperature: > 0, static.
  """
  edge = pairs.valid & (pairs.u != pairs.v)
  top = jnp.max(jnp.where(edge, scores, -jnp.inf))
  probs = jnp.clip(alpha * scores / (top + 1e-6) + (1 - alpha), _EPS, 1 - _EPS)
  uniform = _uniform_by_id(key, pairs.key)
  if temperature == 1.0:
    # sigmoid(logit p + logit u) = p u / (p u + (1 - p)(1 - u)): no transcendental function.
    soft = probs * uniform / (probs * uniform + (1 - probs) * (1 - uniform))
  else:
    soft = jax.nn.sigmoid((jnp.log(probs) - jnp.log1p(-probs) + jnp.log(uniform)
                           - jnp.log1p(-uniform)) / temperature)
  sampled = soft + jax.lax.stop_gradient((soft > 0.5).astype(soft.dtype) - soft)
  return jnp.where(edge, sampled, 0.0)


def negative_pairs(key: Array, pairs: Candidates, real: Array, per_node: int) -> tuple[Array, Array, Array]:
  """``per_node`` random non-candidate partners of each real node: (u i32[N, r], v i32[N, r], valid bool[N, r]).

  Partners are uniform over the real nodes (the first rows of a shard);
  a draw that hits the node itself or a candidate pair is invalid. Node i's
  draws come from ``fold_in(key, i)``: they do not depend on padding.
  """
  n = real.shape[0]
  nodes = jnp.arange(n, dtype=jnp.int32)
  count = jnp.sum(real)
  draws = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (per_node,)))(nodes)
  partner = jnp.minimum((draws * count).astype(jnp.int32), jnp.maximum(count - 1, 0))
  u, v = jnp.minimum(nodes[:, None], partner), jnp.maximum(nodes[:, None], partner)
  key_uv = u * n + v
  at = jnp.minimum(jnp.searchsorted(pairs.key, key_uv), pairs.key.shape[0] - 1)
  candidate = pairs.key[at] == key_uv
  return u, v, real[:, None] & (partner != nodes[:, None]) & ~candidate


def graph_loss(positive: Array, positive_valid: Array, negative: Array,
               negative_valid: Array) -> Array:
  """GAug's weighted BCE of the edge logits S, restricted to candidate and sampled negative pairs (f32[]).

  The dense loss over all n^2 real pairs, ``norm_w mean [pos_w A' softplus(-S)
  + (1 - A') softplus(S)]`` with e = sum A', ``pos_w = (n^2 - e) / e`` and
  ``norm_w = n^2 / (2 (n^2 - e))``, equals ``(mean_{A'} softplus(-S) +
  mean_{not A'} softplus(S)) / 2``. Here A' is the candidate set (every
  valid pair, self-loops included) and the second mean is estimated on the
  sampled negative pairs (``negative_pairs``): ``(masked mean softplus(-S)
  over candidates + masked mean softplus(S) over negatives) / 2``.

  Args:
    positive: f32[M] S on the candidate slots; ``positive_valid`` bool[M].
    negative: f32[...] S on the negative pairs; ``negative_valid`` bool[...].
  """
  return 0.5 * (base.masked_mean(jax.nn.softplus(-positive), positive_valid)
                + base.masked_mean(jax.nn.softplus(negative), negative_valid))


def proto_align_loss(view2: Array, view1: Array, present: Array, tau: float) -> Array:
  """FGGP's prototype alignment (its code's ``proto_align_loss(P2, P1)``), f32[].

  Rows L2-normalised; for each present class c the logits
  ``[<p2_c, p1_c>, <p2_c, p2_j>_{j != c}, <p2_c, p1_j>_{j != c}] / tau`` over
  present j, cross-entropy with target 0; the mean over present classes (0
  when none is; ln 1 = 0 for a lone class).

  Args:
    view2, view1: f32[K, H] the prototypes of the second and first view.
    present: bool[K] classes that have any weight.
    tau: temperature.
  """
  p1 = fggp_server._normalise(view1)
  p2 = fggp_server._normalise(view2)
  positive = jnp.sum(p2 * p1, axis=-1)
  negatives = present[None, :] & ~jnp.eye(present.shape[0], dtype=bool)
  logits = jnp.concatenate([positive[:, None], p2 @ p2.T, p2 @ p1.T], axis=1) / tau
  keep = jnp.concatenate([jnp.ones_like(present)[:, None], negatives, negatives], axis=1)
  per_class = jax.nn.logsumexp(jnp.where(keep, logits, -jnp.inf), axis=1) - positive / tau
  return base.masked_mean(per_class, present)


def pseudo_labelled(logits: Array, y: Array, train_mask: Array, real: Array) -> tuple[Array, Array]:
  """(labels i32[N], weights f32[N]): y and 1 on training nodes, else the argmax and its softmax probability (a constant); 0 on padding."""
  probs = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1))
  labels = jnp.where(train_mask, y, jnp.argmax(probs, axis=-1))
  weights = jnp.where(train_mask, 1.0, jnp.where(real, jnp.max(probs, axis=-1), 0.0))
  return labels, weights


def fggp(model: NodeClassifier, config: Config, neighbours: int = 3, tau: float = 0.5,
         alpha: float = 0.5, temperature: float = 1.0, negatives: int = 4,
         queue_per_class: int = 20, k: int = 40, knn_temperature: float = 0.1,
         prototype_pass: str = "inference", weights: str = "count") -> base.Method:
  """FGGP (Wan, Huang, Ye, AAAI 2024) as its public code does it, with fixed shapes.

  Defaults are the code's (main_graph.py; the paper's text was not
  reachable): ``neighbours`` 3, ``tau`` 0.5 (prototype alignment), augmentor
  ``alpha`` 0.5 and ``temperature`` 1, queue of ``queue_per_class`` x K = 20 K
  rows, ``k`` = 40 voters with ``knn_temperature`` 0.1; ``weights: count``
  (the authors' FedAvg weighs clients by node counts; here training-node
  counts, as every method of this project). ``negatives`` (4 per node) is
  ours: the sampled negative pairs of the sparse L_ga (below).

  Client, per round (``prepare``): the global model's features of the
  client's nodes, each node's 3 cosine nearest neighbours (``knn_indices``,
  dense products in blocks of ``KNN_BLOCK`` rows: O(512 N) memory) and the
  candidate pairs A' = the client's edges OR the kNN links OR self-loops
  (``candidate_pairs``: a fixed, padded list of E + 3N + N pairs, not the
  N x N matrix); A' is refreshed every round from the current global model
  (the code: every 10 rounds), so it needs no per-client state. The
  augmentor (two bias-free layers V1, V2, GCN propagation over symmetric A',
  ``pair_graph``) has no activation after its first layer, so H = relu(A_n
  A_n X V1 V2) and A_n A_n X is fixed for the round.

  Per local step (``local_loss``): view 1 = the backbone in training mode
  over all the client's real nodes (batch norm over every real node: the
  pseudo-labels need every node, as the code), CE on its training nodes;
  S_uv = <h_u, h_v> on the candidate pairs only; the sampled graph
  (``sample_edges``: P, the relaxed-Bernoulli straight-through sample) over
  the candidates; view 2 = the backbone with GCN propagation over the
  sampled graph in every layer (``pair_graph``: a CSR product over the 2M
  padded pair entries and the diagonal, its layout sorted once per round in
  ``prepare``; the code propagates only its classifier layer over A'), CE2
  on it; L_pa between the two views' prototypes (``proto_align_loss``) and
  L_ga (``graph_loss``: positives = the candidates, negatives = ``negatives``
  random non-candidate partners per node, drawn each step). So

    L = CE(view 1) + CE(view 2) + L_pa + L_ga,

  and the backbone's own cross-entropy on its training input is weighed 0
  (``Method.ce_weight``; it is still what ``ClientOutput.losses`` report).
  Restricting the augmentor to candidate pairs is ours (the code scores all
  N^2 pairs; a pair outside A' can be sampled there): it keeps every tensor
  O(E + N) per client. Prototypes are ``prototypes.class_prototypes`` of
  each view's hidden features (the classifier's input) with pseudo-labels
  and confidence weights from view 1's logits (``pseudo_labelled``; the
  weights are constants here, the code lets gradients flow through them).
  The step's randomness (view-1 and view-2 dropout, edge sampling,
  negatives) comes from ``StepOutput.key``.

  Upload: ``(prototypes f32[K, H], present bool[K])`` of the final local
  model (deterministic pass over all real nodes, its own pseudo-labels; the
  code uses the last step's pre-update logits), keyed by class id (the code
  keys them by row, which shifts class ids when a class is missing). The
  pass is the backbone's inference form (``prototype_pass: inference``, the
  default): the form of the global model's features that query the queue at
  evaluation (and that build the kNN view in ``prepare``), so prototypes and
  queries share one space, as in the code, whose PMLP_GCN propagates in
  training and inference alike (FGL_METHODS.md §0.3). With PMLP-GCN that
  form propagates over the client's graph; ``training`` takes the training
  form instead (PMLP-GCN: the MLP, no propagation), the form of this
  project's FGGP tables before the default changed.

  Server: the descent step for the model (the aggregator's update, in which
  the classifier's is 0); per class FINCH over the participants'
  prototypes, the clusters' normalised means enqueued class by class
  (``fggp_server``).

  Model: the augmentor (``augmentor`` {v1 f32[F, H], v2 f32[H, H]}, torch's
  Linear init U(+-1/sqrt(fan_in))) is part of the model and aggregated like
  the backbone (both public codes do; it then enters FedIA's mask). The last
  layer (the classifier) is personal (``Method.personal_leaves``): each
  client keeps its own (per-client state) and starts from it; the global
  model's stays at its initial value (the FedIA code restores both, so the
  global classifier is never trained: its argmax, reported as
  ``argmax_acc``, is a control, not FGGP's prediction).

  Evaluation: the k-nearest-prototype scores of the global model's features
  (``Method.predict``), which the tables report (``test_acc``), as the
  paper's numbers; the classifier's argmax beside them (``argmax_acc``).

  Raises:
    ValueError: a hyper-parameter out of range.
  """
  for name, value, ok, allowed in (
      ("neighbours", neighbours, isinstance(neighbours, int) and neighbours >= 1, "an int >= 1"),
      ("tau", tau, tau > 0, "> 0"), ("alpha", alpha, 0 <= alpha <= 1, "in [0, 1]"),
      ("temperature", temperature, temperature > 0, "> 0"),
      ("negatives", negatives, isinstance(negatives, int) and negatives >= 1, "an int >= 1"),
      ("queue_per_class", queue_per_class,
       isinstance(queue_per_class, int) and queue_per_class >= 1, "an int >= 1"),
      ("k", k, isinstance(k, int) and k >= 1, "an int >= 1"),
      ("knn_temperature", knn_temperature, knn_temperature > 0, "> 0"),
      ("prototype_pass", prototype_pass, prototype_pass in PROTOTYPE_PASSES,
       f"one of {PROTOTYPE_PASSES}")):
    base.check(ok, "fggp", name, value, allowed)
  num_classes, hidden_dim = model.num_classes, model.hidden
  head = f"layer_{model.num_layers - 1}"
  is_head = lambda path: len(path) > 1 and path[0] == "params" and path[1] == head
  second_view = model.clone(propagate_train=True)  # propagates over the sampled graph

  def extend_params(params, key):
    features = params["params"]["layer_0"]["kernel"].shape[0]
    k1, k2 = jax.random.split(key)
    uniform = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) / jnp.sqrt(
        shape[0])
    return {**params, "augmentor": {"v1": uniform(k1, (features, hidden_dim)),
                                    "v2": uniform(k2, (hidden_dim, hidden_dim))}}

  def init(params, num_clients):
    # The queue's random rows from a key tied to the seed's initial model.
    first = params["params"]["layer_0"]["kernel"][0, 0]
    key = jax.random.fold_in(jax.random.PRNGKey(0), jax.lax.bitcast_convert_type(first, jnp.int32))
    return base.MethodState(
        clients=base.per_client(base.select(params, is_head), num_clients),
        server=fggp_server.init_queue(key, queue_per_class * num_classes, hidden_dim))

  def personalise(params, client_state):
    return base.fill(client_state, params, lambda leaf: leaf)

  def real_nodes(ctx):
    return ctx.graph.node_domain < ctx.num_groups

  def full_pass(params, ctx, **kw):
    """The backbone over all the client's rows (``ctx.graph``: the whole shard)."""
    g = ctx.graph
    return model.apply(params, g.x, g, with_hidden=True, groups=g.node_domain,
                       num_groups=ctx.num_groups, **kw)

  def prepare(ctx):
    real = real_nodes(ctx)
    features, _ = full_pass(ctx.global_params, ctx, train=False)
    nearest, found = knn_indices(features, real, neighbours)
    pairs = candidate_pairs(ctx.graph.senders, ctx.graph.receivers, nearest, found, real)
    layout = pair_layout(pairs, real.shape[0])
    view = pair_graph(ctx.graph, pairs, jnp.ones(pairs.u.shape, jnp.float32), real, layout)
    return pairs, layout, graphs.propagate(graphs.propagate(ctx.graph.x, view), view)

  def local_loss(params, step, ctx):
    pairs, layout, smoothed = ctx.prepared
    g, real = ctx.graph, real_nodes(ctx)
    view1_key, sample_key, negative_key, view2_key = jax.random.split(step.key, 4)
    hidden1, logits1 = full_pass(params, ctx, train=True, rngs={"dropout": view1_key})
    cross_entropy = lambda logits: base.masked_mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, g.y), g.train)
    aug = params["augmentor"]
    h = jax.nn.relu(smoothed @ aug["v1"] @ aug["v2"])
    score = lambda u, v: graphs.edge_dot(h, h, u.reshape(-1), v.reshape(-1)).reshape(u.shape)
    scores = score(pairs.u, pairs.v)
    sampled = pair_graph(g, pairs, sample_edges(sample_key, scores, pairs, alpha, temperature),
                         real, layout)
    hidden2, logits2 = second_view.apply(params, g.x, sampled, train=True,
                                         rngs={"dropout": view2_key}, with_hidden=True,
                                         groups=g.node_domain, num_groups=ctx.num_groups)
    labels, confidence = pseudo_labelled(logits1, g.y, g.train, real)
    view1, mass = prototypes.class_prototypes(hidden1, labels, confidence, num_classes)
    view2, _ = prototypes.class_prototypes(hidden2, labels, confidence, num_classes)
    neg_u, neg_v, neg_valid = negative_pairs(negative_key, pairs, real, negatives)
    return (cross_entropy(logits1) + cross_entropy(logits2)
            + proto_align_loss(view2, view1, mass > 0, tau)
            + graph_loss(scores, pairs.valid, score(neg_u, neg_v), neg_valid))

  def ce_weight(ctx):
    return jnp.zeros((), jnp.float32)  # view 1's CE is in local_loss (over the whole graph)

  def client_final(ctx, params, update):
    hidden, logits = full_pass(params, ctx, train=prototype_pass == "training",
                               deterministic=True)
    labels, confidence = pseudo_labelled(logits, ctx.graph.y, ctx.graph.train, real_nodes(ctx))
    protos, mass = prototypes.class_prototypes(hidden, labels, confidence, num_classes)
    return base.select(params, is_head), (protos, mass > 0)

  def server_step(params, queue, update, uploads, participating, num_clients):
    params, _ = base.descent_step(config)(params, (), update, uploads, participating, num_clients)
    protos, present = uploads
    clusters, valid = fggp_server.class_clusters(protos, present & participating[:, None])
    classes = jnp.broadcast_to(jnp.arange(num_classes, dtype=jnp.int32)[:, None], valid.shape)
    queue = fggp_server.enqueue(queue, clusters.reshape(-1, clusters.shape[-1]),
                                classes.reshape(-1), valid.reshape(-1))
    return params, queue

  def predict(params, queue, hidden, logits):
    return fggp_server.knn_scores(hidden, queue, num_classes, k, knn_temperature)

  hparams = {"neighbours": neighbours, "tau": tau, "alpha": alpha, "temperature": temperature,
             "negatives": negatives, "queue_per_class": queue_per_class, "k": k,
             "knn_temperature": knn_temperature, "prototype_pass": prototype_pass,
             "weights": weights}
  return base.Method("fggp", hparams, base.weights_uniform(weights), init, prepare, local_loss,
                     client_final, server_step, ce_weight=ce_weight, needs_graph=True,
                     personal_leaves=is_head, personalise=personalise,
                     extend_params=extend_params, predict=predict)
