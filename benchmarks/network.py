r"""Training over a real, throttled link: 2 processes in 2 network namespaces.

The 2-process MNIST-1D trainer (:mod:`benchmarks.launch`) across a veth pair throttled
with ``tc qdisc ... tbf``, for every rate, model and method, next to timed ``psum``\ s and
``all_gather``\ s to which it fits :mod:`jaxcomp.network`'s α-β model, which predicts
every step time from the compute time and ``jc.wire_report`` (docs/benchmarks.md,
"Training over a throttled link").

  sudo python -m benchmarks.network                         # everything (~30 min)
  sudo python -m benchmarks.network --configs params2m --rates 1gbit --methods dense,onebit

Needs root (``ip netns``, ``tc``) and ``taskset``, or says so and exits 2. Writes
``results.json`` and ``results.md`` to ``--out`` (default ``runs/network``); they record
the malloc the workers inherit (``GLIBC_TUNABLES``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import contextlib
import functools
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

import jax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks import _timing
from benchmarks import launch
from benchmarks._timing import md_table
from examples import common
from examples.mnist1d import models
from examples.mnist1d import train
from examples.mnist1d.configs import default as demo_config
import jaxcomp as jc

NAMESPACES = ("jcnet0", "jcnet1")
VETHS = ("jcveth0", "jcveth1")
ADDRESSES = ("10.231.77.1", "10.231.77.2")
PREFIX_LEN = 24
RATES = ("none", "10gbit", "1gbit", "100mbit")
CONFIGS = ("params2m", "params20m")
METHODS = demo_config.Config.methods  # the demo's methods, in its table order
PSUM_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes per device
BURST_MS = 1.0  # tbf bucket: this many ms of traffic at the rate...
MIN_BURST = 64 * 1024  # ...and at least this many bytes
SCALING_K = (2, 8, 64, 256, 1024)  # devices of the predicted scaling, at 1 Gbit/s


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def missing_requirements() -> list[str]:
  """What this machine lacks for the benchmark (empty: it can run)."""
  missing = [f"the {tool!r} command" for tool in ("ip", "tc", "taskset") if not shutil.which(tool)]
  if os.geteuid() != 0:
    missing.insert(0, "root (ip netns and tc need CAP_NET_ADMIN): run it with sudo")
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
  for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
    if rate.endswith(unit):
      return float(rate[: -len(unit)]) * scale / 8
  raise ValueError(f"rate must look like 100mbit, 1gbit or none; got {rate!r}")


def tbf_burst(rate: str, burst_ms: float = BURST_MS) -> int | None:
  """The tbf bucket for ``rate`` in bytes: ``burst_ms`` of traffic, at least 64 KiB
  (``None`` for ``"none"``). Why 1 ms: docs/benchmarks.md, "The tbf bucket"."""
  bps = rate_bytes_per_s(rate)
  if bps is None:
    return None
  if not burst_ms > 0:
    raise ValueError(f"burst_ms must be positive, got {burst_ms}")
  return max(int(bps * burst_ms / 1e3), MIN_BURST)


class Link(contextlib.AbstractContextManager):
  """Two namespaces joined by a veth pair; torn down on exit, whatever happened (the
  namespaces, the veth pair and ``/etc/netns/<name>/hosts``: gloo finds peers by name)."""

  def __init__(self, namespaces=NAMESPACES, veths=VETHS, addresses=ADDRESSES):
    self.namespaces, self.veths, self.addresses = tuple(namespaces), tuple(veths), tuple(addresses)
    self._undo = contextlib.ExitStack()  # removes what _setup created, and only that

  def __enter__(self) -> Link:
    with contextlib.ExitStack() as undo:  # unwinds a failed set-up
      self._setup(undo)
      self._undo = undo.pop_all()
    return self

  def __exit__(self, *exc) -> None:
    self.teardown()

  def _setup(self, undo: contextlib.ExitStack) -> None:
    existing = _run(["ip", "netns", "list"]).stdout.split()
    clash = [n for n in self.namespaces if n in existing]
    if clash:
      raise RuntimeError(
        f"network namespaces {clash} exist already (a previous run that "
        f"was killed?): remove them with `ip netns del NAME`"
      )
    if not os.path.isdir("/etc/netns"):
      os.makedirs("/etc/netns")
      undo.callback(_run, ["rmdir", "/etc/netns"], check=False)  # only if left empty
    for ns, addr in zip(self.namespaces, self.addresses):
      _run(["ip", "netns", "add", ns])
      undo.callback(_run, ["ip", "netns", "del", ns], check=False)  # and its veth end
      etc = os.path.join("/etc/netns", ns)
      os.makedirs(etc, exist_ok=True)
      undo.callback(shutil.rmtree, etc, ignore_errors=True)
      with open(os.path.join(etc, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    _run(["ip", "link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1]])
    for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses):
      _run(["ip", "link", "set", veth, "netns", ns])
      self.exec(ns, ["ip", "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", veth])
      self.exec(ns, ["ip", "link", "set", veth, "up"])
      self.exec(ns, ["ip", "link", "set", "lo", "up"])

  def exec(self, ns: str, cmd: Sequence[str], check: bool = True):
    return _run(["ip", "netns", "exec", ns, *cmd], check=check)

  def set_rate(self, rate: str, burst_ms: float = BURST_MS) -> int | None:
    """Throttles both ends' egress to ``rate`` (tc tbf), or removes the throttle;
    returns the bucket (:func:`tbf_burst`, ``None`` unthrottled)."""
    burst = tbf_burst(rate, burst_ms)
    for ns, veth in zip(self.namespaces, self.veths):
      self.exec(ns, ["tc", "qdisc", "del", "dev", veth, "root"], check=False)
      if burst is not None:
        tbf = f"tbf rate {rate} burst {burst} latency 100ms".split()
        self.exec(ns, ["tc", "qdisc", "add", "dev", veth, "root", *tbf])
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
    self._undo.close()


def open_link(*names) -> Link:
  """A :class:`Link` to enter; from now on SIGTERM (e.g. a CI timeout) unwinds like
  Ctrl-C, so that the link is torn down."""
  signal.signal(signal.SIGTERM, launch.raise_keyboard_interrupt)
  return Link(*names)


# The benchmarks across the link (this one, two_level, overlap, sharded, lm_network) are
# their own workers: one command per process (launch.worker_commands), each joins the job
# (join) and prints its result on one line (emit), which run_on_link returns.


def add_worker_flags(parser: argparse.ArgumentParser, mode: str = "--worker") -> None:
  """The worker mode's flags, hidden from ``--help``: ``mode`` (``args.worker``) and the
  job's, which :func:`benchmarks.launch.worker_commands` passes."""
  hidden = argparse.SUPPRESS
  parser.add_argument(mode, dest="worker", action="store_true", help=hidden)
  parser.add_argument("--process-id", type=int, default=0, help=hidden)
  parser.add_argument("--num-processes", type=int, default=2, help=hidden)
  parser.add_argument("--coordinator", default=None, help=hidden)


