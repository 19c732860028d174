"""Training propagation operators (issue 12 item 7): dense blocks and CSR products equal the edge list."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse

from fedjax_graph import cells as cells_lib
from fedjax_graph import config, data, devices, graphs, simulation
from conftest import dense_norm_adj, random_graph, vmapped_and_looped

# A 3-node path 0 - 1 - 2 plus an isolated node 3; degrees (with self-loop) 2, 3, 2, 1.
PATH_EDGES = np.array([[0, 1, 1, 2], [1, 0, 2, 1]])
S6 = 1 / np.sqrt(6)
PATH_DENSE = np.array([[1 / 2, S6, 0, 0], [S6, 1 / 3, S6, 0], [0, S6, 1 / 2, 0], [0, 0, 0, 1]])
KINDS = ("sparse", "csr", "dense")


def _shard(edge_index, n, n_node, n_edge, seed=0, features=3):
  rng = np.random.default_rng(seed)
  masks = {k: np.ones(n, bool) for k in ("train", "val", "test")}
  return graphs.pad_graph(rng.standard_normal((n, features)).astype(np.float32),
                          np.zeros(n, np.int64), edge_index, masks, np.zeros(n, np.int64), 1,
                          n_node, n_edge)


def _with(shard, kind):
  return shard._replace(operator=graphs.make_operator(shard, kind, np))


def _csr_dense(op, n):
  out = np.zeros((n, n), np.float32)
  for row in range(n):
    for k in range(op.indptr[row], op.indptr[row + 1]):
      out[row, op.indices[k]] += op.data[k]
  return out


def test_hand_computed_path_graph_operators_and_propagation():
  shard = _shard(PATH_EDGES, 4, n_node=8, n_edge=6)
  expected = np.zeros((8, 8))
  expected[:4, :4] = PATH_DENSE
  dense = graphs.make_operator(shard, "dense", np).matrix
  np.testing.assert_allclose(dense, expected, rtol=1e-6)
  csr = graphs.make_operator(shard, "csr", np)
  assert csr.data.shape == (6 + 8,) and csr.indptr.shape == (9,)  # E + N entries, N + 1 pointers
  np.testing.assert_allclose(_csr_dense(csr, 8), expected, rtol=1e-6, atol=0)
  assert graphs.make_operator(shard, "sparse", np) is None
  h = np.arange(16, dtype=np.float32).reshape(8, 2)
  for kind in KINDS:
    out = graphs.propagate(jnp.asarray(h), _with(shard, kind))
    np.testing.assert_allclose(out, expected @ h, rtol=1e-6, atol=1e-6, err_msg=kind)
    assert np.all(np.asarray(out)[4:] == 0)  # padding rows stay 0


def test_host_and_device_operators_are_the_same_arrays():
  shard = _shard(random_graph(20, 30, seed=2), 20, n_node=24, n_edge=70)
  for kind in ("csr", "dense"):
    host = graphs.make_operator(shard, kind, np)
    device = jax.jit(lambda s, kind=kind: graphs.make_operator(s, kind))(shard)
    jax.tree.map(np.testing.assert_array_equal, host, device)


def _bucket(kind, num_clients=3, n_node=32, n_edge=80):
  """A stacked bucket of different random graphs (sizes 20, 24, 28) with ``kind``'s operator."""
  shards = [_shard(random_graph(n, 25 + 5 * c, seed=c), n, n_node, n_edge, seed=c, features=4)
            for c, n in enumerate(range(20, 20 + 4 * num_clients, 4))]
  return graphs.with_operator(graphs.stack(shards), kind)


