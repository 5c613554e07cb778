"""Pallas GPU kernels for jaxcomp's hot paths, shipped as ``jaxcomp.kernels``.

One module per kernel, each with the kernel body and a jitted wrapper around
``pl.pallas_call`` (Triton) or ``plgpu.kernel`` (Mosaic GPU, :mod:`._mosaic`); the XLA
codec each must match bit for bit is :mod:`jaxcomp.codecs`' ``implementation="xla"``
(``tests/kernel_references.py`` spells it with the kernels' signatures). They import
only low-level helpers (:mod:`jaxcomp._src.plumbing.arith`, ``rng``, ``bitpack``); the codecs
dispatch to them:

* :mod:`~jaxcomp.kernels.quantize`: QSGD's bucket scale (max or l2), stochastic rounding
  with the counter hash of :mod:`jaxcomp._src.plumbing.rng`, sign and lanes bit packing in one
  pass, optionally fused with error feedback.
* :mod:`~jaxcomp.kernels.dequantize`: the sum of K gathered QSGD payloads, decoded in
  one pass (``decode_sum``).
* :mod:`~jaxcomp.kernels.sign_pack`: 1-bit SGD's signs and bucket means (with optional
  fused error feedback) and the K-payload decode-sum.

* :mod:`~jaxcomp.kernels.cpu`: the same four for the CPU, in C++ (``cpu_codecs.cc``)
  behind XLA's FFI, built on first use with the system compiler.

The codecs (:class:`jaxcomp.codecs.QSGD`, :class:`jaxcomp.codecs.OneBit`) dispatch to
them with ``implementation=None | "xla" | "pallas" | "native"`` and fall back to XLA for
shapes the kernels do not handle, and (warning once, :class:`KernelFallbackWarning`)
where this jax or GPU cannot run them. The backends (Mosaic GPU, and Triton while jax
has it) and the choice between them: :mod:`._common`.

The benchmarks are not shipped: in a checkout of the repository,
``python -m benchmarks.kernels`` measures every kernel's GB/s against the XLA path.
"""

from . import cpu
from . import dequantize
from . import quantize
from . import sign_pack
from ._common import KernelFallbackWarning
from ._common import LaunchConfig
from ._common import cuda_available

__all__ = [
  "KernelFallbackWarning",
  "LaunchConfig",
  "cpu",
  "cuda_available",
  "dequantize",
  "quantize",
  "sign_pack",
]
