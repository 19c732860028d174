"""Server-side aggregators, one module each, found by name in ``REGISTRY``.

Every aggregator has one interface (``base``; optax style, pure, jittable)::

  agg = aggregators.get("fedia")            # or aggregators.fedia()
  state = agg.init(num_clients, params)     # params: only FedHEAL needs them
  update, state, diagnostics = agg.update(
      client_updates, state, *hparams, weights=None, participating=None, **hparams)

with ``client_updates`` leaves [C, ...] in the descent convention
``u_k = -(W_k - W) / eta``, ``agg.hparams`` the ordered ``{name: default}`` of
its hyper-parameters (Python numbers are range-checked, traced scalars are
not, so a ``vmap`` over a vector of values compiles once), and diagnostics
that always carry ``weights`` f32[C], ``mask_coverage`` f32[] and
``excluded`` bool[C] (see ``base`` for every convention).

  ===========  ====================  =========================================
  name         hyper-parameters      rule
  ===========  ====================  =========================================
  fedavg       (none)                weighted mean (McMahan et al. 2017)
  fedia        rho 0.5, beta 0.5     importance mask + contribution momentum
  fedia_im     rho 0.5               FedIA's mask, base weights
  fedia_cam    beta 0.5              FedIA's momentum weights, no mask
  gma          tau 0.1               sign-agreement mask (Tenison et al. 2023)
  fedheal      tau 0.3, beta 0.4     consistency masks + fair weights
                                     (Chen, Huang, Ye 2024)
  ===========  ====================  =========================================

Adding an aggregator is a new module with its factory plus one line in
``_AGGREGATORS`` (and its import). The package's names ``fedavg``, ``fedia``,
``gma`` and ``fedheal`` are the functions, not the modules of the same name
(``importlib.import_module("fedjax_graph.aggregators.fedia")`` reaches a
module). ``fedavg`` is the weighted-mean function ``fedavg(client_updates,
weights, participating)``; the FedAvg aggregator is ``fedavg_aggregator()``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from fedjax_graph.aggregators.base import (
    Aggregator,
    Diagnostics,
    EmptyState,
    HParam,
    l2_norms,
    num_clients_of,
    resolve_hparams,
)
from fedjax_graph.aggregators.fedavg import fedavg, fedavg_aggregator
from fedjax_graph.aggregators.fedheal import FedHEALDiagnostics, FedHEALState, fedheal
from fedjax_graph.aggregators.fedia import (
    FedIADiagnostics,
    FedIAState,
    contribution_scores,
    contribution_weights,
    fedia,
    importance_mask,
)
from fedjax_graph.aggregators.gma import GMADiagnostics, gma

# name: (factory, display name).
_AGGREGATORS: dict[str, tuple[Callable[..., Aggregator], str]] = {
    "fedavg": (fedavg_aggregator, "FedAvg"),
    "fedia": (fedia, "FedIA"),
    "fedia_im": (functools.partial(fedia, use_momentum=False), "FedIA-IM"),
    "fedia_cam": (functools.partial(fedia, use_mask=False), "FedIA-CAM"),
    "gma": (gma, "GMA"),
    "fedheal": (fedheal, "FedHEAL"),
}
REGISTRY: Mapping[str, Callable[..., Aggregator]] = {
    name: factory for name, (factory, _) in _AGGREGATORS.items()}
DISPLAY: Mapping[str, str] = {name: display for name, (_, display) in _AGGREGATORS.items()}


def get(name: str, **static_options: Any) -> Aggregator:
  """The aggregator registered as ``name``, built with its static options.

  Raises:
    ValueError: naming the registered aggregators, if ``name`` is not one.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown aggregator {name!r}; choose from {', '.join(REGISTRY)}")
  return REGISTRY[name](**static_options)


def check_hparams(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
  """Checks host-side hyper-parameters of aggregator ``name`` before a run.

  Returns:
    ``{hparam: value}`` in the aggregator's order, defaults filled in.

  Raises:
    ValueError: for an unknown aggregator or hyper-parameter (naming the
      allowed ones), a non-scalar value, or a number out of its range.
  """
  return resolve_hparams(name, get(name).hparam_specs, (), values)


__all__ = [
    "Aggregator", "DISPLAY", "Diagnostics", "EmptyState", "FedHEALDiagnostics", "FedHEALState",
    "FedIADiagnostics", "FedIAState", "GMADiagnostics", "HParam", "REGISTRY", "check_hparams",
    "contribution_scores", "contribution_weights", "fedavg", "fedavg_aggregator", "fedheal",
    "fedia", "gma", "get", "importance_mask", "l2_norms", "num_clients_of",
]
