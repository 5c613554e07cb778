"""Test set-up: 8 CPU devices, strict dtype promotion and cheap compiles, before JAX starts.

Most of the suite's time is XLA compiling small programs, so tests compile with
``jax_disable_most_optimizations`` (``JAX_DISABLE_MOST_OPTIMIZATIONS=1``, which the
processes tests start inherit; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest`` runs the whole
suite with XLA's defaults): what they check (numerics within stated bounds, the bits two
paths compiled alike produce, the bytes on the wire) does not depend on how well XLA
optimizes. Tests whose contract is about the optimized program (bit identity with a
program XLA has fused and contracted into FMAs, or with a native kernel matched to it),
and the README's full-length demo (its run time, not its compiles, dominates), are marked
``xla_optimized`` and compile with XLA's defaults.

scripts/test.sh runs the suite on two jax lines. The first runs every test, the ``once``
tests first (the longest: with pytest-xdist the other workers share the rest meanwhile).
The second (``JAXCOMP_SECOND_LINE=1``) deselects the tests marked ``once`` or ``slow``
and runs one case of each parametrized test (the first), except in tests marked
``every_case`` (their cases differ between jax versions): every test function still runs
on both jax versions, its sweep over sizes, dtypes and methods on the first.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import hypothesis  # noqa: E402
import pytest  # noqa: E402


def second_line() -> bool:
  return os.environ.get("JAXCOMP_SECOND_LINE", "") not in ("", "0")


hypothesis.settings.register_profile(
  "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
# The second jax line runs each property test with fewer examples: the first ran the full
# set, and what differs between jax versions shows on any example.
hypothesis.settings.register_profile(
  "second_line", parent=hypothesis.settings.get_profile("ci"), max_examples=8
)
hypothesis.settings.load_profile("second_line" if second_line() else "ci")


def second_line_cases(items) -> tuple[list, list]:
  """``(kept, deselected)`` on the second jax line (see the module docstring)."""
  kept, dropped, seen = [], [], set()
  for item in items:
    function = item.nodeid.split("[")[0]  # module, class and function
    if item.get_closest_marker("once") or item.get_closest_marker("slow"):
      dropped.append(item)
    elif function in seen and not item.get_closest_marker("every_case"):
      dropped.append(item)
    else:
      kept.append(item)
      seen.add(function)
  return kept, dropped


def pytest_collection_modifyitems(config, items):
  if second_line():
    kept, dropped = second_line_cases(items)
    if dropped:
      config.hook.pytest_deselected(items=dropped)
      items[:] = kept
    return
  items.sort(key=lambda item: item.get_closest_marker("once") is None)  # stable


def pytest_report_header(config):
  if second_line():
    return "second jax line: tests marked once or slow deselected, one case per parametrized test"
  return None


@pytest.fixture(autouse=True)
def _xla_optimized(request, monkeypatch):
  """A test marked ``xla_optimized`` compiles with XLA's default optimizations, and so
  do the processes it starts; the jit caches are dropped on the way in and out, since
  they are not keyed on the setting."""
  if request.node.get_closest_marker("xla_optimized") is None:
    yield
    return
  before = jax.config.values["jax_disable_most_optimizations"]
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")  # restored after the test
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
    jax.clear_caches()
