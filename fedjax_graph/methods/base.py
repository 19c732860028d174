"""The shape of a federated method: a client part and a server part, as pure functions.

The simulation runs all clients of a round in one ``vmap`` and the local steps
in a ``lax.scan``, so a method is a record of pure functions (fedjax's
client_init / client_step / client_final split, optax's style):

  * ``init(params, num_clients) -> MethodState``: per-client state (every leaf
    ``[C, ...]``, read and written by client index) and server state.
  * ``prepare(ctx) -> prepared``: what a client computes once per round
    before its local steps (e.g. MOON's frozen representations); no gradient
    flows through it. ``ctx.prepared`` holds it during the steps.
  * ``local_loss(params, step, ctx) -> f32[]``: the term added to the
    client's cross-entropy at each local step; ``step`` holds the current
    model's hidden representation and logits (``StepOutput``).
  * ``ce_weight(ctx) -> f32[]``: the weight of that cross-entropy in the
    local objective (``ce_weight * CE + local_loss``); 1 unless a method
    weighs it (FedProc's 1 - alpha_t).
  * ``client_final(ctx, params, update) -> (client_state, upload)``: after
    the last step, the client's new state (kept only if it took part) and
    what it uploads besides its model update ``update`` (descent convention,
    u_k = -(W_k - W)/eta): any pytree of fixed shape, e.g. class prototypes
    [K, H] and counts [K]; ``()`` for none. Uploads are stacked [C, ...]
    like the updates.
  * ``server_step(params, server_state, update, uploads, participating,
    num_clients) -> (params, server_state)``: how the aggregate ``update`` of
    the participants' model updates (the aggregator's output) and their
    ``uploads`` (leaves [C, ...], rows of non-participants must be ignored)
    move the global model and the server state.

Optional hooks (None: the plain behaviour; see ``Method``) let a method
extend the model (``extend_params``), keep some of its tensors per client
(``personal_leaves`` with ``personalise``), see the whole client graph in
training (``needs_graph``), draw its own randomness at each step
(``StepOutput.key``) and predict otherwise than by the classifier's argmax
(``predict``).

Each method's module builds one with a factory ``factory(model, config,
**hparams)``; ``methods.make_method`` finds it by name and checks the
hyper-parameters.
"""

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from fedjax_graph.config import Config
from fedjax_graph.types import Array, PyTree


class MethodState(NamedTuple):
  """A method's state in one run.

  Attributes:
    clients: pytree, every leaf [C, ...]: row k is client k's state.
    server: pytree: the server's state.
  """
  clients: PyTree
  server: PyTree


class ClientContext(NamedTuple):
  """Everything one client's local training sees in a round.

  Attributes:
    params: the model the client starts from (the global model, or its own
      for a ``personal`` method).
    global_params: the global model W.
    x: f32[N, F] node features (the rows its backbone trains on).
    y: i32[N] labels, 0 on padding rows.
    train_mask: bool[N] training nodes.
    groups: i32[N] the batch norm's group of each row (its domain), and
      ``num_groups`` on the rows it leaves out.
    num_groups: D, static.
    graph: the client's padded ``Shard`` when the backbone propagates in
      training or the method asks for it (``Method.needs_graph``), else None.
    client_state: this client's row of the per-client state.
    server_state: the method's server state (read only).
    prepared: what ``Method.prepare`` returned (None while preparing).
  """
  params: PyTree
  global_params: PyTree
  x: Array
  y: Array
  train_mask: Array
  groups: Array
  num_groups: int
  graph: Optional[Any]
  client_state: PyTree
  server_state: PyTree
  prepared: PyTree = None


class StepOutput(NamedTuple):
  """The current model's forward pass at one local step.

  Attributes:
    hidden: f32[N, H] the classifier's input before dropout.
    logits: f32[N, K].
    key: a PRNG key for the method's own randomness at this step (e.g.
      FGSSL's augmented views), drawn from the step's key apart from the
      model's dropout key (``client.METHOD_STREAM``), so it is the same in
      every cell of a seed (paired runs); None where no step runs.
  """
  hidden: Array
  logits: Array
  key: Optional[Array] = None


def unit_ce_weight(ctx) -> Array:
  """``Method.ce_weight`` of every method that keeps the cross-entropy as it is: 1."""
  return jnp.ones((), jnp.float32)


