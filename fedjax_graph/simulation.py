"""One federated round, chunks of rounds, and evaluation, batched over runs.

A *run* is one (seed, grid cell) pair. The whole batch of runs advances
together: training and aggregation are ``vmap``-ped over cells and seeds (and,
inside, over the clients of each size bucket), evaluation is ``vmap``-ped too
and its propagations over the shared evaluation graph fuse into one sparse
product for all runs (``graphs.propagate`` on a ``CSRGraph``). A chunk of
rounds is one ``lax.scan``; Python only loops over chunks.

One round (FedIA paper, Algorithm 1; a base method from ``methods``):
  1. a seeded sample of clients takes part (all with participation 1); every
     client k starts from the global model W and runs its local steps with
     the method's loss term, returning u_k = -(W_k - W)/eta;
  2. the server aggregates the participants' updates: the method's own mean
     (uniform or train-count weights), IM-masked (FedAvg+IM) or FedIA
     (eqs. 5-8), chosen per cell by traced values so all live in one
     compiled program;
  3. the method's server step moves W (FedAvg: W <- W - eta * u, eq. 8) and
     its state; participants update their per-client state;
  4. the new global model is evaluated on every domain's full graph.
"""

import hashlib
import json
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_graph import aggregators
from fedjax_graph import methods as methods_lib
from fedjax_graph.client import make_local_update
from fedjax_graph.config import Config
from fedjax_graph.data import Federation
from fedjax_graph.graphs import CSRGraph
from fedjax_graph.models import NodeClassifier, make_model, predict
from fedjax_graph.types import Array, PyTree, Shard


class Cells(NamedTuple):
  """The aggregation settings of a batch of G' cells (traced, so one compile serves all).

  A cell aggregates the participants' updates masked by Importance Masking at
  ratio ``rho`` (rho = 1: no mask), weighted by CAM's alpha (``momentum``) or
  by the base method's own weights. The base method: fedia False, momentum
  False, rho 1; FedIA: both True; IM only (an ablation): fedia True,
  momentum False.

  Attributes:
    rho: f32[G'] mask ratio in (0, 1] (1 where ``fedia`` is False).
    beta: f32[G'] CAM momentum in [0, 1] (ignored where ``momentum`` is False).
    fedia: bool[G'] True: the cell uses FedIA's mask.
    stream: i32[G'] the cell's random stream, ``cell_stream(...)`` of its
      settings: a cell draws the same numbers in any grid, at any position.
    momentum: bool[G'] True: CAM weights; False: the method's own weights.
  """
  rho: Array
  beta: Array
  fedia: Array
  stream: Array
  momentum: Array


def cell_stream(fedia: bool, rho: float, beta: float, momentum: Optional[bool] = None) -> int:
  """A 31-bit id of a cell's settings, folded into the seed's key (host).

  Deriving keys from what a cell *is*, not where it sits in a batch, keeps a
  cell's result independent of the rest of the grid, while distinct cells
  (and seeds) still never share a key. ``momentum`` defaults to ``fedia``.
  """
  momentum = fedia if momentum is None else momentum
  if fedia and not momentum:
    text = f"im:{rho:.9g}"
  else:
    text = f"fedia:{rho:.9g}:{beta:.9g}" if fedia else "fedavg"
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") >> 1


# Sampling keys derive from the seed alone (a fold_in datum above every cell
# stream), so the base method and its "+FedIA" cells see the same clients.
SAMPLING_STREAM = 2**31 + 1


def sample_clients(key: Array, round_index, num_clients: int, fraction: float) -> Array:
  """bool[C]: the clients taking part in round t, a seeded uniform sample.

  ``max(1, round(fraction * C))`` clients without replacement, drawn from
  ``fold_in(key, t)``; all clients when that is C (static ``fraction``).
  """
  count = max(1, round(fraction * num_clients))
  if count >= num_clients:
    return jnp.ones((num_clients,), bool)
  order = jnp.argsort(jax.random.uniform(jax.random.fold_in(key, round_index), (num_clients,)))
  return jnp.zeros((num_clients,), bool).at[order[:count]].set(True)


