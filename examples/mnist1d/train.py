"""Data-parallel MNIST-1D training with dense and compressed gradient exchanges.

Each method trains the same CNN from the same initialisation on the same batches with
the same optimizer; only the first transform of the optax chain, the gradient exchange,
differs. Training runs on every device with ``jax.shard_map``; the exchange is the one
line ``updates, opt_state = tx.update(grads, opt_state, params)``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from examples.mnist1d import input_pipeline
from examples.mnist1d import models
from examples.mnist1d.configs import default as default_config
import jaxcomp as jc

AXIS = "batch"

# The demo's methods, in table order: the default config's list (one place).
METHODS = default_config.Config.methods
# Also accepted by --methods (and benchmarks.launch), not trained by default: the dense
# baseline with all leaves in one all-reduce buffer (jc.pmean_tree), for benchmarks; and
# 1-bit SGD with the paper's per-column means (costly on the convolution kernels, whose
# columns are their few spatial taps: docs/methods/onebit_sgd.md).
# DiLoCo (jc.diloco): local steps, then a synced outer step; the pseudo-gradient dense
# or 4-bit QSGD (LOCAL_PARAMS below).
# SparseLoCo (jc.sparseloco: DiLoCo with chunked top-k 2-bit pseudo-gradients) and DeMo
# (jc.decoupled_momentum, the whole optimizer) as well.
EXTRA_METHODS = (
  "dense_flat",
  "onebit_per_column",
  "diloco",
  "diloco_qsgd4",
  "sparseloco",
  "demo",
)
ALL_METHODS = METHODS + EXTRA_METHODS

# Methods whose exchange carries the momentum (DGC's momentum correction): the optimizer
# after them is plain SGD, and they clip locally instead of clipping the mean gradient.
MOMENTUM_IN_EXCHANGE = ("dgc",)

# Methods that are the whole optimizer, exchange included (1-bit Adam exchanges Adam's
# momentum): make_tx returns the exchange itself, with no optimizer after it and not
# wrapped in jc.per_device_state (it places its own per-device buffers; m and v stay
# replicated, so the updates are).
OPTIMIZER_IN_EXCHANGE = ("onebit_adam", "demo")

# 1-bit Adam's full-precision warm-up, as a fraction of the steps: the paper's 15-25%.
# v is frozen at a loss near zero on this small model, so the compressed stage relies on
# jc.onebit_adam's momentum bound (docs/methods/onebit_adam.md).
ONEBIT_ADAM_FREEZE = 0.2
# What 1-bit Adam compresses: the step direction m / sqrt(v). The frozen v of this ReLU
# CNN spans orders of magnitude within a kernel, where a scaled sign of the momentum
# itself (Algorithm 1, "momentum") gives the small-v coordinates the largest steps.
ONEBIT_ADAM_COMPRESS = "preconditioned"

# Exchanges whose state is identical on every device (MIPD's prediction is updated from
# the aggregated gradient only): kept replicated, not wrapped in jc.per_device_state.
REPLICATED_STATE = ("mipd",)

# DiLoCo's methods: each replica runs the demo's optimizer (make_optimizer) on its own
# gradients for config.diloco_sync_every steps, then the pseudo-gradients are averaged
# (densely, or by the exchange make_exchange gives) and the paper's outer Nesterov
# (DILOCO_OUTER) steps the shared params. The replicas drift apart between syncs, so
# their params are held per device (one row each, P(AXIS)) and evaluated at the anchor.
LOCAL_PARAMS = ("diloco", "diloco_qsgd4", "sparseloco")
DILOCO_OUTER = dict(learning_rate=0.7, momentum=0.9, nesterov=True)
# SparseLoCo's share of each chunk of 4096 values sent at a sync (the paper's 1-3%).
SPARSELOCO_DENSITY = 0.02

# PowerSGD's rank: 2, the paper's setting for image classification (CIFAR-10 ResNet-18).
# Each kernel, viewed as a (k·in, out) matrix, sends 2(m + n) values instead of m·n.
# docs/methods/powersgd.md compares ranks 1-8 on this demo.
POWERSGD_RANK = 2


def pmean_gradients(axis_name: str, *, flat: bool = False) -> optax.GradientTransformation:
  """The dense baseline: a float32 ``lax.pmean`` of every gradient leaf, no state.

  With ``flat``, :func:`jaxcomp.pmean_tree`: the same means from one all-reduce of one
  buffer, instead of one all-reduce operand per leaf (one gloo round each on CPU).
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    if flat:
      return jc.pmean_tree(updates, axis_name), state
    return jax.tree.map(lambda g: lax.pmean(g, axis_name), updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def make_exchange(method: str, config=None, *, warmup: bool = True) -> optax.GradientTransformation:
  """The gradient exchange of ``method``: returns the mean gradient over ``AXIS``.

  ``config`` supplies DGC's clipping threshold and warm-up length (the learning-rate
  warm-up, as in the paper); ``warmup=False`` gives DGC's steady state (for byte counts).
  """
  if method == "dgc":
    clip, warmup_steps = None, 0
    if config is not None:
      # DGC's clip_norm bounds the *sum* of the K gradients (local threshold
      # clip_norm/sqrt(K)); clipping the mean at grad_clip corresponds to K * grad_clip.
      clip = jax.device_count() * config.grad_clip or None
      warmup_steps = min(config.warmup_steps, config.num_steps // 2) if warmup else 0
    return jc.dgc(
      0.001, 0.9, nesterov=True, clip_norm=clip, warmup_steps=warmup_steps, axis_name=AXIS
    )
  if method == "wangni":
    return jc.sparsify(density=0.05, axis_name=AXIS)
  if method == "mipd":  # drop 50%, int8 normal quantization, half update, compensation
    return jc.mipd(0.5, axis_name=AXIS)
  if method == "powersgd":
    return jc.powersgd(POWERSGD_RANK, axis_name=AXIS)  # error feedback and warm start
  if method == "dense":
    return pmean_gradients(AXIS)
  if method in ("dense_flat", "diloco"):
    return pmean_gradients(AXIS, flat=True)
  # "auto": two-phase (traffic flat in K), or the all-gather on 2 devices (same bytes).
  if method in ("qsgd4", "diloco_qsgd4"):
    return jc.qsgd(bits=4, axis_name=AXIS, collective="auto")
  if method == "qsgd2":
    return jc.qsgd(bits=2, bucket_size=128, axis_name=AXIS, collective="auto")
  if method == "onebit":
    return jc.onebit_sgd(axis_name=AXIS)
  if method == "onebit_per_column":
    return jc.onebit_sgd(per_column=True, axis_name=AXIS)
  if method == "ef_signsgd":  # one scale per tensor (per two-phase chunk)
    return jc.ef_signsgd(axis_name=AXIS)
  if method == "onebit_adam":
    return make_onebit_adam(config, warmup=warmup)
  if method == "demo":
    return make_demo(config)
  raise ValueError(f"unknown method {method!r}; expected one of {ALL_METHODS}")


def adam_schedule(config) -> optax.Schedule:
  """The demo's warmup and cosine decay at an Adam-like peak: ``config.learning_rate``
  when ``config.optimizer`` is ``"adamw"``, else ``config.adam_learning_rate`` (the
  default's rate is SGD's)."""
  peak = config.learning_rate if config.optimizer == "adamw" else config.adam_learning_rate
  warmup_cosine = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak,
    warmup_steps=min(config.warmup_steps, config.num_steps // 2),
    decay_steps=config.num_steps,
  )
  return lambda count: warmup_cosine(jnp.asarray(count, jnp.float32))


def make_demo(config) -> optax.GradientTransformation:
  """DeMo (``jc.decoupled_momentum``): the sign of the exchanged fast DCT components of
  each device's momentum, a step of the same size on every coordinate, as Adam's is,
  hence :func:`adam_schedule`; the demo's weight decay; the paper's chunk 64 and top 32.
  ``config`` ``None``: a constant rate of 1e-3 (for byte counts)."""
  if config is None:
    return jc.decoupled_momentum(1e-3, axis_name=AXIS)
  return jc.decoupled_momentum(
    adam_schedule(config), axis_name=AXIS, weight_decay=config.weight_decay
  )


def make_onebit_adam(config, *, warmup: bool = True, **kwargs) -> optax.GradientTransformation:
  """1-bit Adam: the exchange and the optimizer, with the demo's schedule and decay.

  The learning rate follows the same linear warmup and cosine decay as
  :func:`make_optimizer`, peaking at ``config.learning_rate`` when ``config.optimizer``
  is ``"adamw"`` (the rate is then already an Adam one) and at
  ``config.adam_learning_rate`` otherwise (the default's rate is SGD's); weight decay is
  ``config.weight_decay``, decoupled as in ``optax.adamw``. The first
  ``ONEBIT_ADAM_FREEZE`` of the steps are the full-precision warm-up; after it the step
  direction is compressed (``ONEBIT_ADAM_COMPRESS``), held to Adam's momentum bound
  (``jc.onebit_adam``'s default). There is no clipping: the gradient is local, and in
  the compression stage no mean gradient exists to clip (Adam's steps are normalized by
  ``sqrt(v)`` anyway). ``warmup=False`` gives the compression stage alone (``freeze_step=0``, for
  byte counts); ``config`` ``None`` a constant rate of 1e-3 (for byte counts too).
  ``kwargs`` go to ``jc.onebit_adam``, over the demo's (e.g. ``bound_momentum=False``,
  another ``freeze_step``).
  """
  if config is None:
    options = dict(freeze_step=1 if warmup else 0, compress=ONEBIT_ADAM_COMPRESS, axis_name=AXIS)
    return jc.onebit_adam(1e-3, **{**options, **kwargs})
  schedule = adam_schedule(config)
  freeze_step = max(1, round(ONEBIT_ADAM_FREEZE * config.num_steps)) if warmup else 0
  options = dict(
    freeze_step=freeze_step,
    weight_decay=config.weight_decay,
    compress=ONEBIT_ADAM_COMPRESS,
    axis_name=AXIS,
  )
  return jc.onebit_adam(schedule, **{**options, **kwargs})


def make_optimizer(config, *, momentum: bool = True) -> optax.GradientTransformation:
  """The optimizer applied after the exchange, with linear warmup and cosine decay.

  ``config.optimizer`` is ``"adamw"`` or ``"momentum"`` (SGD with Nesterov momentum 0.9
  and decoupled weight decay); the exchanged gradient is first clipped to a global norm
  of ``config.grad_clip`` (0: no clipping). With ``momentum=False`` (after DGC, whose
  exchange carries the Nesterov momentum and clips locally) it is plain SGD with the
  same schedule and weight decay, and no clipping.
  """
  warmup_cosine = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.learning_rate,
    warmup_steps=min(config.warmup_steps, config.num_steps // 2),  # short runs too
    decay_steps=config.num_steps,
  )
  # optax's cosine decay mixes the int32 step count with float constants, which
  # jax_numpy_dtype_promotion="strict" rejects: hand it a float32 count.
  schedule = lambda count: warmup_cosine(jnp.asarray(count, jnp.float32))
  if not momentum:
    return optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(schedule))
  if config.optimizer == "adamw":
    optimizer = optax.adamw(schedule, weight_decay=config.weight_decay)
  elif config.optimizer == "momentum":
    optimizer = optax.chain(
      optax.add_decayed_weights(config.weight_decay),
      optax.sgd(schedule, momentum=0.9, nesterov=True),
    )
  else:
    raise ValueError(f"unknown optimizer {config.optimizer!r}; expected adamw or momentum")
  if config.grad_clip:
    optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip), optimizer)
  return optimizer


