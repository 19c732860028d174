"""Server-side aggregators: FedAvg and FedIA (importance-aware aggregation).

Every aggregator is a pair of pure functions, in the style of an optax
``GradientTransformation`` / ``optax.experimental.Aggregator``, built by a
function that closes over the static switches:

  * ``init(num_clients) -> state``
  * ``update(client_updates, state, rho, beta, base_weights=None,
    participating=None) -> (aggregated_update, new_state, diagnostics)``

so a simulation can hold FedAvg and FedIA behind one interface, ``jit`` the
round, ``lax.scan`` over rounds and ``vmap`` over grid cells of ``(rho, beta)``.

Shapes use the project's one legend (``fedjax_graph/types.py``): ``C``
clients, ``G`` grid cells of ``(rho, beta)``, ... Here ``...`` also stands for
the shape of one parameter tensor and ``n`` for its number of coordinates.

Conventions:
  * ``client_updates`` is a pytree (e.g. Flax params) whose every leaf has a
    leading client axis, ``[C, ...]``. Row ``k`` is client ``k`` by index; the
    order of clients never matters beyond that (all rules are permutation
    equivariant in the client axis).
  * Updates are in the descent convention of the paper (Sec. 3.1):
    ``u_k = -(W_k - W) / eta`` for model sharing (the negative model delta over
    the local learning rate), or the uploaded gradient for gradient sharing.
    The aggregate ``u`` is in the same convention; the *server* then applies
    ``W <- W - eta * u`` (eq. 8). Applying it is not the aggregator's job.
  * ``participating`` is a bool ``[C]`` (default: all ``True``): the sampled
    set ``S_t``. Rows of non-participants are treated as padding: they are
    never read into a result (a NaN there cannot leak), get weight 0 in every
    aggregate and are left out of every mean, max and normalisation.
  * ``rho`` and ``beta`` may be Python numbers or (traced) scalar arrays. Only
    Python/NumPy scalars are range-checked; nothing here breaks tracing, and a
    ``vmap`` over a vector of ``rho`` (or ``beta``) values compiles once.
  * Per-client vectors (``alpha``, scores, softmax) are float32. Aggregates
    keep each leaf's dtype; they are accumulated in at least float32 by
    elementwise multiply-and-sum (not a matmul, so no TF32/bf16 matmul
    precision is involved on accelerators).

References:
  FedIA paper: "Dissecting Federated-Graph Aggregation under Domain Shift:
  Importance-Aware Aggregation via Empirical Analysis" (the version this
  project implements; authors, year and URL not given in its text), Sec. 3.3,
  Algorithm 1, eqs. (5)-(8). An earlier version: Z. Zhou, K. Tam, Z. Wu, P. Sun, J. Wang and
  F. Zhang, "FedIA: A Plug-and-Play Importance-Aware Gradient Pruning
  Aggregation Method for Domain-Robust Federated Graph Learning on Node
  Classification", 2025, https://arxiv.org/abs/2509.18171.

  FedAvg: H. B. McMahan, E. Moore, D. Ramage, S. Hampson and B. Aguera y
  Arcas, "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017, https://arxiv.org/abs/1602.05629.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple, Protocol

import chex
import jax
import jax.numpy as jnp

ClientUpdates = chex.ArrayTree  # Pytree, every leaf [C, ...].
Updates = chex.ArrayTree  # Pytree shaped like one client's: leaves [...].
AggregatorState = chex.ArrayTree


# ----------------------------------------------------------------------------
# Types.
# ----------------------------------------------------------------------------


class FedIAState(NamedTuple):
  """Server state of FedIA: the Contribution-Aware Momentum weights.

  Attributes:
    alpha: f32[C]. ``alpha_k^{t}`` of eq. (7), indexed by client id. Starts
      at ``1/C`` (Algorithm 1, line 2). After a round, the participants'
      entries sum to 1; a non-participant keeps its previous entry.
  """

  alpha: jax.Array  # f32[C]


class EmptyState(NamedTuple):
  """State of a stateless aggregator (FedAvg): a pytree with no leaves."""


class FedIADiagnostics(NamedTuple):
  """Per-round diagnostics of an aggregator (FedIA and FedAvg alike).

  Attributes:
    mask_coverage: f32[]. Fraction of all model coordinates kept by the
      importance mask (1.0 without a mask).
    alpha: f32[C]. Client weights: FedIA's ``alpha^t`` (eq. 7; a
      non-participant's entry is its carried ``alpha^{t-1}``); without
      momentum, the effective aggregation weights (base weights renormalised
      over participants, 0 for non-participants).
    scores: f32[C]. ``s_k = ||u_k * M||_2`` over the whole model (eq. 6);
      0 for non-participants.
    softmax: f32[C]. ``p_k = softmax(s)`` over participants (eq. 6); 0 for
      non-participants.
  """

  mask_coverage: jax.Array  # f32[]
  alpha: jax.Array  # f32[C]
  scores: jax.Array  # f32[C]
  softmax: jax.Array  # f32[C]


class AggregatorInitFn(Protocol):
  """Makes the aggregator's initial server state."""

  def __call__(self, num_clients: int) -> AggregatorState:
    """Returns the state for ``num_clients`` (C) clients."""


