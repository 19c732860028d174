"""Paper-style tables and the selection of reported cells: hand-computed cases."""

import csv
import io

import numpy as np
import pytest

from fedjax_graph import tables

DOMAINS = ["A", "B"]


def _result(test_acc, val_acc=None, classes=None, bacc=None, loss=None, fedia=(True, False),
            momentum=(True, False), rho=(0.3, 1.0), beta=(0.7, 1.0)):
  """A RunResult from test_acc [S, G', T, D]; balanced accuracy and F1 = accuracy unless given."""
  test_acc = np.asarray(test_acc, np.float32)
  s, g, t, d = test_acc.shape
  as_f32 = lambda x, default: default if x is None else np.asarray(x, np.float32)
  kinds = ["fedia" if f and m else "fedia_im" if f else "fedavg" for f, m in zip(fedia, momentum)]
  hparams = {"rho": np.where(fedia, rho, np.nan), "beta": np.where(momentum, beta, np.nan)}
  return tables.RunResult(
      test_acc, as_f32(val_acc, test_acc), np.full((s, g, t, d), 2) if classes is None else classes,
      as_f32(bacc, test_acc), test_acc, as_f32(loss, np.zeros((s, g, t), np.float32)),
      np.zeros((s, g, t, 3), bool), np.zeros((s, g, t, 3), np.float32),
      np.array([f"cell {i}" for i in range(g)]), np.array(kinds), hparams, 1.0)


def _row(result, g, label, method, variant, last):
  variant = {"+FedIA": "+fedia", "+IM": "+fedia_im"}.get(variant, variant)
  return tables.make_row(result, g, method, variant, last)._replace(label=label)


def _pair(result, last=1, label="FedAvg", method="fedavg"):
  return tables.add_deltas([
      _row(result, 1, label, method, "base", last),
      _row(result, 0, f"{label}+FedIA", method, "+FedIA", last)])


def _tables(markdown):
  """The accuracy and the balanced-accuracy parts of a table.md."""
  acc, bacc = markdown.split("Balanced accuracy (%):")
  assert "Test accuracy (%):" in acc
  return acc, bacc


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


# Two seeds, cells (+FedIA, base), T=1: base A 60/58, B 40/40; +FedIA A 62/60, B 43/41.
# Paired differences: A 2, 2 (sd 0); B 3, 1 (sd √2, half-width t_{0.975,1} = 12.71);
# AVG 2.5, 1.5 (sd √2/2, half-width 12.706 / 2 = 6.35).
TWO_SEEDS = np.array([[[[0.62, 0.43]], [[0.60, 0.40]]],
                      [[[0.60, 0.41]], [[0.58, 0.40]]]])


