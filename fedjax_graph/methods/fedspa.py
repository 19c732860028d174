"""FedSPA: an SFPD backbone and homophily-bias-driven aggregation (HBDA).

References:
  Y. Tan, G. Wan, W. Huang, H. Li, X. Zhang, Y. Yang, M. Ye, "FedSPA:
  Generalizable Federated Graph Learning under Homophily Heterogeneity",
  CVPR 2025, pp. 15464-15475; code OakleyTan/FedSPA
  (Code/flgo/algorithm/fedspa.py: HBDA and the Fisher; Code/benchmark001/
  config.py: SFPD). FGL_METHODS.md §5.
"""

import jax
import jax.numpy as jnp

from fedjax_graph.config import Config
from fedjax_graph.methods import base
from fedjax_graph.models import NodeClassifier
from fedjax_graph.sfpd import ATTENTION_GROUPS, NEIGHBOURS
from fedjax_graph.types import Array, PyTree

MINMAX_EPS = 1e-12


def homophily_proxy(x: Array, senders: Array, receivers: Array, rate: float,
                    key: Array) -> Array:
  """The homophily proxy S f32[] of one client's graph (FedSPA, HBDA; ``calculate_shigh``).

  The mean over a random ``rate`` share of the feature columns with
  ``x^T x != 0`` (``max(1, round(rate * count))`` of them, drawn with
  ``key``) of the Rayleigh quotient ``x^T (D - A) x / x^T x``, with
  ``x^T (D - A) x = 1/2 sum_{u -> v} (x_u - x_v)^2`` over the directed edges
  (every edge comes in both directions). 0 when no column qualifies.

  Args:
    x: f32[N, F] node features; padding rows are 0.
    senders, receivers: i32[E] directed edges; padding edges join padding
      rows (0 features), so they add nothing.
    rate: share of the qualifying columns, in (0, 1] (static).
    key: the column draw's PRNG key (fixed: the same columns every round).
  """
  squares = jnp.sum(x * x, axis=0)  # [F]
  dirichlet = 0.5 * jnp.sum(jnp.square(x[senders] - x[receivers]), axis=0)
  valid = squares > 0
  count = jnp.maximum(1, jnp.round(rate * jnp.sum(valid)))
  order = jnp.argsort(jnp.where(valid, jax.random.uniform(key, squares.shape), jnp.inf))
  rank = jnp.zeros(squares.shape, jnp.int32).at[order].set(jnp.arange(squares.shape[0]))
  chosen = valid & (rank < count)
  ratio = dirichlet / jnp.where(valid, squares, 1.0)
  return jnp.sum(jnp.where(chosen, ratio, 0.0)) / jnp.maximum(jnp.sum(chosen), 1)


def minmax(values: Array, active: Array) -> Array:
  """``(v - min) / max(max - min, 1e-12)`` over the ``active`` entries of f32[C] (0 if all equal)."""
  low = jnp.min(jnp.where(active, values, jnp.inf))
  high = jnp.max(jnp.where(active, values, -jnp.inf))
  return jnp.where(active, (values - low) / jnp.maximum(high - low, MINMAX_EPS), 0.0)


def softmin_weights(values: Array, active: Array) -> Array:
  """``exp(-minmax(v)_k) / sum_j exp(-minmax(v)_j)`` over ``active`` f32[C]; 0 elsewhere."""
  e = jnp.where(active, jnp.exp(-minmax(values, active)), 0.0)  # exponents in [-1, 0]
  return e / jnp.maximum(jnp.sum(e), 1e-30)


def fisher_distance(fisher: tuple[Array, ...], active: Array) -> Array:
  """delta_k f32[C] = sum over the group's tensors of ||F_k - mean_{j active} F_j||_1, over sum delta.

  0 for clients not ``active``; all 0 (not NaN) when every active Fisher is
  the same.
  """
  flat = jnp.concatenate([f.reshape(f.shape[0], -1) for f in fisher], axis=1)
  flat = jnp.where(active[:, None], flat, 0.0)
  mean = jnp.sum(flat, axis=0) / jnp.maximum(jnp.sum(active), 1)
  delta = jnp.where(active, jnp.sum(jnp.abs(flat - mean), axis=1), 0.0)
  return delta / jnp.maximum(jnp.sum(delta), 1e-30)


