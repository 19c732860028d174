"""The aggregator interface and the helpers every aggregator shares.

An aggregator is a pair of pure functions built by a factory that closes over
its static options, in the style of an optax ``GradientTransformation`` and of
``optax.experimental`` aggregators (``[C, *param_shape] -> [*param_shape]``):

  * ``init(num_clients, params=None) -> state``: the server state, every leaf
    with a leading client axis [C] (or none). ``params`` is a pytree shaped
    like one client's update (arrays or ``jax.ShapeDtypeStruct``); only an
    aggregator whose state is shaped like the model (FedHEAL) needs it.
  * ``update(client_updates, state, *hparams, weights=None,
    participating=None, **hparams) -> (update, state, diagnostics)``.

``update`` is pure and jittable, so a simulation can ``jit`` a round,
``lax.scan`` over rounds and ``vmap`` over cells of hyper-parameters.

Shapes use the project's legend (``fedjax_graph/types.py``): ``C`` clients;
``...`` stands for the shape of one parameter tensor.

Conventions:
  * ``client_updates`` is a pytree (e.g. Flax params) whose every leaf has a
    leading client axis, ``[C, ...]``. Row ``k`` is client ``k`` by index;
    every rule is permutation equivariant in the client axis.
  * Updates are in the descent convention of the FedIA paper (Sec. 3.1):
    ``u_k = -(W_k - W) / eta``. The aggregate is in the same convention; the
    server then applies ``W <- W - eta * u`` (that step is the caller's).
  * ``weights`` f32[C] are base weights (e.g. train-node counts; default
    uniform), renormalised over the clients aggregated. Rules that make their
    own client weights (FedIA with momentum, FedHEAL) ignore them.
  * ``leaf_weights`` (optional; the aggregators that take it: FedAvg, FedIA
    and its ablations) is a pytree shaped like the updates with leaves f32[C]:
    per parameter tensor, client weights multiplied into the client weights
    the rule forms (base weights or FedIA's alpha) and renormalised over the
    clients aggregated, tensor by tensor. It is how a method whose own
    averaging weighs each parameter group differently (FedSPA's HBDA) keeps
    those weights under another rule; None: one weight per client for every
    tensor, as before.
  * ``participating`` bool[C] (default all True) is the sampled set. Rows of
    non-participants are padding: they are never read into a result (a NaN
    there cannot leak), get weight 0, keep their per-client state and are left
    out of every mean, max and normalisation.
  * A participant whose update is not finite, or whose L2 norm (or any other
    per-client statistic the rule takes) is not finite in float32, is
    *excluded*: treated as a non-participant for the round and reported in
    ``diagnostics.excluded``, so one broken client cannot poison the weights of
    the healthy ones.
  * Hyper-parameters are scalars: Python numbers (range-checked) or (traced)
    arrays (not checked; nothing here breaks tracing, so a ``vmap`` over a
    vector of values compiles once). Positional ones follow the order of
    ``Aggregator.hparams``; a missing one takes its default.
  * Per-client vectors are float32; aggregates keep each leaf's dtype and are
    accumulated in at least float32 by elementwise multiply-and-sum (no
    matmul, so no TF32/bf16 matmul precision on accelerators).
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np

ClientUpdates = chex.ArrayTree  # Pytree, every leaf [C, ...].
Updates = chex.ArrayTree  # Pytree shaped like one client's: leaves [...].
AggregatorState = chex.ArrayTree  # Every leaf [C, ...].


# ----------------------------------------------------------------------------
# Types.
# ----------------------------------------------------------------------------


class EmptyState(NamedTuple):
  """State of a stateless aggregator (FedAvg, GMA): a pytree with no leaves."""


class Diagnostics(NamedTuple):
  """Per-round diagnostics every aggregator reports (its own type may add more).

  Attributes:
    weights: f32[C]. Client-level weights applied this round; they sum to 1
      over the clients aggregated (unless all base weights are 0) and are 0
      for non-participants and excluded clients.
    mask_coverage: f32[]. Share of all model coordinates that at least one
      client's update reaches the aggregate through (1 without a mask).
    excluded: bool[C]. Participants left out of the round because their
      update or one of its statistics was not finite.
  """

  weights: jax.Array  # f32[C]
  mask_coverage: jax.Array  # f32[]
  excluded: jax.Array  # bool[C]


class HParam(NamedTuple):
  """A scalar hyper-parameter: its default and the range a Python number must lie in.

  Attributes:
    default: value used when the caller does not give one.
    low: lower bound, inclusive unless ``open_low``.
    high: upper bound, inclusive.
    open_low: whether ``low`` itself is excluded.
  """

  default: float
  low: float
  high: float
  open_low: bool = False

  def describe(self) -> str:
    return f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"


class AggregatorInitFn(Protocol):

  def __call__(self, num_clients: int, params: Updates | None = None) -> AggregatorState:
    """Returns the state for ``num_clients`` (C) clients."""


class AggregatorUpdateFn(Protocol):

  def __call__(
      self,
      client_updates: ClientUpdates,
      state: AggregatorState,
      *hparams: Any,
      weights: Any = None,
      participating: Any = None,
      **named_hparams: Any,
  ) -> tuple[Updates, AggregatorState, Any]:
    """Maps leaves ``[C, ...]`` to ``[...]``; returns ``(update, state, diagnostics)``."""


class Aggregator(NamedTuple):
  """A server aggregator: a pair of pure functions (optax style).

  Attributes:
    init: ``init(num_clients, params=None) -> state``.
    update: ``update(client_updates, state, *hparams, weights=None,
      participating=None, **hparams) -> (update, new_state, diagnostics)``.
    hparam_specs: ordered ``{name: HParam}``; positional hyper-parameters
      follow this order.
    per_leaf: ``update`` takes ``leaf_weights`` (module docstring); callers
      check it before running a method that supplies them.
  """

  init: AggregatorInitFn
  update: AggregatorUpdateFn
  hparam_specs: Mapping[str, HParam] = types.MappingProxyType({})
  per_leaf: bool = False

  @property
  def hparams(self) -> Mapping[str, float]:
    """Ordered ``{name: default}`` of the hyper-parameters ``update`` takes."""
    return types.MappingProxyType({n: s.default for n, s in self.hparam_specs.items()})


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


def check_num_clients(num_clients: int) -> int:
  """``num_clients`` as an int, or ValueError unless it is an int >= 1."""
  if isinstance(num_clients, bool) or not isinstance(num_clients, numbers.Integral):
    raise ValueError(f"num_clients must be an int, got {num_clients!r}.")
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
  return int(num_clients)


def client_vector(name: str, value: Any, num_clients: int) -> jax.Array:
  """Returns ``value`` as an array, checking its static shape is [C]."""
  value = jnp.asarray(value)
  if value.shape != (num_clients,):
    raise ValueError(
        f"{name} must have shape ({num_clients},) (one entry per client), "
        f"got {value.shape}."
    )
  return value


def participation(participating: Any, num_clients: int) -> jax.Array:
  """Returns participation as bool [C] (all True when None)."""
  if participating is None:
    return jnp.ones((num_clients,), dtype=bool)
  return client_vector("participating", participating, num_clients).astype(bool)


def base_weights(weights: Any, num_clients: int) -> jax.Array:
  """Returns base weights as f32[C] (all ones, i.e. uniform, when None)."""
  if weights is None:
    return jnp.ones((num_clients,), jnp.float32)
  return client_vector("weights", weights, num_clients).astype(jnp.float32)


def _is_concrete_number(x: Any) -> bool:
  # Python and NumPy values are concrete; jax Arrays (possibly traced) are
  # never range-checked, so checking cannot break tracing.
  return isinstance(x, (numbers.Real, np.ndarray)) and not isinstance(x, jax.Array)


def check_hparam(name: str, spec: HParam, value: Any) -> None:
  """Raises ValueError unless ``value`` is a scalar, in range if it is concrete."""
  if value is None or jnp.ndim(value) != 0:
    shape = None if value is None else jnp.shape(value)
    raise ValueError(
        f"{name} must be a scalar, got {'None' if value is None else f'shape {shape}'}; "
        f"vmap over a vector of {name} values instead."
    )
  if _is_concrete_number(value):
    v = float(value)
    above_low = v > spec.low if spec.open_low else v >= spec.low
    if not (above_low and v <= spec.high):  # Also rejects NaN.
      raise ValueError(f"{name} = {value!r}; must be in {spec.describe()}")


def resolve_hparams(
    owner: str,
    specs: Mapping[str, HParam],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Binds positional and named hyper-parameters, fills defaults and checks them.

  Args:
    owner: the aggregator's name, for error messages.
    specs: ordered ``{name: HParam}``.
    args: positional values, in the order of ``specs``.
    kwargs: named values.

  Returns:
    ``{name: value}`` in the order of ``specs``, values as given (or the
    default).

  Raises:
    ValueError: naming the allowed hyper-parameters, for too many positional
      values, an unknown name or one given twice; or, via
      :func:`check_hparam`, a non-scalar or out-of-range value.
  """
  kwargs = dict(kwargs or {})
  names = tuple(specs)
  allowed = ", ".join(names) or "none"
  if len(args) > len(names):
    raise ValueError(
        f"{owner} takes {len(names)} hyper-parameter(s) ({allowed}), got "
        f"{len(args)} positional value(s)."
    )
  unknown = sorted(set(kwargs) - set(names))
  if unknown:
    raise ValueError(
        f"{owner}: unknown hyper-parameter(s) {unknown}; allowed: {allowed}."
    )
  twice = sorted(set(names[: len(args)]) & set(kwargs))
  if twice:
    raise ValueError(f"{owner}: hyper-parameter(s) {twice} given twice.")
  values = dict(zip(names, args)) | kwargs
  resolved = {n: values.get(n, specs[n].default) for n in names}
  for n, v in resolved.items():
    check_hparam(n, specs[n], v)
  return resolved


