"""Domain graphs → client subgraphs and train/val/test splits (host, numpy, seeded).

A domain's nodes are shuffled with a seeded permutation and cut into equal parts;
a client's graph is the subgraph induced by its part (edges across parts are
dropped, as in the FedIA protocol, Appendix A.1). Each client's nodes are then
split into train/validation/test sets with its own seeded permutation.
"""

from typing import NamedTuple, Sequence

import numpy as np


class ClientGraph(NamedTuple):
  """One client's subgraph, nodes reordered train → val → test.

  Attributes:
    nodes: i64[N] global node ids (indices into the domain graph) in local order.
    edge_index: i32[2, E] local directed edges (both directions of each edge).
    num_train: number of training nodes (local rows [0, num_train)).
    num_val: number of validation nodes (rows [num_train, num_train+num_val)).
    num_test: number of test nodes (the remaining rows).
  """
  nodes: np.ndarray
  edge_index: np.ndarray
  num_train: int
  num_val: int
  num_test: int


def split_sizes(n: int, fractions: Sequence[float]) -> tuple[int, int, int]:
  """Train/val/test sizes for ``n`` nodes: train and val rounded, test the rest.

  Raises:
    ValueError: if the fractions are negative or do not sum to 1.
  """
  if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
    raise ValueError(
        f"split fractions must be three non-negative numbers summing to 1, got {list(fractions)}")
  n_train = int(round(fractions[0] * n))
  n_val = min(int(round(fractions[1] * n)), n - n_train)
  return n_train, n_val, n - n_train - n_val


def induced_subgraph(edge_index: np.ndarray, nodes: np.ndarray, num_nodes: int) -> np.ndarray:
  """Edges of ``edge_index`` with both ends in ``nodes``, relabelled to local ids.

  Args:
    edge_index: int[2, E] directed edges of the domain graph.
    nodes: int[n] global ids; local id i is ``nodes[i]``.
    num_nodes: N, node count of the domain graph.

  Returns:
    i32[2, E'] local edges, in the order they appear in ``edge_index``.
  """
  local = np.full(num_nodes, -1, dtype=np.int64)
  local[nodes] = np.arange(len(nodes))
  src, dst = local[edge_index[0]], local[edge_index[1]]
  keep = (src >= 0) & (dst >= 0)
  return np.stack([src[keep], dst[keep]]).astype(np.int32)


def partition_domain(num_nodes: int, edge_index: np.ndarray, num_clients: int,
                     fractions: Sequence[float], seed: int,
                     domain_index: int) -> list[ClientGraph]:
  """Cuts one domain into ``num_clients`` equal random parts with splits.

  Args:
    num_nodes: N, node count of the domain graph.
    edge_index: int[2, E] directed edges of the domain graph.
    num_clients: number of clients the domain is cut into.
    fractions: (train, val, test) fractions of each client's nodes.
    seed: the run seed; with ``domain_index`` it seeds this domain's streams.
    domain_index: position of the domain in the dataset, so that two domains of
      one run never share a random stream.

  Returns:
    ``num_clients`` ClientGraphs; part sizes differ by at most one node.

  Raises:
    ValueError: if ``num_clients`` is not in [1, N].
  """
  if not 1 <= num_clients <= num_nodes:
    raise ValueError(
        f"cannot cut a domain of {num_nodes} nodes into {num_clients} clients; "
        f"allowed: 1 to {num_nodes}")
  rng = np.random.default_rng([seed, domain_index])
  parts = np.array_split(rng.permutation(num_nodes), num_clients)
  clients = []
  for part in parts:
    n_train, n_val, n_test = split_sizes(len(part), fractions)
    nodes = part[rng.permutation(len(part))]
    clients.append(ClientGraph(nodes=nodes,
                               edge_index=induced_subgraph(edge_index, nodes, num_nodes),
                               num_train=n_train, num_val=n_val, num_test=n_test))
  return clients
