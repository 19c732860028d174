"""FedProto: clients share class prototypes; a regulariser pulls each node's embedding to its class's.

References:
  Y. Tan, G. Long, L. Liu, T. Zhou, Q. Lu, J. Jiang, C. Zhang, "FedProto:
  Federated Prototype Learning across Heterogeneous Clients", AAAI 2022,
  https://arxiv.org/abs/2105.00243: local prototypes (eq. 4), their global
  mean (eq. 6), the local loss L_S + lambda L_R (Sec. "Local Model Update");
  its code (yuetan031/FedProto, lib/update.py) for the per-node form of L_R
  and lambda = 1. FGL_METHODS.md §1.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_graph.config import Config
from fedjax_graph.methods import base, prototypes
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array, PyTree


class GlobalPrototypes(NamedTuple):
  """The server's class prototypes, sent to every client (FedProto eq. 6).

  Attributes:
    prototypes: f32[K, H] row c: the unweighted mean of the local prototypes
      of the last round's participants that hold class c; 0 where none does.
    present: bool[K] class c has a global prototype (g_c).
  """
  prototypes: Array
  present: Array


class PrototypeUpload(NamedTuple):
  """What a client sends besides its model update.

  Attributes:
    prototypes: f32[K, H] the mean embedding of its training nodes of each
      class (FedProto eq. 4); 0 for a class it does not hold.
    counts: f32[K] its training nodes per class (0: the class is absent).
  """
  prototypes: Array
  counts: Array


def embedding_width(model: NodeClassifier, params: PyTree) -> int:
  """H, the width of the classifier's input (the node embedding z): static."""
  return params["params"][f"layer_{model.num_layers - 1}"]["kernel"].shape[0]


def no_prototypes(model: NodeClassifier, params: PyTree) -> GlobalPrototypes:
  """The server state before round 0: zero rows, no class present."""
  width = embedding_width(model, params)
  return GlobalPrototypes(jnp.zeros((model.num_classes, width), jnp.float32),
                          jnp.zeros((model.num_classes,), bool))


def local_prototypes(model: NodeClassifier, params: PyTree,
                     ctx: base.ClientContext) -> PrototypeUpload:
  """A client's prototypes from its final local model ``params``.

  The embeddings are the classifier's input (``with_hidden``) of the
  training-time architecture (PMLP-GCN: no propagation) without dropout, with
  the training step's batch-norm groups; the class means are taken over the
  client's training nodes only (never padding, never validation or test
  nodes). The original code averages the train-mode (dropout) embeddings of
  its last local epoch instead: a class mean of one deterministic pass of the
  model actually uploaded is the less noisy estimate of the same quantity.
  """
  hidden, _ = model.apply(params, ctx.x, ctx.graph, train=True, deterministic=True,
                          with_hidden=True, groups=ctx.groups, num_groups=ctx.num_groups)
  means, counts = prototypes.class_prototypes(jax.lax.stop_gradient(hidden), ctx.y,
                                              ctx.train_mask, model.num_classes)
  return PrototypeUpload(means, counts)


def global_prototypes(uploads: PrototypeUpload, participating: Array) -> GlobalPrototypes:
  """The server's new prototypes from the uploads (leaves [C, ...]) of the ``participating`` bool[C].

  Recomputed from this round's uploads alone (no memory of earlier rounds, as
  every public code): a class no participant holds has no prototype.
  """
  return GlobalPrototypes(*prototypes.mean_over_clients(uploads.prototypes, uploads.counts > 0,
                                                        participating))


def prototype_loss(z: Array, y: Array, train_mask: Array, server: GlobalPrototypes) -> Array:
  """FedProto's regulariser L_R in its code's per-node form, f32[].

  ``(1 / (n_tr H)) sum_{i in train} g_{y_i} ||z_i - P_{y_i}||^2`` for
  embeddings z f32[N, H], labels y i32[N] and the training mask bool[N]
  (n_tr its count): the MSE between the embeddings and the same matrix with
  each row replaced by its class's global prototype where there is one (so
  a node of a class without one adds 0 but counts in n_tr). 0 without
  training nodes or prototypes.
  """
  with_prototype = train_mask & server.present[y]
  squared = jnp.sum(jnp.square(z - server.prototypes[y]), axis=-1)
  return base.masked_mean(jnp.where(with_prototype, squared, 0.0), train_mask) / z.shape[-1]


def fedproto(model: NodeClassifier, config: Config, lam: float = 1.0,
             weights: str = "count") -> base.Method:
  """FedProto on a shared model: CE + lam * L_R, prototypes averaged per class, the model by FedAvg.

  Client: at every local step the loss is the cross-entropy plus
  ``lam * prototype_loss`` of the step's embeddings z (the classifier's
  input, before its dropout) against the global prototypes it received;
  round 0 has none, so it is plain CE. After its steps it uploads its
  training nodes' class prototypes and counts (``local_prototypes``).
  Server: the global prototypes are the unweighted per-class mean over the
  participants holding the class (``global_prototypes``; the paper's eq. 6
  writes |D_ij|/N_j factors inside that mean, every public code omits
  them); the model moves by W <- W - eta u, u the mean of the model updates
  (as the graph ports, which add FedAvg to FedProto's prototype-only
  exchange) or what replaces it ("+FedIA"): the prototype mean stays.
  Evaluation is the global model's argmax (as the FedIA paper), not the
  original's nearest prototype.

  Where the public graph ports differ (FGL_METHODS.md §1(h)): z_i is the
  embedding of training node i itself (the FedIA/FGGP port pairs the first
  n_tr rows of the whole graph with the training labels), averaged over
  n_tr H (not N H), and the local prototypes average the training nodes of
  each class. ``lam`` defaults to 1, FedProto's code and README (``--ld``)
  and OpenFGL; the FedIA port's 0.01 is FedProx's mu reused, which makes the
  term negligible.

  Raises:
    ValueError: if ``lam`` < 0 or ``weights`` is not ``count`` or ``uniform``.
  """
  base.check(lam >= 0, "fedproto", "lam", lam, ">= 0")
  descent = base.descent_step(config)

  def init(params, num_clients):
    return base.MethodState(clients=(), server=no_prototypes(model, params))

  def local_loss(params, step, ctx):
    return lam * prototype_loss(step.hidden, ctx.y, ctx.train_mask, ctx.server_state)

  def client_final(ctx, params, update):
    return ctx.client_state, local_prototypes(model, params, ctx)

  def server_step(params, server, update, uploads, participating, num_clients):
    params, _ = descent(params, (), update, uploads, participating, num_clients)
    return params, global_prototypes(uploads, participating)

  return base.Method("fedproto", {"lam": lam, "weights": weights}, base.weights_uniform(weights),
                     init, base.nothing, local_loss, client_final, server_step)