class Method(NamedTuple):
  """A method's pure client and server functions (see the module docstring).

  Attributes:
    name: e.g. ``fedprox``.
    hparams: its hyper-parameters (static: they are closed over).
    uniform_weights: its own averaging weighs participants uniformly (True)
      or by their training-node counts (False): the base weights its
      aggregator gets.
    personal: clients train from, and are evaluated with, their own models
      (the per-client state), not the global model (``local``).
    ce_weight: ``ce_weight(ctx) -> f32[]``, the cross-entropy's weight in
      the local objective (default 1: the objective is CE + local_loss, bit
      for bit as without the field).
    needs_graph: the method's client part uses the client's graph, so
      ``ctx.graph`` is its whole padded ``Shard`` (all rows and edges) also
      with a backbone that does not propagate in training (PMLP-GCN, MLP),
      whose own forward pass still ignores it; ``ctx.x`` and the other rows
      stay what the backbone trains on, the first rows of the shard
      (``simulation.make_training_input``).
    personal_leaves: ``personal_leaves(path) -> bool`` on a parameter's path
      (``path_names``, e.g. ``("params", "layer_2", "kernel")``): True for the
      tensors each client keeps for itself (FGGP's classifier). They are left
      out of the aggregation: no aggregator sees them (not in FedIA's masks,
      norms or scores, nor in GMA's or FedHEAL's statistics), their update is
      0, so the global model keeps its own value of them. None: none.
    personalise: ``personalise(params, client_state) -> params``: the model a
      client starts its local steps from, given the global model and its row
      of the per-client state (e.g. the global model with the client's own
      personal leaves). None: the global model as it is.
    extend_params: ``extend_params(params, key) -> params``: the global
      model's initial parameters with the method's own added (e.g. FGGP's
      augmentor, under a key of its own); they are trained and aggregated like
      the backbone's unless ``personal_leaves`` says otherwise. None: none.
    predict: ``predict(params, server_state, hidden f32[N, H], logits
      f32[N, K]) -> scores f32[N, K]`` from the global model's inference pass:
      evaluation scores the argmax of these (FGGP's k-nearest prototypes) and
      reports the classifier's argmax beside them (``Scores.argmax_acc``).
      None: the classifier's argmax.
  """
  name: str
  hparams: Mapping[str, Any]
  uniform_weights: bool
  init: Callable
  prepare: Callable
  local_loss: Callable
  client_final: Callable
  server_step: Callable
  personal: bool = False
  ce_weight: Callable = unit_ce_weight
  needs_graph: bool = False
  personal_leaves: Optional[Callable[[tuple], bool]] = None
  personalise: Optional[Callable] = None
  extend_params: Optional[Callable] = None
  predict: Optional[Callable] = None


def stateless(params, num_clients) -> MethodState:
  return MethodState(clients=(), server=())


def nothing(ctx) -> tuple:
  return ()


def no_loss(params, step, ctx) -> Array:
  return jnp.zeros((), jnp.float32)


def keep_state(ctx, params, update):
  """``client_final`` of a method whose clients keep their state and upload nothing."""
  return ctx.client_state, ()


def descent_step(config: Config) -> Callable:
  """``server_step`` of FedAvg: W <- W - eta u (FedIA paper, eq. 8)."""
  def server_step(params, server_state, update, uploads, participating, num_clients):
    return jax.tree.map(lambda w, u: w - config.lr * u, params, update), server_state
  return server_step


def per_client(tree: PyTree, num_clients: int) -> PyTree:
  """``tree`` repeated along a new leading [C] axis."""
  return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_clients,) + leaf.shape), tree)


def zeros_like(tree: PyTree) -> PyTree:
  return jax.tree.map(jnp.zeros_like, tree)


def sum_sq(a: PyTree, b: PyTree) -> Array:
  """||a - b||^2 over all leaves."""
  return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def dot(a: PyTree, b: PyTree) -> Array:
  """<a, b> over all leaves."""
  return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def masked_mean(values: Array, mask: Array) -> Array:
  """Mean of ``values`` f32[N] over ``mask`` bool[N]; 0 when the mask is empty."""
  return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def weights_uniform(weights: str) -> bool:
  """``weights: count | uniform`` of a method's own averaging, as a bool."""
  if weights not in ("count", "uniform"):
    raise ValueError(f"weights = {weights!r}; choose 'count' (training-node counts) or 'uniform'")
  return weights == "uniform"


def check(ok: bool, method: str, name: str, value, allowed: str) -> None:
  """Raises ValueError ``<method>: <name> = <value>; must be <allowed>`` unless ``ok``."""
  if not ok:
    raise ValueError(f"{method}: {name} = {value!r}; must be {allowed}")


def path_names(path: Sequence) -> tuple:
  """A pytree key path as plain names: ``(DictKey('params'), DictKey('layer_2'))`` -> ``('params', 'layer_2')``."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def select(tree: PyTree, keep: Callable[[tuple], bool]) -> PyTree:
  """``tree`` with the leaves whose path ``keep`` rejects replaced by None (an empty subtree).

  A pytree function then sees only the kept leaves (e.g. an aggregator sees
  only the shared tensors); ``fill`` puts the others back.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf if keep(path_names(path)) else None, tree)


def fill(part: PyTree, full: PyTree, missing: Callable) -> PyTree:
  """``full``'s structure with ``part``'s leaves where it has them and ``missing(full_leaf)`` elsewhere.

  ``part`` is a ``select`` of a tree shaped like ``full`` (None where a leaf
  was left out).
  """
  return jax.tree.map(lambda p, f: missing(f) if p is None else p, part, full,
                      is_leaf=lambda x: x is None)
