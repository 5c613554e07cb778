r"""Native CPU kernels of QSGD and 1-bit SGD: one pass per bucket, called through XLA's FFI.

The Pallas kernels are the GPU's fast path; this module is the CPU's. XLA:CPU runs
QSGD's encode as separate passes over memory (the bucket scales, then the hash,
stochastic rounding and packing, which as a reduction with fused inputs runs slower
than an elementwise loop), so the XLA path reads its input several times over.
``cpu_codecs.cc`` (next to this file) takes one bucket at a time while it sits in L1:
scale, counter hash, rounding, packing and the optional error feedback in one read of
``x``; the K-payload decode-sum in one write of the output. Same functions and
arguments as the Pallas modules:

* :func:`quantize` / :func:`dequantize_sum` (:mod:`~jaxcomp.kernels.quantize`,
  :mod:`~jaxcomp.kernels.dequantize`);
* :func:`sign_pack` / :func:`sign_unpack_sum` (:mod:`~jaxcomp.kernels.sign_pack`).

What they write is the XLA path's payload, bit for bit: the same counter hash
(:mod:`jaxcomp._src.plumbing.rng`), the same float32 operations in the same order (compiled with
``-ffp-contract=off``: no fused multiply-adds; ``|v| / scale`` as ``|v| * fl(1 / scale)``,
:func:`jaxcomp._src.plumbing.arith.inverse_scale`; denormals flushed to zero, as XLA:CPU
does), the same lanes layout. Two sums are taken in another order than XLA's (inside
the one pass over a bucket; the Pallas kernels take them from XLA instead), and agree
to float32 rounding:
OneBit's bucket means and QSGD's ``norm="l2"`` scales. ``tests/test_cpu_kernels.py``
checks all of it against the XLA path.

Build: on first use, with the system C++ compiler (``$CXX``, else ``c++``) and jaxlib's
FFI headers (``jax.ffi.include_dir()``), ``-O3 -march=native``; the library is cached
in ``$JAXCOMP_CACHE_DIR`` (default ``~/.cache/jaxcomp``) under a hash of the source, the
flags, the compiler, jaxlib's version and the CPU, and compiled again when any changes;
a new build removes the cached libraries nobody loaded for a week (:func:`prune`).
A codec with ``implementation=None`` uses these kernels on a CPU backend when the build
succeeds (:func:`available`) and the XLA path otherwise; ``implementation="native"``
asks for them and raises with the compiler's message when they cannot be built.
``JAXCOMP_NATIVE=0`` turns the default off.

Threads: a call splits its buckets over up to ``hardware_concurrency`` threads of its
own, with at least 2^17 values each (smaller tensors run on the calling thread).

Example:

>>> import jax, jax.numpy as jnp
>>> from jaxcomp.kernels import cpu
>>> x, key = jnp.linspace(-1.0, 1.0, 1000), jax.random.key(0)
>>> if cpu.available():
...   words, scales = cpu.quantize(x, key, levels=7, bucket_size=256)
...   assert words.shape == (125,) and scales.shape == (4,)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import jax
from jax import lax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxcomp._src.plumbing import bitpack

from . import _common
from . import quantize as _quantize
from . import sign_pack as _sign_pack

Array = jax.Array
_F32 = jnp.float32
_U32 = jnp.uint32

SOURCE = Path(__file__).with_name("cpu_codecs.cc")
FLAGS = (
  "-O3",
  "-march=native",
  "-ffp-contract=off",
  "-fno-trapping-math",
  "-std=c++17",
  "-shared",
  "-fPIC",
  "-pthread",
)
_TARGETS = {
  "jaxcomp_cpu_qsgd_encode": "JaxcompQsgdEncode",
  "jaxcomp_cpu_qsgd_decode_sum": "JaxcompQsgdDecodeSum",
  "jaxcomp_cpu_onebit_encode": "JaxcompOneBitEncode",
  "jaxcomp_cpu_onebit_decode_sum": "JaxcompOneBitDecodeSum",
}


class BuildError(RuntimeError):
  """The native kernels could not be compiled or loaded here."""


def cache_dir() -> Path:
  """Where built libraries are kept: ``$JAXCOMP_CACHE_DIR``, else ``~/.cache/jaxcomp``."""
  if os.environ.get("JAXCOMP_CACHE_DIR"):
    return Path(os.environ["JAXCOMP_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxcomp"


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      lines = [l for l in f if l.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _compiler() -> list[str]:
  cxx = os.environ.get("CXX", "c++").split()
  if not cxx or shutil.which(cxx[0]) is None:
    raise BuildError(
      f"no C++ compiler: {cxx[0] if cxx else '$CXX is empty'} not found "
      "(set CXX, or install g++ or clang++)"
    )
  return cxx


def library_path() -> Path:
  """The cached library, built first when missing (raises :class:`BuildError`)."""
  cxx = _compiler()
  version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, check=False).stdout
  digest = hashlib.sha256(
    "\0".join(
      [
        SOURCE.read_text(),
        " ".join(cxx),
        " ".join(FLAGS),
        version,
        jaxlib.__version__,
        platform.machine(),
        _cpu_id(),
      ]
    ).encode()
  ).hexdigest()[:20]
  path = cache_dir() / f"cpu_codecs-{digest}.so"
  if path.exists():
    try:
      os.utime(path)  # its mtime is its last use: prune() keeps what is in use
    except OSError:
      pass
    return path
  path.parent.mkdir(parents=True, exist_ok=True)
  # Build under a unique name, then rename: concurrent builds (pytest-xdist workers,
  # several processes of one job) never load a half-written library.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
  os.close(fd)
  cmd = [*cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      errors = [l for l in done.stderr.splitlines() if "error" in l][:20]
      raise BuildError(
        f"building the native CPU kernels failed ({' '.join(cmd)}):\n"
        + "\n".join(errors or done.stderr.splitlines()[-20:])
      )
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  prune(keep=path)
  return path


#: Cached libraries unused for this long are removed when a new one is built.
PRUNE_AGE_S = 7 * 86400


def prune(keep: Path, max_age_s: float = PRUNE_AGE_S) -> list[Path]:
  """Removes the cache's other libraries (older sources, compilers, jaxlibs) and stray
  temporary builds that were not used for ``max_age_s`` seconds; returns them.

  A library's mtime is its last use (:func:`library_path` touches it), so a version
  that another checkout still loads stays. Removing a library a running process has
  loaded is safe on Linux: the mapping outlives the name.
  """
  removed = []
  now = time.time()
  for f in keep.parent.glob("*.so"):
    if f == keep or not (f.name.startswith("cpu_codecs-") or f.name.startswith("tmp")):
      continue
    try:
      if now - f.stat().st_mtime > max_age_s:
        f.unlink()
        removed.append(f)
    except OSError:
      pass  # gone already, or not ours to remove
  return removed


@functools.cache
def _load() -> str | None:
  """Builds, loads and registers the kernels once; the reason when that failed."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(library_path()))
    for target, symbol in _TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (BuildError, OSError, AttributeError) as e:
    return str(e)
  return None