def run_on_link(module: str, flags, *, prefix=None, host: str = ADDRESSES[0], **kwargs) -> Any:
  """Runs 2 workers of ``module`` (:func:`benchmarks.launch.worker_commands`, process 0 the
  coordinator at ``host``) and returns what process 0 emitted (``launch.worker_results``
  given ``kwargs``: ``every``, ``timeout``...)."""
  coordinator = f"{host}:{launch.free_port()}"
  commands = launch.worker_commands(
    module, flags, processes=2, coordinator=coordinator, prefix=prefix
  )
  return launch.worker_results(commands, launch.RESULT_MARKER, **kwargs)


def join(args: argparse.Namespace, devices_per_process: int = 1) -> None:
  """Worker mode: joins the job that :func:`benchmarks.launch.worker_commands` gave ``args``."""
  launch.init_distributed(
    args.coordinator, args.num_processes, args.process_id, devices_per_process=devices_per_process
  )


def emit(result: dict) -> None:
  """Worker mode: prints ``result`` for :func:`run_on_link`, then leaves the job with
  the others (``jax.distributed.shutdown`` is a barrier)."""
  print(launch.RESULT_MARKER + json.dumps(result), flush=True)
  jax.distributed.shutdown()


def _seconds(f, x) -> float:
  start = time.perf_counter()
  f(x).block_until_ready()
  return time.perf_counter() - start


