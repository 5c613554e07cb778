"""MNIST-1D: dense vs compressed gradient exchange on a small 1-D CNN."""
