r"""Time-to-loss of the LM example over a real, throttled link: 2 processes, 2 namespaces.

The LM trainer (``examples.lm``) runs as 2 processes under ``jax.distributed`` (gloo),
one CPU device each, pinned to a core each, in two network namespaces joined by a veth
pair that ``tc tbf`` throttles (the link of :mod:`benchmarks.network`, imported). Every
method trains the same model on the same batches with the same schedule of
``--steps`` updates, and stops once its validation loss reaches the **target**: dense's
validation loss after ``--target-step`` updates (dense's trajectory is the same bits at
every rate, so one unthrottled dense run both sets the target and measures the compute
step time). A method that has not reached it when the schedule ends is reported as
such. The time to target is the training time (evaluation and compilation excluded)
up to the evaluation that first reached it. DiLoCo's methods (``diloco``,
``diloco_qsgd4``) are evaluated at their anchor, the shared parameters of the last sync:
with ``--eval-every`` a multiple of the config's ``diloco_sync_every`` (10 in every
config), each evaluation sees a fresh sync.

**The scaled rate.** On this CPU a step of a small model is ~10^4 times slower than on
an H100, so a real link makes communication look free. The scaled rate keeps a real
cluster's compute-to-communication ratio for the *same model and per-device batch*:

  t_gpu = F / (peak · utilisation),  F = 6·N·tokens + 12·depth·seq_len·width·tokens
  rate_here = rate_cluster · t_gpu / t_cpu

with N the parameters, ``tokens`` per device per update, ``peak`` an H100 SXM's dense
bf16 989 TFLOP/s at ``--utilisation`` (default 40%), and ``t_cpu`` the measured
compute step time of dense here (unthrottled veth); for 25 and 100 Gbit/s cluster
links (``--cluster-links``). Dense then spends the same share of its step
communicating here as it would there. ``--rates`` takes ``scaled25``/``scaled100``
beside tc rates (``1gbit``, ``100mbit``).

  sudo python -m benchmarks.lm_network                       # 100mbit and scaled100
  sudo python -m benchmarks.lm_network --rates 1gbit,100mbit,scaled25 --methods dense,powersgd
  python -m benchmarks.lm_network --smoke                    # 2 local processes, no link

Needs root, ``ip``, ``tc`` and ``taskset`` (except ``--smoke``); without them it says so
and exits 2. Writes ``--out`` (default ``runs/lm_network``): ``results.json`` and
``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from benchmarks import launch
from benchmarks import network

H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100 SXM
DEFAULT_METHODS = ("dense", "qsgd4", "onebit_adam", "diloco", "diloco_qsgd4")
DEFAULT_RATES = ("100mbit", "scaled100")


def model_flops(config, num_params: int) -> float:
  """Training FLOPs per device per update: 6·N per token (forward and backward of the
  matmuls) plus the attention scores and mixing, 12·depth·seq_len·width per token."""
  tokens = config.per_device_batch_size * config.seq_len * config.accumulation_steps
  attention = 12 * config.depth * config.seq_len * config.width
  return tokens * (6 * num_params + attention)


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


def worker_commands(
  flags: list[str], *, coordinator: str, prefix=None, num_processes: int = 2
) -> list[list[str]]:
  """The LM trainer's command line for each process (``python -m examples.lm.main``)."""
  return [
    [
      *(prefix(i) if prefix is not None else ()),
      sys.executable,
      "-m",
      "examples.lm.main",
      *flags,
      "--coordinator",
      coordinator,
      "--num-processes",
      str(num_processes),
      "--process-id",
      str(i),
      "--devices-per-process",
      "1",
    ]
    for i in range(num_processes)
  ]


def run_trainer(
  flags: list[str], workdir: str, *, coordinator: str, prefix, timeout: float
) -> dict[str, Any]:
  """Runs the 2-process trainer; process 0's ``results.json``."""
  os.makedirs(workdir, exist_ok=True)
  commands = worker_commands([*flags, "--workdir", workdir], coordinator=coordinator, prefix=prefix)
  launch.run_processes(commands, timeout=timeout, stream=False)
  with open(os.path.join(workdir, "results.json")) as f:
    return json.load(f)


