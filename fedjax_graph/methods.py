"""Base federated methods: FedAvg, FedProx, MOON, FedDyn, FedOpt and SCAFFOLD.

A method is a client part and a server part, written as pure functions so that
the simulation runs all clients of a round in one ``vmap``:

  * ``init(params, num_clients) -> MethodState``: per-client state (every leaf
    ``[C, ...]``, read and written by client index) and server state.
  * ``prepare(global_params, client_state, x, graph, groups)``: what a
    client computes once per round before its local steps (MOON's frozen
    representations; ``groups`` are the batch-norm groups of its rows, see
    ``client.norm_groups``); no gradient flows through it.
  * ``local_loss(params, hidden, prepared, global_params, client_state,
    server_state, train_mask) -> f32[]``: the term added to the client's
    cross-entropy (``hidden`` f32[N, H] is the representation before the
    classifier).
  * ``client_after(client_state, client_update, global_params, server_state)``:
    a participant's new per-client state from its update u_k (descent
    convention, u_k = -(W_k - W)/eta); non-participants keep theirs.
  * ``server_step(params, server_state, update, num_participants,
    num_clients) -> (params, server_state)``: how the aggregate ``update`` of
    the client updates moves the global model and the server state.

Each factory takes the backbone and the training recipe (``Config``: eta, K
local steps) first, then the method's hyper-parameters; ``make_method``
builds one by name from a mapping of hyper-parameters and checks them.

**Composition with FedIA** (the paper's "+FedIA", Sec. 3.3): the simulation
forms the aggregate ``update`` either by the method's own averaging (a
weighted mean over participants, weights uniform or train-node counts as the
method's paper does) or by the FedIA aggregator (Importance Mask + CAM
weights). ``server_step`` and ``client_after`` are the method's own in both
cases, so what FedIA replaces is exactly the mean of the client updates:

  ==========  ===================================================================
  FedAvg      u replaces the count-weighted mean; W <- W - eta u.
  FedProx     as FedAvg (the proximal term is client-side only).
  MOON        as FedAvg (the contrastive term is client-side only).
  FedDyn      u replaces the uniform mean of the participants' model deltas, in
              both W and h: h <- h + alpha eta (|P|/m) u;
              W <- W - eta u - h / alpha.
  FedOpt      u replaces the uniform mean Delta; the server optimiser takes the
              pseudo-gradient eta u.
  SCAFFOLD    u replaces the uniform mean, for the model and for the server
              control variate: W <- W - eta_g eta u;
              c <- c + (|S|/N) (u / K - c) (the mean of c_k+ - c_k, option II).
  ==========  ===================================================================

Per-client state never changes for a client that did not take part in the
round (not sampled, no training node, or a non-finite update).

References:
  FedProx: T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. (2).
  MOON: Q. Li, B. He, D. Song, "Model-Contrastive Federated Learning", CVPR
    2021, eqs. (2)-(3).
  FedDyn: D. A. E. Acar, Y. Zhao, R. M. Navarro, M. Mattina, P. N. Whatmough,
    V. Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR
    2021, Algorithm 1.
  FedOpt: S. J. Reddi, Z. Charles, M. Zaheer, Z. Garrett, K. Rush, J. Konecny,
    S. Kumar, H. B. McMahan, "Adaptive Federated Optimization", ICLR 2021,
    Algorithm 2 (FedAdam, FedYogi) and FedAvgM.
  SCAFFOLD: S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich,
    A. T. Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated
    Learning", ICML 2020, Algorithm 1, option II.
"""

import inspect
import pathlib
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
import yaml

from fedjax_graph.config import Config
from fedjax_graph.models import NodeClassifier
from fedjax_graph.types import Array, PyTree

METHODS_FILE = pathlib.Path(__file__).resolve().parents[1] / "configs/methods/defaults.yaml"


class MethodState(NamedTuple):
  """A method's state in one run.

  Attributes:
    clients: pytree, every leaf [C, ...]: row k is client k's state.
    server: pytree: the server's state.
  """
  clients: PyTree
  server: PyTree