def make_tx(
  method: str, config, exchange: optax.GradientTransformation | None = None
) -> optax.GradientTransformation:
  """The exchange (``make_exchange(method, config)`` unless given), then the optimizer.

  Only the exchange's state is per device (error-feedback residuals, device-folded
  keys), so only it is wrapped in ``jc.per_device_state`` (not MIPD's, which is the
  same on every device); the optimizer sees the same
  mean gradient on every device and its state stays replicated, like the parameters.
  ``jc.state_specs`` gives the matching ``shard_map`` specs.
  """
  if method == "sparseloco":  # jc.diloco with SparseLoCo's exchange and outer SGD
    return jc.sparseloco(
      make_optimizer(config),
      sync_every=config.diloco_sync_every,
      axis_name=AXIS,
      density=SPARSELOCO_DENSITY,
    )
  if exchange is None:
    exchange = make_exchange(method, config)
  if method in LOCAL_PARAMS:  # the exchange averages DiLoCo's pseudo-gradients
    return jc.diloco(
      make_optimizer(config),
      optax.sgd(**DILOCO_OUTER),
      sync_every=config.diloco_sync_every,
      axis_name=AXIS,
      exchange=exchange,
    )
  if method in OPTIMIZER_IN_EXCHANGE:
    return exchange
  if method not in REPLICATED_STATE:
    exchange = jc.per_device_state(exchange)
  return optax.chain(exchange, make_optimizer(config, momentum=method not in MOMENTUM_IN_EXCHANGE))


