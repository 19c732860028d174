"""Mixed precision (Config.precision), bench.py's breakdown and scaling helpers, bench_gpu.sh."""

import importlib.util
import os
import subprocess
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from fedjax_graph import cells as cells_lib
from fedjax_graph import config, data, models, simulation
from fedjax_graph.graphs import propagate


def _bench():
  """experiments/bench.py as a module (scripts are not a package)."""
  spec = importlib.util.spec_from_file_location("bench", REPO / "experiments" / "bench.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _quick_jit(fn):
  """``jax.jit(fn)`` compiled at XLA's backend optimisation level 0 on its first call's shapes."""
  compiled = []

  def call(*args):
    if not compiled:
      compiled.append(jax.jit(fn).lower(*args).compile(
          compiler_options={"xla_backend_optimization_level": 0}))
    return compiled[0](*args)

  return call


def _config(**overrides):
  # Small to compile: on tiny_wikinet 2 buckets, 6 clients.
  return config.load_preset("wikinet", hidden=8, num_layers=2, local_steps=2, max_buckets=2,
                            **overrides)


# ---- the Config field


def test_precision_defaults_to_f32_is_recorded_and_validated():
  cfg = _config()
  assert cfg.precision == "f32" and cfg.to_dict()["precision"] == "f32"
  assert config.parse_override("precision=bf16") == ("precision", "bf16")
  assert _config(precision="bf16").model(5).precision == "bf16"
  with pytest.raises(ValueError, match=r"precision = 'fp16'; must be one of \['f32', 'bf16'\]"):
    _config(precision="fp16")
  with pytest.raises(ValueError, match="precision = 16; must be a string"):
    _config(precision=16)
  with pytest.raises(ValueError, match="Unsupported precision: 'f16'"):
    models.make_model("mlp", 3, precision="f16")
  with pytest.raises(ValueError, match="Unsupported precision for sfpd"):
    models.make_model("sfpd", 3, norm="none", precision="bf16")
  with pytest.raises(ValueError, match="Unsupported precision: 'f64'"):
    models.dense(jnp.ones((2, 2)), jnp.ones((2, 2)), "f64")


# ---- the dense product


def test_bf16_dense_rounds_the_inputs_and_accumulates_in_f32():
  # 1 + 2^-10 is not a bfloat16 (8 bits of mantissa): it rounds to 1. The sum of 257
  # products of 1 is exact in f32; 257 is not a bfloat16 (9 bits), so a bfloat16
  # accumulator or output would give 256 or 258.
  h = jnp.full((2, 257), 1 + 2**-10, jnp.float32)
  k = jnp.ones((257, 3), jnp.float32)
  out = models.dense(h, k, "bf16")
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, np.full((2, 3), 257.0))
  np.testing.assert_allclose(models.dense(h, k, "f32"), 257 * (1 + 2**-10), rtol=1e-6)
  # Gradients are f32 arrays (of bfloat16-rounded values): the parameters stay f32.
  grads = jax.grad(lambda h, k: models.dense(h, k, "bf16").sum(), argnums=(0, 1))(h, k)
  assert all(g.dtype == jnp.float32 for g in grads)
  # d/dk = h^T 1: the 2 rows of h, each 1 in bfloat16; d/dh = k 1 = 3.
  np.testing.assert_array_equal(grads[1], np.full((257, 3), 2.0))
  np.testing.assert_array_equal(grads[0], np.full((2, 257), 3.0))


class _OldGraphLinear(nn.Module):
  """GraphLinear as it was before ``precision`` (the f32 reference)."""
  features: int

  @nn.compact
  def __call__(self, h, graph):
    kernel = self.param("kernel", nn.initializers.xavier_uniform(), (h.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
    if graph is None:
      return h @ kernel + bias
    if h.shape[-1] <= self.features:
      return propagate(h, graph) @ kernel + bias
    return propagate(h @ kernel, graph) + bias


def test_f32_layer_is_the_old_layer_bit_for_bit(tiny_wikinet):
  federation = data.build_federation(_config(backbone="gcn"), tiny_wikinet, seeds=[0])
  shard = jax.tree.map(lambda leaf: leaf[0, 0], federation.client_shards[0])
  for graph in (None, shard):
    for width in (4, 16):  # propagate after the product, and before it
      new, old = models.GraphLinear(width), _OldGraphLinear(width)
      params = new.init(jax.random.PRNGKey(0), shard.x, graph)
      f = lambda module, p: jax.jit(lambda p: module.apply(p, shard.x, graph))(p)
      np.testing.assert_array_equal(f(new, params), f(old, params))
      g = lambda module: jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, shard.x, graph)**2)))
      jax.tree.map(np.testing.assert_array_equal, g(new)(params), g(old)(params))


# ---- the whole simulation


ROUNDS = 4
FEDIA = cells_lib.grid("fedia", rho=[0.5], beta=[0.5])  # FedAvg and FedIA(0.5, 0.5)


@pytest.fixture(scope="module")
def runs(tiny_wikinet):
  """Per precision: (sim, federation, state, metrics) after ROUNDS rounds of FEDIA, seed 0.

  Compiled at XLA's backend optimisation level 0 (as tests/test_rounds.py): the
  numbers are XLA's either way, the compile is several times faster.
  """
  out = {}
  for precision in ("f32", "bf16"):
    cfg = _config(precision=precision)
    federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
    sim = simulation.make_simulation(cfg, federation)
    batch, sim_data = FEDIA.batch(), simulation.sim_data(federation)
    state = sim.init(np.asarray(federation.seeds, np.int32), batch)
    compiled = sim.run_chunk.lower(state, np.int32(0), batch, sim_data, num_rounds=ROUNDS).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    out[precision] = (sim, federation, *compiled(state, np.int32(0), batch, sim_data))
  return out


