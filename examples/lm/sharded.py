"""Sharded training of the LM: ZeRO-2 and per-layer FSDP (ZeRO-3), dense or compressed.

Every parameter leaf is cut along its first axis over the data axis (``P(AXIS)``), so
each device holds ``1/K`` of the parameters and of AdamW's moments. The methods:

* ``zero_dense``: ZeRO-2 in plain JAX. The shards are all-gathered (float32, one buffer)
  at the start of the step, the loss is differentiated with respect to the gathered
  weights (this device's full-size local gradient), and one float32 ``psum_scatter``
  (one buffer) hands each device its shard of the mean.
* ``zero_qsgd4``: the same step with the gradient exchanged by ``jc.qsgd(bits=4,
  collective="reduce_scatter")``: row ``j`` of every leaf's local gradient is encoded
  and sent to device ``j``, which decodes and sums the K payloads in float32.
* ``fsdp_dense``: FSDP in plain JAX. Each block's weights are all-gathered (float32, one
  buffer per block) when the block runs, and JAX transposes the gather into that
  block's float32 ``psum_scatter`` in its backward; the embedding, final norm and head
  are gathered once, as one more group.
* ``fsdp_int8_qsgd4``: the same with ``jc.fsdp_gather``: the weights gathered from
  int8 blocks (``jc.codecs.BlockInt8``, ZeRO++'s qwZ) and each block's gradient
  reduce-scattered as 4-bit QSGD inside that block's backward, so no full-size
  gradient of the model is ever held; every leaf is compressed, norms' scales too
  (:func:`every_leaf`).
* ``fsdp_fp8``: the same with FP8 on the wire both ways: the weights gathered as E4M3
  with a power-of-two scale per 32 values, rounded to nearest (``jc.codecs.Float8()``,
  MXFP8's format), and each block's gradient reduce-scattered as E4M3 per 32 values
  with stochastic rounding (unbiased, so no residual, as for QSGD); every leaf
  compressed.

The blocks run in a Python loop, not ``lax.scan``, so XLA sees every block's gather at
once: a rematerialized gather (``jax.checkpoint``) is merged by XLA with the forward's
(measured on XLA:CPU, the optimization barriers notwithstanding), so the gathered
weights are kept for the backward instead, and the step gathers each block once. That
is what the code says here, so that the bytes read off the traced program are the
compiled program's. Per-layer gathering with rematerialization needs the layers under
``lax.scan`` (``benchmarks/sharded.py``'s MLP, docs/guides/fsdp.md).

The optimizer after the exchange (global-norm clipping, AdamW) runs on the shards; the
clipping's norm is summed over the devices (:func:`clip_by_global_norm`), since each
device sees only its shards. QSGD is unbiased: no error feedback, no residual state
(ZeRO++'s qgZ sends none either).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

import jaxcomp as jc

AXIS = "batch"  # the data axis (train.AXIS)

METHODS = ("zero_dense", "zero_qsgd4", "fsdp_dense", "fsdp_int8_qsgd4", "fsdp_fp8")
ZERO = ("zero_dense", "zero_qsgd4")

# jc.qsgd(bits=4)'s codec: 7 levels (4 bits with the sign), buckets of 512, max norm.
QSGD4 = jc.codecs.QSGD(7, 512, norm="max")
# fsdp_fp8's codecs: MXFP8 (E4M3, an E8M0 scale per 32 values), weights rounded to
# nearest, gradients stochastically (unbiased).
FP8_WEIGHTS = jc.codecs.Float8("e4m3")
FP8_GRADS = jc.codecs.Float8("e4m3", rounding="stochastic")


def param_specs(params, num_devices: int):
  """``P(AXIS)`` for every leaf; a ``ValueError`` names a leaf whose first axis K does
  not divide."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    shape = jax.numpy.shape(leaf)
    if not shape or shape[0] % num_devices:
      raise ValueError(
        f"sharded methods cut every parameter along its first axis over the {num_devices}"
        f" devices; {jax.tree_util.keystr(path)} has shape {shape}"
      )
  return jax.tree.map(lambda _: P(AXIS), params)


def gather_flat(shards):
  """Full weights from this device's shards: one float32 ``all_gather`` of all leaves
  in one buffer (typed varying, so a gradient with respect to them stays local; its
  transpose is one ``psum_scatter``, the sum over the devices)."""
  leaves, treedef = jax.tree.flatten(shards)
  rows = lax.all_gather(jnp.concatenate([a.reshape(-1) for a in leaves]), AXIS)  # (K, m)
  out, start = [], 0
  for a in leaves:
    out.append(rows[:, start : start + a.size].reshape((-1, *a.shape[1:])))
    start += a.size
  return treedef.unflatten(out)