def hbda_weights(fisher: dict, homophily: Array, participating: Array) -> dict:
  """HBDA's client weights per parameter group (FedSPA, Sec. 3.3; FGL_METHODS.md §5(d)).

  Args:
    fisher: ``{"fr": tuple, "be": tuple}`` of every client's diagonal Fisher
      of the group's attention vectors, leaves f32[C, ...].
    homophily: f32[C] the clients' homophily proxies S_k.
    participating: bool[C]; only these count, in every min, max, mean and
      softmax (the code indexes all clients there: its ``weights2`` bug).

  Returns:
    ``{"fr", "be", "rest"}``, each f32[C] summing to 1 over the participants
    (0 for the others): per group G ``softmax(-minmax(delta^G))`` with
    ``delta^G`` of ``fisher_distance``, and for every other parameter
    ``softmax(-minmax(|S|))``. Equal inputs give uniform weights.
  """
  weights = {group: softmin_weights(fisher_distance(fisher[group], participating),
                                    participating) for group in ATTENTION_GROUPS}
  return {**weights, "rest": softmin_weights(jnp.abs(homophily), participating)}


def attention_fisher(grads: PyTree) -> dict:
  """``{"fr": tuple, "be": tuple}``: the squared gradients of each group's attention vectors, layer by layer."""
  layers = grads["params"]
  return {group: tuple(jnp.square(layers[layer][name]) for layer in sorted(layers)
                       for name in names)
          for group, names in ATTENTION_GROUPS.items()}


def leaf_groups(params: PyTree) -> PyTree:
  """The HBDA group (``fr``, ``be`` or ``rest``) of every leaf of SFPD's params, by exact name."""
  def group(path, leaf):
    name = path[-1].key
    return next((g for g, names in ATTENTION_GROUPS.items() if name in names), "rest")
  return jax.tree_util.tree_map_with_path(group, params)


