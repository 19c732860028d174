"""FedIA: Importance Masking (IM) and Contribution-Aware Momentum (CAM).

Here ``n`` is the number of coordinates of one parameter tensor (one leaf).

References:
  FedIA paper: "Dissecting Federated-Graph Aggregation under Domain Shift:
  Importance-Aware Aggregation via Empirical Analysis" (the version this
  project implements; authors, year and URL not given in its text), Sec. 3.3,
  Algorithm 1, eqs. (5)-(8). An earlier version: Z. Zhou, K. Tam, Z. Wu,
  P. Sun, J. Wang and F. Zhang, "FedIA: A Plug-and-Play Importance-Aware
  Gradient Pruning Aggregation Method for Domain-Robust Federated Graph
  Learning on Node Classification", 2025, https://arxiv.org/abs/2509.18171.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_graph.aggregators import base

RHO = base.HParam(default=0.5, low=0.0, high=1.0, open_low=True)
BETA = base.HParam(default=0.5, low=0.0, high=1.0)


class FedIAState(NamedTuple):
  """Server state of FedIA: the Contribution-Aware Momentum weights.

  Attributes:
    alpha: f32[C]. ``alpha_k^{t}`` of eq. (7), indexed by client id. Starts
      at ``1/C`` (Algorithm 1, line 2). After a round, the aggregated clients'
      entries sum to 1; a non-participant (or excluded client) keeps its
      previous entry.
  """

  alpha: jax.Array  # f32[C]


class FedIADiagnostics(NamedTuple):
  """Per-round diagnostics of FedIA: the shared fields, then FedIA's own.

  Attributes:
    weights: f32[C]. Weights applied: ``alpha`` (with momentum) or the base
      weights renormalised (without), 0 for non-participants and excluded.
    mask_coverage: f32[]. Share of all model coordinates the importance mask
      keeps (1 without a mask).
    excluded: bool[C]. Participants left out for a non-finite update, norm or
      score.
    alpha: f32[C]. With momentum, ``alpha^t`` of eq. (7) (a non-participant's
      entry is its carried ``alpha^{t-1}``); without, equal to ``weights``.
    scores: f32[C]. ``s_k = ||u_k * M||_2`` over the whole model (eq. 6); 0
      for non-participants and excluded clients (so always finite).
    softmax: f32[C]. ``p_k = softmax(s)`` over the aggregated clients
      (eq. 6); 0 for the others.
  """

  weights: jax.Array  # f32[C]
  mask_coverage: jax.Array  # f32[]
  excluded: jax.Array  # bool[C]
  alpha: jax.Array  # f32[C]
  scores: jax.Array  # f32[C]
  softmax: jax.Array  # f32[C]


# ----------------------------------------------------------------------------
# Eq. (5): the importance mask.
# ----------------------------------------------------------------------------


def _leaf_mask(
    leaf: jax.Array, active: jax.Array, num_active: jax.Array, rho: jax.Array
) -> jax.Array:
  """Eq. (5) for one parameter group (one leaf [C, ...])."""
  shape = leaf.shape[1:]
  n = math.prod(shape)
  if n == 0:
    return jnp.zeros(shape, leaf.dtype)
  activity = jnp.abs(base.read_rows(leaf, active))
  importance = jnp.sum(activity.reshape(leaf.shape[0], n), axis=0) / num_active
  # Stable descending sort: among equal importances the lower flat index
  # comes first, so ties go to the lower index.
  order = jnp.argsort(importance, descending=True, stable=True)
  # k = clip(round(rho * n), 1, n), round half to even. k is data (not a
  # shape), so a traced or vmapped rho never retraces.
  k = jnp.clip(jnp.round(rho * n), 1, n).astype(jnp.int32)
  keep_in_order = jnp.arange(n, dtype=jnp.int32) < k
  flat = jnp.zeros((n,), dtype=bool).at[order].set(keep_in_order)
  return flat.reshape(shape).astype(leaf.dtype)


def _importance_mask_impl(
    client_updates: base.ClientUpdates, rho: jax.Array, active: jax.Array
) -> base.Updates:
  num_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
  return jax.tree.map(lambda leaf: _leaf_mask(leaf, active, num_active, rho), client_updates)


_importance_mask_core = jax.jit(_importance_mask_impl)


def importance_mask(
    client_updates: base.ClientUpdates,
    rho: Any,
    participating: Any = None,
) -> base.Updates:
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
  num_clients = base.num_clients_of(client_updates)
  base.check_hparam("rho", RHO, rho)
  part = base.participation(participating, num_clients)
  return _importance_mask_core(client_updates, base.as_float(rho), part)


# ----------------------------------------------------------------------------
# Eqs. (6)-(7): contribution scores and momentum.
# ----------------------------------------------------------------------------


def _softmax(scores: jax.Array, active: jax.Array) -> jax.Array:
  """``exp(s_k) / sum_j exp(s_j)`` over active clients; 0 for the others.

  The active maximum is subtracted first, so scores 1e4 apart give finite
  weights (a one-hot up to underflow); inactive scores (possibly NaN) are
  never read.
  """
  top = jnp.max(jnp.where(active, scores, -jnp.inf))
  top = jnp.where(jnp.any(active), top, 0.0)
  e = jnp.where(active, jnp.exp(jnp.where(active, scores, top) - top), 0.0)
  total = jnp.sum(e)  # >= 1 whenever a client is active.
  return e / jnp.where(total > 0, total, 1.0)


def _scores(
    client_updates: base.ClientUpdates, mask: base.Updates | None, active: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Scores (eq. 6), the clients still active (finite score) and their softmax."""
  scores = base.l2_norms(client_updates, active, mask)
  active = active & jnp.isfinite(scores)
  return scores, active, _softmax(scores, active)


