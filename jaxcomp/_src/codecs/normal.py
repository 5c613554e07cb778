r"""MIPD's layer-wise normal-distribution quantization (TPDS 2022, §5), as a codec.

A tensor's values are modelled as ``N(μ, σ²)`` and ``[μ - 3σ, μ + 3σ]`` is cut into
``n`` intervals whose widths follow the 3σ rule: 68% of the intervals lie in
``μ ± σ``, 28% in ``σ..2σ`` and 4% in ``2σ..3σ`` (both sides; equal widths within a
band), so each interval holds about the same number of values. A value is sent as the
index of its interval (``m`` bits plus a sign bit, ``n = 2^{m+1}``) and decoded to the
normal's conditional mean on that interval (eq. 8):

.. math::
  E[g \mid g_1 \le g < g_2] = \mu + \sigma
    \frac{\varphi(a) - \varphi(b)}{\Phi(b) - \Phi(a)},
  \qquad a = \frac{g_1 - \mu}{\sigma}, \; b = \frac{g_2 - \mu}{\sigma}.

Values beyond ``μ ± 3σ`` are the significant ones and are sent exactly. The decoding
error of a value inside the range is at most the width of its interval (eq. 9), and the
largest width is ``σ / c_3`` in the outer band, ``c_3`` the number of intervals per side
there (eq. 10).

Proxies are a fixed function of ``(μ, σ)``: ``μ + σ p_j`` with the standard normal's
conditional means ``p_j``, computed once on the host in float64. jaxcomp sends
``(μ, σ)`` (64 bits per tensor) and the receiver recomputes the ``n`` proxies, instead
of sending the ``n`` proxies themselves as in the paper (``32 n`` bits).

Reference:
  MIPD: an adaptive gradient sparsification framework for distributed DNNs training.
  IEEE TPDS 33(11), 2022. doi:10.1109/TPDS.2022.3154387
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs import sparse
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import _check_float
from jaxcomp._src.codecs.base import check_positive_int
from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack

Array = jax.Array
_F32 = jnp.float32
_FLT_MAX = float(np.finfo(np.float32).max)
_PAPER_SHARES = (0.68, 0.28, 0.04)  # the 3σ rule's shares of the intervals, per 1σ band


def _normal_cdf(z: float) -> float:
  return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _normal_pdf(z: float) -> float:
  return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
  """Integers >= 1 summing to ``total``, proportional to ``shares`` (largest remainder)."""
  raw = shares / shares.sum() * total
  counts = np.floor(raw).astype(np.int64)
  for i in np.argsort(-(raw - counts), kind="stable")[: total - counts.sum()]:
    counts[i] += 1
  while (counts == 0).any():  # every band needs an interval: take from the largest
    counts[np.argmax(counts)] -= 1
    counts[np.argmin(counts)] += 1
  return counts


@functools.lru_cache(maxsize=64)
def intervals_table(intervals: int, sigmas: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The standard normal's intervals on one side: ``(band counts, edges, proxies)``.

  ``counts[j]`` intervals of equal width cut band ``j`` (``[j, min(j+1, sigmas))`` in
  units of σ); ``edges`` (length ``intervals/2 + 1``, from 0 to ``sigmas``) and the
  conditional means ``proxies`` (length ``intervals/2``) are float64, for ``z >= 0``;
  the negative side mirrors them. With ``sigmas=3`` the shares are the paper's
  68/28/4%; otherwise each band's share is its probability under ``N(0, 1)``.
  """
  half = intervals // 2
  nbands = math.ceil(sigmas - 1e-12)
  bounds = [min(float(j), sigmas) for j in range(nbands + 1)]
  if sigmas == 3.0:
    shares = np.asarray(_PAPER_SHARES)
  else:
    shares = np.asarray(
      [_normal_cdf(hi) - _normal_cdf(lo) for lo, hi in zip(bounds[:-1], bounds[1:])]
    )
  if half < nbands:
    raise ValueError(
      f"intervals={intervals} leaves fewer than one interval per band "
      f"({nbands} bands of 1σ on each side): use at least {2 * nbands}"
    )
  counts = _largest_remainder(shares, half)
  edges = [0.0]
  for lo, hi, c in zip(bounds[:-1], bounds[1:], counts):
    edges.extend(lo + (hi - lo) * np.arange(1, c + 1) / c)
  edges = np.asarray(edges)
  edges[-1] = sigmas
  a, b = edges[:-1], edges[1:]
  mass = np.asarray([_normal_cdf(y) - _normal_cdf(x) for x, y in zip(a, b)])
  dens = np.asarray([_normal_pdf(x) - _normal_pdf(y) for x, y in zip(a, b)])
  # Far in the tail the mass underflows; the midpoint is then the conditional mean to
  # within float32 precision of the width.
  proxies = np.where(mass > 1e-300, dens / np.maximum(mass, 1e-300), 0.5 * (a + b))
  return counts, edges, proxies


