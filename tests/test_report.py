"""Tests for fedjax_graph.report, with answers computed by hand."""

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image as mpimg

from fedjax_graph import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOMAINS = ["cora", "dblp"]
NAN = float("nan")


def _fedavg_one_seed():
  """[S=1, T=4, D=2]. Last 2 rounds: cora .5,.7  dblp .6,.8."""
  return np.array([[[0.1, 0.3], [0.2, 0.3], [0.5, 0.6], [0.7, 0.8]]])


def _fedia_two_cells():
  """[G=2, S=1, T=4, D=2]. Cell 0 beats FedAvg by 5 points, cell 1 loses."""
  cell0 = [[0.0, 0.0], [0.0, 0.0], [0.6, 0.7], [0.8, 0.7]]
  cell1 = [[0.9, 0.9], [0.9, 0.9], [0.4, 0.5], [0.4, 0.5]]
  return np.array([[cell0], [cell1]])


def _runs(acc, classes=None, loss=None):
  """Runs whose balanced accuracy and F1 equal ``acc``; 2 classes, flat loss, unless given."""
  acc = np.asarray(acc, np.float64)
  return report.Runs(acc, acc, acc, np.full(acc.shape, 2) if classes is None else classes,
                     np.zeros(acc.shape[:-1]) if loss is None else loss)


def _summarize(fedavg_acc, fedia_acc, rho, beta, domains=DOMAINS, last=2, **kwargs):
  return report.summarize(_runs(fedavg_acc), _runs(fedia_acc), {"rho": rho, "beta": beta},
                          domains, last, **kwargs)


@pytest.fixture
def rows_one_seed():
  return _summarize(_fedavg_one_seed(), _fedia_two_cells(), rho=[0.5, 0.5], beta=[1.0, 2.0])


def _grid(rhos, betas, delta_fn, seeds=1, rounds=4):
  """Row-major ρ×β grid with FedIA = FedAvg + delta_fn(ρ, β) (fractions)."""
  rho = np.repeat(rhos, len(betas))
  beta = np.tile(betas, len(rhos))
  fedavg = np.full((seeds, rounds, 2), 0.6)
  fedavg[:, :, 1] = 0.5
  fedavg += np.linspace(0, 0.1, rounds)[None, :, None]
  fedia = np.stack([fedavg + delta_fn(r, b) for r, b in zip(rho, beta)])
  return fedavg, fedia, rho, beta


def _assert_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
  img = mpimg.imread(path)
  assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50


def _assert_no_temp_files(directory, expected):
  assert sorted(os.listdir(directory)) == sorted(expected)


# ----------------------------------------------------------------- summarize


def test_columns_in_exact_order(rows_one_seed):
  stats = lambda metric: [f"{d}{metric}_{s}" for d in DOMAINS + ["avg"] for s in ("mean", "std")]
  expected = (["method", "rho", "beta"] + stats("") + stats("_bacc") + stats("_f1")
              + ["std_over", "delta_avg", "delta_avg_ci", "delta_bacc", "constant_domains",
                 "oscillating_domains", "train_loss_slope", "skipped_updates"])
  assert expected[3:9] == ["cora_mean", "cora_std", "dblp_mean", "dblp_std", "avg_mean",
                           "avg_std"]
  assert expected[9:11] == ["cora_bacc_mean", "cora_bacc_std"]
  assert report.summary_columns(DOMAINS, ("rho", "beta")) == expected
  for row in rows_one_seed:
    assert list(row) == expected


