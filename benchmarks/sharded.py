r"""Per-layer FSDP (ZeRO-3) against dense FSDP: bytes, peak memory, step time over a link.

``--model mlp``: a residual tanh MLP scanned over ``--layers`` layers, sharded over the
data axis: dense FSDP, ``jc.fsdp_gather`` with and without the int8 gather, and one
compressed reduce-scatter of the full gradient; ``--model lm``: the LM trainer's sharded
methods (``examples/lm/sharded.py``). ``--part memory``: each compiled step's peak memory
and bytes per device; ``--part link``: step times of 2 processes over a throttled link
(root). The methods and results: docs/guides/fsdp.md ("Per-layer FSDP, measured") and
docs/benchmarks.md ("The transformer, sharded"). ``--part ef``: a ZeRO-2 loop trains an
8-layer MLP with each error-feedback option (``--methods``): residual, shard and
optimizer bytes per device, and the held-out loss against the dense ``psum_scatter``'s
(docs/guides/sharded.md, "Error feedback a sharded model can afford"); with
``--num-processes``, one process of a ``jax.distributed`` run (``tests/test_sharded.py``).

  sudo nice -n 15 python -m benchmarks.sharded                  # memory, then link
  nice -n 15 python -m benchmarks.sharded --part memory
  sudo python -m benchmarks.sharded --part link --rates none,1gbit --width 1024
  sudo nice -n 15 python -m benchmarks.sharded --model lm --rates 1gbit,100mbit
  python -m benchmarks.sharded --model lm --smoke              # 2 local processes
  python -m benchmarks.sharded --part ef                        # every option, 8 CPU devices
  python -m benchmarks.sharded --part ef --steps 100 --methods dense,qsgd4,signsgd_ef_int8
  python -m benchmarks.sharded --part ef --optimizer sgd --lr 0.05
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import jax
from jax import lax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from benchmarks import launch
from benchmarks import network
from benchmarks._timing import md_head
from benchmarks._timing import md_table
from benchmarks._timing import use_cpu_devices
from examples import common
import jaxcomp as jc
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.tools import wire

METHODS = ("dense", "fsdp_int8_qsgd4", "fsdp_qsgd4", "zero_qsgd4")
# --model lm: the data-parallel baseline and the LM trainer's sharded methods.
LM_METHODS = ("dense", "zero_dense", "zero_qsgd4", "fsdp_dense", "fsdp_int8_qsgd4")
AXIS = "data"
LR = 0.01  # plain SGD: the step is what is measured, not the training
PSPEC = {"w": P(None, AXIS), "b": P(None, AXIS)}  # the stacked layers, cut along each's rows
# A link of its own (names and subnet apart from benchmarks.network's), so that this
# benchmark can run while another holds that one.
NAMESPACES = ("jcfsdp0", "jcfsdp1")
VETHS = ("jcfsveth0", "jcfsveth1")
ADDRESSES = ("10.231.78.1", "10.231.78.2")


def _mesh(k: int, axis: str = AXIS) -> jax.sharding.Mesh:
  return jax.make_mesh((k,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))


# ----------------------------------------------------------------------------- the MLP


def build(method: str, *, layers: int, width: int):
  """``step(params, x, y) -> params`` for ``method``, to run inside ``jax.shard_map``
  (params: each device's shards ``{"w": (L, width/K, width), "b": (L, width/K)}``)."""
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
  qsgd4 = jc.codecs.QSGD(7, 512, norm="max")
  keys = jax.random.split(jax.random.key(0), layers)

  def loss(layer, ws, bs, x, y):
    def body(h, xs):
      w, b = layer(xs)
      return h + jnp.tanh(h @ w + b), None

    h, _ = lax.scan(jax.checkpoint(body), x, (ws, bs, keys))
    return jnp.mean(jnp.square(h - y))

  def sgd(p, g):
    return jax.tree.map(lambda a, b: a - LR * b, p, g)

  if method == "zero_qsgd4":

    def step(p, x, y):
      # The sharded axis is each layer's first, axis 1 of the stacked leaves.
      rows_first = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), p)
      full = jc.gather_weights(rows_first, axis_name=AXIS, codec=None)
      full = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), full)
      g = jax.grad(lambda f: loss(lambda xs: xs[:2], f["w"], f["b"], x, y))(full)
      leaves = [jnp.moveaxis(g["w"], 1, 0), jnp.moveaxis(g["b"], 1, 0)]
      base = jax.random.fold_in(jax.random.key(1), lax.axis_index(AXIS))
      out = collectives.reduce_scatter_means(qsgd4, leaves, jax.random.split(base, 2), AXIS)
      return sgd(p, {"w": jnp.moveaxis(out[0].mean, 0, 1), "b": jnp.moveaxis(out[1].mean, 0, 1)})

    return step
  wc = jc.codecs.BlockInt8() if method == "fsdp_int8_qsgd4" else None

  def layer(xs):
    if method == "dense":
      return tuple(lax.all_gather(a, AXIS, tiled=True) for a in xs[:2])
    # Every leaf compressed, biases too, as zero_qsgd4 compresses them.
    w, b, key = xs
    everything = lambda path, leaf: True
    return jc.fsdp_gather(
      (w, b), axis_name=AXIS, key=key, weight_codec=wc, grad_codec=qsgd4, filter=everything
    )

  def step(p, x, y):
    g = jax.grad(lambda p: loss(layer, p["w"], p["b"], x, y))(p)
    if method == "dense":  # the transposed all_gather sums: the mean is / K
      g = jax.tree.map(lambda a: a / lax.axis_size(AXIS), g)
    return sgd(p, g)

  return step


