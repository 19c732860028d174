"""experiments/table.py and experiments/ablation.py: real WikiNet end to end, resume, selection."""

import csv
import json

import jax
import numpy as np
import pytest
from PIL import Image

from conftest import script_main, usage_error
from fedjax_graph import analysis, comparison, config, methods, sweep, tables
from fedjax_graph.controls import RunControls


def test_table_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "table"
  script_main("table")(["--dataset", "wikinet", "--methods",
                        "fedavg,feddyn,majority,local,centralized", "--rounds", "2",
                        # A small recipe: five programs compile; the table, not learning, is tested.
                        "--set", "hidden=16", "--set", "num_layers=2", "--set", "local_steps=2",
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
  # The majority row is shown (never NC) and not flagged constant: it is constant by design.
  assert [rows[4][f"{d}_constant"] for d in ("chameleon", "squirrel", "crocodile")] == ["0"] * 3
  run = comparison.load_run(out / "runs" / "majority.npz")
  assert (run.predicted_classes == 1).all()
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
  assert record["status"] == "finished"
  assert record["selected"]["feddyn"]["fedia"] == {"rho": 0.5, "beta": 0.5}
  assert record["hparams"]["feddyn"]["alpha"] == 0.01
  run = comparison.load_run(out / "runs" / "feddyn.npz")
  assert run.test_acc.shape == (2, 2, 2, 3)  # [S, G', T, D]
  assert not (out / "checkpoint-feddyn.msgpack").exists()


FGL = ("fedproto", "fedproc", "fgssl", "fedspa", "fggp")


def test_the_five_fgl_baselines_in_one_table_on_real_wikinet(raw_dir, prepared_cache, tmp_path):
  # One round of one local step on a narrow model: each method's program (its client part,
  # uploads and server part on the real shards) runs through the table; the per-method
  # files test what each computes, the README what it learns over 200 rounds.
  out = tmp_path / "fgl"
  script_main("table")(["--dataset", "wikinet", "--methods", ",".join(FGL), "--rounds", "1",
                        "--set", "hidden=8", "--set", "num_layers=2", "--set", "local_steps=1",
                        "--set", "max_buckets=1", "--seeds", "0", "--raw-dir", str(raw_dir),
                        "--cache-dir", str(prepared_cache), "--out", str(out), "--no-progress"])
  with open(out / "table.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["method"] for r in rows] == [
      "FedProto", "FedProto+FedIA", "FedProc", "FedProc+FedIA", "FGSSL", "FGSSL+FedIA",
      "FedSPA", "FedSPA+FedIA", "FGGP", "FGGP+FedIA"]
  assert all(r["status"] == "ok" for r in rows)
  for r in rows:
    for d in ("chameleon", "squirrel", "crocodile", "AVG"):
      assert 0 <= float(r[f"{d}_mean"]) <= 100, (r["method"], d)
    # FGGP alone is scored by its kNN prototypes, with its classifier's argmax beside it.
    assert (r["AVG_argmax_mean"] != "") == r["method"].startswith("FGGP")
  assert "(sfpd: FedSPA, FedSPA+FedIA)" in (out / "table.md").read_text()
  record = json.loads((out / "config.json").read_text())
  assert record["status"] == "finished" and sorted(record["selected"]) == sorted(FGL)
  defaults = methods.method_defaults()["hparams"]
  assert record["hparams"] == {m: methods.run_hparams(m, defaults[m], 1) for m in FGL}
  assert record["hparams"]["fedproc"]["rounds"] == 1  # its schedule spans this run
  # Beside what the config gave, every value in effect: the factories' defaults too.
  assert record["hparams_in_effect"]["fedspa"] == {**record["hparams"]["fedspa"], "hbda": True,
                                                   "proxy_seed": 0}
  for m in FGL:
    run = comparison.load_run(out / "runs" / f"{m}.npz")
    assert run.test_acc.shape == (1, 2, 1, 3) and np.all(np.isfinite(run.train_loss))
    assert not run.nonfinite.any() and (run.predicted_classes >= 1).all()


def test_table_usage_errors(tmp_path, capsys):
  assert "unknown method 'fedsgd'" in usage_error(
      "table", ["--dataset", "wikinet", "--methods", "fedavg,fedsgd"], capsys)
  err = usage_error("table", ["--dataset", "wikinet", "--methods", "fedprotoo"], capsys)
  assert "unknown method 'fedprotoo'; choose from fedavg" in err  # not the shipped YAML's key
  assert "majority, local, centralized" in err and "hparams" not in err
  assert "invalid choice: 'best'" in usage_error(
      "table", ["--dataset", "wikinet", "--select", "best"], capsys)
  assert "select = 'val' needs validation nodes; split = [0.8, 0.0, 0.2] gives none" in usage_error(
      "table", ["--dataset", "wikinet", "--select", "val", "--set", "split=[0.8, 0, 0.2]", "--out",
                str(tmp_path / "val")], capsys)
  assert not (tmp_path / "val").exists()
  assert "methods = ['fedavg', 'fedavg']; give at least one, without repeats" in usage_error(
      "table", ["--dataset", "wikinet", "--methods", "fedavg,fedavg"], capsys)
  assert "participation = 1.5; must be in (0, 1]" in usage_error(
      "table", ["--dataset", "wikinet", "--participation", "1.5"], capsys)
  assert "--seeds: not applicable to --rows-so-far" in usage_error(
      "table", ["--rows-so-far", "x", "--seeds", "0"], capsys)
  assert "/nonexistent is not a folder" in usage_error(
      "table", ["--rows-so-far", "/nonexistent"], capsys)
  assert "holds no config.json" in usage_error("table", ["--rows-so-far", str(tmp_path)], capsys)


def test_another_tools_folder_is_refused_even_with_overwrite(tmp_path, capsys):
  grid_dir = tmp_path / "grid"
  grid_dir.mkdir()
  (grid_dir / "config.json").write_text(json.dumps({"grid": {"rho": [0.5]}, "status": "finished"}))
  (grid_dir / "summary.csv").write_text("x\n")
  new_table = ["--dataset", "wikinet", "--methods", "fedavg", "--out", str(grid_dir)]
  for argv in (new_table, new_table + ["--overwrite"], ["--resume", str(grid_dir)]):
    err = usage_error("table", argv, capsys)
    assert (f"{grid_dir} holds another kind of run (grid.py's config.json, which has no "
            "'methods')") in err
  assert sorted(p.name for p in grid_dir.iterdir()) == ["config.json", "summary.csv"]
  table_dir = tmp_path / "table"
  table_dir.mkdir()
  (table_dir / "config.json").write_text(json.dumps({"methods": ["fedavg"], "status": "running"}))
  err = usage_error("ablation", ["--dataset", "twitch", "--out", str(table_dir), "--overwrite"],
                    capsys)
  assert "(table.py's config.json, which has no 'ablation'); choose another --out" in err
  err = usage_error("grid", ["--dataset", "wikinet", "--out", str(table_dir), "--overwrite"], capsys)
  assert "has no 'grid'); choose another --out" in err


def test_the_method_config_is_checked_for_methods_not_run(tmp_path, capsys):
  bad = tmp_path / "bad.yaml"
  bad.write_text("hparams: {fedavg: {weights: count}, fedspa: {weights: counts}}\n")
  err = usage_error("table", ["--dataset", "wikinet", "--methods", "fedavg", "--method-config",
                              str(bad), "--out", str(tmp_path / "t")], capsys)
  assert f"{bad}: hparams.fedspa: weights = 'counts'" in err
  assert not (tmp_path / "t").exists()
  # A method that runs: its bad value is named with the file and key too.
  bad.write_text("hparams: {fgssl: {tau: -1}}\n")
  err = usage_error("table", ["--dataset", "wikinet", "--methods", "fgssl", "--method-config",
                              str(bad), "--out", str(tmp_path / "t")], capsys)
  assert f"{bad}: hparams.fgssl: tau = -1; must be > 0" in err
  bad.write_text("hparams: {fedproto: {lam: '1'}}\n")
  err = usage_error("table", ["--dataset", "wikinet", "--methods", "fedproto", "--method-config",
                              str(bad), "--out", str(tmp_path / "t")], capsys)
  assert f"{bad}: hparams.fedproto: lam = '1'; must be a number (default 1.0)" in err
  err = usage_error("table", ["--dataset", "wikinet", "--method-config",
                              str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "t")], capsys)
  assert f"method config {tmp_path / 'missing.yaml'}: No such file or directory" in err
  assert not (tmp_path / "t").exists()


def test_rows_so_far_needs_a_finished_method(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"methods": ["fedavg"], "config": {},
                                                    "last": 1}))
  with pytest.raises(ValueError, match="no method has finished yet"):
    comparison.finished_rows(tmp_path)