def summarize(by_rate: dict[str, dict[str, Any]], target: float, args) -> str:
  """The Markdown table: time to target and speed-up vs dense, per rate and method."""
  lines = [
    f"Time to dense's validation loss at update {args.target_step}"
    + (f" plus {100 * args.tolerance:g}%" if args.tolerance else "")
    + f" ({target:.4f} nats/byte),"
    f" schedule of {args.steps} updates, config {args.config}, 2 processes x 1 CPU device"
    " (gloo) over a tc-throttled veth. Time: training steps only.",
    "",
    "| rate | method | reached at update | time to target (s) | speed-up vs dense |"
    " s/update | val loss at stop | vs target | bytes/update | fewer bytes |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for run in by_rate.values():
    results = run["results"]["results"]
    dense_t = results.get("dense", {}).get("target_time_s")
    dense_b = results.get("dense", {}).get("bytes_received")
    for method, r in results.items():
      h = r["history"]
      steps = h["step"][-1]
      per_step = r["train_time_s"] / steps if steps else float("nan")
      if r["target_step"] is None:
        reached, t, speedup = f"not within {steps}", "-", "-"
      else:
        reached, t = str(r["target_step"]), f"{r['target_time_s']:.1f}"
        speedup = f"{dense_t / r['target_time_s']:.2f}x" if dense_t else "-"
      recv = "n/a" if r["bytes_received"] is None else f"{r['bytes_received']:,.0f}"
      fewer = f"{dense_b / r['bytes_received']:.0f}x" if dense_b and r["bytes_received"] else "-"
      gap = f"{100 * (r['val_loss'] / target - 1):+.1f}%"
      mark = " **diverged**" if r.get("diverged") else ""
      lines.append(
        f"| {run['label']} | {method}{mark} | {reached} | {t} | {speedup} | {per_step:.3f}"
        f" | {r['val_loss']:.4f} | {gap} | {recv} | {fewer} |"
      )
  return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="bench", help="examples/lm config (default: bench)")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated")
  p.add_argument(
    "--rates",
    default=",".join(DEFAULT_RATES),
    help="comma-separated: tc rates (1gbit, 100mbit, ...) and scaled25/scaled100",
  )
  p.add_argument("--steps", type=int, default=300, help="schedule length and step budget")
  p.add_argument("--target-step", type=int, default=200, help="dense's update setting the target")
  p.add_argument(
    "--tolerance",
    type=float,
    default=0.0,
    help="the target is dense's loss times (1 + this), e.g. 0.02: within 2%%",
  )
  p.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
  p.add_argument("--batch", type=int, default=16, help="sequences per device per update")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--set", action="append", default=[], metavar="FIELD=VALUE", help="config override"
  )
  p.add_argument("--utilisation", type=float, default=0.4, help="H100 utilisation (MFU)")
  p.add_argument(
    "--cluster-links", default="25,100", help="cluster link rates in Gbit/s for scaledN"
  )
  p.add_argument("--timeout", type=float, default=1800, help="seconds per trainer run")
  p.add_argument("--out", default="runs/lm_network", help="output directory")
  p.add_argument(
    "--smoke",
    action="store_true",
    help="2 local processes, no namespaces or throttle, the tiny config, a few updates",
  )
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
  from examples.lm import configs  # pylint: disable=import-outside-toplevel

  config = configs.load(args.config).get_config()
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  rates = [r.strip() for r in args.rates.split(",") if r.strip()]
  common = [
    "--config",
    args.config,
    "--steps",
    str(args.steps),
    "--eval-every",
    str(args.eval_every),
    "--batch",
    str(args.batch),
    "--seed",
    str(args.seed),
    *(f"--set={item}" for item in args.set),
    "--allow-diverged",  # a diverged method is a marked row, not a lost run
  ]
  out: dict[str, Any] = {
    "args": vars(args),
    "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
  }

  def run_all(prefix, host: str) -> dict[str, Any]:
    def coordinator():
      return f"{host}:{network.free_port()}"

    # 1. Dense, unthrottled, to the target step: the target and the compute step time.
    calib = run_trainer(
      [*common, "--methods", "dense", "--stop-at", str(args.target_step)],
      os.path.join(args.out, "calibration"),
      coordinator=coordinator(),
      prefix=prefix,
      timeout=args.timeout,
    )
    dense = calib["results"]["dense"]
    # Dense's own bits reach it at target_step (1e-6: the float round trip through JSON);
    # --tolerance 0.02: within 2% of it.
    target = dense["val_loss"] * (1 + max(args.tolerance, 1e-6))
    cpu_step = dense["train_time_s"] / dense["history"]["step"][-1]
    from flax import nnx  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel

    from examples.lm import models  # pylint: disable=import-outside-toplevel

    cfg = config.__class__(**{**calib["config"], "per_device_batch_size": args.batch})
    shapes = nnx.eval_shape(lambda: models.create_model(cfg, rngs=nnx.Rngs(0)))
    num_params = sum(p.size for p in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    flops = model_flops(cfg, num_params)
    scaled = {}
    for gbit in (float(g) for g in args.cluster_links.split(",")):
      bits = scaled_rate_bits(gbit * 1e9, flops, cpu_step, args.utilisation)
      scaled[f"scaled{gbit:g}"] = {"cluster_gbit": gbit, "rate_bits": bits, "tc": tc_rate(bits)}
    out["mapping"] = {
      "num_params": num_params,
      "flops_per_update_per_device": flops,
      "h100_step_s": flops / (H100_BF16_FLOPS * args.utilisation),
      "cpu_step_s": cpu_step,
      "utilisation": args.utilisation,
      "scaled": scaled,
    }
    out["target"] = {"step": args.target_step, "val_loss": target}
    print(json.dumps(out["mapping"], indent=1), flush=True)

    by_rate = {}
    for rate in rates:
      tc = scaled[rate]["tc"] if rate in scaled else rate
      label = f"{rate} ({tc})" if rate in scaled else rate
      if prefix is not None:
        link.set_rate(tc)
      print(f"--- {label}: {','.join(methods)}", flush=True)
      run = run_trainer(
        [*common, "--methods", ",".join(methods), "--target-loss", repr(target)],
        os.path.join(args.out, rate),
        coordinator=coordinator(),
        prefix=prefix,
        timeout=args.timeout,
      )
      by_rate[rate] = {"label": label, "tc": tc, "results": run}
    return by_rate, target

  if args.smoke:
    link = None
    by_rate, target = run_all(None, "127.0.0.1")
  else:
    with network.Link() as link:
      link.set_rate("none")
      by_rate, target = run_all(network.Link.prefix, network.ADDRESSES[0])
  out["runs"] = {r: {k: v for k, v in run.items()} for r, run in by_rate.items()}
  table = summarize(by_rate, target, args)
  mapping = out["mapping"]
  notes = [
    "",
    f"Scaled rates: {mapping['num_params']:,} parameters,"
    f" {mapping['flops_per_update_per_device'] / 1e9:.2f} GFLOP per device per update;"
    f" H100 at {100 * args.utilisation:.0f}% of 989 TFLOP/s:"
    f" {1e6 * mapping['h100_step_s']:.2f} us; this CPU (dense, unthrottled):"
    f" {1e3 * mapping['cpu_step_s']:.1f} ms; "
    + "; ".join(
      f"{s['cluster_gbit']:g} Gbit/s -> {s['rate_bits'] / 1e6:.2f} Mbit/s here"
      for s in mapping["scaled"].values()
    )
    + ".",
  ]
  print(table + "\n".join(notes))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n".join(notes) + "\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