class AggregatorUpdateFn(Protocol):
  """Aggregates one round of client updates."""

  def __call__(
      self,
      client_updates: ClientUpdates,
      state: AggregatorState,
      rho: Any,
      beta: Any,
      base_weights: Any = None,
      participating: Any = None,
  ) -> tuple[Updates, AggregatorState, FedIADiagnostics]:
    """Maps leaves ``[C, ...]`` to ``[...]``; see :func:`fedia`."""


class Aggregator(NamedTuple):
  """A server aggregator: a pair of pure functions (optax style).

  Attributes:
    init: ``init(num_clients) -> state``.
    update: ``update(client_updates, state, rho, beta, base_weights=None,
      participating=None) -> (aggregated_update, new_state, diagnostics)``.
  """

  init: AggregatorInitFn
  update: AggregatorUpdateFn


# ----------------------------------------------------------------------------
# Static (trace-time) checks.
# ----------------------------------------------------------------------------


def num_clients_of(client_updates: ClientUpdates) -> int:
  """C of stacked client updates, checking that every leaf has the same leading axis.

  Raises:
    ValueError: naming the leaves, if there are none, one is a scalar, or
      they disagree on C.
  """
  leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(client_updates)
  if not leaves_with_path:
    raise ValueError("client_updates has no array leaves.")
  sizes = {}
  for path, leaf in leaves_with_path:
    name = jax.tree_util.keystr(path) or "<root>"
    shape = jnp.shape(leaf)
    if len(shape) == 0:
      raise ValueError(
          f"client_updates leaf {name} is a scalar; every leaf needs a "
          "leading client axis [C, ...]."
      )
    sizes[name] = shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(
        "client_updates leaves disagree on the leading (client) axis: "
        f"{sizes}."
    )
  num_clients = next(iter(sizes.values()))
  if num_clients < 1:
    raise ValueError(f"client_updates has C={num_clients} clients.")
  return num_clients


def _client_vector(name: str, value: Any, num_clients: int) -> jax.Array:
  """Returns ``value`` as an array, checking its static shape is [C]."""
  value = jnp.asarray(value)
  if value.shape != (num_clients,):
    raise ValueError(
        f"{name} must have shape ({num_clients},) (one entry per client), "
        f"got {value.shape}."
    )
  return value


def _participation(participating: Any, num_clients: int) -> jax.Array:
  """Returns participation as bool [C] (all True when None)."""
  if participating is None:
    return jnp.ones((num_clients,), dtype=bool)
  return _client_vector("participating", participating, num_clients).astype(bool)