def _momentum_step(
    alpha_prev: jax.Array, softmax: jax.Array, beta: jax.Array, active: jax.Array
) -> jax.Array:
  """Eq. (7): EMA of the softmax, renormalised over active clients."""
  tilde = beta * alpha_prev.astype(jnp.float32) + (1.0 - beta) * softmax
  return jnp.where(active, base.normalise(tilde, active), alpha_prev.astype(jnp.float32))


def contribution_scores(
    client_updates: base.ClientUpdates,
    mask: base.Updates | None = None,
    participating: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Contribution scores and their softmax, eq. (6); Algorithm 1, 9-10.

  ``s_k = ||u_k * M||_2`` over the whole model (all leaves together,
  computed stably: see :func:`~base.l2_norms`) and
  ``p_k = exp(s_k) / sum_j exp(s_j)`` over the participants with a finite
  score. A participant whose score is not finite (its update holds Inf/NaN,
  or its norm exceeds float32) gets ``p_k = 0`` instead of turning every
  ``p`` into NaN.

  Args:
    client_updates: pytree, every leaf float[C, ...].
    mask: optional pytree shaped like one client's update (leaves [...],
      values in {0, 1}), e.g. from :func:`importance_mask`; None means no
      mask.
    participating: optional bool[C]; default all True.

  Returns:
    ``(scores, softmax)``, both f32[C]; non-participants get 0 in both (a
    participant's non-finite score is returned as it is, with softmax 0).
    With no participant both are all zeros.

  Raises:
    ValueError: if leaves disagree on the leading axis C or
      ``participating`` is not [C].
  """
  num_clients = base.num_clients_of(client_updates)
  part = base.participation(participating, num_clients)
  scores, _, softmax = _scores_core(client_updates, mask, part)
  return scores, softmax


_scores_core = jax.jit(_scores)


def contribution_weights(
    client_updates: base.ClientUpdates,
    mask: base.Updates | None,
    alpha_prev: Any,
    beta: Any,
    participating: Any = None,
) -> jax.Array:
  """Contribution-Aware Momentum (CAM) weights, eqs. (6)-(7).

  ``s`` and ``p`` are as in :func:`contribution_scores`; then
  ``alpha~_k = beta * alpha_prev_k + (1 - beta) * p_k`` and, for the
  participants with a finite score, ``alpha_k = alpha~_k / sum_j alpha~_j``.

  Semantics under partial participation (as eq. 7 reads): the aggregated
  clients' ``alpha`` sum to 1 (they share the whole aggregate between them);
  a non-participant, or a participant with a non-finite score, keeps
  ``alpha_prev_k`` unchanged as its memory and has weight 0 in the aggregate.
  Hence ``sum(alpha)`` over all C clients is ``1 + sum_{k not aggregated}
  alpha_prev_k``, not 1. If the aggregated clients' ``alpha~`` sum to 0 (only
  possible with ``beta = 1`` and their ``alpha_prev`` all 0), their ``alpha``
  are 0 (no NaN).

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
  num_clients = base.num_clients_of(client_updates)
  base.check_hparam("beta", BETA, beta)
  part = base.participation(participating, num_clients)
  alpha_prev = base.client_vector("alpha_prev", alpha_prev, num_clients)
  return _contribution_weights_core(client_updates, mask, alpha_prev, base.as_float(beta), part)