class SimState(NamedTuple):
  """State of one run between rounds (leaves gain [S, G'] axes in a sweep).

  Attributes:
    params: the global model W.
    aggregator: FedIA's state (alpha f32[C]); unused by cells without CAM.
    method: the base method's ``MethodState`` (per-client leaves [C, ...]).
    key: the run's PRNG key; round t uses fold_in(key, t).
    sample_key: the seed's client-sampling key (the same in every cell).
  """
  params: PyTree
  aggregator: aggregators.FedIAState
  method: methods_lib.MethodState
  key: Array
  sample_key: Array


class RoundMetrics(NamedTuple):
  """What a round records (leaves gain [S, G', T] axes in a sweep).

  Attributes:
    test_acc: f32[D] test accuracy of the global model per domain, in [0, 1].
    val_acc: f32[D] validation accuracy per domain.
    train_loss: f32[] mean over clients of the last local step's loss.
    alpha: f32[C] the aggregation weights applied this round (FedIA's alpha, or
      FedAvg's train-count weights); 0 for clients left out.
    mask_coverage: f32[] share of coordinates FedIA kept (1 for FedAvg).
    nonfinite: bool[C] clients whose update held a NaN or Inf; they were left
      out of the aggregation (see ``make_simulation``).
    predicted_classes: i32[D] how many distinct classes the global model
      predicts on each domain's test nodes (1: a constant prediction).
    diagnostics: ``diagnostics.RoundDiagnostics`` of the round's client updates
      at the rounds a ``DiagnosticsSpec`` names (zeros at other rounds), or
      None when diagnostics are off.
  """
  test_acc: Array
  val_acc: Array
  train_loss: Array
  alpha: Array
  mask_coverage: Array
  nonfinite: Array
  predicted_classes: Array
  diagnostics: Optional[NamedTuple] = None


class DiagnosticsSpec(NamedTuple):
  """Opt-in update diagnostics (FedIA paper, Sec. 3.2), computed inside the jitted rounds.

  Attributes:
    rounds: the 1-based rounds at which to compute them (static).
    top: the salient share p of coordinates per client (static), e.g. 0.05.
  """
  rounds: tuple[int, ...]
  top: float = 0.05


class SimData(NamedTuple):
  """The device arrays of a ``Federation`` (passed to jit as arguments, never closed over)."""
  client_shards: tuple[Shard, ...]
  train_counts: Array
  eval_x: Array
  eval_y: Array
  eval_domain: Array
  eval_graph: CSRGraph
  eval_val: Array
  eval_test: Array


def sim_data(federation: Federation) -> SimData:
  """Moves a federation's arrays to the device."""
  f = federation
  return jax.device_put(SimData(f.client_shards, f.train_counts, f.eval_x, f.eval_y,
                                f.eval_domain, f.eval_graph, f.eval_val, f.eval_test))


class Simulation(NamedTuple):
  """The pieces of a sweep; ``init`` and ``run_chunk`` are the compiled program.

  Attributes:
    model: the backbone.
    local_update: one client's local training (``client.make_local_update``).
    aggregate: ``aggregate(state, cell, updates, losses, train_counts,
      sampled=None)`` -> ``(state, (loss, alpha, mask_coverage, nonfinite))``:
      the server part of a round for one run (aggregation, the method's
      server step and per-client state), not jitted. Clients not
      ``sampled``, with a non-finite update or no training node are left out.
    method: the base method.
    evaluate: ``evaluate(params, val_mask, test_mask, data)`` -> (test f32[D],
      val f32[D], predicted classes i32[D]) for one run, not jitted.
    init: ``init(seeds i32[S], cells: Cells) -> SimState`` with leaves [S, G', ...].
    run_chunk: jitted ``run_chunk(state, first_round, cells, data, num_rounds)``
      -> ``(state, RoundMetrics with leaves [S, G', num_rounds, ...])``;
      ``num_rounds`` is static.
    trace_count: a one-element list counting how often ``run_chunk`` was traced
      (a test guard against recompiling per chunk).
  """
  model: NodeClassifier
  local_update: Callable
  aggregate: Callable
  method: methods_lib.Method
  evaluate: Callable
  init: Callable
  run_chunk: Callable
  trace_count: list