def test_a_batched_bucket_propagates_and_differentiates_alike_in_every_form():
  """vmap over clients (graphs batched), inside a vmap over models (graph shared): dense == csr == sparse."""
  weights = jnp.asarray(np.random.default_rng(5).standard_normal((2, 4, 6)), jnp.float32)

  def loss(w, shard):  # one model on one client: propagate(x W) twice, a nonlinear read-out
    h = graphs.propagate(jnp.tanh(graphs.propagate(shard.x @ w, shard)), shard)
    return jnp.sum(jnp.sin(h) * jnp.arange(h.shape[-1]))

  def run(kind):
    bucket = _bucket(kind)
    per_client = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))
    return jax.jit(jax.vmap(per_client, in_axes=(0, None)))(weights, bucket)  # [models, clients]

  (ref_value, ref_grad), *others = [run(kind) for kind in KINDS]
  assert ref_value.shape == (2, 3) and np.abs(ref_grad).max() > 0
  for kind, (value, grad) in zip(KINDS[1:], others):
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5, err_msg=kind)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-5, err_msg=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_slots_pad_their_operator_and_real_rows_do_not_change(kind):
  bucket = _bucket(kind)
  grown = simulation._pad_shard(bucket, 48, 120, 1)
  rebuilt = graphs.with_operator(jax.tree.map(np.asarray, grown), kind).operator
  assert graphs.kind_of(grown.operator) == kind
  # The padded operator is the padded graph's matrix (as built from its edges), shape for shape.
  if kind == "dense":
    np.testing.assert_array_equal(grown.operator.matrix, rebuilt.matrix)
  elif kind == "csr":
    assert jax.tree.map(np.shape, grown.operator) == jax.tree.map(np.shape, rebuilt)
    for j in range(3):
      as_dense = lambda op: scipy.sparse.csr_matrix(
          (op.data[j], op.indices[j], op.indptr[j]), shape=(48, 48)).toarray()
      np.testing.assert_array_equal(as_dense(jax.tree.map(np.asarray, grown.operator)),
                                    as_dense(rebuilt))
  h = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32, 5)), jnp.float32)
  ref = jax.vmap(graphs.propagate)(h, bucket._replace(operator=None))
  out = jax.vmap(graphs.propagate)(jnp.pad(h, [(0, 0), (0, 16), (0, 0)]), grown)
  np.testing.assert_allclose(out[:, :32], ref, rtol=1e-5, atol=1e-6, err_msg=kind)
  assert np.all(np.asarray(out[:, 32:]) == 0)


