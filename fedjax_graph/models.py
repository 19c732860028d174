"""Node classifiers: MLP, GCN and PMLP-GCN as one Flax module family.

The three backbones share their parameters' structure (a stack of linear
layers) and differ only in where GCN propagation happens:

  backbone   propagates in training   propagates at inference
  mlp        no                       no
  gcn        yes                      yes
  pmlp_gcn   no                       yes

(``sfpd``, FedSPA's typed-edge backbone, is its own module: ``sfpd.SFPD``.)

Each hidden layer computes, as PMLP's reference code (class ``PMLP_GCN``) does,

  h <- dropout(relu(batch_norm(propagate(h @ W) + b)))

(``h @ W + b`` where the layer does not propagate; bias after propagation, as
PyG's GCNConv). The batch norm has no scale or shift and no running
statistics: it always normalises with the statistics of the graph being
processed (the client's nodes in training, one domain's full graph at
inference), never of padding rows and never across domains (``groups``).
Without it the normalised propagation shrinks features to a fraction of their
norm per layer, the logits fall onto the bias and the model predicts one
class. ``norm="none"`` drops it. Weights are Xavier-uniform, biases zero.

References:
  Yang, Wu, Zhang, Xu, Zhang, Yan, "Graph Neural Networks are Inherently Good
  Generalizers: Insights by Bridging GNNs and MLPs" (PMLP), ICLR 2023,
  https://arxiv.org/abs/2212.09034, Sec. 3 (train as MLP, propagate at test).
  Kipf & Welling, "Semi-Supervised Classification with Graph Convolutional
  Networks", ICLR 2017.
  Ioffe & Szegedy, "Batch Normalization", ICML 2015 (eps 1e-5, biased
  variance, as torch.nn.BatchNorm1d(affine=False, track_running_stats=False)).
"""

import functools
import math
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_graph.graphs import Graph, propagate
from fedjax_graph.types import Array

class Backbone(NamedTuple):
  """Where a backbone propagates, and so what a client's training step needs of its shard.

  Attributes:
    propagate_train: propagate after each linear layer in training.
    propagate_eval: propagate after each linear layer at inference.
    training_input: ``graph`` (the padded client graph) or ``rows`` (node
      rows only: a backbone that does not propagate in training); room for
      ``sampled`` neighbourhoods (GraphSAGE) next. See
      ``simulation.make_training_input``.
    eval_labels: the forward reads training labels at inference too (SFPD's
      edge types): the evaluation graph is then given as an
      ``sfpd.LabelledGraph`` (the CSR graph with the clients' training labels).
    operator: propagates in training through the shard's ``operator``
      (``graphs.propagate``), so ``data.build_federation`` builds one per
      size bucket; the others would hold it unused (SFPD has its own typed
      propagation).
  """
  propagate_train: bool
  propagate_eval: bool
  training_input: str
  eval_labels: bool = False
  operator: bool = False


BACKBONES = {
    "mlp": Backbone(False, False, "rows"),
    "gcn": Backbone(True, True, "graph", operator=True),
    "pmlp_gcn": Backbone(False, True, "rows"),
    "sfpd": Backbone(True, True, "graph", eval_labels=True),
}
NORMS = ("batch", "none")
PRECISIONS = ("f32", "bf16")
"""Matmul input precisions of the dense layers (``GraphLinear``); parameters are always f32."""
BATCH_NORM_EPS = 1e-5


def batch_norm(h: Array, groups: Optional[Array] = None, num_groups: int = 1) -> Array:
  """Batch norm without scale or shift, with the statistics of each group of rows.

  Args:
    h: f32[N, H] node states.
    groups: i32[N] group of each row in [0, num_groups]; rows with id
      ``num_groups`` (padding) take no part in any statistic and come out 0
      (also their gradient). None: all rows are one group.
    num_groups: G, static.

  Returns:
    f32[N, H]: per group (h - mean) / sqrt(var + 1e-5), biased variance.
  """
  if groups is None:
    groups, num_groups = jnp.zeros(h.shape[0], jnp.int32), 1
  return _batch_norm(num_groups, h, groups)


# The gradient in closed form (Ioffe & Szegedy, Sec. 3) instead of autodiff:
# per group, dh = inv_std * (g - mean(g) - xhat * mean(g * xhat)). Autodiff of
# the forward pass runs several more passes over [N, H]; this halves the batch
# norm's share of a local step (measured on Twitch S3, PMLP-GCN).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _batch_norm(num_groups: int, h: Array, groups: Array) -> Array:
  return _batch_norm_fwd(num_groups, h, groups)[0]


def _group_ops(num_groups: int, groups: Array, dtype):
  """(mean over each group's rows [N, H] -> [G, H], spread of [G, H] back to rows, 0 on padding)."""
  # Statistics as [G, N] @ [N, H] products: far faster than scatters or
  # reductions over rows on a CPU.
  member_t = (jnp.arange(num_groups)[:, None] == groups).astype(dtype)  # [G, N]
  count = jnp.maximum(jnp.sum(member_t, axis=1), 1.0)[:, None]
  mean = lambda a: member_t @ a / count
  if num_groups == 1:  # every client's training rows: one domain, a broadcast
    return mean, lambda table: member_t[0][:, None] * table
  return mean, lambda table: jnp.concatenate([table, jnp.zeros_like(table[:1])])[groups]