def first_exchange_step(method: str, config) -> int:
  """The first step at which ``method`` runs the exchange whose bytes its row reports.

  DiLoCo's replicas send nothing before their first sync (step ``diloco_sync_every``);
  1-bit Adam's warm-up is a dense all-reduce, its 1-bit stage starts after
  ``freeze_step`` steps; every other exchange runs from step 1 (DGC's warm-up too, at
  a higher density). A run that stops before this step never sent the reported bytes.
  """
  if method in LOCAL_PARAMS:
    return config.diloco_sync_every
  if method == "onebit_adam":  # make_onebit_adam's freeze_step, then one more
    return max(1, round(ONEBIT_ADAM_FREEZE * config.num_steps)) + 1
  return 1


def cross_entropy(model, params, x: jax.Array, y: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of ``model`` on a batch."""
  logits = model.apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(model, tx, mesh, state_specs, *, local_params: bool = False):
  """jit(shard_map(train_step)): params replicated, batch per device, state per specs.

  Returns ``(params, opt_state, losses)`` with each device's loss, shape ``(K,)``: the
  step runs no collective but the exchange's, and the host averages the losses (on a
  high-latency link a ``pmean`` of the loss would cost one more message round per
  step). With ``local_params`` (DiLoCo) the params are per device, one row each.
  """

  def train_step(params, opt_state, batch):
    x, y = jax.tree.map(lambda a: a[0], batch)  # this device's (B, ...) slice
    if local_params:  # this replica's row: it varies over AXIS already
      params = jax.tree.map(lambda a: a[0], params)
    # Differentiate w.r.t. device-varying params: the local gradient. (W.r.t. the
    # replicated params, shard_map's autodiff would psum it: a dense all-reduce.)
    loss, grads = jax.value_and_grad(cross_entropy, argnums=1)(model, jc.vary(params, AXIS), x, y)
    updates, opt_state = tx.update(grads, opt_state, params)  # the gradient exchange
    params = optax.apply_updates(params, updates)
    if local_params:
      params = jax.tree.map(lambda a: a[None], params)
    return params, opt_state, loss[None]

  param_spec = P(AXIS) if local_params else P()
  return jax.jit(
    jax.shard_map(
      train_step,
      mesh=mesh,
      in_specs=(param_spec, state_specs, P(AXIS)),
      out_specs=(param_spec, state_specs, P(AXIS)),
    ),
    donate_argnums=(0, 1),
  )


def compile_train_step(
  model, tx, mesh, state_specs, params, opt_state, config, data, *, local_params: bool = False
):
  """:func:`make_train_step` compiled ahead of time for global batches of ``config``."""
  per_device = jax.NamedSharding(mesh, P(AXIS))
  batch_spec = tuple(
    jax.ShapeDtypeStruct(
      (mesh.size, config.per_device_batch_size, *a.shape[1:]), a.dtype, sharding=per_device
    )
    for a in (data["x"], data["y"])
  )
  return (
    make_train_step(model, tx, mesh, state_specs, local_params=local_params)
    .lower(params, opt_state, batch_spec)
    .compile()
  )


def make_eval_step(model, mesh):
  """jit(shard_map(accuracy)) over a test set split ``(K, n/K, ...)`` with a pad mask."""

  def accuracy(params, x, y, mask):
    x, y, mask = x[0], y[0], mask[0]
    pred = jnp.argmax(model.apply({"params": params}, x), axis=-1)
    correct = jnp.sum((pred == y).astype(jnp.float32) * mask)
    return lax.psum(correct, AXIS) / lax.psum(jnp.sum(mask), AXIS)

  return jax.jit(
    jax.shard_map(accuracy, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=P())
  )


def to_global(tree, sharding: jax.sharding.Sharding):
  """Global arrays of a pytree of host arrays, the same host value in every process.

  Each process puts only the slices of its own (addressable) devices: with ``P()`` every
  device gets the whole leaf, with ``P(AXIS)`` device ``i`` of the mesh gets row ``i``.
  In one process this is ``jax.device_put(tree, sharding)``.
  """
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), tree
  )


#: Host copies of the leaves (of a replicated array, its first local shard).
local_leaves = common.local_leaves
#: sha256 over every leaf's shape, dtype and bytes, in ``jax.tree.leaves`` order.
params_digest = common.params_digest


def local_mean(x: jax.Array) -> float:
  """Mean of this process's shards of a per-device array (waits for it; no collective)."""
  return float(np.mean([np.asarray(s.data) for s in x.addressable_shards]))