def test_auto_rule_is_the_documented_one():
  # dense iff N^2 <= DENSE_RATIO (E + N) and the bucket's blocks fit DENSE_MAX_BYTES.
  ratio = graphs.DENSE_RATIO
  assert graphs.operator_kind("auto", 8, 8 * 8 // ratio - 8, 1) == "dense"  # exactly at the bound
  assert graphs.operator_kind("auto", 8, 8 * 8 // ratio - 8 - 1, 1) == "csr"
  # Twitch S3's and WikiNet's real buckets: N^2 / (E + N) = 68..391, all csr.
  for n, e, c in [(480, 1256, 20), (3568, 57968, 4), (2608, 101448, 2), (5824, 86896, 2)]:
    assert graphs.operator_kind("auto", n, e, c) == "csr"
  # A small dense enough graph, but too many of them to hold as blocks.
  n = 1024
  fits = graphs.DENSE_MAX_BYTES // (4 * n * n)
  assert graphs.operator_kind("auto", n, n * n, fits) == "dense"
  assert graphs.operator_kind("auto", n, n * n, fits + 1) == "csr"
  for mode in ("dense", "csr", "sparse"):
    assert graphs.operator_kind(mode, 5824, 86896, 2) == mode


def test_a_bad_propagation_value_errors_and_the_value_is_recorded():
  with pytest.raises(ValueError, match=r"propagation = 'fast'; must be one of "
                     r"\['auto', 'dense', 'csr', 'sparse'\]"):
    config.load_preset("wikinet", propagation="fast")
  with pytest.raises(ValueError, match="propagation = 'gather'"):
    graphs.operator_kind("gather", 8, 8, 1)
  assert config.load_preset("wikinet").to_dict()["propagation"] == "auto"
  assert config.load_preset("wikinet", propagation="csr").to_dict()["propagation"] == "csr"


def test_a_grid_records_the_propagation_each_bucket_took(tiny_wikinet, tmp_path):
  import json
  from fedjax_graph import experiment
  from fedjax_graph.controls import RunControls
  cfg = config.load_preset("wikinet", backbone="gcn", hidden=8, num_layers=2, local_steps=1,
                           max_buckets=2)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  experiment.run_grid(cfg, "fedia", {"rho": [0.5], "beta": [0.5]}, [0], 1, 1,
                      RunControls(out_dir=tmp_path, progress=False), domain_graphs=tiny_wikinet)
  recorded = json.loads((tmp_path / "config.json").read_text())["bucket_propagation"]
  assert recorded == [graphs.kind_of(s.operator) for s in federation.client_shards]
  assert cfg.propagation == "auto" and set(recorded) <= {"dense", "csr"}


def _federation(tiny_wikinet, kind, **overrides):
  # Small to compile (the compiles are this file's cost).
  overrides = {"max_buckets": 2, "backbone": "gcn", **overrides}
  cfg = config.load_preset("wikinet", hidden=8, num_layers=2, local_steps=2, propagation=kind,
                           **overrides)
  return cfg, data.build_federation(cfg, tiny_wikinet, seeds=[0, 1])


def test_federation_buckets_carry_the_operator_and_the_estimate_counts_it(tiny_wikinet):
  sizes = {}
  for kind in KINDS:
    cfg, federation = _federation(tiny_wikinet, kind)
    for shard in federation.client_shards:
      assert graphs.kind_of(shard.operator) == kind
      if kind == "dense":
        n = shard.x.shape[-2]
        assert shard.operator.matrix.shape == shard.x.shape[:2] + (n, n)
        np.testing.assert_allclose(shard.operator.matrix[0, 0],
                                   graphs.make_operator(jax.tree.map(lambda a: a[0, 0], shard),
                                                        "dense", np).matrix)
    sim = simulation.make_simulation(cfg, federation)
    batch = cells_lib.grid("fedia", rho=[0.5], beta=[0.5]).batch()
    sizes[kind] = devices.estimate(sim, federation, batch, 2)
  extra = sum(4 * np.prod(s.x.shape[:2]) * s.x.shape[-2] ** 2 for s in
              _federation(tiny_wikinet, "dense")[1].client_shards)
  assert sizes["dense"].data - sizes["sparse"].data == extra
  assert sizes["csr"].data > sizes["sparse"].data
  # No per-edge messages with an operator: less activation memory than the edge list.
  assert sizes["csr"].per_run[0] < sizes["sparse"].per_run[0]
  # Backbones that train without the operator do not carry one (any propagation setting).
  for backbone in ("pmlp_gcn", "mlp", "sfpd"):
    norm = {"norm": "none"} if backbone == "sfpd" else {}
    _, federation = _federation(tiny_wikinet, "dense", backbone=backbone, **norm)
    assert all(shard.operator is None for shard in federation.client_shards), backbone


# One FedIA cell: an aggregator group fewer to compile than FedIA + FedAvg.
ONE_CELL = cells_lib.Cells([cells_lib.cell("fedia", rho=0.5, beta=0.5)])


def _run(cfg, federation, rounds=2, cells=None):
  sim = simulation.make_simulation(cfg, federation)
  batch = jax.device_put((cells or cells_lib.grid("fedia", rho=[0.5], beta=[0.5])).batch())
  state = sim.init(np.asarray(federation.seeds, np.int32), batch)
  state, metrics = sim.run_chunk(state, np.int32(0), batch, simulation.sim_data(federation),
                                 num_rounds=rounds)
  return state, metrics


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_gcn_rounds_are_the_same_with_every_operator(tiny_wikinet, participation):
  runs = {kind: _run(*_federation(tiny_wikinet, kind, participation=participation),
                     cells=ONE_CELL) for kind in KINDS}
  (ref_state, ref), *others = runs.values()
  for kind, (state, metrics) in zip(KINDS[1:], others):
    np.testing.assert_allclose(metrics.train_loss, ref.train_loss, rtol=1e-4, err_msg=kind)
    np.testing.assert_allclose(metrics.test_acc, ref.test_acc, atol=1e-6, err_msg=kind)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
                 state[0].params, ref_state[0].params)


def test_vmapped_clients_equal_python_loop_with_an_operator(tiny_wikinet):
  cfg, federation = _federation(tiny_wikinet, "csr", max_buckets=1)  # one loop compile
  sim = simulation.make_simulation(cfg, federation)
  params = sim.model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8)), None, train=False)
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  vmapped, looped = vmapped_and_looped(sim, federation, params, params, shards, keys)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               vmapped, looped)


def test_real_wikinet_gcn_rounds_equal_between_csr_and_sparse(raw_dir, prepared_cache):
  graphs_, _ = data.load_dataset("wikinet", raw_dir=raw_dir, cache_dir=prepared_cache)
  results = {}
  for kind in ("csr", "sparse"):
    cfg = config.load_preset("wikinet", backbone="gcn", hidden=32, num_layers=2, local_steps=2,
                             propagation=kind)
    federation = data.build_federation(cfg, graphs_, seeds=[0])
    assert {graphs.kind_of(s.operator) for s in federation.client_shards} == {kind}
    results[kind] = _run(cfg, federation, rounds=2, cells=ONE_CELL)[1]
  csr, sparse = results["csr"], results["sparse"]
  assert np.all(np.isfinite(csr.train_loss)) and np.all(np.isfinite(csr.test_acc))
  assert np.all(csr.predicted_classes[..., -1, :] > 1)
  np.testing.assert_allclose(csr.train_loss, sparse.train_loss, rtol=1e-4)
  np.testing.assert_allclose(csr.test_acc, sparse.test_acc, atol=2e-3)
