"""Codecs: pure encode/decode pairs whose payloads are what crosses the wire.

A codec is an immutable, hashable object (so it can be a static argument under
``jax.jit``). ``codec.encode(x, key=key)`` returns a :class:`Payload`: a pytree of
fixed-shape arrays (bits packed into uint32 words, scales in float32) plus the static
shape and dtype of ``x``. Its arrays are exactly what a collective moves, so
``codec.wire_bits(shape)`` is computed from their ``nbytes``, never from a formula.
``codec.decode(payload)`` inverts it; it is pure and also runs under ``jax.vmap`` on a
stacked payload (the result of ``lax.all_gather``), and ``codec.decode_sum`` adds up a
stacked payload in rank order without materialising the K decoded copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import rng
from jaxcomp.kernels import _common as kernel_common
from jaxcomp.kernels import _mosaic as kernel_mosaic
from jaxcomp.kernels import cpu as cpu_kernels
from jaxcomp.kernels import dequantize as dequantize_kernel
from jaxcomp.kernels import quantize as quantize_kernel
from jaxcomp.kernels import sign_pack as sign_pack_kernel

Array = jax.Array
_F32 = jnp.float32
_MAX_LEVELS = 2**24 - 1  # levels are handled in float32, exact up to 2**24


# ----------------------------------------------------------------------------- payload


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["arrays"],
  meta_fields=["shape", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class Payload:
  """What a codec sends: named fixed-shape arrays, plus the static shape/dtype of ``x``.

  Attributes:
    arrays: dict of arrays (the pytree leaves; these cross the collective).
    shape: shape of the encoded tensor (static).
    dtype: dtype of the encoded tensor (static); ``decode`` returns this dtype.
  """

  arrays: dict[str, Array]
  shape: tuple[int, ...]
  dtype: Any

  @property
  def nbytes(self) -> int:
    """Total bytes of the payload's arrays (of one payload, or of a stacked one)."""
    return payload_nbytes(self)


def payload_nbytes(payload: Any) -> int:
  """Bytes of every array leaf in a payload pytree."""
  return int(sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(payload)))


# ----------------------------------------------------------------------------- base


def _check_float(x: Any, what: str = "x") -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{what} must be a floating-point array (float32, bfloat16, float16), got dtype {dtype}"
    )


