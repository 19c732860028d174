"""FedHEAL: per-client sign-consistency masks and fairness weights from update distances.

References:
  Y. Chen, W. Huang and M. Ye, "Fair Federated Learning under Domain Skew
  with Local Consistency and Domain Diversity", CVPR 2024,
  https://arxiv.org/abs/2405.16585; reference code
  https://github.com/yuhangchen0/FedHEAL (``models/fedavgheal.py``,
  ``models/utils/federated_model.py``: ``consistency_mask``,
  ``compute_distance``, ``get_params_diff_weights``,
  ``aggregate_nets_parameter``).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from fedjax_graph.aggregators import base

# The reference code's defaults (main.py): threshold 0.3, beta 0.4.
TAU = base.HParam(default=0.3, low=0.0, high=1.0)
BETA = base.HParam(default=0.4, low=0.0, high=1.0)


class FedHEALState(NamedTuple):
  """Server state of FedHEAL, indexed by client id (fixed shapes: vmappable).

  Attributes:
    positive: pytree shaped like the update with a leading client axis,
      leaves i32[C, ...]: in how many of client ``k``'s rounds its update was
      ``>= 0`` at each coordinate. With ``rounds`` it is the sign-consistency
      history ``h_k = positive_k / rounds_k`` in [0, 1]^D, kept as counts so
      the threshold test is exact.
    rounds: i32[C]. Rounds client ``k`` was aggregated in (its own count).
    delta: f32[C]. ``delta p_k``, the EMA of the normalised distances; 0
      before the client's first round.
    weight: f32[C]. ``p_k``, the fairness weight; renormalised over each
      round's aggregated clients, kept by the others; 0 before the client's
      first round.
  """

  positive: chex.ArrayTree  # i32[C, ...] per leaf
  rounds: jax.Array  # i32[C]
  delta: jax.Array  # f32[C]
  weight: jax.Array  # f32[C]


class FedHEALDiagnostics(NamedTuple):
  """Per-round diagnostics of FedHEAL: the shared fields, then FedHEAL's own.

  Attributes:
    weights: f32[C]. ``q_k = p_k`` of the aggregated clients (they sum to 1);
      0 for non-participants and excluded clients.
    mask_coverage: f32[]. Share of coordinates kept by at least one
      aggregated client (the others are not updated this round).
    excluded: bool[C]. Participants left out for a non-finite update or norm.
    distances: f32[C]. ``d_k = ||u_k * m_k||_2``; 0 for clients not
      aggregated.
    kept: f32[C]. Share of its coordinates client ``k``'s mask keeps; 0 for
      clients not aggregated.
  """

  weights: jax.Array  # f32[C]
  mask_coverage: jax.Array  # f32[]
  excluded: jax.Array  # bool[C]
  distances: jax.Array  # f32[C]
  kept: jax.Array  # f32[C]


@jax.jit
def _fedheal_core(client_updates, state, weights, part, tau, beta):
  del weights  # FedHEAL makes its own client weights.
  active, _ = base.screen(client_updates, part)
  first = state.rounds == 0
  seen = jnp.maximum(state.rounds, 1).astype(jnp.float32)

  def mask_of(u, positive):
    # sign(u) = sign(W - W_k), the reference code's update_diff; 0 counts as >= 0.
    up = u >= 0
    consistent = jnp.where(up, positive, base.rows(state.rounds, positive) - positive)
    keep = consistent.astype(jnp.float32) / base.rows(seen, positive) > tau
    return (base.rows(first, u) | keep) & base.rows(active, u)

  masks = jax.tree.map(mask_of, client_updates, state.positive)
  distances = base.l2_norms(client_updates, active, masks)
  active = active & jnp.isfinite(distances)
  distances = jnp.where(active, distances, 0.0)

  # History: only the aggregated clients' own rows move.
  positive = jax.tree.map(
      lambda u, p: p + (base.rows(active, u) & (u >= 0)).astype(p.dtype),
      client_updates, state.positive)
  rounds = state.rounds + active.astype(state.rounds.dtype)

  # Fairness weights from this round's aggregated clients only.
  total = jnp.sum(distances)
  frac = jnp.where(total > 0, distances / jnp.where(total > 0, total, 1.0), 0.0)
  delta = jnp.where(active, (1.0 - beta) * state.delta + beta * frac, state.delta)
  start = jnp.where(first, 1.0 / jnp.maximum(jnp.sum(active), 1), state.weight)
  q = base.normalise(start + delta, active)
  weight = jnp.where(active, q, state.weight)

  # Per coordinate: omega_k = q_k m_k / sum_j q_j m_j over the clients that
  # keep it; where none does, every masked update is 0 and so is the result.
  def leaf_den(m):
    return jnp.sum(base.rows(q, m) * m.astype(jnp.float32), axis=0)

  den = jax.tree.map(leaf_den, masks)

  def leaf_update(u, m, d):
    x = base.read_rows(u, active) * m.astype(base.acc_dtype(u.dtype))
    num = jnp.sum(base.rows(q, x).astype(x.dtype) * x, axis=0)
    return jnp.where(d > 0, num / jnp.where(d > 0, d, 1.0), 0.0).astype(u.dtype)

  update = jax.tree.map(leaf_update, client_updates, masks, den)
  num_coords = base.num_coordinates(update)
  covered = sum(jnp.count_nonzero(d) for d in jax.tree.leaves(den))
  kept = sum(jnp.sum(m.reshape(m.shape[0], -1), axis=1, dtype=jnp.float32)
             for m in jax.tree.leaves(masks))
  diagnostics = FedHEALDiagnostics(
      weights=q,
      mask_coverage=base.share(covered, num_coords),
      excluded=part & ~active,
      distances=distances,
      kept=jnp.where(active, kept / max(num_coords, 1), 0.0),
  )
  return update, FedHEALState(positive, rounds, delta, weight), diagnostics


def fedheal() -> base.Aggregator:
  """FedHEAL: consistency masks per client, fairness weights, per-coordinate renormalisation.

  One round, for each aggregated client ``k`` (a participant with a finite
  update norm) with ``n_k`` its own earlier rounds:

    1. Mask (the paper's local consistency; ``consistency_mask``): in the
       client's first round ``m_k = 1``; else, with
       ``h_k = positive_k / n_k``, ``c = h_k`` where ``u_k >= 0`` and
       ``1 - h_k`` elsewhere, and ``m_k = 1[c > tau]``. Then
       ``h_k <- (n_k h_k + 1[u_k >= 0]) / (n_k + 1)``.
    2. Distance: ``d_k = ||u_k * m_k||_2`` over the whole model.
    3. Weights (the paper's fair aggregation; ``get_params_diff_weights``):
       ``delta p_k <- (1 - beta) delta p_k + beta d_k / sum_{j in S} d_j``;
       ``p_k <- (p_k + delta p_k) / sum_{j in S} (p_j + delta p_j)``;
       ``q_k = p_k``.
    4. Aggregate (``aggregate_nets_parameter``): per coordinate,
       ``u_d = sum_k omega_{k,d} m_{k,d} u_{k,d}`` with
       ``omega_{k,d} = q_k m_{k,d} / sum_j q_j m_{j,d}``; a coordinate no
       client keeps is not updated (0).

  The server then applies ``W <- W - eta * u``. Descent-convention updates
  ``u_k = (W - W_k) / eta`` have the sign of the reference code's
  ``update_diff = W - W_k``, and ``d_k / sum_j d_j`` does not depend on
  ``eta``, so steps 1-4 are the code's up to that factor.

  Choices where the paper and its code leave room, or the code is wrong:
    * The history's denominator is the client's own participation count,
      not the global round (with which the code's average is wrong for a
      client that skipped rounds, and a client first seen after round 0
      raises KeyError). A client's first round, whenever it comes, starts
      fresh: all-ones mask, ``h_k = 1[u_k >= 0]``. A client that does not
      take part (or is excluded) keeps its whole state.
    * The mask test is strict (``c > tau``), as in the code.
    * ``d_k`` is the Euclidean norm of the whole masked update (the code's
      variable is named ``euclidean_distance`` but adds up the norms of the
      parameter tensors; the two agree for a one-tensor model), computed
      stably.
    * ``sum_j d_j`` runs over this round's aggregated clients; the code also
      adds the stale distances of absent clients, measured against older
      global models.
    * ``p`` is stored renormalised over the round's clients, so old rounds
      fade geometrically; the code stores ``p + delta p`` unnormalised, so
      ``p`` accumulates without decay and the weights freeze into the average
      of every past round.
    * A client's first ``p`` is ``1/|S_t|`` (the code: 1 / the number of
      online clients); its ``delta p`` starts at 0.
    * Where no client keeps a coordinate, the code falls back to the weights
      ``q_k``, which multiply masked updates that are all 0 there: the
      coordinate does not move. That result is computed directly (0, never
      0/0), and ``mask_coverage`` reports the share of coordinates updated.
    * Base ``weights`` are ignored (the code passes its own ``freq``).
    * Every leaf of ``client_updates`` is masked and aggregated: pass only
      trainable parameters (the code also masks batch-norm buffers).

  Returns:
    An :class:`~base.Aggregator` with ``hparams`` ``{tau: 0.3, beta: 0.4}``
    (the code's defaults; both in [0, 1]).

    ``init(num_clients, params) -> FedHEALState``: ``params`` (required) is a
    pytree shaped like one client's update (arrays or
    ``jax.ShapeDtypeStruct``, leaves [...]); counts, ``delta`` and
    ``weight`` start at 0. Raises ValueError if ``params`` is None or
    ``num_clients`` is not an int >= 1.

    ``update(client_updates, state, tau, beta, weights=None,
    participating=None) -> (update, new_state, FedHEALDiagnostics)``,
    ``update`` shaped like one client's pytree (leaves [...], same dtypes).
    Raises ValueError if leaves disagree on C, a per-client argument is not
    [C], ``state`` does not match ``init(C, params)`` for this model, or a
    hyper-parameter is unknown, not a scalar or a Python number out of
    range.

  References:
    Chen, Huang and Ye, "Fair Federated Learning under Domain Skew with Local
    Consistency and Domain Diversity", CVPR 2024,
    https://arxiv.org/abs/2405.16585 (Sec. 3: the consistency mask and the
    fair aggregation weights); code https://github.com/yuhangchen0/FedHEAL.
  """

  def init(num_clients: int, params: base.Updates | None = None) -> FedHEALState:
    num_clients = base.check_num_clients(num_clients)
    if params is None:
      raise ValueError(
          "fedheal keeps a per-client history shaped like the model: call "
          "init(num_clients, params) with params shaped like one client's update."
      )
    zeros = jnp.zeros((num_clients,), jnp.float32)
    return FedHEALState(
        positive=jax.tree.map(
            lambda p: jnp.zeros((num_clients,) + jnp.shape(p), jnp.int32), params),
        rounds=jnp.zeros((num_clients,), jnp.int32),
        delta=zeros,
        weight=zeros,
    )

  return base.make_aggregator("fedheal", {"tau": TAU, "beta": BETA}, init, _fedheal_core)
