"""Configurations of the MNIST-1D example; each module has ``get_config()``."""