def client_updates(local_update, federation: Federation, propagates_in_training: bool,
                   params: PyTree, shards: tuple[Shard, ...], keys: Array,
                   client_state: PyTree = (), server_state: PyTree = ()):
  """All clients' updates, one vmap per size bucket, rows in client order.

  Args:
    local_update: from ``client.make_local_update``.
    federation: gives the static bucket layout.
    propagates_in_training: whether the backbone needs the client graph.
    params: the global model W.
    shards: per bucket a ``Shard`` with leaves [C_b, ...] (one seed).
    keys: [C] one PRNG key per client.
    client_state: the method's per-client state, leaves [C, ...].
    server_state: the method's server state (shared by all clients).

  Returns:
    (client updates with leaves [C, ...], losses f32[C, local_steps]).
  """
  outputs = []
  for clients, rows, shard in zip(federation.bucket_clients, federation.bucket_train_rows,
                                  shards):
    if propagates_in_training:
      x, y, train, graph = shard.x, shard.y, shard.train, shard
    else:  # Rows are ordered train first: the rest never reach the loss.
      x, y, train, graph = shard.x[:, :rows], shard.y[:, :rows], shard.train[:, :rows], None
    rows_of = lambda tree: jax.tree.map(lambda leaf: leaf[np.asarray(clients)], tree)
    outputs.append(jax.vmap(local_update, in_axes=(None, 0, 0, 0, 0, 0, 0, None))(
        params, x, y, train, graph, rows_of(keys), rows_of(client_state), server_state))
  order = np.argsort(np.concatenate(federation.bucket_clients))
  return jax.tree.map(lambda *parts: jnp.concatenate(parts)[order], *outputs)


def client_updates_loop(local_update, federation: Federation, propagates_in_training: bool,
                        params: PyTree, shards: tuple[Shard, ...], keys: Array,
                        client_state: PyTree = (), server_state: PyTree = ()):
  """``client_updates`` with a Python loop over clients: the reference for tests and bench.

  ``local_update`` should be jitted by the caller (one compile per bucket shape).
  """
  per_client = [None] * federation.num_clients
  for clients, rows, shard in zip(federation.bucket_clients, federation.bucket_train_rows,
                                  shards):
    for j, k in enumerate(clients):
      one = jax.tree.map(lambda leaf: leaf[j], shard)
      state_k = jax.tree.map(lambda leaf: leaf[k], client_state)
      if propagates_in_training:
        per_client[k] = local_update(params, one.x, one.y, one.train, one, keys[k], state_k,
                                     server_state)
      else:
        per_client[k] = local_update(params, one.x[:rows], one.y[:rows], one.train[:rows], None,
                                     keys[k], state_k, server_state)
  return jax.tree.map(lambda *rows_: jnp.stack(rows_), *per_client)


def finite_clients(client_updates: PyTree) -> Array:
  """bool[C]: True where every coordinate of client k's update is finite."""
  leaves = jax.tree.leaves(client_updates)
  per_leaf = [jnp.all(jnp.isfinite(leaf.reshape(leaf.shape[0], -1)), axis=1) for leaf in leaves]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def client_keys(run_key: Array, round_index, num_clients: int) -> Array:
  """[C] dropout keys of round t: fold_in(run key, t), split per client, never reused."""
  return jax.random.split(jax.random.fold_in(run_key, round_index), num_clients)


def domain_accuracy(pred: Array, labels: Array, mask: Array, node_domain: Array,
                    num_domains: int) -> Array:
  """Accuracy f32[D] over the ``mask``-ed nodes of each domain (0 for an empty domain)."""
  correct = jax.ops.segment_sum(((pred == labels) & mask).astype(jnp.float32), node_domain,
                                num_domains)
  count = jax.ops.segment_sum(mask.astype(jnp.float32), node_domain, num_domains)
  return correct / jnp.maximum(count, 1)


_SIMULATIONS: dict = {}