class Method(NamedTuple):
  """A base method's pure client and server functions (see the module docstring).

  Attributes:
    name: e.g. ``fedprox``.
    hparams: its hyper-parameters (static: they are closed over).
    uniform_weights: its own averaging weighs participants uniformly (True)
      or by their training-node counts (False).
    personal: clients train from, and are evaluated with, their own models
      (the per-client state), not the global model (``local``).
  """
  name: str
  hparams: Mapping[str, Any]
  uniform_weights: bool
  init: Callable
  prepare: Callable
  local_loss: Callable
  client_after: Callable
  server_step: Callable
  personal: bool = False


def _zeros_like(tree: PyTree) -> PyTree:
  return jax.tree.map(jnp.zeros_like, tree)


def _per_client(tree: PyTree, num_clients: int) -> PyTree:
  return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (num_clients,) + leaf.shape), tree)


def _sum_sq(a: PyTree, b: PyTree) -> Array:
  """||a - b||^2 over all leaves."""
  return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _dot(a: PyTree, b: PyTree) -> Array:
  """<a, b> over all leaves."""
  return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


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


def _stateless(params, num_clients):
  return MethodState(clients=(), server=())


def _nothing(*_):
  return ()


def _no_loss(*_):
  return jnp.zeros((), jnp.float32)


def _same_client_state(client_state, *_):
  return client_state


def _weights_uniform(weights: str) -> bool:
  if weights not in ("count", "uniform"):
    raise ValueError(f"weights = {weights!r}; choose 'count' (training-node counts) or 'uniform'")
  return weights == "uniform"


def _check(ok: bool, method: str, name: str, value, allowed: str) -> None:
  if not ok:
    raise ValueError(f"{method}: {name} = {value!r}; must be {allowed}")


def _descent_step(config: Config):
  def server_step(params, server_state, update, num_participants, num_clients):
    return jax.tree.map(lambda w, u: w - config.lr * u, params, update), server_state
  return server_step


def fedavg(model: NodeClassifier, config: Config, weights: str = "count") -> Method:
  """FedAvg (McMahan et al. 2017): W <- W - eta u, u the count-weighted mean of the updates."""
  return Method("fedavg", {"weights": weights}, _weights_uniform(weights), _stateless,
                _nothing, _no_loss, _same_client_state, _descent_step(config))


def fedprox(model: NodeClassifier, config: Config, mu: float = 0.01,
            weights: str = "count") -> Method:
  """FedProx: local loss + (mu/2) ||w - W||^2, W the frozen global model (Li et al. 2020, eq. 2).

  Default mu = 0.01 (the paper's grid is {0.001, 0.01, 0.1, 1}); mu = 0 is FedAvg.
  """
  _check(mu >= 0, "fedprox", "mu", mu, ">= 0")

  def local_loss(params, hidden, prepared, global_params, client_state, server_state, mask):
    return 0.5 * mu * _sum_sq(params, global_params)

  return Method("fedprox", {"mu": mu, "weights": weights}, _weights_uniform(weights), _stateless,
                _nothing, local_loss, _same_client_state, _descent_step(config))


