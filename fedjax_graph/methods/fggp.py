"""FGGP: a learned second view of each client's graph, prototype alignment, clustered prototypes, kNN prediction.

Client (FGL_METHODS.md §4(b)): each round a second view of the client's graph
is built from the global model's features: every node's 3 cosine nearest
neighbours and a self-loop, OR-ed with the client's edges (A'). An augmentor
(two bias-free GCN layers V1, V2 over A''s normalisation) scores every pair,
S = H H^T, and samples a graph from P = alpha S / max S + (1 - alpha) A'
(relaxed Bernoulli, straight-through). The local loss is

  L = CE(view 1) + CE(view 2) + L_pa + L_ga,

L_pa aligning the two views' class prototypes (pseudo-label weighted) and
L_ga the augmentor's weighted BCE reconstruction of A'. Upload: the final
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

import jax
import jax.numpy as jnp
import optax

from fedjax_graph.config import Config
from fedjax_graph.methods import base, fggp_server, prototypes
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array

# float32's eps, as pyro's clamp_probs: keeps logit(p) finite where S = 0 or P = 1.
_EPS = float(jnp.finfo(jnp.float32).eps)


def knn_view(features: Array, real: Array, senders: Array, receivers: Array,
             neighbours: int) -> Array:
  """A' bool[N, N]: the client's edges OR each node's cosine nearest neighbours OR a self-loop.

  Args:
    features: f32[N, H] the global model's node features.
    real: bool[N] real (not padding) nodes.
    senders, receivers: i32[E] the client's directed edges (padding edges
      point at a padding node).
    neighbours: how many nearest neighbours per node (self excluded), static;
      cosine similarities are compared rounded to 5 decimals.

  Returns:
    A'[i, j] True for an edge i -> j, j one of i's neighbours (a directed
    kNN link, as sklearn's ``kneighbors_graph``), or i = j; False on every
    row and column of padding.
  """
  n = features.shape[0]
  unit = features / jnp.sqrt(jnp.maximum(jnp.sum(features**2, -1, keepdims=True), 1e-24))
  others = real[None, :] & ~jnp.eye(n, dtype=bool)
  # Rounded, so float noise (a batched and an unbatched product differ in the
  # last bits) cannot flip a near-tie, e.g. between the all-zero features of
  # dead ReLUs; exact ties go to the lower index (top_k's rule).
  similarity = jnp.round(unit @ unit.T, 5)
  _, nearest = jax.lax.top_k(jnp.where(others, similarity, -jnp.inf), neighbours)
  knn = jnp.zeros((n, n), bool).at[jnp.arange(n)[:, None], nearest].set(True)
  edges = jnp.zeros((n, n), bool).at[senders, receivers].set(True)
  pairs = real[:, None] & real[None, :]
  return (edges | knn | jnp.eye(n, dtype=bool)) & pairs


def sym_normalise(adjacency: Array) -> Array:
  """D^-1/2 A D^-1/2 with D the row sums (0 where a row is empty)."""
  degree = jnp.sum(adjacency, axis=1)
  inv_sqrt = jnp.where(degree > 0, jax.lax.rsqrt(jnp.maximum(degree, 1e-12)), 0.0)
  return inv_sqrt[:, None] * adjacency * inv_sqrt[None, :]


def graph_loss(logits: Array, target: Array, pairs: Array) -> Array:
  """GAug's weighted BCE of the augmentor's edge logits S against A' (f32[]).

  ``norm_w * mean_{real pairs} [pos_w A' softplus(-S) + (1 - A') softplus(S)]``
  with n real nodes, e = sum A', ``norm_w = n^2 / (2 (n^2 - e))`` and
  ``pos_w = (n^2 - e) / e`` (BCEWithLogits with ``pos_weight``).
  """
  target = jnp.where(pairs, target, False).astype(logits.dtype)
  n2 = jnp.sum(pairs)
  edges = jnp.sum(target)
  pos_weight = (n2 - edges) / jnp.maximum(edges, 1.0)
  norm_weight = n2 / jnp.maximum(2.0 * (n2 - edges), 1.0)
  # softplus(S) = S + softplus(-S): one transcendental pass over the N^2 pairs, not two.
  negative = jax.nn.softplus(-logits)
  per_pair = negative * (pos_weight * target + 1 - target) + (1 - target) * logits
  return norm_weight * jnp.sum(jnp.where(pairs, per_pair, 0.0)) / jnp.maximum(n2, 1.0)


def sample_graph(key: Array, scores: Array, target: Array, pairs: Array, alpha: float,
                 temperature: float) -> Array:
  """The augmentor's sampled graph, normalised: f32[N, N], differentiable in ``scores``.

  P = alpha S / (max S + 1e-6) + (1 - alpha) A', clamped to [eps, 1 - eps];
  a relaxed Bernoulli sample sigmoid((logit P + Logistic) / temperature),
  rounded in the forward pass with the soft sample's gradient (pyro's
  ``RelaxedBernoulliStraightThrough``); its strict upper triangle made
  symmetric, the diagonal set to 1, padding rows and columns 0 but for it,
  and D^-1/2 A D^-1/2. The max runs over real pairs only.
  """
  top = jnp.max(jnp.where(pairs, scores, -jnp.inf))
  probs = alpha * scores / (top + 1e-6) + (1 - alpha) * target.astype(scores.dtype)
  probs = jnp.clip(probs, _EPS, 1 - _EPS)
  uniform = jax.random.uniform(key, scores.shape, scores.dtype, _EPS, 1 - _EPS)
  if temperature == 1.0:
    # sigmoid(logit p + logit u) = p u / (p u + (1 - p)(1 - u)): no transcendental
    # function over the N^2 pairs (they dominate a step's cost on a CPU).
    soft = probs * uniform / (probs * uniform + (1 - probs) * (1 - uniform))
  else:
    soft = jax.nn.sigmoid((jnp.log(probs) - jnp.log1p(-probs) + jnp.log(uniform)
                           - jnp.log1p(-uniform)) / temperature)
  sampled = soft + jax.lax.stop_gradient((soft > 0.5).astype(soft.dtype) - soft)
  upper = jnp.triu(jnp.where(pairs, sampled, 0.0), 1)
  return sym_normalise(upper + upper.T + jnp.eye(scores.shape[0], dtype=scores.dtype))


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
         alpha: float = 0.5, temperature: float = 1.0, queue_per_class: int = 20, k: int = 40,
         knn_temperature: float = 0.1, weights: str = "count") -> base.Method:
  """FGGP (Wan, Huang, Ye, AAAI 2024) as its public code does it, with fixed shapes.

  Defaults are the code's (main_graph.py; the paper's text was not
  reachable): ``neighbours`` 3, ``tau`` 0.5 (prototype alignment), augmentor
  ``alpha`` 0.5 and ``temperature`` 1, queue of ``queue_per_class`` x K = 20 K
  rows, ``k`` = 40 voters with ``knn_temperature`` 0.1; ``weights: count``
  (the authors' FedAvg weighs clients by node counts; here training-node
  counts, as every method of this project).

  Client, per round: the kNN view A' (bool[N, N], dense, over the client's
  real nodes; refreshed every round from the current global model, not every
  10 rounds as the code, so it needs no per-client [N, N] state), its
  normalisation A_n and A_n A_n X (the augmentor's first layer has no
  activation, so H = relu(A_n A_n X V1 V2) and A_n A_n X is fixed for the
  round). Per local step, besides the backbone's cross-entropy on its usual
  view: S = H H^T, the sampled graph (``sample_graph``), the second view
  = the backbone with GCN propagation over the sampled graph in every layer
  (the code propagates its classifier layer over A' instead), CE2 on it,
  L_pa between the two views' prototypes (``proto_align_loss``) and L_ga
  (``graph_loss``). Prototypes are ``prototypes.class_prototypes`` of each
  view's hidden features (the classifier's input) with pseudo-labels and
  confidence weights from view 1's logits (``pseudo_labelled``; the weights
  are constants here, the code lets gradients flow through them). Batch
  norm takes the statistics of all the client's real nodes (pseudo-labels
  need every node). The step's own randomness (edge sampling, view-2
  dropout) comes from ``StepOutput.key``.

  Upload: ``(prototypes f32[K, H], present bool[K])`` of the final local
  model (deterministic pass, its own pseudo-labels; the code uses the last
  step's pre-update logits), keyed by class id (the code keys them by row,
  which shifts class ids when a class is missing).

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
  (``Method.predict``), which the tables report, as the paper's numbers.

  Memory: a client holds a handful of dense f32[N, N] arrays per step (N
  its padded node count); the largest WikiNet client (crocodile in 2, N =
  5,816) takes about 135 MB per array.
  """
  for name, value, ok, allowed in (
      ("neighbours", neighbours, isinstance(neighbours, int) and neighbours >= 1, "an int >= 1"),
      ("tau", tau, tau > 0, "> 0"), ("alpha", alpha, 0 <= alpha <= 1, "in [0, 1]"),
      ("temperature", temperature, temperature > 0, "> 0"),
      ("queue_per_class", queue_per_class,
       isinstance(queue_per_class, int) and queue_per_class >= 1, "an int >= 1"),
      ("k", k, isinstance(k, int) and k >= 1, "an int >= 1"),
      ("knn_temperature", knn_temperature, knn_temperature > 0, "> 0")):
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
    return ctx.groups < ctx.num_groups

  def prepare(ctx):
    real = real_nodes(ctx)
    features, _ = model.apply(ctx.global_params, ctx.x, ctx.graph, train=False, with_hidden=True,
                              groups=ctx.groups, num_groups=ctx.num_groups)
    target = knn_view(features, real, ctx.graph.senders, ctx.graph.receivers, neighbours)
    normalised = sym_normalise(target.astype(jnp.float32))
    return target, normalised @ (normalised @ ctx.x)

  def local_loss(params, step, ctx):
    target, smoothed = ctx.prepared
    real = real_nodes(ctx)
    pairs = real[:, None] & real[None, :]
    aug = params["augmentor"]
    h = jax.nn.relu(smoothed @ aug["v1"] @ aug["v2"])
    scores = h @ h.T
    sample_key, dropout_key = jax.random.split(step.key)
    graph = sample_graph(sample_key, scores, target, pairs, alpha, temperature)
    hidden2, logits2 = second_view.apply(params, ctx.x, graph, train=True,
                                         rngs={"dropout": dropout_key}, with_hidden=True,
                                         groups=ctx.groups, num_groups=ctx.num_groups)
    ce2 = base.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits2, ctx.y),
                           ctx.train_mask)
    labels, confidence = pseudo_labelled(step.logits, ctx.y, ctx.train_mask, real)
    view1, mass = prototypes.class_prototypes(step.hidden, labels, confidence, num_classes)
    view2, _ = prototypes.class_prototypes(hidden2, labels, confidence, num_classes)
    return (ce2 + proto_align_loss(view2, view1, mass > 0, tau)
            + graph_loss(scores, target, pairs))

  def client_final(ctx, params, update):
    hidden, logits = model.apply(params, ctx.x, ctx.graph, train=True, deterministic=True,
                                 with_hidden=True, groups=ctx.groups, num_groups=ctx.num_groups)
    labels, confidence = pseudo_labelled(logits, ctx.y, ctx.train_mask, real_nodes(ctx))
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
             "queue_per_class": queue_per_class, "k": k, "knn_temperature": knn_temperature,
             "weights": weights}
  return base.Method("fggp", hparams, base.weights_uniform(weights), init, prepare, local_loss,
                     client_final, server_step, personal_leaves=is_head,
                     personalise=personalise, training_input="graph",
                     extend_params=extend_params, predict=predict)
