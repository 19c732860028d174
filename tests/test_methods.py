"""Base methods (FedProx, MOON, FedDyn, FedOpt, SCAFFOLD), alone and "+FedIA", on tiny graphs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import cells as cells_lib
from fedjax_graph import client, config, data, methods, models, simulation, sweep

ROUNDS = 2


@pytest.fixture(scope="module")
def tiny(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  return cfg, data.build_federation(cfg, tiny_wikinet, seeds=[0])


BASE = cells_lib.Cells([cells_lib.cell("fedavg")])


def _run(cfg, federation, method, hparams=None, cells=BASE, rounds=ROUNDS):
  """Final SimState of the first aggregator group and the metrics of a few rounds."""
  sim = simulation.make_simulation(cfg, federation, method=method, method_hparams=hparams)
  batch = jax.device_put(cells.batch())
  state = sim.init(np.array(federation.seeds, np.int32), batch)
  state, metrics = sim.run_chunk(state, np.int32(0), batch, simulation.sim_data(federation),
                                 num_rounds=rounds)
  return state[0], jax.tree.map(lambda m: m[:, np.argsort(cells.order())], metrics)


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _fixed_server_inputs(sim, num_clients, seed=0, aggregator="fedavg"):
  """A state after init and random client updates, for server-side checks."""
  params = sim.model.clone(propagate_train=False, propagate_eval=False).init(
      jax.random.PRNGKey(seed), jnp.zeros((1, 8)), None, train=False)
  updates = jax.tree.map(
      lambda p: jax.random.normal(jax.random.PRNGKey(seed + 1), (num_clients,) + p.shape), params)
  state = simulation.SimState(params,
                              simulation.aggregators.get(aggregator).init(num_clients, params),
                              sim.method.init(params, num_clients), jax.random.PRNGKey(2),
                              jax.random.PRNGKey(3))
  return state, updates


def _outputs(sim, state, updates, cfg):
  """What the clients would send: these updates, and each client's new state from them."""
  num_clients = jax.tree.leaves(updates)[0].shape[0]

  # A two-node client (features as _fixed_server_inputs' model): enough for
  # methods whose upload is computed from the local model (prototypes).
  x, y = jnp.ones((2, 8)), jnp.array([0, 1])
  train, groups = jnp.ones(2, bool), jnp.zeros(2, jnp.int32)

  def final(client_state, update):
    ctx = methods.ClientContext(None, state.params, x, y, train, groups, 1, None,
                                client_state, state.method.server)
    return sim.method.client_final(ctx, jax.tree.map(lambda w, u: w - cfg.lr * u, state.params,
                                                     update), update)

  client_state, upload = jax.vmap(final)(state.method.clients, updates)
  return client.ClientOutput(updates, jnp.zeros((num_clients, cfg.local_steps)), client_state,
                             upload)


def test_fedprox_mu0_equals_fedavg_bit_for_bit(tiny):
  cfg, federation = tiny
  avg_state, avg_metrics = _run(cfg, federation, "fedavg")
  prox_state, prox_metrics = _run(cfg, federation, "fedprox", {"mu": 0.0})
  _assert_trees_equal(avg_state.params, prox_state.params)
  _assert_trees_equal(avg_metrics.test_acc, prox_metrics.test_acc)
  # And mu > 0 changes the trajectory.
  other, _ = _run(cfg, federation, "fedprox", {"mu": 1.0})
  assert not np.array_equal(other.params["params"]["layer_0"]["kernel"],
                            avg_state.params["params"]["layer_0"]["kernel"])


def test_moon_loss_is_ln2_when_all_representations_agree_and_finite_at_zero():
  z = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
  np.testing.assert_allclose(methods.moon_loss(z, z, z, 0.5), math.log(2), rtol=1e-6)
  zeros = jnp.zeros((3, 4))
  loss, grad = jax.value_and_grad(lambda a: methods.moon_loss(a, zeros, zeros, 0.5).sum())(zeros)
  np.testing.assert_allclose(loss, 3 * math.log(2), rtol=1e-6)
  assert np.all(np.isfinite(grad))
  # Closer to the global than to the previous representation: below ln 2.
  assert float(methods.moon_loss(z, z, -z, 0.5).max()) < math.log(2)


