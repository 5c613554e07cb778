r"""Training over a real, throttled link: 2 processes in 2 network namespaces.

Two network namespaces joined by a veth pair throttled with ``tc qdisc ... tbf``; the
2-process MNIST-1D trainer (:mod:`benchmarks.launch`) runs across it for every rate,
model and method, next to timed ``psum``\ s and ``all_gather``\ s to which it fits
:mod:`jaxcomp.network`'s α-β model, then predicts every step time from the compute time
and ``jc.wire_report`` (docs/benchmarks.md, "Training over a throttled link").

  sudo python -m benchmarks.network                         # everything (~30 min)
  sudo python -m benchmarks.network --configs params2m --rates 1gbit --methods dense,onebit

Needs root (``ip netns``, ``tc``) and ``taskset``; without them it says so and exits 2.
It touches only the namespaces, the veth pair and the ``/etc/netns/<name>`` entries it
creates (``ip netns exec`` mounts ``/etc/netns/<name>/hosts`` over ``/etc/hosts``, so that
gloo finds each peer at its namespace's address), and removes them at the end, also on
failure or Ctrl-C. Writes ``--out`` (default ``runs/network``): ``results.json``,
``results.md`` and ``step_time_vs_bandwidth.png``. The workers inherit the environment:
``GLIBC_TUNABLES=...`` (``benchmarks._timing.REUSE_MALLOC``) gives them a malloc that
reuses large buffers; the results record which.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import _timing
from examples.mnist1d.configs import default as demo_config

NAMESPACES = ("jcnet0", "jcnet1")
VETHS = ("jcveth0", "jcveth1")
ADDRESSES = ("10.231.77.1", "10.231.77.2")
PREFIX_LEN = 24
RATES = ("none", "10gbit", "1gbit", "100mbit")
CONFIGS = ("params2m", "params20m")
METHODS = demo_config.Config.methods  # the demo's methods, in its table order
PSUM_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes per device
RESULT_MARKER = "JAXCOMP_PSUM_RESULT "
BURST_MS = 1.0  # tbf bucket: this many ms of traffic at the rate...
MIN_BURST = 64 * 1024  # ...and at least this many bytes


# ----------------------------------------------------------------------------- the link


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def missing_requirements() -> list[str]:
  """What this machine lacks for the benchmark (empty: it can run)."""
  missing = []
  if os.geteuid() != 0:
    missing.append("root (ip netns and tc need CAP_NET_ADMIN): run it with sudo")
  for tool in ("ip", "tc", "taskset"):
    if shutil.which(tool) is None:
      missing.append(f"the {tool!r} command")
  return missing


def cannot_run(what: str) -> bool:
  """Says on stderr why ``what`` cannot build the link here, if it cannot (then True)."""
  missing = missing_requirements()
  if missing:
    print(f"{what} cannot run here; it needs " + "; ".join(missing) + ".", file=sys.stderr)
  return bool(missing)


def rate_bytes_per_s(rate: str) -> float | None:
  """``"100mbit"`` -> 12.5e6 bytes/s; ``"none"`` -> None (no throttle)."""
  if rate == "none":
    return None
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
  for unit, scale in units.items():
    if rate.endswith(unit):
      return float(rate[: -len(unit)]) * scale / 8
  raise ValueError(f"rate must look like 100mbit, 1gbit or none; got {rate!r}")


def tbf_burst(rate: str, burst_ms: float = BURST_MS) -> int | None:
  """The tbf bucket for ``rate`` in bytes: ``burst_ms`` of traffic, at least 64 KiB
  (``None`` for ``"none"``). See :meth:`Link.set_rate`."""
  bps = rate_bytes_per_s(rate)
  if bps is None:
    return None
  if not burst_ms > 0:
    raise ValueError(f"burst_ms must be positive, got {burst_ms}")
  return max(int(bps * burst_ms / 1e3), MIN_BURST)


class Link(contextlib.AbstractContextManager):
  """Two namespaces joined by a veth pair; torn down on exit, whatever happened."""

  def __init__(
    self,
    namespaces: Sequence[str] = NAMESPACES,
    veths: Sequence[str] = VETHS,
    addresses: Sequence[str] = ADDRESSES,
  ):
    self.namespaces, self.veths, self.addresses = tuple(namespaces), tuple(veths), tuple(addresses)
    self.created_netns: list[str] = []
    self.created_dirs: list[str] = []
    self.created_netns_root = False

  def __enter__(self) -> Link:
    try:
      self._setup()
    except BaseException:
      self.teardown()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.teardown()

  def _setup(self) -> None:
    existing = _run(["ip", "netns", "list"]).stdout.split()
    clash = [n for n in self.namespaces if n in existing]
    if clash:
      raise RuntimeError(
        f"network namespaces {clash} exist already (a previous run that "
        f"was killed?): remove them with `ip netns del NAME`"
      )
    host = socket.gethostname()
    if not os.path.isdir("/etc/netns"):
      os.makedirs("/etc/netns")
      self.created_netns_root = True
    for ns, addr in zip(self.namespaces, self.addresses):
      _run(["ip", "netns", "add", ns])
      self.created_netns.append(ns)
      d = os.path.join("/etc/netns", ns)
      os.makedirs(d, exist_ok=True)
      self.created_dirs.append(d)
      with open(os.path.join(d, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{addr} {host}\n")
    _run(["ip", "link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1]])
    for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses):
      _run(["ip", "link", "set", veth, "netns", ns])
      self.exec(ns, ["ip", "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", veth])
      self.exec(ns, ["ip", "link", "set", veth, "up"])
      self.exec(ns, ["ip", "link", "set", "lo", "up"])

  def exec(self, ns: str, cmd: Sequence[str], check: bool = True):
    return _run(["ip", "netns", "exec", ns, *cmd], check=check)

  def set_rate(self, rate: str, burst_ms: float = BURST_MS) -> int | None:
    """Throttles both ends' egress to ``rate`` (tc tbf), or removes the throttle.

    Returns the bucket size in bytes (``None`` unthrottled): ``burst_ms`` of traffic at
    the rate, at least 64 KiB. The bucket is credit that a message spends at the
    sender's speed: with 10 ms' worth (1.25 MB at 1 Gbit/s, this benchmark's first
    setting) 1 MiB crossed a 1 Gbit/s link at three times the rate, and only a message
    larger than the bucket saw the rate. With 1 ms' worth (64 KiB at 100 Mbit/s) the
    link runs at 86-96% of the rate for 1-10 MiB (docs/benchmarks.md, the tbf bucket).
    """
    bps = rate_bytes_per_s(rate)
    burst = tbf_burst(rate, burst_ms)
    for ns, veth in zip(self.namespaces, self.veths):
      self.exec(ns, ["tc", "qdisc", "del", "dev", veth, "root"], check=False)
      if bps is None:
        continue
      self.exec(
        ns,
        [
          "tc",
          "qdisc",
          "add",
          "dev",
          veth,
          "root",
          "tbf",
          "rate",
          rate,
          "burst",
          str(burst),
          "latency",
          "100ms",
        ],
      )
    return burst

  def set_up(self, up: bool) -> None:
    """Brings both ends of the veth up, or down (a partitioned link: nothing crosses)."""
    for ns, veth in zip(self.namespaces, self.veths):
      self.exec(ns, ["ip", "link", "set", veth, "up" if up else "down"])

  def worker_prefix(self, process_id: int, pin: bool = False) -> list[str]:
    """Worker ``i`` runs in this link's namespace ``i`` (``pin``: on core ``i``)."""
    cores = ["taskset", "-c", str(process_id % (os.cpu_count() or 1))] if pin else []
    return ["ip", "netns", "exec", self.namespaces[process_id], *cores]

  def teardown(self) -> None:
    for ns in self.created_netns:  # deleting a namespace deletes its veth end (and pair)
      _run(["ip", "netns", "del", ns], check=False)
    self.created_netns = []
    for d in self.created_dirs:
      shutil.rmtree(d, ignore_errors=True)
    self.created_dirs = []
    if self.created_netns_root:
      with contextlib.suppress(OSError):
        os.rmdir("/etc/netns")
      self.created_netns_root = False

  @staticmethod
  def prefix(process_id: int) -> list[str]:
    """Worker ``i`` runs in namespace ``i``, pinned to core ``i``."""
    return [
      "ip",
      "netns",
      "exec",
      NAMESPACES[process_id],
      "taskset",
      "-c",
      str(process_id % (os.cpu_count() or 1)),
    ]


