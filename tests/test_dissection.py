"""Diagnostics inside the jitted rounds: opt-in, trajectory-neutral, end to end on real data."""

import csv
import json

import numpy as np
import pytest

from conftest import script_main, usage_error
from fedjax_graph import cells as cells_lib
from fedjax_graph import config, data, diagnostics, simulation, sweep


def test_diagnostics_do_not_change_the_trajectory(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  cells = cells_lib.grid("fedia", rho=[0.4], beta=[0.6])
  controls = sweep.RunControls(chunk=2, progress=False)
  plain = sweep.run_sweep(cfg, federation, cells, rounds=4, controls=controls)
  spec = simulation.DiagnosticsSpec(rounds=(1, 4), top=0.1)
  observed = sweep.run_sweep(cfg, federation, cells, rounds=4, controls=controls,
                             diagnostics=spec)
  assert plain.diagnostics is None
  for name in ("test_acc", "val_acc", "train_loss", "alpha", "mask_coverage"):
    np.testing.assert_array_equal(getattr(plain, name), getattr(observed, name), err_msg=name)
  jaccard = observed.diagnostics.jaccard  # [S, G', T, C, C]
  np.testing.assert_array_equal(jaccard[:, :, [1, 2]], 0.0)  # not a checkpoint round
  np.testing.assert_allclose(np.diagonal(jaccard[:, :, [0, 3]], axis1=-2, axis2=-1), 1.0)
  off_diagonal = jaccard[0, 0, 0][~np.eye(federation.num_clients, dtype=bool)]
  assert np.all((off_diagonal >= 0) & (off_diagonal < 1))




def test_diagnose_end_to_end_on_real_wikinet(raw_dir, prepared_cache, tmp_path, capsys):
  out = tmp_path / "dissect"
  script_main("diagnose")(["--dataset", "wikinet", "--rounds", "3", "--checkpoints", "1,3",
                    "--backbones", "pmlp_gcn", "--aggregators", "fedavg,fedia",
                    "--raw-dir", str(raw_dir), "--cache-dir", str(prepared_cache),
                    "--out", str(out), "--no-progress"])
  headline = json.loads((out / "headline.json").read_text())
  assert "pmlp_gcn/fedavg" in json.dumps(headline) and "pmlp_gcn/fedia" in json.dumps(headline)
  for name in ("overlap_curves.png", "abs_cosine.png", "alignment.png", "factor_association.png",
               "dilution.png", "jaccard_pmlp_gcn_fedavg.png", "overlap.csv", "pairs.csv",
               "clients.csv", "factor_association.csv", "domain_factors.csv", "dilution.csv"):
    assert (out / name).exists(), name
  with open(out / "overlap.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["round"] for r in rows} == {"1", "3"}
  for r in rows:
    assert 0 <= float(r["mean_offdiag"]) <= 1
    assert float(r["random_reference"]) == pytest.approx(0.05 / 1.95, abs=1e-4)
  arrays = np.load(out / "diagnostics.npz")
  assert arrays["pmlp_gcn/fedavg/jaccard"].shape == (1, 2, 6, 6)  # [S, K, C, C]
  assert arrays["factor/label_js"].shape == (3, 3)
  # The salient sets of two clients of one round overlap more than random sets would.
  assert arrays["pmlp_gcn/fedavg/jaccard"][0, 0][~np.eye(6, dtype=bool)].mean() > (
      diagnostics.random_overlap_reference(0.05))


def test_diagnose_runs_every_backbone_it_offers_sfpd_too(tiny_wikinet, tmp_path):
  from fedjax_graph.dissection import run_diagnose

  # SFPD has no norm layer, and diagnose.py has no --norm to turn the preset's batch norm off.
  headline = run_diagnose("wikinet", None, ["sfpd"], ["fedavg"], [1, 2], 2, [0],
                          out_dir=tmp_path / "d", progress=False, domain_graphs=tiny_wikinet)
  assert "sfpd/fedavg" in json.dumps(headline)
  assert json.loads((tmp_path / "d" / "config.json").read_text())["configs"]["sfpd"]["norm"] == "none"


@pytest.mark.parametrize("flags, message", [
    (["--checkpoints", "0,3"], "checkpoints = [0, 3]"),
    (["--checkpoints", "5", "--rounds", "3"], "checkpoints = [5]"),
    (["--top", "1.5"], "top = 1.5"),
    (["--backbones", "pmlp_gcn,resnet"], "backbones = ['pmlp_gcn', 'resnet']"),
    (["--aggregators", "fedavg,krum"], "aggregators = ['fedavg', 'krum']"),
])
def test_diagnose_rejects_bad_flags(flags, message, tmp_path, capsys):
  argv = ["--dataset", "wikinet", "--out", str(tmp_path / "x"), *flags]
  assert message in usage_error("diagnose", argv, capsys)
  assert not (tmp_path / "x").exists()


def test_a_factor_flat_up_to_float_noise_has_no_association():
  client_domain = np.array([0, 0, 1, 1, 2, 2])
  noise = np.array([[0, 1e-9, 2e-9], [1e-9, 0, 3e-9], [2e-9, 3e-9, 0]])
  real = np.array([[0, 1.0, 2.0], [1.0, 0, 3.0], [2.0, 3.0, 0]])
  retention = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
  rho = diagnostics.factor_association({"flat": noise, "real": real}, retention, client_domain)
  assert np.isnan(rho["flat"]) and np.isfinite(rho["real"])


def test_diagnose_refuses_a_finished_folder(tiny_wikinet, tmp_path):
  from fedjax_graph.experiment import prepare_out_dir
  (tmp_path / "headline.json").write_text("{}")
  with pytest.raises(ValueError, match="holds a finished run; pass --overwrite"):
    prepare_out_dir(tmp_path, resume=False, overwrite=False, finished_marker="headline.json",
                    resumable=False)
  (tmp_path / "headline.json").unlink()
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ValueError, match="unfinished run that cannot be resumed"):
    prepare_out_dir(tmp_path, resume=False, overwrite=False, finished_marker="headline.json",
                    resumable=False)
  prepare_out_dir(tmp_path, resume=False, overwrite=True, finished_marker="headline.json",
                  resumable=False)
  # --overwrite passes the check; the run removes its old files only once its data has loaded.
  assert (tmp_path / "config.json").exists()