def make_simulation(config: Config, federation: Federation,
                    diagnostics: Optional[DiagnosticsSpec] = None, method: str = "fedavg",
                    method_hparams: Optional[dict] = None) -> Simulation:
  """Builds the batched round, chunk and init functions for a federation.

  The result depends only on the recipe and the federation's static layout, so
  it is memoised on them: a second sweep of the same layout in one process
  (another grid, a resume, a test) reuses the compiled program.

  Args:
    config: model and local training recipe.
    federation: the padded federation (only its static layout is closed over;
      its arrays are passed at call time via ``sim_data``).
    diagnostics: compute update diagnostics at these rounds; None (the
      default) compiles none of it, so a plain sweep pays nothing.
    method, method_hparams: the base method and its hyper-parameters (see
      ``methods.make_method``).

  Raises:
    ValueError: for an unknown method or a bad hyper-parameter.
  """
  hparams = dict(method_hparams or {})
  layout = (json.dumps(config.to_dict(), sort_keys=True), federation.domains,
            federation.num_classes, federation.bucket_clients, federation.bucket_train_rows,
            federation.eval_x.shape[-1], diagnostics, method,
            json.dumps(hparams, sort_keys=True))
  if layout not in _SIMULATIONS:
    _SIMULATIONS[layout] = _make_simulation(config, federation, diagnostics, method, hparams)
  return _SIMULATIONS[layout]


