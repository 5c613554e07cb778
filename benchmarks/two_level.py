r"""Two-level vs flat compression over a real, throttled link: 2 processes of L devices.

Each process is a node of L CPU devices in :mod:`benchmarks.network`'s namespaces; the
methods (:func:`make_exchange`) train the same model: per method the step time, the
loss, the link's byte counters next to ``jc.wire_report``'s, and an α-β projection to
16-1024 nodes of 8 devices. Results: docs/benchmarks.md, "Two nodes of four devices over
a throttled link"; the method: docs/guides/two_level.md.

  sudo python -m benchmarks.two_level --rates 100mbit,1gbit --models mlp --steps 30
  sudo python -m benchmarks.two_level --models lm --methods dense,flat_qsgd4,two_level_qsgd4
  python -m benchmarks.two_level --project-only       # the projection alone, no root

Needs root (``ip netns``, ``tc``) and ``taskset`` except ``--project-only``, or says so
and exits 2. Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from collections.abc import Sequence
import functools
import importlib
import json
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
from jax import lax
import jax.flatten_util
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from benchmarks import network
from benchmarks._timing import md_table
import jaxcomp as jc

AXES = ("node", "gpu")  # (slow, fast); node = process
POWERSGD_RANK = 4
# X of flat_X and two_level_X: its exchange over an axis.
COMPRESSORS = {
  "qsgd4": functools.partial(jc.qsgd, bits=4),
  "onebit": jc.onebit_sgd,
  "powersgd": functools.partial(jc.powersgd, POWERSGD_RANK),
}
METHODS = ("dense",) + tuple(f"{kind}_{c}" for c in COMPRESSORS for kind in ("flat", "two_level"))
MODELS = ("mlp", "lm")
MLP_SIZES = (40, 1024, 2048, 10)  # 2,163,674 parameters; the 1024x2048 kernel is 2.1M
LOSS_WINDOW = 5  # the loss at equal steps: mean of the last this many steps
NOTHING_SENT = 0.01  # under this share of the modelled bytes: the exchange sent nothing
PROJECTION_NODES = (16, 64, 256, 1024)
PROJECTION_GPUS = 8
# (name, fast link, slow link): latency_s, bytes/s per device.
PROJECTION_LINKS = {
  "100 Gbit/s": {"gpu": (3e-6, 150e9), "node": (10e-6, 12.5e9)},
  "10 Gbit/s": {"gpu": (3e-6, 150e9), "node": (30e-6, 1.25e9)},
  # The bandwidth term alone: from a few hundred devices a ring's latency term dominates
  # every method's time (NCCL switches to trees there), hiding what the bytes cost.
  "100 Gbit/s, α = 0": {"gpu": (0.0, 150e9), "node": (0.0, 12.5e9)},
}


def _exchange(method: str, axis):
  """The exchange of ``method``'s compressor over ``axis`` (dense: a pmean of every leaf)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
  compressor = method.split("_")[-1]
  if compressor == "dense":
    # One pmean of all leaves raveled together, as XLA's all-reduce combiner or a
    # bucketing framework would send them: per-leaf pmeans pay a ring's latency per leaf.
    def update(g, state, params=None):
      flat, unravel = jax.flatten_util.ravel_pytree(g)
      return unravel(lax.pmean(flat, axis)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
  return COMPRESSORS[compressor](axis_name=axis)


def make_exchange(method: str):
  """The gradient exchange of ``method``, its mean over both axes: ``dense``, ``flat_X``
  (X over both axes) or ``two_level_X`` (``jc.two_level(X over "node", fast_axis="gpu")``),
  X one of :data:`COMPRESSORS`. Raises ``NotImplementedError`` where jaxcomp lacks it."""
  if method == "dense":
    return _exchange("dense", AXES)
  if method.startswith("two_level_"):
    return jc.per_device_state(jc.two_level(_exchange(method, "node"), fast_axis="gpu"))
  return jc.per_device_state(_exchange(method, AXES))


def one_gradient_bytes(method: str, params) -> float:
  """Bytes of one gradient as ``method``'s compressor sends it (dense: in float32):
  what one of 2 devices receives from the other, by ``jc.wire_report``."""
  tx = jc.per_device_state(_exchange(method, "node"))
  return jc.wire_report(tx, params, axis_name="node", num_devices=2).bytes_received


def flat_of(method: str) -> str | None:
  """The flat method of a two-level one (``two_level_qsgd4`` -> ``flat_qsgd4``)."""
  return "flat_" + method.removeprefix("two_level_") if method.startswith("two_level_") else None


def model_parts(model: str, *, workdir: str = "runs/two_level/data", lm_config: str = "bench"):
  """``(params, loss_fn, batch_fn, optimizer, description)`` of ``model``.

  ``params``: host arrays, the same in every process; ``loss_fn(params, batch)`` one
  device's mean loss; ``batch_fn(step, num_devices, rows)``: the global batch's rows
  ``rows`` (a slice of devices), leading axis one per device.
  """
  if model == "mlp":
    from examples.mnist1d import input_pipeline  # pylint: disable=import-outside-toplevel
    from examples.mnist1d.configs import default  # pylint: disable=import-outside-toplevel

    rng, sizes = np.random.default_rng(0), list(zip(MLP_SIZES[:-1], MLP_SIZES[1:]))
    params = {
      f"layer{i}": {
        "kernel": (rng.standard_normal((a, b)) / math.sqrt(a)).astype(np.float32),
        "bias": np.zeros((b,), np.float32),
      }
      for i, (a, b) in enumerate(sizes)
    }

    def loss_fn(p, batch):
      h, y = batch
      for i in range(len(sizes)):
        h = h @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"]
        h = jax.nn.relu(h) if i < len(sizes) - 1 else h
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h, y))

    data, per_device = input_pipeline.load_dataset(default.get_config(), workdir), 16

    def batch_fn(step, num_devices, rows):
      idx = np.random.default_rng([1, step]).integers(0, len(data["x"]), (num_devices, per_device))
      return data["x"][idx[rows]], data["y"][idx[rows]]

    description = f"MLP {'-'.join(map(str, MLP_SIZES))}, MNIST-1D, {per_device} examples/device"
    return params, loss_fn, batch_fn, optax.sgd(0.05, momentum=0.9), description
  if model != "lm":
    raise ValueError(f"unknown model {model!r}; expected one of {MODELS}")
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from examples.lm import input_pipeline  # pylint: disable=import-outside-toplevel
  from examples.lm import models  # pylint: disable=import-outside-toplevel
  from examples.lm import train  # pylint: disable=import-outside-toplevel

  config = importlib.import_module(f"examples.lm.configs.{lm_config}").get_config()
  graphdef, state = nnx.split(models.create_model(config, rngs=nnx.Rngs(config.seed)))
  tokens = input_pipeline.load_corpus(config.validation_percent)["train"]

  def loss_fn(p, batch):
    total, count = train.cross_entropy(graphdef, p, batch)
    return total / count

  sizes = {k: getattr(config, k) for k in ("seed", "per_device_batch_size", "seq_len")}

  def batch_fn(step, num_devices, rows):
    return input_pipeline.train_batch(tokens, step, num_devices=num_devices, devices=rows, **sizes)

  description = (
    f"examples/lm {lm_config} (width {config.width}, depth {config.depth}, seq_len "
    f"{config.seq_len}, {config.per_device_batch_size} windows/device)"
  )
  params = jax.device_get(state.to_pure_dict())
  return params, loss_fn, batch_fn, optax.adam(1e-3), description


