"""Quantized weight all-gather (ZeRO++'s qwZ): block int8 weights for the forward.

Under FSDP/ZeRO-3 each device holds a shard of every weight (cut along its first axis,
as ``P("data")`` cuts it) and all-gathers the full weight before using it. The gather is
the forward's traffic; sending the shards as round-to-nearest int8 with one float32
scale per block moves about a quarter of the bytes, deterministically (the same bits
on every step for the same weights, no key). The forward then computes with rounded
weights, so the int8 gather is the caller's choice (``codec=BlockInt8()``), as ZeRO++
makes qwZ opt-in; by default the gather is exact.
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
from jaxcomp._src.plumbing import treeutil
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

  so every value decoded in float32 is within ``s / 2 = max|v| / 254`` of its input
  (plus float32 rounding of the division). Decoded to a narrower dtype, ``s q_i`` is
  then rounded to it: for bfloat16 (8 significant bits) the error bound is
  ``s / 2 + 2^{-8} |s q_i|``, at most ``s / 2 + 127 s / 256``, just under one step
  ``s`` at the block's largest values (no decode can do better in general: the nearest
  bfloat16 to ``s q_i`` is all that dtype can hold). It is deterministic and biased;
  for weights that is the point: the forward sees the same weights on every device and
  every call. A block holding a NaN or an infinity gets a NaN scale and decodes to NaN,
  never hidden.

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


def compressed_leaves(filter_fn, shards, k: int) -> tuple[bool, ...]:
  """For each leaf of ``shards``, whether ``filter_fn`` compresses it (a static tuple).

  The filter (``None``: :func:`jaxcomp.default_filter`) is asked of the *full* weight,
  ``(K·n0, ...)`` in the shard's dtype, so a leaf is compressed or not whatever the
  number of devices cuts it into: a bias of 1024 values stays a bias on 8 devices.
  """
  fn = treeutil.default_filter if filter_fn is None else filter_fn
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(shards)[0]:
    full = jax.ShapeDtypeStruct((k * x.shape[0],) + tuple(x.shape[1:]), x.dtype)
    out.append(treeutil.selected(fn, path, full))
  return tuple(out)


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


def gather_leaves(
  codec: Codec | None, shards: list, axis_name, key: Array | None, compressed: tuple[bool, ...]
) -> list:
  """The full weights from this device's ``shards`` (a list), concatenated along axis 0.

  The shards ``compressed`` marks are encoded with ``codec``; their payloads and the
  other shards, as they are, go in one fused ``all_gather``
  (:func:`jaxcomp._src.exchanges.collectives.gather_tree`, exactly their bytes), and the
  K payloads of each leaf are decoded in rank order. With no leaf to compress
  (``codec=None``, or the filter leaves every one out) each leaf is gathered as it is,
  one tiled ``all_gather`` each, as dense FSDP does. The result is typed varying over
  the axis (no data movement): the loss differentiated with respect to it then gives
  each device its *local* gradient, not one already summed over devices.
  """
  k = collectives.axis_size(axis_name)
  if codec is None or not any(compressed):
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
    # The leaves left dense ride in the same collective (one latency, not two); they
    # are small by the filter's choice, so copying them into its buffer costs nothing.
    sent = [codec.encode(x, key=kk) if c else x for x, kk, c in zip(shards, keys, compressed)]
  gathered = collectives.gather_tree(sent, axis_name)
  out = []
  with jax.named_scope(DECODE_SCOPE):
    for x, g, c in zip(shards, gathered, compressed):
      parts = jax.vmap(lambda p, x=x: codec.decode(p, x.dtype))(g) if c else g
      out.append(parts.reshape((k * x.shape[0],) + x.shape[1:]))
  return collectives.vary(out, axis_name)


def _not_differentiable(*_):
  raise ValueError(
    "jc.gather_weights is not differentiated with respect to the shards: differentiate "
    "the loss with respect to the gathered weights (each device's full-size local "
    "gradient, for a transform with collective='reduce_scatter'), or gather inside the "
    "loss with jc.fsdp_gather, whose backward reduce-scatters the gradient"
  )


def gather_weights(shards, *, axis_name, codec: Codec | None = None, key=None, filter=None):  # pylint: disable=redefined-builtin
  """All-gathers parameter shards into full weights, exactly or from a compressed payload.

  Call inside ``jax.shard_map`` over ``axis_name``; each leaf of ``shards`` is this
  device's slice of a weight cut along its first axis (``P(axis_name)``), and comes back
  as the full weight ``(K·n0, ...)``, in the shard's dtype, the K slices in rank order.
  By default the gather is exact (``lax.all_gather(tiled=True)``, bit for bit dense
  FSDP's). ``codec=jc.codecs.BlockInt8()`` sends int8 codes plus a float32 scale per
  block instead (ZeRO++'s qwZ, about a quarter of float32's bytes), and the forward
  computes with weights rounded to within the codec's bound; ``jc.wire_report`` and
  ``plumbing.collective_trace.collective_ops`` read the bytes off the traced
  ``all_gather``. Leaves that ``filter`` leaves out (by default biases, norms' scales,
  every leaf under 1024 values) are gathered as they are, in the same collective: for
  them, a payload's per-block scales would cost more than they save.

  The result is typed varying over the axis, so ``jax.grad`` of the loss with respect
  to it is each device's *full-size local* gradient: hand it to a transform with
  ``collective="reduce_scatter"``, which returns this device's shard of the mean.
  Differentiating *through* this function with respect to the shards is refused
  (JAX would otherwise transpose the gather into a dense ``psum_scatter``); use
  :func:`jaxcomp.fsdp_gather` to reduce-scatter, compressed, inside the backward.

  Args:
    shards: a pytree of floating-point arrays, each this device's shard.
    axis_name: the data axis the shards are cut over.
    codec: the codec of the weights on the wire: ``None`` (the default) or
      :class:`~jaxcomp.codecs.Identity` for the exact full-precision gather,
      :class:`~jaxcomp.codecs.BlockInt8` (round to nearest, deterministic) for qwZ, or
      any jaxcomp codec (a stochastic one needs ``key``).
    key: a PRNG key for stochastic codecs (folded with the device index).
    filter: ``filter(path, leaf) -> bool``, which leaves ``codec`` compresses, asked of
      the full weight's shape and dtype (``jax.ShapeDtypeStruct``, not the shard's);
      ``None`` is :func:`jaxcomp.default_filter`, as for :func:`jaxcomp.compress`.

  Returns:
    The full weights, a pytree like ``shards``.

  References:
    Wang et al. *ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training*. 2023. https://arxiv.org/abs/2306.10209
  """
  k = collectives.axis_size(axis_name)
  check_shards(shards, k)
  leaves, treedef = jax.tree.flatten(shards)
  compressed = compressed_leaves(filter, shards, k)

  def plain(xs, kk):
    return gather_leaves(codec, xs, axis_name, kk, compressed)

  gather = jax.custom_vjp(plain)
  gather.defvjp(lambda xs, kk: (plain(xs, kk), None), _not_differentiable)
  return treedef.unflatten(gather(leaves, key))
