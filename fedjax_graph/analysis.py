"""Final-rounds statistics: the one definition behind summary.csv and every table.

A run is summarised by each seed's mean over its final ``last`` rounds, per
domain and for AVG (the unweighted mean over domains). Comparisons between
two cells are paired: the cells of one seed share the partition, the initial
model, the dropout keys and the client sample, so the per-seed difference
removes that seed's luck, and its spread over seeds gives a t-interval.

Numpy and scipy only (no jax), so saved histories can be re-analysed anywhere.
Shapes follow ``fedjax_graph/types.py`` (S seeds, T rounds, D domains).
Accuracy-like inputs are fractions in [0, 1] and come out in percent; NaN (a
diverged run) propagates into every statistic it touches.
"""

import math
from typing import NamedTuple

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


class PairedDelta(NamedTuple):
  """Mean per-seed difference of two paired runs, with its 95 % t-interval.

  Attributes:
    mean: f64[K] percentage points (K = D + 1 for per-domain values then AVG),
      mean over seeds of the per-seed differences.
    half_width: f64[K] points, half-width of the 95 % paired t-interval over
      seeds, t_{0.975, S-1} sd / sqrt(S) with the sample sd (ddof=1); NaN with
      one seed (no spread to estimate).
    num_seeds: S.
  """
  mean: np.ndarray
  half_width: np.ndarray
  num_seeds: int


def check_last(last, num_rounds: int) -> int:
  """``last`` as an int after checking it is an integer in [1, ``num_rounds``].

  Raises:
    ValueError: naming ``last`` when it is not an integer in [1, T].
  """
  # bool is an int subclass but `last=True` is certainly a caller bug.
  if isinstance(last, bool) or not isinstance(last, (int, np.integer)):
    raise ValueError(f"last={last!r} must be an integer in [1, {num_rounds}]")
  if not 1 <= last <= num_rounds:
    raise ValueError(f"last={int(last)} is out of range: must be in [1, T={num_rounds}]")
  return int(last)


def _final_percent(values: np.ndarray, last: int) -> np.ndarray:
  """f64[S, last, D + 1] percent: the final rounds, AVG over domains appended per round."""
  values = np.asarray(values, np.float64)
  if values.ndim != 3:
    raise ValueError(f"values must be [S, T, D], got shape {values.shape}")
  tail = 100.0 * values[:, -check_last(last, values.shape[1]):]
  return np.concatenate([tail, tail.mean(axis=-1, keepdims=True)], axis=-1)


def final_rounds(values: np.ndarray, last: int) -> np.ndarray:
  """f64[S, D + 1] percent: each seed's mean over the final ``last`` rounds, per domain, then AVG.

  Args:
    values: [S, T, D] fractions in [0, 1] (accuracy, balanced accuracy, F1).
    last: number of final rounds, 1 <= last <= T.

  Raises:
    ValueError: if ``values`` is not 3-D or ``last`` is out of range.
  """
  return _final_percent(values, last).mean(axis=1)


def spread(values: np.ndarray, last: int) -> tuple[np.ndarray, np.ndarray, str]:
  """Mean and std f64[D + 1] percent of one run over seeds, and what the std is over.

  With 2+ seeds the std is the population std (ddof=0) over seeds of the
  per-seed final-rounds means (``"seeds"``); with one seed, as in the paper,
  the only spread left is over its final rounds (``"rounds"``, ddof=0).

  Args:
    values: [S, T, D] fractions. last: as for ``final_rounds``.

  Returns:
    (mean, std, std_over) with std_over ``"seeds"`` or ``"rounds"``.
  """
  tail = _final_percent(values, last)
  per_seed = tail.mean(axis=1)
  if per_seed.shape[0] >= 2:
    return per_seed.mean(axis=0), per_seed.std(axis=0), "seeds"
  return per_seed[0], tail[0].std(axis=0), "rounds"


def paired_interval(differences: np.ndarray) -> PairedDelta:
  """The mean and 95 % paired t-interval of per-seed differences f64[S, K] (points)."""
  differences = np.asarray(differences, np.float64)
  num_seeds = differences.shape[0]
  if num_seeds < 2:
    half_width = np.full(differences.shape[1:], np.nan)
  else:
    t = stats.t.ppf(0.5 + CONFIDENCE / 2, num_seeds - 1)
    half_width = t * differences.std(axis=0, ddof=1) / math.sqrt(num_seeds)
  return PairedDelta(differences.mean(axis=0), half_width, num_seeds)