# ----------------------------------------------------------------------------- psum timing


def psum_worker(args: argparse.Namespace) -> None:
  """Worker mode: times ``psum`` and ``all_gather`` of each size across the processes.

  Each process contributes ``size`` bytes to both. gloo's all-gather moves more than its
  ideal traffic (docs/benchmarks.md, collectives across the throttled link), so the model
  fits it a link of its own.
  """
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  launch.init_distributed(
    args.coordinator, args.num_processes, args.process_id, devices_per_process=1
  )
  import jax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((jax.device_count(),), ("b",))
  ops = {
    "psum": lambda x: lax.psum(x, "b"),
    "all_gather": lambda x: lax.all_gather(x, "b", tiled=True),
  }
  result: dict[str, Any] = {"process_id": args.process_id}
  for name, op in ops.items():
    f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    samples = []
    for size in args.sizes:
      n = size // 4
      local = np.ones((n,), np.float32)
      x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P("b")), local)
      f(x).block_until_ready()  # compile, and warm the connection
      start = time.perf_counter()
      f(x).block_until_ready()
      warm = time.perf_counter() - start
      # How many timed collectives fit the budget: process 0's estimate, broadcast, so
      # that both processes issue the same number (each deciding from its own clock,
      # one could start a collective the other never joins, and hang).
      repeats = int(
        multihost_utils.broadcast_one_to_all(
          np.int32(min(15, max(3, int(2 * args.seconds_per_size / warm))))
        )
      )
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
      samples.append({"bytes": size, "times_s": times, "median_s": statistics.median(times)})
    result[name] = samples
  print(RESULT_MARKER + json.dumps(result), flush=True)
  jax.distributed.shutdown()