def test_moon_local_loss_masks_padding(tiny):
  cfg, _ = tiny
  model = models.make_model("pmlp_gcn", 5, 8)
  moon = methods.make_method("moon", model, cfg, {"mu": 2.0})
  z = jax.random.normal(jax.random.PRNGKey(0), (6, 8))
  far = z.at[4:].set(-z[4:])  # padding rows disagree, but are masked out
  mask = jnp.array([True, True, True, True, False, False])
  ctx = methods.ClientContext(None, None, None, None, mask, None, 1, None, None, None, (z, far))
  loss = moon.local_loss(None, methods.StepOutput(z, None), ctx)
  np.testing.assert_allclose(loss, 2.0 * math.log(2), rtol=1e-6)


def test_moon_keeps_the_local_model_as_per_client_state(tiny):
  cfg, federation = tiny
  state, metrics = _run(cfg, federation, "moon", rounds=1)
  previous = state.method.clients["params"]["layer_0"]["kernel"][0, 0]  # [C, F, H] of seed 0, cell 0
  global_kernel = state.params["params"]["layer_0"]["kernel"][0, 0]
  # Every client's state is its own local model: all different, none the global model.
  assert len({np.asarray(previous[k]).tobytes() for k in range(previous.shape[0])}) == previous.shape[0]
  assert not np.allclose(previous[0], global_kernel)
  assert np.all(np.isfinite(metrics.test_acc))