def check_state(state: AggregatorState, expected: AggregatorState) -> None:
  """Raises ValueError unless ``state`` has the structure and shapes of ``expected``."""
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(state)
  want_leaves, want_def = jax.tree_util.tree_flatten_with_path(expected)
  if got_def != want_def:
    raise ValueError(
        f"state has structure {got_def}, expected {want_def} (a state from "
        "this aggregator's init, for these clients and this model)."
    )
  for (path, got), (_, want) in zip(got_leaves, want_leaves):
    if jnp.shape(got) != want.shape:
      raise ValueError(
          f"state{jax.tree_util.keystr(path)} must have shape {want.shape}, "
          f"got {jnp.shape(got)} (a state from init for another C or model?)."
      )


def one_client(client_updates: ClientUpdates) -> Updates:
  """Shape and dtype of one client's update: ``jax.ShapeDtypeStruct`` leaves [...]."""
  return jax.tree.map(
      lambda leaf: jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], jnp.result_type(leaf)),
      client_updates,
  )


def make_aggregator(
    owner: str,
    specs: Mapping[str, HParam],
    init: AggregatorInitFn,
    core: Callable[..., tuple[Updates, AggregatorState, Any]],
    per_leaf: bool = False,
) -> Aggregator:
  """Builds an :class:`Aggregator` from its init and its jittable core.

  ``update`` does every static check (leaf shapes, per-client vectors, the
  state against ``init``'s, hyper-parameters), converts the hyper-parameters
  to float arrays, so Python numbers and traced values reach the same
  compiled core, and calls
  ``core(client_updates, state, weights, participating, **hparams)`` with
  ``weights`` f32[C] (ones when None) and ``participating`` bool[C]. With
  ``per_leaf``, ``update`` also takes ``leaf_weights`` (see the module
  docstring) and passes it on as ``core(..., leaf_weights=...)`` when given;
  without, a ``leaf_weights`` is a ValueError naming the aggregator.
  """

  def update(client_updates, state, *args, weights=None, participating=None,
             leaf_weights=None, **kwargs):
    num_clients = num_clients_of(client_updates)
    values = resolve_hparams(owner, specs, args, kwargs)
    check_state(
        state,
        jax.eval_shape(functools.partial(init, num_clients), one_client(client_updates)),
    )
    extra = {}
    if leaf_weights is not None:
      if not per_leaf:
        raise ValueError(f"{owner} does not take per-tensor leaf_weights")
      extra["leaf_weights"] = check_leaf_weights(leaf_weights, client_updates)
    return core(
        client_updates,
        state,
        base_weights(weights, num_clients),
        participation(participating, num_clients),
        **{n: as_float(v) for n, v in values.items()},
        **extra,
    )

  return Aggregator(init=init, update=update, hparam_specs=types.MappingProxyType(dict(specs)),
                    per_leaf=per_leaf)