def _check_intervals(intervals) -> None:
  check_positive_int(intervals, "intervals")
  if intervals < 2 or intervals & (intervals - 1) or intervals > 2**16:
    raise ValueError(
      f"intervals must be a power of two in 2..65536 (m bits plus a sign bit), got {intervals!r}"
    )


def _check_sigmas(sigmas) -> None:
  if isinstance(sigmas, bool) or not isinstance(sigmas, (int, float)) or not 0 < sigmas <= 8:
    raise ValueError(f"sigmas must be a number in (0, 8], got {sigmas!r}")


#: Exponent bound of the power-of-two scales: ``2**±100`` leaves a factor ``2**26`` of room
#: on both sides of float32's normal range, because XLA may fold a constant of the caller's
#: into the scale (``(t / 8) * 2**-e`` compiled as ``t * 2**-(e+3)``), and a folded scale
#: below ``2**-126`` is flushed to zero on XLA:CPU: every value would scale to 0.
_SCALE_EXP = 100


def _pow2_scales(m: Array) -> tuple[Array, Array]:
  """``(2**-e, 2**e)`` for the power of two ``2**e <= m`` of positive float32 ``m``
  (``jnp.frexp``, as ``Cast`` scales fp16), ``e`` clipped to ``[-100, 100]``
  (:data:`_SCALE_EXP`): multiplying by either is exact, and stays so when XLA folds a
  constant factor of the surrounding program into it. Scaled by ``2**-e`` a finite
  float32 is below ``2**29`` and its square far from overflow."""
  _, f = jnp.frexp(m.astype(_F32))  # m = r * 2**f, 0.5 <= r < 1
  e = jnp.clip(f - 1, -_SCALE_EXP, _SCALE_EXP)
  one = jnp.ones_like(m, _F32)
  return jnp.ldexp(one, -e), jnp.ldexp(one, e)


def moments(x: Array) -> tuple[Array, Array]:
  """(μ, σ) of the flat float32 ``x``, population standard deviation.

  Computed on ``x · 2**-e`` (``2**e`` the power of two of ``max|x|``) and scaled back,
  so it stays finite and non-zero for every finite ``x`` (unscaled, ``(x - μ)**2``
  overflows float32 once ``|x - μ| > 1.8e19`` and flushes to zero below ~1e-19).
  Power-of-two scaling is exact: where the plain formulas neither overflow nor
  underflow this is the same arithmetic up to the order XLA sums in. Compiled alone,
  both give the same bits (``tests/test_extremes.py``); inside a larger program
  XLA:CPU may sum the scaled operand in another order than it summed ``x`` (a
  last-bit difference). ``|μ|`` and ``σ`` are clipped to ``max|x|``, which bounds both,
  so rounding cannot push them past ``FLT_MAX`` either.
  """
  count = jnp.float32(max(x.shape[0], 1))
  amax = jnp.max(jnp.abs(x), initial=0.0)
  down, up = _pow2_scales(amax)
  xs, bound = x * down, amax * down
  mu = jnp.clip(jnp.sum(xs) / count, -bound, bound)
  sigma = jnp.minimum(jnp.sqrt(jnp.sum(jnp.square(xs - mu)) / count), bound)
  return mu * up, sigma * up


