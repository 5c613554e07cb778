"""Shared helpers of the benchmark scripts: CPU devices, timing, Markdown tables,
comma-separated flags, and running under a malloc that reuses large buffers."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import jax


def use_cpu_devices(n: int) -> None:
  """``n`` CPU devices in this process, on CPU unless ``JAX_PLATFORMS`` says otherwise;
  before JAX initialises its backends."""
  if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"  # the processes this one starts read it too
    jax.config.update("jax_platforms", "cpu")  # jax read it when imported
  jax.config.update("jax_num_cpu_devices", n)


def median_time(fn, *args, repeats: int) -> float:
  """Median wall time of ``fn(*args)`` over ``repeats`` runs, after a warm-up run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def ints(text: str) -> list[int]:
  """A command-line flag's ``type``: comma-separated integers."""
  return [int(s) for s in text.split(",")]


def md_row(*cells) -> str:
  """A Markdown table row (an empty cell stays ``| |``)."""
  return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def md_head(columns: str, align: str = "") -> str:
  """A Markdown table's header (``columns``: the names, ``" | "`` between them) and rule;
  ``align`` has ``l``, ``r`` or ``c`` per column (default: the first left, others right)."""
  n = columns.count(" | ") + 1
  rule = {"l": "---", "r": "---:", "c": ":---:"}
  return f"| {columns} |\n|" + "|".join(rule[a] for a in align or "l" + "r" * (n - 1)) + "|"


def md_table(head: str, rows, title: str = "", left: int = 1) -> str:
  """A Markdown table under ``title``: ``head`` the column names (``" | "`` between them),
  the first ``left`` columns text, the others numbers; a row is its cells
  (:func:`md_row`) or a line formatted already."""
  align = "l" * left + "r" * (head.count(" | ") + 1 - left)
  rows = [row if isinstance(row, str) else md_row(*row) for row in rows]
  table = "\n".join([md_head(head, align), *rows])
  return f"{title}\n\n{table}" if title else table


#: glibc malloc settings under which XLA:CPU's large buffers are reused from call to call
#: instead of mmapped fresh (a page fault per 4 KiB); read when the process starts. Why
#: each: docs/guides/kernels.md, "Large outputs on XLA:CPU: glibc's mmap threshold".
REUSE_MALLOC = (
  "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184:glibc.malloc.arena_max=1"
)


def malloc_label() -> str:
  """How this process allocates: ``"glibc default"``, ``"glibc reuse"`` or the libc."""
  libc = platform.libc_ver()[0] or "unknown libc"
  if libc != "glibc":
    return libc
  tunables = os.environ.get("GLIBC_TUNABLES")
  return "glibc reuse" if tunables == REUSE_MALLOC else f"glibc {tunables or 'default'}"


def reexec_with_reused_malloc() -> None:
  """Restarts this command with :data:`REUSE_MALLOC` as ``GLIBC_TUNABLES`` (no-op when
  it is already set; an error off glibc, where the tunables mean nothing)."""
  if os.environ.get("GLIBC_TUNABLES") == REUSE_MALLOC:
    return
  if platform.libc_ver()[0] != "glibc":
    raise SystemExit(
      "--reuse-malloc needs glibc (GLIBC_TUNABLES); this is "
      f"{platform.libc_ver()[0] or 'an unknown libc'}"
    )
  env = dict(os.environ, GLIBC_TUNABLES=REUSE_MALLOC)
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