def test_paired_deltas_and_arrows_only_where_the_interval_excludes_0():
  base, plus = _pair(_result(TWO_SEEDS, bacc=np.concatenate(
      [np.full((2, 1, 1, 2), 0.45), np.full((2, 1, 1, 2), 0.5)], axis=1)))
  np.testing.assert_allclose(base.acc.mean, [59.0, 40.0, 49.5], rtol=1e-5)
  np.testing.assert_allclose(base.acc.std, [1.0, 0.0, 0.5], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(plus.acc.delta_base.mean, [2.0, 2.0, 2.0], atol=1e-5)
  np.testing.assert_allclose(plus.acc.delta_base.half_width, [0.0, 12.7062, 6.3531], rtol=1e-4,
                             atol=1e-4)
  assert base.acc.delta_base is None and base.acc.delta_fedavg is None
  np.testing.assert_allclose(plus.acc.delta_fedavg.mean, plus.acc.delta_base.mean)
  assert plus.hparam_dict == {"rho": pytest.approx(0.3), "beta": pytest.approx(0.7)}
  assert base.hparams == ()

  acc, bacc = _tables(tables.to_markdown([base, plus], DOMAINS, "t"))
  assert "| FedAvg |  | 59.00±1.00 | 40.00±0.00 | 49.50±0.50 |  |" in acc
  assert ("| FedAvg+FedIA | ρ=0.3, β=0.7 | 61.00±1.00 ▲+2.00±0.00 | 42.00±1.00 +2.00±12.71 "
          "| 51.50±1.00 +2.00±6.35 | +2.00±6.35 |") in acc
  assert "▲/▼ only where that interval excludes 0" in acc and "ᶜ" not in acc
  # Balanced accuracy 50 -> 45 in both seeds: a significant loss.
  assert ("| FedAvg+FedIA | ρ=0.3, β=0.7 | 45.00±0.00 ▼-5.00±0.00 | 45.00±0.00 ▼-5.00±0.00 "
          "| 45.00±0.00 ▼-5.00±0.00 | ▼-5.00±0.00 |") in bacc

  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert parsed[0]["A_mean"] == "59.0000" and parsed[0]["delta_fedavg"] == ""
  assert parsed[1]["AVG_delta_base"] == "2.0000" and parsed[1]["AVG_delta_base_ci"] == "6.3531"
  assert parsed[1]["B_delta_base_ci"] == "12.7062" and parsed[1]["delta_fedavg_ci"] == "6.3531"
  assert parsed[1]["A_bacc_mean"] == "45.0000" and parsed[1]["AVG_bacc_delta_base"] == "-5.0000"
  assert parsed[1]["bacc_delta_fedavg"] == "-5.0000" and parsed[1]["rho"] == "0.3"
  assert (parsed[1]["A_constant"], parsed[1]["num_seeds"]) == ("0", "2")

  latex = tables.to_latex([base, plus], DOMAINS, "ρ=0.3, β=0.7")
  assert latex.count(r"\begin{table}") == 2 and r"\toprule" in latex
  assert r"$61.00_{\pm 1.00}^{\uparrow+2.00 \pm 0.00}$ & " in latex
  assert r"$42.00_{\pm 1.00}^{+2.00 \pm 12.71}$ & " in latex  # no arrow
  assert r"$51.50_{\pm 1.00}^{+2.00 \pm 6.35}$ & $+2.00 \pm 6.35$ \\" in latex  # AVG, Δ FedAvg
  assert r"$45.00_{\pm 0.00}^{\downarrow-5.00 \pm 0.00}$" in latex  # the balanced-accuracy table
  assert r"\caption{$\rho$=0.3, $\beta$=0.7. Balanced accuracy (\%)." in latex


def test_one_seed_says_so_instead_of_an_interval_and_has_no_arrow():
  base, plus = _pair(_result(TWO_SEEDS[:1]))
  acc, _ = _tables(tables.to_markdown([base, plus], DOMAINS))
  assert "| 62.00±0.00 +2.00 (1 seed) | 43.00±0.00 +3.00 (1 seed) |" in acc
  rows = [line for line in acc.splitlines() if line.startswith("|")]
  assert not any("▲" in line or "▼" in line for line in rows) and "| +2.50 (1 seed) |" in acc
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert parsed[1]["A_delta_base"] == "2.0000" and parsed[1]["A_delta_base_ci"] == "nan"
  assert r"^{+2.00\,(1\,\mathrm{seed})}" in tables.to_latex([base, plus], DOMAINS)


def test_a_domain_constant_in_some_seeds_is_flagged_while_the_row_stays_ok():
  acc = np.full((3, 2, 2, 2), 0.5)
  classes = np.full((3, 2, 2, 2), 2)
  classes[:2, 0, :, 0] = 1  # +FedIA: A constant in seeds 0 and 1; B never
  classes[2, 0, 1, 0] = 1   # seed 2: only in the last round, not through the final 2
  base, plus = _pair(_result(acc, classes=classes), last=2)
  assert plus.status == "ok" and list(plus.constant) == [2, 0] and list(base.constant) == [0, 0]
  markdown = tables.to_markdown([base, plus], DOMAINS)
  acc_md, bacc_md = _tables(markdown)
  for part in (acc_md, bacc_md):
    assert "| FedAvg+FedIA | ρ=0.3, β=0.7 | 50.00±0.00 ᶜ2/3 +0.00±0.00 | 50.00±0.00 +0.00±0.00 |" in part
    assert "ᶜk/S: in k of S seeds" in part and "Constant: FedAvg+FedIA: A 2/3." in part
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert (parsed[1]["A_constant"], parsed[1]["B_constant"]) == ("2", "0")
  assert r"$50.00_{\pm 0.00}^{+0.00 \pm 0.00}$\,\textsuperscript{c}2/3 & " in tables.to_latex(
      [base, plus], DOMAINS)


def test_a_domain_whose_accuracy_takes_turns_is_flagged_oscillating():
  acc = np.full((2, 2, 3, 2), 0.6)
  acc[0, 0, :, 0] = [0.4, 0.6, 0.4]  # +FedIA, seed 0, A: 20-point swings, 2 classes predicted
  acc[1, 0, :, 0] = [0.6, 0.55, 0.6]  # seed 1: 5-point swings, below the threshold
  # A: seed means 46.67 and 58.33: 52.50 ± 5.83
  base, plus = _pair(_result(acc), last=3)
  assert plus.status == "ok" and list(plus.constant) == [0, 0]
  assert list(plus.oscillating) == [1, 0] and list(base.oscillating) == [0, 0]
  acc_md, _ = _tables(tables.to_markdown([base, plus], DOMAINS))
  assert "| FedAvg+FedIA | ρ=0.3, β=0.7 | 52.50±5.83 ᵒ1/2 " in acc_md
  assert "ᵒk/S: in k of S seeds" in acc_md and "Oscillating: FedAvg+FedIA: A 1/2." in acc_md
  assert "ᶜk/S" not in acc_md
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert (parsed[1]["A_oscillating"], parsed[1]["B_oscillating"], parsed[0]["A_oscillating"]) == (
      "1", "0", "0")
  assert r"\,\textsuperscript{o}1/2 & " in tables.to_latex([base, plus], DOMAINS)


def test_reference_rows_get_delta_fedavg_only_and_fedavg_is_found_by_key():
  fedavg_run = _result(TWO_SEEDS)
  majority = _result(np.full((2, 1, 1, 2), 0.5), fedia=(False,), momentum=(False,), rho=(1.0,),
                     beta=(1.0,))
  rows = tables.add_deltas([  # the reference first: FedAvg's row is not at position 0
      _row(majority, 0, "Majority", "majority", "reference", 1),
      _row(fedavg_run, 1, "FedAvg", "fedavg", "base", 1),
      _row(fedavg_run, 0, "FedAvg+FedIA", "fedavg", "+FedIA", 1)])
  ref = rows[0]
  assert ref.acc.delta_base is None and ref.hparams == ()
  np.testing.assert_allclose(ref.acc.delta_fedavg.mean, [-9.0, 10.0, 0.5], atol=1e-5)
  acc, _ = _tables(tables.to_markdown(rows, DOMAINS))
  # Per seed AVG 50 - 50.0 and 50 - 49.0: +0.5 ± 12.706 * 0.7071 / 1.4142 = 6.35.
  assert "| Majority |  | 50.00±0.00 | 50.00±0.00 | 50.00±0.00 | +0.50±6.35 |" in acc
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv(rows, DOMAINS))))
  assert parsed[0]["variant"] == "reference" and parsed[0]["AVG_delta_base"] == ""
  assert parsed[0]["delta_fedavg"] == "0.5000"
  with pytest.raises(ValueError, match="variant = 'ref'"):
    _row(majority, 0, "Majority", "majority", "ref", 1)