def _is_python_scalar(x: Any) -> bool:
  # Python and NumPy scalars are concrete; jax Arrays (possibly traced) are
  # not numbers.Real and are never range-checked.
  return isinstance(x, numbers.Real) and not isinstance(x, jax.Array)


def _check_rho(rho: Any) -> None:
  if jnp.ndim(rho) != 0:
    raise ValueError(
        f"rho must be a scalar, got shape {jnp.shape(rho)}; vmap over a "
        "vector of rho values instead."
    )
  if _is_python_scalar(rho) and not 0.0 < rho <= 1.0:
    raise ValueError(f"rho must be in (0, 1], got rho={rho!r}.")


def _check_beta(beta: Any) -> None:
  if jnp.ndim(beta) != 0:
    raise ValueError(
        f"beta must be a scalar, got shape {jnp.shape(beta)}; vmap over a "
        "vector of beta values instead."
    )
  if _is_python_scalar(beta) and not 0.0 <= beta <= 1.0:
    raise ValueError(f"beta must be in [0, 1], got beta={beta!r}.")


# ----------------------------------------------------------------------------
# Small jittable helpers.
# ----------------------------------------------------------------------------


def _as_float(x: Any) -> jax.Array:
  """A scalar hyper-parameter as a float array (not weakly typed).

  Python floats and traced arrays then hit the same compiled core.
  """
  return jnp.asarray(x, dtype=jnp.result_type(float))


