"""Prepared domain graphs → a padded, stacked federation (host, numpy, once).

``build_federation`` turns the domain graphs of a dataset into everything the
simulation needs, for a batch of seeds at once: client shards grouped into size
buckets and stacked ``[S, C_b, ...]``, and one evaluation graph (the disjoint
union of the full domain graphs) with per-seed validation/test masks.

The seed drives the partition, the splits and (in the simulation) the model's
initialisation and dropout, so a batch of seeds is a batch of independent runs.
With ``pooled=True`` the same partition becomes one client holding every
client's subgraph (the centralised reference, ``references``).
"""

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from fedjax_graph import graphs, models, partition
from fedjax_graph.config import Config
from fedjax_graph.graphs import CSRGraph
from fedjax_graph.types import Shard


@dataclasses.dataclass(frozen=True)
class Federation:
  """A padded federation for S seeds (numpy arrays; shapes fixed here).

  Attributes:
    domains: the D domain names, in dataset order.
    num_classes: K.
    seeds: the S seeds, in batch order.
    client_domain: i32[C] domain index of each client (clients of a domain are
      consecutive, domains in dataset order); 0 for the pooled client.
    train_counts: f32[C] training nodes per client (the FedAvg weights; equal
      across seeds because part and split sizes depend only on node counts).
    bucket_clients: per bucket, the client indices it holds (static).
    bucket_train_rows: per bucket, the largest training-node count: a model
      that does not propagate while training only needs these first rows.
    client_shards: per bucket, a ``Shard`` with leaves [S, C_b, ...], with
      its training propagation ``operator`` of ``graphs.operator_kind``
      (``config.propagation`` and the bucket's shapes); None where the
      backbone propagates without one (``models.Backbone.operator``).
    eval_x: f32[N, F] features of the union of the full domain graphs.
    eval_y: i32[N] labels.
    eval_domain: i32[N] domain of each node, D on padding rows.
    eval_graph: the union's ``CSRGraph`` (shared by every seed and model).
    eval_val: bool[S, N] validation nodes (union of the clients' validation nodes).
    eval_test: bool[S, N] test nodes (union of the clients' test nodes).
    eval_owner: i32[S, N] the client of the (unpooled) partition that holds
      each node; 0 on padding rows.
    pooled: True when the federation is one client holding all clients' nodes.
  """
  domains: tuple[str, ...]
  num_classes: int
  seeds: tuple[int, ...]
  client_domain: np.ndarray
  train_counts: np.ndarray
  bucket_clients: tuple[tuple[int, ...], ...]
  bucket_train_rows: tuple[int, ...]
  client_shards: tuple[Shard, ...]
  eval_x: np.ndarray
  eval_y: np.ndarray
  eval_domain: np.ndarray
  eval_graph: CSRGraph
  eval_val: np.ndarray
  eval_test: np.ndarray
  eval_owner: np.ndarray
  pooled: bool = False

  @property
  def num_clients(self) -> int:
    return len(self.client_domain)

  @property
  def one_domain_clients(self) -> bool:
    """True when every client's real rows (``node_domain < D``) lie in one domain.

    Every client of a partition qualifies; the pooled client of several domains
    does not. The batch norm then takes a client's training rows as one group
    (``models.NodeClassifier.one_domain_train``).
    """
    num_domains = len(self.domains)
    for shard in self.client_shards:
      node_domain = np.asarray(shard.node_domain)
      real = node_domain < num_domains
      lowest = np.where(real, node_domain, num_domains).min(-1)
      highest = np.where(real, node_domain, -1).max(-1)
      if np.any(real.any(-1) & (lowest != highest)):
        return False
    return True