def fedspa(model: NodeClassifier, config: Config, hbda: bool = True, proxy_rate: float = 0.2,
           proxy_seed: int = 0, hidden: int = 128, num_layers: int = 2, dropout: float = 0.1,
           neighbours: str = "mean", weights: str = "uniform") -> base.Method:
  """FedSPA (Tan et al., CVPR 2025): the SFPD backbone, uploads for HBDA, HBDA.

  Client: the plain cross-entropy on its training nodes (the method lives in
  the backbone and the server), on its own backbone SFPD (``sfpd.SFPD``;
  ``recipe``: ``hidden``, ``num_layers``, ``dropout``, no norm). The local
  recipe stays the dataset's (the house keeps one per dataset; FedSPA's own
  is SGD lr 0.1, 4 steps per round). ``neighbours`` (``model_options``,
  ``sfpd.SFPD.neighbours``): ``mean`` (default) weights each typed
  neighbour sum by A_lo's 1/(deg_v + 1); ``sum`` keeps the code's
  unnormalised sums (``agg_func_spa``, ``.sum(1)``; the paper gives no
  scale). ``mean`` departs from the code because ``sum`` collapses on
  WikiNet: logits ~1e7 and one class predicted per domain (issue 11).

  Upload, besides the model update (extra payload: FedIA's Table 1 calls
  FedSPA's exchange standard, but its server reads these from the clients'
  data, which a federated client must upload instead): ``{"homophily":
  f32[], "fisher": {"fr": tuple, "be": tuple}}``, 1 + 2 * sum over layers of
  2 * width floats (533 for 2 layers, hidden 128, 5 classes):

    * S_k, ``homophily_proxy`` of the client's own features and edges, a
      fixed ``proxy_rate`` share of the columns drawn with
      ``PRNGKey(proxy_seed)`` (the same columns for every client and round;
      S_k depends on nothing else, so it is the same value each round: it
      is recomputed in ``client_final``, a cheap product, instead of kept);
    * the diagonal Fisher ``(d mean_{i in T} log p(y_i) / d theta)^2`` of the
      attention vectors of the fr and be groups (``sfpd.ATTENTION_GROUPS``),
      at the client's final local model, on its TRAINING nodes only (the
      code uses every node's label, test nodes included), without dropout
      (the code leaves the module in training mode).

  Server (HBDA, ``hbda_weights`` over the round's participants): each
  tensor is the weighted mean of the clients' models with its group's
  weights, i.e. W <- W - eta * sum_k w_k^G u_k. Composition with an
  aggregator (``Method.leaf_weights``): the base cell is FedAvg with uniform
  base weights times the HBDA weights, renormalised per tensor: exactly
  HBDA. "FedSPA + FedIA": FedIA's mask and CAM, with tensor ``l`` aggregated
  by ``alpha_k w_k^{G(l)}`` renormalised per tensor (alpha's momentum
  state is FedIA's own). ``hbda=False`` (registered as ``fedspa_nohbda``)
  supplies no weights: its base cell is the uniform mean (FedSPA with HBDA
  off) and its "+FedIA" cell is "FedIA (repl.)", FedIA in place of HBDA;
  its clients upload nothing besides the update.

  Where this departs from the code (FGL_METHODS.md §5(h)): the clients
  compute S_k and the Fisher and upload them; only participants enter the
  weights; minmax divides by max(max - min, 1e-12), so equal values give
  uniform weights; the sum normalisation of delta is guarded the same way;
  groups are chosen by exact parameter names. ``weights`` is accepted for
  the house's interface and must be ``uniform`` (HBDA makes the weights).

  Raises:
    ValueError: for ``proxy_rate`` outside (0, 1], a non-positive width or
      depth, a dropout outside [0, 1), ``neighbours`` other than mean or
      sum, or ``weights`` other than uniform.
  """
  name = "fedspa" if hbda else "fedspa_nohbda"
  base.check(0 < proxy_rate <= 1, name, "proxy_rate", proxy_rate, "in (0, 1]")
  base.check(hidden >= 1 and num_layers >= 1, name, "hidden/num_layers",
             (hidden, num_layers), "integers >= 1")
  base.check(0 <= dropout < 1, name, "dropout", dropout, "in [0, 1)")
  base.check(neighbours in NEIGHBOURS, name, "neighbours", neighbours,
             "'mean' (typed sums weighted by 1/(deg + 1)) or 'sum' (unnormalised, the code's)")
  base.check(weights == "uniform", name, "weights", weights,
             "'uniform' (HBDA makes the client weights)")
  proxy_key = jax.random.PRNGKey(proxy_seed)

  def log_likelihood(params, ctx):
    logits = model.apply(params, ctx.x, ctx.graph, train=True, deterministic=True)
    log_p = jnp.take_along_axis(jax.nn.log_softmax(logits), ctx.y[:, None], axis=1)[:, 0]
    return base.masked_mean(log_p, ctx.train_mask)

  def client_final(ctx, params, update):
    if not hbda:  # nothing for the server to weigh with: the standard exchange
      return ctx.client_state, ()
    graph = ctx.graph
    upload = {"homophily": homophily_proxy(ctx.x, graph.senders, graph.receivers, proxy_rate,
                                           proxy_key),
              "fisher": attention_fisher(jax.grad(log_likelihood)(params, ctx))}
    return ctx.client_state, upload

  def leaf_weights(params, uploads, participating):
    per_group = hbda_weights(uploads["fisher"], uploads["homophily"], participating)
    return jax.tree.map(lambda group: per_group[group], leaf_groups(params))

  return base.Method(
      name,
      {"hbda": hbda, "proxy_rate": proxy_rate, "proxy_seed": proxy_seed, "hidden": hidden,
       "num_layers": num_layers, "dropout": dropout, "neighbours": neighbours,
       "weights": weights},
      True, base.stateless, base.nothing, base.no_loss, client_final,
      base.descent_step(config), leaf_weights=leaf_weights if hbda else None,
      recipe={"backbone": "sfpd", "norm": "none", "hidden": hidden, "num_layers": num_layers,
              "dropout": dropout},
      model_options={"neighbours": neighbours})


def fedspa_nohbda(model: NodeClassifier, config: Config, proxy_rate: float = 0.2,
                  proxy_seed: int = 0, hidden: int = 128, num_layers: int = 2,
                  dropout: float = 0.1, neighbours: str = "mean",
                  weights: str = "uniform") -> base.Method:
  """FedSPA with HBDA off (``fedspa(hbda=False)``): alone, the uniform mean; "+FedIA" is "FedIA (repl.)"."""
  return fedspa(model, config, False, proxy_rate, proxy_seed, hidden, num_layers, dropout,
                neighbours, weights)