def global_means(local: list[float]) -> list[float]:
  """Per entry, the mean over processes of every process's ``local`` (each process has as
  many devices): one host all-gather for the whole list, none in a single process."""
  if jax.process_count() == 1 or not local:
    return list(local)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  gathered = multihost_utils.process_allgather(np.asarray(local, np.float32))
  return [float(v) for v in np.mean(np.reshape(gathered, (-1, len(local))), axis=0)]


def local_copies_identical(params) -> bool:
  """Whether every local device holds the same bytes of every replicated leaf."""
  for leaf in jax.tree.leaves(params):
    shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
    if any(s != shards[0] for s in shards[1:]):
      return False
  return True


# Checkpoints (examples/common.py): Orbax, the whole state, refused when of other settings.
checkpoint_manager = common.checkpoint_manager
checkpoint_dir = common.checkpoint_dir
check_fingerprint = common.check_fingerprint
save_checkpoint = common.save_checkpoint
restore_checkpoint = common.restore_checkpoint


def run_fingerprint(method: str, config, num_devices: int, evaluate: bool) -> dict[str, Any]:
  """What a checkpoint of ``method`` must agree on (:func:`common.run_fingerprint`):
  the method, the device count, whether the run evaluates, and the config."""
  return common.run_fingerprint(method, config, num_devices, evaluate=evaluate)


