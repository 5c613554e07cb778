"""What the kernels share: the backend choice, the launch, dispatch.

Backends (:func:`pick_backend`): Mosaic GPU (``plgpu.kernel``, :mod:`._mosaic`), jax's
maintained GPU backend, where this jax (>= 0.12), the GPU (sm_90 or newer; any in
interpret mode) and the shape (:func:`._mosaic.misfit`) allow; else Pallas on Triton
(``pl.pallas_call`` with ``jax.experimental.pallas.triton.CompilerParams``, the kernel
bodies in the per-kernel modules). The Triton versions stay while the supported jax range
needs them: jax 0.10 has no Mosaic GPU interpret mode to test against, Ampere GPUs have
no Mosaic GPU. Where Mosaic GPU runs, the codecs compile nothing for Triton: the Mosaic
GPU kernels take every shape of 1-, 2- or 4-bit codes, and 8- or 16-bit codes go to the
XLA path (:func:`_triton_superseded`; a direct kernel call may still pick Triton).
jax deprecates the Triton backend from 0.11 and will remove it; where neither backend
can run, the codecs use the XLA path and warn once (:func:`use_pallas`,
:func:`no_backend_for`). jax >= 0.11 needs the target GPU to lower Triton kernels
without one (``tests/test_kernels.py`` exports under an abstract H100).

The arithmetic every path shares, the XLA path's included (reciprocals, the bucket
statistics that are sums and are computed before a kernel in one fixed order), is
:mod:`jaxcomp._src.plumbing.arith`. Triton lowers ``x / y`` on float32 to PTX ``div.full.f32``
(an approximation within 2 ulp), while XLA divides with correct rounding, so the
compiled Triton kernels pass :func:`div` (inline ``div.rn.f32``) to
:func:`jaxcomp._src.plumbing.arith.inverse_scale`; interpret mode and Mosaic GPU divide exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
from jax import lax
import jax.numpy as jnp

from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import rng

from . import _mosaic

Array = jax.Array

#: What ``implementation=`` may be on a codec.
IMPLEMENTATIONS = (None, "xla", "pallas", "native")


@functools.cache
def cuda_available() -> bool:
  """Whether jax's default backend is an NVIDIA GPU (the kernels' compiled target)."""
  try:
    devices = jax.devices()
  except RuntimeError:
    return False
  if not devices or devices[0].platform != "gpu":
    return False
  version = str(getattr(devices[0].client, "platform_version", "")).lower()
  return "rocm" not in version and "hip" not in version


def resolve_interpret(interpret: bool | None) -> bool:
  """``None``: compiled on a CUDA GPU, interpret mode anywhere else."""
  if interpret is None:
    return not cuda_available()
  if not isinstance(interpret, bool):
    raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
  return interpret


def check_implementation(implementation) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be None, 'xla', 'pallas' or 'native', got {implementation!r}"
    )


#: The oldest GPU (compute capability) Pallas's Triton backend supports (Ampere).
TRITON_MIN_CAPABILITY = (8, 0)


def _import_pallas():
  from jax.experimental import pallas

  return pallas


def _import_triton():
  from jax.experimental.pallas import triton

  return triton


def compute_capability() -> tuple[int, int] | None:
  """The default device's CUDA compute capability, ``None`` when it is not a CUDA GPU."""
  if not cuda_available():
    return None
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  try:
    major, minor = cc.split(".")[:2]
    return int(major), int(minor)
  except ValueError:
    return None


def triton_unavailable(*, interpret: bool) -> str | None:
  """Why this jax (and GPU) cannot run the Triton kernels (``None``: it can).

  Interpret mode needs Pallas only (its generic interpreter). Compiled, they lower
  through Pallas's Triton backend (``jax.experimental.pallas.triton``), which must import
  (jax deprecates it from 0.11 and will remove it) and supports compute capability 8.0
  (Ampere) and newer.
  """
  try:
    _import_pallas()
  except ImportError as e:
    return f"jax.experimental.pallas does not import: {e}"
  if interpret:
    return None
  try:
    _import_triton()
  except ImportError as e:
    return f"this jax has no Pallas Triton backend: {e}"
  cc = compute_capability()
  if cc is not None and cc < TRITON_MIN_CAPABILITY:
    return (
      f"the GPU has compute capability {cc[0]}.{cc[1]}, Pallas's Triton backend needs "
      f"{TRITON_MIN_CAPABILITY[0]}.{TRITON_MIN_CAPABILITY[1]} or newer"
    )
  return None


