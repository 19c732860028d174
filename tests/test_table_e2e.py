"""experiments/table.py and experiments/ablation.py: real WikiNet end to end, resume, selection."""

import csv
import json

import numpy as np
import pytest
from PIL import Image

from conftest import script_main, usage_error
from fedjax_graph import analysis, comparison, config, sweep, tables


def test_table_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "table"
  script_main("table")(["--dataset", "wikinet", "--methods",
                        "fedavg,feddyn,majority,local,centralized", "--rounds", "2",
                        "--seeds", "0,1", "--raw-dir", str(raw_dir), "--cache-dir",
                        str(prepared_cache), "--out", str(out), "--no-progress"])
  printed = capsys.readouterr().out
  assert "| FedDyn+FedIA | ρ=0.5, β=0.5 |" in printed
  with open(out / "table.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["method"] for r in rows] == ["FedAvg", "FedAvg+FedIA", "FedDyn", "FedDyn+FedIA",
                                         "Majority", "Local", "Centralized"]
  assert [r["variant"] for r in rows[4:]] == ["reference"] * 3
  assert all(r["status"] == "ok" for r in rows)
  # The majority row predicts one class per domain in both seeds, and is still shown.
  assert [rows[4][f"{d}_constant"] for d in ("chameleon", "squirrel", "crocodile")] == ["2"] * 3
  for r in rows[4:]:
    assert r["AVG_delta_base"] == "" and float(r["delta_fedavg"]) == pytest.approx(
        float(r["AVG_mean"]) - float(rows[0]["AVG_mean"]), abs=1e-3)
  for r in rows:
    means = [float(r[f"{d}_mean"]) for d in ("chameleon", "squirrel", "crocodile")]
    assert float(r["AVG_mean"]) == pytest.approx(np.mean(means), abs=1e-3)
  assert float(rows[3]["AVG_delta_base"]) == pytest.approx(
      float(rows[3]["AVG_mean"]) - float(rows[2]["AVG_mean"]), abs=1e-3)
  assert float(rows[2]["delta_fedavg"]) == pytest.approx(
      float(rows[2]["AVG_mean"]) - float(rows[0]["AVG_mean"]), abs=1e-3)
  assert r"\begin{tabular}" in (out / "table.tex").read_text()
  assert "FedDyn+FedIA" in (out / "table.md").read_text()
  assert Image.open(out / "table.png").size[0] > 100
  record = json.loads((out / "config.json").read_text())
  assert record["status"] == "finished" and record["fedia_selected"]["feddyn"] == [0.5, 0.5]
  assert record["hparams"]["feddyn"]["alpha"] == 0.01
  run = comparison.load_run(out / "runs" / "feddyn.npz")
  assert run.test_acc.shape == (2, 2, 2, 3)  # [S, G', T, D]
  assert not (out / "checkpoint-feddyn.msgpack").exists()


def test_table_usage_errors(capsys):
  assert "unknown method 'fedsgd'" in usage_error(
      "table", ["--dataset", "wikinet", "--methods", "fedavg,fedsgd"], capsys)
  assert "invalid choice: 'best'" in usage_error(
      "table", ["--dataset", "wikinet", "--select", "best"], capsys)
  assert "methods = ['fedavg', 'fedavg']; give at least one, without repeats" in usage_error(
      "table", ["--dataset", "wikinet", "--methods", "fedavg,fedavg"], capsys)
  assert "participation = 1.5; must be in (0, 1]" in usage_error(
      "table", ["--dataset", "wikinet", "--participation", "1.5"], capsys)


@pytest.fixture(scope="module")
def tiny_config():
  return config.load_preset("wikinet", hidden=8, max_buckets=1)


def test_table_resume_equals_uninterrupted(tiny_config, tiny_wikinet, tmp_path, monkeypatch):
  from test_reliability import Interrupt, _interrupting

  kwargs = dict(method_names=["fedavg", "scaffold"], seeds=[0], rounds=4, last=2, chunk=1,
                progress=False, domain_graphs=tiny_wikinet)
  whole = comparison.run_table(tiny_config, out_dir=tmp_path / "whole", **kwargs)
  real = sweep.make_simulation
  cut = lambda *a: _interrupting(real(*a), 2) if a[3] == "scaffold" else real(*a)
  monkeypatch.setattr(sweep, "make_simulation", cut)
  with pytest.raises(Interrupt):
    comparison.run_table(tiny_config, out_dir=tmp_path / "cut", **kwargs)
  monkeypatch.setattr(sweep, "make_simulation", real)
  assert (tmp_path / "cut" / "runs" / "fedavg.npz").exists()
  assert (tmp_path / "cut" / "checkpoint-scaffold.msgpack").exists()
  with pytest.raises(ValueError, match="unfinished run; continue it with --resume"):
    comparison.run_table(tiny_config, out_dir=tmp_path / "cut", **kwargs)
  comparison.resume_table(tmp_path / "cut", domain_graphs=tiny_wikinet, progress=False)
  for name in ("fedavg", "scaffold"):
    a = comparison.load_run(whole / "runs" / f"{name}.npz")
    b = comparison.load_run(tmp_path / "cut" / "runs" / f"{name}.npz")
    for field in tables.RunResult._fields[:-1]:  # all but the wall time
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
  assert (whole / "table.csv").read_text() == (tmp_path / "cut" / "table.csv").read_text()
  with pytest.raises(ValueError, match="finished run; pass --overwrite"):
    comparison.run_table(tiny_config, out_dir=whole, **kwargs)
  comparison.run_table(tiny_config, out_dir=whole, overwrite=True, **kwargs)