def train_method(
  method: str,
  config,
  *,
  model,
  init_params,
  data,
  mesh,
  exchange: optax.GradientTransformation | None = None,
  steady_exchange: optax.GradientTransformation | None = None,
  workdir: str | None = None,
  evaluate: bool = True,
  profile: int = 0,
) -> dict[str, Any]:
  """Trains one method from ``init_params``; returns its accuracy, bytes and timings.

  The mesh may span processes (``jax.distributed``): every process then calls this with
  the same arguments, generates the same global batch and puts only its own devices'
  rows on them; losses are averaged over processes on the host.

  ``exchange`` replaces ``make_exchange(method, config)`` (for variants of a method);
  the bytes are those of ``steady_exchange`` when given (e.g. DGC without warm-up).
  With ``config.checkpoint_every`` and a ``workdir``, params, optimizer state and
  progress are checkpointed every that many steps (and at the last) in
  ``workdir/checkpoints/<method>/``, and training resumes from the latest complete
  checkpoint found there, on the batches the uninterrupted run would have drawn, so the
  final parameters are bit-identical to an uninterrupted run's. A checkpoint of other
  settings (config, device count) is refused with ValueError. With ``evaluate``
  (default) the test accuracy is measured every ``config.eval_every`` steps and at the
  last; with ``profile > 0`` that many more steps are run after everything else and
  split by phase (:func:`jaxcomp.profile_phases`).

  Returns:
    ``start_step`` (the checkpoint's step it resumed from, else 0), ``test_accuracy``
    and ``history`` (None without ``evaluate``), ``losses`` (mean over devices, every
    step since step 1), ``step_times_s`` (the steps run now: batch to loss on the host,
    one step in flight), ``train_time_s``, ``compile_time_s``, ``params_sha256`` and
    ``params_checksum`` of the final parameters, ``local_copies_identical``,
    ``params_change_l2`` and ``layer_change`` (from init), ``overflow_steps``, the wire
    report's bytes and ``phases`` (None without ``profile``); ``nonfinite_step``, the
    step where the run went non-finite (:class:`common.Divergence`: the training loss
    is watched every step, the parameters at each evaluation and at the end; None while
    finite) and ``diverged``; ``first_exchange_step`` (:func:`first_exchange_step`) and
    ``exchanged``, whether the run reached it.
  """
  k = mesh.size
  tx = make_tx(method, config, exchange)
  local = method in LOCAL_PARAMS  # DiLoCo: params per device, evaluated at the anchor
  shared = lambda params, opt_state: opt_state.anchor if local else params
  replicated = jax.NamedSharding(mesh, P())
  per_device = jax.NamedSharding(mesh, P(AXIS))

  state_specs = jc.state_specs(tx, init_params, axis_name=AXIS, num_devices=k)
  checkpoints = checkpoint_manager(config, workdir, method)
  fingerprint = run_fingerprint(method, config, k, evaluate)
  start_step, history, losses = 0, None, []
  divergence = common.Divergence()
  if checkpoints is not None and checkpoints.latest_step() is not None:
    start_step, params, opt_state, progress = restore_checkpoint(
      checkpoints, tx, init_params, mesh=mesh, state_specs=state_specs, local_params=local
    )
    where = f"{checkpoints.directory}/{start_step}"
    check_fingerprint(progress.get("run"), fingerprint, where)
    if progress["step"] != start_step or len(progress["losses"]) != start_step:
      raise ValueError(
        f"the checkpoint in {where} is inconsistent: it records step {progress['step']}"
      )
    history, losses = progress["history"], progress["losses"]
    divergence = common.Divergence(**progress.get("divergence", {}))
    print(f"{method}: resuming from step {start_step} ({where})", flush=True)
  else:
    params = to_global(init_params, replicated)
    opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs))(
      params
    )
    if local:  # one row per replica
      params = to_global(
        jax.tree.map(lambda p: np.broadcast_to(p, (k, *p.shape)), init_params), per_device
      )
  batches = input_pipeline.train_batches(
    data["x"],
    data["y"],
    num_devices=k,
    per_device_batch_size=config.per_device_batch_size,
    seed=config.seed,
    start_step=start_step,
  )

  # Compile ahead of time, so that the training time below excludes compilation.
  start = time.perf_counter()
  step = compile_train_step(
    model, tx, mesh, state_specs, params, opt_state, config, data, local_params=local
  )
  if evaluate:
    test = to_global(input_pipeline.eval_shards(data["x_test"], data["y_test"], k), per_device)
    compiled = make_eval_step(model, mesh).lower(shared(params, opt_state), *test).compile()
    accuracy = lambda params: float(compiled(params, *test).addressable_data(0))
  compile_time = time.perf_counter() - start

  if history is None and evaluate:
    history = {
      "step": [0],
      "test_accuracy": [accuracy(shared(params, opt_state))],
      "train_loss": [float("nan")],
    }
  pending = []  # this process's loss of each step not yet averaged over the processes

  def flush():  # the same steps in every process: a collective when multi-process
    for loss in global_means(pending):
      losses.append(loss)
      divergence.loss(len(losses), loss)  # losses[j] is step j + 1's
    pending.clear()

  # Every process checks at the same steps: the check is a reduction over the mesh.
  def params_finite(params, opt_state) -> bool:
    return common.all_finite((params, opt_state.anchor) if local else params)

  step_times = []
  with tqdm(
    total=config.num_steps,
    initial=min(start_step, config.num_steps),
    desc=f"{method:>6}",
    unit="step",
    disable=jax.process_index() != 0 or None,  # None: off unless on a terminal
  ) as bar:
    for i in range(start_step + 1, config.num_steps + 1):
      start = time.perf_counter()
      batch = to_global(next(batches), per_device)
      params, opt_state, loss = step(params, opt_state, batch)
      # Wait for the step: one step in flight at a time. (With more virtual CPU devices
      # than cores, queued multi-device steps can deadlock XLA's CPU collectives: a
      # rendezvous times out before every device arrives.)
      pending.append(local_mean(loss))
      step_times.append(time.perf_counter() - start)
      bar.update()
      evaluating = evaluate and (i % config.eval_every == 0 or i == config.num_steps)
      saving = checkpoints is not None and (
        i % config.checkpoint_every == 0 or i == config.num_steps
      )
      if evaluating or saving:
        flush()
      if evaluating:
        divergence.check(i, params_finite(params, opt_state))
        acc = accuracy(shared(params, opt_state))
        history["train_loss"].append(float(np.mean(losses[history["step"][-1] :])))
        history["step"].append(i)
        history["test_accuracy"].append(acc)
        bar.set_postfix(loss=f"{history['train_loss'][-1]:.3f}", test_acc=f"{acc:.1%}")
      if saving:
        progress = {
          "step": i,
          "losses": losses,
          "history": history,
          "divergence": divergence.state(),
          "run": fingerprint,
        }
        save_checkpoint(checkpoints, i, params, opt_state, progress)
  flush()
  divergence.check(config.num_steps, params_finite(params, opt_state))
  if checkpoints is not None:
    checkpoints.wait_until_finished()  # the last save is written before we return
    checkpoints.close()

  final = local_leaves(shared(params, opt_state))
  change = np.sqrt(
    sum(
      np.sum((f.astype(np.float64) - np.asarray(i, np.float64)) ** 2)
      for f, i in zip(final, jax.tree.leaves(init_params))
    )
  )
  record = {
    "start_step": start_step,
    "overflow_steps": overflow_steps(opt_state, mesh),
    "test_accuracy": history["test_accuracy"][-1] if evaluate else None,
    "losses": losses,
    "step_times_s": step_times,
    "train_time_s": float(sum(step_times)),
    "compile_time_s": compile_time,
    "history": history,
    "params_sha256": params_digest(shared(params, opt_state)),
    "params_checksum": float(sum(np.sum(f, dtype=np.float64) for f in final)),
    "local_copies_identical": local_copies_identical(shared(params, opt_state)),
    "params_change_l2": float(change),
    "layer_change": layer_change(init_params, final),
    "phases": None,
    "nonfinite_step": divergence.step,
    "diverged": divergence.diverged,
    "first_exchange_step": first_exchange_step(method, config),
    "exchanged": config.num_steps >= first_exchange_step(method, config),
  }
  if profile:
    record["phases"] = profile_steps(
      step, params, opt_state, to_global(next(batches), per_device), profile
    )

  if steady_exchange is None and exchange is None and method == "dgc":
    # Report DGC's steady state; its warm-up stages send more.
    steady_exchange = make_exchange(method, config, warmup=False)
  if steady_exchange is None and exchange is None and method in OPTIMIZER_IN_EXCHANGE:
    # 1-bit Adam's compression stage; its warm-up is a dense all-reduce.
    steady_exchange = make_exchange(method, config, warmup=False)
  if steady_exchange is not None:
    tx = make_tx(method, config, steady_exchange)
  report = wire_report(tx, init_params, k)
  record.update(
    {
      "bytes_received": None if report is None else report.bytes_received,
      "dense_bytes": None if report is None else report.dense_bytes,
      "ratio": None if report is None else report.ratio,
      "wire_report": None if report is None else str(report),
    }
  )
  return record


