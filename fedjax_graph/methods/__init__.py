"""Federated methods, one module each, found by name in ``REGISTRY``.

A method is a client part and a server part (``base.Method``); adding one is a
new module with its factory plus one line in ``REGISTRY`` (and ``DISPLAY``).

**Composition with an aggregator** (the paper's "+FedIA", Sec. 3.3): the
simulation forms the aggregate ``update`` of the participants' model updates
with the cell's aggregator: the method's own averaging (``fedavg`` with the
method's base weights: uniform or training-node counts, as its paper does) or
another rule (FedIA, GMA, FedHEAL). The method's ``server_step`` and client
part are the same in both cases, so what an aggregator replaces is exactly the
mean of the client updates:

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
  FedProto    as FedAvg; the per-class mean of the uploaded prototypes stays
              the method's (an aggregator sees model updates only).
  FedProc     as FedProto (its alpha_t schedule is client-side).
  FGSSL       as FedAvg (the contrast and distillation terms are client-side only).
  FedSPA      HBDA's per-tensor weights (``Method.leaf_weights``) multiply the
              aggregator's client weights tensor by tensor: alone FedAvg with
              them (HBDA), +FedIA alpha_k w_k^G renormalised per tensor.
              ``fedspa_nohbda`` has none: +FedIA is "FedIA (repl.)".
  FGGP        u replaces the count-weighted mean of the shared tensors (the
              classifier is personal: never aggregated, in no aggregator's
              mask); FINCH, the prototype queue and the kNN prediction are
              unchanged.
  ==========  ===================================================================

Per-client state never changes for a client that did not take part in the
round (not sampled, no training node, or a non-finite update). ``local`` is a
reference row (``references``), not a federated method: it is registered so
the simulation can run it, but is not in ``METHODS``.
"""

import inspect
from typing import Any, Callable, Mapping, Optional

from fedjax_graph.config import Config
from fedjax_graph.methods.base import ClientContext, Method, MethodState, StepOutput
from fedjax_graph.methods.defaults import METHODS_FILE, check_method_config, method_defaults
from fedjax_graph.methods.fedavg import fedavg
from fedjax_graph.methods.feddyn import feddyn
from fedjax_graph.methods.fedopt import SERVER_OPTIMIZERS, fedopt
from fedjax_graph.methods.fedproc import fedproc
from fedjax_graph.methods.fedproto import fedproto
from fedjax_graph.methods.fedprox import fedprox
from fedjax_graph.methods.fedspa import fedspa, fedspa_nohbda
from fedjax_graph.methods.fggp import fggp
from fedjax_graph.methods.fgssl import fgssl
from fedjax_graph.methods.local import local
from fedjax_graph.methods.moon import cosine_similarity, moon, moon_loss
from fedjax_graph.methods.scaffold import effective_steps, scaffold
from fedjax_graph.models import NodeClassifier

REGISTRY: dict[str, Callable[..., Method]] = {
    "fedavg": fedavg, "fedprox": fedprox, "moon": moon, "feddyn": feddyn, "fedopt": fedopt,
    "scaffold": scaffold, "fedproto": fedproto, "fedproc": fedproc, "fgssl": fgssl,
    "fedspa": fedspa, "fedspa_nohbda": fedspa_nohbda, "fggp": fggp, "local": local}
DISPLAY = {"fedavg": "FedAvg", "fedprox": "FedProx", "moon": "MOON", "feddyn": "FedDyn",
           "fedopt": "FedOpt", "scaffold": "SCAFFOLD", "fedproto": "FedProto",
           "fedproc": "FedProc", "fgssl": "FGSSL", "fedspa": "FedSPA",
           "fedspa_nohbda": "FedSPA w/o HBDA", "fggp": "FGGP", "local": "Local"}
