"""experiments/grid.py end to end on the real WikiNet graphs (few rounds, 2x2 grid)."""

import csv
import json

import numpy as np
import pytest
from PIL import Image

import data_prep

from conftest import script_main, usage_error

# The real graphs with a narrow recipe: the compiles are these tests' cost.
SMALL = ["--set", "hidden=16", "--set", "num_layers=2", "--set", "local_steps=2"]


def test_grid_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "run"
  script_main("grid")(["--dataset", "wikinet", "--rounds", "3", "--last", "2", "--chunk", "2",
                "--rho", "0.3,0.7", "--beta", "0.5,0.9", *SMALL, "--raw-dir", str(raw_dir),
                "--cache-dir", str(prepared_cache), "--out", str(out), "--no-progress"])
  printed = capsys.readouterr().out
  assert "best cell on test AVG (optimistic): rho=" in printed

  domains = ["chameleon", "squirrel", "crocodile"]
  with open(out / "summary.csv") as f:
    reader = csv.DictReader(f)
    rows = list(reader)
  expected_columns = ["method", "rho", "beta"] + [
      f"{d}_{metric}{s}" for metric in ("", "bacc_", "f1_") for d in domains + ["avg"]
      for s in ("mean", "std")] + [
      "std_over", "delta_avg", "delta_avg_ci", "delta_bacc", "constant_domains",
      "oscillating_domains", "train_loss_slope", "skipped_updates"]
  assert reader.fieldnames == expected_columns
  assert [r["method"] for r in rows] == ["fedavg"] + ["fedavg+fedia"] * 4
  assert rows[0]["rho"] == rows[0]["beta"] == ""
  assert {(r["rho"], r["beta"]) for r in rows[1:]} == {
      ("0.3", "0.5"), ("0.3", "0.9"), ("0.7", "0.5"), ("0.7", "0.9")}
  assert all(r["std_over"] == "rounds" and r["skipped_updates"] == "0" for r in rows)
  for r in rows:
    means = [float(r[f"{d}_mean"]) for d in domains]
    assert all(0 <= m <= 100 for m in means)
    assert float(r["avg_mean"]) == pytest.approx(np.mean(means), abs=1e-3)
    assert float(r["delta_avg"]) == pytest.approx(
        float(r["avg_mean"]) - float(rows[0]["avg_mean"]), abs=1e-3)

  history = np.load(out / "history.npz")
  assert history["fedia_test"].shape == (4, 1, 3, 3)  # [G, S, T, D]
  assert history["fedia_val"].shape == (4, 1, 3, 3)
  assert history["fedavg_test"].shape == (1, 3, 3)  # [S, T, D]
  for name in ("fedia_test_bacc", "fedia_test_f1"):
    assert history[name].shape == (4, 1, 3, 3)
  for name in ("fedavg_test_bacc", "fedavg_test_f1"):
    assert history[name].shape == (1, 3, 3)
  assert history["predicted_classes"].shape == (1, 5, 3, 3)  # [S, G+1, T, D], FedAvg last
  assert history["predicted_classes"].min() >= 1
  # Balanced accuracy and F1 in the summary come from the history too.
  assert float(rows[0]["avg_bacc_mean"]) == pytest.approx(
      100 * history["fedavg_test_bacc"][0, -2:].mean(), abs=1e-3)
  assert 0 <= int(rows[0]["constant_domains"]) <= 3
  assert list(history["domains"]) == domains
  np.testing.assert_allclose(history["rho"], [0.3, 0.3, 0.7, 0.7])
  np.testing.assert_allclose(history["beta"], [0.5, 0.9, 0.5, 0.9])
  # The summary is computed from the history: FedAvg's chameleon mean over the last 2 rounds.
  assert float(rows[0]["chameleon_mean"]) == pytest.approx(
      100 * history["fedavg_test"][0, -2:, 0].mean(), abs=1e-3)

  config = json.loads((out / "config.json").read_text())
  assert config["config"]["dataset"] == "wikinet" and config["status"] == "finished"
  assert config["data"]["source_sha256"]  # the raw files' checksums
  assert not (out / "checkpoint.msgpack").exists()  # a finished run keeps no checkpoint
  assert config["num_clients"] == 6 and config["rounds"] == 3
  assert config["bucket_propagation"] == ["none"] * len(config["buckets"])  # PMLP: no operator
  assert config["packages"]["jax"]
  for name in ("heatmap.png", "curves.png"):
    with Image.open(out / name) as image:
      assert image.format == "PNG" and image.size[0] > 300


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "3", "--last", "5"], "last = 5"),
    (["--rho", "0.5,1.5"], "rho = 1.5; must be in (0, 1]"),
    (["--beta", "-0.1"], "beta = -0.1; must be in [0, 1]"),
    (["--aggregator", "gma", "--rho", "0.5"],
     "--rho: not a hyper-parameter of --aggregator gma, whose are tau"),
    (["--aggregator", "krum"], "invalid choice: 'krum'"),
    (["--rounds", "0"], "rounds = 0"),
    (["--seeds", "0,0"], "seeds = [0, 0]"),
    (["--setting", "s9"], "unknown wikinet setting 's9'"),
    (["--rho", "abc"], "comma list of numbers"),
    (["--backbone", "sfpd", "--norm", "none", "--set", "precision=bf16"],
     "Unsupported precision for sfpd: 'bf16'"),
    (["--backbone", "sfpd"], "Unsupported norm for sfpd: 'batch'; SFPD has none (norm: none, "
                             "--norm none"),
])
def test_grid_rejects_bad_flags_before_any_work(flags, message, tmp_path, capsys):
  argv = ["--dataset", "wikinet", "--out", str(tmp_path / "x"), *flags]
  assert message in usage_error("grid", argv, capsys)
  assert not (tmp_path / "x").exists()