def test_feddyn_updates_only_participants_and_uses_total_client_count(tiny):
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method="feddyn")
  num_clients = federation.num_clients
  state, updates = _fixed_server_inputs(sim, num_clients)
  sampled = jnp.arange(num_clients) < 2  # 2 of C clients take part
  new, (_, weights, _, _) = sim.aggregate(state, "fedavg", {}, _outputs(sim, state, updates, cfg),
                                         jnp.ones(num_clients), sampled)
  alpha, lr = sim.method.hparams["alpha"], cfg.lr
  kernel = lambda tree: tree["params"]["layer_0"]["kernel"]
  grads = kernel(new.method.clients)
  np.testing.assert_allclose(grads[:2], alpha * lr * kernel(updates)[:2], rtol=1e-6)
  np.testing.assert_array_equal(grads[2:], 0.0)  # non-participants untouched
  mean = kernel(updates)[:2].mean(0)
  h = alpha * lr * (2 / num_clients) * mean  # m = all C clients, not the 2 participants
  np.testing.assert_allclose(kernel(new.method.server), h, rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(kernel(new.params), kernel(state.params) - lr * mean - h / alpha,
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights, [0.5, 0.5] + [0.0] * (num_clients - 2))


@pytest.mark.parametrize("server_opt", methods.SERVER_OPTIMIZERS)
def test_fedopt_zero_update_leaves_the_model_unchanged(tiny, server_opt):
  cfg, _ = tiny
  model = models.make_model("pmlp_gcn", 5, 8)
  fedopt = methods.make_method("fedopt", model, cfg, {"server_opt": server_opt})
  params = {"w": jnp.arange(6.0).reshape(2, 3)}
  opt_state = fedopt.init(params, 3).server
  everyone = jnp.ones(3, bool)
  for _ in range(3):
    new, opt_state = fedopt.server_step(params, opt_state, {"w": jnp.zeros((2, 3))}, (),
                                        everyone, 3)
    _assert_trees_equal(new, params)
  # A non-zero update does move it.
  moved, _ = fedopt.server_step(params, opt_state, {"w": jnp.ones((2, 3))}, (), everyone, 3)
  assert np.all(np.asarray(moved["w"]) < np.asarray(params["w"]))


def test_scaffold_with_zero_control_variates_equals_fedavg_on_the_first_round(tiny):
  cfg, federation = tiny
  avg, _ = _run(cfg, federation, "fedavg", {"weights": "uniform"}, rounds=1)
  scaffold, _ = _run(cfg, federation, "scaffold", rounds=1)
  _assert_trees_equal(avg.params, scaffold.params)
  # Its control variates then move: c = (|S|/N)(u/K - 0) = mean update / K.
  c = scaffold.method.server["params"]["layer_0"]["kernel"]
  assert np.abs(c).max() > 0
  two, _ = _run(cfg, federation, "scaffold", rounds=2)
  avg_two, _ = _run(cfg, federation, "fedavg", {"weights": "uniform"}, rounds=2)
  assert not np.array_equal(two.params["params"]["layer_0"]["kernel"],
                            avg_two.params["params"]["layer_0"]["kernel"])


# FedSPA's upload needs the client's graph, which these synthetic outputs have
# not (tests/test_methods_fedspa.py checks the same equality on real rounds); nor
# has FGGP's client part (its prototypes): test_methods_fggp.py checks it.
@pytest.mark.parametrize("method", [m for m in methods.METHODS if m not in ("fedspa", "fggp")])
def test_plus_fedia_at_rho1_beta1_equals_the_base_method_with_uniform_weights(tiny, method):
  cfg, federation = tiny
  sim = simulation.make_simulation(cfg, federation, method=method,
                                   method_hparams={"weights": "uniform"})
  num_clients = federation.num_clients
  counts = jnp.arange(1.0, num_clients + 1)  # uniform weights must ignore these
  new = {}
  for aggregator, hparams in (("fedavg", {}), ("fedia", {"rho": 1.0, "beta": 1.0})):
    state, updates = _fixed_server_inputs(sim, num_clients, seed=4, aggregator=aggregator)
    step = jax.jit(lambda s, o, a=aggregator, h=hparams: sim.aggregate(s, a, h, o, counts))
    new[aggregator], _ = step(state, _outputs(sim, state, updates, cfg))
  base, plus = new["fedavg"], new["fedia"]
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  jax.tree.map(close, base.params, plus.params)
  jax.tree.map(close, base.method, plus.method)
  mean = jax.tree.map(lambda u: u.mean(0), updates)
  if method in ("fedavg", "fedprox", "moon", "scaffold"):
    jax.tree.map(close, base.params, jax.tree.map(lambda w, u: w - cfg.lr * u, state.params, mean))


def test_partial_participation_samples_the_same_clients_in_every_cell(tiny, tiny_wikinet):
  cfg, _ = tiny
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, participation=0.5)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  cells = cells_lib.grid("fedia", rho=[0.5], beta=[0.5])
  _, metrics = _run(cfg, federation, "fedavg", cells=cells, rounds=4)
  taking_part = metrics.alpha[0] > 0  # [G', T, C]
  count = max(1, round(0.5 * federation.num_clients))
  np.testing.assert_array_equal(taking_part.sum(-1), count)
  np.testing.assert_array_equal(taking_part[0], taking_part[1])  # FedIA and FedAvg cells
  assert len({row.tobytes() for row in taking_part[0]}) > 1  # rounds differ


def test_partial_participation_leaves_non_participants_state(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1, participation=0.34)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  state, metrics = _run(cfg, federation, "scaffold", rounds=1)
  took_part = metrics.alpha[0, 0, 0] > 0  # [C]
  c_k = np.asarray(state.method.clients["params"]["layer_1"]["bias"][0, 0])  # [C, H]
  assert took_part.sum() == max(1, round(0.34 * federation.num_clients)) < federation.num_clients
  assert np.all(np.abs(c_k[took_part]).max(axis=-1) > 0)
  np.testing.assert_array_equal(c_k[~took_part], 0.0)


@pytest.fixture(scope="module")
def shuffled_buckets():
  """Domains of sizes 90/40/60 in 3 buckets: bucket order is not client order."""
  from conftest import fake_domain
  sizes = {"chameleon": 90, "squirrel": 40, "crocodile": 60}
  graphs = {d: fake_domain(n, 2 * n, 5, 8, i) for i, (d, n) in enumerate(sizes.items())}
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=3)
  federation = data.build_federation(cfg, graphs, seeds=[0])
  order = np.concatenate(federation.bucket_clients)
  assert len(federation.bucket_clients) > 1 and not np.all(np.diff(order) > 0)
  return cfg, federation


