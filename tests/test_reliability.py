"""Resumable sweeps, non-finite updates, validated inputs and paired random streams."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from fedjax_graph import aggregators
from fedjax_graph import cells as cells_lib
from fedjax_graph import config, data, experiment, simulation, sweep
from fedjax_graph.controls import RunControls

from conftest import REPO

QUIET = RunControls(progress=False)
FEDIA = cells_lib.grid("fedia", rho=[0.5], beta=[0.5])


@pytest.fixture(scope="module")
def setup(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0, 1])
  return cfg, federation, simulation.make_simulation(cfg, federation)


class Interrupt(Exception):
  pass


def _interrupting(sim, after_chunks):
  calls = [0]

  def run_chunk(*args, **kwargs):
    calls[0] += 1
    if calls[0] > after_chunks:
      raise Interrupt
    return sim.run_chunk(*args, **kwargs)

  return sim._replace(run_chunk=run_chunk)


def test_resumed_sweep_equals_uninterrupted(setup, tmp_path, capsys):
  cfg, federation, sim = setup
  cells = cells_lib.grid("fedia", rho=[0.3, 0.7], beta=[0.5])
  controls = QUIET.replace(chunk=2)
  run = lambda s, path: sweep.run_sweep(cfg, federation, cells, rounds=6, controls=controls,
                                        simulation=s, checkpoint_path=path, fingerprint="f")
  whole = run(sim, None)
  path = tmp_path / "ckpt.msgpack"
  with pytest.raises(Interrupt):
    run(_interrupting(sim, after_chunks=2), path)
  assert path.exists()
  capsys.readouterr()
  resumed = run(sim, path)
  assert len(resumed.seconds) == 1  # only the last chunk ran again
  assert capsys.readouterr().out.endswith("; resumes at round 5 of 6\n")
  for name in ("test_acc", "val_acc", "train_loss", "alpha", "mask_coverage", "nonfinite"):
    np.testing.assert_array_equal(getattr(resumed, name), getattr(whole, name), err_msg=name)
  with pytest.raises(ValueError, match="different setup"):
    sweep.run_sweep(cfg, federation, cells, rounds=6, controls=controls, simulation=sim,
                    checkpoint_path=path, fingerprint="other")


def test_grid_resume_overwrite_and_refusals(setup, tiny_wikinet, tmp_path, monkeypatch):
  cfg, _, _ = setup
  args = ("fedia", {"rho": [0.5], "beta": [0.3, 0.9]}, [0], 4, 2)
  controls = QUIET.replace(chunk=1)
  run = lambda out, **kw: experiment.run_grid(cfg, *args, controls.replace(out_dir=out, **kw),
                                              domain_graphs=tiny_wikinet)
  whole = run(tmp_path / "whole")

  real = sweep.make_simulation
  monkeypatch.setattr(sweep, "make_simulation", lambda *a: _interrupting(real(*a), 2))
  with pytest.raises(Interrupt):
    run(tmp_path / "cut")
  monkeypatch.setattr(sweep, "make_simulation", real)
  assert json.loads((tmp_path / "cut" / "config.json").read_text())["status"] == "stopped: Interrupt"
  with pytest.raises(ValueError, match="unfinished run; continue it with --resume"):
    run(tmp_path / "cut")
  experiment.resume_grid(tmp_path / "cut", QUIET, domain_graphs=tiny_wikinet)
  # Each call's batch plan is kept: the resumed call's, and the first one's from round 0.
  record = json.loads((tmp_path / "cut" / "config.json").read_text())
  assert record["batch"]["first_round"] == 2
  assert [p["first_round"] for p in record["earlier_batches"]] == [0]

  a, b = np.load(whole / "history.npz"), np.load(tmp_path / "cut" / "history.npz")
  assert sorted(a.files) == sorted(b.files)
  for name in a.files:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  assert (whole / "summary.csv").read_text() == (tmp_path / "cut" / "summary.csv").read_text()

  with pytest.raises(ValueError, match="finished run; pass --overwrite"):
    run(whole)
  with pytest.raises(ValueError, match="finished run; nothing to resume"):
    experiment.resume_grid(whole, domain_graphs=tiny_wikinet)
  run(whole, overwrite=True)
  np.testing.assert_array_equal(np.load(whole / "history.npz")["fedia_test"], a["fedia_test"])

  # Stopped while writing its outputs, after the last round: not finished, resumable.
  def stop(*args, **kwargs):
    raise Interrupt
  monkeypatch.setattr(experiment.report, "plot_curves", stop)
  with pytest.raises(Interrupt):
    run(tmp_path / "late")
  monkeypatch.undo()
  assert not (tmp_path / "late" / "summary.csv").exists()
  experiment.resume_grid(tmp_path / "late", QUIET, domain_graphs=tiny_wikinet)
  assert (whole / "summary.csv").read_text() == (tmp_path / "late" / "summary.csv").read_text()
  assert (tmp_path / "late" / "curves.png").exists()
  assert not (tmp_path / "late" / "checkpoint.msgpack").exists()


@pytest.fixture(scope="module")
def poisoned(tiny_wikinet):
  """Every squirrel client sends a NaN update (its features are NaN)."""
  graphs = {d: dict(g) for d, g in tiny_wikinet.items()}
  graphs["squirrel"]["x"] = np.full_like(graphs["squirrel"]["x"], np.nan)
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  federation = data.build_federation(cfg, graphs, seeds=[0])
  return cfg, federation, simulation.make_simulation(cfg, federation)


def test_nonfinite_updates_skip_keeps_models_finite(poisoned):
  cfg, federation, sim = poisoned
  history = sweep.run_sweep(cfg, federation, FEDIA, rounds=3,
                            controls=QUIET.replace(nonfinite="skip"), simulation=sim)
  bad = federation.client_domain == 1
  assert history.nonfinite[..., bad].all() and not history.nonfinite[..., ~bad].any()
  assert np.isfinite(history.alpha).all() and np.isfinite(history.train_loss).all()
  np.testing.assert_array_equal(history.alpha[..., bad], 0.0)
  np.testing.assert_allclose(history.alpha.sum(-1), 1.0, rtol=1e-5)
  # The other domains still learn a finite model; the poisoned one's accuracy is just low.
  assert np.isfinite(history.test_acc).all()


def test_nonfinite_updates_error_names_round_client_and_domain(poisoned):
  cfg, federation, sim = poisoned
  with pytest.raises(sweep.NonFiniteUpdateError,
                     match=r"client 2 \(domain squirrel\) .* in round 1 \(seed 0, FedIA ρ=0.5"):
    sweep.run_sweep(cfg, federation, FEDIA, rounds=2, controls=QUIET, simulation=sim)


def test_a_nan_client_is_left_out_by_the_guard_and_by_fedia_itself():
  updates = {"w": np.array([[1.0, 2.0], [np.nan, 0.0], [0.5, 0.5]], np.float32)}
  fedia = aggregators.fedia()
  # FedIA excludes a client whose score is not finite instead of poisoning every weight ...
  update, _, diag = fedia.update(updates, fedia.init(3), 1.0, 0.0)
  assert np.isfinite(update["w"]).all() and np.isfinite(diag.softmax).all()
  np.testing.assert_array_equal(diag.excluded, [False, True, False])
  # ... and the simulation never offers it one: its guard leaves the client out first.
  finite = simulation.finite_clients(updates)
  np.testing.assert_array_equal(finite, [True, False, True])
  guarded, _, diag = fedia.update(updates, fedia.init(3), 1.0, 0.0, participating=finite)
  np.testing.assert_allclose(guarded["w"], update["w"], rtol=1e-6)
  assert not diag.excluded.any()


def test_empty_clients_error_or_weight_zero(tiny_wikinet):
  graphs = dict(tiny_wikinet)
  graphs["chameleon"] = {k: v for k, v in tiny_wikinet["chameleon"].items()}
  graphs["chameleon"] = dict(x=graphs["chameleon"]["x"][:2], y=graphs["chameleon"]["y"][:2],
                             edge_index=np.zeros((2, 0), np.int32))
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, split=[0.4, 0.3, 0.3])
  with pytest.raises(ValueError, match="without training nodes.*allow_empty_clients"):
    data.build_federation(cfg, graphs, seeds=[0])
  cfg = dataclasses.replace(cfg, allow_empty_clients=True)
  federation = data.build_federation(cfg, graphs, seeds=[0])
  assert federation.train_counts[:2].tolist() == [0, 0]
  history = sweep.run_sweep(cfg, federation, FEDIA, rounds=2, controls=QUIET)
  np.testing.assert_array_equal(history.alpha[..., :2], 0.0)
  assert np.isfinite(history.alpha).all() and not history.nonfinite.any()


def test_cells_of_a_seed_are_paired_and_seeds_are_not(setup):
  _, federation, sim = setup
  batch = jax.device_put(cells_lib.grid("fedia", rho=[0.1, 0.5], beta=[0.3, 0.9]).batch())
  groups = sim.init(np.array(federation.seeds, np.int32), batch)  # FedIA's 4 cells, FedAvg's
  keys = np.concatenate([np.asarray(g.key) for g in groups], axis=1)  # [S, G', 2]
  assert (keys == keys[:, :1]).all() and not (keys[0] == keys[1]).all()
  kernel = np.concatenate([np.asarray(g.params["params"]["layer_0"]["kernel"]) for g in groups],
                          axis=1)  # [S, G', F, H]
  assert (kernel == kernel[:, :1]).all() and not np.allclose(kernel[0], kernel[1])


def test_paired_cells_start_alike_and_fedia_at_one_is_uniform_averaging(setup):
  cfg, federation, _ = setup
  # FedIA at rho = beta = 1 next to the base method with uniform weights, in one program.
  cells = cells_lib.Cells([cells_lib.cell("fedia", rho=1.0, beta=1.0), cells_lib.cell("fedavg"),
                           cells_lib.cell("fedia", rho=0.3, beta=0.5),
                           cells_lib.cell("fedia_im", rho=0.5), cells_lib.cell("gma", tau=0.5)])
  history = sweep.run_sweep(cfg, federation, cells, rounds=4, controls=QUIET,
                            method_hparams={"weights": "uniform"})
  first = history.train_loss[:, :, 0]  # [S, G'] round 1: same model, same dropout masks
  # Equal up to the last bit of a batched reduction (cells are lanes of one vmap, and XLA:CPU may
  # sum lanes in different orders: 1 ulp seen on an AMD EPYC host); unpaired cells differ by far more.
  np.testing.assert_allclose(first, np.broadcast_to(first[:, :1], first.shape), rtol=1e-6)
  assert not np.allclose(first[0], first[1])  # seeds differ
  np.testing.assert_allclose(history.train_loss[:, 0], history.train_loss[:, 1], rtol=1e-6)
  np.testing.assert_allclose(history.alpha[:, 0], history.alpha[:, 1], rtol=1e-6)
  # The same counts; XLA may divide as a multiply by the reciprocal in one group, not the other.
  np.testing.assert_allclose(history.test_acc[:, 0], history.test_acc[:, 1], atol=1e-6)
  # Later rounds do differ where the aggregation differs.
  assert not np.allclose(history.train_loss[:, 2, 1:], history.train_loss[:, 1, 1:])


@pytest.mark.parametrize("overrides, message", [
    (dict(clients_per_domain={"chameleon": 0, "squirrel": 2, "crocodile": 2}),
     "clients_per_domain['chameleon'] = 0"),
    (dict(clients_per_domain={"chameleon": 2, "squirrel": 2, "crocodile": 2, "mars": 1}),
     "unknown wikinet domain(s) ['mars']"),
    (dict(split=[0.6, 0.6, -0.2]), "split = [0.6, 0.6, -0.2]"),
    (dict(backbone="transformer"), "Unsupported model: 'transformer'"),
    (dict(dropout=1.0), "dropout = 1.0"),
    (dict(lr=0), "lr = 0"),
    (dict(local_steps=0), "local_steps = 0"),
    (dict(colour="red"), "unknown config field(s) ['colour']"),
])
def test_config_values_are_checked_with_named_messages(overrides, message):
  with pytest.raises(ValueError) as err:
    config.load_preset("wikinet", **overrides)
  assert message in str(err.value)


def test_more_clients_than_nodes_is_an_error(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8,
                           clients_per_domain={"chameleon": 41, "squirrel": 2, "crocodile": 2})
  with pytest.raises(ValueError,
                     match=r"clients_per_domain\['chameleon'\] = 41; its 40 nodes allow 1 to 40"):
    data.build_federation(cfg, tiny_wikinet, seeds=[0])


def test_grid_stopped_by_a_nonfinite_update_resumes_with_skip(tiny_wikinet, tmp_path):
  graphs = {d: dict(g) for d, g in tiny_wikinet.items()}
  graphs["squirrel"]["x"] = np.full_like(graphs["squirrel"]["x"], np.nan)
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  with pytest.raises(sweep.NonFiniteUpdateError, match="--resume DIR --nonfinite skip"):
    experiment.run_grid(cfg, "fedia", {"rho": [0.5], "beta": [0.5]}, [0], 2, 1,
                        QUIET.replace(chunk=1, out_dir=tmp_path / "run"), domain_graphs=graphs)
  experiment.resume_grid(tmp_path / "run", QUIET, domain_graphs=graphs, nonfinite="skip")
  rows = (tmp_path / "run" / "summary.csv").read_text().splitlines()
  # Two squirrel clients left out in each of the 2 rounds, for FedAvg and for the FedIA cell.
  assert [r.split(",")[-1] for r in rows[1:]] == ["4", "4"]


def test_a_folder_a_live_run_writes_is_refused_whatever_the_flags(tmp_path):
  from fedjax_graph import rundir

  out = tmp_path / "run"
  script = ("import json, pathlib, sys, time; from fedjax_graph import rundir\n"
            "out = pathlib.Path(sys.argv[1])\n"
            "with rundir.claimed(out):\n"
            "  record = {'status': 'running', **rundir.provenance()}\n"
            "  (out / 'config.json').write_text(json.dumps(record))\n"
            "  print('held', flush=True); time.sleep(60)\n")
  child = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE,
                           text=True, cwd=REPO)
  try:
    assert child.stdout.readline() == "held\n"
    for resume, advice in ((True, "stop it and then resume$"), (False, "choose another --out$")):
      with pytest.raises(ValueError, match=f"another run \\(pid {child.pid}, .*{advice}"):
        with rundir.claimed(out, resume):
          rundir.prepare_out_dir(out, resume, overwrite=not resume, record_key="grid")
    # An ended run's config.json (the holder has not written its own yet) names no pid.
    record = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**record, "status": "finished"}))
    with pytest.raises(ValueError, match="being written by another run; wait for it"):
      with rundir.claimed(out):
        pass
  finally:
    child.kill()  # as kill -9: no clean-up runs, the lock file stays
    child.wait()
  assert (out / rundir.LOCK).exists()
  # The operating system dropped the dead process's lock: the folder is free, and this
  # process holds it re-entrantly (a table's methods, one after another).
  with rundir.claimed(out):
    with rundir.claimed(out):
      assert (out / rundir.LOCK).exists()
  assert not (out / rundir.LOCK).exists()
  # A folder the claim made and nothing filled is removed again: a refused run leaves nothing.
  with pytest.raises(ValueError, match="holds no run to resume"):
    with rundir.claimed(tmp_path / "new"):
      rundir.prepare_out_dir(tmp_path / "new", resume=True, overwrite=False)
  assert not (tmp_path / "new").exists()
