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
from fedjax_graph.models import NodeClassifier, predict
from fedjax_graph.types import Array, PyTree, Shard


class Cells(NamedTuple):
  """The aggregation settings of a batch of G' cells (traced, so one compile serves all).

  A cell aggregates the participants' updates masked by Importance Masking at
  ratio ``rho`` (rho = 1: no mask), weighted by CAM's alpha (``momentum``) or
  by the base method's own weights. The base method: fedia False, momentum
  False, rho 1; FedIA: both True; IM only (an ablation): fedia True,
  momentum False. Cells are paired: within a seed they share every random
  number (initial model, dropout, client sample) and differ only in these
  settings.

  Attributes:
    rho: f32[G'] mask ratio in (0, 1] (1 where ``fedia`` is False).
    beta: f32[G'] CAM momentum in [0, 1] (ignored where ``momentum`` is False).
    fedia: bool[G'] True: the cell uses FedIA's mask.
    momentum: bool[G'] True: CAM weights; False: the method's own weights.
  """
  rho: Array
  beta: Array
  fedia: Array
  momentum: Array


# The client sample's key: fold_in(seed key, SAMPLING_STREAM), apart from the
# keys split off the seed key for the initial model and dropout.
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
    key: the seed's dropout key (the same in every cell: runs are paired);
      round t uses fold_in(key, t).
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
    test_bacc: f32[D] balanced test accuracy per domain (mean recall over the
      classes present among the domain's test nodes).
    test_f1: f32[D] macro-F1 on each domain's test nodes (mean over the
      classes that are true or predicted there, as scikit-learn's).
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
  test_bacc: Array
  test_f1: Array
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
  eval_owner: Array


def sim_data(federation: Federation) -> SimData:
  """Moves a federation's arrays to the device."""
  f = federation
  return jax.device_put(SimData(f.client_shards, f.train_counts, f.eval_x, f.eval_y,
                                f.eval_domain, f.eval_graph, f.eval_val, f.eval_test,
                                f.eval_owner))


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
    evaluate: ``evaluate(params, val_mask, test_mask, owner, data)`` -> (test
      ``Scores``, validation accuracy f32[D]) for one run, not jitted; for a
      ``personal`` method ``params`` are the clients' models, leaves [C, ...],
      and node n is predicted by client ``owner[n]``'s.
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
                   client_state: PyTree = (), server_state: PyTree = (),
                   per_client_params: bool = False, rows_only: bool = True):
  """All clients' updates, one vmap per size bucket, rows in client order.

  Args:
    local_update: from ``client.make_local_update``.
    federation: gives the static bucket layout.
    propagates_in_training: whether the backbone needs the client graph.
    params: the model the clients start from: the global model W, or with
      ``per_client_params`` each client's own (leaves [C, ...]).
    shards: per bucket a ``Shard`` with leaves [C_b, ...] (one seed).
    keys: [C] one PRNG key per client.
    client_state: the method's per-client state, leaves [C, ...].
    server_state: the method's server state (shared by all clients).
    per_client_params: see ``params``.
    rows_only: see ``training_input``.

  Returns:
    (client updates with leaves [C, ...], losses f32[C, local_steps]).
  """
  outputs = []
  for clients, rows, shard in zip(federation.bucket_clients, federation.bucket_train_rows,
                                  shards):
    rows_of = lambda tree: jax.tree.map(lambda leaf: leaf[np.asarray(clients)], tree)
    start = rows_of(params) if per_client_params else params
    outputs.append(jax.vmap(local_update, in_axes=(0 if per_client_params else None,
                                                   0, 0, 0, 0, 0, 0, 0, None))(
        start, *training_input(shard, rows, propagates_in_training, rows_only), rows_of(keys),
        rows_of(client_state), server_state))
  order = np.argsort(np.concatenate(federation.bucket_clients))
  return jax.tree.map(lambda *parts: jnp.concatenate(parts)[order], *outputs)


