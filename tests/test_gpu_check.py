"""scripts/gpu_check.sh, the one-command GPU check, as far as a CPU can run it.

The script parses (``bash -n``) and its ``--dry-run`` runs the same phases as on a GPU
(the kernel tests, the benchmark with ``--ragged --out``) in interpret mode, writing the
summary and the table under ``$OUT``.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_parses():
  subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
  out = subprocess.run(["bash", str(SCRIPT), "--bad"], capture_output=True, text=True)
  assert out.returncode == 2 and "usage" in out.stderr


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
  """The dry run's phases pass and leave the summary, the logs and the table."""
  env = dict(os.environ, OUT=str(tmp_path), JAXCOMP_GPU_PYTHON=sys.executable)
  env["JAXCOMP_GPU_LIMITS"] = "600 600 600"  # a loaded CI machine; a GPU run keeps the defaults
  env.pop("JAX_PLATFORMS", None)
  done = subprocess.run(
    ["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=900
  )
  summary = (tmp_path / "summary.md").read_text()
  assert done.returncode == 0, done.stderr[-3000:] + summary
  assert "| tests | 0 |" in summary and "| benchmark | 0 |" in summary
  assert " passed" in summary
  table = (tmp_path / "kernels.md").read_text()
  assert "kernels on: quantize mosaic_gpu" in table or "quantize triton" in table
  for row in ("| quantize | 2^12 |", "| quantize | 3096 |", "| sign_unpack_sum K=8 | 3096 |"):
    assert row in table, row
  for name in ("env.txt", "tests.log", "tests.xml", "bench.log"):
    assert (tmp_path / name).stat().st_size > 0, name
