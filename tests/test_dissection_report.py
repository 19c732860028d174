"""Tests for fedjax_graph.dissection_report, with answers computed by hand."""

import ast
import csv
import json
import math
import os

import numpy as np
import pytest
from matplotlib import image as mpimg

from fedjax_graph import dissection_report as dr

DOMAINS = ["cora", "dblp"]
CLIENT_DOMAIN = np.array([0, 0, 1, 1])
LEAVES = ["layer_0/kernel", "layer_0/bias"]
RUNS = ["mlp/fedavg", "mlp/fedia", "pmlp_gcn/fedavg", "pmlp_gcn/fedia"]
TOP = 0.05
FACTORS = {"homophily_gap": np.array([[0.0, 0.2], [0.2, 0.0]]),
           "label_js": np.array([[0.0, 0.5], [0.5, 0.0]])}
CSV_FILES = {
    "overlap.csv": list(dr.OVERLAP_COLUMNS),
    "pairs.csv": ["run", "round", "seed", "i", "j", "domain_i", "domain_j",
                  "jaccard", "cosine"],
    "clients.csv": ["run", "round", "seed", "client", "domain",
                    "cos_to_aggregate", "retention"],
    "factor_association.csv": ["backbone", "aggregator", "factor",
                               "spearman_rho"],
    "domain_factors.csv": ["factor", "domain_i", "domain_j", "value"],
    "dilution.csv": ["run", "round", "leaf", "kind", "bin_lo", "bin_hi",
                     "count", "share"],
}


def _block(within, cross, diag=1.0):
  """[4, 4] matrix for clients {0, 1} in cora and {2, 3} in dblp."""
  m = np.where(CLIENT_DOMAIN[:, None] == CLIENT_DOMAIN[None, :], within, cross)
  np.fill_diagonal(m, diag)
  return m


# Checkpoint 0: within 0.5, cross 0.1 -> mean off-diag (4*.5 + 8*.1)/12 = 7/30.
# Checkpoint 1: within 0.3, cross 0.05 -> (4*.3 + 8*.05)/12 = 2/15.
JAC = np.stack([_block(0.5, 0.1), _block(0.3, 0.05)])
# Cross pairs: (0, 2) is -0.2, the other three 0.1 -> 2 of 8 ordered pairs are
# negative (0.25) and the mean |cos| over the 4 pairs i<j is 0.5/4 = 0.125.
COS = _block(0.8, 0.1)
COS[0, 2] = COS[2, 0] = -0.2
CTA = np.array([0.5, 0.4, 0.3, 0.2])  # Mean 0.35.
RET = np.array([0.9, 0.8, 0.4, 0.3])  # Mean 0.6.


def _run(num_seeds, shift, num_k=2):
  """One run: seed s adds 0.1 s, the run adds ``shift``, off the diagonal."""
  off = 1.0 - np.eye(4)
  jac = np.stack([JAC[:num_k] + (0.1 * s + shift) * off
                  for s in range(num_seeds)])
  share = np.zeros((num_seeds, num_k, 2, 10))
  share[..., 0, 0], share[..., 0, 9], share[..., 1, 5] = 6, 2, 4  # 8 and 4.
  dil = np.zeros((num_seeds, num_k, 2, 12))
  dil[..., 0, 4], dil[..., 1, 7] = 2, 4  # Leaf 0: 6 of 8 excluded.
  rep = lambda x: np.broadcast_to(x, (num_seeds, num_k) + x.shape).astype(
      np.float32)
  return {"jaccard": jac.astype(np.float32), "cosine": rep(COS),
          "cos_to_aggregate": rep(CTA), "retention": rep(RET),
          "active_share_hist": share.astype(np.float32),
          "dilution_hist": dil.astype(np.float32),
          "test_acc": np.zeros((num_seeds, 3, 2), np.float32)}


def _write(tmp_path, num_seeds, num_k=2):
  runs = {k: _run(num_seeds, 0.02 * r, num_k) for r, k in enumerate(RUNS)}
  head = dr.write_dissection(tmp_path, runs, [1, 5][:num_k], CLIENT_DOMAIN,
                             DOMAINS, LEAVES, TOP, FACTORS, "toy S1")
  return runs, head