def local_shapes(layers: int, width: int, k: int, batch: int):
  if width % k:
    raise ValueError(f"--width {width} must be divisible by the {k} devices")
  p = {
    "w": jax.ShapeDtypeStruct((layers, width // k, width), jnp.float32),
    "b": jax.ShapeDtypeStruct((layers, width // k), jnp.float32),
  }
  return p, jax.ShapeDtypeStruct((batch, width), jnp.float32)


def jit_step(method: str, args, mesh):
  """``method``'s step, jitted over ``mesh``; it donates the parameters."""
  step = build(method, layers=args.layers, width=args.width)
  in_specs = (PSPEC, P(AXIS), P(AXIS))
  return jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=PSPEC), donate_argnums=0
  )


def wire_bytes(method: str, args, devices: int) -> dict:
  """Bytes received per device per step on ``devices``, by collective, from the trace."""
  p, x = local_shapes(args.layers, args.width, devices, args.batch)
  step = build(method, layers=args.layers, width=args.width)
  out: dict = {}
  for op in wire.collective_ops(step, p, x, x, axis_name=AXIS, num_devices=devices):
    name = wire.canonical(op.primitive)
    out[name] = out.get(name, 0.0) + op.bytes_received
  return out


def _mlp(args):
  """``(compile, wire)`` of the MLP on ``args.devices`` devices: a method's compiled step,
  and the bytes one device receives per step by collective."""
  k, mesh = args.devices, _mesh(args.devices)
  local_shapes(args.layers, args.width, k, args.batch)  # refuses a width K does not divide
  p, x = local_shapes(args.layers, args.width, 1, args.batch * k)  # the global arrays

  def placed(s, spec):
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.NamedSharding(mesh, spec))

  inputs = (jax.tree.map(placed, p, PSPEC), placed(x, P(AXIS)), placed(x, P(AXIS)))
  compile_step = lambda method: jit_step(method, args, mesh).lower(*inputs).compile()
  return compile_step, lambda method: wire_bytes(method, args, k)


def memory_table(rows: list[dict], args) -> str:
  n = args.layers * (args.width * args.width + args.width)
  dense = next((r for r in rows if r["method"] == "dense"), rows[0])
  dense_total, dense_rs = sum(dense["wire"].values()), dense["wire"].get("psum_scatter", 0.0)
  head = "method | peak memory (MiB) | vs dense | bytes received | vs dense |"
  lines = [
    f"{args.layers} layers x ({args.width} x {args.width}) = {n:,} parameters (float32),"
    f" K = {args.devices} devices, batch {args.batch} per device; per device per step.",
    "",
    md_head(head + " gradient exchange bytes | vs dense psum_scatter"),
  ]
  for r in rows:
    total = sum(r["wire"].values())
    grad = r["wire"].get("all_to_all", 0.0) + r["wire"].get("psum_scatter", 0.0)
    lines.append(
      f"| {r['method']} | {r['peak_bytes'] / 2**20:.1f} |"
      f" {r['peak_bytes'] / dense['peak_bytes']:.2f}x | {total:,.0f} |"
      f" {dense_total / total:.2f}x fewer | {grad:,.0f} | {dense_rs / grad:.2f}x fewer |"
    )
  return "\n".join(lines)


def worker(args) -> None:
  """One of 2 processes: times each method's step on the 2-device mesh."""
  network.join(args)
  mesh = _mesh(jax.device_count())
  rng = np.random.default_rng(args.process_id)
  p, x = local_shapes(args.layers, args.width, mesh.size, args.batch)

  def put(shape, spec, scale=1.0):
    a = (scale * rng.normal(size=shape)).astype(np.float32)
    return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, spec), a)

  xb, yb = put(x.shape, P(AXIS)), put(x.shape, P(AXIS))
  result = {}
  for method in args.methods:
    f = jit_step(method, args, mesh)
    params = {n: put(s.shape, PSPEC[n], 1 / np.sqrt(args.width)) for n, s in p.items()}
    state = jax.block_until_ready(f(params, xb, yb))  # compile, warm the connection
    times = []
    for _ in range(args.steps):
      start = time.perf_counter()
      state = jax.block_until_ready(f(state, xb, yb))
      times.append(time.perf_counter() - start)
    finite = common.all_finite(state)  # a collective: both processes, at the same point
    result[method] = {"median_s": statistics.median(times), "times_s": times, "finite": finite}
  network.emit(result)


