"""The README's "Use" snippet runs as written, in a fresh process (as a user pastes it)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_snippet() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  section = readme[readme.index("## Use") :]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_use_snippet_runs_as_written():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, "-c", use_snippet()],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  loss = float(re.search(r"loss (\S+)", done.stdout).group(1))
  assert loss < 2.30  # below log(10): five Adam steps on separable data moved it
  assert "wire report" in done.stdout and "ratio" in done.stdout, done.stdout
