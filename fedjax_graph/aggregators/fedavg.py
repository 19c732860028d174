"""FedAvg: the weighted mean of the participants' updates.

References:
  H. B. McMahan, E. Moore, D. Ramage, S. Hampson and B. Aguera y Arcas,
  "Communication-Efficient Learning of Deep Networks from Decentralized
  Data", AISTATS 2017, https://arxiv.org/abs/1602.05629 (Algorithm 1, the
  server's weighted average).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_graph.aggregators import base


def fedavg(
    client_updates: base.ClientUpdates,
    weights: Any,
    participating: Any = None,
) -> base.Updates:
  """Weighted mean of the participating clients' updates (the FedAvg rule).

  ``u = sum_k w_k p_k u_k / sum_k w_k p_k`` with ``p_k`` the participation
  indicator: the weights are renormalised over participants, and
  non-participants contribute nothing (their rows are never read). Unlike
  :func:`fedavg_aggregator`, this function trusts its input: a participant's
  NaN reaches the result.

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
  """
  num_clients = base.num_clients_of(client_updates)
  part = base.participation(participating, num_clients)
  weights = base.client_vector("weights", weights, num_clients)
  return _fedavg_core(client_updates, weights, part)


@jax.jit
def _fedavg_core(
    client_updates: base.ClientUpdates, weights: jax.Array, part: jax.Array
) -> base.Updates:
  return base.weighted_sum(client_updates, base.normalise(weights, part), part)


@jax.jit
def _aggregator_core(client_updates, state, weights, part, leaf_weights=None):
  active, _ = base.screen(client_updates, part)
  coeff = base.leaf_coefficients(base.normalise(weights, active), leaf_weights, active)
  diagnostics = base.Diagnostics(
      weights=base.applied_weights(coeff, client_updates),
      mask_coverage=jnp.ones((), jnp.float32),
      excluded=part & ~active,
  )
  return base.weighted_sum(client_updates, coeff, active), state, diagnostics


def fedavg_aggregator() -> base.Aggregator:
  """FedAvg behind the :class:`~base.Aggregator` interface (stateless, no hyper-parameters).

  ``update(client_updates, state, weights=None, participating=None,
  leaf_weights=None)`` returns ``fedavg(client_updates, weights, active)``
  with ``weights`` uniform when None and ``active`` the participants whose
  update has a finite L2 norm (the others are reported in
  ``diagnostics.excluded``). With ``leaf_weights`` (pytree of f32[C], see
  ``base``) tensor ``l`` is averaged with ``weights * leaf_weights[l]``
  renormalised; ``diagnostics.weights`` are then their coordinate-weighted mean.

  Returns:
    An :class:`~base.Aggregator`: ``init(num_clients, params=None) ->
    EmptyState()``; ``update`` returns :class:`~base.Diagnostics` with
    ``mask_coverage`` 1. ``update`` raises ValueError if leaves disagree on
    C, ``weights``/``participating`` is not [C], or a hyper-parameter is
    given (FedAvg has none).

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, Algorithm 1.
  """

  def init(num_clients: int, params: base.Updates | None = None) -> base.EmptyState:
    del params  # Stateless.
    base.check_num_clients(num_clients)
    return base.EmptyState()

  return base.make_aggregator("fedavg", {}, init, _aggregator_core, per_leaf=True)