def _make_simulation(config, federation, diagnostics, method_name, method_hparams):
  model = make_model(config.backbone, federation.num_classes, config.hidden,
                     config.num_layers, config.dropout)
  method = methods_lib.make_method(method_name, model, config, method_hparams)
  local_update = make_local_update(model, config, method)
  fedia = aggregators.fedia()
  num_clients, num_domains = federation.num_clients, len(federation.domains)
  feature_dim = federation.eval_x.shape[-1]
  trace_count = [0]

  def init_run(seed, stream):
    seed_key = jax.random.PRNGKey(seed)
    init_key, run_key = jax.random.split(jax.random.fold_in(seed_key, stream))
    # Parameters do not depend on the graph: initialise without propagation.
    plain = model.clone(propagate_train=False, propagate_eval=False)
    params = plain.init(init_key, jnp.zeros((1, feature_dim)), None, train=False)
    return SimState(params, fedia.init(num_clients), method.init(params, num_clients), run_key,
                    jax.random.fold_in(seed_key, SAMPLING_STREAM))

  def init(seeds, cells):
    return jax.vmap(jax.vmap(init_run, in_axes=(None, 0)), in_axes=(0, None))(
        jnp.asarray(seeds), cells.stream)

  def aggregate(state, cell, updates, losses, train_counts, sampled=None):
    # A non-finite update never reaches the global model: its client is treated
    # as absent this round (weights renormalised over the others, FedIA's alpha
    # and its per-client state kept); the sweep then stops or counts it, as
    # its policy says.
    finite = finite_clients(updates)
    participating = finite & (train_counts > 0)
    if sampled is not None:
      participating = participating & sampled
    # rho = 1 (base cells) keeps every coordinate: one code path for all cells.
    mask = aggregators.importance_mask(updates, cell.rho, participating)
    alpha = aggregators.contribution_weights(updates, mask, state.aggregator.alpha, cell.beta,
                                             participating)
    own = jnp.ones_like(train_counts) if method.uniform_weights else train_counts
    weights = jnp.where(cell.momentum, alpha, own)
    weights = jnp.where(participating, weights, 0.0)
    weights = weights / jnp.maximum(jnp.sum(weights), 1e-30)
    masked = jax.tree.map(lambda u, m: u * m, updates, mask)
    update = aggregators.fedavg(masked, weights, participating)
    num_participants = jnp.sum(participating).astype(jnp.float32)
    params, server = method.server_step(state.params, state.method.server, update,
                                        num_participants, num_clients)
    # A round nobody took part in changes nothing (FedDyn's h/alpha term and a
    # server optimiser's momentum would otherwise still move W).
    nobody = num_participants == 0
    params, server = jax.tree.map(lambda old, new: jnp.where(nobody, old, new),
                                  (state.params, state.method.server), (params, server))
    after = jax.vmap(method.client_after, in_axes=(0, 0, None, None))(
        state.method.clients, updates, state.params, state.method.server)
    keep_new = lambda new, old: jnp.where(
        participating.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    clients = jax.tree.map(keep_new, after, state.method.clients)
    aggregator = aggregators.FedIAState(jnp.where(cell.momentum, alpha, state.aggregator.alpha))
    kept = sum(jnp.count_nonzero(m) for m in jax.tree.leaves(mask))
    total = sum(m.size for m in jax.tree.leaves(mask))
    # XLA may divide by a constant as a multiply by its reciprocal: 1 - 6e-8
    # for a full mask. Full coverage is reported as exactly 1.
    coverage = jnp.where(kept == total, 1.0, kept / total)
    # Only updates that would have been aggregated count as non-finite.
    counted = train_counts > 0 if sampled is None else sampled & (train_counts > 0)
    metrics = (jnp.sum(jnp.where(participating, losses[:, -1], 0.0))
               / jnp.maximum(num_participants, 1), weights, coverage, ~finite & counted)
    return state._replace(params=params, aggregator=aggregator,
                          method=methods_lib.MethodState(clients, server)), metrics

  def train_and_aggregate(state, cell, shards, train_counts, t):
    updates, losses = client_updates(local_update, federation, model.propagate_train,
                                     state.params, shards, client_keys(state.key, t, num_clients),
                                     state.method.clients, state.method.server)
    sampled = sample_clients(state.sample_key, t, num_clients, config.participation)
    state, metrics = aggregate(state, cell, updates, losses, train_counts, sampled)
    if diagnostics is None:
      return state, metrics + (None,)
    return state, metrics + (round_diagnostics(updates, train_counts, metrics[-1], t),)

  def round_diagnostics(updates, train_counts, nonfinite, t):
    from fedjax_graph import diagnostics as diag_lib  # Only imported when asked for.

    weights = jnp.where(nonfinite, 0.0, train_counts)
    compute = lambda u: diag_lib.round_diagnostics(u, weights, diagnostics.top)
    skip = lambda u: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                  jax.eval_shape(compute, u))
    # t is the same for every run of the batch, so under vmap this stays a
    # branch and rounds without a checkpoint compute nothing.
    return jax.lax.cond(jnp.isin(t + 1, jnp.asarray(diagnostics.rounds)), compute, skip, updates)

  def evaluate(params, val_mask, test_mask, data):
    pred = predict(model, params, data.eval_x, data.eval_graph)
    acc = lambda mask: domain_accuracy(pred, data.eval_y, mask, data.eval_domain, num_domains)
    hits = jax.ops.segment_sum(
        jax.nn.one_hot(pred, federation.num_classes, dtype=jnp.int32) * test_mask[:, None],
        data.eval_domain, num_domains)  # [D, K] test nodes per predicted class
    return acc(test_mask), acc(val_mask), jnp.sum(hits > 0, axis=-1)

  def run_round(state, t, cells, data):
    per_cell = jax.vmap(train_and_aggregate, in_axes=(0, 0, None, None, None))
    state, (loss, alpha, coverage, nonfinite, diags) = jax.vmap(
        per_cell, in_axes=(0, None, 0, None, None))(
            state, cells, data.client_shards, data.train_counts, t)
    per_cell_eval = jax.vmap(evaluate, in_axes=(0, None, None, None))
    test_acc, val_acc, classes = jax.vmap(per_cell_eval, in_axes=(0, 0, 0, None))(
        state.params, data.eval_val, data.eval_test, data)
    return state, RoundMetrics(test_acc, val_acc, loss, alpha, coverage, nonfinite, classes,
                               diags)

  def run_chunk(state, first_round, cells, data, num_rounds):
    trace_count[0] += 1
    step = lambda s, t: run_round(s, t, cells, data)
    state, metrics = jax.lax.scan(step, state, first_round + jnp.arange(num_rounds))
    # scan stacks rounds first: [L, S, G', ...] -> [S, G', L, ...].
    return state, jax.tree.map(lambda m: jnp.moveaxis(m, 0, 2), metrics)

  return Simulation(model=model, local_update=local_update, aggregate=aggregate,
                    method=method, evaluate=evaluate, init=jax.jit(init),
                    run_chunk=jax.jit(run_chunk, static_argnames="num_rounds"),
                    trace_count=trace_count)
