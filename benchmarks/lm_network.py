r"""Time-to-loss of the LM example over a real, throttled link: 2 processes, 2 namespaces.

The LM trainer (``examples.lm``) as 2 processes across :mod:`benchmarks.network`'s link,
every method until its validation loss reaches dense's at ``--target-step`` (within
``--tolerance``) or its ``--steps`` run out; at tc rates or at ``scaled25``/``scaled100``,
this CPU's rate for an H100's compute-to-communication ratio on a 25 or 100 Gbit/s link
(docs/guides/lm.md and docs/benchmarks.md, "Time to loss over a throttled link").

  sudo python -m benchmarks.lm_network                       # 100mbit and scaled100
  sudo python -m benchmarks.lm_network --rates 1gbit,100mbit,scaled25 --methods dense,powersgd
  python -m benchmarks.lm_network --smoke                    # 2 local processes, no link

Needs root, ``ip``, ``tc`` and ``taskset`` (except ``--smoke``), or says so and exits 2.
Writes ``results.json`` and ``results.md`` to ``--out`` (default ``runs/lm_network``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time
from typing import Any

from benchmarks import launch
from benchmarks import network
from benchmarks._timing import md_table
from examples import common
from examples.lm import configs

H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100 SXM
DEFAULT_METHODS = ("dense", "qsgd4", "onebit_adam", "diloco", "diloco_qsgd4")
DEFAULT_RATES = ("100mbit", "scaled100")


def model_flops(config, num_params: int) -> float:
  """Training FLOPs per device per update: 6·N per token (forward and backward of the
  matmuls) plus the attention scores and mixing, 12·depth·seq_len·width per token."""
  tokens = config.per_device_batch_size * config.seq_len * config.accumulation_steps
  return tokens * (6 * num_params + 12 * config.depth * config.seq_len * config.width)


def scaled_rate_bits(
  cluster_bits: float, flops: float, cpu_step_s: float, utilisation: float
) -> float:
  """The link rate (bit/s) giving this CPU a cluster's compute-to-communication ratio:
  ``cluster_bits · t_gpu / t_cpu`` with ``t_gpu = flops / (989 TFLOP/s · utilisation)``."""
  if not 0 < utilisation <= 1:
    raise ValueError(f"utilisation must be in (0, 1], got {utilisation}")
  if not cpu_step_s > 0:
    raise ValueError(f"the CPU step time must be positive, got {cpu_step_s}")
  t_gpu = flops / (H100_BF16_FLOPS * utilisation)
  return cluster_bits * t_gpu / cpu_step_s


def tc_rate(bits: float) -> str:
  """A tc rate string (kbit resolution) for ``bits`` per second."""
  return f"{max(1, round(bits / 1e3))}kbit"


def worker_commands(flags: list[str], *, coordinator: str, prefix=None) -> list[list[str]]:
  """The LM trainer's command line for each of the 2 processes (``examples.lm.main``)."""
  flags = [*flags, "--devices-per-process", "1"]
  job = dict(processes=2, coordinator=coordinator, prefix=prefix)
  return launch.worker_commands("examples.lm.main", flags, **job)


def run_trainer(
  flags: list[str], workdir: str, *, coordinator: str, prefix, timeout: float
) -> dict[str, Any]:
  """Runs the 2-process trainer; process 0's ``results.json``."""
  os.makedirs(workdir, exist_ok=True)
  commands = worker_commands([*flags, "--workdir", workdir], coordinator=coordinator, prefix=prefix)
  launch.run_processes(commands, timeout=timeout, stream=False)
  with open(os.path.join(workdir, "results.json")) as f:
    return json.load(f)