def _acc_dtype(dtype: Any) -> Any:
  """Accumulation dtype: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)


def _rows(part: jax.Array, leaf: jax.Array) -> jax.Array:
  """Participation [C] broadcastable against ``leaf`` [C, ...]."""
  return part.reshape((part.shape[0],) + (1,) * (leaf.ndim - 1))


def _normalise_over_participants(
    weights: jax.Array, part: jax.Array
) -> jax.Array:
  """``w_k p_k / sum_j w_j p_j`` as f32[C]; all zeros if the sum is 0."""
  w = jnp.where(part, weights.astype(jnp.float32), 0.0)
  total = jnp.sum(w)
  positive = total > 0
  return jnp.where(positive, w / jnp.where(positive, total, 1.0), 0.0)


def _weighted_sum(
    client_updates: ClientUpdates,
    coeff: jax.Array,
    part: jax.Array,
    mask: Updates | None,
) -> Updates:
  """``sum_k coeff_k (u_k * M)`` over participants, leaf by leaf."""

  def leaf_sum(leaf, leaf_mask):
    acc = _acc_dtype(leaf.dtype)
    x = jnp.where(_rows(part, leaf), leaf, 0).astype(acc)
    if leaf_mask is not None:
      x = x * leaf_mask.astype(acc)
    c = coeff.astype(acc).reshape(_rows(part, leaf).shape)
    return jnp.sum(c * x, axis=0).astype(leaf.dtype)

  if mask is None:
    return jax.tree.map(lambda leaf: leaf_sum(leaf, None), client_updates)
  return jax.tree.map(leaf_sum, client_updates, mask)


# ----------------------------------------------------------------------------
# FedAvg.
# ----------------------------------------------------------------------------


def fedavg(
    client_updates: ClientUpdates,
    weights: Any,
    participating: Any = None,
) -> Updates:
  """Weighted mean of the participating clients' updates (FedAvg).

  ``u = sum_k w_k p_k u_k / sum_k w_k p_k`` with ``p_k`` the participation
  indicator: the weights are renormalised over participants, and
  non-participants contribute nothing (their rows are never read).

  Args:
    client_updates: pytree, every leaf float[C, ...]; row ``k`` is client
      ``k``'s update in the descent convention.
    weights: float[C], non-negative (e.g. train-node counts). Not
      range-checked (it may be traced).
    participating: optional bool[C]; default all True.

  Returns:
    Pytree shaped like one client's update (leaves [...], same dtypes). All
    zeros, not NaN, if the participants' weights sum to 0 (or nobody
    participates).

  Raises:
    ValueError: if leaves disagree on the leading axis C, or ``weights`` /
      ``participating`` are not of shape [C].

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017.
  """
  num_clients = num_clients_of(client_updates)
  part = _participation(participating, num_clients)
  weights = _client_vector("weights", weights, num_clients)
  return _fedavg_core(client_updates, weights, part)


@jax.jit
def _fedavg_core(
    client_updates: ClientUpdates, weights: jax.Array, part: jax.Array
) -> Updates:
  coeff = _normalise_over_participants(weights, part)
  return _weighted_sum(client_updates, coeff, part, None)


# ----------------------------------------------------------------------------
# FedIA components: eqs. (5), (6), (7).
# ----------------------------------------------------------------------------


def _leaf_mask(
    leaf: jax.Array, part: jax.Array, num_part: jax.Array, rho: jax.Array
) -> jax.Array:
  """Eq. (5) for one parameter group (one leaf [C, ...])."""
  shape = leaf.shape[1:]
  n = math.prod(shape)
  if n == 0:
    return jnp.zeros(shape, leaf.dtype)
  acc = _acc_dtype(leaf.dtype)
  activity = jnp.where(_rows(part, leaf), jnp.abs(leaf), 0).astype(acc)
  importance = jnp.sum(activity.reshape(leaf.shape[0], n), axis=0) / num_part
  # Stable descending sort: among equal importances the lower flat index
  # comes first, so ties go to the lower index.
  order = jnp.argsort(importance, descending=True, stable=True)
  # k = clip(round(rho * n), 1, n), round half to even. k is data (not a
  # shape), so a traced or vmapped rho never retraces.
  k = jnp.clip(jnp.round(rho * n), 1, n).astype(jnp.int32)
  keep_in_order = jnp.arange(n, dtype=jnp.int32) < k
  flat = jnp.zeros((n,), dtype=bool).at[order].set(keep_in_order)
  return flat.reshape(shape).astype(leaf.dtype)


def importance_mask(
    client_updates: ClientUpdates,
    rho: Any,
    participating: Any = None,
) -> Updates:
  """Layer-wise Importance Masking (IM), eq. (5); Algorithm 1, lines 4-8.

  Each leaf is one parameter group ``G_m`` (one "layer"). Its importance is
  the mean over participating clients of ``|u_k|``, coordinate by
  coordinate; the mask keeps exactly ``k = clip(round(rho * n), 1, n)`` of
  its ``n`` coordinates, those of largest importance. Every leaf gets its
  own budget ``k``, so a large layer cannot crowd out a small one.

  Details that the paper leaves open, fixed here:
    * ``round`` is round-half-to-even (``jnp.round``), computed in floating
      point: ``n=5, rho=0.5`` gives ``round(2.5) = 2``; ``rho=0.3`` gives
      ``round(1.5) = 2``; ``rho=0.7`` gives ``round(3.5) = 4``.
    * At least one coordinate per leaf is kept (``k >= 1``), so a small
      ``rho`` never zeroes a layer; ``rho = 1`` keeps everything.
    * Ties in importance go to the lower flat (row-major) index.
    * With no participant, importance is all 0 and the first ``k``
      coordinates of each leaf are kept.

  Args:
    client_updates: pytree, every leaf float[C, ...].
    rho: retention ratio, scalar in (0, 1]; a Python float or a (traced)
      scalar array. Traced values are not range-checked; the clip on ``k``
      makes ``rho <= 0`` keep one coordinate per leaf and ``rho > 1`` keep
      all.
    participating: optional bool[C]; default all True. Non-participants are
      excluded from the importance.

  Returns:
    Pytree of masks shaped like one client's update (leaves [...]), each
    with its leaf's dtype and values in {0, 1}.

  Raises:
    ValueError: if leaves disagree on the leading axis C, ``participating``
      is not [C], ``rho`` is not a scalar, or ``rho`` is a Python/NumPy
      number outside (0, 1].
  """
  num_clients = num_clients_of(client_updates)
  _check_rho(rho)
  part = _participation(participating, num_clients)
  return _importance_mask_core(client_updates, _as_float(rho), part)


def _importance_mask_impl(
    client_updates: ClientUpdates, rho: jax.Array, part: jax.Array
) -> Updates:
  num_part = jnp.maximum(jnp.sum(part), 1).astype(jnp.float32)
  return jax.tree.map(
      lambda leaf: _leaf_mask(leaf, part, num_part, rho), client_updates
  )


_importance_mask_core = jax.jit(_importance_mask_impl)


def contribution_scores(
    client_updates: ClientUpdates,
    mask: Updates | None = None,
    participating: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Contribution scores and their softmax, eq. (6); Algorithm 1, 9-10.

  ``s_k = ||u_k * M||_2`` over the whole model (all leaves together) and
  ``p_k = exp(s_k) / sum_{j in S} exp(s_j)`` over participants only. The
  softmax subtracts the participants' maximum first, so scores 1e4 apart
  give finite weights (a one-hot up to underflow).

  Args:
    client_updates: pytree, every leaf float[C, ...].
    mask: optional pytree shaped like one client's update (leaves [...],
      values in {0, 1}), e.g. from :func:`importance_mask`; None means no
      mask.
    participating: optional bool[C]; default all True.

  Returns:
    ``(scores, softmax)``, both f32[C]; non-participants get 0 in both. With
    no participant both are all zeros.

  Raises:
    ValueError: if leaves disagree on the leading axis C or
      ``participating`` is not [C].
  """
  num_clients = num_clients_of(client_updates)
  part = _participation(participating, num_clients)
  return _scores_core(client_updates, mask, part)