@jax.jit
def _contribution_weights_core(client_updates, mask, alpha_prev, beta, part):
  _, active, softmax = _scores(client_updates, mask, part)
  return _momentum_step(alpha_prev, softmax, beta, active)


# ----------------------------------------------------------------------------
# The aggregator.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("use_mask", "use_momentum"))
def _fedia_core(
    client_updates: base.ClientUpdates,
    state: FedIAState,
    weights: jax.Array,
    part: jax.Array,
    rho: jax.Array | None = None,
    beta: jax.Array | None = None,
    leaf_weights: base.ClientUpdates | None = None,
    *,
    use_mask: bool,
    use_momentum: bool,
) -> tuple[base.Updates, FedIAState, FedIADiagnostics]:
  # Screen on the unmasked norm first: a non-finite client must not steer the
  # mask of everyone else; its masked score is then finite too (<= the norm).
  active, norms = base.screen(client_updates, part)
  if use_mask:
    mask = _importance_mask_impl(client_updates, rho, active)
    kept = sum(jnp.sum(m, dtype=jnp.float32) for m in jax.tree.leaves(mask))
    coverage = base.share(kept, base.num_coordinates(mask))
    scores, active, softmax = _scores(client_updates, mask, active)
  else:
    mask = None
    coverage = jnp.ones((), jnp.float32)
    scores, softmax = norms, _softmax(norms, active)

  if use_momentum:
    alpha = _momentum_step(state.alpha, softmax, beta, active)
    coeff = jnp.where(active, alpha, 0.0)
    new_state = FedIAState(alpha=alpha)
  else:
    coeff = alpha = base.normalise(weights, active)
    new_state = state

  # A method's per-tensor weights (FedSPA's HBDA) multiply alpha (or the base
  # weights) tensor by tensor; the momentum state stays FedIA's own alpha.
  coeff = base.leaf_coefficients(coeff, leaf_weights, active)
  diagnostics = FedIADiagnostics(
      weights=base.applied_weights(coeff, client_updates),
      mask_coverage=coverage,
      excluded=part & ~active,
      alpha=alpha,
      scores=jnp.where(active, scores, 0.0),
      softmax=softmax,
  )
  return base.weighted_sum(client_updates, coeff, active, mask), new_state, diagnostics