def test_new_columns_three_paired_seeds_by_hand():
  # S=3, T=2, D=2. FedAvg: accuracy 0.5, balanced accuracy 0.4, F1 0.3 everywhere.
  fedavg = report.Runs(np.full((3, 2, 2), 0.5), np.full((3, 2, 2), 0.4), np.full((3, 2, 2), 0.3),
                       np.full((3, 2, 2), 2), np.zeros((3, 2)))
  # The cell gains 2, 4, 6 points on cora in seeds 0, 1, 2 (AVG +1, +2, +3) and 5 points of
  # balanced accuracy; seed 1 predicts one class on dblp in both rounds, seed 2 on cora in
  # the last round only; the loss falls 0.5 and 0.3 and rises 0.3 over the two rounds.
  acc = np.full((3, 2, 2), 0.5)
  acc[:, :, 0] += np.array([0.02, 0.04, 0.06])[:, None]
  classes = np.full((3, 2, 2), 2)
  classes[1, :, 1] = 1
  classes[2, 1, 0] = 1
  loss = np.array([[1.0, 0.5], [1.0, 0.7], [1.0, 1.3]])
  cell = report.Runs(acc, np.full((3, 2, 2), 0.45), np.full((3, 2, 2), 0.3), classes, loss)
  rows = report.summarize(fedavg, report.Runs(*(x[None] for x in cell)),
                          {"rho": [0.3], "beta": [0.5]}, DOMAINS, last=2, skipped=[0, 4])
  expected = {
      "method": "fedavg+fedia", "rho": 0.3, "beta": 0.5,
      "cora_mean": 54.0, "cora_std": math.sqrt(8 / 3),  # 52, 54, 56 (ddof=0)
      "dblp_mean": 50.0, "dblp_std": 0.0,
      "avg_mean": 52.0, "avg_std": math.sqrt(2 / 3),    # 51, 52, 53
      "cora_bacc_mean": 45.0, "cora_bacc_std": 0.0, "dblp_bacc_mean": 45.0,
      "dblp_bacc_std": 0.0, "avg_bacc_mean": 45.0, "avg_bacc_std": 0.0,
      "cora_f1_mean": 30.0, "cora_f1_std": 0.0, "dblp_f1_mean": 30.0, "dblp_f1_std": 0.0,
      "avg_f1_mean": 30.0, "avg_f1_std": 0.0, "std_over": "seeds",
      "delta_avg": 2.0, "delta_avg_ci": 4.302653 / math.sqrt(3),  # sd of 1, 2, 3 is 1
      "delta_bacc": 5.0, "constant_domains": 1, "oscillating_domains": 0,
      "train_loss_slope": (-0.5 - 0.3 + 0.3) / 3, "skipped_updates": 4}
  assert list(rows[1]) == list(expected)
  for key, value in expected.items():
    assert rows[1][key] == (pytest.approx(value, rel=1e-6, abs=1e-9)
                            if isinstance(value, float) else value), key
  # Counted over the last round only, seed 2's cora joins in.
  assert report.summarize(fedavg, report.Runs(*(x[None] for x in cell)),
                          {"rho": [0.3], "beta": [0.5]}, DOMAINS,
                          last=1)[1]["constant_domains"] == 2
  base = rows[0]
  assert (base["delta_avg"], base["delta_avg_ci"], base["delta_bacc"]) == (0.0, "", 0.0)
  assert (base["constant_domains"], base["train_loss_slope"]) == (0, 0.0)
  # Seed 0's dblp accuracy jumps 12 points from one round to the next: oscillating (> 10).
  swinging = acc.copy()
  swinging[0, 1, 1] = 0.62
  swing = lambda last: report.summarize(
      fedavg, report.Runs(*(x[None] for x in cell._replace(acc=swinging))),
      {"rho": [0.3], "beta": [0.5]}, DOMAINS, last=last)[1]["oscillating_domains"]
  assert (swing(2), swing(1)) == (1, 0)  # one final round has no swing


def test_single_seed_means_std_over_rounds_and_delta(rows_one_seed):
  fedavg, cell0, cell1 = rows_one_seed
  assert (fedavg["method"], fedavg["rho"], fedavg["beta"]) == ("fedavg", "",
                                                               "")
  # cora .5,.7 -> 60 ± 10; dblp .6,.8 -> 70 ± 10; AVG per round .55,.75.
  assert fedavg["cora_mean"] == pytest.approx(60.0)
  assert fedavg["cora_std"] == pytest.approx(10.0)
  assert fedavg["dblp_mean"] == pytest.approx(70.0)
  assert fedavg["dblp_std"] == pytest.approx(10.0)
  assert fedavg["avg_mean"] == pytest.approx(65.0)
  assert fedavg["avg_std"] == pytest.approx(10.0)
  assert fedavg["std_over"] == "rounds"
  assert fedavg["delta_avg"] == 0.0

  # cora .6,.8 -> 70 ± 10; dblp .7,.7 -> 70 ± 0; AVG .65,.75 -> 70 ± 5.
  assert (cell0["method"], cell0["rho"], cell0["beta"]) == ("fedavg+fedia",
                                                            0.5, 1.0)
  assert cell0["cora_mean"] == pytest.approx(70.0)
  assert cell0["cora_std"] == pytest.approx(10.0)
  assert cell0["dblp_mean"] == pytest.approx(70.0)
  assert cell0["dblp_std"] == pytest.approx(0.0)
  assert cell0["avg_mean"] == pytest.approx(70.0)
  assert cell0["avg_std"] == pytest.approx(5.0)
  assert cell0["delta_avg"] == pytest.approx(5.0)

  # Early rounds (0.9) must be ignored: cora 40, dblp 50, AVG 45.
  assert cell1["avg_mean"] == pytest.approx(45.0)
  assert cell1["avg_std"] == pytest.approx(0.0)
  assert cell1["delta_avg"] == pytest.approx(-20.0)


