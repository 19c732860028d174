"""User-supplied graphs: self-loops and duplicates removed and counted, one-way edges refused."""

import warnings

import numpy as np
import pytest

from fedjax_graph import config, data, graphs


def _graph(edges, n=4):
  return dict(x=np.zeros((n, 2), np.float32), y=np.arange(n, dtype=np.int32) % 2,
              edge_index=np.asarray(edges, np.int32).reshape(2, -1))


def test_clean_graphs_pass_unchanged_and_silently(tiny_wikinet):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert graphs.check_domain_graphs(tiny_wikinet, list(tiny_wikinet)) is tiny_wikinet


@pytest.mark.parametrize("edges, loops, duplicates", [
    ([[0, 1, 2], [1, 0, 2]], 1, 0),  # 2 -> 2
    ([[0, 1, 0, 1, 0], [1, 0, 1, 0, 1]], 0, 3),  # 0 -> 1 three times, 1 -> 0 twice
    ([[3, 0, 1, 3, 1, 0], [3, 1, 0, 3, 0, 1]], 2, 2),
])
def test_self_loops_and_duplicates_are_removed_and_counted(edges, loops, duplicates):
  domains = {"a": _graph(edges)}
  with pytest.warns(UserWarning, match=f"a: removed {loops} self-loop.s. and {duplicates} "
                                       r"duplicate edge.s. from edge_index"):
    cleaned = graphs.check_domain_graphs(domains, ["a"])
  # The first of each edge, in the given order; the input is not changed.
  assert cleaned["a"]["edge_index"].tolist() == [[0, 1], [1, 0]]
  assert cleaned["a"]["edge_index"].dtype == np.int32
  assert domains["a"]["edge_index"].shape[1] == len(edges[0])


def test_a_one_way_edge_is_refused():
  with pytest.raises(ValueError, match=r"a: 1 edge\(s\) of edge_index have no reverse, e.g. 1 -> "
                                       r"2; graphs must be undirected"):
    graphs.check_domain_graphs({"a": _graph([[0, 1, 1], [1, 0, 2]])}, ["a"])


@pytest.mark.parametrize("change, message", [
    (dict(edge_index=np.array([[0, 4], [4, 0]])),
     "a: edge_index holds node id 4; must be in [0, 4)"),
    (dict(edge_index=np.array([[0, -1], [-1, 0]])), "node id -1; must be in [0, 4)"),
    (dict(edge_index=np.zeros((3, 2), int)), "a: edge_index is int64[3, 2]; must be integers of "
                                             "shape [2, E]"),
    (dict(edge_index=np.array([[0.0, 1.0], [1.0, 0.0]])), "edge_index is float64[2, 2]"),
    (dict(y=np.array([0.0, 1.0, 0.0, 1.0])), "a: y is float64[4]; must be integer labels >= 0"),
    (dict(y=np.array([0, -1, 0, 1])), "y is int64[4]; must be integer labels >= 0 of shape [4]"),
    (dict(x=np.zeros(4)), "a: x has shape (4,); must be [N, F]"),
])
def test_malformed_graphs_are_named(change, message):
  with pytest.raises(ValueError) as err:
    graphs.check_domain_graphs({"a": {**_graph([[0, 1], [1, 0]]), **change}}, ["a"])
  assert message in str(err.value)


def test_build_federation_cleans_user_graphs_first(tiny_wikinet):
  cfg = config.load_preset("wikinet", hidden=8, max_buckets=1)
  dirty = dict(tiny_wikinet)
  edges = tiny_wikinet["squirrel"]["edge_index"]
  loops = np.stack([np.arange(5), np.arange(5)]).astype(edges.dtype)
  dirty["squirrel"] = {**tiny_wikinet["squirrel"],
                       "edge_index": np.concatenate([edges, loops, edges[:, :7]], axis=1)}
  with pytest.warns(UserWarning, match="squirrel: removed 5 self-loop.s. and 7 duplicate edge"):
    federation = data.build_federation(cfg, dirty, seeds=[0])
  expected = data.build_federation(cfg, tiny_wikinet, seeds=[0])
  for got, want in zip(federation.eval_graph, expected.eval_graph):
    np.testing.assert_array_equal(got, want)
  crocodile = tiny_wikinet["crocodile"]
  one_way = dict(tiny_wikinet,
                 crocodile={**crocodile, "edge_index": crocodile["edge_index"][:, 1:]})
  with pytest.raises(ValueError, match="crocodile: 1 edge.s. of edge_index have no reverse"):
    data.build_federation(cfg, one_way, seeds=[0])