def _scores_impl(
    client_updates: ClientUpdates, mask: Updates | None, part: jax.Array
) -> tuple[jax.Array, jax.Array]:
  num_clients = part.shape[0]

  def leaf_sq(leaf, leaf_mask):
    x = jnp.where(_rows(part, leaf), leaf, 0).astype(jnp.float32)
    if leaf_mask is not None:
      x = x * leaf_mask.astype(jnp.float32)
    return jnp.sum(jnp.square(x).reshape(num_clients, -1), axis=1)

  if mask is None:
    sq = jax.tree.map(lambda leaf: leaf_sq(leaf, None), client_updates)
  else:
    sq = jax.tree.map(leaf_sq, client_updates, mask)
  scores = jnp.sqrt(sum(jax.tree.leaves(sq)))

  top = jnp.max(jnp.where(part, scores, -jnp.inf))
  top = jnp.where(jnp.any(part), top, 0.0)
  e = jnp.where(part, jnp.exp(scores - top), 0.0)
  total = jnp.sum(e)  # >= 1 whenever someone participates.
  softmax = e / jnp.where(total > 0, total, 1.0)
  return scores, softmax


_scores_core = jax.jit(_scores_impl)


def _momentum_step(
    alpha_prev: jax.Array, softmax: jax.Array, beta: Any, part: jax.Array
) -> jax.Array:
  """Eq. (7): EMA of the softmax, renormalised over participants."""
  beta = jnp.asarray(beta, dtype=jnp.float32)
  tilde = beta * alpha_prev.astype(jnp.float32) + (1.0 - beta) * softmax
  return jnp.where(
      part,
      _normalise_over_participants(tilde, part),
      alpha_prev.astype(jnp.float32),
  )