def test_two_seeds_std_over_seeds_ddof0():
  fedavg = np.array([
      [[0.1, 0.3], [0.2, 0.3], [0.5, 0.6], [0.7, 0.8]],  # means .6, .7
      [[0.0, 0.0], [0.0, 0.0], [0.8, 0.6], [0.8, 0.6]],  # means .8, .6
  ])
  rows = _summarize(fedavg, fedavg[None] + 0.01, rho=[1.0], beta=[0.1])
  base = rows[0]
  assert base["std_over"] == "seeds"
  assert base["cora_mean"] == pytest.approx(70.0)
  assert base["cora_std"] == pytest.approx(10.0)  # ddof=1 would be 14.14.
  assert base["dblp_mean"] == pytest.approx(65.0)
  assert base["dblp_std"] == pytest.approx(5.0)
  # Per-seed AVG: .65 and .70.
  assert base["avg_mean"] == pytest.approx(67.5)
  assert base["avg_std"] == pytest.approx(2.5)
  assert rows[1]["std_over"] == "seeds"
  assert rows[1]["delta_avg"] == pytest.approx(1.0)


def test_last_equal_to_t_uses_all_rounds():
  fedavg = _fedavg_one_seed()
  rows = _summarize(fedavg, fedavg[None], [1.0], [1.0], last=4)
  assert rows[0]["cora_mean"] == pytest.approx(37.5)
  assert rows[1]["delta_avg"] == pytest.approx(0.0)


def test_nan_propagates_to_the_cell():
  fedia = _fedia_two_cells()
  fedia[1, 0, 3, 0] = np.nan
  rows = _summarize(_fedavg_one_seed(), fedia, [0.5, 0.5], [1.0, 2.0])
  assert math.isnan(rows[2]["cora_mean"])
  assert math.isnan(rows[2]["avg_mean"])
  assert math.isnan(rows[2]["delta_avg"])
  assert math.isnan(rows[2]["delta_avg_ci"])  # one seed: no interval either way
  assert rows[2]["dblp_mean"] == pytest.approx(50.0)
  assert rows[1]["delta_avg"] == pytest.approx(5.0)


@pytest.mark.parametrize("last", [0, 5, -1])
def test_last_out_of_range_names_value(last):
  with pytest.raises(ValueError, match=f"last={last}"):
    _summarize(_fedavg_one_seed(), _fedia_two_cells(), [0.5, 0.5], [1.0, 2.0], last=last)