@pytest.mark.parametrize("method", ["moon", "scaffold", "feddyn"])
def test_vmapped_clients_with_method_state_equal_python_loop(shuffled_buckets, method):
  cfg, federation = shuffled_buckets
  sim = simulation.make_simulation(cfg, federation, method=method)
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  state, fake = _fixed_server_inputs(sim, federation.num_clients)
  # Non-trivial per-client state: a random pytree shaped like the method's.
  clients = jax.tree.map(lambda leaf: 0.1 * jax.random.normal(jax.random.PRNGKey(7), leaf.shape),
                         state.method.clients)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  run = lambda update, client_state, backend: simulation.for_each_client(
      update, federation, sim.training_input, state.params, state.params, shards, keys,
      client_state, state.method.server, backend=backend)
  vmapped = jax.jit(lambda c: run(sim.local_update, c, "vmap"))(clients)
  looped = run(jax.jit(sim.local_update), clients, "loop")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               vmapped, looped)
  plain = run(sim.local_update, state.method.clients, "vmap")
  assert not np.allclose(plain.update["params"]["layer_0"]["kernel"],
                         vmapped.update["params"]["layer_0"]["kernel"])  # the state matters


def test_effective_steps_of_momentum_sgd():
  assert methods.effective_steps(5, 0.0) == 5
  # 1 + 1.9 + 2.71 + 3.439 + 4.0951 gradient steps' worth of movement.
  assert methods.effective_steps(5, 0.9) == pytest.approx(13.1441)


def test_scaffold_stays_bounded_over_many_rounds(tiny):
  cfg, federation = tiny
  size = lambda tree: max(float(np.abs(leaf).max()) for leaf in jax.tree.leaves(tree))
  avg, _ = _run(cfg, federation, "fedavg", rounds=40)
  state, metrics = _run(cfg, federation, "scaffold", rounds=40)
  assert np.all(np.isfinite(metrics.train_loss))
  # Control variates estimated with K instead of K_eff grew ~1e8-fold here.
  assert size(state.params) < 3 * size(avg.params)
  assert size(state.method.server) < 10


def test_a_round_nobody_takes_part_in_changes_nothing(tiny):
  cfg, federation = tiny
  for method in ("feddyn", "fedopt"):
    sim = simulation.make_simulation(cfg, federation, method=method)
    num_clients = federation.num_clients
    state, updates = _fixed_server_inputs(sim, num_clients)
    state = state._replace(method=state.method._replace(
        server=jax.tree.map(lambda leaf: leaf + 0.5, state.method.server)))  # non-zero h, moments
    updates = jax.tree.map(lambda u: u.at[0].set(jnp.nan), updates)
    outputs = _outputs(sim, state, updates, cfg)
    sampled = jnp.arange(num_clients) == 0  # the only sampled client sends NaN
    new, (_, _, _, nonfinite) = sim.aggregate(state, "fedavg", {}, outputs,
                                              jnp.ones(num_clients), sampled)
    _assert_trees_equal(new.params, state.params)
    _assert_trees_equal(new.method, state.method)
    np.testing.assert_array_equal(nonfinite, sampled)
    # A NaN from a client that was not sampled is not reported: it was never used.
    _, (_, _, _, nonfinite) = sim.aggregate(state, "fedavg", {}, outputs, jnp.ones(num_clients),
                                            ~sampled)
    assert not nonfinite.any()


def test_feddyn_stays_finite_over_many_rounds(tiny):
  cfg, federation = tiny
  _, metrics = _run(cfg, federation, "feddyn", cells=cells_lib.grid("fedia", rho=[0.5], beta=[0.5]),
                    rounds=60)
  assert np.all(np.isfinite(metrics.train_loss)) and not metrics.nonfinite.any()