def _run_mlp(args, prefix, host: str, rate: str) -> dict:
  """Each MLP method's step times (process 0's), from 2 :func:`worker` processes."""
  flags = ["--worker", "--layers", str(args.layers), "--width", str(args.width), "--batch"]
  flags += [str(args.batch), "--steps", str(args.steps), "--methods", ",".join(args.methods)]
  run = dict(prefix=prefix, host=host, timeout=args.timeout)
  res = network.run_on_link("benchmarks.sharded", flags, **run)
  print(rate, {m: round(r["median_s"], 4) for m, r in res.items()}, flush=True)
  return res


def link_table(by_rate: dict, wire_k2: dict, args) -> str:
  lines = [
    f"2 processes x 1 CPU device (gloo) over a tc-throttled veth; {args.layers} layers x"
    f" ({args.width} x {args.width}), batch {args.batch} per device; median of"
    f" {args.steps} steps.",
    "",
    md_head("rate | method | bytes received / step | s / step | speed-up vs dense", "llrrr"),
  ]
  for rate, res in by_rate.items():
    for method, r in res.items():
      lines.append(
        f"| {rate} | {method} | {sum(wire_k2[method].values()):,.0f} |"
        f" {r['median_s']:.3f} | {res['dense']['median_s'] / r['median_s']:.2f}x |"
      )
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the LM


def lm_baseline(method: str) -> str:
  """The dense method a sharded LM method is timed against: its own kind's."""
  return method.split("_")[0] + "_dense" if method.startswith(("zero_", "fsdp_")) else "dense"


def lm_config(args):
  """The LM config named by ``--config``, with ``--batch`` when given."""
  from examples.lm import configs  # pylint: disable=import-outside-toplevel

  batch = common.flag_overrides(args, [("batch", "per_device_batch_size", 1)])
  return dataclasses.replace(configs.load(args.config).get_config(), **batch)


