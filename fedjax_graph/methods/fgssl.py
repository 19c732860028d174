"""FGSSL: node-semantic contrast and graph-structure distillation against the frozen global model.

Each local step draws two views of the client's graph: a weak one (edge drop
0.3, feature-column mask 0.3) for the frozen global model and a strong one
(0.8, 0.5) for the local model; the extra loss term compares the two models'
outputs on them. Two forms, switched by ``loss``:

  * ``paper`` (the default, and what tables run): L_CE + L_FNSC + L_FGSD.
    FNSC, a supervised InfoNCE over the training nodes: anchors the local
    model's embeddings on the strong view, samples the global model's on the
    weak view, positives every training node of the anchor's class (itself
    included); FGSD, per node, the softmax over its neighbours of the cosine
    similarity / omega, the global model's distilled into the local model's
    (KL(global || local)).
  * ``code`` (the official code's optimised loss): L_CE + 0.1 L_edge, an
    edge-logit distillation: e_uv = log_softmax(|o_u - o_v| / 0.1) over the K
    logits of each ORIGINAL edge, KL(e^global || e^local) averaged over the
    edges (the code computes FNSC and several other terms and discards them).

L_CE is the client's own cross-entropy on the clean graph. The server is
FedAvg (training-node-count weights); nothing is uploaded besides the model
and no state persists.

Choices where the sources are silent or differ:
  * Embeddings z are the classifier's input (the last hidden layer before
    dropout), as MOON's here. The teacher is the global model with the
    training-time architecture and no dropout (the code's ``eval()``; with
    PMLP-GCN, inference would also propagate); the student runs in training
    mode, dropout on (its own key). Both see the same architecture, so with
    PMLP-GCN the teacher is the MLP the student is.
  * Structure terms (FGSD, edge KD) use the client's original edges, in both
    directions (the code's edge KD does; FGSD's neighbour softmaxes of two
    views with different edges would not share a support). FGSD averages
    KL over the real nodes with at least one neighbour; edge KD over the real
    directed edges (the code's ``batchmean``).
  * Edge drop is a Bernoulli mask on the padded edge list, each directed edge
    dropped independently (not symmetric), as the code's ``dropout_adj``; the
    GCN weights are renormalised with the kept in-degrees, as PyG's GCNConv
    does for a dropped edge list. The feature mask zeroes a Bernoulli set of
    feature columns shared by all nodes, unscaled (PyGCL's FeatureMasking).
  * A backbone that does not propagate in training (PMLP-GCN, MLP) trains as
    an MLP: its views differ only by the feature mask; the edge drop would
    change nothing the model computes and is not drawn. The method still
    needs the client's edges and all its nodes (``needs_graph``): both models
    run on every row of the views, with batch-norm statistics over all the
    client's real nodes (the cross-entropy keeps the backbone's own rows and
    statistics, e.g. the training nodes of PMLP-GCN: FGSSL's local step is
    FedAvg's plus its term, with the same dropout masks). FNSC takes the
    training rows, the first rows of the shard.
  * Views are drawn per local step from the step's method key
    (``StepOutput.key``), so every cell of a seed sees the same views.
  * Defaults: tau 0.1 (the code's InfoNCE), kd_weight 0.1 and kd_tau 0.1
    (the code's edge KD), the views' rates (the code's augWeak and
    augStrongF). omega 0.1: the paper's value was not reachable; the code's
    optimised structure term uses 0.1 (its discarded neighbour-similarity KD,
    ``simi_kd``, uses 4 and a T^2 factor).

References:
  W. Huang, G. Wan, M. Ye, B. Du, "Federated Graph Semantic and Structural
  Learning", IJCAI 2023, https://arxiv.org/abs/2406.18937, Sec. 3 (FNSC,
  FGSD, asymmetric augmentation). Only its abstract was reachable here: the
  two terms follow the reading in FGL_METHODS.md §3(b), so no equation
  numbers are given. Official code: wgc-research/fgssl,
  fgssl/contrib/trainer/FLAG.py (``FGCLTrainer1``, ``edge_distribution_high``).
  P. Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020, eq. (2).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_graph import graphs
from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.methods.prototypes import class_prototypes
from fedjax_graph.models import NodeClassifier, dropout_keep_mask
from fedjax_graph.types import Array, Shard

LOSSES = ("paper", "code")
# A logit that takes no part in a softmax: finite, so an empty row gives no NaN gradient.
_EXCLUDED = -1e9


class ViewRates(NamedTuple):
  """Drop rates of one augmented view, each in [0, 1]."""
  edge: float
  feature: float


def drop_edges(graph: Shard, keep: Array) -> Shard:
  """``graph`` with only the real edges where ``keep`` bool[E], GCN weights renormalised.

  Degrees are recomputed from the kept edges (d = kept in-degree + 1), so the
  result is the padded graph ``graphs.gcn_weights`` gives for the kept edge
  list; dropped and padding edges get weight 0.
  """
  kept = keep & (graph.edge_weight > 0)
  degree = 1.0 + jax.ops.segment_sum(kept.astype(jnp.float32), graph.receivers,
                                     num_segments=graph.self_weight.shape[0])
  inv_sqrt = jax.lax.rsqrt(degree)
  edge_weight = jnp.where(kept, inv_sqrt[graph.senders] * inv_sqrt[graph.receivers], 0.0)
  self_weight = jnp.where(graph.self_weight > 0, 1.0 / degree, 0.0)
  # No operator: the kept edges need not be symmetric (one mask entry per
  # directed edge), which the CSR operator's gradient assumes.
  return graph._replace(edge_weight=edge_weight, self_weight=self_weight, operator=None)


def augment(key: Array, x: Array, graph: Shard, rates: ViewRates,
            with_edges: bool) -> tuple[Array, Shard]:
  """One augmented view: feature columns masked, and with ``with_edges`` edges dropped.

  Args:
    key: the view's PRNG key (the masks are a function of it alone).
    x: f32[N, F] node features.
    graph: the padded ``Shard`` of the same nodes.
    rates: the view's drop rates (realised as ``models.effective_rate``).
    with_edges: drop edges (only a backbone that propagates in training uses them).

  Returns:
    (x f32[N, F] with the dropped columns 0, graph).
  """
  feature_key, edge_key = jax.random.split(key)
  columns = dropout_keep_mask(feature_key, (x.shape[-1],), rates.feature)
  x = jnp.where(columns, x, 0.0)
  if with_edges:
    graph = drop_edges(graph, dropout_keep_mask(edge_key, graph.senders.shape, rates.edge))
  return x, graph


def _unit(z: Array, eps: float = 1e-8) -> Array:
  # As moon.cosine_similarity: a zero row stays 0, with a finite gradient.
  return z * jax.lax.rsqrt(jnp.maximum(jnp.sum(z * z, axis=-1, keepdims=True), eps**2))


def fnsc_loss(z_local: Array, z_global: Array, y: Array, mask: Array, tau: float,
              num_classes: int) -> Array:
  """Federated node semantic contrast, f32[]: a supervised InfoNCE, local anchors vs global samples.

  With s_ij = cos(z_local_i, z_global_j) / tau over the training nodes
  i, j (``mask``) and P_i = {j : y_j = y_i} (i included),
  ``mean_i [logsumexp_j s_ij - mean_{p in P_i} s_ip]`` (SupCon's L_out form,
  the denominator over all samples). The mean over positives is the anchor's
  product with its class's mean global embedding (``class_prototypes``), so
  only the denominator needs the [N, N] matrix.

  Args:
    z_local: f32[N, H] the local model's embeddings (strong view).
    z_global: f32[N, H] the global model's embeddings (weak view, no gradient).
    y: i32[N] labels (any value off ``mask``).
    mask: bool[N] training nodes; padding and other rows take no part.
    tau: temperature > 0.
    num_classes: K, static.

  Returns:
    The mean over training nodes; 0 when there are none.
  """
  anchors, samples = _unit(z_local), jax.lax.stop_gradient(_unit(z_global))
  logits = jnp.where(mask[None, :], anchors @ samples.T / tau, _EXCLUDED)  # [N, N]
  positives, _ = class_prototypes(samples, y, mask, num_classes)  # [K, H] class means
  positive = jnp.sum(anchors * positives[jnp.where(mask, y, 0)], axis=-1) / tau
  return base.masked_mean(jax.nn.logsumexp(logits, axis=-1) - positive, mask)


def _neighbour_log_softmax(scores: Array, receivers: Array, valid: Array,
                           num_nodes: int) -> Array:
  """f32[E] log of the softmax of ``scores`` f32[E] over each receiver's valid edges; 0 elsewhere."""
  scores = jnp.where(valid, scores, _EXCLUDED)
  # The shift only keeps exp finite; the softmax does not depend on it.
  shift = jax.lax.stop_gradient(jax.ops.segment_max(scores, receivers, num_segments=num_nodes))
  shifted = scores - shift[receivers]
  total = jax.ops.segment_sum(jnp.where(valid, jnp.exp(shifted), 0.0), receivers,
                              num_segments=num_nodes)
  return jnp.where(valid, shifted - jnp.log(jnp.maximum(total, 1e-30))[receivers], 0.0)