@pytest.fixture(scope="module")
def tiny_config():
  return config.load_preset("wikinet", hidden=8, max_buckets=1)


def test_table_resume_equals_uninterrupted(tiny_config, tiny_wikinet, tmp_path, monkeypatch):
  from test_reliability import Interrupt, _interrupting

  controls = RunControls(chunk=1, progress=False)
  run = lambda out, **kw: comparison.run_table(
      tiny_config, ["fedavg", "scaffold"], [0], 4, 2, controls=controls.replace(out_dir=out, **kw),
      domain_graphs=tiny_wikinet)
  whole = run(tmp_path / "whole")
  real = sweep.make_simulation
  cut = lambda *a: _interrupting(real(*a), 2) if a[3] == "scaffold" else real(*a)
  monkeypatch.setattr(sweep, "make_simulation", cut)
  with pytest.raises(Interrupt):
    run(tmp_path / "cut")
  monkeypatch.setattr(sweep, "make_simulation", real)
  assert (tmp_path / "cut" / "runs" / "fedavg.npz").exists()
  assert (tmp_path / "cut" / "checkpoint-scaffold.msgpack").exists()
  with pytest.raises(ValueError, match="unfinished run; continue it with --resume"):
    run(tmp_path / "cut")
  # Its finished rows read without training: FedAvg's two, as the whole table has them.
  script_main("table")(["--rows-so-far", str(tmp_path / "cut")])
  partial = (tmp_path / "cut" / "partial.csv").read_text().splitlines()
  assert len(partial) == 3 and partial == (whole / "table.csv").read_text().splitlines()[:3]
  assert "not finished: scaffold" in (tmp_path / "cut" / "partial.md").read_text()
  assert not (tmp_path / "cut" / "table.md").exists()  # still an unfinished run
  # As if a factory default had changed since the start: the finished method keeps what was
  # recorded when it ran, the unfinished one records what it runs with now.
  started = json.loads((tmp_path / "cut" / "config.json").read_text())
  in_effect = started["hparams_in_effect"]
  for name in ("fedavg", "scaffold"):
    started["hparams_in_effect"][name] = {**in_effect[name], "older_default": 1}
  (tmp_path / "cut" / "config.json").write_text(json.dumps(started))
  comparison.resume_table(tmp_path / "cut", controls, domain_graphs=tiny_wikinet)
  assert not (tmp_path / "cut" / "partial.md").exists()  # superseded by the finished table
  record = json.loads((tmp_path / "cut" / "config.json").read_text())
  assert record["hparams_in_effect"]["fedavg"]["older_default"] == 1
  assert "older_default" not in record["hparams_in_effect"]["scaffold"]
  # The first call's plans are kept: fedavg's, and scaffold's that the resumed call replaced.
  assert {k: p["first_round"] for k, p in record["batches"].items()} == {"fedavg": 0,
                                                                         "scaffold": 2}
  assert [(p["run"], p["first_round"]) for p in record["earlier_batches"]] == [("scaffold", 0)]
  for name in ("fedavg", "scaffold"):
    a = comparison.load_run(whole / "runs" / f"{name}.npz")
    b = comparison.load_run(tmp_path / "cut" / "runs" / f"{name}.npz")
    for field in set(tables.RunResult._fields) - {"seconds"}:  # all but the wall time
      jax.tree.map(np.testing.assert_array_equal, getattr(a, field), getattr(b, field))
  assert (whole / "table.csv").read_text() == (tmp_path / "cut" / "table.csv").read_text()
  with pytest.raises(ValueError, match="finished run; pass --overwrite"):
    run(whole)
  run(whole, overwrite=True)


