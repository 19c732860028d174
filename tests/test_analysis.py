"""Final-rounds statistics, paired intervals, constant predictions and loss slopes, computed by hand."""

import math

import numpy as np
import pytest

from fedjax_graph import analysis

T_975_2 = 4.302653  # t quantile 0.975 with 2 degrees of freedom (tables)


def test_final_rounds_averages_the_last_rounds_per_seed_then_domains():
  acc = np.array([[[0.1, 0.5], [0.3, 0.7], [0.5, 0.9]],     # seed 0, T=3, D=2
                  [[0.2, 0.2], [0.4, 0.4], [0.6, 0.6]]])    # seed 1
  np.testing.assert_allclose(analysis.final_rounds(acc, last=2),
                             [[40.0, 80.0, 60.0], [50.0, 50.0, 50.0]])
  np.testing.assert_allclose(analysis.final_rounds(acc, last=3)[0], [30.0, 70.0, 50.0])


def test_spread_is_over_seeds_with_two_seeds_and_over_rounds_with_one():
  acc = np.array([[[0.1, 0.5], [0.3, 0.7], [0.5, 0.9]],
                  [[0.2, 0.2], [0.4, 0.4], [0.6, 0.6]]])
  mean, std, over = analysis.spread(acc, last=2)  # per seed 40/80/60 and 50/50/50
  np.testing.assert_allclose(mean, [45.0, 65.0, 55.0])
  np.testing.assert_allclose(std, [5.0, 15.0, 5.0])  # ddof=0; ddof=1 would be 7.07, 21.2
  assert over == "seeds"
  one = np.array([[[0.5, 0.7], [0.6, 0.8], [0.7, 0.9]]])
  mean, std, over = analysis.spread(one, last=2)  # rounds 60/80/70 and 70/90/80
  np.testing.assert_allclose(mean, [65.0, 85.0, 75.0])
  np.testing.assert_allclose(std, [5.0, 5.0, 5.0], rtol=1e-6)
  assert over == "rounds"


def _paired_runs():
  """a, b: [S=3, T=1, D=2]. Differences: A 1, 2, 3 points; B 2, 2, 2; AVG 1.5, 2, 2.5."""
  b = np.full((3, 1, 2), 0.5)
  a = b + np.array([[0.01, 0.02], [0.02, 0.02], [0.03, 0.02]])[:, None, :]
  return a, b


def test_paired_delta_mean_and_t_interval():
  delta = analysis.paired_delta(*_paired_runs(), last=1)
  assert delta.num_seeds == 3
  np.testing.assert_allclose(delta.mean, [2.0, 2.0, 2.0], rtol=1e-9)
  # sd (ddof=1): A 1, B 0, AVG 0.5; half-width t * sd / sqrt(3).
  np.testing.assert_allclose(delta.half_width, [2.484138, 0.0, 1.242069], rtol=1e-5, atol=1e-9)
  assert delta.half_width[0] == pytest.approx(T_975_2 / math.sqrt(3), rel=1e-6)
  # A's interval [-0.48, 4.48] holds 0; B's [2, 2] and AVG's [0.76, 3.24] do not.
  np.testing.assert_array_equal(analysis.significant(delta), [False, True, True])
  assert analysis.format_delta(delta, 0) == "+2.00±2.48"
  assert analysis.format_delta(delta, 2) == "+2.00±1.24"


def test_paired_delta_of_one_seed_has_no_interval():
  a, b = _paired_runs()
  delta = analysis.paired_delta(a[:1], b[:1], last=1)
  np.testing.assert_allclose(delta.mean, [1.0, 2.0, 1.5], rtol=1e-9)
  assert np.isnan(delta.half_width).all() and delta.num_seeds == 1
  assert not analysis.significant(delta).any()
  assert analysis.format_delta(delta, 0) == "+1.00 (1 seed)"


def test_paired_delta_negative_nan_and_shape_errors():
  a, b = _paired_runs()
  delta = analysis.paired_delta(b, a, last=1)
  assert analysis.format_delta(delta, 1) == "-2.00±0.00"
  assert analysis.significant(delta)[1]
  a[0, 0, 0] = np.nan
  delta = analysis.paired_delta(a, b, last=1)
  assert analysis.format_delta(delta, 0) == "" and not analysis.significant(delta)[0]
  with pytest.raises(ValueError, match="paired runs must have one shape"):
    analysis.paired_delta(a[:2], b, last=1)


def test_constant_domains_needs_one_class_in_every_final_round():
  classes = np.array([[[2, 1], [1, 1], [1, 2]],    # seed 0, T=3: A constant in the last 2
                      [[1, 2], [0, 2], [1, 2]]])   # seed 1: A constant throughout (0: no test node)
  np.testing.assert_array_equal(analysis.constant_domains(classes, last=2),
                                [[True, False], [True, False]])
  np.testing.assert_array_equal(analysis.constant_domains(classes, last=3),
                                [[False, False], [True, False]])


def test_oscillating_domains_is_the_mean_round_to_round_swing():
  # seed 0, A: swings of 22 points; seed 1, B: 6 and 11 points in the last 3 rounds
  acc = np.array([[[0.39, 0.60], [0.61, 0.60], [0.39, 0.61], [0.61, 0.62]],
                  [[0.10, 0.50], [0.50, 0.55], [0.55, 0.61], [0.52, 0.50]]])
  # seed 1, A: |0.05| and |-0.03| in the last 3 rounds = 4 points; B: (6 + 11) / 2 = 8.5 points
  np.testing.assert_array_equal(analysis.oscillating_domains(acc, last=3),
                                [[True, False], [False, False]])
  np.testing.assert_array_equal(analysis.oscillating_domains(acc, last=3, threshold=8.0),
                                [[True, False], [False, True]])
  # seed 1, A over all 4 rounds: (40 + 5 + 3) / 3 = 16 points
  assert analysis.oscillating_domains(acc, last=4)[1, 0]
  assert not analysis.oscillating_domains(acc, last=1).any()  # one round has no swing
  acc[0, -1, 0] = np.nan
  assert not analysis.oscillating_domains(acc, last=3)[0, 0]


def test_loss_slope_per_seed_and_non_finite_windows():
  loss = np.array([[9.0, 3.0, 2.0, 1.0],    # last 3: falls 1 per round
                   [0.0, 1.0, 1.0, 4.0],    # last 3: (-1 * 1 + 0 * 1 + 1 * 4) / 2 = 1.5
                   [1.0, 1.0, np.nan, 1.0],
                   [np.nan, 2.0, 2.0, 2.0]], np.float32)  # NaN before the window: ignored
  slope = analysis.loss_slope(loss, last=3)
  np.testing.assert_allclose(slope[[0, 1, 3]], [-1.0, 1.5, 0.0])
  assert np.isnan(slope[2])
  loss[0, -1] = np.inf
  assert np.isnan(analysis.loss_slope(loss, last=3)[0])
  assert np.isnan(analysis.loss_slope(loss, last=1)).all()  # one round has no slope


@pytest.mark.parametrize("last", [0, 4, True, 1.5])
def test_last_must_be_an_integer_in_range(last):
  with pytest.raises(ValueError, match=f"last={last!r}|last={last}"):
    analysis.final_rounds(np.zeros((1, 3, 2)), last)
