"""Smoke test of examples/tensor_parallel.py: the 2-D and 3-D meshes, the skip and the
accumulation, run as the example runs them."""

import jax
import numpy as np
import pytest

from examples import tensor_parallel


@pytest.mark.parametrize("shape", [(4, 2), (2, 2, 2)])
def test_trains_and_skips_the_nan_step(shape):
  # The example's optax.adam raises an int32 step count to a float power: it runs under
  # standard dtype promotion, as users run it (the suite is strict, see conftest.py).
  with jax.numpy_dtype_promotion("standard"):
    losses, skipped, params = tensor_parallel.train(
      shape, steps=8, accumulate=2, nan_at=3, log=lambda _: None
    )
  assert skipped == 1  # the NaN mini-step poisoned one accumulated update: skipped
  assert all(np.isfinite(losses))
  start = tensor_parallel.init_params(jax.random.key(0))
  for name, leaf in params.items():
    assert np.isfinite(np.asarray(leaf)).all(), name
  # Three updates went through (8 mini-steps / 2, one skipped): the kernels moved.
  assert not np.array_equal(np.asarray(params["w1"]), np.asarray(start["w1"]))