def test_select_val_reports_the_best_validation_cell_and_resumes(tiny_config, tiny_wikinet,
                                                                  tmp_path):
  controls = RunControls(progress=False, out_dir=tmp_path / "val")
  out = comparison.run_table(tiny_config, ["fedprox"], [0, 1], 2, 1, "val", ["fedia", "gma"],
                             controls=controls, domain_graphs=tiny_wikinet)
  run = comparison.load_run(out / "runs" / "fedprox.npz")
  assert run.test_acc.shape[1] == 31  # the 5x5 FedIA grid, 5 GMA taus, the base: one sweep
  assert list(run.aggregators).count("fedia") == 25 and list(run.aggregators).count("gma") == 5
  fedia = np.flatnonzero(run.aggregators == "fedia")
  val_avg = [analysis.final_rounds(run.val_acc[:, g], 1)[:, -1].mean() for g in fedia]
  best = fedia[int(np.argmax(val_avg))]
  record = json.loads((out / "config.json").read_text())
  assert record["selected"]["fedprox"]["fedia"] == pytest.approx(
      {"rho": run.hparams["rho"][best], "beta": run.hparams["beta"][best]})
  assert set(record["selected"]["fedprox"]["gma"]) == {"tau"}
  assert (out / "heatmap-fedprox.png").exists()
  # An interrupted --select val table continues (its config.json has no fixed settings).
  (out / "table.md").unlink()
  (out / "runs" / "fedprox.npz").unlink()
  comparison.resume_table(out, RunControls(progress=False), domain_graphs=tiny_wikinet)
  again = comparison.load_run(out / "runs" / "fedprox.npz")
  np.testing.assert_array_equal(again.test_acc, run.test_acc)


