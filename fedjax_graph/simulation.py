"""One federated round, chunks of rounds, and evaluation, batched over runs.

A *run* is one (seed, cell) pair (``cells``). The whole batch of runs advances
together: the cells of each aggregator group are ``vmap``-ped with the seeds,
and inside a run the clients of each size bucket (``for_each_client``);
evaluation is ``vmap``-ped too and its propagations over the shared
evaluation graph fuse into one sparse product for all runs of a group
(``graphs.propagate`` on a ``CSRGraph``). A chunk of rounds is one
``lax.scan``; Python only loops over chunks.

One round (FedIA paper, Algorithm 1; a method from ``methods``, an aggregator
from ``aggregators``):
  1. a seeded sample of clients takes part (all with participation 1); each
     participant k starts from the global model W (or its own, for a personal
     method) and runs its local steps with the method's loss term, returning
     u_k = -(W_k - W)/eta, its new state and its upload (with participation
     < 1 only the participants train, in fixed slots: ``take_slots``);
  2. the cell's aggregator combines the participants' updates (the method's
     own mean, FedIA, GMA, FedHEAL, ...) with the method's base weights;
  3. the method's server step moves W (FedAvg: W <- W - eta * u, eq. 8) and
     its state with the aggregate and the uploads; participants keep their
     new per-client state;
  4. the new global model is evaluated on every domain's full graph (every
     round, or as an ``EvalSchedule`` says).
"""

import dataclasses
import json
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_graph import aggregators
from fedjax_graph import graphs
from fedjax_graph import methods as methods_lib
from fedjax_graph import models
from fedjax_graph import sfpd
from fedjax_graph.cells import CellBatch
from fedjax_graph.client import ClientOutput, make_local_update
from fedjax_graph.config import Config
from fedjax_graph.data import Federation
from fedjax_graph.graphs import CSRGraph
from fedjax_graph.models import NodeClassifier, predict
from fedjax_graph.types import Array, PyTree, Shard


# The client sample's key: fold_in(seed key, SAMPLING_STREAM), apart from the
# keys split off the seed key for the initial model and dropout.
SAMPLING_STREAM = 2**31 + 1


def participant_count(fraction: float, num_clients: int) -> int:
  """m = max(1, round(fraction * C)): how many clients take part in each round (static)."""
  return max(1, round(fraction * num_clients))


def sample_clients(key: Array, round_index, num_clients: int, fraction: float) -> Array:
  """bool[C]: the clients taking part in round t, a seeded uniform sample.

  ``participant_count(fraction, C)`` clients without replacement, drawn from
  ``fold_in(key, t)``; all clients when that is C (static ``fraction``).
  """
  count = participant_count(fraction, num_clients)
  if count >= num_clients:
    return jnp.ones((num_clients,), bool)
  order = jnp.argsort(jax.random.uniform(jax.random.fold_in(key, round_index), (num_clients,)))
  return jnp.zeros((num_clients,), bool).at[order[:count]].set(True)