def contribution_weights(
    client_updates: ClientUpdates,
    mask: Updates | None,
    alpha_prev: Any,
    beta: Any,
    participating: Any = None,
) -> jax.Array:
  """Contribution-Aware Momentum (CAM) weights, eqs. (6)-(7).

  ``s`` and ``p`` are as in :func:`contribution_scores`; then
  ``alpha~_k = beta * alpha_prev_k + (1 - beta) * p_k`` and, for
  participants, ``alpha_k = alpha~_k / sum_{j in S} alpha~_j``.

  Semantics under partial participation (as eq. 7 reads): the participants'
  ``alpha`` sum to 1 (they share the whole aggregate between them); a
  non-participant keeps ``alpha_prev_k`` unchanged as its memory and has
  weight 0 in the aggregate. Hence ``sum(alpha)`` over all C clients is
  ``1 + sum_{k not in S} alpha_prev_k``, not 1. If the participants'
  ``alpha~`` sum to 0 (only possible with ``beta = 1`` and their
  ``alpha_prev`` all 0), their ``alpha`` are 0 (no NaN).

  Args:
    client_updates: pytree, every leaf float[C, ...].
    mask: pytree shaped like one client's update (leaves [...], values in
      {0, 1}), or None for no mask.
    alpha_prev: float[C], ``alpha^{t-1}`` (``1/C`` in the first round).
    beta: momentum factor, scalar in [0, 1]; a Python float or a (traced)
      scalar array (traced values are not range-checked).
    participating: optional bool[C]; default all True.

  Returns:
    ``alpha^t``, f32[C].

  Raises:
    ValueError: if leaves disagree on the leading axis C, ``alpha_prev`` or
      ``participating`` is not [C], ``beta`` is not a scalar, or ``beta`` is
      a Python/NumPy number outside [0, 1].
  """
  num_clients = num_clients_of(client_updates)
  _check_beta(beta)
  part = _participation(participating, num_clients)
  alpha_prev = _client_vector("alpha_prev", alpha_prev, num_clients)
  return _contribution_weights_core(
      client_updates, mask, alpha_prev, _as_float(beta), part
  )


@jax.jit
def _contribution_weights_core(
    client_updates: ClientUpdates,
    mask: Updates | None,
    alpha_prev: jax.Array,
    beta: jax.Array,
    part: jax.Array,
) -> jax.Array:
  _, softmax = _scores_impl(client_updates, mask, part)
  return _momentum_step(alpha_prev, softmax, beta, part)


# ----------------------------------------------------------------------------
# Aggregators.
# ----------------------------------------------------------------------------


def _check_num_clients(num_clients: int) -> int:
  if isinstance(num_clients, bool) or not isinstance(num_clients, numbers.Integral):
    raise ValueError(f"num_clients must be an int, got {num_clients!r}.")
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
  return int(num_clients)


def _aggregate(
    client_updates: ClientUpdates,
    alpha_prev: jax.Array | None,
    rho: Any,
    beta: Any,
    base_weights: Any,
    participating: Any,
    use_mask: bool,
    use_momentum: bool,
) -> tuple[Updates, jax.Array | None, FedIADiagnostics]:
  """One round of FedIA (or an ablation): static checks, then the core."""
  num_clients = num_clients_of(client_updates)
  part = _participation(participating, num_clients)
  if use_mask:
    _check_rho(rho)
    rho = _as_float(rho)
  else:
    rho = None  # Unused.
  if use_momentum:
    _check_beta(beta)
    beta = _as_float(beta)
    base_weights = None  # Unused by full FedIA.
  else:
    beta = None  # Unused.
    if base_weights is None:
      base_weights = jnp.ones((num_clients,), jnp.float32)
    base_weights = _client_vector("base_weights", base_weights, num_clients)
  return _aggregate_core(
      client_updates,
      alpha_prev,
      rho,
      beta,
      base_weights,
      part,
      use_mask=use_mask,
      use_momentum=use_momentum,
  )