def psum_worker(args: argparse.Namespace) -> None:
  """Worker mode: times ``psum`` and ``all_gather`` of ``size`` bytes per process, each
  size; the model fits each its own link (gloo's all-gather moves more than its traffic)."""
  join(args)
  mesh = jax.make_mesh((jax.device_count(),), ("b",))
  ops = {
    "psum": lambda x: jax.lax.psum(x, "b"),
    "all_gather": lambda x: jax.lax.all_gather(x, "b", tiled=True),
  }
  result: dict[str, Any] = {"process_id": args.process_id}
  for name, op in ops.items():
    f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("b"), out_specs=P("b")))
    result[name] = []
    for size in args.sizes:
      local = np.ones((size // 4,), np.float32)
      x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P("b")), local)
      f(x).block_until_ready()  # compile, and warm the connection
      # How many timed collectives fit the budget: process 0's estimate, broadcast, so
      # that both processes issue the same number (each deciding from its own clock,
      # one could start a collective the other never joins, and hang).
      repeats = np.int32(min(15, max(3, int(2 * args.seconds_per_size / _seconds(f, x)))))
      repeats = int(multihost_utils.broadcast_one_to_all(repeats))
      times = [_seconds(f, x) for _ in range(repeats)]
      result[name].append({"bytes": size, "times_s": times, "median_s": statistics.median(times)})
  emit(result)


def time_collectives(prefix, args: argparse.Namespace) -> dict:
  """Runs :func:`psum_worker` in the two namespaces; process 0's timings, by collective
  (``"psum"``, ``"all_gather"``)."""
  flags = ["--psum-worker", "--psum-sizes", args.psum_sizes]
  flags += ["--seconds-per-size", str(args.seconds_per_size)]
  result = run_on_link("benchmarks.network", flags, prefix=prefix, timeout=args.timeout)
  return {"psum": result["psum"], "all_gather": result["all_gather"]}


def train_on_link(config: str, prefix, args: argparse.Namespace) -> dict[str, Any]:
  """The 2-process trainer across the namespaces; process 0's result (checked equal)."""
  workdir = os.path.join(args.out, "data")
  flags = launch.worker_args(
    args.methods,
    config=config,
    devices_per_process=1,
    steps=args.steps,
    workdir=workdir,
    profile=args.profile,
  )
  coordinator = f"{ADDRESSES[0]}:{launch.free_port()}"
  results = launch.launch(
    flags, processes=2, prefix=prefix, coordinator=coordinator, timeout=args.timeout
  )
  launch.check_identical(results)
  return results[0]


def step_time(record: dict) -> float:
  """Mean step time after the first (compile warm-up) step, in seconds: the mean, not the
  median, since MIPD's half updates alternate a cheap and a costly step."""
  times = record["step_times_s"]
  return statistics.fmean(times[1:] or times)


def _fit(timings: dict, primitive: str) -> dict:
  return {
    rate: jc.network.fit_link([(primitive, s["bytes"], 2, s["median_s"]) for s in samples])
    for rate, samples in timings.items()
  }


