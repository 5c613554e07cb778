"""Data-parallel MNIST-1D training with ``flax.nnx`` and a jaxcomp gradient exchange.

The same experiment as ``examples/mnist1d`` (same data, batches, model shapes,
optimizer and results table), written the way flax's own ``examples/mnist`` is: an
``nnx.Module``, an ``nnx.Optimizer``, and a train step that calls
``optimizer.update(model, grads)``. Data parallelism adds three things:

* **split/merge around ``jax.shard_map``.** The model and the optimizer travel as one
  ``nnx.split((model, optimizer))`` state, replicated (``P()``); the step merges them,
  updates them in place and returns ``nnx.state((model, optimizer))``. This is flax's
  functional pattern for ``jax.jit``: ``nnx.merge`` runs while tracing, not on every
  call, and the pure-pytree step compiles ahead of time (``.lower(...).compile()``) as
  the linen trainer's does, which keeps compilation out of the timings.
  (``nnx.shard_map`` would take the module and optimizer directly, splitting and
  merging them in Python on every call.)
* **The exchange before the optimizer, with its own state.** jaxcomp's state is per
  device (error-feedback residuals, device-folded keys) and its ``init`` needs the mesh
  axis bound (two-phase exchanges size their residuals by it), while ``nnx.Optimizer``
  calls ``tx.init`` when constructed and keeps one replicated state. So the exchange is
  kept beside the optimizer rather than chained into it: ``jc.per_device_state``
  marks its state, ``jc.state_specs`` places it (``P(axis)``: one row per device), it
  is initialised inside ``jax.shard_map``, and it is the one visible line
  ``grads, exchange_state = exchange.update(grads, exchange_state, params)``. The
  ``nnx.Optimizer`` then sees the same mean gradient on every device, so its state
  stays replicated like the model's.
* **The local gradient.** Inside ``jax.shard_map`` (``check_vma`` on) the gradient
  with respect to the replicated model comes back already summed over the devices: the
  transpose of the implicit broadcast is a dense ``psum``, the very all-reduce the
  exchange replaces. The step differentiates ``jc.vary(model, AXIS)`` instead, a copy
  of the model (nnx modules are pytrees) whose parameters are marked device-varying.

The exchanges, the optimizer after them, the byte counts and the results table are
the linen trainer's own (``examples.mnist1d.train``), imported rather than repeated.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from examples.mnist1d import input_pipeline
from examples.mnist1d import train as linen_train
from examples.mnist1d_nnx import models
import jaxcomp as jc

AXIS = linen_train.AXIS
METHODS = linen_train.METHODS
ALL_METHODS = linen_train.ALL_METHODS


def make_exchange(method: str, config, *, warmup: bool = True) -> optax.GradientTransformation:
  """The gradient exchange of ``method``, its state marked per device where it is.

  ``examples.mnist1d.train.make_exchange`` wrapped in ``jc.per_device_state``, except
  for exchanges whose state is the same on every device (MIPD's), kept replicated.
  """
  exchange = linen_train.make_exchange(method, config, warmup=warmup)
  if method in linen_train.REPLICATED_STATE or method in linen_train.OPTIMIZER_IN_EXCHANGE:
    return exchange
  return jc.per_device_state(exchange)


def make_optimizer(method: str, config) -> optax.GradientTransformation:
  """The optimizer after the exchange: plain SGD after DGC (which carries momentum), none
  after 1-bit Adam (whose exchange returns the parameter steps)."""
  if method in linen_train.OPTIMIZER_IN_EXCHANGE:
    return optax.identity()
  return linen_train.make_optimizer(config, momentum=method not in linen_train.MOMENTUM_IN_EXCHANGE)


def loss_fn(model: models.CNN, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of ``model`` on a batch."""
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(graphdef, exchange, mesh, exchange_specs):
  """jit(shard_map(train_step)) over ``(state, exchange_state, batch)``.

  ``state`` is ``nnx.state((model, optimizer))`` (replicated), ``exchange_state`` is
  placed by ``exchange_specs``, the batch is split over the devices. Returns the new
  ``(state, exchange_state)`` and each device's loss, shape ``(K,)``: as in the linen
  trainer the host averages the losses, so the step runs no collective but the
  exchange's.
  """

  def train_step(state, exchange_state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    x, y = jax.tree.map(lambda a: a[0], batch)  # this device's (B, ...) slice
    # The local gradient: w.r.t. a device-varying copy of the model (see the module
    # docstring); w.r.t. `model` itself it would arrive psum'd, a dense all-reduce.
    loss, grads = nnx.value_and_grad(loss_fn)(jc.vary(model, AXIS), x, y)
    params = nnx.state(model, nnx.Param)
    grads, exchange_state = exchange.update(grads, exchange_state, params)  # the exchange
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), exchange_state, loss[None]

  return jax.jit(
    jax.shard_map(
      train_step,
      mesh=mesh,
      in_specs=(P(), exchange_specs, P(AXIS)),
      out_specs=(P(), exchange_specs, P(AXIS)),
    ),
    donate_argnums=(0, 1),
  )


def make_eval_step(graphdef, mesh):
  """jit(shard_map(accuracy)) over a test set split ``(K, n/K, ...)`` with a pad mask."""

  def accuracy(state, x, y, mask):
    model, _ = nnx.merge(graphdef, state)
    x, y, mask = x[0], y[0], mask[0]
    pred = jnp.argmax(model(x), axis=-1)
    correct = jnp.sum((pred == y).astype(jnp.float32) * mask)
    return lax.psum(correct, AXIS) / lax.psum(jnp.sum(mask), AXIS)

  return jax.jit(
    jax.shard_map(accuracy, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=P())
  )


def train_method(
  method: str, config, *, graphdef, init_state, data, mesh
) -> tuple[models.CNN, dict[str, Any]]:
  """Trains one method from the model ``nnx.merge(graphdef, init_state)``.

  Returns the trained model and the method's results, with the keys of
  ``examples.mnist1d.train.train_method``'s (accuracy, bytes, timings, histories, where
  it went non-finite).
  """
  k = mesh.size
  replicated = jax.NamedSharding(mesh, P())
  per_device = jax.NamedSharding(mesh, P(AXIS))

  # device_put first: nnx.merge reuses the Variables of the state it is given, and the
  # host copy must stay untouched for the next method.
  model = nnx.merge(graphdef, jax.device_put(init_state, replicated))
  optimizer = nnx.Optimizer(model, make_optimizer(method, config), wrt=nnx.Param)
  train_graphdef, state = nnx.split((model, optimizer))
  state = jax.device_put(state, replicated)  # the optimizer's step count too

  exchange = make_exchange(method, config)
  init_params = init_state.filter(nnx.Param)  # host arrays: the step donates the device's
  # The exchange's init runs inside shard_map: its state is per device, and a
  # two-phase exchange sizes its residuals by the axis.
  exchange_specs = jc.state_specs(exchange, init_params, axis_name=AXIS, num_devices=k)
  exchange_state = jax.jit(
    jax.shard_map(exchange.init, mesh=mesh, in_specs=P(), out_specs=exchange_specs)
  )(init_params)

  test = jax.device_put(input_pipeline.eval_shards(data["x_test"], data["y_test"], k), per_device)
  batches = input_pipeline.train_batches(
    data["x"],
    data["y"],
    num_devices=k,
    per_device_batch_size=config.per_device_batch_size,
    seed=config.seed,
  )

  # Compile ahead of time, so that the training time below excludes compilation.
  start = time.perf_counter()
  batch_spec = tuple(
    jax.ShapeDtypeStruct(
      (k, config.per_device_batch_size, *a.shape[1:]), a.dtype, sharding=per_device
    )
    for a in (data["x"], data["y"])
  )
  step = (
    make_train_step(train_graphdef, exchange, mesh, exchange_specs)
    .lower(state, exchange_state, batch_spec)
    .compile()
  )
  evaluate = make_eval_step(train_graphdef, mesh).lower(state, *test).compile()
  compile_time = time.perf_counter() - start

  history = {
    "step": [0],
    "test_accuracy": [float(evaluate(state, *test))],
    "train_loss": [float("nan")],
  }
  train_time, losses = 0.0, []
  divergence = common.Divergence()  # losses every step, model and optimizer at evaluations
  with tqdm(total=config.num_steps, desc=f"{method:>6}", unit="step") as bar:
    for i in range(1, config.num_steps + 1):
      start = time.perf_counter()
      batch = jax.device_put(next(batches), per_device)
      state, exchange_state, loss = step(state, exchange_state, batch)
      # One step in flight at a time, as in the linen trainer (queued multi-device
      # steps on few cores can deadlock XLA's CPU collectives).
      losses.append(float(np.mean(np.asarray(loss))))
      divergence.loss(i, losses[-1])
      train_time += time.perf_counter() - start
      bar.update()
      if i % config.eval_every == 0 or i == config.num_steps:
        divergence.check(i, common.all_finite(state))
        acc = float(evaluate(state, *test))
        history["step"].append(i)
        history["test_accuracy"].append(acc)
        history["train_loss"].append(float(np.mean(losses)))  # since the last eval
        losses = []
        bar.set_postfix(loss=f"{history['train_loss'][-1]:.3f}", test_acc=f"{acc:.1%}")

  model, _ = nnx.merge(train_graphdef, state)
  # Bytes of the steady state: DGC's warm-up stages send more.
  steady = (
    make_exchange(method, config, warmup=False)
    if (method == "dgc" or method in linen_train.OPTIMIZER_IN_EXCHANGE)
    else exchange
  )
  report = linen_train.wire_report(steady, init_params, k)
  return model, {
    "overflow_steps": linen_train.overflow_steps(exchange_state),
    "test_accuracy": history["test_accuracy"][-1],
    "bytes_received": None if report is None else report.bytes_received,
    "dense_bytes": None if report is None else report.dense_bytes,
    "ratio": None if report is None else report.ratio,
    "train_time_s": train_time,
    "compile_time_s": compile_time,
    "history": history,
    "wire_report": None if report is None else str(report),
    "layer_change": linen_train.layer_change(
      init_params.to_pure_dict(), nnx.state(model, nnx.Param).to_pure_dict()
    ),
    "nonfinite_step": divergence.step,
    "diverged": divergence.diverged,
    "first_exchange_step": linen_train.first_exchange_step(method, config),
    "exchanged": config.num_steps >= linen_train.first_exchange_step(method, config),
  }


def setup(config, workdir: str):
  """(mesh over all devices, data set, model graphdef, host copy of the model state)."""
  os.makedirs(workdir, exist_ok=True)
  k = jax.device_count()
  mesh = common.data_mesh(AXIS)
  data = input_pipeline.load_dataset(config, workdir)
  graphdef, state = nnx.split(models.create_model(config, rngs=nnx.Rngs(config.seed)))
  # Host copy: every method starts from it (the train step donates its device buffers).
  state = jax.device_get(state)
  num_params = sum(p.size for p in jax.tree.leaves(state))
  print(
    f"{k} devices ({jax.devices()[0].platform}), {num_params:,} parameters, "
    f"{len(data['x'])} train / {len(data['x_test'])} test examples, global batch "
    f"{k * config.per_device_batch_size}, {config.num_steps} steps (flax.nnx)"
  )
  return mesh, data, graphdef, state


def train_and_evaluate(config, workdir: str) -> dict[str, dict[str, Any]]:
  """Trains every method in ``config.methods`` and writes the results to ``workdir``.

  Writes ``results.md`` (the linen trainer's table), ``results.json`` and
  ``accuracy.png``, as ``examples.mnist1d.train.train_and_evaluate`` does, a method
  that went non-finite marked in all three.

  Args:
    config: a :class:`examples.mnist1d.configs.default.Config`.
    workdir: output directory (also caches the generated data set).

  Returns:
    ``{method: results}`` with the keys of :func:`train_method`'s results.
  """
  mesh, data, graphdef, init_state = setup(config, workdir)
  k = mesh.size
  results = {}
  for method in config.methods:
    _, results[method] = train_method(
      method, config, graphdef=graphdef, init_state=init_state, data=data, mesh=mesh
    )

  common.write_results(
    workdir,
    linen_train.results_table(results, k),
    {"config": dataclasses.asdict(config), "num_devices": k, "api": "flax.nnx", "results": results},
  )
  linen_train.plot_accuracy(results, os.path.join(workdir, "accuracy.png"))
  return results
