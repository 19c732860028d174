"""Paper-style tables and the selection of reported cells: hand-computed cases."""

import csv
import io

import numpy as np
import pytest

from fedjax_graph import comparison, tables

DOMAINS = ["A", "B"]


def _result(test_acc, val_acc=None, classes=None, fedia=(True, False), momentum=(True, False),
            rho=(0.3, 1.0), beta=(0.7, 1.0)):
  """A RunResult from test_acc [S, G', T, D]."""
  test_acc = np.asarray(test_acc, np.float32)
  s, g, t, d = test_acc.shape
  return comparison.RunResult(
      test_acc, test_acc if val_acc is None else np.asarray(val_acc, np.float32),
      np.full((s, g, t, d), 2) if classes is None else classes, np.zeros((s, g, t, 3), bool),
      np.zeros((s, g, t, 3), np.float32), np.array(rho), np.array(beta), np.array(fedia),
      np.array(momentum), 1.0)


def test_final_accuracy_averages_the_last_rounds_per_seed_then_domains():
  acc = np.array([[[0.1, 0.5], [0.3, 0.7], [0.5, 0.9]],     # seed 0, T=3, D=2
                  [[0.2, 0.2], [0.4, 0.4], [0.6, 0.6]]])    # seed 1
  got = tables.final_accuracy(acc, last=2)
  np.testing.assert_allclose(got, [[40.0, 80.0, 60.0], [50.0, 50.0, 50.0]])


def test_convergence_status_names_nan_and_constant_prediction():
  acc = np.full((3, 4, 2), 0.6)
  classes = np.full((3, 4, 2), 2)
  assert tables.convergence_status(acc, classes, 0, last=2) == "ok"
  assert tables.convergence_status(acc, classes, 5, last=2) == (
      "ok (5 non-finite client updates skipped)")
  collapsed = classes.copy()
  collapsed[1, -2:] = 1
  assert tables.convergence_status(acc, collapsed, 0, last=2) == (
      "NC: constant prediction (1/3 seeds)")
  collapsed[1, -1, 0] = 2  # one domain still sees two classes in the final rounds
  assert tables.convergence_status(acc, collapsed, 0, last=2) == "ok"
  with_nan = acc.copy()
  with_nan[0, -1, 1] = np.nan
  assert tables.convergence_status(with_nan, classes, 0, last=2) == "NC: NaN accuracy (1/3 seeds)"


def test_rows_deltas_and_formats():
  # Two seeds, cells (+FedIA, base), T=1: base 60/40, +FedIA 62/43 in seed 0; 58/40 vs 60/41.
  acc = np.array([[[[0.62, 0.43]], [[0.60, 0.40]]],
                  [[[0.60, 0.41]], [[0.58, 0.40]]]])
  result = _result(acc)
  rows = comparison.add_deltas([
      comparison.make_row(result, 1, "FedAvg", "fedavg", "base", last=1),
      comparison.make_row(result, 0, "FedAvg+FedIA", "fedavg", "+FedIA", last=1)])
  base, plus = rows
  np.testing.assert_allclose(base.mean, [59.0, 40.0, 49.5], rtol=1e-5)
  np.testing.assert_allclose(base.std, [1.0, 0.0, 0.5], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(plus.delta_base, [2.0, 2.0, 2.0], atol=1e-5)
  assert plus.delta_fedavg == pytest.approx(2.0, abs=1e-5) and base.delta_fedavg is None
  assert (plus.rho, plus.beta, base.rho, base.beta) == (pytest.approx(0.3), pytest.approx(0.7),
                                                        None, None)

  markdown = tables.to_markdown(rows, DOMAINS, "t")
  assert "| FedAvg |  | 59.00±1.00 | 40.00±0.00 | 49.50±0.50 |  |  |" in markdown
  assert "| FedAvg+FedIA | ρ=0.3, β=0.7 | 61.00±1.00 ▲+2.00 |" in markdown
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv(rows, DOMAINS))))
  assert parsed[0]["A_mean"] == "59.0000" and parsed[0]["delta_fedavg"] == ""
  assert parsed[1]["AVG_delta_base"] == "2.0000" and parsed[1]["rho"] == "0.3"
  latex = tables.to_latex(rows, DOMAINS, "ρ=0.3, β=0.7")
  assert r"$61.00_{\pm 1.00}^{\uparrow2.00}$ & " in latex and r"\toprule" in latex
  assert r"$51.50_{\pm 1.00}^{\uparrow2.00}$ & $+2.00$ \\" in latex  # AVG, then Δ FedAvg
  assert r"\caption{$\rho$=0.3, $\beta$=0.7}" in latex