def time_collectives(sizes: Sequence[int], seconds_per_size: float, timeout: float) -> dict:
  """Runs :func:`psum_worker` in the two namespaces; process 0's timings, by collective
  (``"psum"``, ``"all_gather"``)."""
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  coordinator = f"{ADDRESSES[0]}:{free_port()}"
  commands = [
    [
      *Link.prefix(i),
      sys.executable,
      "-m",
      "benchmarks.network",
      "--psum-worker",
      "--process-id",
      str(i),
      "--num-processes",
      "2",
      "--coordinator",
      coordinator,
      "--psum-sizes",
      ",".join(map(str, sizes)),
      "--seconds-per-size",
      str(seconds_per_size),
    ]
    for i in range(2)
  ]
  result = launch.worker_results(commands, RESULT_MARKER, timeout=timeout)
  return {"psum": result["psum"], "all_gather": result["all_gather"]}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


# ----------------------------------------------------------------------------- training


def train_on_link(
  config: str,
  methods: Sequence[str],
  steps: int | None,
  timeout: float,
  workdir: str,
  profile: int = 0,
) -> dict[str, Any]:
  """The 2-process trainer across the namespaces; process 0's result (checked equal)."""
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  args = launch.worker_args(
    methods, config=config, devices_per_process=1, steps=steps, workdir=workdir, profile=profile
  )
  results = launch.launch(
    args,
    processes=2,
    prefix=Link.prefix,
    coordinator=f"{ADDRESSES[0]}:{free_port()}",
    timeout=timeout,
  )
  launch.check_identical(results)
  return results[0]


# ----------------------------------------------------------------------------- the model