def test_add_deltas_needs_a_base_row_and_the_same_seeds():
  base, plus = _pair(_result(TWO_SEEDS))
  with pytest.raises(ValueError, match="FedAvg\\+FedIA: no base row of method 'fedavg'"):
    tables.add_deltas([plus])
  one_seed = _row(_result(TWO_SEEDS[:1]), 0, "X+FedIA", "fedavg", "+FedIA", 1)
  with pytest.raises(ValueError, match="must share the seeds"):
    tables.add_deltas([base, one_seed])


def test_train_loss_slope_reaches_the_row_and_the_csv():
  loss = np.zeros((2, 2, 3), np.float32)
  loss[:, 0] = [[3.0, 2.0, 1.0], [3.0, 2.5, 2.0]]  # +FedIA: slopes -1 and -0.5
  acc = np.full((2, 2, 3, 2), 0.5)
  base, plus = _pair(_result(acc, loss=loss), last=3)
  assert plus.loss_slope == pytest.approx(-0.75) and base.loss_slope == 0.0
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert parsed[1]["train_loss_slope"] == "-7.5000e-01"


def test_non_converged_rows_show_the_reason_not_numbers():
  acc = np.full((1, 2, 2, 2), 0.5)
  classes = np.full((1, 2, 2, 2), 2)
  classes[0, 0] = 1  # the +FedIA cell predicts one class everywhere
  rows = _pair(_result(acc, classes=classes), last=2)
  acc_md, _ = _tables(tables.to_markdown(rows, DOMAINS))
  line = next(l for l in acc_md.splitlines() if l.startswith("| FedAvg+FedIA"))
  assert line == "| FedAvg+FedIA | ρ=0.3, β=0.7 | NC: constant prediction (1/1 seeds) |  |  |  |"
  assert "Constant: FedAvg+FedIA: A 1/1, B 1/1." in acc_md
  assert r"\multicolumn{4}{c}{NC: constant prediction (1/1 seeds)}" in tables.to_latex(
      rows, DOMAINS)


