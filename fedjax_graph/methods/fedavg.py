"""FedAvg (McMahan et al. 2017): local SGD, the server steps along the mean update.

References:
  H. B. McMahan, E. Moore, D. Ramage, S. Hampson, B. Aguera y Arcas,
  "Communication-Efficient Learning of Deep Networks from Decentralized
  Data", AISTATS 2017, Algorithm 1.
"""

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier


def fedavg(model: NodeClassifier, config: Config, weights: str = "count") -> base.Method:
  """FedAvg: W <- W - eta u, u the aggregate (the count-weighted mean by default)."""
  return base.Method("fedavg", {"weights": weights}, base.weights_uniform(weights),
                     base.stateless, base.nothing, base.no_loss, base.keep_state,
                     base.descent_step(config))