def psum_scatter_mean() -> optax.GradientTransformation:
  """The dense ZeRO exchange: each device's shard of the float32 mean gradient, by one
  ``psum_scatter`` of all leaves in one buffer (row ``j`` of every leaf to device ``j``).
  """

  def update_fn(updates, state, params=None):
    del params
    k = lax.axis_size(AXIS)
    leaves, treedef = jax.tree.flatten(updates)
    rows = jnp.concatenate([g.reshape(k, -1) for g in leaves], axis=1)  # (K, m / K)
    mine = lax.psum_scatter(rows, AXIS, scatter_dimension=0, tiled=True)[0] / k
    out, start = [], 0
    for g in leaves:
      n = g.size // k
      out.append(mine[start : start + n].reshape((g.shape[0] // k, *g.shape[1:])))
      start += n
    return treedef.unflatten(out), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` of sharded updates: the squared norms of this
  device's shards are summed over the data axis, so every device scales by the norm of
  the whole mean gradient (optax's would clip each shard by its own norm)."""

  def update_fn(updates, state, params=None):
    del params
    local = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(updates))
    norm = jnp.sqrt(lax.psum(local, AXIS))
    limit = jnp.float32(max_norm)
    scale = jnp.where(norm < limit, jnp.float32(1), limit / norm)
    return jax.tree.map(lambda g: g * scale, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def make_exchange(method: str, specs) -> optax.GradientTransformation | None:
  """ZeRO's gradient exchange (full-size local gradient in, this device's shard of the
  mean out); ``None`` for FSDP, whose exchange runs inside the backward."""
  if method == "zero_dense":
    return psum_scatter_mean()
  if method == "zero_qsgd4":
    return jc.per_device_state(
      jc.qsgd(bits=4, axis_name=AXIS, collective="reduce_scatter", param_specs=specs)
    )
  return None


def make_tx(method: str, config, specs, optimizer) -> optax.GradientTransformation:
  """``skip_nonfinite(chain(exchange, clip, optimizer))`` on shards; ``optimizer`` is
  ``train.make_optimizer`` of a config without clipping (the clip here is sharded)."""
  if config.accumulation_steps != 1:
    raise ValueError(f"{method}: accumulation_steps > 1 is not supported by the sharded methods")
  parts = [make_exchange(method, specs)] if method in ZERO else []
  if config.grad_clip:
    parts.append(clip_by_global_norm(config.grad_clip))
  return jc.skip_nonfinite(optax.chain(*parts, optimizer), axis_name=AXIS)


def state_specs(tx, params, specs, num_devices: int):
  """The optimizer state's specs: ``jc.state_specs`` with ``takes_shards=True``, since
  the chain takes shards through an exchange jaxcomp cannot see (plain JAX's
  ``psum_scatter``, or FSDP's inside the backward; ``zero_qsgd4``'s is detected)."""
  return jc.state_specs(
    tx, params, axis_name=AXIS, num_devices=num_devices, param_specs=specs, takes_shards=True
  )


def every_leaf(path, leaf) -> bool:
  """A filter that compresses every leaf, norms' scales and biases too: the
  configuration the guides' fsdp_int8_qsgd4 figures were measured with (the library's
  default, ``jc.default_filter``, sends leaves under 1024 values dense)."""
  del path, leaf
  return True


def fsdp_gather_fn(method: str):
  """``gather(shards, key) -> full``: dense FSDP's float32 gather (one buffer), or
  ``jc.fsdp_gather`` with the int8 weight gather (asked for: the default is exact) and
  the 4-bit QSGD reduce-scatter, or with FP8 both ways."""
  if method == "fsdp_dense":
    return lambda shards, key: gather_flat(shards)
  if method == "fsdp_int8_qsgd4":
    return lambda shards, key: jc.fsdp_gather(
      shards,
      axis_name=AXIS,
      key=key,
      weight_codec=jc.codecs.BlockInt8(),
      grad_codec=QSGD4,
      filter=every_leaf,
    )
  if method == "fsdp_fp8":
    return lambda shards, key: jc.fsdp_gather(
      shards,
      axis_name=AXIS,
      key=key,
      weight_codec=FP8_WEIGHTS,
      grad_codec=FP8_GRADS,
      filter=every_leaf,
    )
  raise ValueError(f"{method!r} is not an FSDP method")


def fsdp_logits(graphdef, shards, tokens: jax.Array, key: jax.Array, gather) -> jax.Array:
  """The model's logits with each block's weights gathered when the block runs (its
  gradient exchanged in that block's backward); the other weights (embedding, final
  norm, head) gathered as one group before the first block."""
  depth = len(shards["blocks"])
  keys = jax.random.split(key, depth + 1)
  top = gather({k: v for k, v in shards.items() if k != "blocks"}, keys[depth])
  model = nnx.merge(graphdef, {**top, "blocks": shards["blocks"]})  # blocks: shards

  def run_block(i, block, x):
    block_def, block_shards = nnx.split(block)

    return nnx.merge(block_def, gather(block_shards.to_pure_dict(), keys[i]))(x)

  return model(tokens, run_block=run_block)


def local_grads(method: str, graphdef, shards, tokens: jax.Array, key: jax.Array):
  """``(loss, grads)`` of one device's batch. ZeRO: the full-size local gradient of the
  gathered weights (the exchange follows in ``tx``); FSDP: this device's shard of the
  mean gradient, exchanged inside the backward."""

  def cross_entropy(logits):
    tok = tokens.astype(jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

  inputs = tokens.astype(jnp.int32)[:, :-1]
  if method in ZERO:
    full = gather_flat(shards)
    return jax.value_and_grad(lambda p: cross_entropy(nnx.merge(graphdef, p)(inputs)))(full)
  gather = fsdp_gather_fn(method)
  loss, grads = jax.value_and_grad(
    lambda s: cross_entropy(fsdp_logits(graphdef, s, inputs, key, gather))
  )(shards)
  if method == "fsdp_dense":  # the transposed all_gather sums over the devices
    grads = jax.tree.map(lambda g: g / lax.axis_size(AXIS), grads)
  return loss, grads


def make_train_step(method: str, graphdef, tx, mesh, specs, opt_specs, seed: int):
  """jit(shard_map(step)): ``(shards, opt_state, batch, mini_step) -> (shards,
  opt_state, losses)``; ``mini_step`` (replicated int32) seeds the FSDP exchange's
  stochastic rounding (``fold_in(key(seed), mini_step)``), so a step's bits do not
  depend on how the run got there."""

  def train_step(shards, opt_state, batch, mini_step):
    key = jax.random.fold_in(jax.random.key(seed), mini_step)
    loss, grads = local_grads(method, graphdef, shards, batch[0], key)
    updates, opt_state = tx.update(grads, opt_state, shards)
    return optax.apply_updates(shards, updates), opt_state, loss[None]

  return jax.jit(
    jax.shard_map(
      train_step,
      mesh=mesh,
      in_specs=(specs, opt_specs, P(AXIS), P()),
      out_specs=(specs, opt_specs, P(AXIS)),
    ),
    donate_argnums=(0, 1),
  )


class StepTraffic(NamedTuple):
  """Bytes one device receives per step, read off the traced gradient computation."""

  bytes_received: float  # all collectives: weight gathers and the gradient exchange
  by_collective: dict[str, float]  # e.g. {"all_gather": ..., "all_to_all": ...}
  report: Any  # the jc.WireReport


def step_traffic(method: str, graphdef, params, config, num_devices: int) -> StepTraffic:
  """The bytes of a step's gathers and gradient exchange, by ``jc.step_wire_report``.

  The step is the whole gradient computation from one device's shards (the weight
  gathers, the reduce-scatters in the backward or the ZeRO exchange after it) on a
  batch of zeros, traced inside ``shard_map``: the bytes are the collectives' operands
  of the program the trainer runs (every device's shards have the same shapes).
  """
  k = num_devices
  specs = param_specs(params, k)
  shards = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct((p.shape[0] // k, *p.shape[1:]), p.dtype), params
  )
  exchange = make_exchange(method, specs)
  tokens = jnp.zeros((config.per_device_batch_size, config.seq_len + 1), jnp.uint8)

  def step(p):
    _, grads = local_grads(method, graphdef, p, tokens, jax.random.key(0))
    if exchange is not None:
      grads = exchange.update(grads, exchange.init(p), p)[0]
    return grads

  report = jc.step_wire_report(step, shards, axis_name=AXIS, num_devices=k)
  by: dict[str, float] = {}
  for op in report.ops:
    by[op.primitive] = by.get(op.primitive, 0.0) + op.bytes_received
  return StepTraffic(report.bytes_received, by, report)