def _read(path):
  with open(path, newline="", encoding="utf-8") as f:
    return list(csv.reader(f))


def _expected_files(runs=RUNS):
  pngs = [f"jaccard_{k.replace('/', '_')}.png" for k in runs] + [
      "overlap_curves.png", "abs_cosine.png", "alignment.png",
      "factor_association.png", "dilution.png"]
  return set(pngs) | set(CSV_FILES) | {"headline.json"}, pngs


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_files_headers_and_hand_values(tmp_path, num_seeds):
  _, head = _write(tmp_path, num_seeds)
  files, pngs = _expected_files()
  assert set(os.listdir(tmp_path)) == files  # No stray temporary files.
  for name in pngs:
    with open(tmp_path / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert mpimg.imread(tmp_path / name).ndim == 3
  for name, header in CSV_FILES.items():
    assert _read(tmp_path / name)[0] == header, name

  seed_mean = 0.05 * (num_seeds - 1)  # Mean of the per-seed 0.1 s shifts.
  assert head == json.loads((tmp_path / "headline.json").read_text())
  assert head["random_reference"] == pytest.approx(0.05 / 1.95)
  assert (head["first_round"], head["last_round"]) == (1, 5)
  for r, key in enumerate(RUNS):
    h = head["runs"][key]
    assert h["mean_offdiag_first"] == pytest.approx(7 / 30 + 0.02 * r
                                                    + seed_mean)
    assert h["mean_offdiag_last"] == pytest.approx(2 / 15 + 0.02 * r
                                                   + seed_mean)
    assert h["frac_negative_cross_domain_last"] == pytest.approx(0.25)
    assert h["mean_cos_to_aggregate_last"] == pytest.approx(0.35)

  rows = _read(tmp_path / "overlap.csv")
  assert len(rows) == 1 + len(RUNS) * num_seeds * 2
  row = dict(zip(rows[0], rows[1]))  # mlp/fedavg, seed 0, round 1.
  assert (row["run"], row["backbone"], row["aggregator"], row["round"],
          row["seed"]) == ("mlp/fedavg", "mlp", "fedavg", "1", "0")
  expect = {"mean_offdiag": 7 / 30, "mean_within_domain": 0.5,
            "mean_cross_domain": 0.1, "random_reference": 0.05 / 1.95,
            "frac_negative_cross_domain": 0.25,
            "mean_abs_cos_cross_domain": 0.125, "mean_cos_to_aggregate": 0.35,
            "mean_retention": 0.6}
  for col, value in expect.items():
    assert float(row[col]) == pytest.approx(value, abs=1e-4), col

  pairs = _read(tmp_path / "pairs.csv")
  assert len(pairs) == 1 + len(RUNS) * num_seeds * 2 * 16
  assert pairs[3] == ["mlp/fedavg", "1", "0", "0", "2", "cora", "dblp",
                      "0.1000", "-0.2000"]
  assert len(_read(tmp_path / "clients.csv")) == 1 + len(RUNS) * num_seeds * 8

  # Two domains only: every client's discrepancy is the same, so rho is NaN.
  assoc = _read(tmp_path / "factor_association.csv")
  assert len(assoc) == 1 + len(RUNS) * len(FACTORS)
  assert all(r[3] == "nan" for r in assoc[1:])
  factors = _read(tmp_path / "domain_factors.csv")
  assert ["label_js", "cora", "dblp", "0.5000"] in factors

  dil = [dict(zip(CSV_FILES["dilution.csv"], r))
         for r in _read(tmp_path / "dilution.csv")[1:]]
  assert len(dil) == len(RUNS) * 2 * 2 * (10 + 12)
  hit = [r for r in dil if r["run"] == "mlp/fedia" and r["round"] == "5"
         and r["leaf"] == "layer_0/kernel" and r["kind"] == "active_share"]
  assert [int(r["count"]) for r in hit] == [6 * num_seeds] + [0] * 8 + [
      2 * num_seeds]
  assert (hit[0]["bin_lo"], hit[0]["bin_hi"], hit[0]["share"]) == (
      "0.0000", "0.1000", "0.7500")


def test_single_checkpoint_many_clients(tmp_path):
  # Twitch-S3-like: K=1, C=30 clients in 6 domains (DE replicated), a single
  # run (1 backbone x 1 aggregator), S=3. Every client of domain d has
  # retention d, and d's mean label discrepancy to the others, (3d + 15) / 5,
  # also grows with d, so the ranks agree exactly: rho = 1 (-1 for the
  # negated factor). The all-zero homophily factor is constant: rho = NaN.
  rng = np.random.default_rng(1)
  domain = np.repeat(np.arange(6), [10, 4, 4, 4, 4, 4])
  sym = lambda m: (m + np.swapaxes(m, -1, -2)) / 2
  level = np.arange(6, dtype=float)
  label = np.abs(level[:, None] + level[None, :]) * (1 - np.eye(6))
  factors = {"label_js": label, "degree_distance": -label,
             "homophily_gap": np.zeros((6, 6))}
  shape = (3, 1)
  runs = {f"{b}/fedavg": {
      "jaccard": sym(rng.uniform(0, 0.3, shape + (30, 30))),
      "cosine": sym(rng.uniform(-0.5, 0.8, shape + (30, 30))),
      "cos_to_aggregate": rng.uniform(-0.2, 0.8, shape + (30,)),
      "retention": np.broadcast_to(level[domain], shape + (30,)),
      "active_share_hist": rng.integers(0, 50, shape + (4, 10)).astype(float),
      "dilution_hist": rng.integers(0, 20, shape + (4, 12)).astype(float)}
      for b in ("sage",)}
  head = dr.write_dissection(tmp_path, runs, [200], domain,
                             ["DE", "EN", "ES", "FR", "PT", "RU"],
                             ["l0/kernel", "l0/bias", "l1/kernel", "l1/bias"],
                             0.05, factors, "Twitch S3")
  assert head["first_round"] == head["last_round"] == 200
  for key, run in runs.items():
    h = head["runs"][key]
    assert h["mean_offdiag_first"] == h["mean_offdiag_last"]
    assert h["mean_cos_to_aggregate_last"] == pytest.approx(
        run["cos_to_aggregate"].mean())
  assert set(os.listdir(tmp_path)) == _expected_files(["sage/fedavg"])[0]
  assert len(_read(tmp_path / "pairs.csv")) == 1 + 3 * 900
  rho = {r[2]: r[3] for r in _read(tmp_path / "factor_association.csv")[1:]}
  assert rho == {"label_js": "1.0000", "degree_distance": "-1.0000",
                 "homophily_gap": "nan"}


def test_rejects_bad_shapes(tmp_path):
  run = _run(1, 0.0)
  with pytest.raises(ValueError, match="retention"):
    dr.write_dissection(tmp_path, {"mlp/fedavg": {**run, "retention":
                                                  run["retention"][..., :3]}},
                        [1, 5], CLIENT_DOMAIN, DOMAINS, LEAVES, TOP, FACTORS,
                        "t")
  with pytest.raises(ValueError, match="backbone"):
    dr.write_dissection(tmp_path, {"mlp": run}, [1, 5], CLIENT_DOMAIN,
                        DOMAINS, LEAVES, TOP, FACTORS, "t")
  assert os.listdir(tmp_path) == []


def test_module_imports_no_jax_at_load_time():
  # diagnostics needs jax and is imported on call only. A static check: a
  # fresh interpreter would cost more than this whole file's other checks.
  tree = ast.parse(open(dr.__file__, encoding="utf-8").read())
  top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  names = {a.name for n in top for a in n.names} | {
      n.module for n in top if isinstance(n, ast.ImportFrom)}
  assert not {"jax", "diagnostics", "fedjax_graph.diagnostics"} & names
  assert names & {"report"}  # Reuses report's writers.