def interval_codes(
  x: Array, mu: Array, sigma: Array, intervals: int, sigmas: float
) -> tuple[Array, Array]:
  """Interval index (uint32, ``side · n/2 + j``) of each value, and the outlier mask.

  ``side`` is 1 below μ. The index within a side comes from the band (``floor(|z|)``)
  and the equal widths inside it: no search. Outliers (``|z| > sigmas``) get the outer
  interval's code; the caller sends their values exactly.
  """
  counts, _, _ = intervals_table(intervals, sigmas)
  half = intervals // 2
  safe = jnp.where(sigma > 0, sigma, 1.0)
  # z = (x - μ) / σ as XLA compiles a division by a broadcast scalar, a multiply by the
  # reciprocal; inverse_scale keeps that reciprocal normal for σ >= 2**126 (a flushed
  # one would put every value in the innermost interval on XLA:CPU).
  inv, k = arith.inverse_scale(safe)
  z = (x - mu) * inv * k
  a = jnp.abs(z)
  idx = jnp.zeros(x.shape, _F32)
  offset = 0
  for j, c in enumerate(counts):
    lo, hi = float(j), min(float(j + 1), sigmas)
    inside = jnp.floor((a - lo) * jnp.float32(c / (hi - lo)))
    inside = jnp.clip(inside, 0.0, float(c - 1)) + offset
    idx = jnp.where(a >= lo, inside, idx) if j else inside
    offset += int(c)
  idx = jnp.clip(idx, 0.0, float(half - 1)).astype(jnp.uint32)
  codes = idx + jnp.where(z < 0, jnp.uint32(half), jnp.uint32(0))
  outlier = (a > sigmas) & (sigma > 0)
  return codes, outlier


def proxy_values(codes: Array, mu: Array, sigma: Array, intervals: int, sigmas: float) -> Array:
  """Decoded values ``μ ± σ p_j`` of interval codes (float32).

  ``μ + σ p_j`` as written, except where that overflows although ``(μ, σ)`` are finite
  (an interval reaching past float32's range, or ``σ p_j`` alone past ``FLT_MAX``):
  there it is computed as ``(μ·2**-e + (σ·2**-e)·p_j)·2**e``, ``2**e`` the power of two
  of ``max(|μ|, σ)``, and clipped to ``±FLT_MAX``. The value it stands for is finite and
  lies in the same interval, so the clip only moves the proxy towards it. Non-finite
  ``(μ, σ)`` (a flagged tensor) stay non-finite.
  """
  _, _, proxies = intervals_table(intervals, sigmas)
  table = jnp.asarray(np.concatenate([proxies, -proxies]), _F32)
  index = jnp.minimum(codes, intervals - 1).astype(jnp.int32)
  finite = jnp.isfinite(mu) & jnp.isfinite(sigma)

  def proxy(p):
    plain = mu + sigma * p
    down, up = _pow2_scales(jnp.maximum(jnp.abs(mu), sigma))
    scaled = jnp.clip((mu * down + (sigma * down) * p) * up, -_FLT_MAX, _FLT_MAX)
    return jnp.where(jnp.isfinite(plain) | ~finite, plain, scaled)

  if jnp.ndim(mu) == 0 and jnp.ndim(sigma) == 0:
    # One tensor's (μ, σ): its `intervals` values, then a gather. As a cond's output the
    # small table is computed once; fused into the gather XLA:CPU would redo it per value.
    return lax.cond(finite, proxy, lambda p: mu + sigma * p, table)[index]
  return proxy(table[index])