def step_time(record: dict) -> float:
  """Mean step time after the first (compile warm-up) step, in seconds.

  The mean, not the median: MIPD's half updates alternate a cheap and a costly step,
  and the mean is what sets the time to train.
  """
  times = record["step_times_s"]
  return statistics.fmean(times[1:] or times)


def fit_and_predict(runs: dict, psums: dict, gathers: dict | None = None) -> dict:
  """Fits α-β per rate; predicts each method's step time; the errors vs measured.

  ``links`` is fitted to the psums; ``gather_links`` (when ``gathers`` holds timed
  all-gathers of the rate) prices the all-gathers, which gloo runs slower than their
  traffic at the psum's bandwidth would take. :func:`report` fits both ways.
  """
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import launch  # pylint: disable=import-outside-toplevel
  from examples.mnist1d import models  # pylint: disable=import-outside-toplevel
  from examples.mnist1d import train  # pylint: disable=import-outside-toplevel
  import jaxcomp as jc  # pylint: disable=import-outside-toplevel

  links = {
    rate: jc.network.fit_link([("psum", s["bytes"], 2, s["median_s"]) for s in ps])
    for rate, ps in psums.items()
  }
  gather_links = {
    rate: jc.network.fit_link([("all_gather", s["bytes"], 2, s["median_s"]) for s in gs])
    for rate, gs in (gathers or {}).items()
  }

  def per_primitive(rate: str) -> dict | None:
    return {"all_gather": gather_links[rate]} if rate in gather_links else None

  def as_json(ls):
    return {r: {"latency_s": l.latency_s, "bandwidth_Bps": l.bandwidth} for r, l in ls.items()}

  out: dict[str, Any] = {
    "links": as_json(links),
    "gather_links": as_json(gather_links),
    "predictions": {},
    "scaling": {},
  }
  for config_name, by_rate in runs.items():
    config = launch.load_config(config_name)
    model = models.create_model(config)
    x = jax.ShapeDtypeStruct((1, 40), jax.numpy.float32)
    params = jax.eval_shape(lambda a: model.init(jax.random.key(0), a)["params"], x)
    base = by_rate.get("none")
    if base is None:
      continue
    preds: dict[str, Any] = {}
    scaling: dict[str, Any] = {}
    for method in base["methods"]:
      tx = train.make_tx(method, config, train.make_exchange(method, config, warmup=False))
      report2 = jc.wire_report(tx, params, axis_name=train.AXIS, num_devices=2)
      compute = jc.network.compute_time(
        step_time(base["methods"][method]), report2, links["none"], links=per_primitive("none")
      )
      preds[method] = {"compute_s": compute}
      for rate, run in by_rate.items():
        if rate == "none" or method not in run["methods"]:
          continue
        predicted = jc.network.predict_step_time(
          compute, report2, links[rate], links=per_primitive(rate)
        )
        measured = step_time(run["methods"][method])
        preds[method][rate] = {
          "predicted_s": predicted,
          "measured_s": measured,
          "error": predicted / measured - 1,
        }
      # K up to 1024 at 1 Gbit/s with this link's fitted latency.
      ref = links.get("1gbit")
      if ref is not None:
        scaling[method] = {}
        for k in (2, 8, 64, 256, 1024):
          report = jc.wire_report(tx, params, axis_name=train.AXIS, num_devices=k)
          scaling[method][k] = {
            "bytes": report.bytes_received,
            "step_s": jc.network.predict_step_time(
              compute, report, ref, links=per_primitive("1gbit")
            ),
          }
    out["predictions"][config_name] = preds
    out["scaling"][config_name] = scaling
  return out


# ----------------------------------------------------------------------------- reporting