class SimState(NamedTuple):
  """State of one run between rounds (leaves gain [S, G_g] axes in a sweep, per group).

  Attributes:
    params: the global model W.
    aggregator: the cell's aggregator state (e.g. FedIA's alpha f32[C]).
    method: the method's ``MethodState`` (per-client leaves [C, ...]).
    key: the seed's dropout key (the same in every cell: runs are paired);
      round t uses fold_in(key, t).
    sample_key: the seed's client-sampling key (the same in every cell).
  """
  params: PyTree
  aggregator: PyTree
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
    alpha: f32[C] the client weights the aggregator applied this round
      (``diagnostics.weights``: FedIA's alpha, FedAvg's base weights, ...);
      0 for clients left out.
    mask_coverage: f32[] share of coordinates aggregated (1 for FedAvg).
    nonfinite: bool[C] clients left out of the aggregation because their
      update held a NaN or Inf, or a statistic of it was not finite (the
      aggregator's ``excluded``); see ``make_simulation``.
    predicted_classes: i32[D] how many distinct classes the global model
      predicts on each domain's test nodes (1: a constant prediction).
      In a round that an ``EvalSchedule`` leaves unevaluated, this is -1 and
      test_acc, val_acc, test_bacc, test_f1 and argmax_acc are NaN.
    diagnostics: ``diagnostics.RoundDiagnostics`` of the round's client updates
      at the rounds a ``DiagnosticsSpec`` names (zeros at other rounds), or
      None when diagnostics are off.
    argmax_acc: f32[D] test accuracy of the classifier's argmax when the
      method predicts otherwise (``Method.predict``: then ``test_acc`` and
      the other scores are the method's), else None.
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
  argmax_acc: Optional[Array] = None


class DiagnosticsSpec(NamedTuple):
  """Opt-in update diagnostics (FedIA paper, Sec. 3.2), computed inside the jitted rounds.

  Attributes:
    rounds: the 1-based rounds at which to compute them (static).
    top: the salient share p of coordinates per client (static), e.g. 0.05.
  """
  rounds: tuple[int, ...]
  top: float = 0.05


class EvalSchedule(NamedTuple):
  """The rounds at which the global model is evaluated (static: part of the compiled program).

  Round t (1-based) is evaluated when t is a multiple of ``every`` or
  t > ``final_from`` (the final rounds, which the summaries read). With
  ``every`` = 1 (the default) every round is, with no branch in the program
  at all. The metrics of other rounds hold NaN scores and -1 predicted
  classes; training is the same either way.

  Attributes:
    every: k >= 1.
    final_from: T - last: every round after it is evaluated.
  """
  every: int = 1
  final_from: int = 0

  def evaluated(self, round_index):
    """bool (array like ``round_index``, 0-based: t - 1): whether that round is evaluated."""
    return ((round_index + 1) % self.every == 0) | (round_index >= self.final_from)


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


def host_data(federation: Federation) -> SimData:
  """A federation's arrays as a ``SimData`` of host (numpy) arrays, to place as one likes."""
  f = federation
  return SimData(f.client_shards, f.train_counts, f.eval_x, f.eval_y, f.eval_domain,
                 f.eval_graph, f.eval_val, f.eval_test, f.eval_owner)


def sim_data(federation: Federation) -> SimData:
  """Moves a federation's arrays to the (default) device."""
  return jax.device_put(host_data(federation))


class Simulation(NamedTuple):
  """The pieces of a sweep; ``init`` and ``run_chunk`` are the compiled program.

  The state of a batch is a tuple with one ``SimState`` per aggregator group
  of the ``CellBatch`` (leaves [S, G_g, ...]); metrics come with the groups'
  cells concatenated, [S, G', ...] in group order (``Cells.order``).

  Attributes:
    model: the backbone.
    config: the training recipe the program was built from: the caller's
      ``Config`` with a method's ``recipe`` applied (FedSPA's SFPD).
    local_update: one client's local training (``client.make_local_update``).
    training_input: ``training_input(shard, train_rows)`` -> what a client's
      steps see of its shard (``make_training_input``).
    aggregate: ``aggregate(state, aggregator, hparams, outputs, train_counts,
      sampled=None)`` -> ``(state, (loss, weights, mask_coverage, nonfinite))``:
      the server part of a round for one run (aggregation, the method's
      server step and per-client state), not jitted. Clients not ``sampled``,
      with a non-finite update or no training node are left out.
    method: the method.
    evaluate: ``evaluate(params, val_mask, test_mask, owner, data,
      server_state=())`` -> (test ``Scores``, validation accuracy f32[D]) for
      one run, not jitted; for a ``personal`` method ``params`` are the
      clients' models, leaves [C, ...], and node n is predicted by client
      ``owner[n]``'s; a method's ``predict`` reads the method's
      ``server_state``.
    init: ``init(seeds i32[S], batch: CellBatch) -> tuple of SimState``.
    run_chunk: jitted ``run_chunk(state, first_round, batch, data, num_rounds,
      schedule=EvalSchedule())`` -> ``(state, RoundMetrics with leaves [S, G',
      num_rounds, ...])``; ``num_rounds`` and ``schedule`` (which rounds are
      evaluated) are static, and so is the batch's layout (its groups).
    trace_count: a one-element list counting how often ``run_chunk`` (or
      ``run_runs``) was traced (a test guard against recompiling per chunk).
    run_runs: ``run_runs(states, first_round, batch, seed_index, data,
      num_rounds, schedule=EvalSchedule())`` -> ``(states, metrics)``, not
      jitted: the same rounds for a flat list of runs (the layout ``devices``
      shards over devices and splits into sub-batches). Per group g,
      ``states[g]`` has leaves [R_g, ...], ``batch.values[g][name]`` f32[R_g]
      and ``seed_index[g]`` i32[R_g] give each run's hyper-parameters and its
      seed's row of the per-seed data, and ``metrics[g]`` is a
      ``RoundMetrics`` with leaves [R_g, num_rounds, ...]. A run computes what
      it computes in ``run_chunk`` (up to float rounding: the per-seed data
      are gathered per run rather than shared by a seed's cells).
  """
  model: NodeClassifier
  config: Config
  local_update: Callable
  training_input: Callable
  aggregate: Callable
  method: methods_lib.Method
  evaluate: Callable
  init: Callable
  run_chunk: Callable
  trace_count: list
  run_runs: Optional[Callable] = None


def make_training_input(config: Config, num_domains: int, needs_graph: bool = False) -> Callable:
  """What a client's local steps see of its padded shard, by the backbone's ``training_input``.

  Returns ``training_input(shard, train_rows) -> (x f32[..., N', F], y
  i32[..., N'], train_mask bool[..., N'], groups i32[..., N'], graph)`` for
  one client's shard or a bucket's stacked ones; ``groups`` are the batch
  norm's: each row's domain, D on the rows it leaves out (so a pooled client
  holding several domains takes per-domain statistics, as evaluation does):

    * ``graph`` (a backbone that propagates in training, GCN): the whole
      padded graph; the batch norm takes the statistics of the client's real
      nodes.
    * ``rows`` (PMLP-GCN, MLP): node rows only, no graph. With
      ``config.norm_rows == "train"`` only the first ``train_rows`` rows
      (rows are ordered train first, so the rest never reach the loss),
      whose training nodes are also the batch norm's statistics; with
      ``"all"`` every row, statistics over all of the client's nodes, as
      PMLP's reference code.

  With ``needs_graph`` (``Method.needs_graph``: a method whose client part
  uses the client's edges, e.g. FGSSL) ``graph`` is the whole padded shard
  for every backbone; the other outputs are unchanged (for ``rows`` with
  ``norm_rows: train`` still the first ``train_rows`` rows of the shard, so
  the cross-entropy and its dropout masks are those of the plain method). A
  ``rows`` backbone still ignores the graph in its own forward pass.
  """
  kind = models.BACKBONES[config.backbone].training_input
  if kind not in ("graph", "rows"):
    raise ValueError(f"training input {kind!r} of {config.backbone} is not supported")
  rows_only = kind == "rows" and config.norm_rows == "train"
  with_graph = kind == "graph" or needs_graph

  def training_input(shard: Shard, train_rows: int):
    graph = shard if with_graph else None
    if not rows_only:  # node_domain is D on padding rows
      return shard.x, shard.y, shard.train, shard.node_domain, graph
    cut = lambda a: a[..., :train_rows]
    groups = jnp.where(cut(shard.train), cut(shard.node_domain), num_domains)
    return shard.x[..., :train_rows, :], cut(shard.y), cut(shard.train), groups, graph

  return training_input


class SlotGroup(NamedTuple):
  """Slots of a round that share one padded shape (static; see ``take_slots``).

  Attributes:
    bucket: b, the largest size bucket a client in these slots can come from.
    first, size: the slots' range [first, first + size) among the round's m.
    n_node, n_edge, train_rows: their padded shape, the largest of buckets
      0..b (node rows, edge slots, training rows).
  """
  bucket: int
  first: int
  size: int
  n_node: int
  n_edge: int
  train_rows: int


class ClientSlots(NamedTuple):
  """The m participants of a round in fixed slots, grouped by ``SlotGroup``.

  Attributes:
    clients: per group i32[size], the client in each slot (each participant
      once, no empty slot).
    train_rows: per group the training rows its steps see (static ints).
    shards: per group a ``Shard`` with leaves [size, ...]: each slot's
      client's shard, padded to the group's shape.
  """
  clients: tuple
  train_rows: tuple
  shards: tuple


def _bucket_of(federation: Federation) -> np.ndarray:
  """i32[C] each client's size bucket."""
  bucket_of = np.zeros(federation.num_clients, np.int32)
  for b, clients in enumerate(federation.bucket_clients):
    bucket_of[list(clients)] = b
  return bucket_of


def slot_groups(federation: Federation, count: int) -> tuple[SlotGroup, ...]:
  """The static slot layout of rounds with ``count`` = m participants.

  Slot j takes the shape of the bucket of the federation's j-th largest
  client (clients ranked by bucket, largest first, then by index), so the m
  slots are the least padded work that holds *any* m participants: the
  j-th largest participant is never larger than the j-th largest client.
  Slots of one bucket form a group (one batched computation).
  """
  bucket_of = _bucket_of(federation)
  ranked = sorted(range(federation.num_clients), key=lambda k: (-bucket_of[k], k))[:count]
  n_node = [shard.x.shape[-2] for shard in federation.client_shards]
  n_edge = [shard.senders.shape[-1] for shard in federation.client_shards]
  groups, first = [], 0
  for b in sorted(set(bucket_of[ranked].tolist()), reverse=True):
    size = int(np.sum(bucket_of[ranked] == b))
    groups.append(SlotGroup(b, first, size, max(n_node[:b + 1]), max(n_edge[:b + 1]),
                            max(federation.bucket_train_rows[:b + 1])))
    first += size
  return tuple(groups)


def _pad_shard(shard: Shard, n_node: int, n_edge: int, num_domains: int) -> Shard:
  """Stacked shards (leaves [k, N, ...], [k, E]) padded to ``n_node`` rows and ``n_edge`` edges.

  New rows are padding as ``graphs.pad_graph`` makes it (zero features and
  GCN weights, label 0, in no split, domain D); new edges join the last row,
  a padding row, with weight 0. No real row's output changes. An ``operator``
  is padded alike (``graphs.pad_operator``).
  """
  def grow(leaf, size, value):
    return jnp.pad(leaf, [(0, 0), (0, size - leaf.shape[1])] + [(0, 0)] * (leaf.ndim - 2),
                   constant_values=value)

  rows = lambda leaf, value=0: grow(leaf, n_node, value)
  edges = lambda leaf, value=0: grow(leaf, n_edge, value)
  return Shard(x=rows(shard.x), y=rows(shard.y), senders=edges(shard.senders, n_node - 1),
               receivers=edges(shard.receivers, n_node - 1), edge_weight=edges(shard.edge_weight),
               self_weight=rows(shard.self_weight), train=rows(shard.train, False),
               val=rows(shard.val, False), test=rows(shard.test, False),
               node_domain=rows(shard.node_domain, num_domains),
               operator=graphs.pad_operator(shard.operator, n_node, n_edge))


def take_slots(federation: Federation, shards: tuple[Shard, ...], sampled: Array,
               count: int) -> ClientSlots:
  """The sampled clients of a round gathered into the fixed slots of ``slot_groups``.

  The participants, largest bucket first (then by index), fill the m slots
  in order; each slot's shard is its client's, padded to the slot's shape.
  Shapes do not depend on the sample, so nothing recompiles per round.

  Cost: the slots' padded work is the m largest clients', not the sampled
  ones': with clients of very different sizes a small sample costs more
  than q of a round (Twitch S3, 20 DE clients of 285 training rows and 10
  others of 574 to 2,138: q = 0.2, m = 6, trains 11,340 of 22,616 padded
  training rows, 0.50 of the local work). A layout with min(C_b, m) slots
  per bucket would cost more (every bucket at its worst case; S3: 18,626
  rows, 0.82); only shapes that change per round (recompiles) could cost
  exactly the sample's. Each slot's shard is taken from every bucket its
  client may come from and the right one kept: (b + 1) gathers for a group
  of bucket b, small beside the local steps. A slot's propagation
  operator is its bucket's, padded (``graphs.pad_operator``); only where
  a smaller bucket propagates in another form is it built again.

  Args:
    federation: the static layout.
    shards: per bucket a ``Shard`` with leaves [C_b, ...] (one seed).
    sampled: bool[C], exactly ``count`` True (``sample_clients``).
    count: m < C.

  Returns:
    ``ClientSlots``.
  """
  bucket_of = _bucket_of(federation)
  position = np.zeros(federation.num_clients, np.int32)  # row of each client in its bucket
  for clients in federation.bucket_clients:
    position[list(clients)] = np.arange(len(clients))
  # The participants, largest bucket first; the j-th fits slot j (see slot_groups).
  order = jnp.argsort(jnp.where(sampled, -bucket_of, len(shards)), stable=True)[:count]
  clients, train_rows, slot_shards = [], [], []
  for group in slot_groups(federation, count):
    ids = order[group.first:group.first + group.size]
    source, row = jnp.asarray(bucket_of)[ids], jnp.asarray(position)[ids]
    taken = None
    kind = graphs.kind_of(shards[group.bucket].operator)  # the slots propagate as this bucket
    for b in range(group.bucket + 1):  # take from each bucket that may hold them, keep the right
      rows = jnp.minimum(row, len(federation.bucket_clients[b]) - 1)
      part = _pad_shard(jax.tree.map(lambda leaf: leaf[rows], shards[b]), group.n_node,
                        group.n_edge, len(federation.domains))
      if graphs.kind_of(part.operator) != kind:  # a bucket that propagates in another form
        part = part._replace(operator=None if kind == "sparse" else jax.vmap(
            lambda shard: graphs.make_operator(shard, kind))(part._replace(operator=None)))
      keep = lambda new, old: jnp.where((source == b).reshape((-1,) + (1,) * (new.ndim - 1)),
                                        new, old)
      taken = part if taken is None else jax.tree.map(keep, part, taken)
    clients.append(ids)
    train_rows.append(group.train_rows)
    slot_shards.append(taken)
  return ClientSlots(tuple(clients), tuple(train_rows), tuple(slot_shards))


def for_each_client(local_update, federation: Federation, training_input: Callable,
                    start: PyTree, global_params: PyTree,
                    shards: Union[tuple[Shard, ...], ClientSlots], keys: Array,
                    client_state: PyTree = (), server_state: PyTree = (),
                    per_client_start: bool = False, backend: str = "vmap") -> ClientOutput:
  """Every client's local training, or only the participants', rows in client order.

  Args:
    local_update: from ``client.make_local_update`` (jitted by the caller for
      the loop backend: one compile per bucket shape).
    federation: gives the static bucket layout.
    training_input: from ``make_training_input``.
    start: the model the clients start from: the global model, or with
      ``per_client_start`` each client's own (leaves [C, ...]).
    global_params: the global model W.
    shards: per bucket a ``Shard`` with leaves [C_b, ...] (one seed): every
      client trains; or a round's ``ClientSlots`` (``take_slots``): only
      the clients in its slots train.
    keys: [C] one PRNG key per client (client k's is ``keys[k]`` either way).
    client_state: the method's per-client state, leaves [C, ...].
    server_state: the method's server state (shared by all clients).
    per_client_start: see ``start``.
    backend: ``vmap`` (one batched computation per size bucket or slot
      group: the simulation's) or ``loop`` (a Python loop over clients: the
      reference for tests and the bench).

  Returns:
    ``ClientOutput`` with leaves [C, ...] (losses f32[C, local_steps]). With
    ``ClientSlots``, the rows of clients not in a slot hold zeros (update,
    losses, upload) and their ``client_state`` as given; the aggregation
    never reads them (they do not take part).

  Raises:
    ValueError: for an unknown backend.
  """
  if backend not in ("vmap", "loop"):
    raise ValueError(f"backend = {backend!r}; choose 'vmap' or 'loop'")
  rows_of = lambda tree, idx: jax.tree.map(lambda leaf: leaf[idx], tree)
  starts = lambda idx: rows_of(start, idx) if per_client_start else start
  slotted = isinstance(shards, ClientSlots)
  groups = (zip(shards.clients, shards.train_rows, shards.shards) if slotted else
            zip((np.asarray(c) for c in federation.bucket_clients),
                federation.bucket_train_rows, shards))
  outputs = []
  for idx, rows, shard in groups:
    if backend == "vmap":
      outputs.append(jax.vmap(local_update, in_axes=(0 if per_client_start else None, None,
                                                     0, 0, 0, 0, 0, 0, 0, None))(
          starts(idx), global_params, *training_input(shard, rows), keys[idx],
          rows_of(client_state, idx), server_state))
      continue
    for j in range(len(idx)):
      k = idx[j]
      outputs.append(jax.tree.map(lambda leaf: leaf[None], local_update(
          starts(k), global_params, *training_input(rows_of(shard, j), rows), keys[k],
          rows_of(client_state, k), server_state)))
  joined = jax.tree.map(lambda *parts: jnp.concatenate(parts), *outputs)
  if not slotted:
    order = np.argsort(np.concatenate(federation.bucket_clients))
    return jax.tree.map(lambda leaf: leaf[order], joined)
  # Each participant's row to its client's; the others keep zeros or their state.
  filled = jnp.concatenate(shards.clients)
  into = lambda rows, base: base.at[filled].set(rows)
  zeros = lambda rows: into(rows, jnp.zeros((federation.num_clients,) + rows.shape[1:],
                                            rows.dtype))
  return ClientOutput(update=jax.tree.map(zeros, joined.update), losses=zeros(joined.losses),
                      client_state=jax.tree.map(into, joined.client_state, client_state),
                      upload=jax.tree.map(zeros, joined.upload))


def finite_clients(client_updates: PyTree) -> Array:
  """bool[C]: True where every coordinate of client k's update is finite."""
  leaves = jax.tree.leaves(client_updates)
  per_leaf = [jnp.all(jnp.isfinite(leaf.reshape(leaf.shape[0], -1)), axis=1) for leaf in leaves]
  return jnp.all(jnp.stack(per_leaf), axis=0)


def client_keys(run_key: Array, round_index, num_clients: int) -> Array:
  """[C] dropout keys of round t: fold_in(run key, t), split per client, never reused."""
  return jax.random.split(jax.random.fold_in(run_key, round_index), num_clients)


class Scores(NamedTuple):
  """Per-domain scores of one prediction (see ``domain_scores``), each f32[D] in [0, 1] or i32[D].

  ``argmax_acc`` f32[D]: with a method's own ``predict``, the accuracy of the
  classifier's argmax beside it; else None.
  """
  acc: Array
  bacc: Array
  f1: Array
  classes: Array
  argmax_acc: Optional[Array] = None


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


def not_evaluated(shapes: PyTree) -> PyTree:
  """What an unevaluated round records, shaped like ``shapes``: NaN scores, -1 for integers."""
  fill = lambda s: jnp.full(s.shape, -1 if jnp.issubdtype(s.dtype, jnp.integer) else jnp.nan,
                            s.dtype)
  return jax.tree.map(fill, shapes)


_SIMULATIONS: dict = {}


def make_simulation(config: Config, federation: Federation,
                    diagnostics: Optional[DiagnosticsSpec] = None, method: str = "fedavg",
                    method_hparams: Optional[dict] = None, *,
                    _every_client_trains: bool = False) -> Simulation:
  """Builds the batched round, chunk and init functions for a federation.

  The result depends only on the recipe and the federation's static layout, so
  it is memoised on them: a second sweep of the same layout in one process
  (another grid, a resume, a test) reuses the compiled program; a batch of
  cells with another layout (other aggregator groups or group sizes)
  compiles ``run_chunk`` once more.

  Args:
    config: model and local training recipe.
    federation: the padded federation (only its static layout is closed over;
      its arrays are passed at call time via ``sim_data``).
    diagnostics: compute update diagnostics at these rounds; None (the
      default) compiles none of it, so a plain sweep pays nothing.
    method, method_hparams: the method and its hyper-parameters (see
      ``methods.make_method``). A method with a ``recipe`` (FedSPA) runs on
      ``config`` with those fields replaced (its own backbone); the local
      training recipe (lr, steps, momentum) stays the config's. Its
      ``model_options`` are then set on the model (``model.clone``).
    _every_client_trains: with participation < 1, train every client and
      drop the others' results (the path before slots; a reference for
      tests). By default only the round's m participants train, in the fixed
      slots of ``take_slots``, with the same keys and per-client state, so
      the results are the same (to float rounding: a participant may be
      padded to a larger shape). With participation 1, and with
      diagnostics on (they read every client's update), every client trains.

  Raises:
    ValueError: for an unknown method or a bad hyper-parameter.
  """
  hparams = dict(method_hparams or {})
  layout = (json.dumps(config.to_dict(), sort_keys=True), federation.domains,
            federation.num_classes, federation.bucket_clients, federation.bucket_train_rows,
            federation.eval_x.shape[-1], federation.one_domain_clients, diagnostics, method,
            json.dumps(hparams, sort_keys=True), _every_client_trains)
  if layout not in _SIMULATIONS:
    _SIMULATIONS[layout] = _make_simulation(config, federation, diagnostics, method, hparams,
                                            _every_client_trains)
  return _SIMULATIONS[layout]


def _make_simulation(config, federation, diagnostics, method_name, method_hparams,
                     every_client_trains):
  def backbone(config, options):
    model = config.model(federation.num_classes).clone(**options)
    if isinstance(model, models.NodeClassifier) and federation.one_domain_clients:
      model = model.clone(one_domain_train=True)
    return model

  model = backbone(config, {})
  method = methods_lib.make_method(method_name, model, config, method_hparams)
  if method.recipe or method.model_options:
    # The method brings its own backbone (FedSPA's SFPD) or sets attributes of
    # it; it is built again so that its own forward passes use that model.
    config = dataclasses.replace(config, **(method.recipe or {}))
    model = backbone(config, method.model_options or {})
    method = methods_lib.make_method(method_name, model, config, method_hparams)
  eval_labels = models.BACKBONES[config.backbone].eval_labels
  num_clients, num_domains = federation.num_clients, len(federation.domains)
  local_update = make_local_update(model, config, method, num_domains)
  training_input = make_training_input(config, num_domains, method.needs_graph)
  # The tensors every aggregator sees: all but a method's personal ones.
  shared = ((lambda tree: tree) if method.personal_leaves is None else
            (lambda tree: methods_lib.base.select(tree, lambda p: not method.personal_leaves(p))))
  feature_dim = federation.eval_x.shape[-1]
  trace_count = [0]
  count = participant_count(config.participation, num_clients)
  slotted = count < num_clients and diagnostics is None and not every_client_trains

  def init_run(seed, aggregator):
    # Keys from the seed alone: every cell (and every method) of a seed starts
    # from the same model and draws the same dropout masks (paired runs).
    seed_key = jax.random.PRNGKey(seed)
    init_key, run_key = jax.random.split(seed_key)
    # Parameters do not depend on the graph: initialise without propagation.
    plain = model.clone(propagate_train=False, propagate_eval=False)
    params = plain.init(init_key, jnp.zeros((1, feature_dim)), None, train=False)
    if method.extend_params is not None:  # a key of its own: the backbone's init is unchanged
      params = method.extend_params(params, jax.random.fold_in(init_key, 1))
    return SimState(params, aggregators.get(aggregator).init(num_clients, shared(params)),
                    method.init(params, num_clients), run_key,
                    jax.random.fold_in(seed_key, SAMPLING_STREAM))

  def init(seeds, batch: CellBatch):
    states = []
    for group in batch.groups:
      per_seed = jax.vmap(lambda seed: init_run(seed, group.aggregator))(jnp.asarray(seeds))
      states.append(jax.tree.map(lambda leaf: jnp.repeat(leaf[:, None], group.size, axis=1),
                                 per_seed))
    return tuple(states)

  def aggregate(state, aggregator, hparams, outputs: ClientOutput, train_counts, sampled=None):
    # A non-finite update never reaches the global model: its client is treated
    # as absent this round (weights renormalised over the others, the
    # aggregator's and the method's per-client state kept); the sweep then
    # stops or counts it, as its policy says.
    finite = finite_clients(outputs.update)
    participating = finite & (train_counts > 0)
    if sampled is not None:
      participating = participating & sampled
    base_weights = jnp.ones_like(train_counts) if method.uniform_weights else train_counts
    # A method's own per-tensor weights (FedSPA's HBDA), kept under any aggregator.
    leaf_weights = (None if method.leaf_weights is None
                    else shared(method.leaf_weights(state.params, outputs.upload, participating)))
    update, agg_state, diag = aggregators.get(aggregator).update(
        shared(outputs.update), state.aggregator, weights=base_weights,
        participating=participating, leaf_weights=leaf_weights, **hparams)
    if method.personal_leaves is not None:  # personal tensors: no aggregate, the global keeps its own
      update = methods_lib.base.fill(update, outputs.update,
                                     lambda u: jnp.zeros(u.shape[1:], u.dtype))
    # A client whose update is finite but one of whose statistics is not (an
    # overflowing norm) was left out by the aggregator: it is absent too.
    participating = participating & ~diag.excluded
    num_participants = jnp.sum(participating)
    params, server = method.server_step(state.params, state.method.server, update,
                                        outputs.upload, participating, num_clients)
    # A round nobody took part in changes nothing (FedDyn's h/alpha term and a
    # server optimiser's momentum would otherwise still move W).
    nobody = num_participants == 0
    params, server, agg_state = jax.tree.map(
        lambda old, new: jnp.where(nobody, old, new),
        (state.params, state.method.server, state.aggregator), (params, server, agg_state))
    keep_new = lambda new, old: jnp.where(
        participating.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    clients = jax.tree.map(keep_new, outputs.client_state, state.method.clients)
    # Only updates that would have been aggregated count as non-finite.
    counted = train_counts > 0 if sampled is None else sampled & (train_counts > 0)
    loss = (jnp.sum(jnp.where(participating, outputs.losses[:, -1], 0.0))
            / jnp.maximum(num_participants, 1))
    # A personal method (local training) aggregates nothing: no weight to record.
    weights = jnp.zeros_like(diag.weights) if method.personal else diag.weights
    metrics = (loss, weights, diag.mask_coverage, (~finite | diag.excluded) & counted)
    return state._replace(params=params, aggregator=agg_state,
                          method=methods_lib.MethodState(clients, server)), metrics

  def train_and_aggregate(state, aggregator, hparams, shards, train_counts, t):
    start = state.method.clients if method.personal else state.params
    outputs = for_each_client(local_update, federation, training_input, start, state.params,
                              shards, client_keys(state.key, t, num_clients),
                              state.method.clients, state.method.server,
                              per_client_start=method.personal)
    sampled = sample_clients(state.sample_key, t, num_clients, config.participation)
    state, metrics = aggregate(state, aggregator, hparams, outputs, train_counts, sampled)
    if diagnostics is None:
      return state, metrics + (None,)
    return state, metrics + (round_diagnostics(outputs.update, train_counts, metrics[-1], t),)

  def round_diagnostics(updates, train_counts, nonfinite, t):
    from fedjax_graph import diagnostics as diag_lib  # Only imported when asked for.

    weights = jnp.where(nonfinite, 0.0, train_counts)
    compute = lambda u: diag_lib.round_diagnostics(u, weights, diagnostics.top)
    skip = lambda u: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                  jax.eval_shape(compute, u))
    # t is the same for every run of the batch, so under vmap this stays a
    # branch and rounds without a checkpoint compute nothing.
    return jax.lax.cond(jnp.isin(t + 1, jnp.asarray(diagnostics.rounds)), compute, skip, updates)

  def evaluate(params, val_mask, test_mask, owner, data, server_state=()):
    graph = data.eval_graph
    if eval_labels:
      # SFPD types edges by training labels at inference too: those of the
      # domain's clients (every real node is a client's train, val or test node).
      train = (data.eval_domain < num_domains) & ~val_mask & ~test_mask
      graph = sfpd.LabelledGraph(graph, data.eval_y, train)
    # Batch-norm statistics per domain: each domain's full graph is its own batch.
    predict_all = lambda p: predict(model, p, data.eval_x, graph, data.eval_domain,
                                    num_domains)
    argmax = None
    if method.personal:  # each node by the model of the client that holds it
      per_client = jax.lax.map(predict_all, params)  # [C, N]; one model at a time, less memory
      pred = jnp.take_along_axis(per_client, owner[None], axis=0)[0]
    elif method.predict is not None:  # the method's scores, and the classifier's argmax beside
      hidden, logits = model.apply(params, data.eval_x, graph, train=False,
                                   with_hidden=True, groups=data.eval_domain,
                                   num_groups=num_domains)
      pred = jnp.argmax(method.predict(params, server_state, hidden, logits), axis=-1)
      argmax = jnp.argmax(logits, axis=-1)
    else:
      pred = predict_all(params)
    scores = lambda mask, p=pred: domain_scores(p, data.eval_y, mask, data.eval_domain,
                                                num_domains, federation.num_classes)
    test = scores(test_mask)
    if argmax is not None:
      test = test._replace(argmax_acc=scores(test_mask, argmax).acc)
    return test, scores(val_mask).acc

  def participants(sample_key, shards, t):
    # The round's sampled clients in their fixed slots (only called when slotted).
    sampled = sample_clients(sample_key, t, num_clients, config.participation)
    return take_slots(federation, shards, sampled, count)

  def round_metrics(trained, scores, evaluate_now):
    # With a schedule this is a real branch (the round index is the same for every run of the
    # batch and the callers are not under a vmap): a round left out computes no evaluation.
    test, val_acc = (scores() if evaluate_now is None else jax.lax.cond(
        evaluate_now, scores, lambda: not_evaluated(jax.eval_shape(scores))))
    loss, weights, coverage, nonfinite, diags = trained
    return RoundMetrics(test.acc, val_acc, test.bacc, test.f1, loss, weights, coverage,
                        nonfinite, test.classes, diags, test.argmax_acc)

  def run_group(state, group, hparams, t, data, evaluate_now=None):
    if not slotted:
      per_cell = jax.vmap(lambda s, h, shards: train_and_aggregate(
          s, group.aggregator, h, shards, data.train_counts, t), in_axes=(0, 0, None))
      state, trained = jax.vmap(per_cell, in_axes=(0, None, 0))(state, hparams,
                                                                 data.client_shards)
    else:
      def per_seed(cells_state, shards):
        # The sample key is the seed's, the same in every cell: gather the slots once per seed,
        # outside the vmap over cells, so the cells share them as they share the shards.
        slots = participants(cells_state.sample_key[0], shards, t)
        return jax.vmap(lambda s, h: train_and_aggregate(
            s, group.aggregator, h, slots, data.train_counts, t))(cells_state, hparams)
      state, trained = jax.vmap(per_seed)(state, data.client_shards)
    per_cell_eval = jax.vmap(evaluate, in_axes=(0, None, None, None, None, 0))
    evaluated = state.method.clients if method.personal else state.params
    scores = lambda: jax.vmap(per_cell_eval, in_axes=(0, 0, 0, 0, None, 0))(
        evaluated, data.eval_val, data.eval_test, data.eval_owner, data, state.method.server)
    return state, round_metrics(trained, scores, evaluate_now)

  def run_round(states, t, batch: CellBatch, data, schedule=EvalSchedule()):
    evaluate_now = None if schedule.every == 1 else schedule.evaluated(t)
    results = [run_group(state, group, hparams, t, data, evaluate_now)
               for state, group, hparams in zip(states, batch.groups, batch.values)]
    states = tuple(state for state, _ in results)
    # Groups' cells side by side: [S, G_g, ...] -> [S, G', ...].
    metrics = jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1),
                           *(metrics for _, metrics in results))
    return states, metrics

  def run_chunk(state, first_round, batch, data, num_rounds, schedule=EvalSchedule()):
    trace_count[0] += 1
    step = lambda s, t: run_round(s, t, batch, data, schedule)
    state, metrics = jax.lax.scan(step, state, first_round + jnp.arange(num_rounds))
    # scan stacks rounds first: [L, S, G', ...] -> [S, G', L, ...].
    return state, jax.tree.map(lambda m: jnp.moveaxis(m, 0, 2), metrics)

  def run_runs_group(state, group, hparams, seed_index, t, data, evaluate_now=None):
    # One vmap over the runs (leaves [R, ...]); each run gathers its seed's rows
    # of the per-seed data, the shared data (evaluation graph) stay shared.
    def per_run(run_state, h, s):
      shards = jax.tree.map(lambda leaf: leaf[s], data.client_shards)
      if slotted:
        shards = participants(run_state.sample_key, shards, t)
      return train_and_aggregate(run_state, group.aggregator, h, shards, data.train_counts, t)

    state, trained = jax.vmap(per_run)(state, hparams, seed_index)
    evaluated = state.method.clients if method.personal else state.params
    scores = lambda: jax.vmap(evaluate, in_axes=(0, 0, 0, 0, None, 0))(
        evaluated, data.eval_val[seed_index], data.eval_test[seed_index],
        data.eval_owner[seed_index], data, state.method.server)
    return state, round_metrics(trained, scores, evaluate_now)

  def run_runs(states, first_round, batch, seed_index, data, num_rounds,
               schedule=EvalSchedule()):
    trace_count[0] += 1

    def step(states, t):
      evaluate_now = None if schedule.every == 1 else schedule.evaluated(t)
      results = [run_runs_group(state, group, hparams, seeds, t, data, evaluate_now)
                 for state, group, hparams, seeds in zip(states, batch.groups, batch.values,
                                                         seed_index)]
      return tuple(s for s, _ in results), tuple(m for _, m in results)

    states, metrics = jax.lax.scan(step, states, first_round + jnp.arange(num_rounds))
    # [L, R_g, ...] -> [R_g, L, ...] per group.
    return states, jax.tree.map(lambda m: jnp.moveaxis(m, 0, 1), metrics)

  return Simulation(model=model, config=config, local_update=local_update, training_input=training_input,
                    aggregate=aggregate, method=method, evaluate=evaluate, init=jax.jit(init),
                    run_chunk=jax.jit(run_chunk, static_argnames=("num_rounds", "schedule")),
                    trace_count=trace_count, run_runs=run_runs)
