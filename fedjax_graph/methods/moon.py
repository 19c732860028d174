"""MOON: model-contrastive learning between the local, global and previous representations.

References:
  Q. Li, B. He, D. Song, "Model-Contrastive Federated Learning", CVPR 2021,
  eqs. (2)-(3).
"""

import jax
import jax.numpy as jnp

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array


def cosine_similarity(a: Array, b: Array, eps: float = 1e-8) -> Array:
  """Row-wise cosine f32[N] of a, b f32[N, H]; 0, with a finite gradient, for a zero row."""
  dot = jnp.sum(a * b, axis=-1)
  # max() inside the square root: a zero row gives eps, never 0 (no NaN gradient).
  return dot / jnp.sqrt(jnp.maximum(jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1), eps**2))


def moon_loss(z: Array, z_global: Array, z_prev: Array, tau: float) -> Array:
  """MOON's model-contrastive loss per node f32[N] (Li et al. 2021, eq. 2).

  ``-log(e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}))``
  = ``softplus((sim(z, z_prev) - sim(z, z_glob)) / tau)``: ln 2 when the two
  similarities are equal.
  """
  return jax.nn.softplus((cosine_similarity(z, z_prev) - cosine_similarity(z, z_global)) / tau)


def moon(model: NodeClassifier, config: Config, mu: float = 1.0, tau: float = 0.5,
         weights: str = "count") -> base.Method:
  """MOON: local loss + mu * model-contrastive loss.

  The representation z of a node is the last hidden layer's activation (the
  input of the classifier, before dropout); the loss is averaged over the
  client's training nodes, so padding rows never count. Positive: the global
  model's z; negative: the client's previous local model's z (per-client
  state, the initial global model before a client's first round). Both are
  computed once per round with the training-time architecture and no
  dropout. Defaults mu = 1, tau = 0.5 (the paper's setting for most
  datasets).
  """
  base.check(mu >= 0, "moon", "mu", mu, ">= 0")
  base.check(tau > 0, "moon", "tau", tau, "> 0")

  def init(params, num_clients):
    return base.MethodState(clients=base.per_client(params, num_clients), server=())

  def representation(params, ctx):
    hidden, _ = model.apply(params, ctx.x, ctx.graph, train=True, deterministic=True,
                            with_hidden=True, groups=ctx.groups, num_groups=ctx.num_groups)
    return jax.lax.stop_gradient(hidden)

  def prepare(ctx):
    return representation(ctx.global_params, ctx), representation(ctx.client_state, ctx)

  def local_loss(params, step, ctx):
    return mu * base.masked_mean(moon_loss(step.hidden, *ctx.prepared, tau), ctx.train_mask)

  def client_final(ctx, params, update):
    return params, ()  # the local model, next round's negative

  return base.Method("moon", {"mu": mu, "tau": tau, "weights": weights},
                     base.weights_uniform(weights), init, prepare, local_loss, client_final,
                     base.descent_step(config))
