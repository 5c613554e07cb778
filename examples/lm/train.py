"""Data-parallel training of a byte-level transformer LM with a jaxcomp gradient exchange.

Each method trains the same ``flax.nnx`` transformer (``models.py``) from the same
initialisation on the same batches; only the gradient exchange, the first transform of
the optax chain, differs::

  tx = multi_steps(skip_nonfinite(chain(per_device_state(exchange), clip, adamw)), k)

* **Mixed precision.** The parameters are float32 master weights; the model casts them
  to ``config.compute_dtype`` (bfloat16) for its matmuls, so gradients, the exchange
  and AdamW run in float32.
* **Functional NNX.** ``nnx.split`` gives a graphdef and the parameters as a plain
  dict; the loss merges them back while tracing. Params and optimizer state are then
  pytrees that ``jax.shard_map``, optax and Orbax take as they are.
* **Data parallelism.** ``jax.shard_map`` over every device of every process (one mesh
  axis, ``"batch"``); the gradient is taken w.r.t. ``jc.vary(params, AXIS)`` so it
  stays local (w.r.t. the replicated params it would arrive ``psum``'d: a dense
  all-reduce). Each process builds only its own devices' rows of the batch
  (``jax.make_array_from_callback``), so the same code runs as one process or as
  several under ``jax.distributed``.
* **Accumulation and NaN guard.** ``jc.multi_steps`` runs the exchange and AdamW once
  per ``accumulation_steps`` mini-steps; ``jc.skip_nonfinite`` inside it drops an
  update whose gradient is non-finite on any device, on every device alike.
* **Checkpoints.** Orbax saves params, optimizer state (typed keys unwrapped) and the
  progress; the data position is the mini-step counter (``input_pipeline``), so a
  resumed run draws the batches the uninterrupted one would have, and ends with the
  same bits.

* **Sharded methods** (``sharded.py``, :data:`SHARDED_METHODS`): ZeRO-2 and per-layer
  FSDP, the parameters and AdamW's moments cut over ``AXIS``; the step takes the
  shards and returns them, and evaluation sees them gathered.

What each method needs on a transformer is in :func:`make_exchange` (and
docs/guides/lm.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any
from typing import NamedTuple

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from tqdm.auto import tqdm

from examples import common
from examples.lm import input_pipeline
from examples.lm import models
from examples.lm import sharded
from examples.lm.configs import default as default_config
import jaxcomp as jc

AXIS = "batch"

# The methods, in table order: the default config's list (one place).
METHODS = default_config.Config.methods

# Sharded methods (examples/lm/sharded.py: ZeRO-2 and per-layer FSDP, dense or
# compressed), chosen with --methods; not in the default list.
SHARDED_METHODS = sharded.METHODS
# The low-communication methods (docs/guides/lm.md, "Over a slow link"): SparseLoCo and
# DeMo, chosen with --methods; not in the default list.
FRONTIER_METHODS = ("sparseloco", "demo")
ALL_METHODS = METHODS + SHARDED_METHODS + FRONTIER_METHODS

# 1-bit Adam is the whole optimizer (it exchanges Adam's step direction): no AdamW after
# it, and it places its own per-device buffers (not wrapped in jc.per_device_state).
OPTIMIZER_IN_EXCHANGE = ("onebit_adam", "demo")

# DiLoCo (jc.diloco): each replica runs make_optimizer (clip, AdamW) on its own gradients
# for config.diloco_sync_every updates, then the pseudo-gradients are averaged (densely,
# or as 4-bit QSGD) and the paper's outer Nesterov SGD steps the shared parameters. The
# replicas drift apart between syncs, so their params are held per device (one row
# each, P(AXIS)); evaluation and the returned params are the anchor (the shared model).
LOCAL_PARAMS = ("diloco", "diloco_qsgd4", "sparseloco")

# 1-bit codes whose first config.sign_warmup of the updates exchange the dense mean.
SIGN_METHODS = ("onebit", "ef_signsgd")


def schedule(config, peak: float | None = None) -> optax.Schedule:
  """Linear warm-up to ``peak`` (default ``config.learning_rate``), then cosine decay to
  0 at the last update (a float32 count: strict dtype promotion rejects optax's
  int/float mix)."""
  warmup_cosine = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.learning_rate if peak is None else peak,
    warmup_steps=min(config.warmup_steps, config.num_steps // 2),
    decay_steps=config.num_steps,
  )
  return lambda count: warmup_cosine(jnp.asarray(count, jnp.float32))


def pmean_gradients(axis_name: str) -> optax.GradientTransformation:
  """The dense baseline: the float32 mean of every gradient leaf, no state.

  One all-reduce of all leaves in one buffer (``jc.pmean_tree``), as data-parallel
  frameworks bucket gradients: a ``pmean`` per leaf would pay one message round per
  leaf, which on gloo costs more than this small model's bytes.
  """

  return jc.dense_mean(axis_name=axis_name)


def make_exchange(method: str, config, *, warmup: bool = True) -> optax.GradientTransformation:
  """The gradient exchange of ``method`` (the mean gradient over ``AXIS``).

  As the MNIST-1D demo builds them, with what a transformer under AdamW needs:

  * ``qsgd4`` / ``qsgd2``: unbiased stochastic quantization, no error feedback (4 bits
    in buckets of ``config.qsgd_bucket_size``, 128; 2 bits in buckets of 128): smaller
    buckets than ``jc.qsgd``'s 512, because the variance bound grows with the bucket and
    AdamW passes the noise on (``config.qsgd_error_feedback``: with a residual).
  * ``onebit`` / ``ef_signsgd``: biased 1-bit codes with error feedback, chained before
    AdamW like the others. Adam divides by ``sqrt(v)``; the quantized gradients
    (bucket means of each sign) distort ``v``, which is why 1-bit SGD was meant for
    SGD, and 1-bit Adam exists. With ``config.sign_warmup`` their first updates
    exchange the dense mean (:func:`dense_warmup`).
  * ``powersgd``: rank ``config.powersgd_rank`` (the attention and MLP kernels are
    wide matrices, rank 4 as in the paper's language-model runs); embedding, norms
    and biases below its compression threshold go dense.
  * ``dgc``: top-``config.dgc_density`` sparsification with error accumulation and the
    density warm-up, but **momentum 0**: DGC's momentum correction exists to feed plain
    SGD, and here AdamW after it keeps its own moments; no local clipping (AdamW's
    clip follows the exchange).
  * ``onebit_adam``: the whole optimizer (:func:`make_onebit_adam`).
  * ``diloco`` / ``diloco_qsgd4``: the exchange of DiLoCo's pseudo-gradients (the dense
    mean, or 4-bit QSGD as ``qsgd4``); :func:`make_update` wraps it in ``jc.diloco``.
  * ``demo``: DeMo (``jc.decoupled_momentum``), the whole optimizer: the sign of the
    exchanged fast DCT components of each device's momentum, at AdamW's schedule
    shape and weight decay, peaking at ``config.demo_learning_rate`` (no clipping: a
    sign step is bounded).
  * ``sparseloco``: not an exchange of its own; :func:`make_update` builds
    ``jc.sparseloco`` (DiLoCo with chunked top-k, 2-bit values, decaying error feedback).

  ``warmup=False`` gives the steady state (DGC without its density warm-up, 1-bit
  Adam's compression stage, the sign codes without their dense warm-up), for byte
  counts.
  """
  if method in ("dense", "diloco"):
    return pmean_gradients(AXIS)
  if method in ("qsgd4", "diloco_qsgd4"):
    feedback = config.qsgd_error_feedback and method == "qsgd4"
    tx = jc.qsgd(
      bits=4,
      bucket_size=config.qsgd_bucket_size,
      error_feedback=feedback,
      axis_name=AXIS,
      collective="auto",
    )
    return jc.per_device_state(tx) if feedback else tx
  if method == "qsgd2":
    return jc.qsgd(bits=2, bucket_size=128, axis_name=AXIS, collective="auto")
  if method in SIGN_METHODS:
    codes = jc.onebit_sgd if method == "onebit" else jc.ef_signsgd
    steps = sign_warmup_steps(config) if warmup else 0
    return dense_warmup(jc.per_device_state(codes(axis_name=AXIS)), steps)
  if method == "powersgd":
    return jc.powersgd(config.powersgd_rank, axis_name=AXIS)
  if method == "dgc":
    warmup_steps = min(config.warmup_steps, config.num_steps // 2) if warmup else 0
    # The paper's all-gather, as docs/guides/lm.md measured it ("auto" chunks the
    # large leaves at K = 8: CSC's selection, another method).
    return jc.dgc(
      config.dgc_density, 0.0, warmup_steps=warmup_steps, axis_name=AXIS, collective="allgather"
    )
  if method == "onebit_adam":
    return make_onebit_adam(config, warmup=warmup)
  if method == "demo":
    return standard_promotion(
      jc.decoupled_momentum(
        schedule(config, config.demo_learning_rate or config.learning_rate),
        axis_name=AXIS,
        chunk_size=config.demo_chunk_size,
        topk=config.demo_topk,
        momentum_decay=config.demo_momentum_decay,
        weight_decay=config.weight_decay,
      )
    )
  raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def sign_warmup_steps(config) -> int:
  """The updates whose exchange is the dense mean before the sign codes start
  (``config.sign_warmup`` of them, :func:`dense_warmup`)."""
  return round(config.sign_warmup * config.num_steps)


def onebit_adam_freeze_step(config) -> int:
  """1-bit Adam's full-precision warm-up, ``config.onebit_adam_freeze`` of the updates
  (at least one)."""
  return max(1, round(config.onebit_adam_freeze * config.num_steps))


def first_exchange_step(method: str, config) -> int:
  """The first update at which ``method`` runs the exchange whose bytes its row reports
  (the steady state's, :func:`make_exchange` with ``warmup=False``).

  DiLoCo's replicas send nothing before their first sync (update
  ``diloco_sync_every``); the sign codes and 1-bit Adam exchange the dense mean during
  their warm-ups; every other exchange runs from update 1 (DGC's warm-up too, at a
  higher density). A run that stops before this update never sent the reported bytes.
  """
  if method in LOCAL_PARAMS:
    return config.diloco_sync_every
  if method in SIGN_METHODS:
    return sign_warmup_steps(config) + 1
  if method == "onebit_adam":
    return onebit_adam_freeze_step(config) + 1
  return 1


class DenseWarmupState(NamedTuple):
  """State of :func:`dense_warmup`: the update count (replicated) and the exchange's."""

  count: jax.Array  # shape=(), dtype=int32
  inner_state: Any


def dense_warmup(
  exchange: optax.GradientTransformation, steps: int
) -> optax.GradientTransformation:
  """The dense mean for the first ``steps`` updates, then ``exchange``.

  A biased 1-bit code chained before AdamW feeds Adam's second moment ``v`` with the
  codes' magnitudes (bucket means) instead of the gradient's coordinates, and its error
  feedback starts from the large, fast-changing gradients of the first updates. Dense
  updates first let Adam's moments form on the true mean gradient; the exchange's state
  (error feedback) starts when it does. Both branches run collectives, so the count that
  picks one is replicated (``exchange`` is given already per device). ``steps=0``:
  ``exchange`` itself.
  """
  if steps <= 0:
    return exchange
  dense = pmean_gradients(AXIS)

  def init_fn(params):
    return DenseWarmupState(jnp.zeros((), jnp.int32), exchange.init(params))

  def update_fn(updates, state, params=None):
    def warm(inner):
      return dense.update(updates, optax.EmptyState())[0], inner

    def compressed(inner):
      return exchange.update(updates, inner, params)

    out, inner = lax.cond(state.count < steps, warm, compressed, state.inner_state)
    return out, DenseWarmupState(state.count + 1, inner)

  return optax.GradientTransformation(init_fn, update_fn)


def make_onebit_adam(config, *, warmup: bool = True) -> optax.GradientTransformation:
  """1-bit Adam with AdamW's schedule, ``b2`` and decoupled weight decay.

  The first ``config.onebit_adam_freeze`` of the updates are the full-precision
  warm-up (the paper's 15-25%), after which ``v`` is frozen and the step direction
  ``m / sqrt(v)`` crosses the wire at 1 bit (``compress="preconditioned"``), held to
  Adam's momentum bound (``jc.onebit_adam``'s default). No clipping: the gradient stays
  local. ``warmup=False``: the compression stage from the first update (for byte
  counts).
  """
  freeze = onebit_adam_freeze_step(config) if warmup else 0
  return jc.onebit_adam(
    schedule(config),
    freeze_step=freeze,
    b2=config.b2,
    weight_decay=config.weight_decay,
    compress="preconditioned",
    axis_name=AXIS,
  )


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` traced under standard dtype promotion.

  optax's Adam bias correction raises a float decay to the int32 step count, which
  ``jax_numpy_dtype_promotion="strict"`` (the tests' setting) rejects; the result is
  float32 either way.
  """

  def update_fn(updates, state, params=None):
    with jax.numpy_dtype_promotion("standard"):
      return tx.update(updates, state, params)

  return optax.GradientTransformation(tx.init, update_fn)


def make_optimizer(config, *, clip: bool = True) -> optax.GradientTransformation:
  """AdamW after the exchange: global-norm clipping of the mean gradient (unless
  ``grad_clip`` is 0 or ``clip`` is False), then ``optax.adamw`` with :func:`schedule`."""
  adamw = optax.adamw(schedule(config), b2=config.b2, weight_decay=config.weight_decay)
  if config.grad_clip and clip:
    adamw = optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return standard_promotion(adamw)


def make_update(method: str, config, *, warmup: bool = True) -> optax.GradientTransformation:
  """One update: the exchange (its state per device) and the optimizer after it; for
  DiLoCo, ``jc.diloco`` with the optimizer inside and the exchange at the syncs."""
  if method == "sparseloco":  # jc.diloco with SparseLoCo's exchange and outer SGD
    return jc.sparseloco(
      make_optimizer(config),
      sync_every=config.diloco_sync_every,
      axis_name=AXIS,
      density=config.sparseloco_density,
      bits=config.sparseloco_bits,
      chunk_size=config.sparseloco_chunk_size,
      decay=config.sparseloco_decay,
      outer_learning_rate=config.sparseloco_outer_lr,
    )
  exchange = make_exchange(method, config, warmup=warmup)
  if method in LOCAL_PARAMS:
    outer = optax.sgd(config.diloco_outer_lr, momentum=config.diloco_outer_momentum, nesterov=True)
    return jc.diloco(
      make_optimizer(config),
      outer,
      sync_every=config.diloco_sync_every,
      axis_name=AXIS,
      exchange=exchange,
    )
  if method in OPTIMIZER_IN_EXCHANGE:
    return exchange
  if method not in SIGN_METHODS:  # dense_warmup places their state itself
    exchange = jc.per_device_state(exchange)
  return optax.chain(exchange, make_optimizer(config))


def make_tx(method: str, config) -> optax.GradientTransformation:
  """:func:`make_update` guarded by ``jc.skip_nonfinite``, accumulated over
  ``config.accumulation_steps`` mini-steps by ``jc.multi_steps`` (when above 1)."""
  if config.accumulation_steps < 1:
    raise ValueError(f"accumulation_steps must be >= 1, got {config.accumulation_steps}")
  tx = jc.skip_nonfinite(make_update(method, config), axis_name=AXIS)
  if config.accumulation_steps > 1:
    tx = jc.multi_steps(tx, config.accumulation_steps)
  return tx


def cross_entropy(graphdef, params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of next-byte cross-entropies in nats, number of predictions) on windows
  ``(batch, seq_len + 1)``."""
  model = nnx.merge(graphdef, params)
  tokens = tokens.astype(jnp.int32)
  logits = model(tokens[:, :-1])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return jnp.sum(losses), jnp.float32(losses.size)


def make_train_step(graphdef, tx, mesh, state_specs, *, local_params: bool = False):
  """jit(shard_map(train_step)): params replicated, batch per device, state per specs.

  Returns ``(params, opt_state, losses)`` with each device's mean loss, shape ``(K,)``
  (no collective but the exchange's). With ``local_params`` (DiLoCo) the params are
  per device, one row each.
  """

  def loss_fn(params, tokens):
    total, count = cross_entropy(graphdef, params, tokens)
    return total / count

  def train_step(params, opt_state, batch):
    if local_params:  # this replica's row: it varies over AXIS already
      params = jax.tree.map(lambda a: a[0], params)
    loss, grads = jax.value_and_grad(loss_fn)(jc.vary(params, AXIS), batch[0])
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


def make_eval_step(graphdef, mesh):
  """jit(shard_map(mean cross-entropy in nats)) over windows ``(K, n, seq_len + 1)``."""

  def evaluate(params, tokens):
    total, count = cross_entropy(graphdef, params, tokens[0])
    return lax.psum(total, AXIS) / lax.psum(count, AXIS)

  return jax.jit(jax.shard_map(evaluate, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))


def global_rows(shape, sharding, rows_fn) -> jax.Array:
  """A ``(K, ...)`` array over the mesh whose row block ``i`` is ``rows_fn(slice)``:
  each process computes only the rows of its own devices."""
  return jax.make_array_from_callback(
    shape, sharding, lambda index: rows_fn(index[0] if index else slice(None))
  )


def replicate(tree, mesh):
  """Host arrays -> global arrays replicated on every device of every process."""
  replicated = jax.NamedSharding(mesh, P())
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(np.shape(x), replicated, lambda i: np.asarray(x)[i]),
    tree,
  )


def scalar(x: jax.Array) -> float:
  """A replicated scalar as a float (read from this process's first shard)."""
  return float(np.asarray(x.addressable_data(0)))


def diloco_anchor(opt_state):
  """The anchor (the shared parameters at the last sync) of the ``jc.diloco`` state
  inside ``opt_state``."""
  is_diloco = lambda x: isinstance(x, jc.DiLoCoState)
  states = [x for x in jax.tree.leaves(opt_state, is_leaf=is_diloco) if is_diloco(x)]
  if len(states) != 1:
    raise ValueError(f"expected one jc.diloco state in opt_state, found {len(states)}")
  return states[0].anchor


def per_device_rows(tree, mesh):
  """Host arrays -> global ``(K, ...)`` arrays with the same row on every device (the
  replicas' starting params, one row each)."""
  k, rows = mesh.size, jax.NamedSharding(mesh, P(AXIS))
  return jax.tree.map(
    lambda x: global_rows(
      (k, *np.shape(x)), rows, lambda r: np.broadcast_to(x, (k, *np.shape(x)))[r]
    ),
    tree,
  )


def sharded_parts(method: str, config, graphdef, init_params, mesh):
  """``(tx, state_specs, shards, opt_state, step)`` of a sharded method
  (``examples/lm/sharded.py``): every parameter leaf and AdamW's moments cut along
  their first axis over ``AXIS``; ``step(shards, opt_state, batch, mini_step)``."""
  k = mesh.size
  specs = sharded.param_specs(init_params, k)
  tx = sharded.make_tx(method, config, specs, make_optimizer(config, clip=False))
  opt_specs = sharded.state_specs(tx, init_params, specs, k)
  shards = jax.tree.map(
    lambda x, spec: jax.make_array_from_callback(
      np.shape(x), jax.NamedSharding(mesh, spec), lambda i: np.asarray(x)[i]
    ),
    init_params,
    specs,
  )
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=opt_specs)
  opt_state = jax.jit(init)(shards)
  step = sharded.make_train_step(method, graphdef, tx, mesh, specs, opt_specs, config.seed)
  return tx, opt_specs, shards, opt_state, step


def peak_memory(compiled) -> int | None:
  """Peak bytes per device of a compiled step, from ``compiled.memory_analysis()``:
  arguments + outputs + temporaries - aliased (donated) buffers; None where the
  backend gives no analysis."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return int(
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )


def local_mean(x: jax.Array) -> float:
  """Mean of this process's shards of a per-device array."""
  return float(np.mean([np.asarray(s.data) for s in x.addressable_shards]))


# Checkpoints (examples/common.py): Orbax, the whole state, every process its own rows.
checkpoint_manager = common.checkpoint_manager
save_checkpoint = common.save_checkpoint
restore_checkpoint = common.restore_checkpoint


def count_in_state(opt_state, field: str) -> int | None:
  """The largest ``field`` counter (e.g. ``notfinite_count``) in the state, or None."""
  found = []

  def visit(x):
    if hasattr(x, field):
      value = getattr(x, field)
      found.append(int(np.max([np.asarray(s.data) for s in value.addressable_shards])))
    return x

  jax.tree.map(visit, opt_state, is_leaf=lambda x: hasattr(x, field))
  return max(found) if found else None


def train_method(
  method: str,
  config,
  *,
  graphdef,
  init_params,
  corpus,
  mesh,
  workdir: str | None = None,
  stop_at: int | None = None,
  eval_step=None,
) -> dict[str, Any]:
  """Trains one method from ``init_params``; returns its losses, bytes and timings.

  Args:
    method: one of :data:`ALL_METHODS`.
    config: an ``examples.lm.configs`` config.
    graphdef: the model's ``nnx`` graphdef.
    init_params: host copy of the initial parameters (a dict of arrays).
    corpus: :func:`input_pipeline.load_corpus`'s dict.
    mesh: the 1-D data-parallel mesh over every device.
    workdir: checkpoint root (with ``config.checkpoint_every``).
    stop_at: stop after this update, as an interrupted run would (for resume tests).
    eval_step: :func:`make_eval_step`'s function, to share between methods: every
      method evaluates the same model on the same windows, so one compiled evaluation
      serves them all (``jax.jit`` keeps it). None: a new one.

  Returns:
    ``{"val_loss", "bits_per_byte", "bytes_received", "dense_bytes", "ratio",
    "bytes_by_collective", "peak_bytes", "train_time_s", "compile_time_s", "history",
    "target_step", "target_time_s", "skipped_steps", "start_step", "nonfinite_step",
    "diverged", "first_exchange_step", "exchanged"}``. ``bytes_received``
    is per device per update: the exchange's (``jc.wire_report``), or for a sharded
    method the whole step's, weight gathers included (``sharded.step_traffic``, split
    by collective in ``bytes_by_collective``); ``ratio`` is the dense data-parallel
    all-reduce's bytes (``dense_bytes``) over it. ``peak_bytes``: the compiled step's
    peak memory per device (:func:`peak_memory`). ``history`` has ``step``, ``val_loss``,
    ``train_loss`` (this process's devices, mean since the last evaluation) and
    ``time_s`` (training time so far, evaluation and compilation excluded).
    ``nonfinite_step``: the update where the run went non-finite, None while finite
    (:class:`common.Divergence`: the training losses every update, the parameters and
    the validation loss at each evaluation and at the end; an update the NaN guard
    skipped, after which the parameters stay finite, is no divergence but counts in
    ``skipped_steps``). ``exchanged``: whether the run reached
    ``first_exchange_step`` (:func:`first_exchange_step`), so sent the bytes reported.
  """
  k = mesh.size
  acc = config.accumulation_steps
  local = method in LOCAL_PARAMS  # DiLoCo: params per device, evaluated at the anchor
  is_sharded = method in SHARDED_METHODS  # params and AdamW state cut over AXIS
  replicated = jax.NamedSharding(mesh, P())
  whole = jax.jit(lambda tree: tree, out_shardings=replicated)  # the shards gathered
  if is_sharded:
    if config.checkpoint_every:
      raise ValueError(f"{method}: --checkpoint-every is not supported by the sharded methods")
    tx, state_specs, params, opt_state, sharded_step = sharded_parts(
      method, config, graphdef, init_params, mesh
    )
    shared = lambda params, opt_state: whole(params)
  else:
    tx = make_tx(method, config)
    state_specs = jc.state_specs(tx, init_params, axis_name=AXIS, num_devices=k)
    shared = lambda params, opt_state: diloco_anchor(opt_state) if local else params
  per_device = jax.NamedSharding(mesh, P(AXIS))
  checkpoints = checkpoint_manager(config, workdir, method)
  fingerprint = common.run_fingerprint(method, config, k)
  start_step, history, losses, train_time = 0, None, [], 0.0
  divergence = common.Divergence()
  if checkpoints is not None and checkpoints.latest_step() is not None:
    # Every process restores its own devices' rows of the per-device state; the
    # progress (JSON) is process 0's, its train losses included.
    start_step, params, opt_state, progress = restore_checkpoint(
      checkpoints, tx, init_params, mesh=mesh, state_specs=state_specs, local_params=local
    )
    where = f"{checkpoints.directory}/{start_step}"
    common.check_fingerprint(progress.get("run"), fingerprint, where)
    if progress["step"] != start_step:
      raise ValueError(
        f"the checkpoint in {where} is inconsistent: it records step {progress['step']}"
      )
    history, losses, train_time = progress["history"], progress["losses"], progress["train_time"]
    divergence = common.Divergence(**progress.get("divergence", {}))
    if jax.process_index() == 0:
      print(f"{method}: resuming from step {start_step} ({where})", flush=True)
  elif not is_sharded:
    params = replicate(init_params, mesh)
    opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs))(
      params
    )
    if local:  # one row per replica
      params = per_device_rows(init_params, mesh)

  per_eval = config.eval_batches * config.per_device_batch_size
  val = corpus["validation"]
  val_shape = (k, per_eval, config.seq_len + 1)
  val_tokens = global_rows(
    val_shape,
    per_device,
    lambda rows: input_pipeline.eval_windows(
      val, num_devices=k, per_device=per_eval, seq_len=config.seq_len
    )[rows],
  )
  batch_shape = (k, config.per_device_batch_size, config.seq_len + 1)

  def batch_at(mini_step: int) -> jax.Array:
    return global_rows(
      batch_shape,
      per_device,
      lambda rows: input_pipeline.train_batch(
        corpus["train"],
        mini_step,
        seed=config.seed,
        num_devices=k,
        per_device_batch_size=config.per_device_batch_size,
        seq_len=config.seq_len,
        devices=rows,
      ),
    )

  # Compile ahead of time, so that the training time excludes compilation.
  start = time.perf_counter()
  batch_spec = jax.ShapeDtypeStruct(batch_shape, jnp.uint8, sharding=per_device)
  if is_sharded:  # the mini-step seeds the FSDP exchange's stochastic rounding
    step = sharded_step
    extra = lambda m: (replicate(np.int32(m), mesh),)
    extra_spec = (jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),)
  else:
    step = make_train_step(graphdef, tx, mesh, state_specs, local_params=local)
    extra, extra_spec = lambda m: (), ()
  step = step.lower(params, opt_state, batch_spec, *extra_spec).compile()
  peak_bytes = peak_memory(step)
  if eval_step is None:
    eval_step = make_eval_step(graphdef, mesh)
  evaluate = eval_step.lower(shared(params, opt_state), val_tokens).compile()
  compile_time = time.perf_counter() - start

  if history is None:
    history = {
      "step": [0],
      "val_loss": [scalar(evaluate(shared(params, opt_state), val_tokens))],
      "train_loss": [float("nan")],
      "time_s": [0.0],
      "target_step": None,
      "target_time_s": None,
    }
  last = config.num_steps if stop_at is None else min(stop_at, config.num_steps)
  done = start_step  # the last update taken
  show = jax.process_index() == 0
  with tqdm(
    total=config.num_steps,
    initial=min(start_step, config.num_steps),
    desc=f"{method:>11}",
    unit="step",
    disable=not show,
  ) as bar:
    for i in range(start_step + 1, last + 1):
      if history["target_step"] is not None:
        break
      start = time.perf_counter()
      for j in range(acc):
        mini_step = (i - 1) * acc + j
        params, opt_state, loss = step(params, opt_state, batch_at(mini_step), *extra(mini_step))
        # One step in flight at a time (queued multi-device steps on few cores can
        # deadlock XLA's CPU collectives); this also makes the step times honest.
        losses.append(local_mean(loss))
        divergence.loss(i, losses[-1])  # this process's devices: check() dates it over all
      train_time += time.perf_counter() - start
      done = i
      bar.update()
      if i % config.eval_every == 0 or i == config.num_steps:
        loss = scalar(evaluate(shared(params, opt_state), val_tokens))
        divergence.check(i, common.all_finite(params), math.isfinite(loss))
        history["step"].append(i)
        history["val_loss"].append(loss)
        history["train_loss"].append(float(np.mean(losses)))
        history["time_s"].append(train_time)
        losses = []
        bar.set_postfix(loss=f"{history['train_loss'][-1]:.3f}", val=f"{loss:.3f}")
        if config.target_loss and loss <= config.target_loss:  # the same on every process
          history["target_step"], history["target_time_s"] = i, train_time
      if checkpoints is not None and (
        i % config.checkpoint_every == 0 or i in (config.num_steps, last, history["target_step"])
      ):
        progress = {
          "step": i,
          "history": history,
          "losses": losses,
          "train_time": train_time,
          "divergence": divergence.state(),
          "run": fingerprint,
        }
        save_checkpoint(checkpoints, i, params, opt_state, progress)
  divergence.check(done, common.all_finite(params))  # every process: the same steps
  if checkpoints is not None:
    checkpoints.wait_until_finished()  # the last save is written before we return
    checkpoints.close()
  digest = common.params_digest(shared(params, opt_state))  # DiLoCo: the anchor
  if jax.process_count() > 1:  # each process's copy, to compare across processes
    print(f"[process {jax.process_index()}] {method}: params sha256 {digest}", flush=True)

  received = dense_bytes = by_collective = None
  if k > 1 and is_sharded:  # the step's weight gathers and gradient exchange
    traffic = sharded.step_traffic(method, graphdef, init_params, config, k)
    received, by_collective = traffic.bytes_received, traffic.by_collective
    dense_bytes = jc.wire_report(
      make_update("dense", config), init_params, axis_name=AXIS, num_devices=k
    ).dense_bytes
  elif k > 1:  # bytes of one update in the steady state (DGC and 1-bit Adam warm up dense)
    report = jc.wire_report(
      make_update(method, config, warmup=False), init_params, axis_name=AXIS, num_devices=k
    )
    received, dense_bytes = report.bytes_received, report.dense_bytes
  val_loss = history["val_loss"][-1]
  return {
    "start_step": start_step,
    "params": shared(params, opt_state),
    "params_sha256": digest,
    "val_loss": val_loss,
    "bits_per_byte": val_loss / math.log(2),
    "bytes_received": received,
    "dense_bytes": dense_bytes,
    "ratio": None if received is None else dense_bytes / received,
    "bytes_by_collective": by_collective,
    "peak_bytes": peak_bytes,
    "train_time_s": train_time,
    "compile_time_s": compile_time,
    "history": history,
    "target_step": history["target_step"],
    "target_time_s": history["target_time_s"],
    "skipped_steps": count_in_state(opt_state, "notfinite_count"),
    "nonfinite_step": divergence.step,
    "diverged": divergence.diverged,
    "first_exchange_step": first_exchange_step(method, config),
    "exchanged": done >= first_exchange_step(method, config),
  }


def results_table(results: dict[str, dict[str, Any]], config, num_devices: int) -> str:
  """A Markdown table of the results, one row per method. A diverged method's
  validation loss reads ``diverged at update N``; the bytes of one that stopped before
  its exchange first ran (DiLoCo before its first sync) ``none sent``
  (``common.bytes_cells``)."""
  lines = [
    f"Byte-level LM on the Python standard library, {num_devices} devices,"
    f" {config.num_steps} updates of {num_devices * config.per_device_batch_size}"
    f"x{config.accumulation_steps} sequences of {config.seq_len} bytes. Bytes:"
    " jc.wire_report, received per device per update (steady state; sharded methods:"
    " the whole step's, weight gathers included). Peak memory: the compiled step's, per"
    " device. Train time: training steps only (evaluation and compilation excluded).",
    "",
    "| method | val loss (nats) | bits/byte | vs dense | bytes recv/device/update |"
    " ratio vs dense | peak memory (MiB) | train time (s) | compile (s) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  dense = results.get("dense", {})
  dense = None if dense.get("diverged") else dense.get("val_loss")
  for method, r in results.items():
    recv, ratio = common.bytes_cells(r, unit="update")
    loss, bits = f"{r['val_loss']:.3f}", f"{r['bits_per_byte']:.3f}"
    rel = "" if dense is None else f"{100 * (r['val_loss'] / dense - 1):+.1f}%"
    if r.get("diverged"):
      loss, bits, rel = f"diverged at update {r['nonfinite_step']}", "n/a", "n/a"
    peak = "n/a" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.2f}"
    lines.append(
      f"| {method} | {loss} | {bits} | {rel} | {recv} | {ratio}"
      f" | {peak} | {r['train_time_s']:.1f} | {r['compile_time_s']:.1f} |"
    )
  return "\n".join(lines)


def plot_losses(results: dict[str, dict[str, Any]], path: str):
  """Saves validation loss vs step and vs training time, one line per method; a diverged
  method's legend entry says where. Returns the figure."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(10, 4), dpi=120)
  FigureCanvasAgg(fig)
  by_step, by_time = fig.subplots(1, 2)
  for method, r in results.items():
    h = r["history"]
    label = method
    if r.get("diverged"):
      label = f"{method} (diverged at update {r['nonfinite_step']})"
    by_step.plot(h["step"], h["val_loss"], marker=".", label=label)
    by_time.plot(h["time_s"], h["val_loss"], marker=".", label=label)
  for ax, xlabel in ((by_step, "update"), (by_time, "training time (s)")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/byte)")
    ax.grid(alpha=0.3)
  by_step.set_title("Byte-level LM: dense vs compressed exchange")
  by_time.legend()
  fig.tight_layout()
  fig.savefig(path)
  return fig


def setup(config):
  """(mesh over every device of every process, corpus, graphdef, host initial params)."""
  k = jax.device_count()
  mesh = common.data_mesh(AXIS)
  corpus = input_pipeline.load_corpus(config.validation_percent)
  graphdef, state = nnx.split(models.create_model(config, rngs=nnx.Rngs(config.seed)))
  init_params = jax.device_get(state.to_pure_dict())  # every method starts from it
  num_params = sum(p.size for p in jax.tree.leaves(init_params))
  if jax.process_index() == 0:
    print(
      f"{k} devices ({jax.devices()[0].platform}, {jax.process_count()} processes),"
      f" {num_params:,} parameters; corpus {len(corpus['train']):,} train bytes"
      f" ({corpus['train_files']} files) / {len(corpus['validation']):,} validation bytes"
      f" ({corpus['validation_files']} files); global batch"
      f" {k * config.per_device_batch_size}x{config.accumulation_steps}, {config.num_steps}"
      " updates"
    )
  return mesh, corpus, graphdef, init_params


def train_and_evaluate(config, workdir: str, *, stop_at: int | None = None) -> dict[str, Any]:
  """Trains every method in ``config.methods``; process 0 writes the results.

  Writes ``results.md`` (the table), ``results.json`` (histories included) and
  ``val_loss.png`` (validation loss vs update and vs training time) to ``workdir``; a
  method that went non-finite is marked in all three (``diverged``, ``nonfinite_step``).

  Args:
    config: an :class:`examples.lm.configs.default.Config`.
    workdir: output directory (and checkpoint root with ``config.checkpoint_every``).
    stop_at: stop every method after this update (an interrupted run).

  Returns:
    ``{method: results}`` with :func:`train_method`'s keys (``params`` included, as
    global arrays).
  """
  os.makedirs(workdir, exist_ok=True)
  mesh, corpus, graphdef, init_params = setup(config)
  k = mesh.size
  eval_step = make_eval_step(graphdef, mesh)  # compiled once, for every method
  results = {}
  for method in config.methods:
    results[method] = train_method(
      method,
      config,
      graphdef=graphdef,
      init_params=init_params,
      corpus=corpus,
      mesh=mesh,
      workdir=workdir,
      stop_at=stop_at,
      eval_step=eval_step,
    )
  if jax.process_index() == 0:
    saved = {m: {key: v for key, v in r.items() if key != "params"} for m, r in results.items()}
    common.write_results(
      workdir,
      results_table(results, config, k),
      {
        "config": dataclasses.asdict(config),
        "num_devices": k,
        "num_processes": jax.process_count(),
        "jax": jax.__version__,
        "results": saved,
      },
    )
    plot_losses(results, os.path.join(workdir, "val_loss.png"))
  return results