def _batch_norm_fwd(num_groups, h, groups):
  mean, spread = _group_ops(num_groups, groups, h.dtype)
  centred = h - spread(mean(h))
  inv_std = spread(jax.lax.rsqrt(mean(jnp.square(centred)) + BATCH_NORM_EPS))  # 0 on padding
  xhat = centred * inv_std
  return xhat, (xhat, inv_std, groups)


def _batch_norm_bwd(num_groups, residuals, g):
  xhat, inv_std, groups = residuals
  mean, spread = _group_ops(num_groups, groups, g.dtype)
  return inv_std * (g - spread(mean(g)) - xhat * spread(mean(g * xhat))), None


_batch_norm.defvjp(_batch_norm_fwd, _batch_norm_bwd)


def dropout_keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
  """Bernoulli keep mask bool[shape] with P(drop) = ``effective_rate(rate)``.

  Each unit reads only the b bits it needs from packed 32-bit random words, b
  the fewest of 1, 2, 4, 8, 16 that represent ``rate`` exactly (1 bit for 0.5),
  instead of one 32-bit draw per unit as ``jax.random.bernoulli`` does.
  Drawing dropout masks is otherwise the single largest cost of local training
  on a CPU (measured: 26x faster than ``bernoulli`` at rate 0.5).
  """
  bits = _bits_per_unit(rate)
  per_word = 32 // bits
  size = math.prod(shape)
  words = jax.random.bits(key, (-(-size // per_word),), jnp.uint32)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  units = (words[:, None] >> shifts) & jnp.uint32(2**bits - 1)
  return units.reshape(-1)[:size].reshape(shape) >= round(rate * 2**bits)


def _bits_per_unit(rate: float) -> int:
  for bits in (1, 2, 4, 8):
    if float(rate * 2**bits).is_integer():
      return bits
  return 16


def effective_rate(rate: float) -> float:
  """The drop probability ``dropout_keep_mask`` realises: ``rate`` rounded to b bits."""
  bits = _bits_per_unit(rate)
  return round(rate * 2**bits) / 2**bits


def dense(h: Array, kernel: Array, precision: str = "f32") -> Array:
  """``h @ kernel`` f32[..., N, H'] for h f32[..., N, H] and kernel f32[H, H'].

  ``precision="bf16"`` casts both inputs to bfloat16 and accumulates in f32
  (``preferred_element_type``), the mixed precision of accelerators' matrix
  units (Micikevicius et al., "Mixed Precision Training", ICLR 2018,
  https://arxiv.org/abs/1710.03740, Sec. 3: low-precision products,
  f32 master weights and accumulation). The gradients of ``h`` and the
  kernel are f32 arrays holding bfloat16-rounded values (the cast's
  transpose), as with flax's ``nn.Dense(dtype=jnp.bfloat16)``; the f32
  parameters take them. ``"f32"`` is the plain product.

  Raises:
    ValueError: for a precision not in ``PRECISIONS``.
  """
  if precision == "f32":
    return h @ kernel
  if precision == "bf16":
    return jnp.matmul(h.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
  raise ValueError(f"Unsupported precision: {precision!r}; choose one of {list(PRECISIONS)}")


class GraphLinear(nn.Module):
  """``propagate(h @ W) + b`` (or ``h @ W + b`` without a graph).

  ``precision``: of the product ``h @ W`` (``dense``); propagation, bias and
  parameters stay f32.
  """
  features: int
  precision: str = "f32"

  @nn.compact
  def __call__(self, h: Array, graph: Optional[Graph]) -> Array:
    kernel = self.param("kernel", nn.initializers.xavier_uniform(), (h.shape[-1], self.features))
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
    matmul = lambda a: dense(a, kernel, self.precision)
    if graph is None:
      return matmul(h) + bias
    # Propagation is linear, A(hW) = (Ah)W: propagate the narrower side. When h
    # is the input features shared by a vmapped batch of models, Ah is then
    # computed once for the whole batch.
    if h.shape[-1] <= self.features:
      return matmul(propagate(h, graph)) + bias
    return propagate(matmul(h), graph) + bias


class NodeClassifier(nn.Module):
  """``num_layers`` linear layers with batch norm, ReLU and dropout between them.

  Attributes:
    num_classes: K.
    hidden: width of the hidden layers.
    num_layers: linear layers in total (the last is the classifier).
    dropout: drop rate applied after each hidden activation in training
      (realised as ``effective_rate(dropout)``: exact for 0.5).
    propagate_train: propagate after each linear layer in training.
    propagate_eval: propagate after each linear layer at inference.
    norm: ``batch`` (batch norm after each hidden layer) or ``none``.
    precision: ``f32`` or ``bf16``, the dense layers' matmul inputs
      (``dense``); parameters, batch norm and propagation stay f32.
    one_domain_train: in training, the rows given belong to one domain (or
      are left out), as every client's of a partition
      (``data.Federation.one_domain_clients``):
      the batch norm takes all rows of a group below ``num_groups`` as one
      group, the same statistics at a fraction of the cost.
  """
  num_classes: int
  hidden: int = 128
  num_layers: int = 3
  dropout: float = 0.5
  propagate_train: bool = False
  propagate_eval: bool = True
  norm: str = "batch"
  precision: str = "f32"
  one_domain_train: bool = False

  @nn.compact
  def __call__(self, x: Array, graph: Optional[Graph], train: bool, deterministic: bool = False,
               with_hidden: bool = False, groups: Optional[Array] = None, num_groups: int = 1):
    """Logits f32[N, K] for node features ``x`` f32[N, F].

    ``graph`` may be None when this configuration does not propagate (then the
    rows of ``x`` are treated as independent nodes). ``train`` selects the
    training-time architecture (propagation as ``propagate_train``) and
    dropout; ``deterministic`` turns dropout off (e.g. for MOON's frozen
    models). Needs the ``dropout`` rng when dropout is on. With
    ``with_hidden``, returns ``(hidden f32[N, H], logits)``: ``hidden`` is the
    classifier's input before dropout (the node representation).
    ``groups`` i32[N] and ``num_groups`` (static) say over which rows the
    batch norm takes its statistics (see ``batch_norm``; padding rows carry
    ``num_groups``); None: all rows.
    """
    propagates = self.propagate_train if train else self.propagate_eval
    if propagates and graph is None:
      raise ValueError("this backbone propagates here and needs a graph, got None")
    graph = graph if propagates else None
    if train and self.one_domain_train and groups is not None:
      groups, num_groups = jnp.where(groups < num_groups, 0, 1), 1
    h = hidden = x
    for i in range(self.num_layers - 1):
      h = GraphLinear(self.hidden, self.precision, name=f"layer_{i}")(h, graph)
      if self.norm == "batch":
        h = batch_norm(h, groups, num_groups)
      h = hidden = nn.relu(h)
      if train and not deterministic and self.dropout > 0:
        keep = dropout_keep_mask(self.make_rng("dropout"), h.shape, self.dropout)
        h = jnp.where(keep, h / (1 - effective_rate(self.dropout)), 0.0)
    logits = GraphLinear(self.num_classes, self.precision,
                         name=f"layer_{self.num_layers - 1}")(h, graph)
    return (hidden, logits) if with_hidden else logits


def make_model(name: str, num_classes: int, hidden: int = 128, num_layers: int = 3,
               dropout: float = 0.5, norm: str = "batch",
               precision: str = "f32") -> NodeClassifier:
  """The backbone called ``name`` (one of ``BACKBONES``) with ``norm`` (one of ``NORMS``).

  ``sfpd`` is an ``sfpd.SFPD`` (same call signature), which has no batch norm
  and only f32. ``precision``: one of ``PRECISIONS`` (``NodeClassifier``).

  Raises:
    ValueError: for an unknown name, norm or precision, listing the supported
      ones, or ``sfpd`` with a norm other than ``none`` or a precision other
      than ``f32``.
  """
  if name not in BACKBONES:
    raise ValueError(f"Unsupported model: {name!r}; choose one of {sorted(BACKBONES)}")
  if norm not in NORMS:
    raise ValueError(f"Unsupported norm: {norm!r}; choose one of {list(NORMS)}")
  if precision not in PRECISIONS:
    raise ValueError(f"Unsupported precision: {precision!r}; choose one of {list(PRECISIONS)}")
  if name == "sfpd":
    from fedjax_graph import sfpd  # sfpd imports this module
    if norm != "none":
      raise ValueError(f"Unsupported norm for sfpd: {norm!r}; SFPD has none "
                       "(norm: none, --norm none on the command line)")
    if precision != "f32":
      raise ValueError(f"Unsupported precision for sfpd: {precision!r}; SFPD is f32 only")
    return sfpd.SFPD(num_classes=num_classes, hidden=hidden, num_layers=num_layers,
                     dropout=dropout)
  propagate_train, propagate_eval = BACKBONES[name][:2]
  return NodeClassifier(num_classes=num_classes, hidden=hidden, num_layers=num_layers,
                        dropout=dropout, propagate_train=propagate_train,
                        propagate_eval=propagate_eval, norm=norm, precision=precision)


def predict(model: NodeClassifier, params, x: Array, graph: Graph,
            groups: Optional[Array] = None, num_groups: int = 1) -> Array:
  """Class predictions i32[N] of a model for features f32[N, F] (inference).

  ``groups``/``num_groups``: the batch-norm groups, e.g. each node's domain
  (``NodeClassifier.__call__``).
  """
  return jnp.argmax(model.apply(params, x, graph, train=False, groups=groups,
                                num_groups=num_groups), axis=-1)