def fit_and_predict(runs: dict, psums: dict, gathers: dict | None = None) -> dict:
  """Fits α-β per rate to the psums (``links``), and the all-gathers to ``gathers`` where
  given (``gather_links``); predicts each method's step time; the errors vs measured."""
  links, gather_links = _fit(psums, "psum"), _fit(gathers or {}, "all_gather")
  per_primitive = {rate: {"all_gather": link} for rate, link in gather_links.items()}

  def predict(compute: float, report, rate: str) -> float:
    return jc.network.predict_step_time(compute, report, links[rate], links=per_primitive.get(rate))

  out: dict[str, Any] = {}
  for key, fitted in (("links", links), ("gather_links", gather_links)):
    out[key] = {
      r: {"latency_s": l.latency_s, "bandwidth_Bps": l.bandwidth} for r, l in fitted.items()
    }
  out.update(predictions={}, scaling={})
  for config_name, by_rate in runs.items():
    base = by_rate.get("none")
    if base is None:
      continue
    config = launch.load_config(config_name)
    x = jax.ShapeDtypeStruct((1, 40), jax.numpy.float32)
    init = lambda a: models.create_model(config).init(jax.random.key(0), a)["params"]
    params = jax.eval_shape(init, x)
    preds = out["predictions"][config_name] = {}
    scaling = out["scaling"][config_name] = {}
    for method in base["methods"]:
      tx = train.make_tx(method, config, train.make_exchange(method, config, warmup=False))
      wire = functools.partial(jc.wire_report, tx, params, axis_name=train.AXIS)
      report2 = wire(num_devices=2)
      compute = jc.network.compute_time(
        step_time(base["methods"][method]), report2, links["none"], links=per_primitive.get("none")
      )
      preds[method] = {"compute_s": compute}
      for rate, run in by_rate.items():
        if rate != "none" and method in run["methods"]:
          predicted = predict(compute, report2, rate)
          measured = step_time(run["methods"][method])
          error = predicted / measured - 1
          preds[method][rate] = {"predicted_s": predicted, "measured_s": measured, "error": error}
      if "1gbit" in links:  # K up to 1024 at 1 Gbit/s with this link's fitted latency
        reports = {k: wire(num_devices=k) for k in SCALING_K}
        scaling[method] = {
          k: {"bytes": r.bytes_received, "step_s": predict(compute, r, "1gbit")}
          for k, r in reports.items()
        }
  return out


def _measured_table(config: str, by_rate: dict, preds: dict) -> str:
  rows = []
  for rate, run in by_rate.items():
    dense = run["methods"].get("dense")
    for method, r in run["methods"].items():
      t, p = step_time(r), preds.get(method, {}).get(rate)
      cells = [rate, method, f"{1e3 * t:.0f}", f"{step_time(dense) / t:.2f}x" if dense else "n/a"]
      cells += [f"{r['bytes_received']:,.0f}", f"{r['final_loss']:.3f}"]
      cells += [f"{1e3 * p['predicted_s']:.0f}", f"{100 * p['error']:+.0f}%"] if p else ["", ""]
      rows.append(cells)
  head = (
    "rate | method | mean step (ms) | speed-up vs dense | bytes/step (wire_report) | final loss"
    " | predicted step (ms) | error"
  )
  num_params = next(iter(by_rate.values()))["num_params"]
  title = f"### {config}: {num_params:,} parameters, 2 processes x 1 CPU device"
  return md_table(head, rows, title, left=2)


def _split_table(config: str, by_rate: dict, preds: dict) -> str:
  """Where the time goes: compute (from the unthrottled run, minus the modelled
  exchange), the codec's cost over dense, and the exchange at each rate."""
  rates = [r for r in by_rate if r != "none"]
  rows = []
  for method, p in preds.items():
    runs = [by_rate[r]["methods"].get(method) for r in rates]
    cells = ["" if m is None else f"{1e3 * (step_time(m) - p['compute_s']):.0f}" for m in runs]
    codec = p["compute_s"] - preds["dense"]["compute_s"]
    rows.append([method, f"{1e3 * p['compute_s']:.0f}", f"{1e3 * codec:+.0f}", *cells])
  head = " | ".join(
    ["method | compute (ms) | codec vs dense (ms)"] + [f"exchange {r} (ms)" for r in rates]
  )
  title = (
    f"Step time split ({config}): compute = unthrottled step minus the modelled "
    "exchange; codec = compute minus dense's (encode, decode, error feedback,"
    " top-k...); exchange = measured step minus compute."
  )
  return md_table(head, rows, title)