def read_counters(interface: str, root: str = "/sys/class/net") -> dict[str, int]:
  """``{"tx_bytes", "rx_bytes"}`` of ``interface`` from its statistics under ``root``
  (the namespace's own ``/sys`` under ``ip netns exec``)."""
  stats = pathlib.Path(root, interface, "statistics")
  return {name: int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes")}


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
  return {k: after[k] - before[k] for k in before}


def slow_axis_bytes(report, devices_per_node: int) -> float:
  """Bytes per node per step over the slow link by ``report``'s ring convention: a
  collective over ``node`` alone runs L at once per node (its bytes times L); one over
  ``("node", "gpu")`` is a ring over all N·L devices crossing between nodes once per node
  (gloo runs all-to-all and all-gather otherwise: the counters show by how much)."""
  return sum(
    b * (devices_per_node if len(axes) == 1 else 1)
    for axes, b in report.by_axis.items()
    if "node" in axes
  )


def train_one(method, mesh, parts, steps, warmup, interface) -> dict[str, Any]:
  """``warmup + steps`` steps of ``method``; timings, losses and counters."""
  params_host, loss_fn, batch_fn, optimizer, _ = parts
  l, k = mesh.shape["gpu"], mesh.size
  tx = optax.chain(make_exchange(method), optimizer)  # NotImplementedError: caller's row
  specs = jc.state_specs(tx, params_host, axis_name=AXES, num_devices=k, mesh=mesh)
  report = jc.wire_report(tx, params_host, axis_name=AXES, num_devices=k, mesh=mesh)

  def put(spec, x, shape):
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, shape)

  params = jax.tree.map(lambda x: put(P(), x, x.shape), params_host)
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def step(params, opt_state, batch):
    batch = jax.tree.map(lambda x: x[0], batch)
    # The local gradient: a gradient w.r.t. replicated parameters would be psum'ed.
    loss, grads = jax.value_and_grad(loss_fn)(jc.vary(params, AXES), batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, AXES)

  step = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXES)), out_specs=(P(), specs, P())),
    donate_argnums=(0, 1),
  )
  rows = slice(jax.process_index() * l, (jax.process_index() + 1) * l)
  losses, times, start_all = [], [], time.perf_counter()
  for i in range(warmup + steps):
    # The batch is built before the clock and the counters start.
    b = jax.tree.map(lambda x: put(P(AXES), x, (k, *x.shape[1:])), batch_fn(i, k, rows))
    if i == warmup:
      before = read_counters(interface)
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, b)
    losses.append(float(np.asarray(loss.addressable_data(0))))
    times.append(time.perf_counter() - start)
  return {
    "step_times_s": times[warmup:],
    "warmup_s": sum(times[:warmup]),
    "wall_s": time.perf_counter() - start_all,
    "losses": losses,
    "link_bytes": counter_delta(before, read_counters(interface)),
    "timed_steps": steps,
    "wire_slow_bytes_per_node": slow_axis_bytes(report, l),
    "one_gradient_bytes": one_gradient_bytes(method, params_host),
    "wire_by_axis": {"x".join(a): b for a, b in report.by_axis.items()},
    "wire_bytes_per_device": report.bytes_received,
  }


