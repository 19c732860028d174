"""FedProto and FedProc: hand-computed losses, uploads and server rules; vmap == loop; padding; +FedIA; real WikiNet."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import fake_domain, vmapped_and_looped
from fedjax_graph import cells as cells_lib
from fedjax_graph import client, config, data, methods, models, simulation, sweep
from fedjax_graph.methods.fedproc import (FedProcState, contrast_weight, fedproc, gpcl_loss,
                                          prototype_cosines)
from fedjax_graph.methods.fedproto import (GlobalPrototypes, PrototypeUpload, global_prototypes,
                                           local_prototypes, no_prototypes, prototype_loss)

NUM_CLASSES, FEATURES, HIDDEN = 5, 8, 8


@pytest.fixture(scope="module")
def cfg():
  return config.load_preset("wikinet", hidden=HIDDEN, max_buckets=2)


@pytest.fixture(scope="module")
def federation(cfg):
  """Domains of 40/60/90 nodes in two size buckets (bucket order is not client order)."""
  sizes = {"chameleon": 90, "squirrel": 40, "crocodile": 60}
  graphs = {d: fake_domain(n, 2 * n, NUM_CLASSES, FEATURES, i) for i, (d, n) in
            enumerate(sizes.items())}
  federation = data.build_federation(cfg, graphs, seeds=[0])
  assert len(federation.bucket_clients) == 2
  assert not np.all(np.diff(np.concatenate(federation.bucket_clients)) > 0)
  return federation


def _init(model, features=FEATURES):
  """Initial parameters (they do not depend on the graph: initialised without propagation)."""
  return model.clone(propagate_eval=False).init(jax.random.PRNGKey(0), jnp.zeros((1, features)),
                                                None, train=False)


def _server(prototypes, present):
  return GlobalPrototypes(jnp.asarray(prototypes, jnp.float32), jnp.asarray(present))


def _ctx(y, train_mask, server_state, x=None, groups=None):
  return methods.ClientContext(None, None, x, jnp.asarray(y), jnp.asarray(train_mask), groups, 1,
                               None, (), server_state)


def _random_server(method, params, seed=5):
  """A non-trivial server state: random prototypes, class 2 absent (FedProc: round 3)."""
  key = jax.random.PRNGKey(seed)
  protos = GlobalPrototypes(jax.random.uniform(key, (NUM_CLASSES, HIDDEN)),
                            jnp.arange(NUM_CLASSES) != 2)
  return protos if method == "fedproto" else FedProcState(protos, jnp.int32(3))


# --- Client uploads -------------------------------------------------------------------------


def test_local_prototypes_are_training_class_means_and_zero_for_an_absent_class(cfg):
  # One linear layer: the classifier's input is x itself, so the means are checkable by hand.
  model = models.make_model("pmlp_gcn", 3, num_layers=1)
  params = _init(model, 2)
  x = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0], [7.0, 7.0], [9.0, 9.0]])
  y = jnp.array([0, 0, 1, 1, 0])
  train = jnp.array([True, True, True, False, False])  # rows 3, 4: validation and padding
  ctx = methods.ClientContext(params, params, x, y, train, jnp.zeros(5, jnp.int32), 1, None, (),
                              None)
  upload = local_prototypes(model, params, ctx)
  np.testing.assert_allclose(upload.prototypes, [[2.0, 3.0], [5.0, 0.0], [0.0, 0.0]])
  np.testing.assert_array_equal(upload.counts, [2.0, 1.0, 0.0])  # class 2 absent here
  # The method's own upload is the same thing.
  fedproto = methods.make_method("fedproto", model, cfg)
  _, same = fedproto.client_final(ctx, params, None)
  jax.tree.map(np.testing.assert_array_equal, same, upload)


def test_uploaded_prototypes_use_the_final_model_without_dropout(cfg):
  model = models.make_model("pmlp_gcn", NUM_CLASSES, HIDDEN)
  params = _init(model)
  x = jax.random.normal(jax.random.PRNGKey(1), (6, FEATURES))
  y, train = jnp.array([0, 1, 1, 3, 3, 3]), jnp.ones(6, bool)
  ctx = methods.ClientContext(params, params, x, y, train, jnp.zeros(6, jnp.int32), 1, None, (),
                              None)
  hidden, _ = jax.jit(lambda p: model.apply(p, x, None, train=True, deterministic=True,
                                            with_hidden=True))(params)
  upload = jax.jit(lambda p: local_prototypes(model, p, ctx))(params)
  np.testing.assert_allclose(upload.prototypes[3], hidden[3:].mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(upload.prototypes[1], hidden[1:3].mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(upload.counts, [1, 2, 0, 3, 0])
  np.testing.assert_array_equal(np.asarray(upload.prototypes)[[2, 4]], 0.0)


# --- Server rule ------------------------------------------------------------------------------


def test_global_prototypes_average_the_participants_that_hold_each_class():
  protos = jnp.array([[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]],   # client 0: class 0
                      [[3.0, 2.0], [5.0, 5.0], [0.0, 0.0]],   # client 1: classes 0, 1
                      [[9.0, 9.0], [9.0, 9.0], [9.0, 9.0]],   # client 2: all, not taking part
                      [[jnp.nan] * 2] * 3])                   # client 3: diverged, left out
  counts = jnp.array([[4.0, 0, 0], [1, 2, 0], [1, 1, 1], [1, 1, 1]])
  participating = jnp.array([True, True, False, False])
  server = global_prototypes(PrototypeUpload(protos, counts), participating)
  # Unweighted over clients (counts 4 and 1 do not weigh); class 2 held by no participant.
  np.testing.assert_allclose(server.prototypes, [[2.0, 1.0], [5.0, 5.0], [0.0, 0.0]])
  np.testing.assert_array_equal(server.present, [True, True, False])
  # Nobody holds anything: zero rows, no class present.
  none = global_prototypes(PrototypeUpload(protos, counts), jnp.zeros(4, bool))
  np.testing.assert_array_equal(none.prototypes, 0.0)
  assert not none.present.any()


# --- Loss terms ------------------------------------------------------------------------------


Z = jnp.array([[1.0, 2.0], [3.0, 0.0], [0.0, 0.0], [100.0, -100.0]])
Y = jnp.array([0, 1, 2, 0])
TRAIN = jnp.array([True, True, True, False])  # the last row is padding


def test_fedproto_loss_by_hand_with_an_absent_class_and_padding(cfg):
  server = _server([[1.0, 0.0], [1.0, 1.0], [7.0, 7.0]], [True, True, False])
  # ||(0, 2)||^2 + ||(2, -1)||^2 + 0 (class 2 has no prototype) over n_tr H = 3 * 2.
  np.testing.assert_allclose(prototype_loss(Z, Y, TRAIN, server), 9.0 / 6.0)
  model = models.make_model("pmlp_gcn", 3, 2)
  fedproto = methods.make_method("fedproto", model, cfg, {"lam": 2.0})
  loss = fedproto.local_loss(None, methods.StepOutput(Z, None), _ctx(Y, TRAIN, server))
  np.testing.assert_allclose(loss, 2.0 * 9.0 / 6.0)
  # No prototype for any class (round 0): 0, with a zero gradient.
  nothing = _server(np.zeros((3, 2)), [False] * 3)
  value, grad = jax.value_and_grad(prototype_loss)(Z, Y, TRAIN, nothing)
  assert float(value) == 0.0 and not np.asarray(grad).any()
  assert fedproto.ce_weight(_ctx(Y, TRAIN, server)) == 1.0


def test_gpcl_loss_by_hand_with_an_absent_class_and_padding():
  z = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 5.0], [3.0, 3.0]])
  server = _server([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [True, True, False])
  # Node 0: cos 1 to its class-0 prototype, 0 to class 1's; node 1: 1/sqrt2 to both;
  # node 2 (class 2, no prototype) adds 0 but counts; node 3 is padding.
  expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 3
  np.testing.assert_allclose(gpcl_loss(z, Y, TRAIN, server), expected, rtol=1e-6)
  # tau divides the cosines.
  expected = (math.log(1 + math.exp(-2)) + math.log(2)) / 3
  np.testing.assert_allclose(gpcl_loss(z, Y, TRAIN, server, tau=0.5), expected,
                             rtol=1e-6)
  # With class 2's prototype present it is one more negative for nodes 0 (cos -1) and 1
  # (cos -1/sqrt2), and node 2's positive: cos 0, against 0 and 1 for classes 0 and 1.
  every = server._replace(present=jnp.ones(3, bool))
  expected = (math.log(1 + math.exp(-1) + math.exp(-2)) + math.log(2 + math.exp(-math.sqrt(2)))
              + math.log(2 + math.e)) / 3
  np.testing.assert_allclose(gpcl_loss(z, Y, TRAIN, every), expected, rtol=1e-6)
  # No prototype at all: 0, finite zero gradient; one class only: its nodes add log 1 = 0.
  nothing = _server(np.zeros((3, 2)), [False] * 3)
  value, grad = jax.value_and_grad(gpcl_loss)(z, Y, TRAIN, nothing)
  assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)
  only_0 = server._replace(present=jnp.array([True, False, False]))
  assert float(gpcl_loss(z, Y, TRAIN, only_0)) == pytest.approx(0.0, abs=1e-7)
  # A zero embedding (a dead ReLU row) keeps the gradient finite.
  grad = jax.grad(gpcl_loss)(jnp.zeros((4, 2)), Y, TRAIN, every)
  assert np.all(np.isfinite(grad))


def test_prototype_cosines_equal_the_pairwise_cosine_with_zero_rows_and_their_gradients():
  key_z, key_p = jax.random.split(jax.random.PRNGKey(3))
  z = jax.random.normal(key_z, (7, 4)).at[2].set(0.0)  # a dead row
  prototypes = jax.random.normal(key_p, (3, 4)).at[1].set(0.0)  # an all-zero prototype
  pairwise = lambda z, p: methods.cosine_similarity(z[:, None, :], p[None, :, :])
  np.testing.assert_allclose(prototype_cosines(z, prototypes), pairwise(z, prototypes),
                             rtol=1e-6, atol=1e-7)
  assert np.all(np.asarray(prototype_cosines(z, prototypes))[2] == 0.0)
  weights = jax.random.normal(key_p, (7, 3))
  for argnum in (0, 1):
    ours, theirs = (jax.grad(lambda *a: jnp.sum(weights * f(*a)), argnum)(z, prototypes)
                    for f in (prototype_cosines, pairwise))
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_fedproc_schedule_weighs_contrast_and_cross_entropy(cfg):
  alphas = [float(contrast_weight(t, 5)) for t in range(7)]
  np.testing.assert_allclose(alphas, [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])
  assert float(contrast_weight(199, 200)) == 0.0
  assert float(contrast_weight(1, 200)) == pytest.approx(1 - 1 / 199)
  assert [float(contrast_weight(t, 1)) for t in range(2)] == [1.0, 0.0]  # a one-round run
  model = models.make_model("pmlp_gcn", 3, 2)
  fedproc = methods.make_method("fedproc", model, cfg, {"rounds": 5})
  server = FedProcState(_server([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], [True, True, False]),
                        jnp.int32(1))
  ctx = _ctx(Y, TRAIN, server)
  z = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 5.0], [3.0, 3.0]])
  np.testing.assert_allclose(fedproc.ce_weight(ctx), 0.25)
  np.testing.assert_allclose(fedproc.local_loss(None, methods.StepOutput(z, None), ctx),
                             0.75 * (math.log(1 + math.exp(-1)) + math.log(2)) / 3, rtol=1e-6)


def test_hyper_parameters_are_checked(cfg):
  model = models.make_model("pmlp_gcn", 3, 2)
  with pytest.raises(ValueError, match="fedproto: lam = -1; must be >= 0"):
    methods.make_method("fedproto", model, cfg, {"lam": -1})
  with pytest.raises(ValueError, match="fedproc: tau = 0; must be > 0"):
    methods.make_method("fedproc", model, cfg, {"tau": 0})
  with pytest.raises(ValueError, match="fedproc: rounds = 0; must be an integer >= 1"):
    methods.make_method("fedproc", model, cfg, {"rounds": 0})
  for rounds in (200.0, True):  # the wrong kind, named before the factory's own check
    with pytest.raises(ValueError, match=r"fedproc: rounds = .*; must be an integer \(default"):
      methods.make_method("fedproc", model, cfg, {"rounds": rounds})
  defaults = methods.method_defaults()["hparams"]
  assert defaults["fedproto"] == {"lam": 1.0, "weights": "count"}
  assert defaults["fedproc"] == {"tau": 1.0, "weights": "count"}
  # Its schedule spans the run unless the config fixes T; other methods take no rounds.
  assert methods.run_hparams("fedproc", defaults["fedproc"], 50)["rounds"] == 50
  assert methods.run_hparams("fedproc", {"rounds": 200}, 50) == {"rounds": 200}
  assert methods.run_hparams("fedproto", defaults["fedproto"], 50) == defaults["fedproto"]
  assert methods.hparams_in_effect("fedproc", {"tau": 2.0}) == {"tau": 2.0, "rounds": 200,
                                                                "weights": "count"}


# --- One client's local training --------------------------------------------------------------


def _local_update(cfg, method, hparams=None):
  model = cfg.model(NUM_CLASSES)
  return jax.jit(client.make_local_update(model, cfg, methods.make_method(method, model, cfg,
                                                                          hparams), 1)), model


def _one_client(n=12, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((n, FEATURES)), jnp.float32),
          jnp.asarray(rng.integers(0, NUM_CLASSES, n), jnp.int32), jnp.ones(n, bool),
          jnp.zeros(n, jnp.int32))


def test_fedproc_round_0_only_decays_and_its_last_round_is_plain_cross_entropy(cfg):
  no_decay = config.load_preset("wikinet", hidden=HIDDEN, weight_decay=0.0)
  update, model = _local_update(no_decay, "fedproc", {"rounds": 4})
  params = _init(model)
  state = fedproc(model, no_decay, rounds=4).init(params, 1).server
  key = jax.random.PRNGKey(1)
  # Round 0: alpha = 1 and no prototypes, so the objective is 0: no movement at all.
  out = update(params, params, *_one_client(), None, key, (), state)
  jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0.0), out.update)
  assert out.upload.counts.sum() == 12
  # Round T - 1 = 3: alpha = 0, so the update is FedAvg's whatever the prototypes.
  late = FedProcState(_random_server("fedproto", params), jnp.int32(3))
  out = update(params, params, *_one_client(), None, key, (), late)
  avg, _ = _local_update(no_decay, "fedavg")
  reference = avg(params, params, *_one_client(), None, key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out.update,
               reference.update)
  # FedProto: no prototypes yet (round 0) is FedAvg too, and prototypes then pull the model.
  proto, _ = _local_update(no_decay, "fedproto")
  empty = no_prototypes(model, params)
  first = proto(params, params, *_one_client(), None, key, (), empty)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), first.update,
               reference.update)
  pulled = proto(params, params, *_one_client(), None, key, (), late.prototypes)
  assert not np.allclose(pulled.update["params"]["layer_0"]["kernel"],
                         reference.update["params"]["layer_0"]["kernel"])


@pytest.mark.parametrize("method", ["fedproto", "fedproc"])
def test_padded_client_equals_unpadded(method):
  # Without dropout the keys cannot differ between the two shapes.
  cfg = config.load_preset("wikinet", hidden=HIDDEN, dropout=0.0)
  update, model = _local_update(cfg, method)
  params = _init(model)
  server = _random_server(method, params)
  x, y, train, groups = _one_client()
  rng = np.random.default_rng(9)
  pad = lambda a, value: jnp.concatenate([a, jnp.full((4,) + a.shape[1:], value, a.dtype)])
  padded_x = jnp.concatenate([x, jnp.asarray(rng.standard_normal((4, FEATURES)) * 50,
                                             jnp.float32)])
  key = jax.random.PRNGKey(2)
  plain = update(params, params, x, y, train, groups, None, key, (), server)
  padded = update(params, params, padded_x, pad(y, 0), pad(train, False), pad(groups, 1), None,
                  key, (), server)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # sum order
  jax.tree.map(close, plain.update, padded.update)
  jax.tree.map(close, plain.upload, padded.upload)
  assert np.abs(plain.update["params"]["layer_0"]["kernel"]).max() > 0


@pytest.mark.parametrize("method", ["fedproto", "fedproc"])
def test_vmapped_clients_equal_python_loop(cfg, federation, method):
  sim = simulation.make_simulation(cfg, federation, method=method)
  params = _init(sim.model)
  server = _random_server(method, params)
  shards = jax.tree.map(lambda leaf: leaf[0], simulation.sim_data(federation).client_shards)
  keys = simulation.client_keys(jax.random.PRNGKey(1), 0, federation.num_clients)
  vmapped, looped = vmapped_and_looped(sim, federation, params, params, shards, keys, (), server)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), vmapped,
               looped)
  # Row k is client k's: its prototype counts are its own training labels.
  for clients, shard in zip(federation.bucket_clients, shards):
    for j, k in enumerate(clients):
      labels = np.asarray(shard.y[j])[np.asarray(shard.train[j])]
      np.testing.assert_array_equal(vmapped.upload.counts[k],
                                    np.bincount(labels, minlength=NUM_CLASSES))


# --- The server part inside the round -----------------------------------------------------------


def _client_outputs(sim, params, num_clients, seed=4):
  """Random updates and prototype uploads; client 1 lacks class 0, nobody holds class 4."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  updates = jax.tree.map(lambda p: jax.random.normal(keys[0], (num_clients,) + p.shape), params)
  counts = jax.random.randint(keys[1], (num_clients, NUM_CLASSES), 1, 5).astype(jnp.float32)
  counts = counts.at[1, 0].set(0.0).at[:, 4].set(0.0)
  protos = jax.random.normal(keys[2], (num_clients, NUM_CLASSES, HIDDEN))
  protos = jnp.where(counts[..., None] > 0, protos, 0.0)
  return client.ClientOutput(updates, jnp.zeros((num_clients, 5)), (),
                             PrototypeUpload(protos, counts)), updates, protos


