"""FedProx: a proximal term keeps each client near the global model.

References:
  T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith,
  "Federated Optimization in Heterogeneous Networks", MLSys 2020, eq. (2).
"""

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier


def fedprox(model: NodeClassifier, config: Config, mu: float = 0.01,
            weights: str = "count") -> base.Method:
  """FedProx: local loss + (mu/2) ||w - W||^2, W the frozen global model.

  Default mu = 0.01 (the paper's grid is {0.001, 0.01, 0.1, 1}); mu = 0 is
  FedAvg. The server part is FedAvg's.
  """
  base.check(mu >= 0, "fedprox", "mu", mu, ">= 0")

  def local_loss(params, step, ctx):
    return 0.5 * mu * base.sum_sq(params, ctx.global_params)

  return base.Method("fedprox", {"mu": mu, "weights": weights}, base.weights_uniform(weights),
                     base.stateless, base.nothing, local_loss, base.keep_state,
                     base.descent_step(config))