@pytest.mark.parametrize("kwargs, match", [
    (dict(cells=_runs(np.zeros((2, 1, 3, 2)))), "does not match"),
    (dict(base=_runs(np.zeros((4, 2)))), r"\[S, T, D\]"),
    (dict(base=_runs(_fedavg_one_seed())._replace(train_loss=np.zeros((1, 3)))),
     r"base.train_loss has shape \(1, 3\); expected \(1, 4\)"),
    (dict(cells=_runs(_fedia_two_cells())._replace(bacc=np.zeros((2, 1, 4, 1)))),
     "cells.bacc has shape"),
    (dict(hparams={"rho": [0.5], "beta": [1.0, 2.0]}),
     r"'rho' has shape \(1,\); expected \(G,\)=\(2,\)"),
    (dict(hparams={"avg_mean": [0.5, 0.5]}), r"\['avg_mean'\] clash"),
    (dict(hparams={"x_mean": [0.5, 0.5]}), "clash"),
    (dict(cell_method="fedavg"), "both 'fedavg'"),
    (dict(domains=["cora"]), "domain names"),
    (dict(domains=["cora", "cora"]), "unique"),
    (dict(domains=["cora", "avg"]), "unique"),
])
def test_shape_and_domain_mismatch_raise(kwargs, match):
  args = dict(base=_runs(_fedavg_one_seed()), cells=_runs(_fedia_two_cells()),
              hparams={"rho": [0.5, 0.5], "beta": [1.0, 2.0]}, domains=DOMAINS, last=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    report.summarize(**args)


def test_degenerate_warnings_name_seed_run_and_domains():
  fedavg_classes = np.full((2, 4, 2), 2)
  fedavg_classes[1, 2:, 0] = 1  # seed 8 of FedAvg: cora constant in the last 2 rounds
  fedia_classes = np.full((2, 2, 4, 2), 2)
  fedia_classes[1, 0, 2:] = 1  # cell 1, seed 7: both domains
  fedia_classes[0, 1, 3, 1] = 1  # constant in one final round only: not reported
  acc = np.full((2, 4, 2), 0.5)
  labels = [f"FedIA {report.format_hparams({'rho': 0.5, 'beta': b})}" for b in (1.0, 2.0)]
  lines = report.degenerate_warnings(_runs(acc, fedavg_classes),
                                     _runs(np.stack([acc, acc]), fedia_classes),
                                     labels, DOMAINS, last=2, seeds=[7, 8])
  assert lines == [
      "seed 7, FedIA ρ=0.5, β=2: constant prediction on cora, dblp through the last 2 rounds",
      "seed 8, FedAvg: constant prediction on cora through the last 2 rounds"]
  assert report.degenerate_warnings(_runs(acc, fedavg_classes), _runs(np.stack([acc, acc])),
                                    ["a", "b"], DOMAINS, last=2, seeds=[7, 8],
                                    base_label="FedProx") == [
      "seed 8, FedProx: constant prediction on cora through the last 2 rounds"]
  assert report.degenerate_warnings(_runs(acc), _runs(np.stack([acc, acc])), labels,
                                    DOMAINS, last=2) == []
  swinging = acc.copy()
  swinging[0, 1:, 1] = [0.3, 0.7, 0.3]  # seed 7, dblp: 40-point swings in the last 2 rounds
  assert report.degenerate_warnings(_runs(acc, fedavg_classes), _runs(np.stack([acc, swinging])),
                                    labels, DOMAINS, last=2, seeds=[7, 8]) == [
      "seed 7, FedIA ρ=0.5, β=2: accuracy swings by > 10 points per round on dblp through the "
      "last 2 rounds",
      "seed 8, FedAvg: constant prediction on cora through the last 2 rounds"]
  with pytest.raises(ValueError, match="got 1 labels for G=2 cells"):
    report.degenerate_warnings(_runs(acc), _runs(np.stack([acc, acc])), ["a"], DOMAINS, last=2)


# ----------------------------------------------------------------- selection


def test_best_cell_skips_fedavg_and_nan(rows_one_seed):
  assert report.best_cell(rows_one_seed) is rows_one_seed[1]
  rows = [dict(r) for r in rows_one_seed]
  rows[1]["avg_mean"] = NAN
  assert report.best_cell(rows) is rows[2]
  rows[2]["avg_mean"] = NAN
  with pytest.raises(ValueError, match="no grid cell"):
    report.best_cell(rows)


def test_best_cell_other_key(rows_one_seed):
  assert report.best_cell(rows_one_seed, key="avg_std") is rows_one_seed[1]
  assert report.best_cell(rows_one_seed, key="dblp_std") is rows_one_seed[1]


def test_format_table(rows_one_seed):
  text = report.format_table(rows_one_seed)
  lines = text.splitlines()
  assert lines[0].split() == ["method", "ρ", "β", "cora", "dblp", "AVG",
                              "ΔAVG"]
  assert lines[2].split() == ["fedavg", "60.00", "70.00", "65.00±10.00",
                              "+0.00"]
  assert lines[3].split() == ["fedavg+fedia", "0.5", "1", "70.00", "70.00",
                              "70.00±5.00", "+5.00"]
  assert lines[4].split()[-1] == "-20.00"
  # Right-aligned numeric columns end at the same offset as the header.
  assert len(lines[2]) == len(lines[3]) == len(lines[0])
  assert "rounds" in lines[-1]


def test_format_table_nan_cell(rows_one_seed):
  rows = [dict(r) for r in rows_one_seed]
  for k in ("cora_mean", "avg_mean", "avg_std", "delta_avg"):
    rows[2][k] = NAN
  line = report.format_table(rows).splitlines()[4]
  assert line.split()[3:] == ["nan", "50.00", "nan±nan", "nan"]


def test_format_table_max_rows_keeps_fedavg_and_best(rows_one_seed):
  rows = list(reversed(rows_one_seed))
  lines = report.format_table(rows, max_rows=1).splitlines()
  assert lines[2].startswith("fedavg ")
  assert lines[3].split()[-1] == "+5.00"
  assert lines[4] == "... 1 more cell(s) not shown"


# ----------------------------------------------------------------- files


def test_csv_round_trip(tmp_path, rows_one_seed):
  rows = [dict(r) for r in rows_one_seed]
  rows[2]["avg_mean"] = NAN
  rows[2]["rho"] = 1e-5
  path = tmp_path / "summary.csv"
  report.write_summary_csv(rows, path)
  _assert_no_temp_files(tmp_path, ["summary.csv"])
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    assert reader.fieldnames == report.summary_columns(DOMAINS, ("rho", "beta"))
    back = list(reader)
  assert len(back) == 3
  assert back[0]["method"] == "fedavg"
  assert back[0]["rho"] == back[0]["beta"] == ""
  assert back[0]["cora_mean"] == "60.0000"
  assert back[0]["delta_avg"] == "0.0000"
  assert back[0]["std_over"] == "rounds"
  assert back[1]["avg_std"] == "5.0000"
  assert back[1]["delta_avg"] == "5.0000"
  assert back[2]["avg_mean"] == "nan"
  assert back[0]["delta_avg_ci"] == "" and back[1]["delta_avg_ci"] == "nan"  # one seed
  assert back[1]["train_loss_slope"] == "0.0000e+00"
  assert back[1]["constant_domains"] == "0"
  # ρ/β must survive exactly, not as 0.0000.
  assert float(back[2]["rho"]) == 1e-5
  assert float(back[2]["beta"]) == 2.0


def test_fedia_csv_is_unchanged_byte_for_byte(tmp_path, rows_one_seed):
  # The values of test_single_seed_means_std_over_rounds_and_delta; balanced accuracy and F1
  # equal accuracy (``_runs``), the loss is flat.
  stats = lambda metric: ",".join(f"{d}{metric}_{s}" for d in DOMAINS + ["avg"]
                                  for s in ("mean", "std"))
  header = (f"method,rho,beta,{stats('')},{stats('_bacc')},{stats('_f1')},std_over,delta_avg,"
            "delta_avg_ci,delta_bacc,constant_domains,oscillating_domains,train_loss_slope,"
            "skipped_updates")
  # A std of 10 over the two final rounds is a 20-point swing: that domain oscillates.
  tail = ",rounds,{0},{1},{0},0,{2},0.0000e+00,0"
  expected = [
      header,
      "fedavg,,," + "60.0000,10.0000,70.0000,10.0000,65.0000,10.0000," * 2
      + "60.0000,10.0000,70.0000,10.0000,65.0000,10.0000" + tail.format("0.0000", "", 2),
      "fedavg+fedia,0.5,1.0," + "70.0000,10.0000,70.0000,0.0000,70.0000,5.0000," * 2
      + "70.0000,10.0000,70.0000,0.0000,70.0000,5.0000" + tail.format("5.0000", "nan", 1),
      "fedavg+fedia,0.5,2.0," + "40.0000,0.0000,50.0000,0.0000,45.0000,0.0000," * 2
      + "40.0000,0.0000,50.0000,0.0000,45.0000,0.0000" + tail.format("-20.0000", "nan", 0)]
  report.write_summary_csv(rows_one_seed, tmp_path / "summary.csv")
  assert (tmp_path / "summary.csv").read_bytes() == "".join(
      f"{line}\r\n" for line in expected).encode()


def test_csv_overwrites_atomically(tmp_path, rows_one_seed):
  path = tmp_path / "s.csv"
  path.write_text("old")
  report.write_summary_csv(rows_one_seed, path)
  assert path.read_text().startswith("method,rho,beta,")
  _assert_no_temp_files(tmp_path, ["s.csv"])


def test_write_history_round_trip(tmp_path):
  path = tmp_path / "hist.npz"
  a = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
  report.write_history(path, fedia_test=a, seeds=np.array([0, 1]))
  _assert_no_temp_files(tmp_path, ["hist.npz"])
  with np.load(path) as z:
    np.testing.assert_array_equal(z["fedia_test"], a)
    np.testing.assert_array_equal(z["seeds"], [0, 1])


def test_write_json_sorted_indented(tmp_path):
  path = tmp_path / "cfg.json"
  report.write_json(path, {"b": np.float32(1.5), "a": np.arange(2)})
  assert path.read_text() == '{\n  "a": [\n    0,\n    1\n  ],\n  "b": 1.5\n}\n'
  _assert_no_temp_files(tmp_path, ["cfg.json"])


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
  path = tmp_path / "h.npz"
  path.write_bytes(b"old")
  with pytest.raises(Exception):
    # Pickling the object fails mid-write, after the temp file exists.
    report.write_history(path, bad=_Unpicklable())
  assert path.read_bytes() == b"old"
  _assert_no_temp_files(tmp_path, ["h.npz"])
  with pytest.raises(TypeError):
    report.write_json(tmp_path / "x.json", {"a": object()})
  _assert_no_temp_files(tmp_path, ["h.npz"])


class _Unpicklable:

  def __reduce__(self):
    raise RuntimeError("cannot pickle")


# ----------------------------------------------------------------- plots


def _heatmap_and_curves(tmp_path, rhos, betas, delta_fn, seeds=1, nan_cell=None,
                        title="Test-Set (setting)"):
  fedavg, fedia, rho, beta = _grid(rhos, betas, delta_fn, seeds=seeds)
  if nan_cell is not None:
    fedia[nan_cell, :, 2:, :] = np.nan
  rows = _summarize(fedavg, fedia, rho, beta)
  heat, curves = tmp_path / "heat.png", tmp_path / "curves.png"
  report.plot_heatmap(rows, heat, title=title)
  report.plot_curves(fedavg, fedia, rows, curves, title, last=2)
  _assert_png(heat)
  _assert_png(curves)
  _assert_no_temp_files(tmp_path, ["heat.png", "curves.png"])
  return rows


def test_plots_2x2_grid(tmp_path):
  rows = _heatmap_and_curves(tmp_path, [0.1, 0.5], [0.5, 2.0],
                             lambda r, b: 0.02 * r - 0.01 * b, seeds=3)
  assert report.best_cell(rows)["rho"] == 0.5
  assert report.best_cell(rows)["beta"] == 0.5


def test_plots_single_cell(tmp_path):
  _heatmap_and_curves(tmp_path, [0.3], [1.0], lambda r, b: 0.0)


def test_plots_with_nan_cell(tmp_path):
  rows = _heatmap_and_curves(tmp_path, [0.1, 0.5], [0.5, 2.0],
                             lambda r, b: 0.01 * b, nan_cell=1)
  assert math.isnan(rows[2]["delta_avg"])


def test_heatmap_partial_grid_and_all_nan(tmp_path):
  fedavg, fedia, rho, beta = _grid([0.1, 0.5], [0.5, 2.0], lambda r, b: 0.01)
  keep = [0, 1, 3]  # (0.5, 0.5) missing.
  rows = _summarize(fedavg, fedia[keep], rho[keep], beta[keep])
  report.plot_heatmap(rows, tmp_path / "partial.png")
  _assert_png(tmp_path / "partial.png")
  fedia[:] = np.nan
  rows = _summarize(fedavg, fedia, rho, beta)
  report.plot_heatmap(rows, tmp_path / "nan.png", title="all diverged")
  _assert_png(tmp_path / "nan.png")
  _assert_no_temp_files(tmp_path, ["partial.png", "nan.png"])


def test_heatmap_marks_paired_intervals_and_constant_cells(tmp_path):
  # Cells row-major (0.1, 0.5), (0.1, 2), (0.5, 0.5), (0.5, 2); ρ=0.5 gains 1 point in every
  # seed (sd 0: significant), ρ=0.1 gains nothing (0 is never outside the interval).
  fedavg, fedia, rho, beta = _grid([0.1, 0.5], [0.5, 2.0], lambda r, b: 0.01 * (r == 0.5),
                                   seeds=3)
  fedia[3] += np.array([-0.03, 0.0, 0.03])[:, None, None]  # +1 on average, hw 4.30 * 3/√3 = 7.45
  classes = np.full(fedia.shape, 2)
  classes[1, 2, :, 1] = 1  # cell (0.1, 2), seed 2: dblp constant
  rows = report.summarize(_runs(fedavg), _runs(fedia, classes), {"rho": rho, "beta": beta},
                          DOMAINS, last=2)
  assert rows[4]["delta_avg"] == pytest.approx(1.0) and rows[4]["delta_avg_ci"] == pytest.approx(
      4.302653 * 3 / math.sqrt(3), rel=1e-5)
  grid = report.plot_heatmap(rows, tmp_path / "heat.png", title="marks")
  np.testing.assert_array_equal(grid.significant, [[False, False], [True, False]])
  np.testing.assert_array_equal(grid.constant, [[False, True], [False, False]])
  np.testing.assert_allclose(grid.delta, [[0.0, 0.0], [1.0, 1.0]], atol=1e-9)
  assert (grid.row_name, grid.col_name) == ("rho", "beta")
  np.testing.assert_array_equal(grid.row_values, [0.1, 0.5])
  np.testing.assert_array_equal(grid.col_values, [0.5, 2.0])
  _assert_png(tmp_path / "heat.png")
  labels = report.plot_curves(fedavg, fedia, rows, tmp_path / "curves.png", "t", last=2)
  assert labels == ["FedAvg", "FedAvg+FedIA (ρ=0.5, β=0.5)"]

  # One seed: the same deltas carry no interval, so nothing is marked significant.
  fedavg, fedia, rho, beta = _grid([0.1, 0.5], [0.5, 2.0], lambda r, b: 0.01 * (r == 0.5))
  one = report.plot_heatmap(_summarize(fedavg, fedia, rho, beta), tmp_path / "one.png")
  assert not one.significant.any()


def test_curves_say_when_a_plotted_run_ends_constant(tmp_path):
  fedavg, fedia, rho, beta = _grid([0.1], [0.5, 2.0], lambda r, b: 0.01 * b)
  classes = np.full(fedia.shape, 2)
  classes[1, 0, :, :] = 1  # the best cell (β=2) predicts one class on both domains
  rows = report.summarize(_runs(fedavg), _runs(fedia, classes), {"rho": rho, "beta": beta},
                          DOMAINS, last=2)
  labels = report.plot_curves(fedavg, fedia, rows, tmp_path / "c.png", "t", last=2)
  assert labels == ["FedAvg",
                    "FedAvg+FedIA (ρ=0.1, β=2): constant on 2 (seed, domain) pair(s)"]


def test_curves_rejects_mismatched_rows(tmp_path, rows_one_seed):
  with pytest.raises(ValueError, match="G=1"):
    report.plot_curves(_fedavg_one_seed(), _fedia_two_cells()[:1],
                       rows_one_seed, tmp_path / "c.png", "t")
  with pytest.raises(ValueError, match="last=9"):
    report.plot_curves(_fedavg_one_seed(), _fedia_two_cells(), rows_one_seed,
                       tmp_path / "c.png", "t", last=9)
  assert os.listdir(tmp_path) == []


def test_module_does_not_import_jax():
  # Load the file directly in a fresh interpreter: the package __init__ and
  # other tests may legitimately import jax, which would mask the check.
  path = os.path.abspath(report.__file__)
  code = ("import importlib.util, sys; "
          f"spec = importlib.util.spec_from_file_location('r', {path!r}); "
          "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
          "assert 'jax' not in sys.modules, 'report imported jax'")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_skipped_updates_column_counts_per_method():
  args = (_fedavg_one_seed(), _fedia_two_cells(), [0.5, 0.5], [1.0, 2.0])
  rows = _summarize(*args, skipped=[3, 0, 7])
  assert [r["skipped_updates"] for r in rows] == [3, 0, 7]
  assert all(r["skipped_updates"] == 0 for r in _summarize(*args))
  with pytest.raises(ValueError, match="skipped has shape"):
    _summarize(*args, skipped=[1, 2])


# ----------------------------------------------------------------- one hyper-parameter (GMA's τ)


def _tau_rows(classes=None):
  """GMA cells τ = 0.1, 0.3, 1e-5 (unsorted) on 3 seeds: ΔAVG +1 in every seed, 0, -1."""
  fedavg, fedia, _, _ = _grid([0.0], [0.0], lambda r, b: 0.0, seeds=3)
  cells = np.stack([fedavg + 0.01, fedavg, fedavg - 0.01])
  rows = report.summarize(_runs(fedavg), _runs(cells, classes), {"tau": [0.1, 0.3, 1e-5]},
                          DOMAINS, last=2, cell_method="fedavg+gma")
  return fedavg, cells, rows


def test_one_hyperparameter_summary_table_and_csv(tmp_path):
  _, _, rows = _tau_rows()
  assert report.summary_columns(DOMAINS, ["tau"])[:3] == ["method", "tau", "cora_mean"]
  assert all(list(r) == report.summary_columns(DOMAINS, ["tau"]) for r in rows)
  assert [(r["method"], r["tau"]) for r in rows] == [
      ("fedavg", ""), ("fedavg+gma", 0.1), ("fedavg+gma", 0.3), ("fedavg+gma", 1e-5)]
  assert [r["delta_avg"] for r in rows] == pytest.approx([0.0, 1.0, 0.0, -1.0], abs=1e-9)
  assert report.hparam_names(rows[0]) == ["tau"]
  assert report.best_cell(rows) is rows[1]

  lines = report.format_table(rows).splitlines()
  assert lines[0].split() == ["method", "τ", "cora", "dblp", "AVG", "ΔAVG"]
  assert lines[2].split()[:2] == ["fedavg", "68.33"]  # cora .6 + (.0667, .1)
  assert lines[5].split()[:2] == ["fedavg+gma", "1e-05"]

  report.write_summary_csv(rows, tmp_path / "summary.csv")
  text = (tmp_path / "summary.csv").read_text()
  assert text.startswith("method,tau,cora_mean,")
  assert "\nfedavg+gma,1e-05,67.3333," in text  # the exact repr, not 0.0000
  with open(tmp_path / "summary.csv", newline="") as f:
    assert [r["tau"] for r in csv.DictReader(f)] == ["", "0.1", "0.3", "1e-05"]


def test_one_hyperparameter_heatmap_is_one_row_and_curves_name_it(tmp_path):
  classes = np.full((3, 3, 4, 2), 2)
  classes[2, 1, :, 0] = 1  # τ=1e-5, seed 1: cora constant
  fedavg, cells, rows = _tau_rows(classes)
  grid = report.plot_heatmap(rows, tmp_path / "heat.png", title="gma")
  assert (grid.row_name, grid.col_name, grid.row_values.size) == (None, "tau", 0)
  np.testing.assert_array_equal(grid.col_values, [1e-5, 0.1, 0.3])
  np.testing.assert_allclose(grid.delta, [[-1.0, 1.0, 0.0]], atol=1e-9)
  assert grid.present.shape == (1, 3) and grid.present.all()
  # ±1 in every seed has sd 0: significant; 0 never is.
  np.testing.assert_array_equal(grid.significant, [[True, True, False]])
  np.testing.assert_array_equal(grid.constant, [[True, False, False]])
  _assert_png(tmp_path / "heat.png")
  labels = report.plot_curves(fedavg, cells, rows, tmp_path / "curves.png", "gma", last=2)
  assert labels == ["FedAvg", "FedAvg+GMA (τ=0.1)"]
  _assert_no_temp_files(tmp_path, ["heat.png", "curves.png"])


def test_two_hyperparameters_of_another_method_and_a_heatmap_needs_one_or_two(tmp_path):
  fedavg, fedia, rho, beta = _grid([0.1, 0.5], [0.3], lambda r, b: 0.01 * r)
  fedheal = lambda hparams: report.summarize(
      _runs(fedavg), _runs(fedia), hparams, DOMAINS, last=2, cell_method="fedavg+fedheal")
  rows = fedheal({"tau": rho, "beta": beta})
  grid = report.plot_heatmap(rows, tmp_path / "heat.png")
  assert (grid.row_name, grid.col_name, grid.delta.shape) == ("tau", "beta", (2, 1))
  assert report.format_table(rows).splitlines()[0].split()[:3] == ["method", "τ", "β"]
  assert report.plot_curves(fedavg, fedia, rows, tmp_path / "c.png", "t")[1] == (
      "FedAvg+FedHEAL (τ=0.5, β=0.3)")
  for hparams in ({}, {"tau": rho, "beta": beta, "eta": rho}):
    with pytest.raises(ValueError, match="one or two hyper-parameters"):
      report.plot_heatmap(fedheal(hparams), tmp_path / "x.png")
  _assert_no_temp_files(tmp_path, ["heat.png", "c.png"])


def test_display_names_mirror_the_aggregator_registry():
  from fedjax_graph import aggregators  # jax: here, not in report
  assert {name: report.display_name(name) for name in aggregators.DISPLAY} == dict(
      aggregators.DISPLAY)
  assert report.display_name("fedavg+gma") == "FedAvg+GMA"
  assert report.display_name("fedprox+x") == "fedprox+x"


def test_curves_tick_only_whole_rounds(tmp_path, monkeypatch):
  saved = []
  monkeypatch.setattr(report, "save_figure", lambda fig, path: saved.append(fig))
  fedavg, fedia, rho, beta = _grid([0.1], [0.5], lambda r, b: 0.0)  # a few rounds only
  rows = _summarize(fedavg, fedia, rho, beta)
  report.plot_curves(fedavg, fedia, rows, tmp_path / "c.png", "t")
  ticks = saved[0].axes[0].get_xticks()
  np.testing.assert_array_equal(ticks, np.round(ticks))
