"""Local training: a client's full-batch SGD steps from the model it starts from.

``make_local_update`` builds the function one client runs in a round; the
simulation runs it for every client of a round at once (``for_each_client``:
a ``vmap`` per size bucket) and the steps in a ``lax.scan``.

A method (``methods.Method``: FedProx, MOON, FedDyn, SCAFFOLD...) adds its term
to the local loss (and may weigh the cross-entropy: ``Method.ce_weight``),
sees everything the client sees (``methods.ClientContext``) and, after the
last step, gives the client's new state and its upload.

References:
  FedIA paper, Sec. 3.1 (descent convention u_k = -(W_k - W)/eta) and
  Appendix A.1 (5 local steps, SGD with momentum 0.9, weight decay 1e-5, eta 0.05).
"""

from typing import Callable, NamedTuple

import jax
import optax

from fedjax_graph import methods as methods_lib
from fedjax_graph.config import Config
from fedjax_graph.methods.base import ClientContext, StepOutput, masked_mean
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array, PyTree


# A step's key for the method's own randomness: fold_in(step key, METHOD_STREAM),
# apart from the dropout keys flax derives from the step key.
METHOD_STREAM = 2**31 + 2


def local_optimizer(config: Config) -> optax.GradientTransformation:
  """SGD with momentum and L2 decay added to the gradient, as torch.optim.SGD(weight_decay=...) does."""
  return optax.chain(optax.add_decayed_weights(config.weight_decay),
                     optax.sgd(config.lr, momentum=config.momentum))


class ClientOutput(NamedTuple):
  """What one client's round produces.

  Attributes:
    update: the client update u_k = -(W_k - W_start)/eta (a pytree shaped like
      the model; W_start the model it started from).
    losses: f32[local_steps] the masked mean cross-entropy before each step
      (without the method's term or weight).
    client_state: its new per-client state (kept only if it took part).
    upload: what it sends besides the update (``()`` for most methods).
  """
  update: PyTree
  losses: Array
  client_state: PyTree
  upload: PyTree


LocalUpdate = Callable[..., ClientOutput]


def make_local_update(model: NodeClassifier, config: Config, method: methods_lib.Method,
                      num_domains: int) -> LocalUpdate:
  """The local training of one client, as a pure function.

  The returned ``local_update(start_params, global_params, x, y, train_mask,
  groups, graph, key, client_state=(), server_state=())`` takes

    start_params: the model the client starts from (the global model W, or
      its own for a ``personal`` method); a method's ``personalise`` then
      puts its own tensors in (the update is taken from what it returns).
    global_params: the global model W (what proximal terms pull towards).
    x: f32[N, F] the client's node features (padded).
    y: i32[N] labels, 0 on padding rows.
    train_mask: bool[N] the client's training nodes.
    groups: i32[N] the batch norm's group of each row, its domain in
      [0, D), and D (``num_domains``) on rows it leaves out (padding; see
      ``simulation.make_training_input``): statistics never cross domains,
      also for the pooled client of the centralised reference.
    graph: the client's padded ``Shard`` when the backbone propagates in
      training or the method needs it (``Method.needs_graph``), else None
      (then only the rows of ``x`` matter).
    key: a PRNG key for this client and round.
    client_state: this client's row of the method's per-client state.
    server_state: the method's server state (read only).

  and returns a ``ClientOutput``. The optimiser state is fresh each round and
  every step draws its own dropout key from ``key``, and from that the
  method's key of the step (``StepOutput.key``).
  """
  optimizer = local_optimizer(config)

  def loss_fn(params, key, ctx):
    hidden, logits = model.apply(params, ctx.x, ctx.graph, train=True, rngs={"dropout": key},
                                 with_hidden=True, groups=ctx.groups,
                                 num_groups=ctx.num_groups)
    cross_entropy = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, ctx.y),
                                ctx.train_mask)
    extra = method.local_loss(
        params, StepOutput(hidden, logits, jax.random.fold_in(key, METHOD_STREAM)), ctx)
    # The method may weigh the cross-entropy (FedProc); 1 for the others (x * 1 == x exactly).
    return method.ce_weight(ctx) * cross_entropy + extra, cross_entropy

  def local_update(start_params, global_params, x, y, train_mask, groups, graph, key,
                   client_state=(), server_state=()):
    if method.personalise is not None:  # e.g. the global model with the client's own head
      start_params = method.personalise(start_params, client_state)
    ctx = ClientContext(start_params, global_params, x, y, train_mask, groups, num_domains,
                        graph, client_state, server_state)
    ctx = ctx._replace(prepared=method.prepare(ctx))

    def step(carry, step_key):
      params, opt_state = carry
      (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, step_key, ctx)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    init = (start_params, optimizer.init(start_params))
    (params, _), losses = jax.lax.scan(step, init, jax.random.split(key, config.local_steps))
    update = jax.tree.map(lambda w, w_k: (w - w_k) / config.lr, start_params, params)
    new_state, upload = method.client_final(ctx, params, update)
    return ClientOutput(update, losses, new_state, upload)

  return local_update