def training_input(shard: Shard, train_rows: int, propagates_in_training: bool,
                   rows_only: bool = True):
  """What a client's local steps see of its padded shard (one client, or a bucket's stacked).

  A backbone that propagates in training gets the whole padded graph, and its
  batch norm the statistics of the client's real nodes. One that does not
  (PMLP-GCN, MLP) gets node rows only, no graph: with ``rows_only`` the first
  ``train_rows`` rows (rows are ordered train first, so the rest never reach
  the loss), whose training nodes are also the batch norm's statistics;
  without it every row, statistics over all of the client's nodes, as PMLP's
  reference code computes them (``Config.norm_rows``).

  Returns:
    (x f32[..., N', F], y i32[..., N'], train_mask bool[..., N'],
    node_mask bool[..., N'] (the batch norm's rows), graph: the shard or None).
  """
  if propagates_in_training or not rows_only:
    real = shard.train | shard.val | shard.test
    return shard.x, shard.y, shard.train, real, shard if propagates_in_training else None
  cut = lambda a: a[..., :train_rows]
  return shard.x[..., :train_rows, :], cut(shard.y), cut(shard.train), cut(shard.train), None


def client_updates_loop(local_update, federation: Federation, propagates_in_training: bool,
                        params: PyTree, shards: tuple[Shard, ...], keys: Array,
                        client_state: PyTree = (), server_state: PyTree = (),
                        rows_only: bool = True):
  """``client_updates`` with a Python loop over clients: the reference for tests and bench.

  ``local_update`` should be jitted by the caller (one compile per bucket shape).
  """
  per_client = [None] * federation.num_clients
  for clients, rows, shard in zip(federation.bucket_clients, federation.bucket_train_rows,
                                  shards):
    for j, k in enumerate(clients):
      one = jax.tree.map(lambda leaf: leaf[j], shard)
      state_k = jax.tree.map(lambda leaf: leaf[k], client_state)
      per_client[k] = local_update(
          params, *training_input(one, rows, propagates_in_training, rows_only), keys[k],
          state_k, server_state)
  return jax.tree.map(lambda *rows_: jnp.stack(rows_), *per_client)


def finite_clients(client_updates: PyTree) -> Array:
  """bool[C]: True where every coordinate of client k's update is finite."""
  leaves = jax.tree.leaves(client_updates)
  per_leaf = [jnp.all(jnp.isfinite(leaf.reshape(leaf.shape[0], -1)), axis=1) for leaf in leaves]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def client_keys(run_key: Array, round_index, num_clients: int) -> Array:
  """[C] dropout keys of round t: fold_in(run key, t), split per client, never reused."""
  return jax.random.split(jax.random.fold_in(run_key, round_index), num_clients)


class Scores(NamedTuple):
  """Per-domain scores of one prediction (see ``domain_scores``), each f32[D] in [0, 1] or i32[D]."""
  acc: Array
  bacc: Array
  f1: Array
  classes: Array


