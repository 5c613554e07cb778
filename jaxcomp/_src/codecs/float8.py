"""FP8 with a power-of-two scale per block: MXFP8's wire format (OCP MX v1.0).

Hopper and later GPUs compute in FP8, and FP8 is what FSDP implementations gather
their weights in (torchtitan's float8 all-gather). Each block of values shares one
power-of-two scale held in an E8M0 byte, so a decode is an exact multiplication and
the element format keeps its full relative precision across the block's range: unlike
int8 blocks, a value much smaller than its block's largest keeps its significant bits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import _check_float
from jaxcomp._src.codecs.base import buckets
from jaxcomp._src.codecs.base import check_positive_int
from jaxcomp._src.plumbing import rng
from jaxcomp._src.plumbing.arith import row_absmax_finite
from jaxcomp._src.plumbing.arith import to_buckets

Array = jax.Array
_F32 = jnp.float32
_FLT_MAX = np.float32(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class _Format:
  """An FP8 element format: its dtype, mantissa bits, exponent bias (the smallest
  normal exponent is ``1 - bias``) and largest finite value."""

  dtype: Any
  mantissa_bits: int
  bias: int
  max_finite: float

  @property
  def min_exponent(self) -> int:
    return 1 - self.bias


FORMATS = {
  "e4m3": _Format(jnp.float8_e4m3fn, 3, 7, 448.0),
  "e5m2": _Format(jnp.float8_e5m2, 2, 15, 57344.0),
}
ROUNDINGS = ("nearest", "stochastic")
#: E8M0 scale bytes: 2^(byte - 127); 255 is NaN (the scale of a non-finite block).
SCALE_BIAS, SCALE_NAN = 127, 255
#: Smallest scale exponent used: 2^-126 is float32's smallest normal, so a scale is a
#: normal float32 built from its bits (E8M0 allows 2^-127, a float32 subnormal).
_MIN_SCALE_EXP = -126


def _pow2(e: Array) -> Array:
  """``2.0**e`` in float32 for integer ``e`` in [-126, 127], from its exponent bits."""
  return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, _F32)


@dataclasses.dataclass(frozen=True)
class Float8(Codec):
  r"""FP8 values (E4M3 or E5M2) with a power-of-two scale per block (MXFP8, OCP MX v1.0).

  Each block ``v`` of ``block_size`` consecutive values of the flattened tensor (the
  last one shorter; ``block_size=None``: one block per tensor) gets a scale ``2^e``,
  sent as an E8M0 byte ``e + 127``, and its values are sent as FP8 codes of ``v / 2^e``:

  .. math::
    e = \min\{\, e \in \mathbb{Z} : \max_i |v_i| \le M \, 2^e \,\}, \qquad
    \hat v_i = 2^e \, \mathrm{fp8}(v_i / 2^e),

  with ``M`` the format's largest finite value (448 for E4M3, 57344 for E5M2). Nothing
  saturates: the block's largest value maps at or below ``M``. (OCP MX's rule
  ``e = floor(log2 max|v|) - emax`` can map it up to ``2M/1.75`` and clamps there; the
  smallest ``e`` that fits costs at most one bit of range at the bottom and keeps the
  error bound below for every value.)

  ``rounding="nearest"`` rounds ``v_i / 2^e`` to the nearest FP8 value, ties to even
  (exactly ``ml_dtypes``' cast, deterministic). ``rounding="stochastic"`` rounds it to
  one of its two FP8 neighbours with probabilities that make it unbiased,
  ``E[\hat v_i] = v_i`` (the random bits of :mod:`jaxcomp._src.plumbing.rng`, on a
  ``2^{-24}`` grid). With ``m`` mantissa bits and ``e_min`` the format's smallest normal
  exponent (E4M3: 3, -6; E5M2: 2, -14), the error of each value is at most half an ulp
  at nearest and under one ulp stochastically, subnormals included:

  .. math::
    |\hat v_i - v_i| \le 2^{-(m+1)} |v_i| + 2^{e + e_{\min} - m - 1} \quad \text{(nearest)},
    \qquad
    |\hat v_i - v_i| < 2^{-m} |v_i| + 2^{e + e_{\min} - m} \quad \text{(stochastic)}.

  (Plus float32's rounding, for a block whose scale is near float32's smallest normal:
  the scale exponent is at least -126.) Decoded to a narrower dtype (bfloat16), the
  float32 decode is then rounded to it. A block holding a NaN or an infinity gets
  E8M0's NaN scale (255) and decodes to NaN, as :class:`BlockInt8` and :class:`QSGD`
  do: never hidden. It is biased at nearest (for weights, the point: the same weights
  on every device and call) and unbiased stochastically (for gradients).

  Wire format: ``n`` FP8 codes, the bytes of ``jnp.float8_e4m3fn`` or
  ``jnp.float8_e5m2`` held as uint8 (``lax.bitcast_convert_type`` makes them FP8
  arrays), and ``ceil(n / block_size)`` uint8 E8M0 scales: ``8 + 8 / block_size`` bits
  per value, 8.25 for MX's blocks of 32.

  Args:
    format: ``"e4m3"`` (the default: more precision, E4M3FN with no infinity) or
      ``"e5m2"`` (more range, less precision).
    block_size: values per scale, 32 by default (MX's), or ``None`` for one scale per
      tensor.
    rounding: ``"nearest"`` (the default) or ``"stochastic"`` (needs ``key``).

  Example:
    >>> import jax.numpy as jnp, jaxcomp as jc
    >>> codec = jc.codecs.Float8(block_size=4)
    >>> codec.decode(codec.encode(jnp.array([1.0, -0.3, 0.01, 100.0]))).tolist()
    [1.0, -0.3125, 0.009765625, 96.0]

  References:
    Open Compute Project. *OCP Microscaling Formats (MX) Specification v1.0*. 2023.
    https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf

    Micikevicius et al. *FP8 Formats for Deep Learning*. 2022.
    https://arxiv.org/abs/2209.05433
  """

  format: str = "e4m3"
  block_size: int | None = 32
  rounding: str = "nearest"

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ValueError(f"format must be one of {tuple(FORMATS)}, got {self.format!r}")
    check_positive_int(self.block_size, "block_size", allow_none=True)
    if self.rounding not in ROUNDINGS:
      raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")

  @property
  def needs_key(self) -> bool:  # type: ignore[override]
    return self.rounding == "stochastic"

  @property
  def spec(self) -> _Format:
    """The element format's parameters."""
    return FORMATS[self.format]

  def scale_exponents(self, amax: Array) -> Array:
    """The smallest integer ``e`` with ``amax <= M 2^e`` (int32), at least -126.

    With ``amax = f 2^E``, ``f`` in [1/2, 1) (``frexp``), ``M = 1.75 · 2^emax``:
    ``amax / 2^(E - 1 - emax) = 2^(emax + 1) f`` fits under ``M`` iff ``f <= 7/8``,
    so ``e = E - 1 - emax + (f > 7/8)``, exactly, with no division.
    """
    f, big_e = jnp.frexp(amax)
    emax = int(math.log2(self.spec.max_finite / 1.75))
    e = big_e - 1 - emax + (f > np.float32(0.875)).astype(big_e.dtype)
    return jnp.where(amax > 0, jnp.maximum(e, _MIN_SCALE_EXP), 0).astype(jnp.int32)

  def round_scaled(self, y: Array, key: Array | None) -> Array:
    """``y`` (float32, ``|y| <= M``) rounded to the FP8 grid, as float32 on that grid.

    ``t = |y| / ulp(y)`` with ``ulp(y) = 2^(max(floor(log2|y|), e_min) - m)`` (an exact
    power-of-two scaling), rounded to an integer half to even or stochastically
    (:func:`jaxcomp._src.plumbing.rng.bernoulli_round`); ``t ulp`` is an FP8 value (the
    top of a binade rounds up to the next power of two, and ``M`` is on the grid).
    """
    s = self.spec
    # floor(log2|y|) read off float32's exponent bits (frexp is several times slower on
    # XLA:CPU); a float32 subnormal or zero reads -127, under e_min either way.
    biased = (lax.bitcast_convert_type(y, jnp.int32) >> 23) & 0xFF
    ulp_exp = jnp.maximum(biased - 127, s.min_exponent) - s.mantissa_bits
    t = jnp.abs(y) * _pow2(-ulp_exp)
    if self.rounding == "nearest":
      q = jnp.round(t)  # half to even: FP8's ties (the parity of t is the last bit)
    else:
      q = rng.bernoulli_round(t, key)
    return jnp.copysign(q * _pow2(ulp_exp), y)

  def fp8_bits(self, r: Array) -> Array:
    """The FP8 bit patterns (uint8) of float32 values ``r`` already on the FP8 grid.

    Assembled from ``r``'s float32 bits (sign; exponent rebiased; the top mantissa
    bits), or for FP8's subnormals from ``|r| / 2^(e_min - m)``, an integer: the same
    bytes as ``r.astype(jnp.float8_*)``, several times faster on XLA:CPU, whose float8
    arrays take slow paths (a reshape or slice of them copies element by element).
    """
    s = self.spec
    m = s.mantissa_bits
    b = lax.bitcast_convert_type(r, jnp.uint32)
    exp_field = ((b >> 23) & 0xFF) - np.uint32(127 - s.bias)
    normal = (exp_field << m) | ((b >> (23 - m)) & np.uint32(2**m - 1))
    a = jnp.abs(r)
    sub = (a * np.float32(2.0 ** (m - s.min_exponent))).astype(jnp.uint32)
    code = jnp.where(a < np.float32(2.0**s.min_exponent), sub, normal)
    return (code | ((b >> 31) << 7)).astype(jnp.uint8)

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    _check_float(x)
    if self.needs_key:
      key = self._require_key(key)
    n = x.size
    b, nb = buckets(n, self.block_size)
    v = to_buckets(x.reshape(-1).astype(_F32), b, nb)
    amax, finite = row_absmax_finite(v)
    e = self.scale_exponents(jnp.where(finite, amax, 0.0))
    y = jnp.where(finite[:, None], v * _pow2(-e)[:, None], 0.0)
    codes = self.fp8_bits(self.round_scaled(y, key)).reshape(-1)[:n]
    scales = jnp.where(finite, e + SCALE_BIAS, SCALE_NAN).astype(jnp.uint8)
    return Payload({"codes": codes, "scales": scales}, tuple(x.shape), jnp.dtype(x.dtype))

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    b, nb = buckets(n, self.block_size)
    byte = payload.arrays["scales"].astype(jnp.int32)
    # E8M0 byte 0 (2^-127) is a float32 subnormal: built as 2^-126 / 2.
    scale = jnp.where(byte > 0, _pow2(jnp.maximum(byte, 1) - SCALE_BIAS), np.float32(2.0**-127))
    scale = jnp.where(byte == SCALE_NAN, jnp.nan, scale)
    codes = lax.bitcast_convert_type(payload.arrays["codes"], self.spec.dtype)
    q = to_buckets(codes.astype(_F32), b, nb)
    # A block whose largest value is within half an ulp of FLT_MAX rounds up to 2^128:
    # clamped back to FLT_MAX (NaN, the mark of a non-finite block, passes through).
    return jnp.clip(q * scale[:, None], -_FLT_MAX, _FLT_MAX).reshape(-1)[:n]