@pytest.mark.parametrize("method", ["fedproto", "fedproc"])
def test_plus_fedia_at_rho1_beta1_equals_the_method_with_uniform_weights(cfg, federation, method):
  sim = simulation.make_simulation(cfg, federation, method=method,
                                   method_hparams={"weights": "uniform"})
  num_clients = federation.num_clients
  params = _init(sim.model)
  outputs, updates, protos = _client_outputs(sim, params, num_clients)
  counts = jnp.arange(1.0, num_clients + 1)  # uniform weights must ignore these
  sampled = jnp.arange(num_clients) != 2  # client 2 sits out: its prototypes must not count
  new = {}
  for aggregator, hparams in (("fedavg", {}), ("fedia", {"rho": 1.0, "beta": 1.0})):
    state = simulation.SimState(params, simulation.aggregators.get(aggregator).init(num_clients),
                                sim.method.init(params, num_clients), jax.random.PRNGKey(2),
                                jax.random.PRNGKey(3))
    step = jax.jit(lambda s, a=aggregator, h=hparams: sim.aggregate(s, a, h, outputs, counts,
                                                                     sampled))
    new[aggregator], _ = step(state)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)
  jax.tree.map(close, new["fedavg"].params, new["fedia"].params)
  jax.tree.map(close, new["fedavg"].method, new["fedia"].method)
  # By hand: W - eta * mean of the participants' updates; prototypes per class over holders.
  mean = jax.tree.map(lambda u: u[np.asarray(sampled)].mean(0), updates)
  jax.tree.map(close, new["fedavg"].params,
               jax.tree.map(lambda w, u: w - cfg.lr * u, params, mean))
  server = new["fedavg"].method.server
  if method == "fedproc":
    assert int(server.round) == 1
    server = server.prototypes
  holders, protos = [k for k in range(num_clients) if k != 2], np.asarray(protos)
  np.testing.assert_allclose(server.prototypes[0],
                             protos[[k for k in holders if k != 1], 0].mean(0), rtol=1e-6)
  np.testing.assert_allclose(server.prototypes[3], protos[holders, 3].mean(0), rtol=1e-6)
  np.testing.assert_array_equal(server.prototypes[4], 0.0)
  np.testing.assert_array_equal(server.present, [True, True, True, True, False])
  # A round nobody takes part in leaves the prototypes and FedProc's counter as they were.
  state = new["fedavg"]
  unchanged, _ = sim.aggregate(state, "fedavg", {}, outputs, counts, jnp.zeros(num_clients, bool))
  jax.tree.map(np.testing.assert_array_equal, unchanged.method, state.method)


