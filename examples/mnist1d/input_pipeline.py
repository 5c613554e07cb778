"""MNIST-1D input pipeline: generated offline, cached as .npz, split into device batches."""

from __future__ import annotations

from collections.abc import Iterator
import os

import numpy as np


def load_dataset(config, workdir: str) -> dict[str, np.ndarray]:
  """Returns ``{"x", "y", "x_test", "y_test"}``: float32 ``(n, 40)`` inputs, int32 labels.

  The data set is generated with ``mnist1d.data.make_dataset`` (no download) and cached
  in ``workdir`` as an ``.npz`` keyed by its size and seed, so later runs skip the
  generator.
  """
  name = f"mnist1d_n{config.num_samples}_split{config.train_split}_seed{config.data_seed}.npz"
  path = os.path.join(workdir, name)
  if os.path.exists(path):
    with np.load(path) as cached:
      return {k: cached[k] for k in ("x", "y", "x_test", "y_test")}

  from mnist1d.data import get_dataset_args  # pylint: disable=import-outside-toplevel
  from mnist1d.data import make_dataset  # pylint: disable=import-outside-toplevel

  args = get_dataset_args()
  args.num_samples = config.num_samples
  args.train_split = config.train_split
  args.seed = config.data_seed
  data = make_dataset(args)  # seeds numpy's global RNG; we use our own Generator below
  arrays = {
    "x": data["x"].astype(np.float32),
    "y": data["y"].astype(np.int32),
    "x_test": data["x_test"].astype(np.float32),
    "y_test": data["y_test"].astype(np.int32),
  }
  os.makedirs(workdir, exist_ok=True)
  # A per-process temporary name: the workers of benchmarks/launch.py may generate it
  # together.
  tmp = f"{path}.tmp{os.getpid()}.npz"
  np.savez(tmp, **arrays)
  os.replace(tmp, path)
  return arrays


def train_batches(
  x: np.ndarray,
  y: np.ndarray,
  *,
  num_devices: int,
  per_device_batch_size: int,
  seed: int,
  start_step: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields ``(x, y)`` batches of shape ``(K, per_device_batch_size, ...)`` forever.

  Each epoch is a fresh permutation drawn from ``np.random.default_rng(seed)``, so the
  same seed gives the same batches in the same order (every method sees identical
  data). The tail of an epoch that does not fill a global batch is dropped.
  ``start_step`` skips that many batches (a run resumed from a checkpoint sees the
  batches the uninterrupted run would have): the permutations of the skipped epochs
  are still drawn, so the generator is where it would have been.
  """
  rng = np.random.default_rng(seed)
  global_batch = num_devices * per_device_batch_size
  if global_batch > len(x):
    raise ValueError(f"global batch {global_batch} exceeds the {len(x)} training examples")
  per_epoch = len(x) // global_batch
  skip_epochs, skip = divmod(start_step, per_epoch)
  for _ in range(skip_epochs):
    rng.permutation(len(x))
  while True:
    perm = rng.permutation(len(x))
    for start in range(skip * global_batch, per_epoch * global_batch, global_batch):
      idx = perm[start : start + global_batch].reshape(num_devices, per_device_batch_size)
      yield x[idx], y[idx]
    skip = 0


def eval_shards(
  x: np.ndarray, y: np.ndarray, num_devices: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Pads the test set to a multiple of ``K`` and splits it: ``(K, n/K, ...)`` arrays.

  Returns ``(x, y, mask)``; ``mask`` is 1.0 for real examples and 0.0 for padding.
  """
  n = len(x)
  per_device = -(-n // num_devices)
  pad = per_device * num_devices - n
  mask = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
  x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
  y = np.concatenate([y, np.zeros(pad, y.dtype)])
  split = lambda a: a.reshape(num_devices, per_device, *a.shape[1:])
  return split(x), split(y), split(mask)
