"""Local training: a client's full-batch SGD steps from the global model.

``make_local_update`` builds the function one client runs in a round; the
simulation vmaps it over the clients of a size bucket, so all clients train in
one batched computation and the steps run in a ``lax.scan``.

A base method (``methods.Method``: FedProx, MOON, FedDyn, SCAFFOLD...) adds
its term to the local loss; its per-client state arrives as an argument.

References:
  FedIA paper, Sec. 3.1 (descent convention u_k = -(W_k - W)/eta) and
  Appendix A.1 (5 local steps, SGD with momentum 0.9, weight decay 1e-5, eta 0.05).
"""

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_graph import methods as methods_lib
from fedjax_graph.config import Config
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array, PyTree


def masked_mean(values: Array, mask: Array) -> Array:
  """Mean of ``values`` f32[N] over ``mask`` bool[N]; 0 when the mask is empty."""
  total = jnp.sum(jnp.where(mask, values, 0.0))
  return total / jnp.maximum(jnp.sum(mask), 1)


def local_optimizer(config: Config) -> optax.GradientTransformation:
  """SGD with momentum and L2 decay added to the gradient, as torch.optim.SGD(weight_decay=...) does."""
  return optax.chain(optax.add_decayed_weights(config.weight_decay),
                     optax.sgd(config.lr, momentum=config.momentum))


LocalUpdate = Callable[..., tuple[PyTree, Array]]


def norm_groups(node_mask: Array) -> Array:
  """i32[N] batch-norm groups of one client: 0 on its nodes, 1 (excluded) on padding."""
  return jnp.where(node_mask, 0, 1).astype(jnp.int32)


def make_local_update(model: NodeClassifier, config: Config,
                      method: Optional[methods_lib.Method] = None) -> LocalUpdate:
  """The local training of one client, as a pure function.

  The returned ``local_update(global_params, x, y, train_mask, node_mask,
  graph, key, client_state=(), server_state=())`` takes

    global_params: the global model W (a pytree of f32 arrays).
    x: f32[N, F] the client's node features (padded).
    y: i32[N] labels, 0 on padding rows.
    train_mask: bool[N] the client's training nodes.
    node_mask: bool[N] the rows whose statistics the batch norm takes (the
      client's real nodes); False on padding.
    graph: the client's padded ``Shard`` when the backbone propagates in
      training, else None (then only the rows of ``x`` matter).
    key: a PRNG key for this client and round.
    client_state: this client's row of the method's per-client state.
    server_state: the method's server state (read only).

  and returns ``(client_update, losses)``: the update u_k = -(W_k - W)/eta in
  the descent convention (a pytree shaped like W) and f32[local_steps] the
  masked mean cross-entropy before each step (without the method's term).
  The optimiser state is fresh each round and every step draws its own
  dropout key from ``key``. ``method`` defaults to FedAvg (no extra term).
  """
  optimizer = local_optimizer(config)
  method = method or methods_lib.fedavg(model, config)

  def loss_fn(params, x, y, train_mask, groups, graph, key, context):
    global_params, client_state, server_state, prepared = context
    hidden, logits = model.apply(params, x, graph, train=True, rngs={"dropout": key},
                                 with_hidden=True, groups=groups)
    cross_entropy = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y),
                                train_mask)
    extra = method.local_loss(params, hidden, prepared, global_params, client_state,
                              server_state, train_mask)
    return cross_entropy + extra, cross_entropy

  def local_update(global_params, x, y, train_mask, node_mask, graph, key, client_state=(),
                   server_state=()):
    groups = norm_groups(node_mask)
    context = (global_params, client_state, server_state,
               method.prepare(global_params, client_state, x, graph, groups))

    def step(carry, step_key):
      params, opt_state = carry
      (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, x, y, train_mask, groups, graph, step_key, context)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    init = (global_params, optimizer.init(global_params))
    (params, _), losses = jax.lax.scan(step, init, jax.random.split(key, config.local_steps))
    client_update = jax.tree.map(lambda w, w_k: (w - w_k) / config.lr, global_params, params)
    return client_update, losses

  return local_update
