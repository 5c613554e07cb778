"""Byte-level corpus of the Python standard library's own ``.py`` sources.

Every machine with Python has it (``sysconfig.get_paths()["stdlib"]``, without
``site-packages``). The files are split into train and validation **by file**: a file
goes to validation when the SHA-256 of its relative path, taken modulo 100, is below
``validation_percent``, so the split depends only on the paths (the same on every
machine with the same Python), not on the order files are listed in. Each split is the
concatenation of its files (sorted by path, one newline between), one byte per token.

Batches are not materialized ahead of time: mini-step ``i``'s windows start at
offsets drawn from a generator seeded by ``(seed, i)``, so the data position is the
mini-step counter alone (checkpointing it is checkpointing the step), and each process
cuts only the rows of its own devices.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import sysconfig

import numpy as np


def stdlib_root() -> pathlib.Path:
  """The standard library's directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path | None = None) -> list[str]:
  """Relative paths (POSIX, sorted) of the ``.py`` files under ``root``, site-packages
  excluded."""
  root = stdlib_root() if root is None else pathlib.Path(root)
  files = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
  return sorted(p.as_posix() for p in files if "site-packages" not in p.parts)


def is_validation(path: str, validation_percent: int) -> bool:
  """Whether ``path`` belongs to the validation split (its hash mod 100 < percent)."""
  return int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100 < validation_percent


@functools.lru_cache(maxsize=4)
def load_corpus(validation_percent: int, root: str | None = None) -> dict:
  """``{"train", "validation"}``: uint8 arrays, plus file and byte counts.

  Args:
    validation_percent: in ``[1, 99]``, the share of files (by path hash) held out.
    root: the directory of sources (default: the standard library).

  Returns:
    ``{"train": uint8[n], "validation": uint8[m], "train_files", "validation_files",
    "root"}``.
  """
  if not 1 <= validation_percent <= 99:
    raise ValueError(f"validation_percent must be in [1, 99], got {validation_percent}")
  base = stdlib_root() if root is None else pathlib.Path(root)
  files = source_files(base)
  if not files:
    raise ValueError(f"no .py files under {base}")
  splits = {"train": [], "validation": []}
  for path in files:
    split = "validation" if is_validation(path, validation_percent) else "train"
    splits[split].append(path)
  out = {"root": os.fspath(base)}
  for split, paths in splits.items():
    if not paths:
      raise ValueError(f"the {split} split of {base} is empty")
    data = b"\n".join((base / p).read_bytes() for p in paths)
    out[split] = np.frombuffer(data, dtype=np.uint8)
    out[f"{split}_files"] = len(paths)
  return out


def window_offsets(n: int, count: int, seq_len: int, *, seed: int, step: int) -> np.ndarray:
  """``count`` window starts in ``[0, n - seq_len - 1]`` for mini-step ``step``, drawn
  from a generator seeded by ``(seed, step)`` alone."""
  if n < seq_len + 1:
    raise ValueError(f"a corpus of {n} bytes has no window of {seq_len + 1}")
  rng = np.random.default_rng([seed, step])
  return rng.integers(0, n - seq_len, size=count)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> np.ndarray:
  """``tokens[o : o + seq_len + 1]`` for each offset: inputs and shifted targets."""
  return tokens[offsets[..., None] + np.arange(seq_len + 1)]


def train_batch(
  tokens: np.ndarray,
  step: int,
  *,
  seed: int,
  num_devices: int,
  per_device_batch_size: int,
  seq_len: int,
  devices: slice | None = None,
) -> np.ndarray:
  """Mini-step ``step``'s batch, uint8 ``(devices, per_device_batch_size, seq_len + 1)``.

  The global batch has ``num_devices`` rows (one per device of the mesh); ``devices``
  selects this process's rows (default: all). Only those windows are read.
  """
  offsets = window_offsets(
    len(tokens), num_devices * per_device_batch_size, seq_len, seed=seed, step=step
  ).reshape(num_devices, per_device_batch_size)
  return windows(tokens, offsets[devices if devices is not None else slice(None)], seq_len)


def eval_windows(
  tokens: np.ndarray, *, num_devices: int, per_device: int, seq_len: int
) -> np.ndarray:
  """A fixed evaluation set: ``num_devices * per_device`` windows evenly spread over
  ``tokens``, uint8 ``(num_devices, per_device, seq_len + 1)``."""
  count = num_devices * per_device
  offsets = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
  return windows(tokens, offsets.reshape(num_devices, per_device), seq_len)
