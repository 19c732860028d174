"""Local training: a client's full-batch SGD steps from the global model.

``make_local_update`` builds the function one client runs in a round; the
simulation vmaps it over the clients of a size bucket, so all clients train in
one batched computation and the steps run in a ``lax.scan``.

References:
  FedIA paper, Sec. 3.1 (descent convention u_k = -(W_k - W)/eta) and
  Appendix A.1 (5 local steps, SGD with momentum 0.9, weight decay 1e-5, eta 0.05).
"""

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_graph.config import Config
from fedjax_graph.graphs import Graph
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


LocalUpdate = Callable[[PyTree, Array, Array, Array, Optional[Graph], Array], tuple[PyTree, Array]]


def make_local_update(model: NodeClassifier, config: Config) -> LocalUpdate:
  """The local training of one client, as a pure function.

  The returned ``local_update(global_params, x, y, train_mask, graph, key)`` takes

    global_params: the global model W (a pytree of f32 arrays).
    x: f32[N, F] the client's node features (padded).
    y: i32[N] labels, 0 on padding rows.
    train_mask: bool[N] the client's training nodes.
    graph: the client's padded ``Shard`` when the backbone propagates in
      training, else None (then only the rows of ``x`` matter).
    key: a PRNG key for this client and round.

  and returns ``(client_update, losses)``: the update u_k = -(W_k - W)/eta in
  the descent convention (a pytree shaped like W) and f32[local_steps] the
  masked mean cross-entropy before each step. The optimiser state is fresh each
  round and every step draws its own dropout key from ``key``.
  """
  optimizer = local_optimizer(config)

  def loss_fn(params, x, y, train_mask, graph, key):
    logits = model.apply(params, x, graph, train=True, rngs={"dropout": key})
    return masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), train_mask)

  def local_update(global_params, x, y, train_mask, graph, key):
    def step(carry, step_key):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y, train_mask, graph, step_key)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    init = (global_params, optimizer.init(global_params))
    (params, _), losses = jax.lax.scan(step, init, jax.random.split(key, config.local_steps))
    client_update = jax.tree.map(lambda w, w_k: (w - w_k) / config.lr, global_params, params)
    return client_update, losses

  return local_update
