"""FedDyn: a dynamic regulariser aligns the clients' optima with the global one.

References:
  D. A. E. Acar, Y. Zhao, R. M. Navarro, M. Mattina, P. N. Whatmough,
  V. Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR
  2021, Algorithm 1.
"""

import jax
import jax.numpy as jnp

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier


def feddyn(model: NodeClassifier, config: Config, alpha: float = 0.01,
           weights: str = "uniform") -> base.Method:
  """FedDyn (Acar et al. 2021, Algorithm 1).

  Client k minimises L_k(w) - <g_k, w> + (alpha/2) ||w - W||^2, then
  g_k <- g_k - alpha (w_k - W) = g_k + alpha eta u_k. Server, with m the
  total number of clients and P the participants:
  h <- h - (alpha/m) sum_{k in P} (w_k - W) = h + alpha eta (|P|/m) u and
  W <- mean_{k in P} w_k - h/alpha = W - eta u - h/alpha, u the uniform mean
  of the participants' updates (or what replaces it, e.g. FedIA's
  aggregate). Default alpha = 0.01 (the paper's grid is {0.1, 0.01, 0.001}).
  """
  base.check(alpha > 0, "feddyn", "alpha", alpha, "> 0")
  lr = config.lr

  def init(params, num_clients):
    return base.MethodState(clients=base.per_client(base.zeros_like(params), num_clients),
                            server=base.zeros_like(params))

  def local_loss(params, step, ctx):
    return (0.5 * alpha * base.sum_sq(params, ctx.global_params)
            - base.dot(ctx.client_state, params))

  def client_final(ctx, params, update):
    return jax.tree.map(lambda g, u: g + alpha * lr * u, ctx.client_state, update), ()

  def server_step(params, h, update, uploads, participating, num_clients):
    share = jnp.sum(participating) / num_clients
    h = jax.tree.map(lambda h_, u: h_ + alpha * lr * share * u, h, update)
    return jax.tree.map(lambda w, u, h_: w - lr * u - h_ / alpha, params, update, h), h

  return base.Method("feddyn", {"alpha": alpha, "weights": weights},
                     base.weights_uniform(weights), init, base.nothing, local_loss,
                     client_final, server_step)