@functools.partial(jax.jit, static_argnames=("use_mask", "use_momentum"))
def _aggregate_core(
    client_updates: ClientUpdates,
    alpha_prev: jax.Array | None,
    rho: jax.Array | None,
    beta: jax.Array | None,
    base_weights: jax.Array | None,
    part: jax.Array,
    *,
    use_mask: bool,
    use_momentum: bool,
) -> tuple[Updates, jax.Array | None, FedIADiagnostics]:
  if use_mask:
    mask = _importance_mask_impl(client_updates, rho, part)
    kept = sum(jnp.sum(m, dtype=jnp.float32) for m in jax.tree.leaves(mask))
    total = sum(m.size for m in jax.tree.leaves(mask))
    coverage = kept / max(total, 1)
  else:
    mask = None
    coverage = jnp.ones((), jnp.float32)

  scores, softmax = _scores_impl(client_updates, mask, part)

  if use_momentum:
    alpha = _momentum_step(alpha_prev, softmax, beta, part)
    coeff = jnp.where(part, alpha, 0.0)
    reported = alpha
  else:
    alpha = alpha_prev
    coeff = _normalise_over_participants(base_weights, part)
    reported = coeff

  aggregate = _weighted_sum(client_updates, coeff, part, mask)
  diagnostics = FedIADiagnostics(
      mask_coverage=jnp.asarray(coverage, jnp.float32),
      alpha=reported,
      scores=scores,
      softmax=softmax,
  )
  return aggregate, alpha, diagnostics


def fedia(use_mask: bool = True, use_momentum: bool = True) -> Aggregator:
  """FedIA: Importance Masking + Contribution-Aware Momentum (Algorithm 1).

  One round (Algorithm 1, lines 4-13):

    1. IM, eq. (5): per leaf (parameter group), importance = mean over
       participants of ``|u_k|``; mask ``M`` keeps the top
       ``clip(round(rho * n), 1, n)`` coordinates (see
       :func:`importance_mask`).
    2. CAM, eqs. (6)-(7): ``s_k = ||u_k * M||_2`` over the whole model,
       ``p = softmax(s)`` over participants, ``alpha~ = beta * alpha_prev +
       (1 - beta) * p``, renormalised over participants (see
       :func:`contribution_weights`).
    3. Aggregate, eq. (8): ``u = sum_{k in S} alpha_k (u_k * M)``.

  The server then applies ``W <- W - eta * u`` (eq. 8, Algorithm 1 line 14);
  that step is the caller's, not the aggregator's.

  Ablations (static switches, fixed when the aggregator is built):
    * ``use_momentum=False`` (IM only): the client weights are the
      ``base_weights`` renormalised over participants (uniform if None,
      e.g. train-node counts for count weighting) instead of ``alpha``;
      ``beta`` is ignored and the state is passed through unchanged. The
      aggregate equals ``fedavg(u * M, base_weights, participating)``.
    * ``use_mask=False`` (CAM only): ``M`` is all ones; ``rho`` is ignored.
    * Both off: FedAvg (see :func:`fedavg_aggregator`).

  With ``rho = 1`` and ``beta = 1``, FedIA is uniform averaging: the mask is
  all ones and ``alpha`` stays ``1/C`` (with every client participating).

  Where this departs from the authors' public PyTorch code (as seen in one
  version of it), the paper text is followed: the mask is chosen per layer
  (eq. 5), not by one top-k over all parameters concatenated; ``k`` is
  ``round(rho * n)`` clipped to ``[1, n]``, not ``max(1, floor(rho * D))``;
  importance and scores use the current round's updates (the model deltas in
  descent convention, Sec. 3.1), not a running mean of each client's past
  gradients; ``alpha`` is indexed by client id (so partial participation is
  well defined), not by position among the online clients.

  Args:
    use_mask: apply Importance Masking (eq. 5). Static.
    use_momentum: weight clients by Contribution-Aware Momentum (eqs. 6-7).
      Static.

  Returns:
    An :class:`Aggregator` ``(init, update)``:

    ``init(num_clients) -> FedIAState(alpha=f32[C] all 1/C)``; raises
    ValueError unless ``num_clients`` is an int >= 1.

    ``update(client_updates, state, rho, beta, base_weights=None,
    participating=None) -> (aggregated_update, new_state, diagnostics)``:

      * ``client_updates``: pytree, every leaf float[C, ...], descent
        convention.
      * ``state``: :class:`FedIAState`, ``alpha`` f32[C].
      * ``rho``: retention ratio, scalar in (0, 1] (Python float or traced
        scalar array; vmappable).
      * ``beta``: momentum factor, scalar in [0, 1] (idem).
      * ``base_weights``: optional float[C], used only when
        ``use_momentum=False``; uniform if None. Ignored by full FedIA
        (Algorithm 1 starts from ``alpha^0 = 1/C``).
      * ``participating``: optional bool[C]; default all True.
      * Returns ``aggregated_update`` shaped like one client's pytree
        (leaves [...], same dtypes), ``new_state`` (:class:`FedIAState`)
        and :class:`FedIADiagnostics`.
      * Raises ValueError if leaves disagree on the leading axis C; a
        per-client argument or ``state.alpha`` is not [C]; ``rho``/``beta``
        is not a scalar; or (when used) ``rho`` is a Python number outside
        (0, 1] or ``beta`` one outside [0, 1].

  References:
    FedIA paper, "Dissecting Federated-Graph Aggregation under Domain Shift:
    Importance-Aware Aggregation via Empirical Analysis", Sec. 3.3,
    Algorithm 1, eqs. (5)-(8); earlier version: Zhou et al., "FedIA: A
    Plug-and-Play Importance-Aware Gradient Pruning Aggregation Method for
    Domain-Robust Federated Graph Learning on Node Classification", 2025,
    https://arxiv.org/abs/2509.18171.
  """

  def init_fn(num_clients: int) -> FedIAState:
    num_clients = _check_num_clients(num_clients)
    return FedIAState(
        alpha=jnp.full((num_clients,), 1.0 / num_clients, jnp.float32)
    )

  def update_fn(
      client_updates: ClientUpdates,
      state: FedIAState,
      rho: Any,
      beta: Any,
      base_weights: Any = None,
      participating: Any = None,
  ) -> tuple[Updates, FedIAState, FedIADiagnostics]:
    num_clients = num_clients_of(client_updates)
    alpha_prev = _client_vector("state.alpha", state.alpha, num_clients)
    aggregate, alpha, diagnostics = _aggregate(
        client_updates,
        alpha_prev,
        rho,
        beta,
        base_weights,
        participating,
        use_mask=use_mask,
        use_momentum=use_momentum,
    )
    new_state = FedIAState(alpha=alpha) if use_momentum else state
    return aggregate, new_state, diagnostics

  return Aggregator(init=init_fn, update=update_fn)