def test_a_saved_run_of_another_setup_is_refused_naming_the_file(tiny_config, tiny_wikinet,
                                                                 tmp_path):
  out = comparison.run_table(tiny_config, ["fedavg"], [0], 2, 1,
                             controls=RunControls(progress=False, out_dir=tmp_path / "a"),
                             domain_graphs=tiny_wikinet)
  record = json.loads((out / "config.json").read_text())
  assert record["hparams"]["fedavg"] == {"weights": "count"}
  assert record["hparams_in_effect"]["fedavg"] == {"weights": "count"}
  # A table with other settings whose runs/ holds a's fedavg.npz: resuming it refuses the
  # file (it would be reported under the other settings), and so do its rows so far.
  def other(name, **changes):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "runs").mkdir()
    (folder / "runs" / "fedavg.npz").write_bytes((out / "runs" / "fedavg.npz").read_bytes())
    (folder / "config.json").write_text(json.dumps({**record, **changes, "status": "running"}))
    return folder
  uniform = other("uniform", hparams={"fedavg": {"weights": "uniform"}})
  message = (r"uniform/runs/fedavg.npz was saved by another run \(hparams.weights: 'count' "
             r"in the file, 'uniform' here\); delete it")
  with pytest.raises(ValueError, match=message):
    comparison.resume_table(uniform, RunControls(progress=False), domain_graphs=tiny_wikinet)
  with pytest.raises(ValueError, match=message):
    comparison.finished_rows(uniform)
  # A file saved before runs recorded their setup is checked by its cells, seeds and rounds.
  with np.load(out / "runs" / "fedavg.npz") as f:
    legacy = {k: f[k] for k in f.files if k != "run_setup"}
  np.savez(out / "runs" / "fedavg.npz", **legacy)
  seeds = other("seeds", seeds=[0, 1])
  with pytest.raises(ValueError, match=r"fedavg.npz was saved by another run \(seeds: \[0\] "
                                       r"in the file, \[0, 1\] here\)"):
    comparison.finished_rows(seeds)
  assert comparison.finished_rows(other("same")).exists()  # its own legacy file loads


