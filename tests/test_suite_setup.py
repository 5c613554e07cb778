"""The test harness itself: what tests/conftest.py and scripts/test.sh rely on."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from tests import conftest

# One worker runs this module in order (--dist loadgroup): the restore test follows the
# marked one.
pytestmark = pytest.mark.xdist_group("suite_setup")

GROUPED = """
import os

import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
  with open(os.environ["WORKERS_FILE"], "a") as f:
    f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.parametrize("i", range(6))
def test_free(i):
  pass
"""


def test_xdist_groups_run_on_one_worker(tmp_path):
  """scripts/test.sh's ``--dist loadgroup`` sends a module marked ``xdist_group`` to one
  worker (its module fixtures built once): a pytest/pytest-xdist pair that stops doing
  so (pytest-xdist issue 1386) fails here rather than slowing the suite unseen."""
  (tmp_path / "test_grouped.py").write_text(GROUPED)
  workers = tmp_path / "workers.txt"
  env = {**os.environ, "WORKERS_FILE": str(workers)}
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-n",
      "2",
      "--dist",
      "loadgroup",
      "-p",
      "no:cacheprovider",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 0, run.stdout + run.stderr
  assert "12 passed" in run.stdout, run.stdout
  ran_on = workers.read_text().split()
  assert len(ran_on) == 6 and len(set(ran_on)) == 1, ran_on


def test_tests_compile_as_the_environment_says():
  """Cheap compiles by default, in this process and (through the environment) in the
  processes tests start."""
  env = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]
  assert jax.config.values["jax_disable_most_optimizations"] == (env not in ("0", "false"))


@pytest.mark.xla_optimized
def test_marked_tests_compile_with_the_defaults():
  assert not jax.config.values["jax_disable_most_optimizations"]
  assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"  # so do their subprocesses


def test_the_setting_is_restored_after_a_marked_test():
  """Runs after the marked test in this module (collection order)."""
  test_tests_compile_as_the_environment_says()


class _Item:
  """What second_line_cases reads of a pytest item."""

  def __init__(self, nodeid, *marks):
    self.nodeid, self.marks = nodeid, marks

  def get_closest_marker(self, name):
    return name if name in self.marks else None


def test_the_second_line_runs_each_test_function_once_and_no_slow_test():
  items = [
    _Item("a.py::test_sweep[1]"),  # the first case runs
    _Item("a.py::test_sweep[2]"),
    _Item("b.py::test_sweep[1]"),  # another module's function of the same name runs
    _Item("a.py::TestC::test_sweep[1]"),  # and a class's
    _Item("a.py::test_plain"),
    _Item("a.py::test_slow", "slow"),
    _Item("a.py::test_once[1]", "once"),
    _Item("a.py::test_versions[1]", "every_case"),
    _Item("a.py::test_versions[2]", "every_case"),
  ]
  kept, dropped = conftest.second_line_cases(items)
  assert [items.index(i) for i in kept] == [0, 2, 3, 4, 7, 8]
  assert [items.index(i) for i in dropped] == [1, 5, 6]


def test_markers_are_declared():
  text = (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
  for marker in ("slow", "once", "xla_optimized", "every_case"):
    assert f'"{marker}:' in text, marker
