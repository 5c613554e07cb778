"""Every ```python block of the README and the docs runs as written.

Each page's blocks run in order, as one script in a fresh process (what a reader gets
pasting them one after the other into one session): pages share nothing, so a page's
blocks bring their own imports, data and mesh. The process has JAX on the CPU with the
8 devices of `tests/conftest.py` (`tests/_docs_blocks.run_script`). One place runs each
block: the blocks a guide test runs and checks the output of are listed in
`RUN_ELSEWHERE`, and skipped here. A block that cannot run on a CPU-only machine says so
in its page (`<!-- not-run: why -->` on the line before its fence) and is listed, with
that reason, in `NOT_RUN`.
"""

import glob
import math
import operator
import os
import re

import pytest

from tests import _docs_blocks
from tests._docs_blocks import ROOT


def _pages() -> list[str]:
  found = ["README.md"] + [
    os.path.relpath(p, ROOT)
    for pattern in ("docs/*.md", "docs/guides/*.md", "docs/methods/*.md")
    for p in sorted(glob.glob(os.path.join(ROOT, pattern)))
  ]
  return [p for p in found if _docs_blocks.python_blocks(p)]


#: (page, section) -> the test that runs that section's block and checks its output.
RUN_ELSEWHERE = {
  ("README.md", "Use"): "tests/test_readme.py::test_use_snippet_runs_as_written",
  # Word for word the README's (tests/test_docs_api.py checks it): run there once.
  ("docs/getting_started.md", "Use"): "tests/test_readme.py::test_use_snippet_runs_as_written",
  ("docs/methods/mipd.md", "Mean squared errors"): (
    "tests/test_normal.py::test_the_pages_error_table_is_what_its_code_prints"
  ),
  ("docs/methods/onebit_sgd.md", "Per-column layout, in every exchange"): (
    "tests/test_onebit_sgd.py::test_the_pages_byte_table_is_what_its_code_prints"
  ),
  ("docs/guides/sharded.md", "The ZeRO-2 step"): (
    "tests/test_sharded.py::test_guide_snippet_runs_as_written"
  ),
  (
    "docs/guides/two_level.md",
    "Use",
  ): "tests/test_two_level.py::test_guide_snippet_runs_as_written",
  ("docs/guides/two_level.md", "DiLoCo across nodes"): (
    "tests/test_diloco_nodes.py::test_guide_section_runs_as_written"
  ),
  ("docs/guides/two_level.md", "HSDP"): "tests/test_hsdp.py::test_guide_snippet_runs_as_written",
}

#: (page, section) -> why its block does not run here; the page says the same beside it.
NOT_RUN: dict[tuple[str, str], str] = {}

#: The pages that take longest on 2 CPU cores (long compiles; checkpoints.md runs twice).
SLOW = {
  "docs/guides/checkpoints.md",
  "docs/guides/fsdp.md",
  "docs/guides/nnx.md",
  "docs/methods/diloco.md",
  "docs/methods/mipd.md",
}

#: Pages that write files (Orbax checkpoints): run twice in one directory, as a reader
#: running the page again would.
RERUN = {"docs/guides/checkpoints.md"}

#: What a page's printout must say, beyond running: (pattern, comparison, bound) on the
#: number the pattern captures. A loss below its value at the start (log of the class
#: count for zero weights), a compressed step priced below its dense baseline.
PRINTS = {
  "docs/methods/demo.md": (r"loss (\S+)", operator.lt, math.log(16)),
  "docs/methods/onebit_adam.md": (r"loss (\S+)", operator.lt, math.log(16)),
  "docs/methods/mipd.md": (r"loss (\S+)", operator.lt, math.log(16)),
  "docs/methods/diloco.md": (r"loss at the anchor (\S+)", operator.lt, math.log(16)),
  "docs/methods/qsvrg.md": (r"loss (\S+)", operator.lt, 0.65),  # a tenth of w = 0's
  "docs/guides/fsdp.md": (r"ratio (\S+)x", operator.gt, 1.0),
  "docs/guides/profiling.md": (r"step (\S+) ms = gradient", operator.gt, 0.0),
  "docs/guides/two_level.md": (r"(\S+) ms a step", operator.gt, 0.0),
}

PAGES = _pages()


def _runnable_here(page):
  return [
    b
    for b in _docs_blocks.python_blocks(page)
    if b.not_run is None and (page, b.section) not in RUN_ELSEWHERE
  ]


def test_every_block_is_run_once_or_marked():
  """Each block runs here, or in the one test `RUN_ELSEWHERE` names (which exists and
  reads that section), or is marked not-run in its page with the reason `NOT_RUN` gives."""
  marked = {}
  for page in PAGES:
    for block in _docs_blocks.python_blocks(page):
      if block.not_run is not None:
        marked[(page, block.section)] = block.not_run
  assert marked == NOT_RUN
  for (page, section), test in RUN_ELSEWHERE.items():
    blocks = [b for b in _docs_blocks.python_blocks(page) if b.section == section]
    assert len(blocks) == 1 and blocks[0].not_run is None, (page, section)
    path, name = test.split("::")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      assert re.search(rf"^def {name}\(", f.read(), re.M), test


@pytest.mark.parametrize(
  "page",
  [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PAGES if _runnable_here(p)],
)
def test_page_runs_as_written(page, tmp_path):
  """The page's blocks, in order, in a fresh process started in an empty directory,
  without a warning (a page whose filter leaves nothing to compress, say); a page that
  writes files (`RERUN`) runs a second time over what the first wrote."""
  code = "\n".join(f"# {b.page}:{b.line}\n{b.code}" for b in _runnable_here(page))
  for _ in range(2 if page in RERUN else 1):
    done = _docs_blocks.run_script(code, cwd=tmp_path, timeout=400)
    assert done.returncode == 0, f"{page}:\n{done.stderr[-4000:]}"
    assert "Warning" not in done.stderr, f"{page}:\n{done.stderr[-4000:]}"
  if page in PRINTS:
    pattern, compare, bound = PRINTS[page]
    found = re.search(pattern, done.stdout)
    assert found and compare(float(found.group(1)), bound), (page, done.stdout[-2000:])


def test_blocks_are_found_as_a_reader_sees_them(tmp_path):
  """Indented fences (in list items) are dedented, other languages' fences are skipped
  (a `#` line inside one is no heading), a not-run comment marks only the next block."""
  page = tmp_path / "page.md"
  page.write_text(
    "# Title\n\n## First\n\n```python\na = 1\n```\n\n```bash\n# not a heading\n```\n\n"
    "1. item:\n\n   ```python\n   if a:\n     b = 2\n   ```\n\n## Second\n\n"
    "<!-- not-run: needs a GPU -->\n```python\nc = 3\n```\n\n```python\nd = 4\n```\n",
    encoding="utf-8",
  )
  blocks = _docs_blocks.python_blocks(str(page))
  assert [(b.section, b.code, b.not_run) for b in blocks] == [
    ("First", "a = 1\n", None),
    ("First", "if a:\n  b = 2\n", None),
    ("Second", "c = 3\n", "needs a GPU"),
    ("Second", "d = 4\n", None),
  ]
  assert [b.line for b in blocks] == [5, 15, 23, 27]
  page.write_text("## Open\n\n```python\na = 1\n", encoding="utf-8")
  with pytest.raises(ValueError, match="never closed"):
    _docs_blocks.python_blocks(str(page))
