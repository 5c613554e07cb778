"""The XLA path each Pallas kernel must match, as functions with the kernels' signatures.

Each is the codec's encode or decode-sum with ``implementation="xla"`` (the payload
arrays, and for error feedback the new residual ``(x + e) - decode``), so a kernel test
compares like with like. They live with the tests: the kernels import only low-level
helpers, never the codecs that dispatch to them.
"""

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs import base as codecs

Array = jax.Array
_F32 = jnp.float32


def quantize_reference(
  x: Array,
  key: Array,
  residual: Array | None = None,
  *,
  levels: int,
  bucket_size: int,
  norm: str = "max",
) -> tuple[Array, ...]:
  """The XLA path: :class:`jaxcomp.codecs.QSGD`'s encode (and decode for the residual)."""
  codec = codecs.QSGD(levels, bucket_size, norm, implementation="xla")
  if residual is None:
    p = codec.encode(x, key=key)
    return p.arrays["words"], p.arrays["scales"]
  x32 = x.astype(_F32) + residual
  p = codec.encode(x32.astype(x.dtype), key=key)
  return p.arrays["words"], p.arrays["scales"], x32 - codec.decode(p, _F32)


def sign_pack_reference(
  x: Array, residual: Array | None = None, *, bucket_size: int
) -> tuple[Array, ...]:
  """The XLA path: :class:`jaxcomp.codecs.OneBit`'s encode (and decode for the residual)."""
  codec = codecs.OneBit(bucket_size, implementation="xla")
  if residual is None:
    p = codec.encode(x)
    return p.arrays["words"], p.arrays["pos"], p.arrays["neg"]
  x32 = x.astype(_F32) + residual
  p = codec.encode(x32.astype(x.dtype))
  return p.arrays["words"], p.arrays["pos"], p.arrays["neg"], x32 - codec.decode(p, _F32)


def sign_unpack_sum_reference(
  words: Array, pos: Array, neg: Array, *, n: int, bucket_size: int
) -> Array:
  """The XLA path: :meth:`jaxcomp.codecs.OneBit.decode_sum` of the stacked payload."""
  codec = codecs.OneBit(bucket_size, implementation="xla")
  return codec.decode_sum(codecs.Payload({"words": words, "pos": pos, "neg": neg}, (n,), _F32))


def dequantize_sum_reference(
  words: Array, scales: Array, *, n: int, levels: int, bucket_size: int
) -> Array:
  """The XLA path: :meth:`jaxcomp.codecs.QSGD.decode_sum` of the stacked payload."""
  codec = codecs.QSGD(levels, bucket_size, "max", implementation="xla")
  return codec.decode_sum(codecs.Payload({"words": words, "scales": scales}, (n,), _F32))