def _lm(args):
  """``(compile, wire)`` of the LM trainer on ``args.devices`` devices: a method's compiled
  training step, and the bytes one device receives per step by collective (a sharded
  method's weight gathers included)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from examples.lm import models  # pylint: disable=import-outside-toplevel
  from examples.lm import sharded as lm_sharded  # pylint: disable=import-outside-toplevel
  from examples.lm import train  # pylint: disable=import-outside-toplevel

  config, k, mesh = lm_config(args), args.devices, _mesh(args.devices, train.AXIS)
  graphdef, state = nnx.split(models.create_model(config, rngs=nnx.Rngs(config.seed)))
  init_params = jax.device_get(state.to_pure_dict())
  shape = (k, config.per_device_batch_size, config.seq_len + 1)
  batch = jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=jax.NamedSharding(mesh, P(train.AXIS)))

  def compile_step(method):
    if method in lm_sharded.METHODS:
      _, _, params, opt_state, step = train.sharded_parts(
        method, config, graphdef, init_params, mesh
      )
      mini_step = jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.NamedSharding(mesh, P()))
      return step.lower(params, opt_state, batch, mini_step).compile()
    tx = train.make_tx(method, config)
    specs = jc.state_specs(tx, init_params, axis_name=train.AXIS, num_devices=k)
    params = train.replicate(init_params, mesh)
    opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = train.make_train_step(graphdef, tx, mesh, specs)
    return step.lower(params, opt_state, batch).compile()

  def wire_by(method):
    if method in lm_sharded.METHODS:
      return lm_sharded.step_traffic(method, graphdef, init_params, config, k).by_collective
    update = train.make_update(method, config, warmup=False)
    by: dict = {}
    for op in jc.wire_report(update, init_params, axis_name=train.AXIS, num_devices=k).ops:
      by[op.primitive] = by.get(op.primitive, 0.0) + op.bytes_received
    return by

  return compile_step, wire_by


def lm_memory_table(rows: list[dict], args) -> str:
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from examples.lm import models  # pylint: disable=import-outside-toplevel

  config, k = lm_config(args), args.devices
  shapes = nnx.eval_shape(lambda: models.create_model(config, rngs=nnx.Rngs(0)))
  n = sum(p.size for p in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
  psum_scatter = (k - 1) / k * 4 * n  # a dense float32 reduce-scatter of the model
  fsdp = next((r for r in rows if r["method"] == "fsdp_dense"), rows[0])
  head = "method | peak memory (MiB) | vs fsdp_dense | bytes received | dense all-reduce / this |"
  lines = [
    f"LM config {args.config}: {config.depth} blocks of width {config.width}, {n:,}"
    f" parameters, K = {k} devices, {config.per_device_batch_size} sequences of"
    f" {config.seq_len} bytes per device; AdamW; per device per step.",
    "",
    md_head(head + " gradient exchange bytes | dense psum_scatter / this"),
  ]
  for r in rows:
    total = sum(r["wire"].values())
    grad = sum(v for c, v in r["wire"].items() if not c.startswith("all_gather"))
    lines.append(
      f"| {r['method']} | {r['peak_bytes'] / 2**20:.2f} |"
      f" {r['peak_bytes'] / fsdp['peak_bytes']:.2f}x | {total:,.0f} |"
      f" {2 * psum_scatter / total:.2f}x | {grad:,.0f} | {psum_scatter / grad:.2f}x |"
    )
  return "\n".join(lines)


def _run_lm(args, prefix, host: str, rate: str) -> dict:
  """The 2-process LM trainer's results per method (less the parameters)."""
  from benchmarks import lm_network  # pylint: disable=import-outside-toplevel

  flags = ["--config", args.config, "--methods", ",".join(args.methods)]
  flags += ["--steps", str(args.steps), "--eval-every", str(args.steps)]
  flags += [] if args.batch is None else ["--batch", str(args.batch)]
  workdir = os.path.join(os.path.abspath(args.out), "lm", rate)
  coordinator = f"{host}:{launch.free_port()}"
  run = dict(coordinator=coordinator, prefix=prefix, timeout=args.timeout)
  res = lm_network.run_trainer(flags, workdir, **run)["results"]
  print(rate, {m: round(r["train_time_s"] / args.steps, 4) for m, r in res.items()}, flush=True)
  return {m: {k: v for k, v in r.items() if k != "params"} for m, r in res.items()}