def test_skipped_updates_are_named_in_the_row_and_no_change_is_taken_against_an_nc_base():
  acc = np.full((1, 2, 2, 2), 0.5)
  classes = np.full((1, 2, 2, 2), 2)
  classes[0, 1] = 1  # the base cell predicts one class everywhere: NC
  result = _result(acc, classes=classes)
  nonfinite = np.zeros((1, 2, 2, 3), bool)
  nonfinite[0, 0, 0, :2] = True  # the +FedIA cell left out 2 client updates in round 0
  base, plus = _pair(result._replace(nonfinite=nonfinite), last=2)
  assert plus.status == "ok (2 non-finite client updates skipped)"
  assert plus.acc.delta_base is None and plus.acc.delta_fedavg is None
  acc_md, _ = _tables(tables.to_markdown([base, plus], DOMAINS))
  line = next(l for l in acc_md.splitlines() if l.startswith("| FedAvg+FedIA"))
  assert line == ("| FedAvg+FedIA (2 non-finite client updates skipped) | ρ=0.3, β=0.7 | "
                  "50.00±0.00 | 50.00±0.00 | 50.00±0.00 |  |")
  assert "FedAvg+FedIA (2 non-finite client updates skipped) ($\\rho$=0.3" in tables.to_latex(
      [base, plus], DOMAINS)
  parsed = list(csv.DictReader(io.StringIO(tables.to_csv([base, plus], DOMAINS))))
  assert parsed[1]["AVG_delta_base"] == "" and parsed[1]["delta_fedavg"] == ""


def test_select_val_picks_the_best_validation_cell_not_the_best_test_cell():
  # Cells: three FedIA cells then the base. Test favours cell 0, validation cell 2.
  test = np.array([[[[0.9, 0.9]], [[0.5, 0.5]], [[0.4, 0.4]], [[0.3, 0.3]]]])
  val = np.array([[[[0.2, 0.2]], [[0.5, 0.5]], [[0.8, 0.6]], [[0.9, 0.9]]]])
  result = _result(test, val, fedia=(True, True, True, False),
                   momentum=(True, True, True, False), rho=(0.1, 0.3, 0.5, 1.0),
                   beta=(0.1, 0.1, 0.1, 1.0))
  assert tables.select_cell(result, "fedia", "val", last=1) == 2
  assert tables.select_cell(result, "fedia", "fixed", last=1) == 0
  assert tables.validation_avg(result, 2, last=1) == pytest.approx(70.0)


def test_grid_heatmap_of_a_select_val_sweep_marks_what_it_draws(tmp_path):
  # Cells: FedIA (0.1, 0.1), (0.1, 0.5), (0.5, 0.1); GMA τ=0.3, 0.1; then the base. 3 seeds, T=1.
  base = np.full((3, 1, 2), 0.5)
  cells = [base + 0.01, base + np.array([-0.03, 0.0, 0.06])[:, None, None], base,
           base - 0.01, base + 0.02, base]
  test_acc = np.stack(cells, axis=1).astype(np.float32)  # [S, G', T, D]
  classes = np.full(test_acc.shape, 2)
  classes[0, 2, :, 1] = 1
  nan = np.nan
  result = tables.RunResult(
      test_acc=test_acc, val_acc=test_acc, predicted_classes=classes, test_bacc=test_acc,
      test_f1=test_acc, train_loss=np.zeros((3, 6, 1), np.float32),
      nonfinite=np.zeros((3, 6, 1, 3), bool), alpha=np.zeros((3, 6, 1, 3), np.float32),
      labels=np.array([f"cell {g}" for g in range(6)]),
      aggregators=np.array(["fedia"] * 3 + ["gma"] * 2 + ["fedavg"]),
      hparams={"rho": np.array([0.1, 0.1, 0.5, nan, nan, nan]),
               "beta": np.array([0.1, 0.5, 0.1, nan, nan, nan]),
               "tau": np.array([nan, nan, nan, 0.3, 0.1, nan])}, seconds=1.0)
  grid = tables.plot_grid_heatmap(result, DOMAINS, 1, tmp_path / "heatmap-fedprox.png",
                                  "t", "FedProx")
  assert (grid.row_name, grid.col_name) == ("rho", "beta")
  np.testing.assert_allclose(grid.delta[0], [1.0, 1.0], atol=1e-4)
  assert not grid.present[1, 1] and grid.delta[1, 0] == pytest.approx(0.0, abs=1e-6)
  # +1 in every seed is significant; -3, 0, +6 (hw 4.30 * 4.58 / √3 = 11.4) is not.
  np.testing.assert_array_equal(grid.significant, [[True, False], [False, False]])
  np.testing.assert_array_equal(grid.constant, [[False, False], [True, False]])
  assert (tmp_path / "heatmap-fedprox.png").read_bytes()[:4] == b"\x89PNG"
  # GMA's cells: one row over τ, sorted.
  gma = tables.plot_grid_heatmap(result, DOMAINS, 1, tmp_path / "heatmap-gma.png",
                                 aggregator="gma")
  assert (gma.row_name, gma.col_name) == (None, "tau")
  np.testing.assert_allclose(gma.col_values, [0.1, 0.3])
  np.testing.assert_allclose(gma.delta, [[2.0, -1.0]], atol=1e-4)
  np.testing.assert_array_equal(gma.significant, [[True, True]])
  with pytest.raises(ValueError, match="one base cell"):
    tables.plot_grid_heatmap(result._replace(aggregators=np.array(["fedia"] * 6)), DOMAINS, 1,
                             tmp_path / "x.png")
  with pytest.raises(ValueError, match="need fedheal grid cells"):
    tables.plot_grid_heatmap(result, DOMAINS, 1, tmp_path / "x.png", aggregator="fedheal")