def tables(runs: dict, model: dict) -> list[str]:
  """Markdown: measured steps per config and rate, then the model's errors and scaling."""
  out = []
  for config, by_rate in runs.items():
    preds = model["predictions"].get(config, {})
    out.append(_measured_table(config, by_rate, preds))
    if "dense" in preds:
      out.append(_split_table(config, by_rate, preds))
    scaling = model["scaling"].get(config)
    if scaling:
      ks = list(next(iter(scaling.values())))
      rows = [[m, *(f"{1e3 * by_k[k]['step_s']:.0f}" for k in ks)] for m, by_k in scaling.items()]
      title = f"Predicted step time (ms) at 1 Gbit/s vs K ({config}, fitted α, β):"
      out.append(md_table(" | ".join(["method", *(f"K={k}" for k in ks)]), rows, title))
    out += phase_tables(config, by_rate)
  title = "Fitted links (psum timings, least squares on relative error):"
  return [*out, link_table(title, model["links"])]


def error_comparison(model: dict, model_gather: dict) -> str:
  """Markdown: each point's error with the psum link and with the all-gather link."""
  a, b = (
    {
      (config, rate, method): v["error"]
      for config, preds in m["predictions"].items()
      for method, p in preds.items()
      for rate, v in p.items()
      if isinstance(v, dict)  # not compute_s
    }
    for m in (model, model_gather)
  )
  rows = [[*key, f"{100 * a[key]:+.0f}%", f"{100 * b[key]:+.0f}%"] for key in a]
  mean = lambda e: 100 * statistics.fmean(abs(v) for v in e.values()) if e else float("nan")
  title = (
    "Prediction error with every collective on the psum link, and with the "
    "all-gathers on their own fitted link:"
  )
  head = "config | rate | method | psum link | all-gather link"
  means = f"psum link {mean(a):.1f}%, all-gather link {mean(b):.1f}%"
  return md_table(head, rows, title, left=3) + f"\n\nMean |error|: {means} ({len(a)} points)."


def link_table(title: str, links: dict) -> str:
  """Markdown: each rate's fitted link (α, bandwidth) under ``title``."""
  rows = [
    [rate, f"{1e6 * l['latency_s']:.0f}", f"{l['bandwidth_Bps'] / 1e6:.1f}"]
    for rate, l in links.items()
  ]
  return md_table("rate | α (µs) | bandwidth (MB/s)", rows, title)


def phase_tables(config: str, by_rate: dict) -> list[str]:
  """The measured step split (``--profile``), process 0, as a Markdown table; or none."""
  rows = [
    launch.phase_row(f"{rate} | {method}", r["phases"])
    for rate, run in by_rate.items()
    for method, r in run["methods"].items()
    if r.get("phases")
  ]
  title = (
    f"Measured step split ({config}, process 0, `--profile`: ms per step from "
    "jc.profile_phases over the extra profiled steps; exchange includes waiting "
    "for the other process; idle is the step's wall time not covered by ops):"
  )
  head = " | ".join(["rate | method | step", *launch.PHASE_COLUMNS])
  return [md_table(head, rows, title, left=2)] if rows else []