def fedavg_aggregator() -> Aggregator:
  """FedAvg behind the :class:`Aggregator` interface (stateless).

  ``init(num_clients) -> EmptyState()``.
  ``update(client_updates, state, rho, beta, base_weights=None,
  participating=None) -> (fedavg(client_updates, base_weights or uniform,
  participating), state, diagnostics)``; ``rho`` and ``beta`` are ignored.
  The diagnostics have FedIA's structure (``mask_coverage`` 1, ``alpha`` the
  effective weights, ``scores``/``softmax`` of the unmasked updates), so a
  simulation can record both aggregators the same way. Identical to
  ``fedia(use_mask=False, use_momentum=False)`` except for the state.

  Returns:
    An :class:`Aggregator`. ``update`` raises ValueError if leaves disagree
    on the leading axis C or ``base_weights``/``participating`` is not [C].

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017.
  """

  def init_fn(num_clients: int) -> EmptyState:
    _check_num_clients(num_clients)
    return EmptyState()

  def update_fn(
      client_updates: ClientUpdates,
      state: EmptyState,
      rho: Any = None,
      beta: Any = None,
      base_weights: Any = None,
      participating: Any = None,
  ) -> tuple[Updates, EmptyState, FedIADiagnostics]:
    del rho, beta  # Unused by FedAvg.
    aggregate, _, diagnostics = _aggregate(
        client_updates,
        None,
        None,
        None,
        base_weights,
        participating,
        use_mask=False,
        use_momentum=False,
    )
    return aggregate, state, diagnostics

  return Aggregator(init=init_fn, update=update_fn)
