"""MNIST-1D configurations of the network benchmarks (``python -m benchmarks.launch
--config params2m``); each module has ``get_config()``."""