def worker(args: argparse.Namespace) -> None:
  network.join(args, args.devices_per_process)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  shape = (args.num_processes, args.devices_per_process)
  mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), AXES)
  parts = model_parts(args.models, workdir=os.path.join(args.out, "data"), lm_config=args.lm_config)
  result: dict[str, Any] = {
    "process_id": args.process_id,
    "model": parts[4],
    "num_params": int(sum(np.size(x) for x in jax.tree.leaves(parts[0]))),
    "methods": {},
  }
  for method in args.methods.split(","):
    try:
      r = train_one(method, mesh, parts, args.steps, args.warmup, network.VETHS[args.process_id])
    except NotImplementedError as e:
      r = {"status": f"not supported: {e}"}
    print(f"   [p{args.process_id}] {method}: {r.get('status', 'ok')}", file=sys.stderr, flush=True)
    result["methods"][method] = r
  network.emit(result)


def pinning(processes: int, cores: int, devices: int) -> tuple[list[list[str]], str]:
  """``taskset`` prefixes, one per process, and a sentence saying how they were pinned
  (and whether the ``devices`` of a process share its cores: on fewer cores than
  devices the step times hold every device's compute one after another)."""
  per = cores // processes
  sets = [f"{i * per}-{(i + 1) * per - 1}" if per else str(i % cores) for i in range(processes)]
  if not per:
    note = f"only {cores} cores for {processes} processes: they share cores"
  else:
    note = f"{cores} cores: process i pinned to cores " + ", ".join(sets)
    if per < devices:
      note += f" (only {per} core(s) for the {devices} devices of each process)"
  return [["taskset", "-c", s] for s in sets], note


def run_rate(args, link, model: str) -> list[dict[str, Any]]:
  """One launch of all methods of ``model`` on ``link``; every process's results."""
  tasksets, _ = pinning(2, os.cpu_count() or 1, args.devices_per_process)
  flags = ["--worker", "--models", model, "--out", args.out]
  for flag in ("devices_per_process", "lm_config", "methods", "steps", "warmup"):
    flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
  prefix = lambda i: [*link.worker_prefix(i), *tasksets[i]]
  run = dict(timeout=args.timeout, stream=args.verbose, every=True)
  return network.run_on_link("benchmarks.two_level", flags, prefix=prefix, **run)