def _program_text(sim, federation) -> str:
  batch = FEDIA.batch()
  state = sim.init(np.asarray(federation.seeds, np.int32), batch)
  return str(jax.make_jaxpr(lambda s, d: sim.run_chunk(s, np.int32(0), batch, d, num_rounds=1))(
      state, simulation.sim_data(federation)))


def test_f32_program_has_no_bf16_and_bf16_casts_only_the_products(runs):
  assert "bf16" not in _program_text(*runs["f32"][:2])
  text = _program_text(*runs["bf16"][:2])
  assert "bf16" in text and "preferred_element_type=float32" in text


def test_bf16_runs_close_to_f32_with_f32_parameters_and_updates(runs):
  f32, bf16 = runs["f32"][3], runs["bf16"][3]
  for name in ("test_acc", "val_acc", "train_loss", "alpha"):
    assert np.isfinite(getattr(bf16, name)).all(), name
  # Bfloat16 keeps 8 bits of mantissa: the losses stay within a few per cent.
  np.testing.assert_allclose(bf16.train_loss, f32.train_loss, rtol=0.05, atol=0.02)
  assert np.max(np.abs(bf16.test_acc - f32.test_acc)) <= 0.15
  sim, federation, state, _ = runs["bf16"]
  for group in state:
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(group.params))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(group.aggregator)
               if jnp.issubdtype(leaf.dtype, jnp.floating))
  params = jax.tree.map(lambda leaf: leaf[0, 0], state[0].params)
  shard = jax.tree.map(lambda leaf: leaf[0, 0], federation.client_shards[0])
  inputs = sim.training_input(shard, federation.bucket_train_rows[0])
  update = jax.jit(sim.local_update)(params, params, *inputs, jax.random.PRNGKey(0)).update
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(update))
  assert any(float(jnp.max(jnp.abs(leaf))) > 0 for leaf in jax.tree.leaves(update))


# ---- bench.py


def test_breakdown_shares_sum_to_one_and_flops_count(runs):
  bench = _bench()
  sim, federation = runs["f32"][:2]
  # FedAvg alone: the smallest program (the scaling test's runs=1 point reuses its compile).
  batch = jax.device_put(cells_lib.Cells([cells_lib.cell("fedavg")]).batch())
  parts = bench.breakdown(sim, federation, batch, simulation.sim_data(federation),
                          federation.seeds, repeats=1, jit=_quick_jit)
  assert set(parts.shares) == {"local training", "aggregation", "evaluation"}
  assert abs(sum(parts.shares.values()) - 1) < 1e-9
  assert all(s > 0 for s in parts.shares.values()) and parts.round > 0
  # By hand: F=128 -> H=8 -> K=5 (num_layers 2) over each client's training rows, 2 steps.
  cfg = _config()
  F, H, K = federation.eval_x.shape[-1], 8, federation.num_classes
  per_row = 3 * 2 * (F * H + H * K) - 2 * F * H
  rows = sum(len(c) * r for c, r in zip(federation.bucket_clients, federation.bucket_train_rows))
  assert bench.training_flops(cfg, federation, 4) == per_row * rows * 2 * 4
  assert bench.matmul_peak(size=128, repeats=1) > 0


def test_kernel_ratios_print_both_families(runs, capsys):
  _bench().kernel_ratios(runs["f32"][1], width=4, models_side_by_side=2, repeats=1)
  printed = capsys.readouterr().out
  for name in ("all rows gathered", "graphs.edge_dot", "gather + segment-sum",
               "graphs.csr_product"):
    assert name in printed
  assert printed.count("ratio: ") == 2


def test_scaling_rows_and_plot(runs, tiny_wikinet, tmp_path):
  bench = _bench()
  rows = bench.scaling_table(_config(), tiny_wikinet, domain="crocodile", clients=(3,),
                             runs=(1,), devices=(), rounds=1)
  assert [(r.axis, r.value, r.clients, r.runs, r.devices) for r in rows] == [
      ("clients", 3, 7, 2, 1), ("runs", 1, 6, 1, 1)]
  assert all(r.round_s > 0 and np.isfinite(r.compile_s) for r in rows)
  assert bench.runs_layout(78) == (26, 3) and bench.runs_layout(4) == (2, 2)
  with pytest.raises(ValueError, match="a batch of 3 runs"):
    bench.runs_layout(3)
  rows.append(bench.ScalingRow("devices", 2, 6, 4, 2, 1.0, 0.5, 0.0))
  bench.plot_scaling(rows, tmp_path / "scaling.png", "tiny")
  assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_bench_gpu_smoke_on_cpu(raw_dir, prepared_cache):
  # The accelerator script's smoke mode: one FedIA cell + FedAvg, 1 seed, 2 rounds, on WikiNet
  # (its default, Twitch S3, is the same code path at 2.5x the compile).
  env = {**os.environ, "DATASET": "wikinet", "SETTING": "default", "ROUNDS": "2", "SEEDS": "0",
         "GRID": "0.5", "LOOP_ROUNDS": "1",
         "FEDJAX_GRAPH_RAW": str(raw_dir), "FEDJAX_GRAPH_CACHE": str(prepared_cache)}
  small = ["--set", "hidden=16", "--set", "num_layers=2", "--set", "local_steps=2"]  # fast compiles
  done = subprocess.run(["bash", str(REPO / "experiments" / "bench_gpu.sh"), *small], env=env,
                        cwd=REPO, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  text = done.stdout
  for needle in ("wall time", "compile", "round-cells/s", "peak memory", "speed-up",
                 "results match: True", "all finite: True"):
    assert needle in text, (needle, text[-3000:])
