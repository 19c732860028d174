"""FedOpt: an adaptive server optimiser on the aggregate (FedAdam, FedYogi, FedAvgM).

References:
  S. J. Reddi, Z. Charles, M. Zaheer, Z. Garrett, K. Rush, J. Konecny,
  S. Kumar, H. B. McMahan, "Adaptive Federated Optimization", ICLR 2021,
  Algorithm 2 (FedAdam, FedYogi) and FedAvgM.
"""

from typing import Optional

import jax
import optax

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier

SERVER_OPTIMIZERS = ("adam", "yogi", "avgm")


def fedopt(model: NodeClassifier, config: Config, server_opt: str = "adam",
           server_lr: Optional[float] = None, tau: float = 1e-3, b1: float = 0.9,
           b2: float = 0.99, weights: str = "uniform") -> base.Method:
  """FedOpt (Reddi et al. 2021, Algorithm 2): an optax server optimiser on a pseudo-gradient.

  The pseudo-gradient is eta u = -Delta (Delta the mean model delta of the
  participants), so a zero aggregate from a fresh state moves nothing.
  ``server_opt``: ``adam`` (FedAdam via ``optax.adam``, which also
  bias-corrects its moments) or ``yogi`` (FedYogi via ``optax.scale_by_yogi``,
  moments starting at 0), both with adaptivity ``tau`` as eps; ``avgm``
  (FedAvgM via ``optax.sgd`` with momentum ``b1``; server_lr 1 and b1 0 is
  FedAvg). Defaults from the paper: server_lr 10^-2 (adam, yogi) or 1
  (avgm), tau 10^-3, b1 0.9, b2 0.99. Both adaptive optimisers bias-correct
  their moments, which the paper's Algorithm 2 does not.
  """
  if server_lr is None:
    server_lr = 1.0 if server_opt == "avgm" else 0.01
  base.check(server_opt in SERVER_OPTIMIZERS, "fedopt", "server_opt", server_opt,
             f"one of {SERVER_OPTIMIZERS}")
  base.check(server_lr > 0, "fedopt", "server_lr", server_lr, "> 0")
  base.check(tau > 0, "fedopt", "tau", tau, "> 0")
  base.check(0 <= b1 < 1, "fedopt", "b1", b1, "in [0, 1)")
  base.check(0 <= b2 < 1, "fedopt", "b2", b2, "in [0, 1)")
  if server_opt == "adam":
    optimizer = optax.adam(server_lr, b1=b1, b2=b2, eps=tau)
  elif server_opt == "yogi":
    # optax.yogi starts both moments at 1e-6, so a zero update would still
    # move; the paper starts the first moment at 0.
    optimizer = optax.chain(
        optax.scale_by_yogi(b1=b1, b2=b2, eps=tau, initial_accumulator_value=0.0),
        optax.scale(-server_lr))
  else:
    optimizer = optax.sgd(server_lr, momentum=b1 or None)

  def init(params, num_clients):
    return base.MethodState(clients=(), server=optimizer.init(params))

  def server_step(params, opt_state, update, uploads, participating, num_clients):
    pseudo_grad = jax.tree.map(lambda u: config.lr * u, update)
    steps, opt_state = optimizer.update(pseudo_grad, opt_state, params)
    return optax.apply_updates(params, steps), opt_state

  hparams = {"server_opt": server_opt, "server_lr": server_lr, "tau": tau, "b1": b1, "b2": b2,
             "weights": weights}
  return base.Method("fedopt", hparams, base.weights_uniform(weights), init, base.nothing,
                     base.no_loss, base.keep_state, server_step)
