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


def pytest_collection_modifyitems(config, items):
  """With ``JAXCOMP_SKIP_ONCE=1`` (scripts/test.sh's second jax line), tests marked
  ``once`` are skipped: they are too slow to run on both lines and ran on the first."""
  import pytest

  if os.environ.get("JAXCOMP_SKIP_ONCE", "") in ("", "0"):
    return
  skip = pytest.mark.skip(reason="marked once: runs on scripts/test.sh's first jax line only")
  for item in items:
    if item.get_closest_marker("once") is not None:
      item.add_marker(skip)