#: The kernels' backends, in order of preference.
BACKENDS = ("mosaic_gpu", "triton")


def _why_not(backend: str, misfit: str | None, *, interpret: bool) -> str | None:
  if backend == "triton":
    return triton_unavailable(interpret=interpret)
  try:
    _import_pallas()
  except ImportError as e:
    return f"jax.experimental.pallas does not import: {e}"
  capability = None if interpret else compute_capability()
  return _mosaic.unavailable(interpret=interpret, capability=capability) or misfit


def pick_backend(misfit: str | None, *, interpret: bool, backend: str | None = None) -> str:
  """The backend a kernel call runs on: ``backend`` if given, else Mosaic GPU where it
  can run this shape (``misfit`` is :func:`jaxcomp.kernels._mosaic.misfit`'s answer),
  else Triton. Raises ``ValueError`` saying why when the one asked for (or every one)
  cannot run here."""
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"backend must be None, 'mosaic_gpu' or 'triton', got {backend!r}")
  reasons = []
  for name in BACKENDS if backend is None else (backend,):
    why = _why_not(name, misfit, interpret=interpret)
    if why is None:
      return name
    reasons.append(f"{name}: {why}")
  raise ValueError("no Pallas backend can run this kernel here (" + "; ".join(reasons) + ")")


def _triton_superseded(*, interpret: bool) -> str | None:
  """Why the codecs do not compile a shape for Triton that Mosaic GPU refuses (8- and
  16-bit codes) where Mosaic GPU runs (``None``: they may): jax deprecates Triton from
  0.11 and will remove it, and the XLA path sends the same payload. The codecs keep
  Triton where Mosaic GPU cannot run at all (jax < 0.12, GPUs older than sm_90); a
  direct kernel call still picks it (:func:`pick_backend`), and interpret mode (the CPU
  tests) keeps it."""
  if interpret:
    return None
  if _why_not("mosaic_gpu", None, interpret=interpret) is None:
    return "Mosaic GPU runs here; the deprecated Triton backend is not used for shapes it refuses"
  return None


def unavailable(*, interpret: bool) -> str | None:
  """Why no backend can run the kernels here, for any shape (``None``: one can)."""
  reasons = []
  for name in BACKENDS:
    why = _why_not(name, None, interpret=interpret)
    if why is None:
      return None
    reasons.append(why)
  return "; ".join(reasons)


def no_backend_for(misfit: str | None) -> str | None:
  """Why no backend can run a kernel on this shape in the codecs' mode here (interpret
  mode off a CUDA GPU), ``None`` when one can; ``misfit`` is
  :func:`jaxcomp.kernels._mosaic.misfit`'s answer for the shape. The codecs then use the
  XLA path for it, with one :class:`KernelFallbackWarning` (whatever the shape)."""
  interpret = not cuda_available()
  try:
    if pick_backend(misfit, interpret=interpret) == "triton":
      superseded = _triton_superseded(interpret=interpret)
      if superseded is not None:
        raise ValueError(f"mosaic_gpu: {misfit}; triton: {superseded}")
  except ValueError as e:
    reasons = [why for name in BACKENDS if (why := _why_not(name, None, interpret=interpret))]
    if (why := _triton_superseded(interpret=interpret)) is not None:
      reasons.append(why)
    reasons.append("the Mosaic GPU kernels pack only 1-, 2- and 4-bit codes")
    warn_fallback("; ".join(reasons))
    return str(e)
  return None


#: Reasons already warned about (each once per process).
_warned: set[str] = set()


class KernelFallbackWarning(RuntimeWarning):
  """The Pallas kernels cannot run here: the codecs use the XLA path instead."""


