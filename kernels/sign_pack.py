r"""1-bit SGD in one pass: sign bits and per-bucket positive/negative means.

Per bucket ``v`` of ``bucket_size`` values (Seide et al. 2014):

.. math::
  \mathrm{bit}_i = [v_i < 0], \qquad
  \mu^+ = \mathrm{mean}\{v_i : v_i \ge 0\}, \qquad \mu^- = \mathrm{mean}\{v_i : v_i < 0\},

signs packed 32 per uint32 word (bit ``i`` of word ``g`` is value ``32 g + i``) and the
two means in float32: exactly :class:`jaxcomp.codecs.OneBit`'s payload. With
``residual=e`` the kernel also fuses the error feedback of :func:`jaxcomp.onebit_sgd`:
it encodes ``v = fl_{dtype}(x + e)`` and returns ``e' = (x + e) - Q(v)``.

The sign words are bit-identical to :func:`sign_pack_reference`; the means are sums
taken in another order than XLA's, so they agree to float32 rounding (a few ulp), not
bit for bit.

:func:`sign_unpack_sum` is the receiving side: the sum of K gathered payloads decoded
in one pass, in rank order, like :meth:`OneBit.decode_sum <jaxcomp.codecs.Codec.decode_sum>`.

Reference: Seide, Fu, Droppo, Li, Yu, *1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs*, Interspeech 2014,
https://www.isca-archive.org/interspeech_2014/seide14_interspeech.html: Section 3 (the
1-bit quantizer with error feedback).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from . import _common
from . import _mosaic

Array = jax.Array
_F32 = jnp.float32
_U32 = jnp.uint32

SignPackConfig = _common.LaunchConfig

DTYPES = _common.DTYPES


def unsupported(n: int, *, bucket_size: int | None, dtype=jnp.float32) -> str | None:
  """Why the kernels cannot handle this tensor (``None`` when it can); see
  :func:`~jaxcomp.kernels._common.unsupported_bucketing`."""
  return _common.unsupported_bucketing(n, bucket_size, dtype)


def _sign_pack_kernel(x_ref, *refs, n, bucket, rows, exact_asm, has_residual):
  if has_residual:
    e_ref, words_ref, pos_ref, neg_ref, new_e_ref = refs
  else:
    (words_ref, pos_ref, neg_ref), e_ref = refs, None
  length = rows * bucket
  start, _, v, x32 = _common.load_buckets(x_ref, e_ref, n=n, rows=rows, bucket=bucket)
  neg = v < 0

  # Values of this bucket that exist (the last bucket is short): clip(n - first, 0, b).
  first = lax.broadcasted_iota(jnp.int32, (rows,), 0) * bucket + start
  count = jnp.clip(n - first, 0, bucket).astype(_F32)
  neg_count = jnp.sum(neg.astype(_F32), axis=1)
  pos_count = count - neg_count
  pos_part, neg_part = jnp.maximum(v, 0.0), jnp.minimum(v, 0.0)
  # The scaled sums too (cheap next to the loads): used where a plain sum overflowed.
  shift = _common.sum_shift(bucket)
  down = np.float32(2.0**-shift)

  def mean(part, c):
    return _common.side_mean(
      jnp.sum(part, axis=1), jnp.sum(part * down, axis=1), c, shift, exact_asm=exact_asm
    )

  pos = mean(pos_part, pos_count)
  negm = mean(neg_part, neg_count)
  lanes = neg.astype(_U32).reshape(length // 32, 32)
  shifts = lax.broadcasted_iota(_U32, lanes.shape, 1)
  words_ref[...] = jnp.sum(lanes << shifts, axis=1, dtype=_U32)
  pos_ref[...] = pos
  neg_ref[...] = negm
  if has_residual:
    sent = jnp.where(neg, negm[:, None], pos[:, None])
    new_e_ref[...] = (x32 - sent).reshape(length)


@functools.partial(jax.jit, static_argnames=("bucket_size", "config", "interpret", "backend"))
def sign_pack(
  x: Array,
  residual: Array | None = None,
  *,
  bucket_size: int,
  config: SignPackConfig = SignPackConfig(),
  interpret: bool | None = None,
  backend: str | None = None,
) -> tuple[Array, ...]:
  """Packs the signs of ``x`` and computes its per-bucket means, in one pass.

  Args:
    x: float32/bfloat16/float16 array (flattened row-major).
    residual: optional float32 error-feedback residual of ``x``'s shape.
    bucket_size: values per bucket, a power of two in 32..65536.
    config: block size and Triton launch parameters (the Triton kernel's).
    interpret: run in Pallas interpret mode (default: unless on a CUDA GPU).
    backend: ``"mosaic_gpu"``, ``"triton"`` or ``None`` (see
      :func:`jaxcomp.kernels.quantize.quantize`).

  Returns:
    ``(words, pos, neg)``: uint32 ``(ceil(n / 32),)`` and float32
    ``(ceil(n / bucket_size),)`` twice; plus the new float32 residual when ``residual``
    is given.
  """
  n = x.size
  why = unsupported(n, bucket_size=bucket_size, dtype=x.dtype)
  if why is not None:
    raise ValueError(f"the sign_pack kernel does not handle this input: {why}")
  interpret = _common.resolve_interpret(interpret)
  _common.check_interpretable(interpret, x, residual)
  misfit = _mosaic.misfit(n, 1, bucket_size)
  if _common.pick_backend(misfit, interpret=interpret, backend=backend) == "mosaic_gpu":
    _common.check_residual(x, residual)
    return _mosaic.sign_pack(
      x, residual, bucket=bucket_size, out_struct=_common.out_struct, interpret=interpret
    )
  rows = config.rows(bucket_size)
  nb = -(-n // bucket_size)
  kernel = functools.partial(
    _sign_pack_kernel,
    n=n,
    bucket=bucket_size,
    rows=rows,
    exact_asm=not interpret,
    has_residual=residual is not None,
  )
  return _common.call_encoder(
    kernel,
    x,
    residual,
    name="jaxcomp_sign_pack",
    bucket=bucket_size,
    config=config,
    interpret=interpret,
    outputs=[
      ((-(-n // 32),), _U32, rows * bucket_size // 32),
      ((nb,), _F32, rows),
      ((nb,), _F32, rows),
    ],
  )


def sign_pack_reference(
  x: Array, residual: Array | None = None, *, bucket_size: int
) -> tuple[Array, ...]:
  """The XLA path: :class:`jaxcomp.codecs.OneBit`'s encode (and decode for the residual)."""
  from jaxcomp._src import codecs

  codec = codecs.OneBit(bucket_size, implementation="xla")
  if residual is None:
    p = codec.encode(x)
    return p.arrays["words"], p.arrays["pos"], p.arrays["neg"]
  x32 = x.astype(_F32) + residual
  p = codec.encode(x32.astype(x.dtype))
  return p.arrays["words"], p.arrays["pos"], p.arrays["neg"], x32 - codec.decode(p, _F32)


def _unpack_block(words, pos, neg, *, rows, bucket, exact_asm):
  """float32 ``(rows, bucket)`` values of one OneBit payload's block (words ``(W,)``)."""
  del exact_asm  # no arithmetic
  shifts = lax.broadcasted_iota(_U32, (words.shape[0], 32), 1)
  bits = ((words[:, None] >> shifts) & jnp.uint32(1)).reshape(rows, bucket)
  return jnp.where(bits != 0, neg[:, None], pos[:, None])


@functools.partial(jax.jit, static_argnames=("n", "bucket_size", "config", "interpret", "backend"))
def sign_unpack_sum(
  words: Array,
  pos: Array,
  neg: Array,
  *,
  n: int,
  bucket_size: int,
  config: SignPackConfig = SignPackConfig(),
  interpret: bool | None = None,
  backend: str | None = None,
) -> Array:
  """Sum of K OneBit payloads, decoded in one pass (rank order).

  Args:
    words: uint32 ``(K, ceil(n / 32))``.
    pos, neg: float32 ``(K, ceil(n / bucket_size))``.
    n: values per payload.
    bucket_size: the codec's, a power of two in 32..65536.
    config, interpret, backend: as for :func:`sign_pack`.

  Returns:
    float32 ``(n,)``.
  """
  why = unsupported(n, bucket_size=bucket_size)
  if why is not None:
    raise ValueError(f"the sign_unpack_sum kernel does not handle this payload: {why}")
  return _common.call_decoder(
    _unpack_block,
    words,
    {"pos": pos, "neg": neg},
    n=n,
    bits=1,
    bucket=bucket_size,
    name="jaxcomp_sign_unpack_sum",
    config=config,
    interpret=interpret,
    backend=backend,
    mosaic_decode=_mosaic.onebit_decode,
  )


def sign_unpack_sum_reference(
  words: Array, pos: Array, neg: Array, *, n: int, bucket_size: int
) -> Array:
  """The XLA path: :meth:`jaxcomp.codecs.OneBit.decode_sum` of the stacked payload."""
  from jaxcomp._src import codecs

  codec = codecs.OneBit(bucket_size, implementation="xla")
  return codec.decode_sum(codecs.Payload({"words": words, "pos": pos, "neg": neg}, (n,), _F32))