def fgsd_loss(z_local: Array, z_global: Array, graph: Shard, omega: float) -> Array:
  """Federated graph structure distillation, f32[]: KL(q_global || q_local) per node, averaged.

  q_i is node i's softmax over its neighbours j (the senders of its real
  edges) of cos(z_i, z_j) / omega; the KL is averaged over the real nodes with
  at least one neighbour (0 when there are none). Padding edges (weight 0)
  never count.

  Args:
    z_local: f32[N, H] the local model's embeddings (strong view).
    z_global: f32[N, H] the global model's embeddings (weak view, no gradient).
    graph: the client's padded ``Shard`` (original edges).
    omega: temperature > 0.
  """
  num_nodes, valid = z_local.shape[0], graph.edge_weight > 0
  # Cosines of unit rows, edge by edge without an [E, H] copy (graphs.edge_dot).
  cosine = lambda z: graphs.edge_dot(_unit(z), _unit(z), graph.senders, graph.receivers)
  log_q = lambda z: _neighbour_log_softmax(cosine(z) / omega, graph.receivers, valid, num_nodes)
  log_teacher, log_student = jax.lax.stop_gradient(log_q(z_global)), log_q(z_local)
  per_edge = jnp.where(valid, jnp.exp(log_teacher) * (log_teacher - log_student), 0.0)
  per_node = jax.ops.segment_sum(per_edge, graph.receivers, num_segments=num_nodes)
  has_neighbour = jax.ops.segment_sum(valid.astype(jnp.int32), graph.receivers,
                                      num_segments=num_nodes) > 0
  return base.masked_mean(per_node, has_neighbour)


