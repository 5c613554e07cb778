"""One-off studies behind the figures and design choices in the docs.

Each answers one question (how a Linux token bucket paces a link, what XLA:CPU does with a loop,
whether the native kernels train bit for bit like XLA) and is run as
``python -m benchmarks.studies.NAME``; the tools a user runs to measure their own set-up
(``benchmarks.codecs``, ``benchmarks.kernels``, ``benchmarks.network``, ...) stay in
``benchmarks/``.
"""
