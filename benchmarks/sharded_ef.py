r"""Error feedback a sharded model can afford: state bytes and convergence per option.

A ZeRO-2 loop (the gradient reduce-scattered by ``collective="reduce_scatter"``, adamw
or SGD on the shards) trains an 8-layer MLP with each exchange option from the same start:
the residuals' bytes per device next to the shards' and the optimizer's, and the held-out
loss against the dense ``psum_scatter``'s (docs/guides/sharded.md, "Error feedback a
sharded model can afford").

  python -m benchmarks.sharded_ef                       # every option, 8 CPU devices
  python -m benchmarks.sharded_ef --steps 100 --options dense,qsgd4,signsgd_ef_int8
  python -m benchmarks.sharded_ef --optimizer sgd --lr 0.05

With ``--process-id/--num-processes/--coordinator``, one process of a ``jax.distributed``
run (gloo on CPU) that prints ``RESULT {json}`` (``tests/test_sharded.py`` compares them).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import jax
from jax import lax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from benchmarks import sharded
from benchmarks._timing import md_head
from examples import common
import jaxcomp as jc

RESULT_MARKER = "RESULT "
WIDTH, IN, OUT, LAYERS = 128, 64, 16, 8
AXIS = "data"


#: name -> the exchange's factory, called with the axis and ``collective=``.
OPTIONS = {
  # The dense psum_scatter: no leaf compressed.
  "dense": functools.partial(jc.compress, jc.codecs.Identity(), filter=lambda path, leaf: False),
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


def make_tx(option: str, lr: float, optimizer: str = "adamw"):
  """``optax.chain(per_device_state(exchange), optimizer)`` for ``option``: adamw, or
  SGD with momentum 0.9 (``"sgd"``)."""
  ex = OPTIONS[option](axis_name=AXIS, collective="reduce_scatter")
  opt = optax.adamw(lr, weight_decay=1e-4) if optimizer == "adamw" else optax.sgd(lr, 0.9)
  return optax.chain(jc.per_device_state(ex), opt)


def init_params(seed: int):
  """The MLP's parameters: ``LAYERS`` dense layers, ``IN -> WIDTH ... -> OUT``."""
  sizes = [IN] + [WIDTH] * (LAYERS - 1) + [OUT]
  keys = jax.random.split(jax.random.key(seed), LAYERS)
  return {
    f"layer{i}": {
      "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
      "b": jnp.zeros((b,), jnp.float32),
    }
    for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
  }


def data(seed: int, n: int):
  """``n`` inputs and their targets from a fixed random teacher (a 2-layer tanh net)."""
  k1, k2, k3 = jax.random.split(jax.random.key(1000), 3)
  w1 = jax.random.normal(k1, (IN, 256)) / np.sqrt(IN)
  w2 = jax.random.normal(k2, (256, OUT)) / np.sqrt(256)
  x = jax.random.normal(jax.random.fold_in(k3, seed), (n, IN))
  return x, jnp.tanh(x @ w1) @ w2


def loss_fn(params, x, y):
  for i in range(LAYERS):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    x = jnp.tanh(x) if i < LAYERS - 1 else x
  return jnp.mean((x - y) ** 2)


def make_step(tx, mesh, state_specs):
  """The jitted ZeRO-2 step: gather the shards, local gradient, reduce-scatter, adamw."""

  def step(shards, opt_state, x, y):
    params = jax.tree.map(lambda s: lax.all_gather(s, AXIS, tiled=True), shards)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # local, full size
    updates, opt_state = tx.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, lax.pmean(loss, AXIS)

  in_specs = (P(AXIS), state_specs, P(AXIS), P(AXIS))
  out_specs = (P(AXIS), state_specs, P())
  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def per_device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def train(option: str, args, seed: int = 0) -> dict[str, Any]:
  """Trains ``option`` for ``--steps``; losses, held-out loss, bytes per device."""
  k, mesh = jax.device_count(), common.data_mesh(AXIS)
  params, tx = init_params(seed), make_tx(option, args.lr, args.optimizer)
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=k, param_specs=P(AXIS))
  place = jax.NamedSharding(mesh, P(AXIS))
  shards = jax.device_put(params, place)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(P(AXIS),), out_specs=specs))
  opt_state, step, losses = init(shards), make_step(tx, mesh, specs), []
  for t in range(args.steps):
    xy = jax.device_put(data(t, args.batch * k), place)
    shards, opt_state, loss = step(shards, opt_state, *xy)
    losses.append(float(loss))
  final = jax.tree.map(np.asarray, multihost_utils.process_allgather(shards, tiled=True))
  report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=k, param_specs=P(AXIS))
  exchange = opt_state[0].inner
  return {
    "losses": losses,
    "test_loss": float(loss_fn(final, *data(10**6, 4096))),
    "shard_bytes": per_device_bytes(shards),
    "residual": per_device_bytes(
      (exchange.residual, exchange.residual_scale, exchange.chunk_residual)
    ),
    "optimizer": per_device_bytes(opt_state[1]),
    "wire_bytes": report.bytes_received,
    "params_sha256": common.params_digest(final),
  }


def table(results: dict[str, dict[str, Any]]) -> str:
  """The Markdown table: bytes per device and held-out loss against dense."""
  dense = results.get("dense")
  columns = "option | residual B/device | x shards | optimizer B/device | wire B/step"
  lines = [md_head(columns + " | test loss | vs dense")]
  for name, r in results.items():
    rel = r["test_loss"] / dense["test_loss"] if dense else float("nan")
    lines.append(
      f"| {name} | {r['residual']:,} | {r['residual'] / r['shard_bytes']:.2f} | "
      f"{r['optimizer']:,} | {r['wire_bytes']:,.0f} | {r['test_loss']:.4f} | {rel:.2f} |"
    )
  return "\n".join(lines)


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=32, help="examples per device per step")
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
  parser.add_argument("--devices", type=int, default=8, help="CPU devices (one process)")
  parser.add_argument("--process-id", type=int, default=None)
  parser.add_argument("--num-processes", type=int, default=None)
  parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  parser.add_argument("--devices-per-process", type=int, default=2)
  args = parser.parse_args(argv)
  try:
    args.options = common.parse_methods(args.options, tuple(OPTIONS), "--options")
  except ValueError as e:
    parser.error(str(e))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  worker = args.process_id is not None
  if worker:
    common.init_distributed(
      args.coordinator,
      args.num_processes,
      args.process_id,
      devices_per_process=args.devices_per_process,
    )
  else:
    sharded.use_cpu_devices(args.devices)
  results = {o: train(o, args) for o in args.options}
  if worker:
    print(RESULT_MARKER + json.dumps(results), flush=True)
    return 0
  print(
    f"ZeRO-2 MLP ({LAYERS} layers, width {WIDTH}), K={jax.device_count()} devices, "
    f"{args.steps} steps, {args.optimizer} lr {args.lr}, batch {args.batch}/device"
  )
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
