"""Update-field diagnostics: the aggregation-compatibility analysis of Sec. 3.2.

This module reproduces the measurements behind Findings 1-3 and the signal
dilution argument of the FedIA paper (Sec. 3.2, eqs. 2-4, Figures 2-5):

  * Salient-update overlap (Finding 1, eq. 2, Fig. 2): the top-p % coordinates
    ``S_k`` of ``|u_k|`` per client and their pairwise Jaccard overlap
    (the paper's "Gradient Support Intersection", GSI), against the
    random-set reference ``p / (2 - p)``.
  * Directional alignment (Finding 2, Figs. 3-4): pairwise signed cosine
    between client updates, the share of negative cross-domain pairs, the
    distribution of ``|cos|`` and each client's cosine with the ordinary
    (FedAvg) aggregate.
  * Signal dilution (eqs. 3-4): per coordinate the active share ``r_d``, the
    active-client mean ``mu_act,d`` and the ratio ``u_bar_d / mu_act,d``,
    summarised as per-layer histograms.
  * Domain discrepancies (Finding 3, Fig. 5): homophily gap, feature-mean
    distance, label Jensen-Shannon divergence and degree-histogram distance
    between domains, and their Spearman association with each client's
    salient-coordinate retention after aggregation.

Two halves:
  * Jittable (JAX) functions over stacked client updates: a pytree whose every
    leaf is ``[C, ...]``, in the descent convention of the paper (Sec. 3.1;
    see ``fedjax_graph/aggregators.py``). ``top`` (the paper's ``p``, as a
    fraction) is a static Python float. Nothing loops over clients in Python,
    so :func:`round_diagnostics` runs inside the jitted round, under ``vmap``
    over grid cells and seeds and inside ``lax.cond``.
  * Host-side (NumPy / SciPy / networkx) functions that summarise the stored
    matrices after a run and compute the per-dataset domain factors once.

Shapes use the project's legend (``fedjax_graph/types.py``): ``C`` clients,
``D`` domains, ``N`` nodes, ``F`` features, ``K`` classes, ``B`` histogram
bins (here, not size buckets), plus, in this module only, ``P`` the total
number of model coordinates of one client (all leaves together), ``L`` the
number of parameter leaves ("layers") and ``R`` runs or recorded rounds.

Conventions fixed here (the paper leaves them open):
  * Salient sets are taken over the whole model (all leaves concatenated),
    as eq. (2) reads ``top-p% of |u_k|``; per-layer views only split the
    resulting per-coordinate quantities by leaf.
  * ``k = max(1, round(top * P))`` coordinates per client, Python's
    round-half-to-even (the same rule as ``aggregators.importance_mask``);
    ties in ``|u|`` go to the lower flat index (``jax.lax.top_k``).
  * Client weights ``q`` are the given weights normalised to sum 1 (all 0 if
    they sum to 0). A client with ``q_k = 0`` (absent, or with a non-finite
    update) is never read into the aggregate, ``r_d``, ``mu_act`` or the
    dilution ratio, so a NaN in its row cannot leak there; its own rows of
    the pairwise matrices are still computed from its update.

References:
  FedIA paper: "Dissecting Federated-Graph Aggregation under Domain Shift:
  Importance-Aware Aggregation via Empirical Analysis", Sec. 3.2, eqs. (2)-(4),
  Figures 2-5 (the version this project implements). Earlier version: Z. Zhou
  et al., https://arxiv.org/abs/2509.18171.

  J. Lin, "Divergence measures based on the Shannon entropy", IEEE Trans.
  Inf. Theory 37(1), 1991 (Jensen-Shannon divergence).

  J. Zhu et al., "Beyond Homophily in Graph Neural Networks: Current
  Limitations and Effective Designs", NeurIPS 2020 (edge homophily ratio).
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_graph.aggregators import num_clients_of

# scipy.stats, scipy.spatial and networkx are imported inside the host-side
# functions: the jitted simulation imports this module and never needs them.

ClientUpdates = Any  # Pytree, every leaf [C, ...].

# Default histogram edges of round_diagnostics: 10 bins of r_d over [0, 1] and
# 12 bins of width 0.25 of the dilution ratio over [-1, 2] (eq. 4 predicts
# r_d in (0, 1]; the margins show reinforcement (> 1) and cancellation (< 0)).
ACTIVE_SHARE_EDGES = np.linspace(0.0, 1.0, 11)
DILUTION_EDGES = np.linspace(-1.0, 2.0, 13)

# Float sums of the weights put r_d = j/C up to a few ulps off an edge it
# equals in exact arithmetic; values this far (relative to the narrowest bin)
# below an edge count in the bin above, as their exact value would.
_EDGE_TOLERANCE = 1e-4


# ----------------------------------------------------------------------------
# Static (trace-time) checks.
# ----------------------------------------------------------------------------



def _check_top(top: Any) -> float:
  """``top`` as a Python float in (0, 1]; it sets a shape, so it is static."""
  if isinstance(top, jax.Array) or not isinstance(top, numbers.Real):
    raise TypeError(
        f"top must be a static Python float (it fixes k), got {type(top)}."
    )
  top = float(top)
  if not 0.0 < top <= 1.0:
    raise ValueError(f"top = {top!r}; must be in (0, 1]")
  return top


def _check_matrix(name: str, x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim != 2:
    raise ValueError(f"{name} must be 2-D [C, P], got shape {x.shape}.")
  return x


def _check_vector(name: str, x: Any, size: int) -> jax.Array:
  x = jnp.asarray(x)
  if x.shape != (size,):
    raise ValueError(f"{name} must have shape ({size},), got {x.shape}.")
  return x


def salient_count(num_coords: int, top: float) -> int:
  """The static size ``k = clip(max(1, round(top * P)), 0, P)`` of a set S_k.

  Args:
    num_coords: P, the number of coordinates.
    top: the salient fraction ``p`` in (0, 1] (Python float).

  Returns:
    k as a Python int (round half to even, at least 1, at most P).
  """
  return min(num_coords, max(1, round(_check_top(top) * num_coords)))


# ----------------------------------------------------------------------------
# Flattening.
# ----------------------------------------------------------------------------


def leaf_sizes(client_updates: ClientUpdates) -> tuple[int, ...]:
  """Coordinates per client of each leaf, in ``jax.tree.leaves`` order.

  Args:
    client_updates: pytree, every leaf [C, ...].

  Returns:
    A static tuple of L Python ints; they sum to P and split the columns of
    :func:`flatten_clients` leaf by leaf.
  """
  num_clients_of(client_updates)
  return tuple(
      int(math.prod(jnp.shape(leaf)[1:]))
      for leaf in jax.tree.leaves(client_updates)
  )


def flatten_clients(client_updates: ClientUpdates) -> jax.Array:
  """Concatenates each client's leaves into one row.

  Args:
    client_updates: pytree, every leaf float[C, ...].

  Returns:
    f32[C, P]: row k is client k's whole update, leaves in
    ``jax.tree.leaves`` order, each flattened row-major.

  Raises:
    ValueError: if there are no leaves or they disagree on C.
  """
  num_clients = num_clients_of(client_updates)
  return jnp.concatenate(
      [
          jnp.reshape(leaf, (num_clients, -1)).astype(jnp.float32)
          for leaf in jax.tree.leaves(client_updates)
      ],
      axis=1,
  )


# ----------------------------------------------------------------------------
# Finding 1: salient-update overlap (eq. 2).
# ----------------------------------------------------------------------------


def salient_mask(flat: jax.Array, top: float) -> jax.Array:
  """Salient sets S_k: per row the top-p % coordinates of ``|u_k|`` (eq. 2).

  Args:
    flat: f32[C, P] client updates (e.g. from :func:`flatten_clients`).
    top: the fraction ``p`` in (0, 1], a static Python float (5 % in the
      paper: ``top=0.05``).

  Returns:
    bool[C, P] with exactly ``k = salient_count(P, top)`` True entries per
    row, at the k largest ``|values|`` of that row; ties go to the lower
    index.

  Raises:
    ValueError: if ``flat`` is not 2-D, P is 0, or ``top`` is outside (0, 1].
  """
  flat = _check_matrix("flat", flat)
  num_coords = flat.shape[1]
  if num_coords == 0:
    raise ValueError("flat has no coordinates (P = 0).")
  return _salient_mask_core(flat, salient_count(num_coords, top))


@functools.partial(jax.jit, static_argnums=1)
def _salient_mask_core(flat: jax.Array, k: int) -> jax.Array:
  # top_k gives exactly k indices (a threshold on |u| would keep every tie).
  _, index = jax.lax.top_k(jnp.abs(flat), k)
  rows = jnp.arange(flat.shape[0])[:, None]
  return jnp.zeros(flat.shape, dtype=bool).at[rows, index].set(True)


def _count_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  # HIGHEST keeps f32 accumulation on accelerators (no TF32/bf16 passes);
  # 0/1 products summed in f32 are exact up to 2**24 coordinates.
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def jaccard(masks: jax.Array) -> jax.Array:
  """Pairwise Jaccard overlap ``|S_i ∩ S_j| / |S_i ∪ S_j|`` (eq. 2, GSI).

  Args:
    masks: bool[C, P], row k the set S_k (e.g. from :func:`salient_mask`).

  Returns:
    f32[C, C], symmetric, in [0, 1]. The diagonal is 1 (a set overlaps
    itself fully, even an empty one); off the diagonal two empty sets give
    0 (0/0 -> 0), never NaN.
  """
  return _jaccard_core(_check_matrix("masks", masks))


@jax.jit
def _jaccard_core(masks: jax.Array) -> jax.Array:
  m = masks.astype(jnp.float32)
  inter = _count_matmul(m, m.T)
  size = jnp.sum(m, axis=1)
  union = size[:, None] + size[None, :] - inter
  overlap = jnp.where(union > 0, inter / jnp.where(union > 0, union, 1.0), 0.0)
  return jnp.where(jnp.eye(masks.shape[0], dtype=bool), 1.0, overlap)


def random_overlap_reference(top: float) -> float:
  """Expected Jaccard overlap of two independent random top-p sets.

  For two uniformly random k-subsets of P coordinates with ``k = p P``,
  ``E|S_i ∩ S_j| ≈ k^2 / P = p k`` and
  ``|S_i ∪ S_j| = 2k - |S_i ∩ S_j|``, so the overlap is ``p / (2 - p)``
  (Sec. 3.2: 0.026 at p = 5 %).

  Args:
    top: the fraction ``p`` in (0, 1].

  Returns:
    ``p / (2 - p)`` as a Python float.
  """
  top = _check_top(top)
  return top / (2.0 - top)


# ----------------------------------------------------------------------------
# Finding 2: directional alignment (Figs. 3-4).
# ----------------------------------------------------------------------------


def _unit_rows(x: jax.Array) -> jax.Array:
  """Rows scaled to unit L2 norm; a zero row stays 0."""
  # Dividing by the max |x| first keeps sum(x^2) finite for large updates.
  scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  y = x / jnp.where(scale > 0, scale, 1.0)
  norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=-1, keepdims=True))
  return jnp.where(norm > 0, y / jnp.where(norm > 0, norm, 1.0), 0.0)


def cosine_matrix(flat: jax.Array) -> jax.Array:
  """Pairwise signed cosine ``cos(u_i, u_j)`` between client updates (Fig. 4).

  Args:
    flat: f32[C, P] client updates.

  Returns:
    f32[C, C], symmetric, clipped to [-1, 1]. A row of a zero update is all
    0 (its diagonal entry too), never NaN.
  """
  return _cosine_core(_check_matrix("flat", flat))


@jax.jit
def _cosine_core(flat: jax.Array) -> jax.Array:
  unit = _unit_rows(flat.astype(jnp.float32))
  return jnp.clip(_count_matmul(unit, unit.T), -1.0, 1.0)


def cosine_to(flat: jax.Array, ref: jax.Array) -> jax.Array:
  """Each client's cosine with one reference vector, e.g. ``cos(u_k, u_bar)``.

  Args:
    flat: f32[C, P] client updates.
    ref: f32[P] reference (Fig. 4 uses the FedAvg aggregate ``u_bar``).

  Returns:
    f32[C] in [-1, 1]; 0 where ``u_k`` or ``ref`` is the zero vector.
  """
  flat = _check_matrix("flat", flat)
  return _cosine_to_core(flat, _check_vector("ref", ref, flat.shape[1]))


@jax.jit
def _cosine_to_core(flat: jax.Array, ref: jax.Array) -> jax.Array:
  flat, ref = flat.astype(jnp.float32), ref.astype(jnp.float32)
  # Elementwise multiply-and-sum, not a matmul: no reduced-precision passes.
  dots = jnp.sum(_unit_rows(flat) * _unit_rows(ref[None, :]), axis=1)
  return jnp.clip(dots, -1.0, 1.0)


# ----------------------------------------------------------------------------
# Signal dilution (eqs. 3-4).
# ----------------------------------------------------------------------------


def _normalised_weights(weights: jax.Array) -> jax.Array:
  """``q = w / sum(w)`` as f32[C]; all 0 if the weights sum to 0."""
  w = weights.astype(jnp.float32)
  total = jnp.sum(w)
  return jnp.where(total != 0, w / jnp.where(total != 0, total, 1.0), 0.0)


_normalised_weights_core = jax.jit(_normalised_weights)


def _weighted_rows(flat: jax.Array, q: jax.Array,
                   keep: jax.Array | None = None) -> jax.Array:
  """``q_k u_kd`` as f32[C, P], 0 where ``q_k = 0`` or ``keep`` is False.

  ``where`` rather than a product, so a NaN row with no weight is never read.
  """
  read = (q != 0)[:, None]
  if keep is not None:
    read = read & keep
  return jnp.where(read, q[:, None] * flat, 0.0)


def _weighted_mean(flat: jax.Array, q: jax.Array) -> jax.Array:
  """``u_bar = sum_k q_k u_k``, f32[P] (eq. 4, left)."""
  return jnp.sum(_weighted_rows(flat, q), axis=0)


@jax.jit
def _dilution_parts(flat, masks, q):
  """r_d, mu_act,d and u_bar_d of eqs. (3)-(4), each f32[P]."""
  r = jnp.sum(jnp.where(masks, q[:, None], 0.0), axis=0)
  active_sum = jnp.sum(_weighted_rows(flat, q, masks), axis=0)
  mu = jnp.where(r != 0, active_sum / jnp.where(r != 0, r, 1.0), 0.0)
  return r, mu, _weighted_mean(flat, q)


def _dilution_checks(flat, masks, weights):
  flat = _check_matrix("flat", flat).astype(jnp.float32)
  masks = _check_matrix("masks", masks)
  if masks.shape != flat.shape:
    raise ValueError(
        f"masks {masks.shape} and flat {flat.shape} must have the same shape."
    )
  weights = _check_vector("weights", weights, flat.shape[0])
  return flat, masks.astype(bool), _normalised_weights_core(weights)


def active_share(masks: jax.Array, weights: jax.Array) -> jax.Array:
  """Active share ``r_d = sum_{k in A_d} q_k`` (eq. 3).

  ``A_d`` is the set of clients for which coordinate d is salient
  (``masks[k, d]``) and ``q`` the weights normalised to sum 1.

  Args:
    masks: bool[C, P] salient sets.
    weights: f32[C] non-negative base weights (e.g. train-node counts; 0 for
      an absent client). Not range-checked (they may be traced).

  Returns:
    f32[P] in [0, 1] (up to rounding); all 0 if the weights sum to 0.
  """
  masks = _check_matrix("masks", masks).astype(bool)
  return _active_share_core(
      masks, _check_vector("weights", weights, masks.shape[0]))


@jax.jit
def _active_share_core(masks: jax.Array, weights: jax.Array) -> jax.Array:
  q = _normalised_weights(weights)
  return jnp.sum(jnp.where(masks, q[:, None], 0.0), axis=0)


def active_mean(flat: jax.Array, masks: jax.Array,
                weights: jax.Array) -> jax.Array:
  """Active-client mean ``mu_act,d = (1/r_d) sum_{k in A_d} q_k u_kd`` (eq. 3).

  Args:
    flat: f32[C, P] client updates.
    masks: bool[C, P] salient sets (A_d is column d).
    weights: f32[C] base weights (normalised to q inside).

  Returns:
    f32[P]; 0 where ``r_d = 0`` (no weighted client finds d salient).
  """
  flat, masks, q = _dilution_checks(flat, masks, weights)
  return _dilution_parts(flat, masks, q)[1]


def dilution_ratio(flat: jax.Array, masks: jax.Array,
                   weights: jax.Array) -> jax.Array:
  """Ratio of the averaged update to the active-client mean (eq. 4).

  ``u_bar_d / mu_act,d`` with ``u_bar = sum_k q_k u_k`` (the FedAvg
  aggregate). Eq. (4) predicts ``≈ r_d`` when non-salient clients are near 0
  on d: the aggregate is diluted by the active mass. Values above ``r_d``
  (or above 1) mean the other clients reinforce the active mean; below 0,
  they overturn it.

  Args:
    flat: f32[C, P] client updates.
    masks: bool[C, P] salient sets.
    weights: f32[C] base weights (normalised to q inside).

  Returns:
    f32[P], NaN-free for finite inputs: 0 where ``mu_act,d = 0`` (no active
    client, or the active updates cancel exactly). Such coordinates carry no
    ratio; :func:`round_diagnostics` excludes them from ``dilution_hist``
    (pass ``valid=active_mean(...) != 0`` to :func:`layer_histograms`).
  """
  flat, masks, q = _dilution_checks(flat, masks, weights)
  _, mu, u_bar = _dilution_parts(flat, masks, q)
  return _safe_ratio(u_bar, mu)


@jax.jit
def _safe_ratio(u_bar: jax.Array, mu: jax.Array) -> jax.Array:
  return jnp.where(mu != 0, u_bar / jnp.where(mu != 0, mu, 1.0), 0.0)


def layer_histograms(values: jax.Array, sizes: Sequence[int],
                     edges: Any, valid: jax.Array | None = None) -> jax.Array:
  """Per-leaf histogram counts of a per-coordinate quantity.

  Bins are ``[e_b, e_{b+1})``, the last one closed, as ``np.histogram``.
  Values outside the edges are clipped into the end bins (below ``e_0``
  counts in bin 0, above ``e_B`` in bin B-1), so every counted coordinate
  appears and each row sums to its leaf's number of counted coordinates.
  A value within ``1e-4`` of the narrowest bin width below an edge counts in
  the bin above, so float rounding of, e.g., ``r_d = 3/10`` cannot move it
  down a bin. NaN values and coordinates with ``valid`` False are not
  counted.

  Args:
    values: f32[P] per-coordinate values (e.g. r_d or the dilution ratio).
    sizes: static per-leaf coordinate counts (from :func:`leaf_sizes`),
      summing to P.
    edges: static array-like [B+1], strictly increasing bin edges, e.g.
      ``np.linspace(0, 1, 11)`` for r_d.
    valid: optional bool[P]; False drops a coordinate from the counts.

  Returns:
    f32[L, B] counts, row l for leaf l.

  Raises:
    ValueError: if ``sizes`` does not sum to P or ``edges`` is not a
      strictly increasing 1-D array of at least 2 entries.
  """
  values = jnp.asarray(values)
  sizes = tuple(int(s) for s in sizes)
  if values.ndim != 1 or values.shape[0] != sum(sizes):
    raise ValueError(
        f"values must be 1-D of length sum(sizes)={sum(sizes)}, got shape "
        f"{values.shape}."
    )
  edges = np.asarray(edges, dtype=np.float64)
  if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
    raise ValueError(
        f"edges must be strictly increasing, 1-D, >= 2 entries; got {edges}."
    )
  if valid is not None:
    valid = _check_vector("valid", valid, values.shape[0])
  shifted = edges - _EDGE_TOLERANCE * np.min(np.diff(edges))
  return _histograms_core(values, valid, sizes,
                          tuple(float(e) for e in shifted))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _histograms_core(values: jax.Array, valid: jax.Array | None,
                     sizes: tuple[int, ...],
                     shifted: tuple[float, ...]) -> jax.Array:
  num_bins = len(shifted) - 1
  # searchsorted(side="right") by counting passed edges: with a dozen edges a
  # fused compare-and-sum is cheaper to compile and run than a binary search.
  passed = values.astype(jnp.float32)[:, None] >= jnp.asarray(
      shifted, jnp.float32)[None, :]
  bins = jnp.clip(jnp.sum(passed, axis=1) - 1, 0, num_bins - 1)
  counted = ~jnp.isnan(values)
  if valid is not None:
    counted = counted & valid.astype(bool)
  counted = counted.astype(jnp.float32)
  rows, start = [], 0
  for size in sizes:  # A static loop over leaves, never over clients.
    rows.append(jnp.bincount(bins[start:start + size],
                             weights=counted[start:start + size],
                             length=num_bins))
    start += size
  return jnp.stack(rows).astype(jnp.float32)


# ----------------------------------------------------------------------------
# Retention (Fig. 5).
# ----------------------------------------------------------------------------


def retention(masks: jax.Array, aggregate_mask: jax.Array) -> jax.Array:
  """Share of each client's salient set kept salient by the aggregate.

  ``|S_k ∩ S_agg| / |S_k|`` with ``S_agg`` the top-p % of the aggregate's
  ``|values|`` (Fig. 5's salient-coordinate retention).

  Args:
    masks: bool[C, P] client salient sets.
    aggregate_mask: bool[P] the aggregate's salient set.

  Returns:
    f32[C] in [0, 1]; 0 for an empty ``S_k``.
  """
  masks = _check_matrix("masks", masks).astype(bool)
  aggregate_mask = _check_vector("aggregate_mask", aggregate_mask,
                                 masks.shape[1]).astype(bool)
  return _retention_core(masks, aggregate_mask)


@jax.jit
def _retention_core(masks: jax.Array, aggregate_mask: jax.Array) -> jax.Array:
  kept = jnp.sum(masks & aggregate_mask[None, :], axis=1).astype(jnp.float32)
  size = jnp.sum(masks, axis=1).astype(jnp.float32)
  return jnp.where(size > 0, kept / jnp.where(size > 0, size, 1.0), 0.0)


# ----------------------------------------------------------------------------
# One round, bundled.
# ----------------------------------------------------------------------------


class RoundDiagnostics(NamedTuple):
  """The per-round diagnostics of :func:`round_diagnostics`.

  Leaves gain leading axes under ``vmap`` (e.g. ``[S, G', T]`` in a sweep).

  Attributes:
    jaccard: f32[C, C] salient-set overlap, eq. (2) (Fig. 2).
    cosine: f32[C, C] pairwise signed cosine of the updates (Figs. 3-4).
    cos_to_aggregate: f32[C] ``cos(u_k, u_bar)`` with the FedAvg aggregate
      (Fig. 4).
    retention: f32[C] share of S_k also salient in the FedAvg aggregate
      (Fig. 5).
    active_share_hist: f32[L, 10] per-leaf counts of ``r_d`` (eq. 3) over
      ``ACTIVE_SHARE_EDGES`` (10 bins on [0, 1]); every coordinate counted.
    dilution_hist: f32[L, 12] per-leaf counts of ``u_bar_d / mu_act,d``
      (eq. 4) over ``DILUTION_EDGES`` (12 bins on [-1, 2], end bins open);
      coordinates with ``mu_act,d = 0`` are excluded, so leaf l counts
      ``sizes[l] - dilution_hist[l].sum()`` excluded coordinates.
  """

  jaccard: jax.Array
  cosine: jax.Array
  cos_to_aggregate: jax.Array
  retention: jax.Array
  active_share_hist: jax.Array
  dilution_hist: jax.Array


def round_diagnostics(client_updates: ClientUpdates, weights: jax.Array,
                      top: float = 0.05) -> RoundDiagnostics:
  """All per-round update-field diagnostics of Sec. 3.2 for one round.

  Pure and jittable; ``top`` is static (close over it, or mark it static
  under ``jax.jit``). Works under ``vmap`` and inside ``lax.cond``.

  Args:
    client_updates: pytree, every leaf float[C, ...], descent convention.
    weights: f32[C] FedAvg base weights (e.g. train-node counts); give an
      absent or non-finite client weight 0, so it stays out of the
      aggregate, ``r_d`` and the dilution ratio.
    top: the salient fraction ``p`` in (0, 1] (static; 0.05 in the paper).

  Returns:
    A :class:`RoundDiagnostics`. The aggregate is FedAvg's weighted mean
    ``u_bar = sum_k q_k u_k``; its salient set (same ``top``) defines
    retention.

  Raises:
    ValueError / TypeError: on inconsistent shapes or a non-static or
      out-of-range ``top``.
  """
  weights = _check_vector("weights", weights, num_clients_of(client_updates))
  return _round_core(client_updates, weights, _check_top(top))


@functools.partial(jax.jit, static_argnums=2)
def _round_core(client_updates: ClientUpdates, weights: jax.Array,
                top: float) -> RoundDiagnostics:
  flat = flatten_clients(client_updates)
  sizes = leaf_sizes(client_updates)
  q = _normalised_weights(weights)
  masks = salient_mask(flat, top)
  r, mu, u_bar = _dilution_parts(flat, masks, q)
  aggregate_mask = salient_mask(u_bar[None, :], top)[0]
  return RoundDiagnostics(
      jaccard=jaccard(masks),
      cosine=cosine_matrix(flat),
      cos_to_aggregate=cosine_to(flat, u_bar),
      retention=retention(masks, aggregate_mask),
      active_share_hist=layer_histograms(r, sizes, ACTIVE_SHARE_EDGES),
      dilution_hist=layer_histograms(_safe_ratio(u_bar, mu), sizes,
                                     DILUTION_EDGES, valid=mu != 0),
  )


# ----------------------------------------------------------------------------
# Host side: summaries of the pairwise matrices.
# ----------------------------------------------------------------------------


def _pair_masks(client_domain: Any, num_clients: int):
  domain = np.asarray(client_domain)
  if domain.shape != (num_clients,):
    raise ValueError(
        f"client_domain must have shape ({num_clients},), got {domain.shape}."
    )
  same = domain[:, None] == domain[None, :]
  off = ~np.eye(num_clients, dtype=bool)
  return off, same & off, ~same


def _masked_mean(matrix: np.ndarray, mask: np.ndarray) -> Any:
  """Mean over masked [C, C] entries, per leading index; NaN if none."""
  if not mask.any():
    out = np.full(matrix.shape[:-2], np.nan)
  else:
    out = matrix[..., mask].mean(axis=-1)
  return float(out) if np.ndim(out) == 0 else out


def _square(matrix: Any) -> np.ndarray:
  matrix = np.asarray(matrix, dtype=np.float64)
  if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
    raise ValueError(f"matrix must be [..., C, C], got shape {matrix.shape}.")
  return matrix


def frac_negative_cross_domain(cos: Any, client_domain: Any) -> Any:
  """Share of cross-domain client pairs with negative cosine (Fig. 4, Sec. 3.2).

  Args:
    cos: [..., C, C] signed cosine matrices (e.g. ``RoundDiagnostics.cosine``,
      possibly stacked over rounds or runs).
    client_domain: int[C] domain of each client.

  Returns:
    A float (or an array over the leading axes): the fraction of ordered
    pairs ``(i, j)`` of different domains with ``cos[i, j] < 0`` (the same
    as over unordered pairs for a symmetric matrix); NaN if all clients
    share one domain.
  """
  cos = _square(cos)
  _, _, cross = _pair_masks(client_domain, cos.shape[-1])
  return _masked_mean((cos < 0).astype(np.float64), cross)


def cross_domain_abs_cosine(cos: Any, client_domain: Any) -> np.ndarray:
  """``|cos|`` of every unordered cross-domain client pair (Fig. 3).

  The alignment-magnitude distribution of Finding 2, for a histogram.

  Args:
    cos: [..., C, C] signed cosine matrices.
    client_domain: int[C] domain of each client.

  Returns:
    f64[..., M]: ``|cos[i, j]|`` for the M pairs ``i < j`` of different
    domains, in row-major order of ``(i, j)``.
  """
  cos = _square(cos)
  _, _, cross = _pair_masks(client_domain, cos.shape[-1])
  return np.abs(cos[..., cross & np.triu(cross, k=1)])


def pair_summary(matrix: Any, client_domain: Any) -> dict[str, Any]:
  """Block means of a pairwise client matrix (Figs. 2 and 4).

  Args:
    matrix: [..., C, C] Jaccard or cosine matrices (leading axes, e.g.
      rounds, are kept).
    client_domain: int[C] domain of each client.

  Returns:
    A dict of floats (arrays over the leading axes if any), diagonal always
    excluded and each mean over ordered pairs:
      * ``mean_offdiag``: all pairs ``i != j``;
      * ``mean_within_domain``: pairs of the same domain;
      * ``mean_cross_domain``: pairs of different domains;
      * ``frac_negative_cross_domain``: see :func:`frac_negative_cross_domain`
        (meaningful for signed cosine matrices only).
    A mean with no such pair is NaN. A NaN entry (a non-finite client)
    propagates to the means; drop that client first.
  """
  matrix = _square(matrix)
  off, within, cross = _pair_masks(client_domain, matrix.shape[-1])
  return {
      "mean_offdiag": _masked_mean(matrix, off),
      "mean_within_domain": _masked_mean(matrix, within),
      "mean_cross_domain": _masked_mean(matrix, cross),
      "frac_negative_cross_domain": frac_negative_cross_domain(
          matrix, client_domain),
  }


# ----------------------------------------------------------------------------
# Host side: domain factors (Finding 3, Fig. 5).
# ----------------------------------------------------------------------------


def _simple_graph(edge_index: Any, num_nodes: int):
  """The undirected simple graph of ``edge_index`` (no self-loops)."""
  import networkx as nx

  edge_index = np.asarray(edge_index)
  if edge_index.ndim != 2 or edge_index.shape[0] != 2:
    raise ValueError(f"edge_index must be [2, E], got {edge_index.shape}.")
  graph = nx.Graph()
  graph.add_nodes_from(range(num_nodes))
  graph.add_edges_from(edge_index.T.tolist())
  graph.remove_edges_from(list(nx.selfloop_edges(graph)))
  if graph.number_of_nodes() != num_nodes:
    raise ValueError("edge_index refers to nodes outside [0, num_nodes).")
  return graph


def _homophily_of(graph, y: np.ndarray) -> float:
  edges = np.asarray(list(graph.edges()), dtype=np.int64).reshape(-1, 2)
  if edges.shape[0] == 0:
    return float("nan")
  return float(np.mean(y[edges[:, 0]] == y[edges[:, 1]]))


def edge_homophily(edge_index: Any, y: Any) -> float:
  """Edge homophily: the share of edges joining two nodes of the same label.

  ``edge_index`` is read as an undirected simple graph: both directions of
  an edge and repeated edges count once, self-loops are dropped (they are
  trivially homophilous). On a graph stored with both directions this
  equals the directed ratio.

  Args:
    edge_index: int[2, E] edges.
    y: int[N] node labels.

  Returns:
    h in [0, 1] (Zhu et al., 2020), or NaN for a graph with no edges.
  """
  y = np.asarray(y)
  return _homophily_of(_simple_graph(edge_index, y.shape[0]), y)


def js_divergence(p: Any, q: Any) -> float:
  """Jensen-Shannon divergence in bits (base 2), in [0, 1].

  ``JS(p, q) = H(m) - (H(p) + H(q)) / 2`` with ``m = (p + q) / 2``;
  ``scipy.spatial.distance.jensenshannon`` gives its square root.

  Args:
    p: [K] non-negative weights (normalised inside).
    q: [K] non-negative weights (normalised inside).

  Returns:
    0 for identical distributions, 1 for disjoint supports.
  """
  from scipy.spatial import distance

  return float(distance.jensenshannon(np.asarray(p, np.float64),
                                      np.asarray(q, np.float64), base=2) ** 2)


class DomainStatistics(NamedTuple):
  """Per-domain summaries behind :func:`domain_factors`.

  Attributes:
    names: the D domain names, in the order of the rows below.
    homophily: f64[D] edge homophily.
    feature_mean: f64[D, F] mean node feature vector.
    label_dist: f64[D, K] label distribution over the union of classes
      (``K = 1 + max label`` over all domains).
    degree_hist: f64[D, B] normalised histogram of ``log1p(degree)`` on bins
      shared by all domains.
  """

  names: tuple[str, ...]
  homophily: np.ndarray
  feature_mean: np.ndarray
  label_dist: np.ndarray
  degree_hist: np.ndarray


def domain_statistics(domain_graphs: Mapping[str, Mapping[str, Any]],
                      num_bins: int = 20) -> DomainStatistics:
  """Per-domain homophily, feature mean, label and degree distributions.

  Args:
    domain_graphs: ``{domain: {"x": f32[N, F], "y": i32[N],
      "edge_index": i32[2, E]}}`` (the prepared-data format).
    num_bins: B, bins of the shared log-degree histogram.

  Returns:
    A :class:`DomainStatistics`, rows in the order of ``domain_graphs``.
  """
  if not domain_graphs:
    raise ValueError("domain_graphs is empty.")
  if num_bins < 1:
    raise ValueError(f"num_bins must be >= 1, got {num_bins}.")
  names = tuple(domain_graphs)
  labels = [np.asarray(domain_graphs[d]["y"]).astype(np.int64) for d in names]
  if any(y.size == 0 for y in labels) or any(y.min() < 0 for y in labels):
    raise ValueError("every domain needs nodes with labels >= 0.")
  num_classes = 1 + max(int(y.max()) for y in labels)
  homophily, means, label_dist, degrees = [], [], [], []
  for name, y in zip(names, labels):
    graph = _simple_graph(domain_graphs[name]["edge_index"], y.shape[0])
    homophily.append(_homophily_of(graph, y))
    means.append(np.asarray(domain_graphs[name]["x"], np.float64).mean(axis=0))
    label_dist.append(np.bincount(y, minlength=num_classes) / y.shape[0])
    degrees.append(np.array([deg for _, deg in graph.degree()], np.float64))
  # Degrees are heavy-tailed: log bins keep the tail from vanishing into one
  # linear bin; shared edges make the histograms comparable across domains.
  top = max(np.log1p(deg.max()) for deg in degrees)
  edges = np.linspace(0.0, max(top, 1e-12), num_bins + 1)
  degree_hist = np.stack([np.histogram(np.log1p(deg), edges)[0] / deg.size
                          for deg in degrees])
  return DomainStatistics(names, np.asarray(homophily), np.stack(means),
                          np.stack(label_dist), degree_hist)


def domain_factors(domain_graphs: Mapping[str, Mapping[str, Any]],
                   num_bins: int = 20) -> dict[str, np.ndarray]:
  """Pairwise graph-domain discrepancies of Finding 3 (Fig. 5).

  Computed once per dataset on the host. Rows and columns follow the order
  of ``domain_graphs``; every matrix is symmetric with a zero diagonal.

  Args:
    domain_graphs: ``{domain: {"x": f32[N, F], "y": i32[N],
      "edge_index": i32[2, E]}}``.
    num_bins: B, bins of the log-degree histogram.

  Returns:
    ``{name: f64[D, D]}`` with
      * ``homophily_gap``: ``|h_i - h_j|``, h the edge homophily
        (:func:`edge_homophily`);
      * ``feature_distance``: L2 distance between mean feature vectors;
      * ``label_js``: Jensen-Shannon divergence, base 2 (in [0, 1]), of the
        label distributions over the union of classes (:func:`js_divergence`);
      * ``degree_distance``: L1 distance (in [0, 2]) between the normalised
        histograms of ``log1p(degree)`` on ``num_bins`` equal bins from 0 to
        the largest ``log1p(degree)`` of any domain (degrees of the
        undirected simple graph, networkx).
  """
  stats = domain_statistics(domain_graphs, num_bins)
  num = len(stats.names)
  pairs = [(i, j) for i in range(num) for j in range(num)]

  def matrix(fn):
    out = np.zeros((num, num))
    for i, j in pairs:
      if i != j:
        out[i, j] = fn(i, j)
    return out

  return {
      "homophily_gap": np.abs(stats.homophily[:, None]
                              - stats.homophily[None, :]),
      "feature_distance": np.linalg.norm(
          stats.feature_mean[:, None, :] - stats.feature_mean[None, :, :],
          axis=-1),
      "label_js": matrix(lambda i, j: js_divergence(stats.label_dist[i],
                                                    stats.label_dist[j])),
      "degree_distance": np.abs(stats.degree_hist[:, None, :]
                                - stats.degree_hist[None, :, :]).sum(-1),
  }


def client_discrepancy(factor: Any, client_domain: Any) -> np.ndarray:
  """Each client's mean discrepancy to the other domains present.

  Args:
    factor: [D, D] one domain-factor matrix.
    client_domain: int[C] domain of each client (indices into ``factor``).

  Returns:
    f64[C]: for client k of domain a, the unweighted mean of
    ``factor[a, b]`` over the domains ``b != a`` that have at least one
    client (the domains it is aggregated with); NaN if there is none.
  """
  factor = _square(factor)
  domain = np.asarray(client_domain).astype(np.int64)
  if domain.ndim != 1 or domain.min(initial=0) < 0 or (
      domain.max(initial=0) >= factor.shape[0]):
    raise ValueError("client_domain must be int[C] indices into factor.")
  present = np.zeros(factor.shape[0], bool)
  present[domain] = True
  others = present[None, :] & ~np.eye(factor.shape[0], dtype=bool)
  count = others.sum(axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):
    per_domain = np.where(others, factor, 0.0).sum(axis=1) / count
  return np.where(count[domain] > 0, per_domain[domain], np.nan)


def factor_association(factors: Mapping[str, Any], retention_by_client: Any,
                       client_domain: Any) -> dict[str, float]:
  """Spearman association of each domain factor with retention (Fig. 5).

  For each factor, each client gets its mean discrepancy to the OTHER
  domains in the federation (:func:`client_discrepancy`): retention is about
  how its salient set survives averaging with those domains, so its own
  domain's zero diagonal is left out. Retention given over several runs or
  rounds ``[R, C]`` is first averaged per client, so each client is one
  observation (pooling R dependent copies would overstate the sample).
  Clients of one domain share a discrepancy; ``spearmanr`` ranks ties by
  their average. Call once per backbone; Fig. 5 reports ``|rho|`` means.

  Args:
    factors: ``{name: [D, D]}``, e.g. from :func:`domain_factors`.
    retention_by_client: f[C] or f[R, C] retention (e.g.
      ``RoundDiagnostics.retention`` at a chosen round, stacked over seeds).
    client_domain: int[C] domain of each client.

  Returns:
    ``{name: rho}``, Spearman's rho in [-1, 1]; NaN when either side is
    constant (e.g. a single domain) or fewer than 2 clients are finite.
  """
  from scipy import stats

  ret = np.asarray(retention_by_client, np.float64)
  if ret.ndim == 2:
    ret = ret.mean(axis=0)
  if ret.ndim != 1 or ret.shape != np.shape(client_domain):
    raise ValueError(
        f"retention must be [C] or [R, C] with C={np.size(client_domain)}, "
        f"got {np.shape(retention_by_client)}."
    )
  out = {}
  for name, factor in factors.items():
    x = client_discrepancy(factor, client_domain)
    ok = np.isfinite(x) & np.isfinite(ret)
    # A factor flat up to float noise (e.g. the mean-feature distance of
    # per-domain standardised features) must not be ranked: its rho is noise.
    if (ok.sum() < 2 or np.ptp(x[ok]) <= 1e-6 * max(1.0, np.abs(x[ok]).max())
        or np.ptp(ret[ok]) == 0):
      out[name] = float("nan")
      continue
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      out[name] = float(stats.spearmanr(x[ok], ret[ok]).statistic)
  return out
