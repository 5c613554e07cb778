"""Pallas GPU kernels for jaxcomp's hot paths, shipped as ``jaxcomp.kernels``.

The kernels (fused stochastic rounding, bucketed max-norm scaling, bit packing) are
tracked in their own issue; until they land every codec runs its XLA path, which is
what this package will fall back to on CPU and for shapes a kernel cannot handle.
"""