def warn_fallback(reason: str) -> None:
  """Warns once per process and reason that the codecs fall back to the XLA path."""
  if reason in _warned:
    return
  _warned.add(reason)
  warnings.warn(
    f"jaxcomp's Pallas kernels cannot run here ({reason}); the codecs use the XLA path "
    f"instead (the same payloads).",
    KernelFallbackWarning,
    stacklevel=3,
  )


def use_pallas(implementation: str | None) -> bool:
  """Whether a codec's ``implementation`` asks for the kernels, and they can run here.

  ``None`` picks them on a CUDA GPU (and the native CPU kernels, or XLA, elsewhere:
  :func:`jaxcomp.kernels.cpu.use_by_default`); ``"pallas"`` always (interpret mode off
  GPU, slow but exact: what the CPU tests run); ``"xla"`` and ``"native"`` never. Where
  the installed jax or the GPU cannot run them (:func:`unavailable`), the answer is
  ``False`` with one :class:`KernelFallbackWarning`: a codec never breaks for it.
  """
  check_implementation(implementation)
  if implementation is None:
    if not cuda_available():
      return False
    why = unavailable(interpret=False)
  elif implementation == "pallas":
    why = unavailable(interpret=not cuda_available())
  else:
    return False
  if why is not None:
    warn_fallback(why)
    return False
  return True