def fedia(use_mask: bool = True, use_momentum: bool = True) -> base.Aggregator:
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

  A participant whose update has a non-finite L2 norm (an Inf/NaN entry, or
  a norm beyond float32) is excluded before step 1, and one whose masked
  score is not finite before step 2: it is treated as absent (weight 0,
  alpha kept) and reported in ``diagnostics.excluded``. Norms are computed
  stably, so a finite update as large as 3e19 still gets a finite score.

  Ablations (static switches, fixed when the aggregator is built; registry
  names ``fedia_im`` and ``fedia_cam``):
    * ``use_momentum=False`` (IM only): the client weights are the base
      ``weights`` renormalised over participants (uniform if None, e.g.
      train-node counts for count weighting) instead of ``alpha``; the state
      is passed through unchanged and ``beta`` is not a hyper-parameter. The
      aggregate equals ``fedavg(u * M, weights, participating)``.
    * ``use_mask=False`` (CAM only): ``M`` is all ones; ``rho`` is not a
      hyper-parameter.
    * Both off: FedAvg with FedIA's diagnostics; no hyper-parameter.

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
    An :class:`~base.Aggregator`; ``hparams`` is ``{rho: 0.5, beta: 0.5}``
    (those in use):

    ``init(num_clients, params=None) -> FedIAState(alpha=f32[C] all 1/C)``;
    raises ValueError unless ``num_clients`` is an int >= 1.

    ``update(client_updates, state, rho, beta, weights=None,
    participating=None) -> (aggregated_update, new_state, diagnostics)``:

      * ``client_updates``: pytree, every leaf float[C, ...], descent
        convention.
      * ``state``: :class:`FedIAState`, ``alpha`` f32[C].
      * ``rho``: retention ratio, scalar in (0, 1] (Python float or traced
        scalar array; vmappable); positional or by name.
      * ``beta``: momentum factor, scalar in [0, 1] (idem).
      * ``weights``: optional float[C], used only without momentum; uniform
        if None. Full FedIA ignores it (Algorithm 1 starts from
        ``alpha^0 = 1/C``).
      * ``participating``: optional bool[C]; default all True.
      * ``leaf_weights``: optional pytree shaped like the updates, leaves
        f32[C] (see ``base``): tensor ``l`` is aggregated with
        ``alpha * leaf_weights[l]`` (without momentum: base weights times
        it) renormalised over the aggregated clients; the mask, the scores
        and the alpha state are unchanged. ``diagnostics.weights`` are then
        the coordinate-weighted mean of the per-tensor weights.
      * Returns ``aggregated_update`` shaped like one client's pytree
        (leaves [...], same dtypes), ``new_state`` (:class:`FedIAState`)
        and :class:`FedIADiagnostics`.
      * Raises ValueError if leaves disagree on the leading axis C; a
        per-client argument or ``state.alpha`` is not [C]; a hyper-parameter
        is unknown, not a scalar, or a Python number out of range.

  References:
    FedIA paper, "Dissecting Federated-Graph Aggregation under Domain Shift:
    Importance-Aware Aggregation via Empirical Analysis", Sec. 3.3,
    Algorithm 1, eqs. (5)-(8); earlier version: Zhou et al., "FedIA: A
    Plug-and-Play Importance-Aware Gradient Pruning Aggregation Method for
    Domain-Robust Federated Graph Learning on Node Classification", 2025,
    https://arxiv.org/abs/2509.18171.
  """
  # Only the hyper-parameters in use: an ablation given the other one is an error.
  specs = {"rho": RHO} if use_mask else {}
  if use_momentum:
    specs["beta"] = BETA

  def init(num_clients: int, params: base.Updates | None = None) -> FedIAState:
    del params  # alpha is per client only.
    num_clients = base.check_num_clients(num_clients)
    return FedIAState(alpha=jnp.full((num_clients,), 1.0 / num_clients, jnp.float32))

  name = {(True, True): "fedia", (True, False): "fedia_im", (False, True): "fedia_cam"}.get(
      (use_mask, use_momentum), "fedia(use_mask=False, use_momentum=False)")
  core = functools.partial(_fedia_core, use_mask=use_mask, use_momentum=use_momentum)
  return base.make_aggregator(name, specs, init, core, per_leaf=True)