def report(saved: dict, out: str) -> None:
  """Fits the model to ``saved``; writes results.json (with it) and results.md.

  ``saved`` holds ``runs`` and ``psums``; results saved before ``gathers``, ``malloc`` and
  ``bursts`` were kept lack them (the model then prices all-gathers with the psums' link).
  """
  runs, psums, gathers, bursts = (saved.get(k) for k in ("runs", "psums", "gathers", "bursts"))
  # The main model prices every collective with the psums' link. With timed all-gathers,
  # a second one prices the all-gathers with their own link; both errors are reported
  # (the second was not better overall on the throttled link:
  # docs/benchmarks.md#collectives-across-the-throttled-link).
  model = fit_and_predict(runs, psums)
  model_gather = fit_and_predict(runs, psums, gathers) if gathers else None
  burst_text = (
    "not recorded (10 ms of traffic at the rate, before 2026-11-22)"
    if bursts is None
    else ", ".join(f"{r} {b:,} B" for r, b in bursts.items() if b is not None)
  )
  malloc = saved.get("malloc")
  text = [f"malloc: {malloc or 'not recorded'}", f"tbf bucket: {burst_text}", *tables(runs, model)]
  if model_gather is not None:
    text.append(error_comparison(model, model_gather))
    text.append(link_table("Fitted all-gather links:", model_gather["gather_links"]))
  record = {"runs": runs, "psums": psums, "gathers": gathers, "model": model}
  record.update(model_gather_links=model_gather, malloc=malloc, bursts=bursts)
  os.makedirs(out, exist_ok=True)
  common.write_results(out, "\n\n".join(text), record)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--rates", default=",".join(RATES), help="tc tbf rates; 'none' (unthrottled) runs first")
  add("--configs", default=",".join(CONFIGS))
  add("--methods", default=",".join(METHODS))
  add("--steps", type=int, default=None, help="override the config's steps")
  add("--out", default="runs/network")
  add("--timeout", type=float, default=1800.0, help="seconds per launch")
  add("--seconds-per-size", type=float, default=3.0)
  add("--burst-ms", type=float, default=BURST_MS, help="tbf bucket in ms at the rate (>= 64 KiB)")
  add("--profile", type=int, default=0, metavar="STEPS", help="profile STEPS more steps a method")
  add(
    "--analyze", metavar="RESULTS_JSON", help="only redo the model and tables from a results.json"
  )
  add("--psum-sizes", default=",".join(map(str, PSUM_SIZES)), help="bytes per device timed")
  add_worker_flags(parser, "--psum-worker")
  args = parser.parse_args(argv)
  args.sizes = _timing.ints(args.psum_sizes)  # checked here, not in the workers
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    psum_worker(args)
    return 0
  if args.analyze:
    with open(args.analyze) as f:
      report(json.load(f), args.out)
    return 0
  if cannot_run("benchmarks/network.py"):
    return 2
  rates = ["none"] + [r for r in args.rates.split(",") if r != "none"]
  for r in rates:
    rate_bytes_per_s(r)  # validate before building anything
  os.makedirs(args.out, exist_ok=True)
  saved: dict[str, Any] = {"runs": {c: {} for c in args.configs.split(",")}}
  saved.update(psums={}, gathers={}, malloc=_timing.malloc_label(), bursts={})  # as inherited
  with open_link() as link:
    pinned = functools.partial(link.worker_prefix, pin=True)  # process i on core i
    for rate in rates:
      saved["bursts"][rate] = link.set_rate(rate, args.burst_ms)
      print(f"== link {rate}: timing psums and all-gathers", flush=True)
      timed = time_collectives(pinned, args)
      saved["psums"][rate], saved["gathers"][rate] = timed["psum"], timed["all_gather"]
      for s, g in zip(timed["psum"], timed["all_gather"]):
        ms = f"psum {1e3 * s['median_s']:9.2f} ms, all_gather {1e3 * g['median_s']:9.2f} ms"
        print(f"   {s['bytes']:>10,} B: {ms}", flush=True)
      for config, by_rate in saved["runs"].items():
        print(f"== link {rate}, {config}: {args.methods}", flush=True)
        start = time.perf_counter()
        by_rate[rate] = train_on_link(config, pinned, args)
        for m, r in by_rate[rate]["methods"].items():
          print(f"   {m:>7}: mean step {1e3 * step_time(r):8.1f} ms, loss {r['final_loss']:.3f}")
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:  # partial results
          json.dump(saved, f, indent=2)
  report(saved, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