def profile_steps(step, params, opt_state, batch, calls: int) -> dict[str, Any]:
  """``calls`` more steps on ``batch``, split by phase (:func:`jaxcomp.profile_phases`):
  ms per step in gradient, encode, exchange, decode, update and idle, on this process's
  devices, and the top ops of each phase."""
  carry = [params, opt_state]

  def run():  # the step donates its state: carry it from call to call
    carry[0], carry[1], loss = step(carry[0], carry[1], batch)
    return loss

  prof = jc.profile_phases(run, step, calls=calls)
  return {
    "step_ms": 1e3 * prof.step_s,
    "calls": prof.calls,
    "untraced": list(prof.untraced),
    **{p: 1e3 * t for p, t in prof.phases.items()},
    "top_ops_ms": {p: [[n, 1e3 * t] for n, t in ops] for p, ops in prof.top_ops.items()},
  }


def layer_change(before, after) -> dict[str, float]:
  """``||after - before|| / ||before||`` per parameter, keyed by its path (NaN where
  ``before`` is all zeros, e.g. biases at init: no relative change is defined)."""
  out = {}
  for (path, b), a in zip(
    jax.tree_util.tree_flatten_with_path(before)[0], jax.tree_util.tree_leaves(after)
  ):
    b, a = np.asarray(b, np.float64), np.asarray(a, np.float64)
    norm = np.linalg.norm(b)
    out[jax.tree_util.keystr(path)] = (
      float(np.linalg.norm(a - b) / norm) if norm else (float("nan"))
    )
  return out


