"""The README's "Use" snippet runs as written, in a fresh process (as a user pastes it)."""

import re

from tests import _docs_blocks


def use_snippet() -> str:
  return _docs_blocks.section_code("README.md", "Use")


def test_use_snippet_runs_as_written():
  done = _docs_blocks.run_script(use_snippet())
  assert done.returncode == 0, done.stderr[-3000:]
  loss = float(re.search(r"loss (\S+)", done.stdout).group(1))
  assert loss < 2.30  # below log(10): five Adam steps on separable data moved it
  assert "wire report" in done.stdout and "ratio" in done.stdout, done.stdout