def edge_kd_loss(logits_local: Array, logits_global: Array, graph: Shard, tau: float) -> Array:
  """The official code's edge distillation, f32[]: KL(e_global || e_local) averaged over real edges.

  e_uv = log_softmax(|o_u - o_v| / tau) over the K logit dimensions of each
  directed edge (u, v) of ``graph`` (``edge_distribution_high`` in FLAG.py,
  KLDivLoss(batchmean, log_target=True)); padding edges never count, 0
  without a real edge.

  Args:
    logits_local: f32[N, K] the local model's logits (strong view).
    logits_global: f32[N, K] the global model's logits (weak view, no gradient).
    graph: the client's padded ``Shard`` (original edges).
    tau: temperature > 0.
  """
  edge_dist = lambda o: jax.nn.log_softmax(
      jnp.abs(o[graph.senders] - o[graph.receivers]) / tau, axis=-1)
  teacher = jax.lax.stop_gradient(edge_dist(logits_global))
  per_edge = jnp.sum(jnp.exp(teacher) * (teacher - edge_dist(logits_local)), axis=-1)
  return base.masked_mean(per_edge, graph.edge_weight > 0)


def fgssl(model: NodeClassifier, config: Config, loss: str = "paper", tau: float = 0.1,
          omega: float = 0.1, kd_weight: float = 0.1, kd_tau: float = 0.1,
          weak_edge: float = 0.3, weak_feature: float = 0.3, strong_edge: float = 0.8,
          strong_feature: float = 0.5, weights: str = "count") -> base.Method:
  """FGSSL (Huang et al. 2023): local loss + FNSC + FGSD (``paper``) or + kd_weight * edge KD (``code``).

  See the module docstring for both forms and the choices made. ``tau`` is
  FNSC's temperature, ``omega`` FGSD's, ``kd_weight`` and ``kd_tau`` the edge
  KD's (``code`` only); ``weak_*`` / ``strong_*`` the views' edge-drop and
  feature-mask rates. The client needs its graph (``needs_graph``).

  Raises:
    ValueError: for a ``loss`` other than ``paper`` or ``code``, a temperature
      <= 0, a negative ``kd_weight`` or a rate outside [0, 1].
  """
  base.check(loss in LOSSES, "fgssl", "loss", loss, f"one of {LOSSES}")
  for name, value in (("tau", tau), ("omega", omega), ("kd_tau", kd_tau)):
    base.check(value > 0, "fgssl", name, value, "> 0")
  base.check(kd_weight >= 0, "fgssl", "kd_weight", kd_weight, ">= 0")
  for name, value in (("weak_edge", weak_edge), ("weak_feature", weak_feature),
                      ("strong_edge", strong_edge), ("strong_feature", strong_feature)):
    base.check(0 <= value <= 1, "fgssl", name, value, "in [0, 1]")
  weak, strong = ViewRates(weak_edge, weak_feature), ViewRates(strong_edge, strong_feature)
  with_edges = model.propagate_train

  def on_view(params, key, rates, graph, num_groups, dropout_key=None):
    """(hidden f32[N, H], logits f32[N, K]) of ``params`` on a view of all the shard's rows."""
    x, view = augment(key, graph.x, graph, rates, with_edges)
    return model.apply(params, x, view, train=True, deterministic=dropout_key is None,
                       rngs=None if dropout_key is None else {"dropout": dropout_key},
                       with_hidden=True, groups=graph.node_domain, num_groups=num_groups)

  def local_loss(params, step, ctx):
    if ctx.graph is None:
      raise ValueError("fgssl needs the client's graph in training (Method.needs_graph)")
    weak_key, strong_key, dropout_key = jax.random.split(step.key, 3)
    z_global, o_global = jax.lax.stop_gradient(
        on_view(ctx.global_params, weak_key, weak, ctx.graph, ctx.num_groups))
    z_local, o_local = on_view(params, strong_key, strong, ctx.graph, ctx.num_groups,
                               dropout_key)
    if loss == "code":
      return kd_weight * edge_kd_loss(o_local, o_global, ctx.graph, kd_tau)
    rows = ctx.x.shape[0]  # the rows the backbone trains on: the shard's first rows
    return (fnsc_loss(z_local[:rows], z_global[:rows], ctx.y, ctx.train_mask, tau,
                      model.num_classes)
            + fgsd_loss(z_local, z_global, ctx.graph, omega))

  hparams = {"loss": loss, "tau": tau, "omega": omega, "kd_weight": kd_weight,
             "kd_tau": kd_tau, "weak_edge": weak_edge, "weak_feature": weak_feature,
             "strong_edge": strong_edge, "strong_feature": strong_feature, "weights": weights}
  return base.Method("fgssl", hparams, base.weights_uniform(weights), base.stateless,
                     base.nothing, local_loss, base.keep_state, base.descent_step(config),
                     needs_graph=True)