@dataclasses.dataclass(frozen=True)
class NormalQuantizer(Codec):
  r"""MIPD's normal-distribution quantizer: 3σ-rule intervals, conditional-mean proxies.

  Per tensor: ``μ`` and ``σ`` of its values; each value within ``μ ± sigmas·σ`` is sent
  as the ``log2(intervals)``-bit index of its interval and decoded to the interval's
  conditional mean under ``N(μ, σ²)`` (module docstring, eq. 8). Values beyond it are
  sent exactly as (index, float32) pairs in a static capacity of
  ``ceil(outlier_fraction · n)`` slots (at least one). Deterministic and biased
  (a value decodes to its interval's mean under the model, not to itself on average).

  When more values than the capacity lie outside: :meth:`encode_with_info` reports the
  overflow, the outliers beyond the capacity decode to the outer interval's proxy, and
  :attr:`fallback` is the same quantizer with room for every value, which
  :func:`jaxcomp.compress` (``collective="allgather"``) sends instead on every device,
  so nothing is lost there; it counts these steps in ``overflow_count``.

  Wire format: codes packed into uint32 words (``log2(intervals)`` bits each), ``(μ, σ)``
  float32, outlier indices (uint8/uint16/int32 by ``n``) and float32 values. The
  receiver recomputes the proxies from ``(μ, σ)``.

  Args:
    intervals: ``n``, a power of two; codes are ``log2(n)`` bits (``m`` bits plus a
      sign bit). 256 gives the paper's int8 codes.
    sigmas: half-width of the quantized range in σ (3: the 3σ rule). Bands are 1σ
      wide; with ``sigmas=3`` they get the paper's 68/28/4% of the intervals, otherwise
      each band's share is its normal probability.
    outlier_fraction: capacity of exactly-sent values beyond the range, as a fraction
      of the tensor (a normal puts 0.27% beyond 3σ; gradients have heavier tails).

  >>> import jax, jax.numpy as jnp, jaxcomp as jc
  >>> q = jc.codecs.NormalQuantizer(intervals=256)
  >>> x = jax.random.normal(jax.random.key(0), (4096,))
  >>> y = q.decode(q.encode(x))
  >>> bool(jnp.max(jnp.abs(y - x)) <= 0.2 * jnp.std(x) + 1e-6), q.wire_bits(x.shape)
  (True, 34800)
  """

  intervals: int = 256
  sigmas: float = 3.0
  outlier_fraction: float = 0.01

  def __post_init__(self):
    _check_intervals(self.intervals)
    _check_sigmas(self.sigmas)
    object.__setattr__(self, "sigmas", float(self.sigmas))
    sparse.check_density(self.outlier_fraction, "outlier_fraction")
    intervals_table(self.intervals, self.sigmas)  # validates intervals vs bands

  @property
  def bits(self) -> int:
    """Bits per code: ``m`` magnitude bits plus the sign bit."""
    return int(self.intervals).bit_length() - 1

  @property
  def max_error(self) -> float:
    """Largest interval width in units of σ: the bound of eq. (10) on ``|x - decode|``."""
    _, edges, _ = intervals_table(self.intervals, self.sigmas)
    return float(np.max(np.diff(edges)))

  @property
  def fallback(self) -> NormalQuantizer | None:
    if self.outlier_fraction >= 1:
      return None
    return dataclasses.replace(self, outlier_fraction=1.0)

  def capacity(self, n: int) -> int:
    """Static number of exactly-sent outliers for a tensor of ``n`` values."""
    return sparse.num_entries(self.outlier_fraction, n)

  def encode_with_info(self, x: Array, *, key: Array | None = None) -> tuple[Payload, Array]:
    del key
    _check_float(x)
    n = x.size
    flat = x.reshape(-1).astype(_F32)
    mu, sigma = moments(flat)
    codes, outlier = interval_codes(flat, mu, sigma, self.intervals, self.sigmas)
    cap = self.capacity(n)
    idx = sparse.compact(outlier, cap)
    values = jnp.where(idx < n, flat[jnp.minimum(idx, max(n - 1, 0))], 0.0)
    overflow = jnp.sum(outlier, dtype=jnp.int32) > cap
    arrays = {
      "words": bitpack.pack_bits(codes, self.bits),
      "stats": jnp.stack([mu, sigma]),
      "outlier_indices": idx.astype(sparse.index_dtype(n)),
      "outlier_values": values,
    }
    return Payload(arrays, tuple(x.shape), jnp.dtype(x.dtype)), overflow

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    return self.encode_with_info(x, key=key)[0]

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    arrays = payload.arrays
    codes = bitpack.unpack_bits(arrays["words"], self.bits, n)
    mu, sigma = arrays["stats"][0], arrays["stats"][1]
    out = proxy_values(codes, mu, sigma, self.intervals, self.sigmas)
    idx = arrays["outlier_indices"].astype(jnp.int32)
    return out.at[idx].set(arrays["outlier_values"], mode="drop")