def test_non_converged_rows_show_the_reason_not_numbers():
  acc = np.full((1, 2, 2, 2), 0.5)
  classes = np.full((1, 2, 2, 2), 2)
  classes[0, 0] = 1  # the +FedIA cell predicts one class everywhere
  result = _result(acc, classes=classes)
  rows = comparison.add_deltas([
      comparison.make_row(result, 1, "FedAvg", "fedavg", "base", last=2),
      comparison.make_row(result, 0, "FedAvg+FedIA", "fedavg", "+FedIA", last=2)])
  markdown = tables.to_markdown(rows, DOMAINS)
  assert "| FedAvg+FedIA | ρ=0.3, β=0.7 | NC: constant prediction (1/1 seeds) |" in markdown
  assert "50.00" not in markdown.splitlines()[-1]
  assert r"\multicolumn{4}{c}{NC: constant prediction (1/1 seeds)}" in tables.to_latex(
      rows, DOMAINS)


def test_select_val_picks_the_best_validation_cell_not_the_best_test_cell():
  # Cells: three FedIA cells then the base. Test favours cell 0, validation cell 2.
  test = np.array([[[[0.9, 0.9]], [[0.5, 0.5]], [[0.4, 0.4]], [[0.3, 0.3]]]])
  val = np.array([[[[0.2, 0.2]], [[0.5, 0.5]], [[0.8, 0.6]], [[0.9, 0.9]]]])
  result = _result(test, val, fedia=(True, True, True, False),
                   momentum=(True, True, True, False), rho=(0.1, 0.3, 0.5, 1.0),
                   beta=(0.1, 0.1, 0.1, 1.0))
  assert comparison.select_cell(result, "val", last=1) == 2
  assert comparison.select_cell(result, "fixed", last=1) == 0


def test_one_seed_spread_is_over_the_final_rounds():
  acc = np.array([[[0.5, 0.7], [0.6, 0.8], [0.7, 0.9]]])  # one seed, T=3, D=2
  mean, std = tables.final_spread(acc, last=2)
  np.testing.assert_allclose(mean, [65.0, 85.0, 75.0])
  np.testing.assert_allclose(std, [5.0, 5.0, 5.0], rtol=1e-6)


def test_method_config_errors_name_the_file_and_key():
  from fedjax_graph import methods
  check = lambda raw: methods.check_method_config(raw, "my.yaml")
  with pytest.raises(ValueError, match="my.yaml: must be a mapping with the keys"):
    check(None)
  with pytest.raises(ValueError, match=r"my.yaml: unknown key\(s\) \['colour'\]"):
    check({"hparams": {}, "colour": 1})
  with pytest.raises(ValueError, match="my.yaml: hparams.fedprx: unknown method"):
    check({"hparams": {"fedprx": {"mu": 5.0}}})
  with pytest.raises(ValueError, match=r"my.yaml: fedia.default = 0.5; must be \[rho, beta\]"):
    check({"fedia": {"default": 0.5}})
  with pytest.raises(ValueError, match=r"fedia.twitch.s1.moon: rho = 1.5; the mask ratio"):
    check({"fedia": {"twitch": {"s1": {"moon": [1.5, 0.5]}}}})
  with pytest.raises(ValueError, match="fedia.twitch.s1.moon = \\['a', 0.5\\]"):
    check({"fedia": {"twitch": {"s1": {"moon": ["a", 0.5]}}}})
  ok = check({"hparams": {"fedprox": {"mu": 0.1}}})
  assert ok["fedia"]["default"] == (0.5, 0.5) and ok["hparams"]["fedprox"] == {"mu": 0.1}