def overflow_steps(opt_state, mesh=None) -> int | None:
  """Most steps any device took the exchange's overflow path (``overflow_count``), or
  None. With ``mesh``, the counts may be per device on devices of every process: their
  maximum is then a jitted reduction, which every process must call."""
  counts = []

  def visit(x):
    if hasattr(x, "overflow_count"):
      counts.append(x.overflow_count)
    return x

  jax.tree.map(visit, opt_state, is_leaf=lambda x: hasattr(x, "overflow_count"))
  if not counts:
    return None
  if mesh is None:
    return max(int(np.max(np.asarray(c))) for c in counts)
  top = jax.jit(
    lambda cs: jnp.max(jnp.stack([jnp.max(c) for c in cs])),
    out_shardings=jax.NamedSharding(mesh, P()),
  )(counts)
  return int(top.addressable_data(0))


def wire_report(tx, params, num_devices: int) -> jc.WireReport | None:
  """jaxcomp's byte count of ``tx``'s exchange on ``num_devices`` devices (None if 1)."""
  if num_devices < 2:
    return None
  return jc.wire_report(tx, params, axis_name=AXIS, num_devices=num_devices)


def results_table(results: dict[str, dict[str, Any]], num_devices: int) -> str:
  """A Markdown table of the results, one row per method; a diverged method's accuracy
  reads ``diverged at step N`` (that of a non-finite model means nothing), and the
  bytes of one that never reached its exchange ``none sent`` (:func:`common.bytes_cells`)."""
  lines = [
    f"MNIST-1D, {num_devices} devices. Bytes: jc.wire_report, received per device per"
    " step. Train time: wall time of the training steps only (compiled ahead of time,"
    " listed apart; evaluation excluded).",
    "",
    "| method | test acc (%) | bytes recv/device/step | ratio vs dense |"
    " train time (s, excl. compile) | compile (s) |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for method, r in results.items():
    recv, ratio = common.bytes_cells(r)
    acc = f"{100 * r['test_accuracy']:.1f}"
    if r.get("diverged"):
      acc = common.diverged_note(r["nonfinite_step"])
    lines.append(
      f"| {method} | {acc} | {recv} | {ratio} |"
      f" {r['train_time_s']:.1f} | {r['compile_time_s']:.1f} |"
    )
  return "\n".join(lines)


def plot_label(method: str, r: dict[str, Any]) -> str:
  """A method's legend entry: its name, and ``(diverged at step N)`` if it did."""
  if r.get("diverged"):
    return f"{method} ({common.diverged_note(r['nonfinite_step'])})"
  return method


def plot_accuracy(results: dict[str, dict[str, Any]], path: str):
  """Saves test accuracy vs step, one line per method (Agg canvas, no pyplot state);
  a diverged method's line is dashed, its legend entry says where (:func:`plot_label`).
  Returns the figure."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(6, 4), dpi=120)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  for method, r in results.items():
    h = r["history"]
    ax.plot(
      h["step"],
      [100 * a for a in h["test_accuracy"]],
      marker=".",
      linestyle="--" if r.get("diverged") else "-",
      label=plot_label(method, r),
    )
  ax.set_xlabel("step")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title("MNIST-1D: dense vs compressed gradient exchange")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  return fig


def setup(config, workdir: str):
  """(mesh over all devices, data set, model, host copy of the initial params)."""
  os.makedirs(workdir, exist_ok=True)
  k = jax.device_count()
  mesh = common.data_mesh(AXIS)
  data = input_pipeline.load_dataset(config, workdir)
  model = models.create_model(config)
  # Host copy: every method starts from it (the train step donates its device buffers).
  init_params = jax.device_get(
    jax.jit(model.init)(jax.random.key(config.seed), data["x"][:1])["params"]
  )
  num_params = sum(p.size for p in jax.tree.leaves(init_params))
  print(
    f"{k} devices ({jax.devices()[0].platform}), {num_params:,} parameters, "
    f"{len(data['x'])} train / {len(data['x_test'])} test examples, global batch "
    f"{k * config.per_device_batch_size}, {config.num_steps} steps"
  )
  return mesh, data, model, init_params


def train_and_evaluate(config, workdir: str) -> dict[str, dict[str, Any]]:
  """Trains every method in ``config.methods`` and writes the results to ``workdir``.

  Writes ``results.md`` (the table), ``results.json`` (everything, histories included)
  and ``accuracy.png`` (test accuracy vs step). A method that went non-finite is marked
  in all three (``diverged``, ``nonfinite_step``); ``main`` then exits non-zero.

  Args:
    config: a :class:`examples.mnist1d.configs.default.Config`.
    workdir: output directory (also caches the generated data set, and holds the
      checkpoints with ``config.checkpoint_every``).

  Returns:
    ``{method: {"start_step", "test_accuracy", "bytes_received", "dense_bytes", "ratio",
    "train_time_s", "compile_time_s", "history", "wire_report", "layer_change"}}``
    (``start_step``: the checkpoint's step the method resumed from, else 0).
  """
  mesh, data, model, init_params = setup(config, workdir)
  k = mesh.size
  results = {}
  for method in config.methods:
    results[method] = train_method(
      method, config, model=model, init_params=init_params, data=data, mesh=mesh, workdir=workdir
    )

  common.write_results(
    workdir,
    results_table(results, k),
    {"config": dataclasses.asdict(config), "num_devices": k, "results": results},
  )
  plot_accuracy(results, os.path.join(workdir, "accuracy.png"))
  return results