def paired_delta(a: np.ndarray, b: np.ndarray, last: int) -> PairedDelta:
  """Run ``a`` minus run ``b`` (same seeds, paired) per domain and AVG, in points.

  Args:
    a, b: [S, T, D] fractions of two cells over the same seeds, seed s of
      ``a`` paired with seed s of ``b``.
    last: as for ``final_rounds``.

  Raises:
    ValueError: if the shapes differ or ``last`` is out of range.
  """
  if np.shape(a) != np.shape(b):
    raise ValueError(f"paired runs must have one shape, got {np.shape(a)} and {np.shape(b)}")
  return paired_interval(final_rounds(a, last) - final_rounds(b, last))


def significant(delta: PairedDelta) -> np.ndarray:
  """bool[K]: the 95 % interval excludes 0 (all False with one seed or NaN)."""
  if delta.num_seeds < 2:
    return np.zeros(np.shape(delta.mean), bool)
  return np.abs(delta.mean) > delta.half_width  # NaN compares False


def format_delta(delta: PairedDelta, j: int) -> str:
  """Entry j as text: ``+1.23±0.45`` (mean ± half-width), ``+1.23 (1 seed)``, or "" for NaN."""
  mean = float(delta.mean[j])
  if math.isnan(mean):
    return ""
  if delta.num_seeds < 2:
    return f"{mean:+.2f} (1 seed)"
  return f"{mean:+.2f}±{float(delta.half_width[j]):.2f}"


def constant_domains(predicted_classes: np.ndarray, last: int) -> np.ndarray:
  """bool[S, D]: at most one class predicted on the domain's test nodes in each of the final rounds.

  Such a model scores its domain's class share whatever it learned, so its
  accuracy there measures nothing about aggregation.

  Args:
    predicted_classes: i32[S, T, D] distinct classes predicted per round on
      each domain's test nodes.
    last: as for ``final_rounds``.
  """
  predicted_classes = np.asarray(predicted_classes)
  last = check_last(last, predicted_classes.shape[1])
  return (predicted_classes[:, -last:] <= 1).all(axis=1)


# Twitch and WikiNet runs that learn move a domain's accuracy by < 1 point per
# round at the end; runs whose client weights flip between two winners move
# it by 20-26 points each round (two near-constant models taking turns).
OSCILLATION_POINTS = 10.0


def oscillating_domains(test_acc: np.ndarray, last: int,
                        threshold: float = OSCILLATION_POINTS) -> np.ndarray:
  """bool[S, D]: mean |change| of the domain's accuracy between final rounds > ``threshold`` points.

  A model that alternates between two near-constant predictions (e.g. one
  class in even rounds, the other in odd rounds) averages over the final
  rounds to a score between the two class shares, yet never ends at one
  predicted class, so ``constant_domains`` does not see it. Its mean over the
  final rounds measures nothing about aggregation either.

  Args:
    test_acc: [S, T, D] fractions in [0, 1]; the final ``last`` rounds must
      all be evaluated (they are, whatever the evaluation interval).
    last: as for ``final_rounds``; the swing is the mean of the ``last`` - 1
      absolute round-to-round changes (never with ``last`` = 1: all False).
    threshold: percentage points.
  """
  test_acc = np.asarray(test_acc, np.float64)
  last = check_last(last, test_acc.shape[1])
  if last < 2:
    return np.zeros((test_acc.shape[0], test_acc.shape[2]), bool)
  swing = 100.0 * np.abs(np.diff(test_acc[:, -last:], axis=1)).mean(axis=1)
  return swing > threshold  # NaN compares False: a NaN run is NC already


def loss_slope(train_loss: np.ndarray, last: int) -> np.ndarray:
  """f64[S]: least-squares slope of each seed's training loss over the final rounds (loss/round).

  Positive: the loss is rising; near 0: flat. NaN for a seed with a non-finite
  loss in the window, and for ``last`` = 1 (a slope needs two rounds).

  Args:
    train_loss: f32[S, T] mean client training loss per round.
    last: as for ``final_rounds``.
  """
  train_loss = np.asarray(train_loss, np.float64)
  last = check_last(last, train_loss.shape[1])
  if last < 2:
    return np.full(train_loss.shape[0], np.nan)
  x = np.arange(last) - (last - 1) / 2  # centred rounds
  y = train_loss[:, -last:]
  # inf - inf in the centring gives NaN, so one non-finite value makes it NaN
  # (on purpose: no warning).
  with np.errstate(invalid="ignore"):
    return ((y - y.mean(axis=1, keepdims=True)) * x).sum(axis=1) / (x * x).sum()
