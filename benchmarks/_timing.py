"""Shared timing helper of the benchmark scripts (the kernels' own, re-exported)."""

from jaxcomp.kernels._common import median_time  # noqa: F401
