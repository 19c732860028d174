"""Reference rows of the comparison tables: the floor and the ceiling of a federation.

A server rule is worth what it adds between two references run on the same
seeds, partition and splits (and, where they train, the same initial model):

  ===========  ===============================================================
  majority     per domain, the majority class of its clients' training labels,
               predicted for every node (the floor a constant model reaches).
  local        every client trains its own model alone for the same rounds x
               local steps (``methods.local``); a domain's test node is
               classified by the model of the client that holds it, on the
               full domain graph.
  centralized  one model trained on the union of all clients' training nodes
               (their subgraphs side by side, no edge between clients), full
               batch, rounds x local steps: FedAvg over one pooled client
               (``data.build_federation(pooled=True)``), so the optimiser is
               reset every K steps exactly as the clients' is.
  ===========  ===============================================================
"""

import numpy as np

from fedjax_graph import simulation
from fedjax_graph.data import Federation

REFERENCES = ("majority", "local", "centralized")
DISPLAY = {"majority": "Majority", "local": "Local", "centralized": "Centralized"}


def majority_classes(federation: Federation) -> np.ndarray:
  """i32[S, D]: the most frequent training label of each domain (ties: the lower class).

  Counted over the training nodes of the domain's clients, per seed (the
  splits depend on the seed).
  """
  num_seeds, num_domains = len(federation.seeds), len(federation.domains)
  counts = np.zeros((num_seeds, num_domains + 1, federation.num_classes), np.int64)
  for shard in federation.client_shards:  # leaves [S, C_b, N]
    for s in range(num_seeds):
      train = shard.train[s]
      np.add.at(counts[s], (shard.node_domain[s][train], shard.y[s][train]), 1)
  return counts[:, :num_domains].argmax(axis=-1).astype(np.int32)


def majority_history(federation: Federation, rounds: int) -> dict:
  """Per-round arrays of the majority-class predictor, shaped like one cell of a sweep.

  Returns:
    ``{test_acc, val_acc, test_bacc, test_f1: f32[S, 1, T, D], predicted_classes:
    i32[S, 1, T, D], train_loss: f32[S, 1, T] (NaN: nothing is trained),
    nonfinite: bool[S, 1, T, C], alpha: f32[S, 1, T, C]}``; the prediction
    does not change over rounds.
  """
  majority = majority_classes(federation)
  num_domains, num_classes = len(federation.domains), federation.num_classes
  padded = np.minimum(federation.eval_domain, num_domains - 1)  # padding rows: any class
  per_seed = []
  for s in range(len(federation.seeds)):
    pred = majority[s][padded]
    scores = lambda mask: simulation.domain_scores(pred, federation.eval_y, mask,
                                                   federation.eval_domain, num_domains,
                                                   num_classes)
    test, val = scores(federation.eval_test[s]), scores(federation.eval_val[s])
    per_seed.append([np.asarray(v) for v in (test.acc, val.acc, test.bacc, test.f1,
                                             test.classes)])
  stacked = [np.stack(values) for values in zip(*per_seed)]  # each [S, D]
  over_rounds = lambda a: np.repeat(a[:, None, None], rounds, axis=2)  # [S, 1, T, D]
  test_acc, val_acc, test_bacc, test_f1, classes = map(over_rounds, stacked)
  shape = (len(federation.seeds), 1, rounds)
  return dict(test_acc=test_acc, val_acc=val_acc, test_bacc=test_bacc, test_f1=test_f1,
              predicted_classes=classes, train_loss=np.full(shape, np.nan, np.float32),
              nonfinite=np.zeros(shape + (federation.num_clients,), bool),
              alpha=np.zeros(shape + (federation.num_clients,), np.float32))