def rate_mapping(config, calibration: dict[str, Any], args) -> dict[str, Any]:
  """The scaled rates, from dense's unthrottled ``calibration`` run of ``config``."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  from examples.lm import models  # pylint: disable=import-outside-toplevel

  dense = calibration["results"]["dense"]
  cpu_step = dense["train_time_s"] / dense["history"]["step"][-1]
  cfg = config.__class__(**{**calibration["config"], "per_device_batch_size": args.batch})
  shapes = nnx.eval_shape(lambda: models.create_model(cfg, rngs=nnx.Rngs(0)))
  num_params = sum(p.size for p in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
  flops = model_flops(cfg, num_params)
  scaled = {}
  for gbit in (float(g) for g in args.cluster_links.split(",")):
    bits = scaled_rate_bits(gbit * 1e9, flops, cpu_step, args.utilisation)
    scaled[f"scaled{gbit:g}"] = {"cluster_gbit": gbit, "rate_bits": bits, "tc": tc_rate(bits)}
  return {
    "num_params": num_params,
    "flops_per_update_per_device": flops,
    "h100_step_s": flops / (H100_BF16_FLOPS * args.utilisation),
    "cpu_step_s": cpu_step,
    "utilisation": args.utilisation,
    "scaled": scaled,
  }


def summarize(by_rate: dict[str, dict[str, Any]], target: float, args) -> str:
  """The Markdown table: time to target and speed-up vs dense, per rate and method."""
  rows = []
  for run in by_rate.values():
    results = run["results"]["results"]
    dense_t, dense_b = (
      results.get("dense", {}).get(k) for k in ("target_time_s", "bytes_received")
    )
    for method, r in results.items():
      steps, received = r["history"]["step"][-1], r["bytes_received"]
      per_step = r["train_time_s"] / steps if steps else float("nan")
      reached, t, speedup = f"not within {steps}", "-", "-"
      if r["target_step"] is not None:
        reached, t = str(r["target_step"]), f"{r['target_time_s']:.1f}"
        speedup = f"{dense_t / r['target_time_s']:.2f}x" if dense_t else "-"
      mark = " **diverged**" if r.get("diverged") else ""
      cells = [run["label"], method + mark, reached, t, speedup, f"{per_step:.3f}"]
      cells += [f"{r['val_loss']:.4f}", f"{100 * (r['val_loss'] / target - 1):+.1f}%"]
      cells.append("n/a" if received is None else f"{received:,.0f}")
      rows.append([*cells, f"{dense_b / received:.0f}x" if dense_b and received else "-"])
  tolerance = f" plus {100 * args.tolerance:g}%" if args.tolerance else ""
  title = (
    f"Time to dense's validation loss at update {args.target_step}{tolerance}"
    f" ({target:.4f} nats/byte), schedule of {args.steps} updates, config {args.config},"
    " 2 processes x 1 CPU device (gloo) over a tc-throttled veth. Time: training steps only."
  )
  head = (
    "rate | method | reached at update | time to target (s) | speed-up vs dense | s/update"
    " | val loss at stop | vs target | bytes/update | fewer bytes"
  )
  return md_table(head, rows, title, left=2)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = p.add_argument
  add("--config", default="bench", help="examples/lm config (default: bench)")
  add("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated")
  add("--rates", default=",".join(DEFAULT_RATES), help="tc rates (1gbit, ...), scaled25/100")
  add("--steps", type=int, default=300, help="schedule length and step budget")
  add("--target-step", type=int, default=200, help="dense's update setting the target")
  add("--tolerance", type=float, default=0.0, help="target: dense's loss times (1 + this)")
  add("--eval-every", type=int, default=10, help="updates between evaluations")
  add("--batch", type=int, default=16, help="sequences per device per update")
  add("--seed", type=int, default=0)
  add("--set", action="append", default=[], metavar="FIELD=VALUE", help="config override")
  add("--utilisation", type=float, default=0.4, help="H100 utilisation (MFU)")
  add("--cluster-links", default="25,100", help="cluster link rates in Gbit/s for scaledN")
  add("--timeout", type=float, default=1800, help="seconds per trainer run")
  add("--out", default="runs/lm_network", help="output directory")
  add("--smoke", action="store_true", help="2 local processes, no link, tiny config, 4 updates")
  args = p.parse_args(argv)
  args.out = os.path.abspath(args.out)
  if args.smoke:
    args.config, args.steps, args.target_step, args.eval_every, args.batch = "tiny", 4, 2, 2, 2
    args.rates = "none"
  if not 0 <= args.tolerance < 1:
    p.error("--tolerance must be in [0, 1)")
  if not 0 < args.target_step <= args.steps or args.steps % args.eval_every:
    p.error("need 0 < --target-step <= --steps, both multiples of --eval-every")
  if args.target_step % args.eval_every:
    p.error("--target-step must be a multiple of --eval-every")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if not args.smoke and network.cannot_run("benchmarks.lm_network"):
    return 2
  config = configs.load(args.config).get_config()
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  rates = [r.strip() for r in args.rates.split(",") if r.strip()]
  flags = [
    *f"--config {args.config} --steps {args.steps} --eval-every {args.eval_every}".split(),
    *f"--batch {args.batch} --seed {args.seed}".split(),
    *(f"--set={item}" for item in args.set),
    "--allow-diverged",  # a diverged method is a marked row, not a lost run
  ]
  out: dict[str, Any] = {
    "args": vars(args),
    "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  }
  with contextlib.nullcontext() if args.smoke else network.open_link() as link:
    prefix = None if link is None else functools.partial(link.worker_prefix, pin=True)
    host = "127.0.0.1" if link is None else network.ADDRESSES[0]

    def train(what: list[str], subdir: str) -> dict[str, Any]:
      workdir = os.path.join(args.out, subdir)
      coordinator = f"{host}:{launch.free_port()}"
      return run_trainer(
        [*flags, *what], workdir, coordinator=coordinator, prefix=prefix, timeout=args.timeout
      )

    # Dense's trajectory is the same bits at every rate: one unthrottled run to the target
    # step sets the target and measures the compute step time of the scaled rates.
    calibration = train(["--methods", "dense", "--stop-at", str(args.target_step)], "calibration")
    # Dense's own bits reach it at target_step (1e-6: the float round trip through JSON).
    target = calibration["results"]["dense"]["val_loss"] * (1 + max(args.tolerance, 1e-6))
    out["mapping"] = mapping = rate_mapping(config, calibration, args)
    out["target"] = {"step": args.target_step, "val_loss": target}
    print(json.dumps(mapping, indent=1), flush=True)
    out["runs"] = by_rate = {}
    for rate in rates:
      tc = mapping["scaled"][rate]["tc"] if rate in mapping["scaled"] else rate
      label = f"{rate} ({tc})" if rate in mapping["scaled"] else rate
      if link is not None:
        link.set_rate(tc)
      print(f"--- {label}: {','.join(methods)}", flush=True)
      run = train(["--methods", ",".join(methods), "--target-loss", repr(target)], rate)
      by_rate[rate] = {"label": label, "tc": tc, "results": run}
  scaled = "; ".join(
    f"{s['cluster_gbit']:g} Gbit/s -> {s['rate_bits'] / 1e6:.2f} Mbit/s here"
    for s in mapping["scaled"].values()
  )
  notes = (
    f"\nScaled rates: {mapping['num_params']:,} parameters,"
    f" {mapping['flops_per_update_per_device'] / 1e9:.2f} GFLOP per device per update;"
    f" H100 at {100 * args.utilisation:.0f}% of 989 TFLOP/s:"
    f" {1e6 * mapping['h100_step_s']:.2f} us; this CPU (dense, unthrottled):"
    f" {1e3 * mapping['cpu_step_s']:.1f} ms; {scaled}."
  )
  os.makedirs(args.out, exist_ok=True)
  common.write_results(args.out, summarize(by_rate, target, args) + notes, out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