def tables(runs: dict, model: dict) -> str:
  """Markdown: measured steps per config and rate, then the model's errors and scaling."""
  lines = []
  for config, by_rate in runs.items():
    any_run = next(iter(by_rate.values()))
    lines += [
      f"### {config}: {any_run['num_params']:,} parameters, 2 processes x 1 CPU device",
      "",
      "| rate | method | mean step (ms) | speed-up vs dense | bytes/step (wire_report)"
      " | final loss | predicted step (ms) | error |",
      "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    preds = model["predictions"].get(config, {})
    for rate, run in by_rate.items():
      dense = run["methods"].get("dense")
      dense = step_time(dense) if dense else None
      for method, r in run["methods"].items():
        t = step_time(r)
        speedup = f"{dense / t:.2f}x" if dense else "n/a"
        p = preds.get(method, {}).get(rate)
        pred = f"{1e3 * p['predicted_s']:.0f}" if p else ""
        err = f"{100 * p['error']:+.0f}%" if p else ""
        lines.append(
          f"| {rate} | {method} | {1e3 * t:.0f} | {speedup} |"
          f" {r['bytes_received']:,.0f} | {r['final_loss']:.3f} | {pred} | {err} |"
        )
    lines.append("")
    if preds and "dense" in preds:
      # Where the time goes: compute (from the unthrottled run, minus the modelled
      # exchange), the codec's cost over dense, and the exchange at each rate.
      rates = [r for r in by_rate if r != "none"]
      base = preds["dense"]["compute_s"]
      lines += [
        f"Step time split ({config}): compute = unthrottled step minus the modelled "
        "exchange; codec = compute minus dense's (encode, decode, error feedback,"
        " top-k...); exchange = measured step minus compute.",
        "",
        "| method | compute (ms) | codec vs dense (ms) | "
        + " | ".join(f"exchange {r} (ms)" for r in rates)
        + " |",
        "|---|---:|---:|" + "---:|" * len(rates),
      ]
      for method, p in preds.items():
        cells = []
        for r in rates:
          m = by_rate[r]["methods"].get(method)
          cells.append("" if m is None else f"{1e3 * (step_time(m) - p['compute_s']):.0f}")
        lines.append(
          f"| {method} | {1e3 * p['compute_s']:.0f} |"
          f" {1e3 * (p['compute_s'] - base):+.0f} | " + " | ".join(cells) + " |"
        )
      lines.append("")
    scaling = model["scaling"].get(config)
    if scaling:
      ks = list(next(iter(scaling.values())))
      lines += [
        f"Predicted step time (ms) at 1 Gbit/s vs K ({config}, fitted α, β):",
        "",
        "| method | " + " | ".join(f"K={k}" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
      ]
      for method, by_k in scaling.items():
        lines.append(
          f"| {method} | " + " | ".join(f"{1e3 * by_k[k]['step_s']:.0f}" for k in ks) + " |"
        )
      lines.append("")
    lines += phase_tables(config, by_rate)
  title = "Fitted links (psum timings, least squares on relative error):"
  return "\n".join(lines) + "\n" + link_table(title, model["links"])


def prediction_errors(model: dict) -> dict[tuple[str, str, str], float]:
  """``(config, rate, method) -> predicted / measured - 1`` of a fitted model."""
  return {
    (config, rate, method): v["error"]
    for config, preds in model["predictions"].items()
    for method, p in preds.items()
    for rate, v in p.items()
    if isinstance(v, dict) and "error" in v
  }


def error_comparison(model: dict, model_gather: dict) -> str:
  """Markdown: each point's error with the psum link and with the all-gather link."""
  a, b = prediction_errors(model), prediction_errors(model_gather)
  lines = [
    "Prediction error with every collective on the psum link, and with the "
    "all-gathers on their own fitted link:",
    "",
    "| config | rate | method | psum link | all-gather link |",
    "|---|---|---|---:|---:|",
  ]
  for key in a:
    lines.append(f"| {' | '.join(key)} | {100 * a[key]:+.0f}% | {100 * b[key]:+.0f}% |")
  mean = lambda e: 100 * statistics.fmean(abs(v) for v in e.values()) if e else float("nan")
  lines += [
    "",
    f"Mean |error|: psum link {mean(a):.1f}%, all-gather link {mean(b):.1f}% ({len(a)} points).",
    "",
  ]
  return "\n".join(lines) + "\n"


def link_table(title: str, links: dict) -> str:
  """Markdown: each rate's fitted link (α, bandwidth) under ``title``."""
  lines = [title, "", "| rate | α (µs) | bandwidth (MB/s) |", "|---|---:|---:|"]
  for rate, l in links.items():
    lines.append(f"| {rate} | {1e6 * l['latency_s']:.0f} | {l['bandwidth_Bps'] / 1e6:.1f} |")
  return "\n".join(lines) + "\n"


def phase_tables(config: str, by_rate: dict) -> list[str]:
  """Markdown rows of the measured step split (``--profile``), process 0; or none."""
  from benchmarks.launch import PHASE_COLUMNS  # pylint: disable=import-outside-toplevel
  from benchmarks.launch import phase_row  # pylint: disable=import-outside-toplevel

  rows = [
    phase_row(f"{rate} | {method}", r["phases"])
    for rate, run in by_rate.items()
    for method, r in run["methods"].items()
    if r.get("phases")
  ]
  if not rows:
    return []
  return [
    f"Measured step split ({config}, process 0, `--profile`: ms per step from "
    "jc.profile_phases over the extra profiled steps; exchange includes waiting "
    "for the other process; idle is the step's wall time not covered by ops):",
    "",
    "| rate | method | step | " + " | ".join(PHASE_COLUMNS) + " |",
    "|---|---|---:|" + "---:|" * len(PHASE_COLUMNS),
    *rows,
    "",
  ]


def plot(runs: dict, path: str) -> None:
  """Median step time vs bandwidth, one line per method, one panel per config."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(5 * len(runs), 4), dpi=120)
  FigureCanvasAgg(fig)
  for i, (config, by_rate) in enumerate(runs.items()):
    ax = fig.add_subplot(1, len(runs), i + 1)
    rates = [r for r in by_rate if r != "none"]
    xs = [8 * rate_bytes_per_s(r) / 1e6 for r in rates]
    methods = next(iter(by_rate.values()))["methods"]
    for method in methods:
      ys = [1e3 * step_time(by_rate[r]["methods"][method]) for r in rates]
      ax.plot(xs, ys, marker="o", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s, tc tbf)")
    ax.set_ylabel("mean step time (ms)")
    ax.set_title(f"{config}, 2 processes")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--rates",
    default=",".join(RATES),
    help="tc tbf rates; 'none' (unthrottled) is always run first",
  )
  parser.add_argument("--configs", default=",".join(CONFIGS))
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
  parser.add_argument("--out", default="runs/network")
  parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
  parser.add_argument("--seconds-per-size", type=float, default=3.0)
  parser.add_argument(
    "--burst-ms",
    type=float,
    default=BURST_MS,
    help="tbf bucket in ms of traffic at the rate (at least 64 KiB)",
  )
  parser.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="STEPS",
    help="after each method's run, profile STEPS more steps "
    "(jc.profile_phases) and tabulate gradient/encode/exchange/decode",
  )
  parser.add_argument(
    "--analyze",
    default=None,
    metavar="RESULTS_JSON",
    help="only fit the model and write the tables/plot from a "
    "results.json of an earlier run (no root needed)",
  )
  # psum worker mode (internal).
  parser.add_argument("--psum-worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--num-processes", type=int, default=2, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument(
    "--psum-sizes",
    default=",".join(map(str, PSUM_SIZES)),
    help="bytes per device of the timed psums",
  )
  args = parser.parse_args(argv)
  args.sizes = [int(s) for s in args.psum_sizes.split(",")]
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.psum_worker:
    psum_worker(args)
    return 0
  if args.analyze:
    with open(args.analyze) as f:
      saved = json.load(f)
    report(
      saved["runs"],
      saved["psums"],
      args.out,
      saved.get("malloc"),
      saved.get("bursts"),
      saved.get("gathers"),
    )
    return 0
  if cannot_run("benchmarks/network.py"):
    return 2
  rates = ["none"] + [r for r in args.rates.split(",") if r != "none"]
  for r in rates:
    rate_bytes_per_s(r)  # validate before building anything
  configs = args.configs.split(",")
  methods = args.methods.split(",")
  os.makedirs(args.out, exist_ok=True)
  # SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the link is torn down.
  from benchmarks import launch  # pylint: disable=import-outside-toplevel

  signal.signal(signal.SIGTERM, launch.raise_keyboard_interrupt)
  runs: dict[str, dict[str, Any]] = {c: {} for c in configs}
  psums: dict[str, list] = {}
  gathers: dict[str, list] = {}
  malloc = _timing.malloc_label()  # the workers inherit this environment
  bursts: dict[str, int | None] = {}
  with Link() as link:
    for rate in rates:
      bursts[rate] = link.set_rate(rate, args.burst_ms)
      print(f"== link {rate}: timing psums and all-gathers", flush=True)
      timed = time_collectives(args.sizes, args.seconds_per_size, args.timeout)
      psums[rate], gathers[rate] = timed["psum"], timed["all_gather"]
      for s, g in zip(psums[rate], gathers[rate]):
        print(
          f"   {s['bytes']:>10,} B: psum {1e3 * s['median_s']:9.2f} ms, all_gather "
          f"{1e3 * g['median_s']:9.2f} ms",
          flush=True,
        )
      for config in configs:
        print(f"== link {rate}, {config}: {','.join(methods)}", flush=True)
        start = time.perf_counter()
        runs[config][rate] = train_on_link(
          config, methods, args.steps, args.timeout, os.path.join(args.out, "data"), args.profile
        )
        for m, r in runs[config][rate]["methods"].items():
          print(
            f"   {m:>7}: mean step {1e3 * step_time(r):8.1f} ms, loss {r['final_loss']:.3f}",
            flush=True,
          )
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:  # partial results
          json.dump(
            {"runs": runs, "psums": psums, "gathers": gathers, "malloc": malloc, "bursts": bursts},
            f,
            indent=2,
          )
  report(runs, psums, args.out, malloc, bursts, gathers)
  return 0


def report(
  runs: dict,
  psums: dict,
  out: str,
  malloc: str | None = None,
  bursts: dict | None = None,
  gathers: dict | None = None,
) -> None:
  """Fits the model; writes results.json (with it), results.md and the plot.

  ``malloc`` says how the workers allocated (they inherit ``GLIBC_TUNABLES``; see
  ``benchmarks._timing.REUSE_MALLOC``), ``bursts`` the tbf bucket per rate (bytes) and
  ``gathers`` the timed all-gathers per rate; ``None`` for results saved before they
  were kept (the model then prices all-gathers with the psums' link).
  """
  os.makedirs(out, exist_ok=True)
  # The main model prices every collective with the psums' link. With timed all-gathers,
  # a second one prices the all-gathers with their own link; both errors are reported
  # (the second was not better overall on the throttled link:
  # docs/benchmarks.md#collectives-across-the-throttled-link).
  model = fit_and_predict(runs, psums)
  model_gather = fit_and_predict(runs, psums, gathers) if gathers else None
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(
      {
        "runs": runs,
        "psums": psums,
        "gathers": gathers,
        "model": model,
        "model_gather_links": model_gather,
        "malloc": malloc,
        "bursts": bursts,
      },
      f,
      indent=2,
    )
  burst_text = (
    "not recorded (10 ms of traffic at the rate, before 2026-11-22)"
    if bursts is None
    else ", ".join(f"{r} {b:,} B" for r, b in bursts.items() if b is not None)
  )
  text = f"malloc: {malloc or 'not recorded'}\n\ntbf bucket: {burst_text}\n\n" + tables(runs, model)
  if model_gather is not None:
    text += "\n" + error_comparison(model, model_gather)
    text += link_table("Fitted all-gather links:", model_gather.get("gather_links", {}))
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text)
  print(text)
  plot(runs, os.path.join(out, "step_time_vs_bandwidth.png"))


if __name__ == "__main__":
  sys.exit(main())