def row_of(method: str, per_process: Sequence[dict]) -> dict[str, Any]:
  """One table row from the processes' records of ``method``."""
  r0 = per_process[0]
  if "status" in r0:
    return {"method": method, "status": r0["status"]}
  losses, final = r0["losses"], statistics.fmean(r0["losses"][-LOSS_WINDOW:])

  def per_step(counter):  # what each node's end of the veth counted, averaged over nodes
    return statistics.fmean(p["link_bytes"][counter] for p in per_process) / r0["timed_steps"]

  sent, modelled = per_step("tx_bytes"), r0["wire_slow_bytes_per_node"]
  status = "ok"
  if not all(math.isfinite(x) for x in losses) or final > losses[0]:
    status = "diverged"
  elif sent < NOTHING_SENT * modelled:
    status = "sent nothing"
  return {
    "method": method,
    "status": status,
    "step_s": statistics.median(r0["step_times_s"]),
    "loss": final,
    "first_loss": losses[0],
    "link_sent_per_node": sent,
    "link_received_per_node": per_step("rx_bytes"),
    "wire_slow_per_node": modelled,
    "one_gradient": r0.get("one_gradient_bytes"),
  }


def rows_with_ratios(rows: Sequence[dict]) -> list[dict]:
  """``rows`` with speed-ups and byte ratios vs dense and vs the flat method."""
  by = {r["method"]: r for r in rows if "step_s" in r}
  out = []
  for r in map(dict, rows):
    refs = {"dense": by.get("dense"), "flat": by.get(flat_of(r["method"]) or "")}
    for name, ref in refs.items():
      if r["method"] in by and ref is not None and ref is not by[r["method"]]:
        sent = r["link_sent_per_node"]
        r[f"speedup_vs_{name}"] = ref["step_s"] / r["step_s"]
        r[f"bytes_vs_{name}"] = ref["link_sent_per_node"] / sent if sent else math.inf
    out.append(r)
  return out


def _x(v) -> str:
  return "" if v is None else f"{v:.2f}x"


def table(rows: Sequence[dict]) -> str:
  """Markdown: one row per method."""
  cells = []
  for r in rows:
    if "step_s" not in r:  # "not supported" alone: jaxcomp's reason is in results.json
      cells.append([r["method"], r["status"].split(":")[0], *[""] * 10])
      continue
    sent, wire, one = r["link_sent_per_node"], r["wire_slow_per_node"], r.get("one_gradient")
    measured = [f"{1e3 * r['step_s']:.1f}", f"{r['loss']:.4f}", f"{sent / 1e6:.3f}"]
    measured += [f"{wire / 1e6:.3f}", f"{sent / wire if wire else math.inf:.2f}"]
    ratios = [sent / one if one else None]
    ratios += [
      r.get(f"{what}_vs_{ref}") for what in ("speedup", "bytes") for ref in ("dense", "flat")
    ]
    cells.append([r["method"], r["status"], *measured, *map(_x, ratios)])
  head = (
    "method | status | median step (ms) | loss | link MB/node/step (tx) | wire_report slow"
    " MB/node/step | link/wire | link / one gradient | speed-up vs dense | vs flat"
    " | fewer bytes vs dense | vs flat"
  )
  return md_table(head, cells, left=2) + "\n"


def projection(
  params,
  methods: Sequence[str],
  nodes: Sequence[int] = PROJECTION_NODES,
  gpus: int = PROJECTION_GPUS,
) -> dict[str, dict[str, dict[int, float | None]]]:
  """``{link name: {method: {nodes: exchange seconds per step}}}`` by ``jc.network``
  with a link per mesh axis, from ``jc.wire_report`` on an abstract ``(nodes, gpus)``
  mesh; ``None`` where jaxcomp does not support the method."""

  def report(method, n):
    mesh = jax.sharding.AbstractMesh((n, gpus), AXES)
    try:
      tx = optax.chain(make_exchange(method))
      return jc.wire_report(tx, params, axis_name=AXES, num_devices=n * gpus, mesh=mesh)
    except NotImplementedError:
      return None

  reports = {m: {n: report(m, n) for n in nodes} for m in methods}
  out = {}
  for name, by_axis in PROJECTION_LINKS.items():
    link = {axis: jc.network.Link(*v) for axis, v in by_axis.items()}
    out[name] = {
      m: {n: None if r is None else jc.network.exchange_time(r, link) for n, r in by_n.items()}
      for m, by_n in reports.items()
    }
  return out


