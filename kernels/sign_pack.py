r"""1-bit SGD's encode: sign bits, per-bucket positive/negative means, fused feedback.

Per bucket ``v`` of ``bucket_size`` values (Seide et al. 2014):

.. math::
  \mathrm{bit}_i = [v_i < 0], \qquad
  \mu^+ = \mathrm{mean}\{v_i : v_i \ge 0\}, \qquad \mu^- = \mathrm{mean}\{v_i : v_i < 0\},

signs packed 32 per uint32 word (bit ``i`` of word ``g`` is value ``32 g + i``) and the
two means in float32: exactly :class:`jaxcomp.codecs.OneBit`'s payload. With
``residual=e`` the kernel also fuses the error feedback of :func:`jaxcomp.onebit_sgd`:
it encodes ``v = fl_{dtype}(x + e)`` and returns ``e' = (x + e) - Q(v)``.

The payload is bit-identical to the XLA path's (``OneBit(..., implementation="xla")``),
and so is the residual (``x + e - mean``: no product that XLA could contract into an
FMA). The means are sums, whose float32 values depend on the order of their additions:
the wrapper computes them in XLA before the kernel, with the XLA path's own code
(:func:`jaxcomp._src.plumbing.arith.onebit_means`, pairwise sums), and the kernel packs the
signs and writes the residual.

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

from jaxcomp._src.plumbing import arith

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


def _sign_pack_kernel(pos_ref, neg_ref, x_ref, *refs, n, bucket, rows, has_residual):
  if has_residual:
    e_ref, words_ref, new_e_ref = refs
  else:
    (words_ref,), e_ref = refs, None
  length = rows * bucket
  _, _, v, x32 = _common.load_buckets(x_ref, e_ref, n=n, rows=rows, bucket=bucket)
  neg = v < 0
  lanes = neg.astype(_U32).reshape(length // 32, 32)
  shifts = lax.broadcasted_iota(_U32, lanes.shape, 1)
  words_ref[...] = jnp.sum(lanes << shifts, axis=1, dtype=_U32)
  if has_residual:
    sent = jnp.where(neg, neg_ref[...][:, None], pos_ref[...][:, None])
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
  _common.check_residual(x, residual)
  # The means are sums: computed in XLA, in the XLA path's order, by its code, over the
  # codec's buckets (one short one when n < bucket_size).
  b = min(bucket_size, n)
  pos, neg = arith.onebit_means(arith.encoded_values(x, residual), None, b=b, nb=-(-n // b))
  misfit = _mosaic.misfit(n, 1, bucket_size)
  if _common.pick_backend(misfit, interpret=interpret, backend=backend) == "mosaic_gpu":
    words, *new_residual = _mosaic.sign_pack(
      x, residual, pos, neg, bucket=bucket_size, out_struct=_common.out_struct, interpret=interpret
    )
    return (words, pos, neg, *new_residual)
  rows = config.rows(bucket_size)
  kernel = functools.partial(
    _sign_pack_kernel, n=n, bucket=bucket_size, rows=rows, has_residual=residual is not None
  )
  words, *new_residual = _common.call_encoder(
    kernel,
    x,
    residual,
    name="jaxcomp_sign_pack",
    bucket=bucket_size,
    config=config,
    interpret=interpret,
    per_bucket=(pos, neg),
    outputs=[((-(-n // 32),), _U32, rows * bucket_size // 32)],
  )
  return (words, pos, neg, *new_residual)


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