def lm_link_table(by_rate: dict, args) -> str:
  config = lm_config(args)
  where = "localhost, no throttle (--smoke)" if args.smoke else "a tc-throttled veth"
  head = "rate | method | bytes received / step | peak memory (MiB) | s / step | speed-up vs |"
  lines = [
    f"2 processes x 1 CPU device (gloo) over {where}; LM config {args.config}"
    f" ({config.depth} blocks of width {config.width}), {config.per_device_batch_size}"
    f" sequences of {config.seq_len} bytes per device; mean of {args.steps} updates"
    " (training steps only).",
    "",
    md_head(head + " val loss", "llrrrlr"),
  ]
  for rate, res in by_rate.items():
    for method, r in res.items():
      base, speedup = lm_baseline(method), "-"
      if base in res and base != method:
        speedup = f"{res[base]['train_time_s'] / r['train_time_s']:.2f}x {base}"
      peak = "n/a" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.2f}"
      lines.append(
        f"| {rate} | {method} | {r['bytes_received']:,.0f} | {peak} |"
        f" {r['train_time_s'] / args.steps:.3f} | {speedup} | {r['val_loss']:.3f} |"
      )
  return "\n".join(lines)


# ----------------------------------------------------------------------------- error feedback

EF_WIDTH, EF_IN, EF_OUT, EF_LAYERS = 128, 64, 16, 8


#: --part ef's options (``--methods``): name -> the exchange's factory, called with the
#: axis and ``collective=``.
EF_OPTIONS = {
  "dense": jc.dense_mean,
  "qsgd4": functools.partial(jc.qsgd, bits=4),
  "qsgd2": functools.partial(jc.qsgd, bits=2),
  "qsgd2_ef": functools.partial(jc.qsgd, bits=2, error_feedback=True),
  "signsgd_noef": functools.partial(jc.compress, jc.codecs.ScaledSign(None)),
  "signsgd_ef_f32": functools.partial(jc.ef_signsgd, residual_dtype=jnp.float32),
  "signsgd_ef_bf16": functools.partial(jc.ef_signsgd, residual_dtype=jnp.bfloat16),
  "signsgd_ef_int8": functools.partial(jc.ef_signsgd, residual_dtype=jnp.int8),
  "onebit_ef_f32": functools.partial(jc.onebit_sgd, residual_dtype=jnp.float32),
  "onebit_ef_int8": functools.partial(jc.onebit_sgd, residual_dtype=jnp.int8),
}


def ef_tx(option: str, lr: float, optimizer: str = "adamw"):
  """``optax.chain(per_device_state(exchange), optimizer)`` for ``option``: adamw, or
  SGD with momentum 0.9 (``"sgd"``)."""
  ex = EF_OPTIONS[option](axis_name=AXIS, collective="reduce_scatter")
  opt = optax.adamw(lr, weight_decay=1e-4) if optimizer == "adamw" else optax.sgd(lr, 0.9)
  return optax.chain(jc.per_device_state(ex), opt)


def ef_params(seed: int):
  """The MLP's parameters: ``EF_LAYERS`` dense layers, ``EF_IN -> EF_WIDTH ... -> EF_OUT``."""
  sizes = [EF_IN] + [EF_WIDTH] * (EF_LAYERS - 1) + [EF_OUT]
  keys = jax.random.split(jax.random.key(seed), EF_LAYERS)
  return {
    f"layer{i}": {
      "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
      "b": jnp.zeros((b,), jnp.float32),
    }
    for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
  }


def ef_data(seed: int, n: int):
  """``n`` inputs and their targets from a fixed random teacher (a 2-layer tanh net)."""
  k1, k2, k3 = jax.random.split(jax.random.key(1000), 3)
  w1 = jax.random.normal(k1, (EF_IN, 256)) / np.sqrt(EF_IN)
  w2 = jax.random.normal(k2, (256, EF_OUT)) / np.sqrt(256)
  x = jax.random.normal(jax.random.fold_in(k3, seed), (n, EF_IN))
  return x, jnp.tanh(x @ w1) @ w2


def ef_loss(params, x, y):
  for i in range(EF_LAYERS):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    x = jnp.tanh(x) if i < EF_LAYERS - 1 else x
  return jnp.mean((x - y) ** 2)


