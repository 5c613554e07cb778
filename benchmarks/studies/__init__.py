"""One-off studies behind the figures and design choices in the docs.

Each answers one question (what the Elias string costs per coordinate, what MIPD's
payloads must hold, whether the native kernels train bit for bit like XLA) and is run
as ``python -m benchmarks.studies.NAME``; the tools a user runs to measure their own
set-up (``benchmarks.codecs``, ``benchmarks.kernels``, ``benchmarks.network``, ...) stay
in ``benchmarks/``. A study whose result is only historical is removed; its docs section
names the commit that still has it.
"""