def test_select_val_reports_the_best_validation_cell(tiny_config, tiny_wikinet, tmp_path):
  out = comparison.run_table(tiny_config, ["fedprox"], [0, 1], rounds=2, last=1, select="val",
                             out_dir=tmp_path / "val", progress=False,
                             domain_graphs=tiny_wikinet)
  run = comparison.load_run(out / "runs" / "fedprox.npz")
  assert run.test_acc.shape[1] == 26  # the 5x5 grid and the base method, one sweep
  val_avg = [analysis.final_rounds(run.val_acc[:, g], 1)[:, -1].mean() for g in range(25)]
  best = int(np.argmax(val_avg))
  record = json.loads((out / "config.json").read_text())
  assert record["fedia_selected"]["fedprox"] == pytest.approx([run.rho[best], run.beta[best]])


def test_ablation_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "ablation"
  script_main("ablation")(["--dataset", "wikinet", "--settings", "default", "--rounds", "2",
                           "--raw-dir", str(raw_dir), "--cache-dir", str(prepared_cache),
                           "--out", str(out), "--no-progress"])
  with open(out / "table.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["method"] for r in rows] == [
      "default:FedAvg", "default:FedAvg+IM", "default:FedAvg+IM+CAM"]
  assert [r["variant"] for r in rows] == ["base", "+IM", "+FedIA"]
  assert (rows[1]["rho"], rows[1]["beta"], rows[2]["beta"]) == ("0.5", "", "0.5")
  run = comparison.load_run(out / "runs" / "default.npz")
  # IM only weighs clients by training-node counts, like FedAvg; CAM does not.
  np.testing.assert_allclose(run.alpha[:, 0], run.alpha[:, 2], rtol=1e-5)
  assert not np.allclose(run.alpha[:, 1, -1], run.alpha[:, 2, -1])
  assert "FedAvg+IM+CAM" in (out / "table.md").read_text()


def test_overwrite_removes_only_its_own_files_and_only_after_the_data_loads(
    tiny_config, tiny_wikinet, tmp_path, capsys):
  out = tmp_path / "paper"
  kwargs = dict(method_names=["fedavg"], seeds=[0], rounds=1, last=1, progress=False)
  comparison.run_table(tiny_config, out_dir=out, domain_graphs=tiny_wikinet, **kwargs)
  (out / "table_notes.txt").write_text("mine")
  (out / "runs" / "keep.npz").write_bytes(b"mine")
  # The data cannot load: nothing is removed.
  with pytest.raises(OSError):
    comparison.run_table(tiny_config, out_dir=out, overwrite=True,
                         raw_dir=tmp_path / "missing", cache_dir=tmp_path / "cache", **kwargs)
  assert (out / "table.md").exists() and (out / "runs" / "fedavg.npz").exists()
  comparison.run_table(tiny_config, out_dir=out, overwrite=True, domain_graphs=tiny_wikinet,
                       **kwargs)
  assert (out / "table_notes.txt").read_text() == "mine"
  assert (out / "runs" / "keep.npz").read_bytes() == b"mine"


def test_ablation_checks_its_config_before_writing_and_picks_default_settings(
    tmp_path, capsys):
  bad = tmp_path / "bad.yaml"
  bad.write_text("fedia: {wikinet: {default: {fedavg: [1.5, 0.5]}}}\n")
  out = tmp_path / "abl"
  err = usage_error("ablation", ["--dataset", "wikinet", "--method-config", str(bad), "--out",
                                 str(out)], capsys)
  assert "fedia.wikinet.default.fedavg: rho = 1.5" in err and not out.exists()
  err = usage_error("ablation", ["--dataset", "wikinet", "--settings", "s1"], capsys)
  assert "unknown wikinet setting 's1'" in err
  err = usage_error("ablation", ["--dataset", "twitch", "--setting", "s2", "--settings", "s1,s3"],
                    capsys)
  assert "--setting s2 is not in --settings s1,s3" in err