# --- Real data --------------------------------------------------------------------------------


def test_short_fedproc_run_on_real_wikinet_is_sane(raw_dir, prepared_cache):
  # FedProc, alone and +FedIA, over its whole schedule (T = 3: alpha 1, 0.5, 0): the contrast
  # loss, the CE weight and the prototype exchange on real data (FedProto shares the last two).
  cfg = config.load_preset("wikinet")
  graphs, _ = data.load_dataset("wikinet", raw_dir, prepared_cache)
  federation = data.build_federation(cfg, graphs, seeds=[0])
  cells = cells_lib.Cells([cells_lib.cell("fedia", rho=0.5, beta=0.5), cells_lib.cell("fedavg")])
  history = sweep.run_sweep(cfg, federation, cells, 3, sweep.RunControls(progress=False),
                            method="fedproc", method_hparams={"rounds": 3})
  acc = history.test_acc  # [S, G', T, D]
  assert np.all(np.isfinite(acc)) and np.all(np.isfinite(history.train_loss))
  assert not history.nonfinite.any()
  # Every domain's final global model predicts more than one class, above chance (0.2).
  assert np.all(history.predicted_classes[:, :, -1] > 1)
  assert np.all(acc[:, :, -1].mean(-1) > 0.2), acc[:, :, -1]