def check_leaf_weights(leaf_weights: Any, client_updates: ClientUpdates) -> Any:
  """``leaf_weights`` as f32 leaves, checking it has the updates' structure and leaves [C].

  Raises:
    ValueError: naming the expected structure or the first leaf of another shape.
  """
  num_clients = num_clients_of(client_updates)
  want = jax.tree.structure(client_updates)
  if jax.tree.structure(leaf_weights) != want:
    raise ValueError(f"leaf_weights has structure {jax.tree.structure(leaf_weights)}, "
                     f"expected that of the updates, {want}")
  for path, leaf in jax.tree_util.tree_flatten_with_path(leaf_weights)[0]:
    if jnp.shape(leaf) != (num_clients,):
      raise ValueError(f"leaf_weights{jax.tree_util.keystr(path)} must have shape "
                       f"({num_clients},), got {jnp.shape(leaf)}")
  return jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), leaf_weights)


# ----------------------------------------------------------------------------
# Small jittable helpers.
# ----------------------------------------------------------------------------


def leaf_coefficients(coeff: jax.Array, leaf_weights: Any, active: jax.Array) -> Any:
  """Per-tensor client weights: ``coeff_k l_k`` renormalised over ``active``, leaf by leaf.

  ``coeff`` f32[C] are the rule's client weights; ``leaf_weights`` a pytree
  of f32[C] (or None: ``coeff`` itself is returned, one vector for all).
  """
  if leaf_weights is None:
    return coeff
  return jax.tree.map(lambda w: normalise(coeff * w, active), leaf_weights)