def moon(model: NodeClassifier, config: Config, mu: float = 1.0, tau: float = 0.5,
         weights: str = "count") -> Method:
  """MOON: local loss + mu * model-contrastive loss (Li, He, Song 2021, eqs. 2-3).

  The representation z of a node is the last hidden layer's activation (the
  input of the classifier, before dropout); the loss is averaged over the
  client's training nodes, so padding rows never count. Positive: the global
  model's z; negative: the client's previous local model's z (per-client
  state, the initial global model before a client's first round). Both are
  computed once per round with the training-time architecture and no
  dropout. Defaults mu = 1, tau = 0.5 (the paper's setting for most
  datasets).
  """
  _check(mu >= 0, "moon", "mu", mu, ">= 0")
  _check(tau > 0, "moon", "tau", tau, "> 0")

  def init(params, num_clients):
    return MethodState(clients=_per_client(params, num_clients), server=())

  def representation(params, x, graph, groups):
    hidden, _ = model.apply(params, x, graph, train=True, deterministic=True, with_hidden=True,
                            groups=groups)
    return jax.lax.stop_gradient(hidden)

  def prepare(global_params, previous_params, x, graph, groups):
    return (representation(global_params, x, graph, groups),
            representation(previous_params, x, graph, groups))

  def local_loss(params, hidden, prepared, global_params, client_state, server_state, mask):
    per_node = moon_loss(hidden, *prepared, tau)
    return mu * jnp.sum(jnp.where(mask, per_node, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

  def client_after(previous_params, update, global_params, server_state):
    return jax.tree.map(lambda w, u: w - config.lr * u, global_params, update)  # the local model

  return Method("moon", {"mu": mu, "tau": tau, "weights": weights}, _weights_uniform(weights),
                init, prepare, local_loss, client_after, _descent_step(config))


def feddyn(model: NodeClassifier, config: Config, alpha: float = 0.01,
           weights: str = "uniform") -> Method:
  """FedDyn (Acar et al. 2021, Algorithm 1).

  Client k minimises L_k(w) - <g_k, w> + (alpha/2) ||w - W||^2, then
  g_k <- g_k - alpha (w_k - W) = g_k + alpha eta u_k. Server, with m the
  total number of clients and P the participants:
  h <- h - (alpha/m) sum_{k in P} (w_k - W) = h + alpha eta (|P|/m) u and
  W <- mean_{k in P} w_k - h/alpha = W - eta u - h/alpha, u the uniform mean
  of the participants' updates. Default alpha = 0.01 (the paper's grid is
  {0.1, 0.01, 0.001}).
  """
  _check(alpha > 0, "feddyn", "alpha", alpha, "> 0")
  lr = config.lr

  def init(params, num_clients):
    return MethodState(clients=_per_client(_zeros_like(params), num_clients),
                       server=_zeros_like(params))

  def local_loss(params, hidden, prepared, global_params, grad_state, h, mask):
    return 0.5 * alpha * _sum_sq(params, global_params) - _dot(grad_state, params)

  def client_after(grad_state, update, global_params, h):
    return jax.tree.map(lambda g, u: g + alpha * lr * u, grad_state, update)

  def server_step(params, h, update, num_participants, num_clients):
    share = num_participants / num_clients
    h = jax.tree.map(lambda h_, u: h_ + alpha * lr * share * u, h, update)
    return jax.tree.map(lambda w, u, h_: w - lr * u - h_ / alpha, params, update, h), h

  return Method("feddyn", {"alpha": alpha, "weights": weights}, _weights_uniform(weights), init,
                _nothing, local_loss, client_after, server_step)


SERVER_OPTIMIZERS = ("adam", "yogi", "avgm")


def fedopt(model: NodeClassifier, config: Config, server_opt: str = "adam",
           server_lr: Optional[float] = None, tau: float = 1e-3, b1: float = 0.9,
           b2: float = 0.99, weights: str = "uniform") -> Method:
  """FedOpt (Reddi et al. 2021, Algorithm 2): an optax server optimiser on a pseudo-gradient.

  The pseudo-gradient is eta u = -Delta (Delta the mean model delta of the
  participants), so a zero aggregate from a fresh state moves nothing.
  ``server_opt``: ``adam`` (FedAdam via ``optax.adam``, which also
  bias-corrects its moments) or ``yogi`` (FedYogi via ``optax.scale_by_yogi``,
  moments starting at 0), both
  with adaptivity ``tau`` as eps; ``avgm`` (FedAvgM via ``optax.sgd`` with
  momentum ``b1``; server_lr 1 and b1 0 is FedAvg). Defaults from the paper:
  server_lr 10^-2 (adam, yogi) or 1 (avgm), tau 10^-3, b1 0.9, b2 0.99.
  Both adaptive optimisers bias-correct their moments, which the paper's
  Algorithm 2 does not.
  """
  if server_lr is None:
    server_lr = 1.0 if server_opt == "avgm" else 0.01
  _check(server_opt in SERVER_OPTIMIZERS, "fedopt", "server_opt", server_opt,
         f"one of {SERVER_OPTIMIZERS}")
  _check(server_lr > 0, "fedopt", "server_lr", server_lr, "> 0")
  _check(tau > 0, "fedopt", "tau", tau, "> 0")
  _check(0 <= b1 < 1, "fedopt", "b1", b1, "in [0, 1)")
  _check(0 <= b2 < 1, "fedopt", "b2", b2, "in [0, 1)")
  if server_opt == "adam":
    optimizer = optax.adam(server_lr, b1=b1, b2=b2, eps=tau)
  elif server_opt == "yogi":
    # optax.yogi starts both moments at 1e-6, so a zero update would still
    # move; the paper starts the first moment at 0.
    optimizer = optax.chain(
        optax.scale_by_yogi(b1=b1, b2=b2, eps=tau, initial_accumulator_value=0.0),
        optax.scale(-server_lr))
  else:
    optimizer = optax.sgd(server_lr, momentum=b1 or None)

  def init(params, num_clients):
    return MethodState(clients=(), server=optimizer.init(params))

  def server_step(params, opt_state, update, num_participants, num_clients):
    pseudo_grad = jax.tree.map(lambda u: config.lr * u, update)
    steps, opt_state = optimizer.update(pseudo_grad, opt_state, params)
    return optax.apply_updates(params, steps), opt_state

  hparams = {"server_opt": server_opt, "server_lr": server_lr, "tau": tau, "b1": b1, "b2": b2,
             "weights": weights}
  return Method("fedopt", hparams, _weights_uniform(weights), init, _nothing, _no_loss,
                _same_client_state, server_step)


def effective_steps(local_steps: int, momentum: float) -> float:
  """K_eff = sum_{t=1..K} (1 - m^t)/(1 - m): gradients' worth of movement of K momentum steps.

  Under a constant gradient g, K steps of SGD with momentum m move the model
  by eta K_eff g; K_eff = K for plain SGD (m = 0).
  """
  return float(sum((1 - momentum**t) / (1 - momentum) for t in range(1, local_steps + 1)))


def scaffold(model: NodeClassifier, config: Config, server_lr: float = 1.0,
             weights: str = "uniform") -> Method:
  """SCAFFOLD with option II control variates (Karimireddy et al. 2020, Algorithm 1).

  Every local gradient is corrected by c - c_k, realised as the loss term
  <c - c_k, w> whose gradient is exactly that. Option II sets
  c_k+ = c_k - c + (W - w_k)/(K eta), the mean corrected gradient of plain
  SGD. The local optimiser here has momentum m (0.9), under which K steps
  move eta K_eff gradients (``effective_steps``: 13.1 for K = 5), so the
  estimate divides by K_eff: c_k+ = c_k - c + u_k/K_eff (the paper's formula
  when m = 0). Dividing by K instead overestimates the gradient 2.6-fold
  and the control variates diverge (measured on a quadratic toy problem).
  Server: W <- W - eta_g eta u and c <- c + (|S|/N) (u/K_eff - c), u the
  uniform mean (so (u/K_eff - c) is the mean of c_k+ - c_k). Default
  eta_g = 1.
  """
  _check(server_lr > 0, "scaffold", "server_lr", server_lr, "> 0")
  steps = effective_steps(config.local_steps, config.momentum)

  def init(params, num_clients):
    zeros = _zeros_like(params)
    return MethodState(clients=_per_client(zeros, num_clients), server=zeros)

  def local_loss(params, hidden, prepared, global_params, c_k, c, mask):
    return _dot(jax.tree.map(jnp.subtract, c, c_k), params)

  def client_after(c_k, update, global_params, c):
    return jax.tree.map(lambda ck, c_, u: ck - c_ + u / steps, c_k, c, update)

  def server_step(params, c, update, num_participants, num_clients):
    share = num_participants / num_clients
    params = jax.tree.map(lambda w, u: w - server_lr * config.lr * u, params, update)
    return params, jax.tree.map(lambda c_, u: c_ + share * (u / steps - c_), c, update)

  return Method("scaffold", {"server_lr": server_lr, "weights": weights},
                _weights_uniform(weights), init, _nothing, local_loss, client_after,
                server_step)


def local(model: NodeClassifier, config: Config) -> Method:
  """Local training alone, a reference row (not a federated method).

  Every client trains its own model: per-client state is its model, each
  round it runs the same local steps from it (optimiser state fresh each
  round, as the federated clients) and keeps the result; nothing is
  aggregated and the global model never moves. ``personal``: a domain's test
  node is classified by the model of the client that holds it.
  """
  def init(params, num_clients):
    return MethodState(clients=_per_client(params, num_clients), server=())

  def client_after(own_params, update, global_params, server_state):
    return jax.tree.map(lambda w, u: w - config.lr * u, own_params, update)

  def server_step(params, server_state, update, num_participants, num_clients):
    return params, server_state

  return Method("local", {}, False, init, _nothing, _no_loss, client_after, server_step,
                personal=True)


METHODS = {"fedavg": fedavg, "fedprox": fedprox, "moon": moon, "feddyn": feddyn,
           "fedopt": fedopt, "scaffold": scaffold}
DISPLAY = {"fedavg": "FedAvg", "fedprox": "FedProx", "moon": "MOON", "feddyn": "FedDyn",
           "fedopt": "FedOpt", "scaffold": "SCAFFOLD"}


def make_method(name: str, model: NodeClassifier, config: Config,
                hparams: Optional[Mapping[str, Any]] = None) -> Method:
  """The method called ``name`` with ``hparams`` over its defaults.

  Raises:
    ValueError: for an unknown method or hyper-parameter, or a value out of
      its range, naming it and what is allowed.
  """
  factories = {**METHODS, "local": local}
  if name not in factories:
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
  factory = factories[name]
  hparams = dict(hparams or {})
  allowed = list(inspect.signature(factory).parameters)[2:]
  unknown = sorted(set(hparams) - set(allowed))
  if unknown:
    raise ValueError(f"{name}: unknown hyper-parameter(s) {unknown}; valid: {allowed}")
  try:
    return factory(model, config, **hparams)
  except TypeError as err:  # e.g. mu: "0.01" compared with 0
    raise ValueError(f"{name}: a hyper-parameter has the wrong type in {hparams} ({err})")


def method_defaults(path: pathlib.Path = METHODS_FILE) -> dict:
  """Reads and checks a method config (default ``configs/methods/defaults.yaml``).

  The file maps ``hparams`` to ``{method: {name: value}}`` (methods left out
  take the functions' defaults) and ``fedia`` to ``{default: [rho, beta],
  <dataset>: {<setting>: {method: [rho, beta]}}}``.

  Raises:
    ValueError: naming the file and the key of the first bad entry.
    OSError: if the file cannot be read.
  """
  with open(path) as f:
    try:
      raw = yaml.safe_load(f)
    except yaml.YAMLError as err:
      raise ValueError(f"{path}: not valid YAML ({err})")
  return check_method_config(raw, str(path))


def _pair(value, where: str) -> tuple[float, float]:
  ok = (isinstance(value, (list, tuple)) and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))
  if not ok:
    raise ValueError(f"{where} = {value!r}; must be [rho, beta], two numbers")
  rho, beta = float(value[0]), float(value[1])
  if not 0 < rho <= 1:
    raise ValueError(f"{where}: rho = {rho:g}; the mask ratio must be in (0, 1]")
  if not 0 <= beta <= 1:
    raise ValueError(f"{where}: beta = {beta:g}; the momentum must be in [0, 1]")
  return rho, beta


def check_method_config(raw, source: str = "method config") -> dict:
  """Checks a method config's structure (see ``method_defaults``); returns it, defaults filled.

  Raises:
    ValueError: naming ``source`` and the key of the first bad entry.
  """
  def mapping(value, where):
    if value is None:
      return {}
    if not isinstance(value, dict):
      raise ValueError(f"{source}: {where} must be a mapping, got {value!r}")
    return value

  if not isinstance(raw, dict) or not raw:
    raise ValueError(f"{source}: must be a mapping with the keys 'hparams' and 'fedia'")
  unknown = sorted(set(raw) - {"hparams", "fedia"})
  if unknown:
    raise ValueError(f"{source}: unknown key(s) {unknown}; valid: ['fedia', 'hparams']")
  hparams = mapping(raw.get("hparams"), "hparams")
  for name, values in hparams.items():
    if name not in METHODS:
      raise ValueError(f"{source}: hparams.{name}: unknown method; choose from "
                       f"{', '.join(METHODS)}")
    hparams[name] = mapping(values, f"hparams.{name}")
  fedia = mapping(raw.get("fedia"), "fedia")
  fedia["default"] = _pair(fedia.get("default", [0.5, 0.5]), f"{source}: fedia.default")
  for dataset, settings in fedia.items():
    if dataset == "default":
      continue
    for setting, table in mapping(settings, f"fedia.{dataset}").items():
      for name, pair in mapping(table, f"fedia.{dataset}.{setting}").items():
        where = f"{source}: fedia.{dataset}.{setting}.{name}"
        if name not in METHODS:
          raise ValueError(f"{where}: unknown method; choose from {', '.join(METHODS)}")
        _pair(pair, where)
  return {"hparams": hparams, "fedia": fedia}