def build_federation(config: Config, domain_graphs: Mapping[str, Mapping[str, np.ndarray]],
                     seeds: Sequence[int], pad_multiple: int = 8,
                     pooled: bool = False) -> Federation:
  """Partitions, splits, pads and stacks the federation of ``config`` for ``seeds``.

  Args:
    config: the federation preset (clients per domain, split fractions, buckets).
    domain_graphs: ``{domain: {"x": f32[N, F], "y": i32[N], "edge_index": i32[2, E]}}``
      for every domain of ``config.dataset`` (as ``data_prep.load_domain`` gives).
    seeds: the S >= 1 run seeds.
    pad_multiple: padded sizes are rounded up to a multiple of this.
    pooled: make one client of the partition's clients (the union of their
      subgraphs: no edge between two clients; nodes keep their splits, train
      first). The evaluation graph and masks are those of the partition.

  Returns:
    The ``Federation``.

  Raises:
    ValueError: if a domain is missing, feature widths differ, a domain has
      fewer nodes than clients, a client gets no training node (unless
      ``config.allow_empty_clients``), a domain gets no test node, or no
      seed is given.
  """
  domain_graphs = graphs.check_domain_graphs(domain_graphs, config.domains)
  seeds = tuple(int(s) for s in seeds)
  if not seeds:
    raise ValueError("at least one seed is needed")
  domains = config.domains
  missing = [d for d in domains if d not in domain_graphs]
  if missing:
    raise ValueError(f"no graph for domain(s) {missing}")
  widths = {domain_graphs[d]["x"].shape[1] for d in domains}
  if len(widths) != 1:
    raise ValueError(f"domains have different feature widths {sorted(widths)}")
  num_classes = int(max(domain_graphs[d]["y"].max() for d in domains)) + 1
  for d in domains:
    n = len(domain_graphs[d]["y"])
    if config.clients_per_domain[d] > n:
      raise ValueError(f"clients_per_domain[{d!r}] = {config.clients_per_domain[d]}; its {n} "
                       f"nodes allow 1 to {n}")

  per_seed = [[client for i, d in enumerate(domains)
               for client in partition.partition_domain(
                   len(domain_graphs[d]["y"]), domain_graphs[d]["edge_index"],
                   config.clients_per_domain[d], config.split, seed, i)]
              for seed in seeds]
  client_domain = np.repeat(np.arange(len(domains)), list(config.clients_per_domain.values()))
  first = per_seed[0]
  empty = [f"{domains[client_domain[k]]} client {k}" for k in range(len(first))
           if first[k].num_train == 0]
  if empty and not config.allow_empty_clients:
    raise ValueError(f"client(s) without training nodes: {empty}; use fewer clients per domain "
                     "or set allow_empty_clients: true to give them weight 0")
  test_nodes = np.array([np.bincount(client_domain, [c.num_test for c in clients], len(domains))
                         for clients in per_seed])  # [S, domains]
  untested = [d for d, n in zip(domains, test_nodes.min(axis=0)) if n == 0]
  if untested:
    raise ValueError(f"domain(s) {untested} get no test node with split = {list(config.split)}: "
                     "their test accuracy would be undefined; give test a larger fraction")

  eval_x, eval_y, eval_domain, eval_graph, offsets = _union_graph(domain_graphs, domains,
                                                                  pad_multiple)
  eval_val = np.zeros((len(seeds), len(eval_y)), bool)
  eval_test = np.zeros((len(seeds), len(eval_y)), bool)
  eval_owner = np.zeros((len(seeds), len(eval_y)), np.int32)
  # Each client in the union graph's node ids, so that clients of different
  # domains can be pooled.
  per_seed = [[c._replace(nodes=offsets[client_domain[k]] + c.nodes) for k, c in enumerate(clients)]
              for clients in per_seed]
  for s, clients in enumerate(per_seed):
    for k, c in enumerate(clients):
      eval_val[s, c.nodes[c.num_train:c.num_train + c.num_val]] = True
      eval_test[s, c.nodes[c.num_train + c.num_val:]] = True
      eval_owner[s, c.nodes] = k
  if pooled:
    per_seed = [[_pool(clients)] for clients in per_seed]
    client_domain = np.zeros(1, int)
    first = per_seed[0]
  train_counts = np.array([c.num_train for c in first], np.float32)

  buckets = graphs.size_buckets([len(c.nodes) for c in first], config.max_buckets)
  shards, train_rows = [], []
  for bucket in buckets:
    n_node = graphs.padding_budget(max(len(first[k].nodes) for k in bucket), pad_multiple)
    n_edge = graphs.padding_budget(
        max(clients[k].edge_index.shape[1] for clients in per_seed for k in bucket), pad_multiple)
    stacked = graphs.stack([
        graphs.stack([_client_shard(clients[k], eval_x, eval_y, eval_domain, len(domains),
                                    n_node, n_edge)
                      for k in bucket])
        for clients in per_seed])
    kind = (graphs.operator_kind(config.propagation, n_node, n_edge, len(seeds) * len(bucket))
            if models.BACKBONES[config.backbone].operator else "sparse")  # sparse: none
    shards.append(graphs.with_operator(stacked, kind))
    train_rows.append(max(first[k].num_train for k in bucket))
  return Federation(domains=domains, num_classes=num_classes, seeds=seeds,
                    client_domain=client_domain.astype(np.int32), train_counts=train_counts,
                    bucket_clients=tuple(tuple(b) for b in buckets),
                    bucket_train_rows=tuple(train_rows), client_shards=tuple(shards),
                    eval_x=eval_x, eval_y=eval_y, eval_domain=eval_domain,
                    eval_graph=eval_graph, eval_val=eval_val, eval_test=eval_test,
                    eval_owner=eval_owner, pooled=pooled)


