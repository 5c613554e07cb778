r"""QSGD dequantization fused with the sum of K gathered payloads.

After an ``all_gather`` every device holds K payloads (words and per-bucket scales) of
the same tensor and needs their sum. Decoding them one by one writes a full float32
tensor K times; this kernel reads the K payloads (``K (n bits / 8 + 4 n / b)`` bytes)
and writes the sum once (``4 n`` bytes):

.. math::
  \mathrm{out}_i = \sum_{k=0}^{K-1} \pm_{k,i}\, \xi_{k,i} \cdot (\sigma_{k,\lfloor i/b\rfloor} / s),

added in rank order ``((d_0 + d_1) + d_2) + ...``, the order of
:meth:`QSGD.decode_sum <jaxcomp.codecs.Codec.decode_sum>`, so that in interpret mode the result is
bit-identical to it (a compiled kernel may contract ``acc + q * step`` into one fused
multiply-add, within one rounding of it).

The payload format is :class:`jaxcomp.codecs.QSGD`'s lanes layout (see
:mod:`jaxcomp.kernels.quantize`). The K payloads are read with a loop inside each program, so K
is not unrolled and need not be a power of two.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxcomp._src.plumbing import arith

from . import _common
from . import _mosaic
from . import quantize as quantize_lib

Array = jax.Array
_F32 = jnp.float32
_U32 = jnp.uint32

DequantizeConfig = _common.LaunchConfig


def _decode_block(words, scale, *, rows, bucket, levels, exact_asm):
  """float32 ``(rows, bucket)`` values of one payload's block (words ``(W,)``)."""
  del exact_asm  # no division left: the step is a multiplication (arith.level_step)
  mbits = int(levels).bit_length()
  bits = mbits + 1
  per_word = 32 // bits
  shifts = lax.broadcasted_iota(_U32, (words.shape[0], per_word), 1) * jnp.uint32(bits)
  codes = ((words[:, None] >> shifts) & jnp.uint32((1 << bits) - 1)).reshape(rows, bucket)
  mag = (codes & jnp.uint32((1 << mbits) - 1)).astype(_F32)
  q = jnp.where((codes >> mbits) != 0, -mag, mag)
  step = arith.level_step(scale, levels)
  return q * step[:, None]


def unsupported(n: int, *, levels: int, bucket_size: int | None) -> str | None:
  """Why the kernel cannot decode this payload (``None`` when it can)."""
  return quantize_lib.unsupported(n, levels=levels, bucket_size=bucket_size, dtype=jnp.float32)


@functools.partial(
  jax.jit, static_argnames=("n", "levels", "bucket_size", "config", "interpret", "backend")
)
def dequantize_sum(
  words: Array,
  scales: Array,
  *,
  n: int,
  levels: int,
  bucket_size: int,
  config: DequantizeConfig = DequantizeConfig(),
  interpret: bool | None = None,
  backend: str | None = None,
) -> Array:
  """Sum of K QSGD payloads, decoded in one pass.

  Args:
    words: uint32 ``(K, ceil(n * bits / 32))``, the stacked payload words.
    scales: float32 ``(K, ceil(n / bucket_size))``.
    n: values per payload.
    levels, bucket_size: the codec's (the code width must divide 32).
    config: block size and Triton launch parameters (the Triton kernel's).
    interpret: run in Pallas interpret mode (default: unless on a CUDA GPU).
    backend: ``"mosaic_gpu"``, ``"triton"`` or ``None`` (see
      :func:`jaxcomp.kernels.quantize.quantize`).

  Returns:
    float32 ``(n,)``.
  """
  why = unsupported(n, levels=levels, bucket_size=bucket_size)
  if why is not None:
    raise ValueError(f"the dequantize kernel does not handle this payload: {why}")
  return _common.call_decoder(
    functools.partial(_decode_block, levels=levels),
    words,
    {"scales": scales},
    n=n,
    bits=quantize_lib.bits_per_value(levels),
    bucket=bucket_size,
    name="jaxcomp_dequantize_sum",
    config=config,
    interpret=interpret,
    backend=backend,
    mosaic_decode=_mosaic.qsgd_decode(levels),
  )
