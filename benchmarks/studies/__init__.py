"""One-off studies behind the figures and design choices in the docs.

Each answers one question (what the Elias string costs per coordinate, what MIPD's
payloads must hold, whether the native kernels train bit for bit like XLA) and is run
as ``python -m benchmarks.studies.NAME``; the tools a user runs to measure their own
set-up (``benchmarks.codecs``, ``benchmarks.kernels``, ``benchmarks.network``, ...) stay
in ``benchmarks/``. A study whose result is only historical is removed; its docs section
names the commit that still has it.
"""

import jax

from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc


def compressed(tree) -> list:
  """``[(path string, leaf)]`` of the leaves of ``tree`` jaxcomp compresses by default."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p), x) for p, x in leaves if jc.default_filter(p, x)]


def init_grads(workdir: str, batch: int = 256):
  """(parameters, gradient) of the MNIST-1D demo's CNN at init on its first ``batch``
  training examples."""
  _, data, model, params = train.setup(default.get_config(), workdir)
  x, y = data["x"][:batch], data["y"][:batch]
  return params, jax.grad(lambda p: train.cross_entropy(model, p, x, y))(params)
