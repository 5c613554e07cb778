"""Quantized weight all-gather (ZeRO++'s qwZ): block int8 weights for the forward.

Under FSDP/ZeRO-3 each device holds a shard of every weight (cut along its first axis,
as ``P("data")`` cuts it) and all-gathers the full weight before using it. The gather is
the forward's traffic; sending the shards as round-to-nearest int8 with one float32
scale per block moves about a quarter of the bytes, deterministically (the same bits
on every step for the same weights, no key).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import _check_float
from jaxcomp._src.codecs.base import buckets
from jaxcomp._src.codecs.base import check_positive_int
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.plumbing.arith import row_absmax_finite
from jaxcomp._src.plumbing.arith import to_buckets
from jaxcomp._src.plumbing.phases import DECODE_SCOPE
from jaxcomp._src.plumbing.phases import ENCODE_SCOPE

Array = jax.Array
_F32 = jnp.float32
_QMAX = 127  # int8 codes in [-127, 127]: symmetric, -128 unused


@dataclasses.dataclass(frozen=True)
class BlockInt8(Codec):
  r"""Block-wise symmetric int8 quantization, round to nearest (ZeRO++'s qwZ).

  Each block ``v`` of ``block_size`` consecutive values of the flattened tensor (the
  last block shorter) is sent as int8 codes and one float32 scale:

  .. math::
    s = \max_i |v_i| / 127, \qquad q_i = \mathrm{round}(v_i / s) \in [-127, 127],
    \qquad \hat v_i = s \, q_i,

  so every decoded value is within ``s / 2 = max|v| / 254`` of its input (plus float32
  rounding of the division). It is deterministic and biased; for weights that is the
  point: the forward sees the same weights on every device and every call. A block
  holding a NaN or an infinity gets a NaN scale and decodes to NaN, never hidden.

  Wire format: ``n`` int8 codes and ``ceil(n / block_size)`` float32 scales, i.e.
  ``8 + 32 / block_size`` bits per value.

  Args:
    block_size: values per block (keyword or positional), 256 by default.

  Example:
    >>> import jax.numpy as jnp, jaxcomp as jc
    >>> codec = jc.codecs.BlockInt8(block_size=4)
    >>> codec.decode(codec.encode(jnp.array([1.27, -0.5, 0.0, 0.01]))).tolist()
    [1.2699999809265137, -0.5, 0.0, 0.009999999776482582]

  References:
    Wang et al. *ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training*. 2023. https://arxiv.org/abs/2306.10209 (qwZ, §3.1)
  """

  block_size: int = 256

  def __post_init__(self):
    check_positive_int(self.block_size, "block_size")

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key
    _check_float(x)
    n = x.size
    b, nb = buckets(n, self.block_size)
    v = to_buckets(x.reshape(-1).astype(_F32), b, nb)
    amax, finite = row_absmax_finite(v)
    scale = jnp.where(finite, amax / np.float32(_QMAX), jnp.nan)
    safe = jnp.where(finite & (amax > 0), scale, np.float32(1))
    q = jnp.clip(jnp.round(v / safe[:, None]), -_QMAX, _QMAX)
    codes = jnp.where(finite[:, None], q, 0.0).astype(jnp.int8).reshape(-1)[:n]
    return Payload({"codes": codes, "scales": scale}, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    b, nb = buckets(n, self.block_size)
    q = to_buckets(payload.arrays["codes"].astype(_F32), b, nb)
    return (q * payload.arrays["scales"][:, None]).reshape(-1)[:n]


#: The default codec of the weight all-gather (round to nearest: deterministic).
DEFAULT_WEIGHT_CODEC = BlockInt8()


def check_shards(shards, k: int, what: str = "shards") -> None:
  """A ``ValueError`` naming the leaf unless each leaf of ``shards`` is a floating-point
  array with a first axis (the axis ``P(axis_name)`` cuts)."""
  for path, x in jax.tree_util.tree_flatten_with_path(shards)[0]:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
        f"{what}{jax.tree_util.keystr(path)} must be a floating-point array, got dtype {dtype}"
      )
    if not jnp.ndim(x):
      raise ValueError(
        f"{what}{jax.tree_util.keystr(path)} is a scalar: shards are cut along their first "
        f"axis over the {k} devices, so each leaf needs one"
      )


def gather_leaves(codec: Codec | None, shards: list, axis_name, key: Array | None) -> list:
  """The full weights from this device's ``shards`` (a list), concatenated along axis 0.

  Every shard is encoded with ``codec``, all payloads go in one fused ``all_gather``
  (:func:`jaxcomp._src.exchanges.collectives.gather_tree`), and the K payloads of each leaf are
  decoded in rank order; ``codec=None`` gathers each leaf as it is (a tiled
  ``all_gather``, as dense FSDP does). The result is typed varying over the
  axis (no data movement): the loss differentiated with respect to it then gives each
  device its *local* gradient, not one already summed over devices.
  """
  k = collectives.axis_size(axis_name)
  if codec is None:
    # The float gather as dense FSDP writes it, one tiled all_gather per leaf: fused
    # into one buffer of words, the leaves would be copied in and out of it, a full
    # layer's extra copy at the peak of the step.
    return [lax.all_gather(x, axis_name, axis=0, tiled=True) for x in shards]
  keys = [None] * len(shards)
  if codec.needs_key:
    if key is None:
      raise ValueError(f"{type(codec).__name__} is stochastic: pass key=...")
    base = jax.random.fold_in(key, lax.axis_index(axis_name))
    keys = list(jax.random.split(base, len(shards)))
  with jax.named_scope(ENCODE_SCOPE):
    payloads = [codec.encode(x, key=kk) for x, kk in zip(shards, keys)]
  gathered = collectives.gather_tree(payloads, axis_name)
  out = []
  with jax.named_scope(DECODE_SCOPE):
    for x, g in zip(shards, gathered):
      parts = jax.vmap(lambda p: codec.decode(p, x.dtype))(g)
      out.append(parts.reshape((k * x.shape[0],) + x.shape[1:]))
  return collectives.vary(out, axis_name)


def _not_differentiable(*_):
  raise ValueError(
    "jc.gather_weights is not differentiated with respect to the shards: differentiate "
    "the loss with respect to the gathered weights (each device's full-size local "
    "gradient, for a transform with collective='reduce_scatter'), or gather inside the "
    "loss with jc.fsdp_gather, whose backward reduce-scatters the gradient"
  )


def gather_weights(shards, *, axis_name, codec: Codec | None = DEFAULT_WEIGHT_CODEC, key=None):
  """All-gathers parameter shards into full weights from a compressed payload (qwZ).

  Call inside ``jax.shard_map`` over ``axis_name``; each leaf of ``shards`` is this
  device's slice of a weight cut along its first axis (``P(axis_name)``), and comes back
  as the full weight ``(K·n0, ...)``, in the shard's dtype, the K slices in rank order.
  The bytes on the wire are the payload's arrays: int8 codes plus a float32 scale per
  block with the default :class:`BlockInt8` (``jc.wire_report`` and
  ``plumbing.collective_trace.collective_ops`` read them off the traced ``all_gather``).

  The result is typed varying over the axis, so ``jax.grad`` of the loss with respect
  to it is each device's *full-size local* gradient: hand it to a transform with
  ``collective="reduce_scatter"``, which returns this device's shard of the mean.
  Differentiating *through* this function with respect to the shards is refused
  (JAX would otherwise transpose the gather into a dense ``psum_scatter``); use
  :func:`jaxcomp.fsdp_gather` to reduce-scatter, compressed, inside the backward.

  Args:
    shards: a pytree of floating-point arrays, each this device's shard.
    axis_name: the data axis the shards are cut over.
    codec: the codec of the weights on the wire; :class:`~jaxcomp.codecs.BlockInt8`
      (round to nearest, deterministic) by default, ``None`` or
      :class:`~jaxcomp.codecs.Identity` for the exact full-precision gather, or any
      jaxcomp codec (a stochastic one needs ``key``).
    key: a PRNG key for stochastic codecs (folded with the device index).

  Returns:
    The full weights, a pytree like ``shards``.

  References:
    Wang et al. *ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training*. 2023. https://arxiv.org/abs/2306.10209
  """
  k = collectives.axis_size(axis_name)
  check_shards(shards, k)
  leaves, treedef = jax.tree.flatten(shards)

  def plain(xs, kk):
    return gather_leaves(codec, xs, axis_name, kk)

  gather = jax.custom_vjp(plain)
  gather.defvjp(lambda xs, kk: (plain(xs, kk), None), _not_differentiable)
  return treedef.unflatten(gather(leaves, key))
