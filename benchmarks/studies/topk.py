"""Top-k selection on CPU: DGC's sampled threshold and the blocked top-k vs lax.top_k.

  python -m benchmarks.studies.topk                  # n = 1M..16M, density 0.1%
  python -m benchmarks.studies.topk --sizes 1,4 --repeats 3

Times the encode of :class:`jaxcomp.codecs.TopK` with ``method="exact"`` (``lax.top_k``
of |x|), ``"blocked"`` and ``"sampled"`` (jitted, one device, median of ``--repeats``)
as ratios to ``lax.top_k`` in the same run, and the recall of each set against the exact
top-k on Gaussian and Student-t (1.5 d.o.f.) inputs. Results: docs/methods/dgc.md.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks._timing import md_head
from benchmarks._timing import median_time
import jaxcomp as jc


def run(sizes_m, density: float, repeats: int) -> list[dict]:
  rows = []
  for size in sizes_m:
    n = int(size * 2**20)
    row = {"n": n}
    for dist in ("gaussian", "heavy_tailed"):
      key = jax.random.key(n % 1000)
      x = jax.random.t(key, 1.5, (n,)) if dist != "gaussian" else jax.random.normal(key, (n,))
      exact_idx = None
      for method in ("exact", "blocked", "sampled"):
        codec = jc.codecs.TopK(density, method)
        encode = jax.jit(lambda v, key, c=codec: c.encode(v, key=key).arrays["indices"])
        key = jax.random.key(1)
        idx = np.asarray(encode(x, key)).astype(np.int64)
        if method == "exact":
          exact_idx = set(idx.tolist())
        else:
          row[f"recall_{method}_{dist}"] = len(exact_idx & set(idx.tolist())) / len(exact_idx)
        if dist == "gaussian":
          row[f"time_{method}"] = median_time(encode, x, key, repeats=repeats)
    rows.append(row)
    print(
      f"n={n:>10,}: exact {row['time_exact'] * 1e3:7.1f} ms, blocked "
      f"{row['time_blocked'] * 1e3:7.1f} ms, sampled {row['time_sampled'] * 1e3:7.1f} ms",
      flush=True,
    )
  return rows


def table(rows: list[dict], density: float) -> str:
  head = "n | lax.top_k (ms) | blocked (ms) | speed-up | sampled (ms) | speed-up | recall sampled"
  lines = [
    f"TopK encode on {jax.devices()[0].device_kind} ({jax.device_count()} device(s) "
    f"visible, one used), density {density:g}, jax {jax.__version__}. Speed-up = "
    "lax.top_k time / method time (same run). Recall = share of the exact top-k selected.",
    "",
    md_head(head + " (gauss / heavy) | recall blocked (gauss / heavy)", "r" * 8),
  ]
  for r in rows:
    lines.append(
      f"| {r['n']:,} | {r['time_exact'] * 1e3:.1f} | {r['time_blocked'] * 1e3:.1f} |"
      f" {r['time_exact'] / r['time_blocked']:.2f}x | {r['time_sampled'] * 1e3:.1f} |"
      f" {r['time_exact'] / r['time_sampled']:.2f}x |"
      f" {r['recall_sampled_gaussian']:.3f} / {r['recall_sampled_heavy_tailed']:.3f} |"
      f" {r['recall_blocked_gaussian']:.3f} / {r['recall_blocked_heavy_tailed']:.3f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="1,2,4,8,16", help="sizes in units of 2**20 values")
  parser.add_argument("--density", type=float, default=0.001)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  sizes = [float(s) for s in args.sizes.split(",")]
  print(table(run(sizes, args.density, args.repeats), args.density))


if __name__ == "__main__":
  main()