def applied_weights(coeff: Any, like: Updates) -> jax.Array:
  """The client weights f32[C] a diagnostic reports for ``coeff`` (f32[C] or per leaf).

  Per-leaf weights are averaged over leaves weighted by their coordinate
  counts: each client's share of the aggregate's coordinates.
  """
  if isinstance(coeff, (jax.Array, np.ndarray)):
    return coeff
  sizes = [math.prod(jnp.shape(leaf)[1:]) for leaf in jax.tree.leaves(like)]
  total = sum(sizes)
  return sum(n / max(total, 1) * c for n, c in zip(sizes, jax.tree.leaves(coeff)))


def as_float(x: Any) -> jax.Array:
  """A scalar as a float array (not weakly typed): one compiled core for all."""
  return jnp.asarray(x, dtype=jnp.result_type(float))


def acc_dtype(dtype: Any) -> Any:
  """Accumulation dtype: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)


def rows(vector: jax.Array, leaf: jax.Array) -> jax.Array:
  """A per-client vector [C] broadcastable against ``leaf`` [C, ...]."""
  return vector.reshape((vector.shape[0],) + (1,) * (leaf.ndim - 1))


def read_rows(leaf: jax.Array, active: jax.Array) -> jax.Array:
  """``leaf`` [C, ...] in the accumulation dtype with inactive rows set to 0.

  ``where``, not a multiply, so a NaN in an inactive row is never read.
  """
  return jnp.where(rows(active, leaf), leaf, 0).astype(acc_dtype(leaf.dtype))


def normalise(weights: jax.Array, active: jax.Array) -> jax.Array:
  """``w_k a_k / sum_j w_j a_j`` as f32[C]; all zeros if the sum is 0."""
  w = jnp.where(active, weights.astype(jnp.float32), 0.0)
  total = jnp.sum(w)
  positive = total > 0
  return jnp.where(positive, w / jnp.where(positive, total, 1.0), 0.0)


def weighted_sum(
    client_updates: ClientUpdates,
    coeff: jax.Array,
    active: jax.Array,
    mask: Updates | None = None,
) -> Updates:
  """``sum_k coeff_k (u_k * M)`` over active clients, leaf by leaf, in each leaf's dtype.

  ``coeff`` is f32[C], or a pytree shaped like the updates with leaves f32[C]
  (per-tensor weights, :func:`leaf_coefficients`). ``mask`` (optional) is
  shaped like one client's update (leaves [...]).
  """

  def leaf_sum(leaf, leaf_coeff, leaf_mask=None):
    x = read_rows(leaf, active)
    if leaf_mask is not None:
      x = x * leaf_mask.astype(x.dtype)
    return jnp.sum(rows(leaf_coeff, x).astype(x.dtype) * x, axis=0).astype(leaf.dtype)

  if isinstance(coeff, (jax.Array, np.ndarray)):
    coeff = jax.tree.map(lambda _: coeff, client_updates)
  if mask is None:
    return jax.tree.map(leaf_sum, client_updates, coeff)
  return jax.tree.map(leaf_sum, client_updates, coeff, mask)


def l2_norms(
    client_updates: ClientUpdates, active: jax.Array, mask: Updates | None = None
) -> jax.Array:
  """``||u_k * M_k||_2`` over the whole model (all leaves together), stably: f32[C].

  The sum of squares of float32 values overflows for a finite update whose
  entries reach ~1.8e19, so each client's rows are first scaled by
  ``2^-e``, with ``2^e`` the power of two at their largest ``|value|``; then
  every scaled entry is below 4 and the norm is ``2^e ||x 2^-e||``. Powers of
  two scale exactly, and ``e`` is clipped to [-126, 126] so both factors are
  normal floats: dividing by the maximum itself is not safe, since XLA may
  divide by multiplying with a reciprocal, and ``1/3e38`` is subnormal and
  flushed to zero. The result is finite whenever the update is finite and
  its norm is representable; it is Inf or NaN when the update holds Inf/NaN
  or the norm itself exceeds float32 (~3.4e38). Inactive clients get 0.

  Args:
    client_updates: pytree, every leaf float[C, ...].
    active: bool[C]; inactive rows are never read.
    mask: optional pytree of masks, leaves [...] (shared) or [C, ...] (per
      client), values in {0, 1}.
  """
  num_clients = active.shape[0]

  def flat(leaf, leaf_mask=None):
    x = read_rows(leaf, active)
    if leaf_mask is not None:
      x = x * leaf_mask.astype(x.dtype)
    return x.reshape(num_clients, -1)

  if mask is None:
    xs = [flat(leaf) for leaf in jax.tree.leaves(client_updates)]
  else:
    xs = jax.tree.leaves(jax.tree.map(flat, client_updates, mask))
  # max propagates NaN, so a NaN anywhere in a row makes its norm NaN.
  scale = functools.reduce(
      jnp.maximum, [jnp.max(jnp.abs(x), axis=1, initial=0.0) for x in xs]
  )
  exponent = jnp.clip(jnp.frexp(scale)[1], -126, 126)
  one = jnp.ones_like(scale)
  down = jnp.ldexp(one, -exponent)
  sq = sum(jnp.sum(jnp.square(x * down[:, None].astype(x.dtype)), axis=1) for x in xs)
  return (jnp.sqrt(sq) * jnp.ldexp(one, exponent)).astype(jnp.float32)


def screen(client_updates: ClientUpdates, participating: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The clients a round aggregates: participants whose update has a finite norm.

  Returns:
    ``(active, norms)``: bool[C] participants with a finite (stable) L2 norm,
    hence a finite update; and their norms f32[C] (0 for non-participants,
    non-finite for the excluded ``participating & ~active``).
  """
  norms = l2_norms(client_updates, participating)
  return participating & jnp.isfinite(norms), norms


def num_coordinates(tree: Updates) -> int:
  """Number of coordinates of one client's update (static)."""
  return sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree.leaves(tree))


def share(kept: jax.Array, total: int) -> jax.Array:
  """``kept / total`` as f32[]: exactly 1 when all are kept.

  XLA may divide by a constant as a multiply by its reciprocal (1 - 6e-8 for
  a full mask), so the full case is selected, not computed.
  """
  kept = jnp.asarray(kept, jnp.float32)
  return jnp.where(kept == total, 1.0, kept / max(total, 1)).astype(jnp.float32)