def ef_step(tx, mesh, state_specs):
  """The jitted ZeRO-2 step: gather the shards, local gradient, reduce-scatter, adamw."""

  def step(shards, opt_state, x, y):
    params = jax.tree.map(lambda s: lax.all_gather(s, AXIS, tiled=True), shards)
    loss, grads = jax.value_and_grad(ef_loss)(params, x, y)  # local, full size
    updates, opt_state = tx.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, lax.pmean(loss, AXIS)

  in_specs = (P(AXIS), state_specs, P(AXIS), P(AXIS))
  out_specs = (P(AXIS), state_specs, P())
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def ef_train(option: str, args, seed: int = 0) -> dict[str, Any]:
  """Trains ``option`` for ``--steps``; losses, held-out loss, bytes per device."""
  k, mesh = jax.device_count(), common.data_mesh(AXIS)
  params, tx = ef_params(seed), ef_tx(option, args.lr, args.optimizer)
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=k, param_specs=P(AXIS))
  place = jax.NamedSharding(mesh, P(AXIS))
  shards = jax.device_put(params, place)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(AXIS),), out_specs=specs))
  opt_state, step, losses = init(shards), ef_step(tx, mesh, specs), []
  for t in range(args.steps):
    xy = jax.device_put(ef_data(t, args.batch * k), place)
    shards, opt_state, loss = step(shards, opt_state, *xy)
    losses.append(float(loss))
  final = jax.tree.map(np.asarray, multihost_utils.process_allgather(shards, tiled=True))
  report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=k, param_specs=P(AXIS))
  exchange = opt_state[0].inner
  return {
    "losses": losses,
    "test_loss": float(ef_loss(final, *ef_data(10**6, 4096))),
    "shard_bytes": per_device_bytes(shards),
    "residual": per_device_bytes(
      (exchange.residual, exchange.residual_scale, exchange.chunk_residual)
    ),
    "optimizer": per_device_bytes(opt_state[1]),
    "wire_bytes": report.bytes_received,
    "params_sha256": common.params_digest(final),
  }


def ef_table(results: dict[str, dict[str, Any]]) -> str:
  """The Markdown table: bytes per device and held-out loss against dense."""
  dense = results.get("dense")
  rows = []
  for name, r in results.items():
    rel = r["test_loss"] / dense["test_loss"] if dense else float("nan")
    cells = [name, f"{r['residual']:,}", f"{r['residual'] / r['shard_bytes']:.2f}"]
    cells += [f"{r['optimizer']:,}", f"{r['wire_bytes']:,.0f}", f"{r['test_loss']:.4f}"]
    rows.append([*cells, f"{rel:.2f}"])
  head = "option | residual B/device | x shards | optimizer B/device | wire B/step | test loss"
  return md_table(head + " | vs dense", rows)


def error_feedback(args) -> int:
  """``--part ef``: every option's table, or as one process of ``jax.distributed`` its
  results (:func:`benchmarks.network.emit`)."""
  worker = args.num_processes is not None
  if worker:
    network.join(args, args.devices_per_process)
  else:
    use_cpu_devices(args.devices)
  results = {o: ef_train(o, args) for o in args.methods}
  if worker:
    network.emit(results)
    return 0
  print(
    f"ZeRO-2 MLP ({EF_LAYERS} layers, width {EF_WIDTH}), K={jax.device_count()} devices, "
    f"{args.steps} steps, {args.optimizer} lr {args.lr}, batch {args.batch}/device"
  )
  print(ef_table(results))
  return 0


# ----------------------------------------------------------------------------- either model