def enabled_by_default() -> bool:
  """Whether ``implementation=None`` may pick these kernels (``JAXCOMP_NATIVE`` != 0)."""
  return os.environ.get("JAXCOMP_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
  """Whether the kernels are built and registered (building them on first call)."""
  return _load() is None


def require() -> None:
  """Raises :class:`BuildError` (with the compiler's message) unless :func:`available`."""
  why = _load()
  if why is not None:
    raise BuildError(why)


def use_by_default() -> bool:
  """What ``implementation=None`` means off a CUDA GPU: these kernels when jax's default
  backend is the CPU, they are not turned off, and they build here."""
  return (
    jax.default_backend() == "cpu"
    and enabled_by_default()
    and not _common.cuda_available()
    and available()
  )


def _flat32(x: Array) -> Array:
  return x.reshape(-1).astype(_F32)


def _residual_arg(x: Array, residual: Array | None) -> Array:
  if residual is None:
    return jnp.zeros((0,), _F32)
  if x.dtype != jnp.float32:
    # v = fl_dtype(x + e) needs a rounding the kernel does not do: callers fuse the
    # feedback only for float32 (QSGD/OneBit.fuses_feedback).
    raise ValueError(f"fused error feedback needs a float32 x, got {x.dtype}")
  if residual.shape != x.shape:
    raise ValueError(f"residual shape {residual.shape} != x shape {x.shape}")
  return _flat32(residual)


def _call(target: str, outs, *args, **attrs):
  require()
  results = jax.ffi.ffi_call(target, outs, vmap_method="sequential")(
    *args, **{k: np.int64(v) for k, v in attrs.items()}
  )
  # Under shard_map (check_vma), an FFI call's results carry no varying axes; they vary
  # wherever an input does (the kernel runs per device), so say so.
  vma = frozenset().union(*(_common.varying_axes(a) for a in args))
  if vma:
    cast = lambda r: lax.pcast(r, tuple(sorted(vma)), to="varying")
    results = (
      tuple(cast(r) for r in results) if isinstance(results, (tuple, list)) else cast(results)
    )
  return results


def quantize(
  x: Array,
  key: Array,
  residual: Array | None = None,
  *,
  levels: int,
  bucket_size: int,
  norm: str = "max",
) -> tuple[Array, ...]:
  """QSGD's ``(words, scales)`` of ``x`` (plus the new residual when ``residual`` is
  given): :func:`jaxcomp.kernels.quantize.quantize`'s contract, on the CPU."""
  if norm not in ("max", "l2"):
    raise ValueError(f"norm must be 'max' or 'l2', got {norm!r}")
  n = x.size
  why = _quantize.unsupported(n, levels=levels, bucket_size=bucket_size, dtype=x.dtype)
  if why is not None:
    raise ValueError(f"the native quantize kernel does not handle this input: {why}")
  e = _residual_arg(x, residual)
  bits = _quantize.bits_per_value(levels)
  outs = (
    jax.ShapeDtypeStruct((bitpack.num_words(n, bits),), _U32),
    jax.ShapeDtypeStruct((-(-n // bucket_size),), _F32),
    jax.ShapeDtypeStruct(e.shape, _F32),
  )
  words, scales, new_e = _call(
    "jaxcomp_cpu_qsgd_encode",
    outs,
    _flat32(x),
    e,
    _common.key_words_array(key),
    levels=levels,
    bucket=bucket_size,
    l2=int(norm == "l2"),
  )
  if residual is None:
    return words, scales
  return words, scales, new_e.reshape(x.shape)


def dequantize_sum(words: Array, scales: Array, *, n: int, levels: int, bucket_size: int) -> Array:
  """Flat float32 sum of K QSGD payloads (``words (K, W)``, ``scales (K, buckets)``),
  decoded in rank order: :func:`jaxcomp.kernels.dequantize.dequantize_sum`'s contract."""
  why = _quantize.unsupported(n, levels=levels, bucket_size=bucket_size, dtype=_F32)
  if why is not None:
    raise ValueError(f"the native dequantize kernel does not handle this payload: {why}")
  return _call(
    "jaxcomp_cpu_qsgd_decode_sum",
    jax.ShapeDtypeStruct((n,), _F32),
    words.astype(_U32),
    scales.astype(_F32),
    levels=levels,
    bucket=bucket_size,
  )


def sign_pack(x: Array, residual: Array | None = None, *, bucket_size: int) -> tuple[Array, ...]:
  """OneBit's ``(words, pos, neg)`` of ``x`` (plus the new residual when ``residual`` is
  given): :func:`jaxcomp.kernels.sign_pack.sign_pack`'s contract, on the CPU."""
  n = x.size
  why = _sign_pack.unsupported(n, bucket_size=bucket_size, dtype=x.dtype)
  if why is not None:
    raise ValueError(f"the native sign_pack kernel does not handle this input: {why}")
  e = _residual_arg(x, residual)
  nb = -(-n // bucket_size)
  outs = (
    jax.ShapeDtypeStruct((-(-n // 32),), _U32),
    jax.ShapeDtypeStruct((nb,), _F32),
    jax.ShapeDtypeStruct((nb,), _F32),
    jax.ShapeDtypeStruct(e.shape, _F32),
  )
  words, pos, neg, new_e = _call(
    "jaxcomp_cpu_onebit_encode", outs, _flat32(x), e, bucket=bucket_size
  )
  if residual is None:
    return words, pos, neg
  return words, pos, neg, new_e.reshape(x.shape)


def sign_unpack_sum(words: Array, pos: Array, neg: Array, *, n: int, bucket_size: int) -> Array:
  """Flat float32 sum of K OneBit payloads, decoded in rank order:
  :func:`jaxcomp.kernels.sign_pack.sign_unpack_sum`'s contract."""
  why = _sign_pack.unsupported(n, bucket_size=bucket_size)
  if why is not None:
    raise ValueError(f"the native sign_unpack_sum kernel does not handle this payload: {why}")
  return _call(
    "jaxcomp_cpu_onebit_decode_sum",
    jax.ShapeDtypeStruct((n,), _F32),
    words.astype(_U32),
    pos.astype(_F32),
    neg.astype(_F32),
    bucket=bucket_size,
  )


if __name__ == "__main__":  # python -m jaxcomp.kernels.cpu: build and say where
  require()
  print(library_path())
  sys.exit(0)