def check_positive_int(value: Any, name: str, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


@functools.lru_cache(maxsize=4096)
def _wire_bits(codec: Codec, shape: tuple[int, ...], dtype: Any) -> int:
  key = jax.random.key(0)
  out = jax.eval_shape(lambda x: codec.encode(x, key=key), jax.ShapeDtypeStruct(shape, dtype))
  return 8 * payload_nbytes(out)


class Codec:
  """Base class of all codecs. Subclasses are frozen dataclasses.

  Subclasses implement ``encode`` and ``_decode_f32``; the base class supplies
  ``decode``, ``decode_sum`` and ``wire_bits``.
  """

  #: Whether ``encode`` uses ``key`` (stochastic codecs raise without one).
  needs_key: bool = False

  #: Whether every device must draw the *same* random bits (e.g. :class:`RandomK` with
  #: shared indices): :func:`jaxcomp.compress` then does not fold the device index into
  #: the key.
  shared_randomness: bool = False

  #: Names of the payload arrays that may be summed across devices with ``lax.psum``
  #: (the others, e.g. shared indices, are identical on every device), or ``None`` when
  #: the payload is not linear. Enables ``collective="psum"``.
  summable_fields: tuple[str, ...] | None = None

  #: A fixed-width codec of the same quantization, for a variable-length format held in
  #: a fixed buffer (:class:`EliasQSGD`): when a buffer overflows on any device, the
  #: all-gather exchange sends this codec's payload instead. ``None``: never overflows.
  fallback: Codec | None = None

  @property
  def alignment(self) -> int:
    """Chunk lengths of the two-phase exchange are multiples of this (whole uint32 words).

    Buckets restart at each chunk: a chunk of c values has ``ceil(c / bucket_size)``
    buckets, the last one shorter, so small tensors are not padded to whole buckets.
    """
    return 32

  def chunk_shape(self, shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """Shape of each of the K chunks the two-phase exchange cuts a tensor of ``shape`` into.

    By default a flat slice of ``ceil(n / K)`` values rounded up to :attr:`alignment`
    (:func:`flat_chunk_length`). A codec whose buckets follow the tensor's structure
    (:class:`OneBit` with ``per_column=True``) cuts it along that structure instead, so
    that no bucket straddles two chunks.
    """
    return (flat_chunk_length(self.alignment, math.prod(shape), k),)

  def to_chunks(self, x: Array, k: int) -> Array:
    """``x`` cut into its K two-phase chunks, stacked: ``(K, *chunk_shape(x.shape, K))``.

    Chunk j is what device j owns; the chunks past the end of ``x`` are zero-padded.
    """
    (c,) = self.chunk_shape(x.shape, k)
    flat = x.reshape(-1)
    pad = k * c - flat.shape[0]
    return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(k, c)

  def from_chunks(self, chunks: Array, shape: tuple[int, ...]) -> Array:
    """Inverse of :meth:`to_chunks`: K stacked (decoded) chunks back to ``shape``,
    the padding dropped."""
    return chunks.reshape(-1)[: math.prod(shape)].reshape(shape)

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    raise NotImplementedError

  def encode_with_info(self, x: Array, *, key: Array | None = None) -> tuple[Payload, Array]:
    """``encode``, and whether a static capacity overflowed (a bool scalar).

    Codecs whose payload holds a random number of entries in a fixed capacity
    (:class:`UnbiasedSparsifier`) report here when they had to take their unbiased
    overflow path; :func:`jaxcomp.compress` counts it in its state. Others never overflow.
    """
    return self.encode(x, key=key), jnp.zeros((), bool)

  def _decode_f32(self, payload: Payload) -> Array:
    raise NotImplementedError

  def _kernel_unsupported(self, n: int, dtype: Any) -> str | None:
    """Why this codec's kernels cannot take ``n`` values of ``dtype`` (``None``: they can)."""
    del n, dtype
    return "no kernels"

  def kernel_backend(self, n: int, dtype: Any = jnp.float32) -> str | None:
    """``"pallas"``, ``"native"`` or ``None`` (the XLA path) for ``n`` values of ``dtype``:
    what ``implementation`` picks (:func:`_kernel_backend`) where the kernels handle it."""
    if self._kernel_unsupported(n, dtype) is not None:
      return None
    backend = _kernel_backend(self.implementation)
    if backend == "pallas" and kernel_common.no_backend_for(self._mosaic_misfit(n)):
      return None  # no Pallas backend here lowers this shape: XLA (warned once)
    return backend

  def _mosaic_misfit(self, n: int) -> str | None:
    """Why the Mosaic GPU kernels do not take ``n`` values (:func:`kernels._mosaic.misfit`)."""
    del n
    return "no kernels"

  def uses_kernel(self, n: int, dtype: Any = jnp.float32) -> bool:
    """Whether encoding ``n`` values of ``dtype`` (and decoding them) runs kernels."""
    return self.kernel_backend(n, dtype) is not None

  def fuses_feedback(self, n: int, dtype: Any) -> bool:
    """Whether :meth:`encode_feedback` runs as one fused kernel for this tensor: the
    Pallas kernels for every input dtype, the native ones for float32 (``fl_dtype(x + e)``
    of a narrower dtype is left to the unfused path)."""
    backend = self.kernel_backend(n, dtype)
    return backend == "pallas" or (backend == "native" and jnp.dtype(dtype) == jnp.float32)

  def _kernel_decode_sum(self, arrays: dict[str, Array], n: int) -> Array:
    """The flat float32 sum of stacked payload arrays by a kernel (when uses_kernel)."""
    raise NotImplementedError

  def encode_feedback(
    self, g: Array, residual: Array, *, key: Array | None = None
  ) -> tuple[Payload, Array, Array]:
    """Error-feedback encode: ``(payload, e', finite)`` for gradient ``g`` and residual ``e``.

    The payload encodes ``v = fl_{g.dtype}(g + e)`` (the sum in float32), ``e' = (g + e)
    - decode(payload)`` in float32, and ``finite`` (a bool scalar) says whether ``g + e``
    was finite. Codecs with a fused kernel (:meth:`fuses_feedback`) read ``g`` and ``e``
    and write ``e'`` and the payload in one pass; this is the unfused definition.
    """
    x32 = g.astype(_F32) + residual
    payload = self.encode(x32.astype(g.dtype), key=key)
    return payload, x32 - self.decode(payload, _F32), jnp.all(jnp.isfinite(x32))

  def decode(self, payload: Payload, dtype: Any = None) -> Array:
    """Decodes one payload to an array of the encoded shape and dtype.

    Args:
      payload: a payload from :meth:`encode` (under ``jax.vmap``, a stacked one).
      dtype: optional output dtype; defaults to the dtype of the encoded array.
    """
    out = self._decode_f32(payload).reshape(payload.shape)
    return out.astype(payload.dtype if dtype is None else dtype)

  def decode_sum(self, stacked: Payload) -> Array:
    """Sum of the decodings of a stacked payload (leading axis K), in float32.

    The K payloads are decoded and added one at a time in index order (a ``lax.scan``),
    the order of a ring/sequential ``psum``: only one decoded copy is live at a time, and
    with :class:`Identity` the result equals ``lax.psum`` exactly on CPU. Codecs with a
    kernel (:meth:`uses_kernel`) decode all K in one pass, adding in the same order.
    """
    n = math.prod(stacked.shape)
    if self.uses_kernel(n):
      return self._kernel_decode_sum(stacked.arrays, n).reshape(stacked.shape)

    def body(acc, p):
      return acc + self.decode(p, _F32), None

    # The first decoding seeds the carry, so the carry has the payload's sharding type
    # (varying or not under shard_map's check_vma) without inspecting it.
    first = self.decode(jax.tree.map(lambda a: a[0], stacked), _F32)
    acc, _ = lax.scan(body, first, jax.tree.map(lambda a: a[1:], stacked))
    return acc

  def wire_bits(self, shape: tuple[int, ...], dtype: Any = jnp.float32) -> int:
    """Bits of the payload of a tensor of ``shape``: 8 x the nbytes of its arrays."""
    return _wire_bits(self, tuple(int(d) for d in shape), jnp.dtype(dtype))

  def _require_key(self, key: Array | None) -> Array:
    if key is None:
      raise ValueError(f"{type(self).__name__}.encode is stochastic and needs key=...")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)
    return key


def flat_chunk_length(alignment: int, n: int, k: int) -> int:
  """Length of each of the K flat chunks of an n-vector: ``ceil(n / K)`` rounded up to a
  multiple of ``alignment`` (at least one ``alignment``)."""
  per_device = -(-n // k)
  return max(alignment, -(-per_device // alignment) * alignment)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The matrix view ``(shape[0], prod(shape[1:]))`` of a tensor; ``(1, 1)`` for a scalar.

  A vector of m values is one column ``(m, 1)``. Kernels of higher rank are matrices of
  their first dimension against all the others (PowerSGD's convention).
  """
  if not shape:
    return 1, 1
  return int(shape[0]), math.prod(shape[1:])


def buckets(n: int, bucket_size: int | None) -> tuple[int, int]:
  """(bucket length, number of buckets) for a flat tensor of n values."""
  b = max(n, 1) if bucket_size is None else min(bucket_size, max(n, 1))
  return b, -(-n // b)


def _kernel_backend(implementation: str | None) -> str | None:
  """Which kernels a codec's ``implementation`` picks for a shape they handle.

  ``None``: the Pallas kernels on a CUDA GPU, the native CPU kernels on a CPU backend
  (when they build here, :func:`jaxcomp.kernels.cpu.available`), else XLA.
  """
  if kernel_common.use_pallas(implementation):
    return "pallas"
  if implementation == "native":
    cpu_kernels.require()  # a clear error (the compiler's) when they cannot be built
    return "native"
  if implementation is None and cpu_kernels.use_by_default():
    return "native"
  return None


# ----------------------------------------------------------------------------- codecs


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
  """Sends the tensor as it is (the dense baseline)."""

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key
    _check_float(x)
    return Payload({"values": x}, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    return payload.arrays["values"].astype(_F32)


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
  """Sends the tensor cast to a narrower float type (the peers' fp16/bf16 hooks).

  For ``float16`` the tensor is first multiplied by a power of two
  ``2**(15 - e)``, ``e = ceil(log2 max|x|)``, so that ``max|x|`` lands in
  ``[2**14, 2**15)``: nothing overflows fp16's 65504 and small gradients keep their
  precision instead of flushing to zero; the float32 scale travels with the payload and
  is exact to undo. ``bfloat16`` has float32's range and is sent unscaled.

  Args:
    dtype: the wire dtype, ``jnp.bfloat16`` or ``jnp.float16`` (any float dtype works).
  """

  dtype: Any = jnp.bfloat16

  def __post_init__(self):
    dt = jnp.dtype(self.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
      raise TypeError(f"Cast needs a floating dtype, got {self.dtype!r}")
    object.__setattr__(self, "dtype", dt)

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key
    _check_float(x)
    arrays = {}
    if self.dtype == jnp.float16:
      xf = x.astype(_F32)
      amax = jnp.max(jnp.abs(xf)) if x.size else jnp.zeros((), _F32)
      _, e = jnp.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
      ok = jnp.isfinite(amax) & (amax > 0)
      # 2**127 is float32's largest power of two: inputs below 2**-112 scale up to it.
      shift = jnp.minimum(15 - e, 127)
      scale = jnp.where(ok, jnp.ldexp(jnp.ones((), _F32), shift), jnp.ones((), _F32))
      arrays["values"] = (xf * scale).astype(self.dtype)
      arrays["scale"] = scale
    else:
      arrays["values"] = x.astype(self.dtype)
    return Payload(arrays, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    v = payload.arrays["values"].astype(_F32)
    if "scale" in payload.arrays:
      v = v / payload.arrays["scale"]
    return v


@dataclasses.dataclass(frozen=True)
class QSGD(Codec):
  r"""QSGD stochastic quantization with ``levels`` levels per sign, bucketed.

  For each bucket ``v`` (``bucket_size`` consecutive values of the flattened tensor,
  the whole tensor when ``None``) with scale ``||v||`` (``norm="l2"``, the paper's
  quantizer) or ``max_i |v_i|`` (``norm="max"``, the paper's practical variant):

  .. math::
    Q_s(v)_i = \|v\| \cdot \mathrm{sgn}(v_i) \cdot \xi_i / s, \qquad
    \xi_i = \ell + \mathrm{Bernoulli}(|v_i| s / \|v\| - \ell), \;
    \ell = \lfloor |v_i| s / \|v\| \rfloor,

  and ``Q_s(0) = 0``. It is unbiased, and with the l2 norm (Lemma 3.1)
  ``E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2`` and
  ``E||Q(v)||_0 <= s (s + sqrt(n))``. With the max norm every decoded value is within
  ``max|v| / s`` of its input.

  Wire format: each value's magnitude ``xi`` (``ceil(log2(s+1))`` bits) and sign (1 bit)
  packed into uint32 words (see :mod:`jaxcomp._src.plumbing.bitpack`), plus one float32 scale per
  bucket. Padding of the last bucket is not sent.

  Args:
    levels: ``1 <= s < 2**24``, levels per sign (``2**(bits-1) - 1`` for ``bits``).
    bucket_size: values per bucket, or ``None`` for one bucket per tensor.
    norm: ``"l2"`` or ``"max"``.
    implementation: ``None`` (the Pallas kernels of :mod:`jaxcomp.kernels` on a CUDA
      GPU, the native CPU kernels of :mod:`jaxcomp.kernels.cpu` on a CPU backend where
      they build and ``norm="max"``, XLA elsewhere), ``"xla"``, ``"pallas"`` (interpret
      mode off GPU) or ``"native"``. A shape the kernels do not handle (see
      ``jaxcomp.kernels.quantize.unsupported``) falls back to XLA. XLA and the Pallas
      kernels give bit-identical payloads for the same key (the l2 scale is computed by
      the same code for both); the native kernels too with ``norm="max"``, while with
      ``"l2"`` they sum a bucket's squares in another order, so a scale may differ in
      its last bits.

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic. *QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding*. NeurIPS 2017. https://arxiv.org/abs/1610.02132
  """

  levels: int
  bucket_size: int | None = None
  norm: str = "l2"
  implementation: str | None = None

  needs_key = True

  def __post_init__(self):
    kernel_common.check_implementation(self.implementation)
    check_positive_int(self.levels, "levels")
    if self.levels > _MAX_LEVELS:
      raise ValueError(f"levels must be at most 2**24 - 1 (exact in float32), got {self.levels}")
    check_positive_int(self.bucket_size, "bucket_size", allow_none=True)
    if self.norm not in ("l2", "max"):
      raise ValueError(f"norm must be 'l2' or 'max', got {self.norm!r}")

  @property
  def magnitude_bits(self) -> int:
    return int(self.levels).bit_length()  # ceil(log2(levels + 1))

  @property
  def bits(self) -> int:
    """Bits per value on the wire: magnitude plus sign."""
    return self.magnitude_bits + 1

  def scales(self, v: Array) -> Array:
    """Per-bucket scale of a ``(buckets, bucket_size)`` float32 array; NaN for a bucket
    that holds a NaN or an infinity (:func:`jaxcomp._src.plumbing.arith.qsgd_scales`: the
    kernels take the same function's scales, so they agree bit for bit)."""
    return arith.qsgd_scales(v, self.norm)

  def quantize(self, x: Array, *, key: Array | None = None) -> tuple[Array, Array, Array]:
    """The quantization before packing: ``(scales, magnitudes, negative)``.

    ``scales`` is float32 ``(buckets,)``; ``magnitudes`` (uint32, ``s·ξ_i`` in
    ``0..levels``) and ``negative`` (bool) are ``(buckets, bucket_length)``, the padding
    of the last bucket zero. :meth:`encode` packs exactly these; other wire formats of
    the same quantization (e.g. Elias coding) start from them.

    The Bernoulli draws are :mod:`jaxcomp._src.plumbing.rng`'s counter-based bits: value ``i``
    of the flattened tensor uses ``h(i)`` under ``key``, the same bits a Pallas kernel
    computes from its element index.
    """
    _check_float(x)
    key = self._require_key(key)
    n = x.size
    b, nb = buckets(n, self.bucket_size)
    v = arith.to_buckets(x.reshape(-1).astype(_F32), b, nb)
    # A bucket holding NaN/Inf gets a NaN scale, so it decodes to NaN: never hidden
    # (the codes of a non-finite value are meaningless).
    scale = self.scales(v)
    s = jnp.float32(self.levels)
    # r = |v| / scale * s as fl(fl(|v| * inv) * fl(s * k)) (arith.level_ratio):
    # what XLA compiles a division by the broadcast scale into anyway, spelled out so
    # that the Pallas and native kernels compute the same bits.
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    inv, k = arith.inverse_scale(safe)
    r = jnp.where(
      (scale > 0)[:, None],
      arith.level_ratio(jnp.abs(v), inv[:, None], k[:, None], self.levels),
      0.0,
    )
    # r is finite (0 in a non-finite bucket, whose NaN scale marks it) and <= s (|v| *
    # fl(1 / max) <= 1, tests/test_qsgd.py checks every mantissa): the clamp is a guard.
    mag = jnp.minimum(rng.bernoulli_round(r, key), s).astype(jnp.uint32)
    # A zero code carries no sign (the paper's string has no bit for it): +0, not -0.
    return scale, mag, (v < 0) & (mag > 0)

  def _kernel_unsupported(self, n: int, dtype: Any) -> str | None:
    return quantize_kernel.unsupported(
      n, levels=self.levels, bucket_size=self.bucket_size, dtype=dtype
    )

  def _mosaic_misfit(self, n: int) -> str | None:
    return kernel_mosaic.misfit(n, self.bits, self.bucket_size)

  def kernel_backend(self, n: int, dtype: Any = jnp.float32) -> str | None:
    backend = super().kernel_backend(n, dtype)
    if backend == "native" and self.norm == "l2" and self.implementation is None:
      # The kernel sums a bucket's squares in another order than XLA: by default the
      # l2 scale stays on the XLA path, so every QSGD(norm="l2") on a CPU (and the
      # quantize() of EliasQSGD, which is XLA) agrees bit for bit.
      return None
    return backend

  def _kernel_encode(
    self, x: Array, key: Array | None, residual: Array | None = None
  ) -> tuple[Payload, ...]:
    """The quantize kernel's payload (and new residual, when ``residual`` is given)."""
    module = cpu_kernels if self.kernel_backend(x.size, x.dtype) == "native" else quantize_kernel
    words, scales, *new_residual = module.quantize(
      x,
      self._require_key(key),
      residual,
      levels=self.levels,
      bucket_size=self.bucket_size,
      norm=self.norm,
    )
    payload = Payload({"words": words, "scales": scales}, tuple(x.shape), jnp.dtype(x.dtype))
    return (payload, *new_residual)

  def encode_feedback(
    self, g: Array, residual: Array, *, key: Array | None = None
  ) -> tuple[Payload, Array, Array]:
    """See :meth:`Codec.encode_feedback`; fused into the quantize kernel when it runs.

    ``finite`` is then read off the scales (a bucket that is not finite has a NaN scale).
    """
    _check_float(g)
    if not self.fuses_feedback(g.size, g.dtype):
      return super().encode_feedback(g, residual, key=key)
    payload, new_residual = self._kernel_encode(g, key, residual.astype(_F32))
    return payload, new_residual, jnp.all(jnp.isfinite(payload.arrays["scales"]))

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    _check_float(x)
    if self.uses_kernel(x.size, x.dtype):
      return self._kernel_encode(x, key)[0]
    scale, mag, negative = self.quantize(x, key=key)
    sign = negative.astype(jnp.uint32)
    codes = (mag | (sign << self.magnitude_bits)).reshape(-1)[: x.size]
    words = bitpack.pack_bits(codes, self.bits)
    return Payload({"words": words, "scales": scale}, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    if self.uses_kernel(n):
      return self._kernel_decode_sum(jax.tree.map(lambda a: a[None], payload.arrays), n)
    codes = bitpack.unpack_bits(payload.arrays["words"], self.bits, n)
    return self.dequantize(codes, payload.arrays["scales"], n)

  def _kernel_decode_sum(self, arrays: dict[str, Array], n: int) -> Array:
    module = cpu_kernels if self.kernel_backend(n) == "native" else dequantize_kernel
    return module.dequantize_sum(
      arrays["words"], arrays["scales"], n=n, levels=self.levels, bucket_size=self.bucket_size
    )

  def dequantize(self, codes: Array, scales: Array, n: int) -> Array:
    """Flat float32 values of ``n`` codes (``magnitude | sign << magnitude_bits``)."""
    b, nb = buckets(n, self.bucket_size)
    mask = jnp.uint32((1 << self.magnitude_bits) - 1)
    mag = (codes & mask).astype(_F32)
    neg = (codes >> self.magnitude_bits) != 0
    q = arith.to_buckets(jnp.where(neg, -mag, mag), b, nb)
    step = arith.level_step(scales, self.levels)
    return (q * step[:, None]).reshape(-1)[:n]


@dataclasses.dataclass(frozen=True)
class OneBit(Codec):
  r"""1-bit quantization: a sign bit per value, two reconstruction values per bucket.

  Within each bucket, values ``>= 0`` decode to the mean of the bucket's non-negative
  values and values ``< 0`` to the mean of its negative values, so the bucket's sum (and
  mean) is preserved:

  .. math::
    Q(v)_i = \begin{cases} \mathrm{mean}\{v_j : v_j \ge 0\} & v_i \ge 0 \\
                           \mathrm{mean}\{v_j : v_j < 0\} & v_i < 0 \end{cases}

  The buckets are ``bucket_size`` consecutive values of the flattened tensor (the whole
  tensor when ``None``), or with ``per_column=True`` the columns of its matrix view, as
  in the paper (§3: one pair of reconstruction values per matrix column): a tensor of
  shape ``(m, ...)`` is viewed as ``(m, n)``, ``n = prod(shape[1:])`` (a vector as one
  column, :func:`matrix_shape`), and column ``x[:, j]`` gets the two means of its own
  entries. The columns are laid out one after the other (column-major), so the sign
  words hold column 0's m signs, then column 1's, ...; the two-phase exchange cuts such a
  tensor into chunks of whole columns (:meth:`chunk_shape`), or, where K does not divide
  the number of columns, of column segments with a pair of means each, when that moves
  fewer bytes than zero padding columns (:meth:`column_segments`).

  It is deterministic and biased; use it with error feedback
  (:func:`jaxcomp.onebit_sgd`), which carries ``v - Q(v)`` into the next step.

  The means of finite values are finite: a bucket whose float32 sum of one sign
  overflows (values from about ``FLT_MAX / bucket_size``) is summed again scaled by a
  power of two (:func:`jaxcomp._src.plumbing.arith.side_mean`), on every path.

  Wire format: signs packed 32 per uint32, plus two float32 per bucket (per column:
  ``ceil(m n / 32)`` words and ``2 n`` floats, at most ``m n + 31 + 64 n`` bits).

  Args:
    bucket_size: values per bucket, or ``None`` for one bucket per tensor (with
      ``per_column=True``: must be ``None``, the columns are the buckets).
    implementation: ``None`` (the Pallas kernels on a CUDA GPU, the native CPU kernels
      on a CPU backend where they build, XLA elsewhere), ``"xla"``, ``"pallas"``
      (interpret mode off GPU) or ``"native"``; shapes the kernels do not handle, and
      ``per_column=True``, fall back to XLA. XLA and the Pallas kernels give
      bit-identical payloads (the means are computed by the same code for both); the
      native kernels the same sign words, and means to float32 rounding (their sums are
      taken in another order).
    per_column: one pair of reconstruction values per column of the matrix view
      (keyword only).

  References:
    Seide, Fu, Droppo, Li, Yu. *1-Bit Stochastic Gradient Descent and its Application
    to Data-Parallel Distributed Training of Speech DNNs*. Interspeech 2014.
  """

  bucket_size: int | None = None
  implementation: str | None = None
  per_column: bool = dataclasses.field(default=False, kw_only=True)

  def __post_init__(self):
    check_positive_int(self.bucket_size, "bucket_size", allow_none=True)
    kernel_common.check_implementation(self.implementation)
    if not isinstance(self.per_column, (bool, np.bool_)):
      raise TypeError(f"per_column must be a bool, got {self.per_column!r}")
    if self.per_column and self.bucket_size is not None:
      raise ValueError(
        f"per_column=True takes each column as a bucket: leave "
        f"bucket_size=None (got {self.bucket_size})"
      )

  def _kernel_unsupported(self, n: int, dtype: Any) -> str | None:
    if self.per_column:
      return "per-column buckets run on the XLA path"
    return sign_pack_kernel.unsupported(n, bucket_size=self.bucket_size, dtype=dtype)

  def _mosaic_misfit(self, n: int) -> str | None:
    return kernel_mosaic.misfit(n, 1, self.bucket_size)

  def _bucket_layout(self, shape: tuple[int, ...]) -> tuple[int, int]:
    """(bucket length, number of buckets) of a tensor of ``shape``."""
    if self.per_column:
      return matrix_shape(shape)
    return buckets(math.prod(shape), self.bucket_size)

  def _flat(self, x: Array) -> Array:
    """``x`` flattened in bucket order, float32 (column-major with ``per_column``)."""
    if self.per_column:
      return x.reshape(matrix_shape(x.shape)).astype(_F32).T.reshape(-1)
    return x.reshape(-1).astype(_F32)

  def column_segments(self, shape: tuple[int, ...], k: int) -> int:
    """How many segments the two-phase exchange cuts each column of ``shape`` into (with
    ``per_column``; 1 otherwise).

    Chunks of whole columns are padded with zero columns when K does not divide the
    number of columns n: a (1024, 3) kernel on 8 devices would send 8 one-column chunks,
    5 of them zeros. Cutting each column into r segments of ``m / r`` values makes
    ``r n`` segment columns to deal out instead, at the price of a pair of means per
    segment. r is the divisor of m up to K whose chunk (:meth:`chunk_shape`) has the
    smallest payload; on ties, the one with the fewest padding columns (then the
    smallest). r = 1 (whole columns, the paper's buckets) whenever K divides n, since more
    segments then add means and no fewer signs.
    """
    if not self.per_column:
      return 1
    m, n = matrix_shape(shape)
    costs = []
    for r in range(1, min(k, m) + 1):
      if m % r == 0:
        c = -(-n * r // k)
        costs.append((self.wire_bits((m // r, c)), k * c - n * r, r))
    return min(costs)[2]

  def chunk_shape(self, shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    """See :meth:`Codec.chunk_shape`. With ``per_column``: ``(m / r, ceil(r n / K))``, a
    block of whole segment columns: the ``(m, n)`` matrix view with each column cut into
    r segments (:meth:`column_segments`; r = 1 keeps whole columns), the last blocks
    padded with zero columns, which decode to zero."""
    if not self.per_column:
      return super().chunk_shape(shape, k)
    m, n = matrix_shape(shape)
    r = self.column_segments(shape, k)
    return m // r, -(-n * r // k)

  def to_chunks(self, x: Array, k: int) -> Array:
    if not self.per_column:
      return super().to_chunks(x, k)
    m, n = matrix_shape(x.shape)
    ms, c = self.chunk_shape(x.shape, k)
    r = m // ms
    # Segment s of column j is segment column j r + s: column j's rows stay together.
    x2 = x.reshape(r, ms, n).transpose(1, 2, 0).reshape(ms, n * r)
    if k * c > n * r:
      x2 = jnp.pad(x2, ((0, 0), (0, k * c - n * r)))
    return x2.reshape(ms, k, c).transpose(1, 0, 2)

  def from_chunks(self, chunks: Array, shape: tuple[int, ...]) -> Array:
    if not self.per_column:
      return super().from_chunks(chunks, shape)
    m, n = matrix_shape(shape)
    k, ms, c = chunks.shape
    r = m // ms
    x2 = chunks.transpose(1, 0, 2).reshape(ms, k * c)[:, : n * r]
    return x2.reshape(ms, n, r).transpose(2, 0, 1).reshape(shape)

  def _kernel_encode(self, x: Array, residual: Array | None = None) -> tuple[Payload, ...]:
    """The sign_pack kernel's payload (and new residual, when ``residual`` is given)."""
    module = cpu_kernels if self.kernel_backend(x.size, x.dtype) == "native" else sign_pack_kernel
    words, pos, neg, *new_residual = module.sign_pack(x, residual, bucket_size=self.bucket_size)
    payload = Payload({"words": words, "pos": pos, "neg": neg}, tuple(x.shape), jnp.dtype(x.dtype))
    return (payload, *new_residual)

  def encode_feedback(
    self, g: Array, residual: Array, *, key: Array | None = None
  ) -> tuple[Payload, Array, Array]:
    """See :meth:`Codec.encode_feedback`; fused into the sign_pack kernel when it runs.

    ``finite`` is then read off the means (a non-finite value makes its bucket's mean
    non-finite; a bucket sum beyond float32's range does not: the kernels sum such a
    bucket again, scaled, as :func:`jaxcomp._src.plumbing.arith.side_mean` describes).
    """
    del key
    _check_float(g)
    if not self.fuses_feedback(g.size, g.dtype):
      return super().encode_feedback(g, residual)
    payload, new_residual = self._kernel_encode(g, residual.astype(_F32))
    pos, neg = payload.arrays["pos"], payload.arrays["neg"]
    return payload, new_residual, jnp.all(jnp.isfinite(pos)) & jnp.all(jnp.isfinite(neg))

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key
    _check_float(x)
    n = x.size
    if self.uses_kernel(n, x.dtype):
      return self._kernel_encode(x)[0]
    b, nb = self._bucket_layout(x.shape)
    flat = self._flat(x)
    v = arith.to_buckets(flat, b, nb)
    words = bitpack.pack_bits((v < 0).reshape(-1)[:n].astype(jnp.uint32), 1)
    pos, neg = arith.onebit_means(flat, words, b=b, nb=nb)
    arrays = {"words": words, "pos": pos, "neg": neg}
    return Payload(arrays, tuple(x.shape), jnp.dtype(x.dtype))

  def _kernel_decode_sum(self, arrays: dict[str, Array], n: int) -> Array:
    module = cpu_kernels if self.kernel_backend(n) == "native" else sign_pack_kernel
    return module.sign_unpack_sum(
      arrays["words"], arrays["pos"], arrays["neg"], n=n, bucket_size=self.bucket_size
    )

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    if self.uses_kernel(n):
      return self._kernel_decode_sum(jax.tree.map(lambda a: a[None], payload.arrays), n)
    b, nb = self._bucket_layout(payload.shape)
    neg = arith.to_buckets(bitpack.unpack_bits(payload.arrays["words"], 1, n), b, nb) != 0
    out = jnp.where(neg, payload.arrays["neg"][:, None], payload.arrays["pos"][:, None])
    if self.per_column:  # (columns, m) back to the (m, columns) matrix view
      return out.T
    return out.reshape(-1)[:n]


@dataclasses.dataclass(frozen=True)
class ScaledSign(Codec):
  r"""EF-signSGD's scaled sign: a sign bit per value and one scale ``‖v‖₁ / d`` per bucket.

  For each bucket ``v`` of ``d`` values (``bucket_size`` consecutive values of the
  flattened tensor, the whole tensor when ``None``; the last bucket's ``d`` is its own
  length):

  .. math::
    C(v) = \frac{\|v\|_1}{d} \, \mathrm{sign}(v), \qquad
    \mathrm{sign}(v_i) = \begin{cases} +1 & v_i \ge 0 \\ -1 & v_i < 0 \end{cases}

  One bit per value holds two signs, so ``sign(0) = +1`` (``-0.0`` included): a zero
  decodes to ``+‖v‖₁/d``. Every decoded value then has magnitude ``‖v‖₁/d``, so
  ``⟨C(v), v⟩ = ‖v‖₁²/d = ‖C(v)‖²`` and the paper's compressor property holds with
  equality, ``‖C(v) - v‖² = (1 - δ(v)) ‖v‖²`` with ``δ(v) = ‖v‖₁² / (d ‖v‖₂²) ∈ [1/d, 1]``
  (the paper's δ-approximate compressor, with its δ for the scaled sign). It is
  deterministic and *biased* (``C(v) ≠ v`` unless all ``|v_i|`` are equal), which is why
  :func:`jaxcomp.ef_signsgd` carries ``v - C(v)`` into the next step.

  A bucket holding a NaN gets a NaN scale, one holding an infinity an infinite one, so
  neither is hidden; a sum of finite values beyond float32's range is taken again scaled
  by a power of two (:func:`jaxcomp._src.plumbing.arith.side_mean`), so the scale of finite
  values is finite.

  Wire format: signs packed 32 per uint32 (``ceil(n / 32)`` words), plus one float32
  scale per bucket. Decoding ``-s``/``+s`` per sign bit.

  Args:
    bucket_size: values per bucket, or ``None`` for one scale per tensor (Algorithm 1's
      ``d`` is the length of the compressed vector).

  Example:
    >>> import jax.numpy as jnp, jaxcomp as jc
    >>> codec = jc.codecs.ScaledSign()
    >>> codec.decode(codec.encode(jnp.array([3.0, -1.0, 0.0, 2.0]))).tolist()
    [1.5, -1.5, 1.5, 1.5]

  References:
    Karimireddy, Rebjock, Stich, Jaggi. *Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes*. ICML 2019. https://arxiv.org/abs/1901.09847
  """

  bucket_size: int | None = None

  def __post_init__(self):
    check_positive_int(self.bucket_size, "bucket_size", allow_none=True)

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key
    _check_float(x)
    n = x.size
    b, nb = buckets(n, self.bucket_size)
    flat = x.reshape(-1).astype(_F32)
    v = arith.to_buckets(flat, b, nb)
    words = bitpack.pack_bits((v < 0).reshape(-1)[:n].astype(jnp.uint32), 1)
    two_level = b % arith.WORD == 0
    # ||v||_1 as the sums of each sign (one pass, no abs reduction; no cancellation).
    pos_sum, neg_sum, _ = arith.onebit_sums(v, words, two_level=two_level)
    l1 = pos_sum - neg_sum
    count = arith.valid_counts(n, b, nb, _F32)
    safe, has = np.maximum(count, np.float32(1)), count > 0
    shift = arith.sum_shift(b)

    def rescaled():  # finite values summing past FLT_MAX: their l1 norm scaled by 2**-shift
      scaled = arith.onebit_sums(
        arith.to_buckets(flat * np.float32(2.0**-shift), b, nb), words, two_level=two_level
      )
      return scaled[0] - scaled[1]

    # Only the extra pass is conditional: the arithmetic with the static counts stays
    # outside the cond (under vmap in shard_map, a constant met inside a cond's branch is
    # cast to varying by mistake).
    scaled_l1 = lax.cond(jnp.any(jnp.isinf(l1)), rescaled, lambda: jnp.zeros_like(l1))
    big = jnp.clip(scaled_l1 / safe * np.float32(2.0**shift), 0.0, arith.FLT_MAX)
    # Where the scaled norm is not finite either, an input was: the scale stays so.
    scales = jnp.where(has, jnp.where(jnp.isinf(l1) & jnp.isfinite(scaled_l1), big, l1 / safe), 0.0)
    return Payload({"words": words, "scales": scales}, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    b, nb = buckets(n, self.bucket_size)
    neg = arith.to_buckets(bitpack.unpack_bits(payload.arrays["words"], 1, n), b, nb) != 0
    scale = payload.arrays["scales"][:, None]
    return jnp.where(neg, -scale, scale).reshape(-1)[:n]