def memory(args, *, with_wire: bool = True) -> list[dict]:
  """Each method's compiled step (``--model``'s): its peak memory per device (arguments
  + outputs + temporaries - aliased) and its wire bytes by collective (``with_wire``)."""
  compile_step, wire_by = (_lm if args.model == "lm" else _mlp)(args)
  rows = []
  for method in args.methods:
    m = compile_step(method).memory_analysis()
    used = sum(getattr(m, f"{part}_size_in_bytes") for part in ("argument", "output", "temp"))
    rows.append(
      {
        "method": method,
        "peak_bytes": int(used - m.alias_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "wire": wire_by(method) if with_wire else None,
      }
    )
    print(method, rows[-1], flush=True)
  return rows


def link(args) -> dict:
  """``{rate: results}`` of 2 processes (``--model``'s) over the throttled veth, process
  ``i`` in namespace ``i``, at each rate; or with ``--smoke`` 2 local processes (no
  namespaces or throttle)."""
  run = _run_lm if args.model == "lm" else _run_mlp
  if args.smoke:
    return {"none": run(args, None, "127.0.0.1", "none")}
  out = {}
  with network.open_link(NAMESPACES, VETHS, ADDRESSES) as ln:
    for rate in args.rates:
      ln.set_rate(rate)
      out[rate] = run(args, ln.worker_prefix, ADDRESSES[0], rate)
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--part", default="all", choices=("all", "memory", "link", "ef"))
  p.add_argument("--model", default="mlp", choices=("mlp", "lm"), help="MLP, or examples/lm")
  p.add_argument("--config", default="deep", help="--model lm: the examples/lm config")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--batch", type=int, help="per device: rows (32) or LM sequences (the config's)")
  p.add_argument("--devices", type=int, default=8, help="CPU devices of the memory and ef parts")
  p.add_argument("--methods", default=None, help="comma-separated (default: every method)")
  p.add_argument("--rates", default="none,1gbit")
  p.add_argument("--steps", type=int, help="timed per method and rate (10); ef: trained (300)")
  p.add_argument("--timeout", type=float, default=1200)
  p.add_argument("--smoke", action="store_true", help="link part: 2 local processes, tiny model")
  p.add_argument("--out", default=None, help="output directory (runs/sharded, runs/sharded_lm)")
  p.add_argument("--lr", type=float, default=3e-3, help="--part ef")
  p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="--part ef")
  p.add_argument("--num-processes", type=int, help="--part ef: one process of jax.distributed")
  p.add_argument("--process-id", type=int, default=0, help="--part ef, with --num-processes")
  p.add_argument("--coordinator", default="", help="--part ef: HOST:PORT of process 0")
  p.add_argument("--devices-per-process", type=int, default=2, help="--part ef, CPU devices")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  lm, ef = args.model == "lm", args.part == "ef"
  if ef and lm:
    p.error("--part ef trains its own MLP: it takes no --model lm")
  known = tuple(EF_OPTIONS) if ef else LM_METHODS if lm else METHODS
  try:
    args.methods = list(common.parse_methods(args.methods or ",".join(known), known))
  except ValueError as e:
    p.error(str(e))
  args.rates = [r for r in args.rates.split(",") if r]
  args.out = args.out or ("runs/sharded_lm" if lm else "runs/sharded")
  if args.smoke and lm:
    args.part, args.rates, args.config, args.batch, args.steps = "link", ["none"], "tiny", 2, 2
  elif args.smoke:
    args.part, args.rates, args.width, args.batch, args.steps = "link", ["none"], 64, 4, 2
  if args.batch is None and not lm:
    args.batch = 32
  if args.steps is None:
    args.steps = 300 if ef else 10
  if not (lm or ef) and "dense" not in args.methods:
    p.error("--methods must include dense (the baseline)")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  if args.part == "ef":
    return error_feedback(args)
  lm, memory_part, link_part = args.model == "lm", args.part != "link", args.part != "memory"
  if link_part and not args.smoke and network.cannot_run("benchmarks.sharded --part link"):
    return 2
  results, report = {"args": vars(args)}, []
  if memory_part:
    use_cpu_devices(args.devices)
    results["memory"] = memory(args)
    report.append((lm_memory_table if lm else memory_table)(results["memory"], args))
    print(report[-1], flush=True)
  if link_part:
    results["link"] = link(args)
    if lm:
      report.append(lm_link_table(results["link"], args))
    else:  # the MLP's bytes at K = 2, from its trace
      results["link_wire"] = wire_k2 = {m: wire_bytes(m, args, 2) for m in args.methods}
      report.append(link_table(results["link"], wire_k2, args))
    print(report[-1], flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write("\n\n".join(report) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
