"""Runs over several devices and in sub-batches: one device's results, no collective, the plan recorded."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from conftest import REPO, script_main, usage_error
from fedjax_graph import cli, devices, io
from fedjax_graph.cells import CellBatch, Group
from fedjax_graph.controls import RunControls, parse_size

# Runs in a fresh interpreter: the host platform's device count is fixed when
# jax starts. Three seeds x (2 FedIA cells + FedAvg) = 6 + 3 runs: "one" on one
# device (today's program), "four" on 4 devices with a budget 10 % under both
# the estimate and XLA's figure for all runs at once, so they are padded (to
# multiples of 4) and split into sub-batches; then the same with half the
# clients sampled and round 1 not evaluated. The compiles (a small recipe)
# dominate the file's time.
FOUR_DEVICES = textwrap.dedent("""
    import json, pathlib, sys
    sys.path.insert(0, str(pathlib.Path.cwd().parent))
    import jax, numpy as np
    from conftest import fake_domain
    from fedjax_graph import cells, config, data, devices, experiment, simulation
    from fedjax_graph.controls import RunControls

    out = pathlib.Path(sys.argv[1])
    assert jax.device_count() == 4, jax.devices()
    sizes = {"chameleon": 40, "squirrel": 60, "crocodile": 90}
    graphs = {d: fake_domain(n, 2 * n, 5, 8, i) for i, (d, n) in enumerate(sizes.items())}
    cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, num_layers=2, local_steps=2)
    grid, seeds = {"rho": [0.3, 0.7], "beta": [0.5]}, [0, 1, 2]
    federation = data.build_federation(cfg, graphs, seeds)
    sim = simulation.make_simulation(cfg, federation)
    batch = cells.grid("fedia", **grid).batch()
    sizes = [g.size for g in batch.groups]
    whole = devices.estimate(sim, federation, batch, 2).total(devices.layout(3, sizes, 4, 1))
    # A budget under both the estimate and XLA's figure for all runs at once: they must split.
    at_once = devices.ShardedRunner(sim, devices.device_mesh(4), devices.layout(3, sizes, 4, 1),
                                    sim.init(np.array(seeds, np.int32), jax.device_put(batch)),
                                    batch, federation).compiled_bytes(0, 2)
    budget = int(0.9 * min(whole, at_once))

    for name, controls in (("one", dict(devices=1)),
                           ("four", dict(devices=4, max_memory=budget))):
      experiment.run_grid(cfg, "fedia", grid, seeds, 2, 2, RunControls(
          out_dir=out / name, progress=False, chunk=2, **controls), domain_graphs=graphs)
    # Half the clients sampled (only they train, in slots), round 1 not evaluated.
    sampled = config.load_preset("wikinet", hidden=8, max_buckets=1, num_layers=2,
                                 local_steps=2, participation=0.5)
    for name, count in (("one_sampled", 1), ("four_sampled", 4)):
      experiment.run_grid(sampled, "fedia", grid, seeds, 2, 1, RunControls(
          out_dir=out / name, progress=False, chunk=2, devices=count, eval_every=2),
          domain_graphs=graphs)

    # Today's program called directly (cached): what "one" ran.
    placed = jax.device_put(batch)
    _, direct = sim.run_chunk(sim.init(np.array(seeds, np.int32), placed), np.int32(0), placed,
                              simulation.sim_data(federation), num_rounds=2)
    np.savez(out / "direct.npz", **{k: np.asarray(v) for k, v in direct._asdict().items()
                                    if v is not None})

    # The 4-device program "four" ran (cached): no collective in its HLO.
    plan = json.loads((out / "four" / "config.json").read_text())["batch"]
    layout = devices.layout(3, sizes, 4, plan["sub_batches"])
    state = sim.init(np.array(seeds, np.int32), jax.device_put(batch))
    runner = devices.ShardedRunner(sim, devices.device_mesh(4), layout, state, batch, federation)
    hlo = runner.chunk.lower(runner.states[0], np.int32(0), *runner.inputs[0], runner.data,
                             num_rounds=2).compile().as_text()
    # The detector finds the all-reduce of a psum over the same mesh.
    spec = jax.sharding.PartitionSpec(devices.AXIS)
    summed = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, devices.AXIS),
                                   mesh=devices.device_mesh(4), in_specs=spec,
                                   out_specs=jax.sharding.PartitionSpec()))
    control = summed.lower(np.ones(4, np.float32)).compile().as_text()
    (out / "hlo.json").write_text(json.dumps({"round": devices.collectives(hlo),
                                              "psum": devices.collectives(control),
                                              "budget": budget}))