def _pool(clients: Sequence[partition.ClientGraph]) -> partition.ClientGraph:
  """One client holding the given clients' nodes (train, then val, then test) and their edges."""
  pick = lambda start, stop: np.concatenate([c.nodes[start(c):stop(c)] for c in clients])
  nodes = np.concatenate([pick(lambda c: 0, lambda c: c.num_train),
                          pick(lambda c: c.num_train, lambda c: c.num_train + c.num_val),
                          pick(lambda c: c.num_train + c.num_val, lambda c: len(c.nodes))])
  local = np.zeros(nodes.max() + 1, np.int32)
  local[nodes] = np.arange(len(nodes))
  edge_index = local[np.concatenate([c.nodes[c.edge_index] for c in clients], axis=1)]
  return partition.ClientGraph(nodes, edge_index, sum(c.num_train for c in clients),
                               sum(c.num_val for c in clients), sum(c.num_test for c in clients))


def _client_shard(client: partition.ClientGraph, x: np.ndarray, y: np.ndarray,
                  node_domain: np.ndarray, num_domains: int, n_node: int, n_edge: int) -> Shard:
  """A client's padded shard; ``client.nodes`` index the union graph's ``x``, ``y``, ``node_domain``."""
  n = len(client.nodes)
  rows = np.arange(n)
  masks = dict(train=rows < client.num_train,
               val=(rows >= client.num_train) & (rows < client.num_train + client.num_val),
               test=rows >= client.num_train + client.num_val)
  return graphs.pad_graph(x[client.nodes], y[client.nodes], client.edge_index, masks,
                          node_domain[client.nodes], num_domains, n_node, n_edge)


def _union_graph(domain_graphs, domains, pad_multiple):
  """The disjoint union of the full domain graphs, padded (host)."""
  sizes = [len(domain_graphs[d]["y"]) for d in domains]
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  total = int(sum(sizes))
  rows = graphs.padding_budget(total, pad_multiple)
  pad = rows - total
  x = np.concatenate([domain_graphs[d]["x"] for d in domains]
                     + [np.zeros((pad, domain_graphs[domains[0]]["x"].shape[1]), np.float32)])
  y = np.concatenate([domain_graphs[d]["y"] for d in domains] + [np.zeros(pad, np.int64)])
  node_domain = np.concatenate([np.full(n, i) for i, n in enumerate(sizes)]
                               + [np.full(pad, len(domains))])
  edge_index = np.concatenate([domain_graphs[d]["edge_index"] + o
                               for d, o in zip(domains, offsets)], axis=1)
  return (x.astype(np.float32), y.astype(np.int32), node_domain.astype(np.int32),
          graphs.csr_graph(edge_index, total, rows), offsets)


def load_dataset(dataset: str, raw_dir=None, cache_dir=None, verify: bool = True
                 ) -> tuple[dict, dict]:
  """Prepares (on first use) and loads every domain of ``dataset``.

  Args:
    dataset: ``twitch`` or ``wikinet``.
    raw_dir: the raw MUSAE files (SNAP layout); None: ``$FEDJAX_GRAPH_RAW``, the
      cache, or a download (see ``data_prep.prepare``).
    cache_dir: the prepared-data cache; None: ``$FEDJAX_GRAPH_CACHE`` or
      ``~/.cache/fedjax_graph``.
    verify: check the raw files against the SNAP release's sha256 table.

  Returns:
    (``{domain: {"x", "y", "edge_index"}}``, the cache's meta.json contents).

  Raises:
    FileNotFoundError: if ``raw_dir`` is given and is not a folder, or raw files
      are missing.
    ValueError: for malformed or corrupt raw files.
  """
  import data_prep  # Host-only; kept out of the import path of the JAX modules.
  import pathlib

  if raw_dir is not None and not pathlib.Path(raw_dir).is_dir():
    # Even when the cache would serve, a raw folder the user named must exist.
    raise FileNotFoundError(f"raw data folder {raw_dir} does not exist (--raw-dir, "
                            "FEDJAX_GRAPH_RAW: the folder holding twitch/ and wikipedia/)")
  prepared = data_prep.prepare(dataset, raw_dir=raw_dir, cache_dir=cache_dir, verify=verify)
  graphs_ = {d: data_prep.load_domain(prepared, d) for d in data_prep.DATASETS[dataset]}
  return graphs_, data_prep.load_meta(prepared)
