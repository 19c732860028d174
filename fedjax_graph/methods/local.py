"""Local training alone: the reference row whose clients never share anything."""

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier


def local(model: NodeClassifier, config: Config) -> base.Method:
  """Local training alone, a reference row (not a federated method).

  Every client trains its own model: per-client state is its model, each
  round it runs the same local steps from it (optimiser state fresh each
  round, as the federated clients) and keeps the result; nothing is
  aggregated and the global model never moves. ``personal``: a domain's test
  node is classified by the model of the client that holds it.
  """
  def init(params, num_clients):
    return base.MethodState(clients=base.per_client(params, num_clients), server=())

  def client_final(ctx, params, update):
    return params, ()

  def server_step(params, server_state, update, uploads, participating, num_clients):
    return params, server_state

  return base.Method("local", {}, False, init, base.nothing, base.no_loss, client_final,
                     server_step, personal=True)