""")


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
  out = tmp_path_factory.mktemp("devices")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, "-c", FOUR_DEVICES, str(out)], cwd=REPO / "tests",
                        env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  return out, done.stdout


def _history(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def test_four_devices_in_sub_batches_give_one_devices_results(four_devices):
  out, _ = four_devices
  one, four = (_history(out / name / "history.npz") for name in ("one", "four"))
  assert one.keys() == four.keys()
  for name, expected in one.items():
    assert four[name].shape == expected.shape, name  # the padding is dropped
    if expected.dtype.kind in "fc":
      np.testing.assert_allclose(four[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    else:
      np.testing.assert_array_equal(four[name], expected, err_msg=name)
  assert not np.allclose(one["fedia_test"][0], one["fedia_test"][1])  # two real cells
  assert not np.allclose(one["fedavg_test"][0], one["fedavg_test"][1])  # three real seeds


def test_sampled_clients_and_skipped_evaluations_shard_like_one_device(four_devices):
  out, _ = four_devices
  one, four = (_history(out / name / "history.npz") for name in ("one_sampled", "four_sampled"))
  assert json.loads((out / "four_sampled" / "config.json").read_text())["batch"]["devices"] == 4
  for name, expected in one.items():
    if expected.dtype.kind in "fc":
      np.testing.assert_allclose(four[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    else:
      np.testing.assert_array_equal(four[name], expected, err_msg=name)
  assert np.isnan(one["fedia_test"][:, :, 0]).all() and not np.isnan(one["fedia_test"][:, :, 1]).any()
  assert ((one["alpha"] > 0).sum(-1) < one["alpha"].shape[-1]).all()  # not every client took part


def test_one_device_is_todays_program_bit_for_bit(four_devices):
  out, _ = four_devices
  one, direct = _history(out / "one" / "history.npz"), _history(out / "direct.npz")
  # Cells in the grid's order: FedIA (0.3, 0.5), FedIA (0.7, 0.5), FedAvg; [S, G', T, ...].
  np.testing.assert_array_equal(one["fedia_test"], np.moveaxis(direct["test_acc"][:, :2], 0, 1))
  np.testing.assert_array_equal(one["fedavg_test"], direct["test_acc"][:, 2])
  for name in ("train_loss", "alpha", "mask_coverage", "nonfinite", "predicted_classes"):
    np.testing.assert_array_equal(one[name], direct[name], err_msg=name)


def test_the_plan_is_printed_and_recorded(four_devices):
  out, printed = four_devices
  one, four = (json.loads((out / name / "config.json").read_text())["batch"]
               for name in ("one", "four"))
  assert (one["devices"], one["sub_batches"], one["padding_runs"], one["runs"]) == (1, 1, 0, 9)
  assert "batch: 9 runs (3 seed(s) x 3 cells) on 1 device(s); memory per device" in printed
  budget = json.loads((out / "hlo.json").read_text())["budget"]
  assert four["devices"] == 4 and four["sub_batches"] > 1 and four["memory_budget"] == "--max-memory"
  assert four["memory_budget_bytes"] == budget
  # CPU reports its buffers: XLA's figure of the program that ran is within the budget.
  assert 0 < four["memory_xla_bytes"] <= four["memory_budget_bytes"]
  per_group = four["group_runs_per_sub_batch"]
  assert all(m % 4 == 0 for m in per_group)  # each sub-batch splits evenly over the devices
  assert four["padding_runs"] == four["sub_batches"] * sum(per_group) - 9 > 0
  assert (f"batch: 9 runs (3 seed(s) x 3 cells) on 4 device(s) in {four['sub_batches']} "
          f"sub-batches of {four['runs_per_sub_batch']} runs ({four['padding_runs']} padding "
          "run(s) repeat real ones)") in printed


def test_no_collective_inside_the_sharded_round(four_devices):
  out, _ = four_devices
  found = json.loads((out / "hlo.json").read_text())
  assert found["round"] == []
  assert found["psum"] == ["all-reduce"]  # the detector sees one when there is one


def test_layout_pads_with_real_runs_and_round_trips():
  layout = devices.layout(num_seeds=3, group_sizes=[2, 1], devices=4, splits=1)
  assert layout.per_batch == (8, 4) and layout.padding == 3 and not layout.trivial
  np.testing.assert_array_equal(layout.source(0), [0, 1, 2, 3, 4, 5, 0, 1])
  split = devices.layout(num_seeds=3, group_sizes=[5, 1], devices=2, splits=3)
  assert split.per_batch == (6, 2) and split.runs == 18 and split.padding == 6
  assert devices.finest_split(3, [5, 1], 2) == 8
  assert devices.layout(2, [3], 1, 1).trivial

  rng = np.random.default_rng(0)
  states = ({"w": rng.normal(size=(3, 5, 4)), "k": rng.integers(0, 9, (3, 5))},
            {"w": rng.normal(size=(3, 1, 4)), "k": rng.integers(0, 9, (3, 1))})
  sub = split.to_runs(states)
  assert len(sub) == 3 and sub[0][0]["w"].shape == (6, 4) and sub[2][1]["k"].shape == (2,)
  back = split.from_runs(sub)
  for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(states)):
    np.testing.assert_array_equal(got, want)
  # Each slot gets its run's seed row and cell values; a padding slot repeats a real run.
  batch = CellBatch((Group("gma", ("tau",), 5), Group("fedavg", (), 1)),
                    ({"tau": np.arange(5, dtype=np.float32) / 10}, {}))
  inputs = split.inputs(batch)
  seeds = np.concatenate([i[1][0] for i in inputs])
  taus = np.concatenate([i[0].values[0]["tau"] for i in inputs])
  run = split.source(0)
  np.testing.assert_array_equal(seeds, run // 5)
  np.testing.assert_allclose(taus, (run % 5) / 10)
  np.testing.assert_array_equal(np.concatenate([i[1][1] for i in inputs]), [0, 1, 2, 0, 1, 2])
  np.testing.assert_array_equal(np.concatenate([s[0]["w"] for s in sub]),
                                states[0]["w"].reshape(15, 4)[run])


@pytest.mark.parametrize("text, size", [("8G", 8 * 2**30), ("512M", 512 * 2**20),
                                        ("1.5g", 3 * 2**29), ("8GiB", 8 * 2**30),
                                        ("2 GB", 2 * 2**30), ("100", 100), ("64k", 2**16),
                                        ("1e9", 10**9), ("2.5E3", 2500)])
def test_memory_sizes_parse(text, size):
  assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "8X", "-1G", "-5M", "G", "e3", "1e"])
def test_bad_memory_sizes_name_the_text(text):
  with pytest.raises(ValueError, match=f"memory size {text!r}: give a number of bytes"):
    parse_size(text)


@pytest.mark.parametrize("text, size", [("0", 0), ("0.5", 0)])
def test_memory_sizes_below_one_byte_say_so(text, size):
  with pytest.raises(ValueError, match=f"memory size {text!r} is {size} bytes; give at least one"):
    parse_size(text)
  with pytest.raises(ValueError, match="memory size '1e400' is too large"):
    parse_size("1e400")


def test_flags_reach_the_run_controls(capsys):
  parser = cli.sweep_parser("test")
  args = cli.parse_args(parser, ["--dataset", "wikinet", "--devices", "1", "--max-memory", "8G"])
  controls = cli.run_controls(args, nonfinite="error")
  assert controls.devices == 1 and controls.max_memory == 8 * 2**30
  assert cli.run_controls(cli.parse_args(parser, ["--dataset", "wikinet"]), "error").devices is None
  assert "memory size '8X'" in usage_error("grid", ["--dataset", "wikinet", "--max-memory", "8X"],
                                           capsys)
  with pytest.raises(ValueError, match="devices = 0; must be >= 1"):
    RunControls(devices=0)


def test_more_devices_than_there_are_is_a_usage_error(tmp_path, capsys):
  count = jax.device_count()
  message = f"devices = {count + 1}; this process sees {count} cpu device(s): choose 1 to {count}"
  with pytest.raises(ValueError, match=re.escape(message)):
    devices.device_mesh(count + 1)
  with pytest.raises(ValueError, match=re.escape(message)):
    RunControls(devices=count + 1)
  assert devices.device_mesh().size == count
  out = tmp_path / "run"
  assert message in usage_error("grid", ["--dataset", "wikinet", "--devices", str(count + 1),
                                         "--out", str(out)], capsys)
  assert not out.exists()  # refused before anything is written


def test_default_budget_is_a_share_of_the_host_ram_on_cpu():
  budget, source = devices.default_budget(devices.device_mesh(1))
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert budget == int(devices.DEFAULT_SHARE * ram) and source.startswith("80% of the host's")


def test_only_process_zero_writes(tmp_path, monkeypatch):
  path = tmp_path / "a.txt"
  path.write_text("kept")
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert not io.is_writer()
  io.atomic_write(tmp_path / "b.txt", lambda f: f.write("x"), binary=False)
  io.remove_file(path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  io.atomic_write(tmp_path / "b.txt", lambda f: f.write("x"), binary=False)
  io.remove_file(path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]


def test_collectives_are_found_by_name():
  text = ("%ag = f32[8] all-gather-start(f32[2] %p)\n%x = f32[4] add(%a, %b)\n"
          "%cp = f32[2] collective-permute(%y), source_target_pairs={{0,1}}")
  assert devices.collectives(text) == ["all-gather", "collective-permute"]
  assert devices.collectives("%r = f32[2] reduce(%a, %b), to_apply=%sum") == []


def test_a_budget_nothing_fits_names_the_least_need_and_the_run_resumes(tiny_wikinet, tmp_path):
  from fedjax_graph import config, experiment
  from fedjax_graph.controls import OverBudgetError
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, num_layers=2, local_steps=2)
  out = tmp_path / "run"
  controls = RunControls(out_dir=out, progress=False, chunk=2, max_memory=1024)
  with pytest.raises(OverBudgetError) as err:
    experiment.run_grid(cfg, "fedia", {"rho": [0.5], "beta": [0.5]}, [0, 1], 2, 2, controls,
                        domain_graphs=tiny_wikinet)
  message = str(err.value)
  assert re.search(r"the batch needs at least \S+ \S+ per device \(the least of the layouts "
                   r"tried: \d+ sub-batch\(es\) of \d+ runs\), over the budget of 1.00 KiB "
                   r"\(--max-memory\); raise --max-memory, or run fewer seeds or cells at once\. "
                   + re.escape(f"{out} keeps the run: continue it with --resume {out} "
                               "--max-memory SIZE") + "$", message), message
  assert "--devices" not in message  # one device is all there is
  record = json.loads((out / "config.json").read_text())
  assert record["status"] == "stopped: over the memory budget" and record["max_memory"] == 1024
  with pytest.raises(ValueError, match=re.escape(
      f"continue it with --resume {out} --max-memory SIZE (it stopped over its memory budget)")):
    experiment.run_grid(cfg, "fedia", {"rho": [0.5], "beta": [0.5]}, [0, 1], 2, 2, controls,
                        domain_graphs=tiny_wikinet)
  # Resumed without a budget: the run's own, still too small; with a new one, it finishes.
  with pytest.raises(OverBudgetError, match="over the budget of 1.00 KiB"):
    experiment.resume_grid(out, RunControls(progress=False), domain_graphs=tiny_wikinet)
  # A budget above the host's RAM is taken, with a warning that it adds no memory.
  with pytest.warns(UserWarning, match=r"--max-memory 16.00 TiB is above the host's \S+ \S+ RAM"):
    experiment.resume_grid(out, RunControls(progress=False, max_memory=2**44),
                           domain_graphs=tiny_wikinet)
  record = json.loads((out / "config.json").read_text())
  assert record["status"] == "finished" and record["max_memory"] == 2**44
  assert record["batch"]["memory_budget_bytes"] == 2**44 and record["batch"]["first_round"] == 0
  assert "earlier_batches" not in record  # the calls that found no layout recorded none
