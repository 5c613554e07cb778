"""MNIST-1D with flax.nnx: dense vs compressed gradient exchange, nnx.Optimizer."""