def test_a_table_puts_each_aggregator_in_a_row_of_its_own(tiny_config, tiny_wikinet, tmp_path):
  out = comparison.run_table(tiny_config, ["fedavg", "feddyn"], [0], 2, 1,
                             aggregators=["fedia", "gma", "fedheal"],
                             controls=RunControls(progress=False, out_dir=tmp_path / "agg"),
                             domain_graphs=tiny_wikinet)
  with open(out / "table.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["method"] for r in rows] == [
      "FedAvg", "FedAvg+FedIA", "FedAvg+GMA", "FedAvg+FedHEAL",
      "FedDyn", "FedDyn+FedIA", "FedDyn+GMA", "FedDyn+FedHEAL"]
  assert [(r["rho"], r["beta"], r["tau"]) for r in rows[:4]] == [
      ("", "", ""), ("0.5", "0.5", ""), ("", "", "0.1"), ("", "0.4", "0.3")]
  assert rows[6]["AVG_delta_base"] != "" and rows[2]["delta_fedavg"] != ""
  run = comparison.load_run(out / "runs" / "feddyn.npz")
  assert list(run.labels) == ["FedDyn+FedIA", "FedDyn+GMA", "FedDyn+FedHEAL", "FedDyn"]


def test_ablation_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "ablation"
  script_main("ablation")(["--dataset", "wikinet", "--settings", "default", "--rounds", "2",
                           "--raw-dir", str(raw_dir), "--cache-dir", str(prepared_cache),
                           "--out", str(out), "--no-progress", "--aggregators", "fedia,fedheal"])
  with open(out / "table.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["method"] for r in rows] == [
      "default:FedAvg", "default:FedAvg+IM", "default:FedAvg+IM+CAM", "default:FedAvg+FedHEAL"]
  assert [r["variant"] for r in rows] == ["base", "+fedia_im", "+fedia", "+fedheal"]
  assert (rows[1]["rho"], rows[1]["beta"], rows[2]["beta"]) == ("0.5", "", "0.5")
  assert (rows[3]["tau"], rows[3]["beta"]) == ("0.3", "0.4")  # the method config's
  run = comparison.load_run(out / "runs" / "default.npz")
  # IM only weighs clients by training-node counts, like FedAvg; CAM does not.
  assert list(run.labels) == ["FedAvg", "FedAvg+IM", "FedAvg+IM+CAM", "FedAvg+FedHEAL"]
  # The table names FedHEAL's hyper-parameters in its own order (tau, beta).
  assert "| FedAvg+FedHEAL | τ=0.3, β=0.4 |" in (out / "table.md").read_text()
  np.testing.assert_allclose(run.alpha[:, 1], run.alpha[:, 0], rtol=1e-5)
  assert not np.allclose(run.alpha[:, 1, -1], run.alpha[:, 2, -1])
  assert "FedAvg+IM+CAM" in (out / "table.md").read_text()


def test_overwrite_removes_only_its_own_files_and_only_after_the_data_loads(
    tiny_config, tiny_wikinet, tmp_path, capsys):
  out = tmp_path / "paper"
  run = lambda **kw: comparison.run_table(tiny_config, ["fedavg"], [0], 1, 1, controls=RunControls(
      progress=False, out_dir=out, **{k: v for k, v in kw.items() if k != "domain_graphs"}),
      domain_graphs=kw.get("domain_graphs"))
  run(domain_graphs=tiny_wikinet)
  (out / "table_notes.txt").write_text("mine")
  (out / "runs" / "keep.npz").write_bytes(b"mine")
  # The data cannot load: nothing is removed.
  with pytest.raises(OSError, match="missing does not exist \\(--raw-dir, FEDJAX_GRAPH_RAW"):
    run(overwrite=True, raw_dir=tmp_path / "missing", cache_dir=tmp_path / "cache")
  assert (out / "table.md").exists() and (out / "runs" / "fedavg.npz").exists()
  run(overwrite=True, domain_graphs=tiny_wikinet)
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