def test_plot_table_draws_every_variant(tmp_path):
  base, plus = _pair(_result(TWO_SEEDS))
  majority = _row(_result(np.full((2, 1, 1, 2), 0.5), fedia=(False,),
                                     momentum=(False,), rho=(1.0,), beta=(1.0,)),
                             0, "Majority", "majority", "reference", 1)
  tables.plot_table(tables.add_deltas([base, plus, majority]), tmp_path / "table.png", "t")
  assert (tmp_path / "table.png").read_bytes()[:4] == b"\x89PNG"


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
  with pytest.raises(ValueError, match="my.yaml: fedia.twich: unknown dataset; choose from "
                                       "twitch, wikinet"):
    check({"fedia": {"twich": {"s1": {"moon": [0.5, 0.5]}}}})
  ok = check({"hparams": {"fedprox": {"mu": 0.1}}})
  assert ok["fedia"]["default"] == (0.5, 0.5) and ok["hparams"]["fedprox"] == {"mu": 0.1}


def test_a_setting_the_fedia_table_lacks_is_named():
  from fedjax_graph import comparison, methods
  mine = methods.check_method_config({"fedia": {"wikinet": {"defualt": {"fedavg": [0.9, 0.9]}}}},
                                     "my.yaml")
  note = comparison.unmatched_setting_note(mine, "wikinet", "default")
  assert note == ("my.yaml: fedia.wikinet has no entry for setting 'default' (it lists defualt), "
                  "so FedIA runs with fedia.default (rho=0.5, beta=0.5)")
  assert comparison.aggregator_setting(mine, "wikinet", "default", "fedavg", "fedia") == {
      "rho": 0.5, "beta": 0.5}  # what the note says
  assert comparison.unmatched_setting_note(mine, "wikinet", "defualt") is None
  assert comparison.unmatched_setting_note(mine, "twitch", "s1") is None  # nothing listed
  shipped = methods.method_defaults()
  assert all(comparison.unmatched_setting_note(shipped, "twitch", s) is None
             for s in ("s1", "s2", "s3"))


def test_a_method_config_file_replaces_the_shipped_values_key_by_key(tmp_path):
  from fedjax_graph import methods
  shipped = methods.method_defaults()
  mine = tmp_path / "mine.yaml"
  mine.write_text("hparams: {fgssl: {loss: code}}\nfedia: {twitch: {s1: {fedavg: [0.3, 0.7]}}}\n")
  merged = methods.method_defaults(mine)
  assert merged["source"] == str(mine) and shipped["source"] == str(methods.METHODS_FILE)
  assert merged["hparams"]["fgssl"] == {**shipped["hparams"]["fgssl"], "loss": "code"}
  assert merged["hparams"]["fedprox"] == shipped["hparams"]["fedprox"]
  s1 = merged["fedia"]["twitch"]["s1"]
  assert tuple(s1["fedavg"]) == (0.3, 0.7) and s1["fedprox"] == shipped["fedia"]["twitch"]["s1"]["fedprox"]
  assert merged["fedia"]["twitch"]["s3"] == shipped["fedia"]["twitch"]["s3"]
  assert merged["aggregators"] == shipped["aggregators"]
  mine.write_text("fgssl: {loss: code}\n")  # the section left out: an unknown key, named
  with pytest.raises(ValueError, match=r"mine.yaml: unknown key\(s\) \['fgssl'\]"):
    methods.method_defaults(mine)