def projection_table(proj: Mapping, gpus: int = PROJECTION_GPUS) -> str:
  tables = []
  for name, by_method in proj.items():
    where = ""
    if link := PROJECTION_LINKS.get(name):
      (fast_a, fast_b), (slow_a, slow_b) = link["gpu"], link["node"]
      where = (
        f" (fast: α {fast_a * 1e6:g} µs, {fast_b / 1e9:g} GB/s; slow: α"
        f" {slow_a * 1e6:g} µs, {slow_b / 1e9:g} GB/s, per device)"
      )
    nodes = list(next(iter(by_method.values())))
    head = " | ".join(["method", *(f"{n} nodes" for n in nodes)])
    rows = [
      [method, *("not supported" if t is None else f"{1e3 * t:.2f}" for t in by_n.values())]
      for method, by_n in by_method.items()
    ]
    title = (
      f"Projected exchange time per step (ms), {gpus} devices per node, nodes on {name}{where}:"
    )
    tables.append(md_table(head, rows, title))
  return "\n\n".join(tables) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rates", default="100mbit,1gbit", help="tc tbf rates")
  parser.add_argument("--models", default="mlp", help=f"comma-separated, of {MODELS}")
  parser.add_argument("--lm-config", default="bench", help="examples/lm config for --models lm")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--devices-per-process", type=int, default=4, help="L CPU devices")
  parser.add_argument("--steps", type=int, default=30, help="timed steps per method")
  parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile)")
  parser.add_argument("--out", default="runs/two_level")
  parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
  parser.add_argument("--burst-ms", type=float, default=network.BURST_MS)
  parser.add_argument("--verbose", action="store_true", help="echo the workers' output")
  parser.add_argument("--project-only", action="store_true", help="the projection alone")
  network.add_worker_flags(parser)
  return parser.parse_args(argv)


def measure(args, methods, models, results, report) -> None:
  """The runs over the link: every model at every rate, into ``results`` and ``report``."""
  _, note = pinning(2, os.cpu_count() or 1, args.devices_per_process)
  results["setup"] = (
    f"2 processes x {args.devices_per_process} CPU devices, mesh "
    f"{AXES} = (2, {args.devices_per_process}); {note}; "
    f"{args.warmup} warm-up + {args.steps} timed steps per method"
  )
  report(results["setup"] + "\n")
  with network.open_link() as link:
    for rate in args.rates.split(","):
      results.setdefault("bursts", {})[rate] = link.set_rate(rate, args.burst_ms)
      for model in models:
        print(f"== {model} at {rate}", flush=True)
        start = time.perf_counter()
        procs = run_rate(args, link, model)
        rows = rows_with_ratios([row_of(m, [p["methods"][m] for p in procs]) for m in methods])
        results["runs"].setdefault(model, {})[rate] = {"rows": rows, "raw": procs}
        report(
          f"### {model} at {rate}: {procs[0]['model']}, {procs[0]['num_params']:,} "
          f"parameters ({time.perf_counter() - start:.0f} s)\n\n" + table(rows)
        )


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  methods, models = args.methods.split(","), args.models.split(",")
  for m in methods:
    if m not in METHODS:
      raise SystemExit(f"unknown method {m!r}; expected some of {','.join(METHODS)}")
  os.makedirs(args.out, exist_ok=True)
  results: dict[str, Any] = {"command": " ".join(sys.argv), "runs": {}, "projection": {}}
  text = []

  def report(section: str) -> None:  # printed, and every results file rewritten with it
    print(section, flush=True)
    text.append(section)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(results, f, indent=2, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write("\n".join(text))

  if not args.project_only:
    if network.cannot_run("benchmarks/two_level.py"):
      return 2
    for r in args.rates.split(","):
      network.rate_bytes_per_s(r)
    measure(args, methods, models, results, report)
  for model in models:
    params = model_parts(model, workdir=os.path.join(args.out, "data"), lm_config=args.lm_config)[0]
    results["projection"][model] = proj = projection(params, methods)
    report(f"### α-β projection, {model}\n\n" + projection_table(proj))
  return 0


if __name__ == "__main__":
  sys.exit(main())