# Table rows named otherwise than "<method>+<aggregator>" (``comparison.row_label``):
# FedIA in place of FedSPA's HBDA is the FedIA paper's "FedIA (repl.)".
ROW_DISPLAY = {("fedspa_nohbda", "fedia"): "FedIA (repl.)"}
REFERENCE_METHODS = ("local",)
# The federated base methods (what tables run "alone and +FedIA").
METHODS = {name: f for name, f in REGISTRY.items() if name not in REFERENCE_METHODS}


def register(name: str, factory: Callable[..., Method], display: Optional[str] = None) -> None:
  """Adds a method under ``name`` (e.g. from a user's own module or a test).

  Raises:
    ValueError: if ``name`` is taken.
  """
  if name in REGISTRY:
    raise ValueError(f"a method called {name!r} is registered already")
  REGISTRY[name] = factory
  METHODS[name] = factory
  DISPLAY[name] = display or name


def run_hparams(name: str, hparams: Optional[Mapping[str, Any]], rounds: int) -> dict:
  """A method's hyper-parameters for a run of ``rounds`` rounds.

  A method whose factory takes ``rounds`` (the T of a schedule over the run,
  FedProc's alpha_t) gets the run's, unless ``hparams`` sets it.

  Raises:
    ValueError: for an unknown method.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
  out = dict(hparams or {})
  if "rounds" in inspect.signature(REGISTRY[name]).parameters:
    out.setdefault("rounds", rounds)
  return out


def _check_type(method: str, key: str, value: Any, default: Any) -> None:
  """Raises a ValueError naming ``method.key`` when ``value`` is not of its default's kind.

  Kinds: true/false, an integer, a number (an integer too), a string; a
  parameter without a default is left to its factory.
  """
  kinds = ((bool, lambda v: isinstance(v, bool), "true or false"),
           (int, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
           (float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
           (str, lambda v: isinstance(v, str), "a string"))
  for kind, ok, name in kinds:
    if isinstance(default, kind):  # bool first: True is an int too
      if not ok(value):
        raise ValueError(f"{method}: {key} = {value!r}; must be {name} (default {default!r})")
      return


def make_method(name: str, model: NodeClassifier, config: Config,
                hparams: Optional[Mapping[str, Any]] = None) -> Method:
  """The method called ``name`` with ``hparams`` over its defaults.

  Raises:
    ValueError: for an unknown method or hyper-parameter, or a value out of
      its range, naming it and what is allowed.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
  factory = REGISTRY[name]
  hparams = dict(hparams or {})
  parameters = inspect.signature(factory).parameters
  allowed = list(parameters)[2:]
  unknown = sorted(set(hparams) - set(allowed))
  if unknown:
    raise ValueError(f"{name}: unknown hyper-parameter(s) {unknown}; valid: {allowed}")
  for key, value in hparams.items():
    _check_type(name, key, value, parameters[key].default)
  try:
    return factory(model, config, **hparams)
  except TypeError as err:  # a type the defaults do not tell, e.g. of a parameter without one
    raise ValueError(f"{name}: a hyper-parameter has the wrong type in {hparams} ({err})")
  except ValueError as err:  # most factories' messages name the value, not the method
    if str(err).startswith(f"{name}:"):
      raise
    raise ValueError(f"{name}: {err}") from None


def hparams_in_effect(name: str, hparams: Optional[Mapping[str, Any]] = None) -> dict:
  """Every hyper-parameter of method ``name``: ``hparams`` over its factory's defaults.

  Raises:
    ValueError: for an unknown method.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
  parameters = list(inspect.signature(REGISTRY[name]).parameters.values())[2:]
  defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
  return {**defaults, **(hparams or {})}


__all__ = ["ClientContext", "DISPLAY", "METHODS", "METHODS_FILE", "Method", "MethodState",
           "REGISTRY", "ROW_DISPLAY", "SERVER_OPTIMIZERS", "StepOutput", "check_method_config",
           "cosine_similarity", "effective_steps", "hparams_in_effect", "make_method",
           "method_defaults", "moon_loss", "register", "run_hparams"]