def domain_scores(pred: Array, labels: Array, mask: Array, node_domain: Array,
                  num_domains: int, num_classes: int) -> Scores:
  """Accuracy, balanced accuracy and macro-F1 over the ``mask``-ed nodes of each domain.

  Args:
    pred, labels: i32[N] predicted and true classes in [0, K).
    mask: bool[N] the nodes scored (e.g. test nodes).
    node_domain: i32[N] domain of each node; D on padding rows (dropped).
    num_domains, num_classes: D and K (static).

  Returns:
    ``Scores``: accuracy; balanced accuracy, the mean recall over the classes
    present among the domain's scored nodes; macro-F1, the mean of
    2 TP / (predicted + true) over the classes that are true or predicted
    there (scikit-learn's convention); ``classes`` i32[D], how many distinct
    classes are predicted (1: a constant prediction). All 0 for a domain
    without scored nodes.
  """
  onehot = lambda c: jax.nn.one_hot(c, num_classes, dtype=jnp.float32) * mask[:, None]
  per_domain = lambda v: jax.ops.segment_sum(v, node_domain, num_domains)  # [D, K]
  predicted, true = per_domain(onehot(pred)), per_domain(onehot(labels))
  hits = per_domain(onehot(pred) * onehot(labels))
  mean_over = lambda values, classes: (jnp.sum(jnp.where(classes, values, 0.0), axis=-1)
                                       / jnp.maximum(jnp.sum(classes, axis=-1), 1))
  acc = jnp.sum(hits, axis=-1) / jnp.maximum(jnp.sum(true, axis=-1), 1)
  bacc = mean_over(hits / jnp.maximum(true, 1), true > 0)
  f1 = mean_over(2 * hits / jnp.maximum(predicted + true, 1), predicted + true > 0)
  return Scores(acc, bacc, f1, jnp.sum(predicted > 0, axis=-1).astype(jnp.int32))


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
  model = config.model(federation.num_classes)
  method = methods_lib.make_method(method_name, model, config, method_hparams)
  local_update = make_local_update(model, config, method)
  fedia = aggregators.fedia()
  num_clients, num_domains = federation.num_clients, len(federation.domains)
  feature_dim = federation.eval_x.shape[-1]
  trace_count = [0]

  def init_run(seed):
    # Keys from the seed alone: every cell (and every method) of a seed starts
    # from the same model and draws the same dropout masks (paired runs).
    seed_key = jax.random.PRNGKey(seed)
    init_key, run_key = jax.random.split(seed_key)
    # Parameters do not depend on the graph: initialise without propagation.
    plain = model.clone(propagate_train=False, propagate_eval=False)
    params = plain.init(init_key, jnp.zeros((1, feature_dim)), None, train=False)
    return SimState(params, fedia.init(num_clients), method.init(params, num_clients), run_key,
                    jax.random.fold_in(seed_key, SAMPLING_STREAM))

  def init(seeds, cells):
    per_seed = jax.vmap(init_run)(jnp.asarray(seeds))
    num_cells = cells.rho.shape[0]
    return jax.tree.map(lambda leaf: jnp.repeat(leaf[:, None], num_cells, axis=1), per_seed)

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
    start = state.method.clients if method.personal else state.params
    updates, losses = client_updates(local_update, federation, model.propagate_train,
                                     start, shards, client_keys(state.key, t, num_clients),
                                     state.method.clients, state.method.server,
                                     per_client_params=method.personal,
                                     rows_only=config.norm_rows == "train")
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

  def evaluate(params, val_mask, test_mask, owner, data):
    # Batch-norm statistics per domain: each domain's full graph is its own batch.
    predict_all = lambda p: predict(model, p, data.eval_x, data.eval_graph, data.eval_domain,
                                    num_domains)
    if method.personal:  # each node by the model of the client that holds it
      per_client = jax.lax.map(predict_all, params)  # [C, N]; one model at a time, less memory
      pred = jnp.take_along_axis(per_client, owner[None], axis=0)[0]
    else:
      pred = predict_all(params)
    scores = lambda mask: domain_scores(pred, data.eval_y, mask, data.eval_domain, num_domains,
                                        federation.num_classes)
    return scores(test_mask), scores(val_mask).acc

  def run_round(state, t, cells, data):
    per_cell = jax.vmap(train_and_aggregate, in_axes=(0, 0, None, None, None))
    state, (loss, alpha, coverage, nonfinite, diags) = jax.vmap(
        per_cell, in_axes=(0, None, 0, None, None))(
            state, cells, data.client_shards, data.train_counts, t)
    per_cell_eval = jax.vmap(evaluate, in_axes=(0, None, None, None, None))
    evaluated = state.method.clients if method.personal else state.params
    test, val_acc = jax.vmap(per_cell_eval, in_axes=(0, 0, 0, 0, None))(
        evaluated, data.eval_val, data.eval_test, data.eval_owner, data)
    return state, RoundMetrics(test.acc, val_acc, test.bacc, test.f1, loss, alpha, coverage,
                               nonfinite, test.classes, diags)

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