#: Input dtypes the encoding kernels read (others fall back to XLA).
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_bucketing(n: int, bucket_size: int | None, dtype) -> str | None:
  """Why a bucketed kernel cannot take this tensor (``None`` when it can).

  Bucketed kernels need a power-of-two bucket of 32..65536 values (one bucket per
  tensor is a whole-tensor reduction: an XLA job), a float16/bfloat16/float32 input
  and ``0 < n < 2**30`` (int32 indices, with room for the last block's padding).
  """
  if bucket_size is None:
    return "bucket_size=None (one bucket per tensor)"
  if not arith.is_power_of_two(bucket_size) or not 32 <= bucket_size <= 65536:
    return f"bucket_size {bucket_size} is not a power of two in 32..65536"
  if jnp.dtype(dtype) not in DTYPES:
    return f"dtype {jnp.dtype(dtype)}"
  if not 0 < n < 2**30:
    return f"{n} values (the kernels take 1 to 2**30 - 1)"
  return None


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """Tuning knobs shared by the kernels.

  Attributes:
    block_size: values per program (a power of two; rounded up to whole buckets).
    num_warps: Triton warps per program.
    num_stages: Triton pipeline stages.
  """

  block_size: int = 8192
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_size", "num_warps", "num_stages"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not arith.is_power_of_two(self.block_size):
      raise ValueError(f"block_size must be a power of two, got {self.block_size}")

  def rows(self, bucket: int) -> int:
    """Buckets per program."""
    return max(1, self.block_size // bucket)

  def compiler_params(self):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def div(x: Array, y: Array, *, exact_asm: bool) -> Array:
  """float32 ``x / y`` with correct rounding, in a compiled kernel or in interpret mode."""
  if not exact_asm:
    return x / y
  from jax.experimental.pallas import triton as pltriton

  x, y = jnp.broadcast_arrays(x, y)
  [out] = pltriton.elementwise_inline_asm(
    "div.rn.f32 $0, $1, $2;",
    args=[x, y],
    constraints="=f,f,f",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
  )
  return out


def key_words_array(key: Array) -> Array:
  """The two uint32 hash seeds of ``key`` (:func:`jaxcomp._src.plumbing.rng.key_words`)
  as ``(2,)``."""
  k0, k1 = rng.key_words(key)
  return jnp.stack([k0, k1])


def out_struct(like: Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
  """A ``pallas_call`` output type that varies over the mesh axes ``like`` varies over.

  Inside ``jax.shard_map`` with ``check_vma`` Pallas needs to know over which manual
  axes an output varies; the kernels' outputs vary like their main input.
  """
  aval = jax.typeof(like)
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if mat is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  vma = getattr(aval, "vma", None)  # older spelling
  if vma:
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
  return jax.ShapeDtypeStruct(shape, dtype)


def varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` is typed device-varying (shard_map's check_vma)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def check_interpretable(interpret: bool, *arrays: Array) -> None:
  """Pallas's interpreter cannot run on values typed as varying under ``check_vma``.

  Its grid loop slices device-varying blocks with a device-invariant loop index, which
  ``jax.shard_map(check_vma=True)`` rejects while lowering. Compiled kernels are not
  affected. Raise a clear error instead of that one.
  """
  if not interpret:
    return
  axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
  if axes:
    raise ValueError(
      f"jaxcomp's Pallas kernels run in interpret mode here (no CUDA GPU), and Pallas's "
      f"interpreter cannot run on values that vary over the manual axes {sorted(axes)} "
      f"of a jax.shard_map with check_vma=True. Use implementation='xla' (bit-identical "
      f"payloads), jax.shard_map(..., check_vma=False), or jax.pmap."
    )


def load_buckets(x_ref, e_ref, *, n: int, rows: int, bucket: int):
  """A program's block of ``rows`` buckets: ``(start, idx, v, x32)``.

  ``start`` is the flat index of the block's first value, ``idx`` (int32, ``(rows,
  bucket)``) every value's flat index, ``v`` the float32 values to encode, zero past
  ``n`` (the last bucket's padding; a ragged block's tail, which Pallas leaves
  undefined). With an error-feedback residual ``e_ref`` (else ``None``), ``x32 = x + e``
  in float32 and ``v = fl_{x.dtype}(x32)``, what :func:`jaxcomp.compress` encodes.
  """
  from jax.experimental import pallas as pl

  start = pl.program_id(0) * (rows * bucket)
  idx = (
    lax.broadcasted_iota(jnp.int32, (rows, bucket), 0) * bucket
    + lax.broadcasted_iota(jnp.int32, (rows, bucket), 1)
    + start
  )
  x = x_ref[...].reshape(rows, bucket)
  x32 = None
  if e_ref is not None:
    x32 = x.astype(jnp.float32) + e_ref[...].reshape(rows, bucket)
    v = x32.astype(x.dtype).astype(jnp.float32)
  else:
    v = x.astype(jnp.float32)
  return start, idx, jnp.where(idx < n, v, 0.0), x32


def check_residual(x: Array, residual: Array | None) -> None:
  if residual is not None and (residual.shape != x.shape or residual.dtype != jnp.float32):
    raise ValueError(
      f"residual must be float32 of shape {x.shape}, got {residual.dtype} {residual.shape}"
    )


def call_encoder(
  body,
  x: Array,
  residual: Array | None,
  *,
  name: str,
  bucket: int,
  config: LaunchConfig,
  interpret: bool,
  outputs,
  lead=(),
  per_bucket=(),
) -> tuple[Array, ...]:
  """Runs an encoding kernel over ``x``'s buckets, one program per ``config.rows`` buckets.

  ``body(*lead_refs, *bucket_refs, x_ref, [e_ref], *output_refs, [new_e_ref])`` sees
  each ``lead`` array whole, the block's ``rows`` entries of each ``per_bucket`` array
  (one value per bucket: statistics computed before the kernel), and a block of ``rows
  * bucket`` values of the flat ``x`` (and of the residual). ``outputs`` lists
  ``(shape, dtype, values_per_block)`` of the payload arrays, each a 1-D array written
  one block per program. With a residual, the last result is the new float32 residual
  in ``x``'s shape.
  """
  from jax.experimental import pallas as pl

  check_residual(x, residual)
  n = x.size
  rows = config.rows(bucket)
  nb = -(-n // bucket)
  flat = pl.BlockSpec((rows * bucket,), lambda i: (i,))
  in_specs = [pl.BlockSpec(a.shape, lambda i, nd=a.ndim: (0,) * nd) for a in lead]
  in_specs += [pl.BlockSpec((rows,), lambda i: (i,)) for _ in per_bucket] + [flat]
  args = [*lead, *per_bucket, x.reshape(-1)]
  out_shape = [out_struct(x, shape, dtype) for shape, dtype, _ in outputs]
  out_specs = [pl.BlockSpec((block,), lambda i: (i,)) for _, _, block in outputs]
  if residual is not None:
    in_specs.append(flat)
    args.append(residual.reshape(-1))
    out_shape.append(out_struct(x, (n,), jnp.float32))
    out_specs.append(flat)
  outs = pl.pallas_call(
    body,
    out_shape=tuple(out_shape),
    grid=(-(-nb // rows),),
    in_specs=in_specs,
    out_specs=tuple(out_specs),
    interpret=interpret,
    compiler_params=None if interpret else config.compiler_params(),
    name=name,
  )(*args)
  if residual is not None:
    return (*outs[:-1], outs[-1].reshape(x.shape))
  return tuple(outs)


def call_decoder(
  decode,
  words: Array,
  per_bucket: dict[str, Array],
  *,
  n: int,
  bits: int,
  bucket: int,
  name: str,
  config: LaunchConfig,
  interpret: bool | None,
  backend: str | None = None,
  mosaic_decode=None,
) -> Array:
  """Sums K stacked payloads decoded block by block: one pass, adds in rank order.

  ``words`` is uint32 ``(K, ceil(n * bits / 32))`` (lanes layout), each array of
  ``per_bucket`` float32 ``(K, ceil(n / bucket))``. ``decode(words_block, *bucket_rows,
  rows=, bucket=, exact_asm=)`` returns the float32 ``(rows, bucket)`` values of one
  payload's block. The K payloads are read in a loop inside each program (not
  unrolled; K need not be a power of two) and added ``((d_0 + d_1) + d_2) + ...``, the
  order of :meth:`jaxcomp.codecs.Codec.decode_sum`. Returns float32 ``(n,)``.

  On Mosaic GPU (:func:`pick_backend`) ``mosaic_decode(codes_tile, *bucket_scalars)``
  decodes instead (:func:`jaxcomp.kernels._mosaic.decode_sum`).
  """
  from jax.experimental import pallas as pl

  want = bitpack.num_words(n, bits)
  if words.ndim != 2 or words.shape[1] != want or words.dtype != jnp.uint32:
    raise ValueError(f"words must be uint32 (K, {want}), got {words.dtype} {words.shape}")
  k = words.shape[0]
  if k < 1:
    raise ValueError("need at least one payload")
  nb = -(-n // bucket)
  for field, a in per_bucket.items():
    if a.shape != (k, nb) or a.dtype != jnp.float32:
      raise ValueError(f"{field} must be float32 ({k}, {nb}), got {a.dtype} {a.shape}")
  interpret = resolve_interpret(interpret)
  check_interpretable(interpret, words, *per_bucket.values())
  misfit = _mosaic.misfit(n, bits, bucket)
  if pick_backend(misfit, interpret=interpret, backend=backend) == "mosaic_gpu":
    return _mosaic.decode_sum(
      mosaic_decode,
      words,
      per_bucket,
      n=n,
      bits=bits,
      bucket=bucket,
      out_struct=out_struct,
      interpret=interpret,
      name=name,
    )
  rows = config.rows(bucket)
  length = rows * bucket
  kp = 1 << max(0, (k - 1).bit_length())  # Triton blocks are powers of two; rows >= K unread

  def body(words_ref, *refs):
    *row_refs, out_ref = refs

    def one(j):
      return decode(
        words_ref[j, :],
        *(r[j, :] for r in row_refs),
        rows=rows,
        bucket=bucket,
        exact_asm=not interpret,
      )

    acc = lax.fori_loop(1, k, lambda j, acc: acc + one(j), one(0))
    out_ref[...] = acc.reshape(length)

  rows_spec = pl.BlockSpec((kp, rows), lambda i: (0, i))
  return pl.pallas_call(
    body,
    out_shape=out_struct(words, (n,), jnp.float32),
    grid=(-(-nb // rows),),
    in_specs=[pl.BlockSpec((kp, length * bits // 32), lambda i: (0, i))]
    + [rows_spec] * len(per_bucket),
    out_specs=pl.BlockSpec((length,), lambda i: (i,)),
    interpret=interpret,
    compiler_params=None if interpret else config.compiler_params(),
    name=name,
  )(words, *per_bucket.values())