def test_make_method_rejects_bad_names_and_values(tiny):
  cfg, _ = tiny
  model = models.make_model("pmlp_gcn", 5, 8)
  with pytest.raises(ValueError, match="unknown method 'fedsgd'; choose from fedavg, fedprox"):
    methods.make_method("fedsgd", model, cfg)
  with pytest.raises(ValueError, match=r"fedprox: unknown hyper-parameter\(s\) \['lambda'\]"):
    methods.make_method("fedprox", model, cfg, {"lambda": 1})
  with pytest.raises(ValueError, match="fedprox: mu = -1; must be >= 0"):
    methods.make_method("fedprox", model, cfg, {"mu": -1})
  with pytest.raises(ValueError, match="fedopt: server_opt = 'sgd'; must be one of"):
    methods.make_method("fedopt", model, cfg, {"server_opt": "sgd"})
  with pytest.raises(ValueError, match="weights = 'size'"):
    methods.make_method("feddyn", model, cfg, {"weights": "size"})
  with pytest.raises(ValueError, match=r"fedprox: mu = '0.1'; must be a number \(default 0.01\)"):
    methods.make_method("fedprox", model, cfg, {"mu": "0.1"})
  with pytest.raises(ValueError, match=r"fgssl: loss = 1; must be a string \(default 'paper'\)"):
    methods.make_method("fgssl", model, cfg, {"loss": 1})
  with pytest.raises(ValueError, match="fggp: prototype_pass = 'eval'; must be one of"):
    methods.make_method("fggp", model, cfg, {"prototype_pass": "eval"})
  with pytest.raises(ValueError, match=r"participation = 0.0; must be in \(0, 1\]"):
    config.load_preset("wikinet", participation=0)
  with pytest.raises(ValueError, match="fedia_im: unknown hyper-parameter"):
    cells_lib.cell("fedia_im", rho=0.5, beta=0.5)


def test_defaults_file_names_known_methods_and_hparams(tiny):
  cfg, _ = tiny
  model = models.make_model("pmlp_gcn", 5, 8)
  defaults = methods.method_defaults()
  for name, hparams in defaults["hparams"].items():
    assert methods.make_method(name, model, cfg, hparams).name == name
  for setting, table in defaults["fedia"]["twitch"].items():
    assert set(table) <= set(methods.METHODS), setting


def class_counts(model, config):
  """A test method: each client uploads its per-class training-node counts; the server sums them."""
  from fedjax_graph.methods import base

  num_classes = model.num_classes

  def init(params, num_clients):
    return base.MethodState(clients=(), server=jnp.zeros(num_classes))

  def client_final(ctx, params, update):
    one_hot = jax.nn.one_hot(ctx.y, num_classes) * ctx.train_mask[:, None]
    return ctx.client_state, jnp.sum(one_hot, axis=0)  # upload f32[K]

  def server_step(params, total, update, uploads, participating, num_clients):
    params, _ = base.descent_step(config)(params, (), update, uploads, participating,
                                          num_clients)
    return params, total + jnp.sum(jnp.where(participating[:, None], uploads, 0.0), axis=0)

  return base.Method("class_counts", {}, False, init, base.nothing, base.no_loss, client_final,
                     server_step)


def test_uploads_reach_the_server_stacked_by_client(tiny_wikinet):
  if "class_counts" not in methods.REGISTRY:
    methods.register("class_counts", class_counts)
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=2, participation=0.5)
  federation = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  state, metrics = _run(cfg, federation, "class_counts", rounds=3)
  # By hand: each client's training labels, summed over the clients sampled in each round.
  per_client = np.zeros((federation.num_clients, federation.num_classes))
  for clients, shard in zip(federation.bucket_clients, federation.client_shards):
    for j, k in enumerate(clients):
      labels = shard.y[0, j][shard.train[0, j]]
      per_client[k] = np.bincount(labels, minlength=federation.num_classes)
  sampled = np.asarray(metrics.alpha[0, 0]) > 0  # [T, C]
  assert sampled.sum(-1).tolist() == [3, 3, 3] and len({r.tobytes() for r in sampled}) > 1
  np.testing.assert_allclose(state.method.server[0, 0], (sampled @ per_client).sum(0))
  with pytest.raises(ValueError, match="registered already"):
    methods.register("class_counts", class_counts)
