"""Tests of fedjax_graph.partition and data.build_federation (host-side, numpy)."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_graph import data, graphs, partition
from fedjax_graph.config import load_preset
from conftest import random_graph

# A hand-made graph on 6 nodes: 0-1, 1-2, 2-3, 3-4, 0-5 (both directions).
_UNDIRECTED = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [0, 5]]).T
SMALL_EDGES = np.concatenate([_UNDIRECTED, _UNDIRECTED[::-1]], axis=1)



def _reference_induced(edge_index, nodes):
  """Induced subgraph by a plain loop: list of local (src, dst) in edge order."""
  local = {int(g): i for i, g in enumerate(nodes)}
  return [(local[int(s)], local[int(r)]) for s, r in edge_index.T
          if int(s) in local and int(r) in local]


class TestSplitSizes:

  @pytest.mark.parametrize("n,fractions,expected", [
      (10, (0.6, 0.1, 0.3), (6, 1, 3)),
      (7, (0.6, 0.1, 0.3), (4, 1, 2)),    # 4.2 -> 4, 0.7 -> 1, rest 2
      (9, (0.6, 0.2, 0.2), (5, 2, 2)),    # 5.4 -> 5, 1.8 -> 2
      (100, (0.6, 0.2, 0.2), (60, 20, 20)),
      (1, (0.6, 0.2, 0.2), (1, 0, 0)),
      (1, (0.4, 0.3, 0.3), (0, 0, 1)),
      (0, (0.6, 0.1, 0.3), (0, 0, 0)),
      (3, (0.5, 0.5, 0.0), (2, 1, 0)),    # val clamped so test is never negative
      (4, (1.0, 0.0, 0.0), (4, 0, 0)),
  ])
  def test_hand_computed(self, n, fractions, expected):
    sizes = partition.split_sizes(n, fractions)
    assert sizes == expected
    assert sum(sizes) == n and min(sizes) >= 0

  def test_sum_and_nonnegative_for_many_sizes(self):
    for n in range(0, 60):
      for fractions in [(0.6, 0.1, 0.3), (0.6, 0.2, 0.2), (0.1, 0.8, 0.1), (0.5, 0.5, 0.0)]:
        tr, va, te = partition.split_sizes(n, fractions)
        assert tr + va + te == n and min(tr, va, te) >= 0
        assert abs(tr - fractions[0] * n) <= 0.5

  @pytest.mark.parametrize("fractions", [
      (0.6, 0.1, 0.2),      # sums to 0.9
      (0.6, 0.3, 0.3),      # sums to 1.2
      (1.2, -0.1, -0.1),    # sums to 1 but negative
      (0.5, 0.5),           # two fractions
      (0.25, 0.25, 0.25, 0.25),
  ])
  def test_bad_fractions_raise(self, fractions):
    with pytest.raises(ValueError, match="split fractions"):
      partition.split_sizes(10, fractions)


class TestInducedSubgraph:

  def test_hand_made(self):
    # Keep nodes 3, 1, 2 (local ids 0, 1, 2): edges 1-2 and 2-3 survive; 0-1, 3-4 and
    # 0-5 have an end outside and are dropped.
    nodes = np.array([3, 1, 2])
    local = partition.induced_subgraph(SMALL_EDGES, nodes, 6)
    # Edge order of SMALL_EDGES: (0,1) (1,2) (2,3) (3,4) (0,5) (1,0) (2,1) (3,2) (4,3) (5,0).
    expected = np.array([[1, 2, 2, 0], [2, 0, 1, 2]])
    np.testing.assert_array_equal(local, expected)
    assert local.dtype == np.int32

  def test_no_edges_kept(self):
    local = partition.induced_subgraph(SMALL_EDGES, np.array([1, 5, 4]), 6)
    assert local.shape == (2, 0)

  def test_all_nodes_permuted(self):
    nodes = np.array([5, 4, 3, 2, 1, 0])
    local = partition.induced_subgraph(SMALL_EDGES, nodes, 6)
    np.testing.assert_array_equal(local, 5 - SMALL_EDGES)

  def test_matches_reference_onrandom_graph(self):
    ei = random_graph(30, 60, seed=0)
    nodes = np.random.default_rng(1).permutation(30)[:13]
    local = partition.induced_subgraph(ei, nodes, 30)
    assert [tuple(e) for e in local.T.tolist()] == _reference_induced(ei, nodes)


class TestPartitionDomain:
  N = 53
  EDGES = random_graph(53, 120, seed=2)
  FRACTIONS = (0.6, 0.1, 0.3)

  def _parts(self, num_clients=4, seed=0, domain_index=0, fractions=FRACTIONS):
    return partition.partition_domain(self.N, self.EDGES, num_clients, fractions, seed,
                                      domain_index)

  @pytest.mark.parametrize("num_clients", [1, 3, 4, 7, 53])
  def test_parts_are_a_partition(self, num_clients):
    clients = self._parts(num_clients)
    assert len(clients) == num_clients
    all_nodes = np.concatenate([c.nodes for c in clients])
    assert len(all_nodes) == self.N
    np.testing.assert_array_equal(np.sort(all_nodes), np.arange(self.N))
    sizes = [len(c.nodes) for c in clients]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == self.N

  def test_part_sizes_hand_computed(self):
    # 53 = 14 + 13 + 13 + 13 (array_split puts the remainder first).
    assert [len(c.nodes) for c in self._parts(4)] == [14, 13, 13, 13]

  def test_split_counts(self):
    for c in self._parts(4):
      n = len(c.nodes)
      assert (c.num_train, c.num_val, c.num_test) == partition.split_sizes(n, self.FRACTIONS)
      assert c.num_train + c.num_val + c.num_test == n
    # 14 nodes: 8.4 -> 8, 1.4 -> 1, 5 ; 13 nodes: 7.8 -> 8, 1.3 -> 1, 4.
    counts = [(c.num_train, c.num_val, c.num_test) for c in self._parts(4)]
    assert counts == [(8, 1, 5), (8, 1, 4), (8, 1, 4), (8, 1, 4)]

  def test_local_edges_are_induced_subgraph(self):
    for c in self._parts(4):
      assert c.edge_index.dtype == np.int32
      assert [tuple(e) for e in c.edge_index.T.tolist()] == _reference_induced(self.EDGES,
                                                                                c.nodes)
      # Local ids map back to global edges.
      glob = c.nodes[c.edge_index]
      global_set = set(map(tuple, self.EDGES.T.tolist()))
      assert all(tuple(e) in global_set for e in glob.T.tolist())

  def test_cross_part_edges_dropped(self):
    clients = self._parts(4)
    owner = np.empty(self.N, int)
    for k, c in enumerate(clients):
      owner[c.nodes] = k
    within = np.sum(owner[self.EDGES[0]] == owner[self.EDGES[1]])
    assert sum(c.edge_index.shape[1] for c in clients) == within
    assert within < self.EDGES.shape[1]

  def test_deterministic(self):
    a, b = self._parts(4, seed=5), self._parts(4, seed=5)
    for ca, cb in zip(a, b):
      np.testing.assert_array_equal(ca.nodes, cb.nodes)
      np.testing.assert_array_equal(ca.edge_index, cb.edge_index)
      assert (ca.num_train, ca.num_val, ca.num_test) == (cb.num_train, cb.num_val, cb.num_test)

  def test_seed_and_domain_index_change_partition(self):
    base = self._parts(4, seed=0, domain_index=0)
    for other in (self._parts(4, seed=1, domain_index=0), self._parts(4, seed=0, domain_index=1)):
      assert any(not np.array_equal(c.nodes, o.nodes) for c, o in zip(base, other))
      # Same sizes: they depend only on the node count.
      assert [len(c.nodes) for c in base] == [len(o.nodes) for o in other]

  def test_local_order_shuffled_within_part(self):
    # One client: the part is the whole permuted domain, then permuted again.
    (c,) = self._parts(1)
    assert not np.array_equal(c.nodes, np.arange(self.N))

  @pytest.mark.parametrize("num_clients", [54, 100, 0, -1])
  def test_bad_num_clients(self, num_clients):
    with pytest.raises(ValueError) as err:
      self._parts(num_clients)
    assert str(self.N) in str(err.value) and str(num_clients) in str(err.value)


# --- data.build_federation on a tiny synthetic WikiNet -------------------------------------------

DOMAIN_SIZES = {"chameleon": 37, "squirrel": 52, "crocodile": 44}
NUM_FEATURES = 8


def _fake_domains(sizes=DOMAIN_SIZES, num_classes=5):
  out = {}
  for i, (name, n) in enumerate(sizes.items()):
    rng = np.random.default_rng(100 + i)
    # Distinct features per domain, so a row can be traced back to its node.
    x = (rng.standard_normal((n, NUM_FEATURES)) + 10 * i).astype(np.float32)
    y = rng.integers(0, num_classes, n).astype(np.int64)
    if n > 1:
      y[0] = num_classes - 1
      ei = random_graph(n, min(2 * n, n * (n - 1) // 2), seed=200 + i)
    else:
      ei = np.zeros((2, 0), np.int64)
    out[name] = dict(x=x, y=y, edge_index=ei)
  return out


@pytest.fixture(scope="module")
def wikinet():
  config = load_preset("wikinet", hidden=8)
  domains = _fake_domains()
  fed = data.build_federation(config, domains, seeds=[0, 1])
  return config, domains, fed


def _client_rows(fed):
  """{client index: (bucket, position in bucket)}."""
  return {k: (b, j) for b, clients in enumerate(fed.bucket_clients) for j, k in enumerate(clients)}


def _expected_clients(config, domains, seed):
  return [c for i, d in enumerate(config.domains)
          for c in partition.partition_domain(len(domains[d]["y"]), domains[d]["edge_index"],
                                              config.clients_per_domain[d], config.split, seed, i)]


class TestBuildFederation:

  def test_counts(self, wikinet):
    config, domains, fed = wikinet
    assert config.clients_per_domain == {"chameleon": 2, "squirrel": 2, "crocodile": 2}
    assert fed.num_clients == 6
    assert fed.domains == ("chameleon", "squirrel", "crocodile")
    assert fed.seeds == (0, 1)
    assert fed.num_classes == 5
    np.testing.assert_array_equal(fed.client_domain, [0, 0, 1, 1, 2, 2])
    # Parts: 37 -> 19, 18; 52 -> 26, 26; 44 -> 22, 22; train = round(0.6 n).
    np.testing.assert_array_equal(fed.train_counts, [11, 11, 16, 16, 13, 13])
    assert fed.train_counts.dtype == np.float32
    assert sorted(k for b in fed.bucket_clients for k in b) == list(range(6))
    assert len(fed.client_shards) == len(fed.bucket_clients)

  def test_bucket_shapes(self, wikinet):
    _, _, fed = wikinet
    sizes = [19, 18, 26, 26, 22, 22]
    for clients, shard, train_rows in zip(fed.bucket_clients, fed.client_shards,
                                          fed.bucket_train_rows):
      s, c, n_node, f = shard.x.shape
      assert (s, c, f) == (2, len(clients), NUM_FEATURES)
      assert n_node == graphs.padding_budget(max(sizes[k] for k in clients))
      assert n_node % 8 == 0
      assert train_rows == max(int(fed.train_counts[k]) for k in clients)
      assert shard.senders.shape[:2] == (2, len(clients))

  def test_client_rows_match_domain_nodes(self, wikinet):
    config, domains, fed = wikinet
    where = _client_rows(fed)
    for s, seed in enumerate(fed.seeds):
      for k, c in enumerate(_expected_clients(config, domains, seed)):
        d = fed.domains[fed.client_domain[k]]
        b, j = where[k]
        shard = fed.client_shards[b]
        n = len(c.nodes)
        np.testing.assert_array_equal(shard.x[s, j, :n], domains[d]["x"][c.nodes])
        np.testing.assert_array_equal(shard.x[s, j, n:], 0.0)
        np.testing.assert_array_equal(shard.y[s, j, :n], domains[d]["y"][c.nodes])
        tr, va = c.num_train, c.num_val
        np.testing.assert_array_equal(np.flatnonzero(shard.train[s, j]), np.arange(tr))
        np.testing.assert_array_equal(np.flatnonzero(shard.val[s, j]), np.arange(tr, tr + va))
        np.testing.assert_array_equal(np.flatnonzero(shard.test[s, j]), np.arange(tr + va, n))
        np.testing.assert_array_equal(shard.node_domain[s, j, :n], fed.client_domain[k])
        np.testing.assert_array_equal(shard.node_domain[s, j, n:], 3)
        e = c.edge_index.shape[1]
        np.testing.assert_array_equal(shard.senders[s, j, :e], c.edge_index[0])
        np.testing.assert_array_equal(shard.receivers[s, j, :e], c.edge_index[1])
        np.testing.assert_array_equal(shard.edge_weight[s, j, e:], 0.0)

  def test_eval_graph(self, wikinet):
    config, domains, fed = wikinet
    total = sum(DOMAIN_SIZES.values())
    rows = graphs.padding_budget(total)
    assert fed.eval_x.shape == (rows, NUM_FEATURES)
    np.testing.assert_array_equal(
        fed.eval_x[:total], np.concatenate([domains[d]["x"] for d in config.domains]))
    np.testing.assert_array_equal(fed.eval_x[total:], 0.0)
    np.testing.assert_array_equal(
        fed.eval_y[:total], np.concatenate([domains[d]["y"] for d in config.domains]))
    np.testing.assert_array_equal(fed.eval_domain, [0] * 37 + [1] * 52 + [2] * 44
                                  + [3] * (rows - total))
    # The eval graph is the disjoint union: propagating equals per-domain propagation.
    h = np.random.default_rng(0).standard_normal((rows, 3)).astype(np.float32)
    out = np.asarray(graphs.propagate(jnp.asarray(h), fed.eval_graph))
    offset = 0
    for d in config.domains:
      n = DOMAIN_SIZES[d]
      csr = graphs.csr_graph(domains[d]["edge_index"], n, n)
      np.testing.assert_allclose(out[offset:offset + n],
                                 np.asarray(graphs.propagate(jnp.asarray(h[offset:offset + n]),
                                                             csr)), rtol=1e-5, atol=1e-6)
      offset += n
    np.testing.assert_array_equal(out[total:], 0.0)

  def test_eval_masks_are_union_of_client_splits(self, wikinet):
    config, domains, fed = wikinet
    offsets = {"chameleon": 0, "squirrel": 37, "crocodile": 89}
    rows = fed.eval_x.shape[0]
    assert fed.eval_val.shape == fed.eval_test.shape == (2, rows)
    for s, seed in enumerate(fed.seeds):
      val, test, train = set(), set(), set()
      for k, c in enumerate(_expected_clients(config, domains, seed)):
        o = offsets[fed.domains[fed.client_domain[k]]]
        tr, va = c.num_train, c.num_val
        train |= set((o + c.nodes[:tr]).tolist())
        val |= set((o + c.nodes[tr:tr + va]).tolist())
        test |= set((o + c.nodes[tr + va:]).tolist())
      assert set(np.flatnonzero(fed.eval_val[s]).tolist()) == val
      assert set(np.flatnonzero(fed.eval_test[s]).tolist()) == test
      assert not (fed.eval_val[s] & fed.eval_test[s]).any()
      assert len(train | val | test) == 133 and not (train & (val | test))

  def test_seeds_give_different_partitions(self, wikinet):
    _, _, fed = wikinet
    assert not np.array_equal(fed.eval_val[0], fed.eval_val[1])
    assert not np.array_equal(fed.eval_test[0], fed.eval_test[1])
    assert fed.eval_val[0].sum() == fed.eval_val[1].sum()
    shard = fed.client_shards[0]
    assert not np.array_equal(shard.x[0], shard.x[1])

  def test_single_seed_matches_batch(self, wikinet):
    config, domains, fed = wikinet
    single = data.build_federation(config, domains, seeds=[1])
    np.testing.assert_array_equal(single.eval_val[0], fed.eval_val[1])
    np.testing.assert_array_equal(single.eval_test[0], fed.eval_test[1])
    for a, b in zip(single.client_shards, fed.client_shards):
      np.testing.assert_array_equal(a.x[0], b.x[1])

  def test_client_without_train_nodes_raises(self):
    # squirrel has 2 nodes cut into 2 clients: 1 node each, round(0.4 * 1) = 0 train nodes.
    config = load_preset("wikinet", hidden=8, split=(0.4, 0.3, 0.3))
    domains = _fake_domains({"chameleon": 30, "squirrel": 2, "crocodile": 31})
    with pytest.raises(ValueError, match="without training nodes") as err:
      data.build_federation(config, domains, seeds=[0])
    assert "squirrel client 2" in str(err.value) and "squirrel client 3" in str(err.value)
    assert "chameleon" not in str(err.value)

  def test_domain_smaller_than_client_count_raises(self):
    config = load_preset("wikinet", hidden=8)
    domains = _fake_domains({"chameleon": 30, "squirrel": 1, "crocodile": 31})
    with pytest.raises(ValueError, match=r"clients_per_domain\['squirrel'\] = 2; its 1 nodes "
                                         "allow 1 to 1"):
      data.build_federation(config, domains, seeds=[0])

  def test_domain_without_test_nodes_raises(self):
    # squirrel's 2 nodes in 2 clients: round(0.6 * 1) = 1 train node each, none left to test.
    config = load_preset("wikinet", hidden=8, split=(0.6, 0.1, 0.3))
    domains = _fake_domains({"chameleon": 30, "squirrel": 2, "crocodile": 31})
    with pytest.raises(ValueError, match=r"domain\(s\) \['squirrel'\] get no test node"):
      data.build_federation(config, domains, seeds=[0])

  def test_missing_domain_raises(self):
    config = load_preset("wikinet", hidden=8)
    domains = _fake_domains()
    del domains["crocodile"]
    with pytest.raises(ValueError, match="crocodile"):
      data.build_federation(config, domains, seeds=[0])

  def test_feature_width_mismatch_raises(self):
    config = load_preset("wikinet", hidden=8)
    domains = _fake_domains()
    domains["squirrel"]["x"] = domains["squirrel"]["x"][:, :5]
    with pytest.raises(ValueError, match="feature widths"):
      data.build_federation(config, domains, seeds=[0])

  def test_no_seed_raises(self):
    with pytest.raises(ValueError, match="seed"):
      data.build_federation(load_preset("wikinet", hidden=8), _fake_domains(), seeds=[])