def test_grid_of_another_aggregator_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "gma"
  script_main("grid")(["--dataset", "wikinet", "--aggregator", "gma", "--tau", "0.1,0.5,0.9",
                       "--rounds", "2", *SMALL, "--raw-dir", str(raw_dir), "--cache-dir",
                       str(prepared_cache), "--out", str(out), "--no-progress"])
  assert "best cell on test AVG (optimistic): tau=" in capsys.readouterr().out
  with open(out / "summary.csv") as f:
    rows = list(csv.DictReader(f))
  assert [(r["method"], r["tau"]) for r in rows] == [
      ("fedavg", ""), ("fedavg+gma", "0.1"), ("fedavg+gma", "0.5"), ("fedavg+gma", "0.9")]
  history = np.load(out / "history.npz")
  assert history["gma_test"].shape == (3, 1, 2, 3) and list(history["tau"]) == [0.1, 0.5, 0.9]
  assert list(history["labels"]) == ["GMA τ=0.1", "GMA τ=0.5", "GMA τ=0.9", "FedAvg"]
  with Image.open(out / "heatmap.png") as image:
    assert image.format == "PNG"
  record = json.loads((out / "config.json").read_text())
  assert record["aggregator"] == "gma" and record["grid"] == {"tau": [0.1, 0.5, 0.9]}


def test_a_run_says_why_it_prepares_the_data(raw_dir, tmp_path, capsys):
  argv = ["--dataset", "wikinet", "--raw-dir", str(raw_dir), "--cache-dir", str(tmp_path),
          "--rounds", "1", "--rho", "0.5", "--beta", "0.5", "--no-progress", *SMALL]
  script_main("grid")(argv + ["--out", str(tmp_path / "a")])
  assert f"preparing {tmp_path / 'wikinet'}: not prepared yet" in capsys.readouterr().err
  path = tmp_path / "wikinet" / "crocodile.npz"
  path.write_bytes(path.read_bytes()[:-10])
  script_main("grid")(argv + ["--out", str(tmp_path / "b")])
  assert "wikinet: damaged or missing: crocodile.npz" in capsys.readouterr().err
  data_prep.prepare("wikinet", raw_dir=raw_dir, cache_dir=tmp_path)
  assert "preparing" not in capsys.readouterr().err  # reused quietly
