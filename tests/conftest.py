"""Test set-up: 8 CPU devices and strict dtype promotion, before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
  "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile("ci")
