"""The ```python blocks of the README and the docs, found one way for every test that
runs them: `tests/test_docs_snippets.py` (every page) and the guide tests that check a
section's output (`test_two_level.py`, `test_hsdp.py`, `test_diloco_nodes.py`,
`test_sharded.py`, `test_readme.py`) and those that check a page's table against what
its block prints (`test_onebit_sgd.py`, `test_normal.py`).

A block a reader cannot run on a CPU-only machine as written (a fragment of a larger
step, a shell command, a multi-process launch) says so in the page, on the line right
before its fence: ``<!-- not-run: why -->``. Every other block runs.
"""

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FENCE = re.compile(r"^([ \t]*)```python[ \t]*$")
_NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->")


@dataclasses.dataclass(frozen=True)
class Block:
  """One ```python block of a page."""

  page: str  # path relative to the repository root
  line: int  # 1-based line of its opening fence
  section: str  # the heading above it ("" before the first)
  code: str  # dedented, ending in a newline
  not_run: str | None  # the reason given by a `<!-- not-run: ... -->` line, or None


def python_blocks(page: str) -> list[Block]:
  """The page's ```python blocks, in order (fences indented in list items included)."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = f.read().splitlines()
  blocks, section, i, fenced = [], "", 0, False
  while i < len(lines):
    line = lines[i]
    opening = _FENCE.match(line)
    if opening and not fenced:
      indent, start, body = opening.group(1), i, []
      i += 1
      while i < len(lines) and lines[i].strip() != "```":
        body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
        i += 1
      if i == len(lines):
        raise ValueError(f"{page}:{start + 1}: a ```python fence that is never closed")
      previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
      reason = _NOT_RUN.search(previous)
      code = textwrap.dedent("\n".join(body)) + "\n"
      blocks.append(Block(page, start + 1, section, code, reason and reason.group(1)))
    elif line.lstrip().startswith("```"):
      fenced = not fenced  # another language's fence: headings inside are not headings
    elif not fenced and re.match(r"#+\s", line):
      section = line.lstrip("#").strip()
    i += 1
  return blocks


def _section_block(page: str, section: str) -> Block:
  """The one runnable ```python block under the heading `section` of `page`."""
  (block,) = [b for b in python_blocks(page) if b.section == section and b.not_run is None]
  return block


def section_code(page: str, section: str) -> str:
  """The code of the one runnable ```python block under the heading `section` of `page`."""
  return _section_block(page, section).code


def run_script(code: str, *, cwd: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh Python process as a reader on a CPU-only machine would: the
  repository importable, JAX on the CPU with the 8 devices of `tests/conftest.py` (set
  through the environment, so a page need not say it), default dtype promotion."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_PLATFORMS"] = "cpu"
  env["JAX_NUM_CPU_DEVICES"] = "8"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def table_after(page: str, section: str) -> list[str]:
  """The lines of the first markdown table after the runnable block of `section`: the
  page's copy of what that block prints."""
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    lines = f.read().splitlines()[_section_block(page, section).line :]
  start = next(i for i, line in enumerate(lines) if line.startswith("|"))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
  return lines[start:end]


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def assert_tables_match(printed: list[str], shown: list[str]) -> None:
  """`printed` (a block's table) is the page's table `shown`: the same rows and text, and
  each number with decimals equal up to one unit of the last digit the page shows (a
  value on a rounding boundary may round the other way under another XLA); whole
  numbers (sizes, bits, names' digits) exactly."""
  assert len(printed) == len(shown), "\n".join(["printed:", *printed, "shown:", *shown])
  for got, want in zip(printed, shown):
    assert _NUMBER.sub("#", got) == _NUMBER.sub("#", want), (got, want)
    for a, b in zip(_NUMBER.findall(got), _NUMBER.findall(want)):
      decimals = len(b.partition(".")[2])
      unit = 10.0**-decimals if decimals else 0.0
      assert abs(float(a.replace(",", "")) - float(b.replace(",", ""))) <= 1.001 * unit, (got, want)
