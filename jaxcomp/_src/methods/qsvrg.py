"""Quantized SVRG (QSGD §3.3): a training-step helper for strongly convex finite sums.

SVRG needs each device's gradient at two points (the iterate and the snapshot) on the
same minibatch, so it cannot be an optax transform of one gradient; :func:`qsvrg` returns
pure functions over explicit state instead, built from the same codecs and collectives
as :func:`jaxcomp.compress`. :func:`qsvrg_wire_report` counts the bits of an epoch from
the traced collectives, like :func:`jaxcomp.wire_report`.

Written as named steps over a frozen :class:`_Options`: ``_init``, ``_snapshot``
(``∇f(y)``), ``_step`` (one inner iteration through ``_exchange``), ``_end_epoch`` and
``_epoch``; :func:`qsvrg` only wires them into a :class:`QSVRG`.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src.codecs import base as codecs_lib
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import transforms
from jaxcomp._src.plumbing import collective_trace
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32
COLLECTIVES = ("auto", "allgather", "two_phase")


class QSVRGState(NamedTuple):
  """State of :func:`qsvrg`. Identical on every device: hold it replicated (``P()``).

  ``snapshot``, ``full_grad`` and ``iterate_sum`` are pytrees shaped like the
  parameters. The key is split every inner step and folded with the device index only
  for encoding, so the stored key stays the same on every device.
  """

  key: Array  # typed PRNG key, shape=()
  count: Array  # shape=(), dtype=int32: inner steps taken in all (the schedule's input)
  inner_count: Array  # shape=(), dtype=int32: inner steps taken in the current epoch
  snapshot: Any  # y, leaf shapes, the parameters' dtypes
  full_grad: Any  # ∇f(y), the dense mean over devices, leaf shapes, float32
  iterate_sum: Any  # Σ_t x_t over the current epoch, leaf shapes, float32


class QSVRG(NamedTuple):
  """The functions of :func:`qsvrg` (all pure, jit-able, usable in shard_map and pmap).

  Attributes:
    init: ``init(params) -> state``; the snapshot starts at ``params``.
    snapshot: ``snapshot(params, state, full_batch=None, *, grad=None) -> state``: starts
      an epoch at ``y = params``: ``∇f(y)``, the mean over devices of each device's full
      local gradient (on ``full_batch``, or ``grad`` when given), exchanged densely.
    step: ``step(params, state, batch) -> (params, state)``: one inner iteration.
    end_epoch: ``end_epoch(state) -> params``: the mean iterate of the epoch, the next
      snapshot point.
    epoch: ``epoch(params, state, full_batch, batches) -> (params, state)``: ``snapshot``,
      then ``step`` over the leading axis of ``batches`` (a ``lax.scan``, T steps), then
      ``end_epoch``; the returned params are the new snapshot point ``y``.
  """

  init: Callable[[Any], QSVRGState]
  snapshot: Callable[..., QSVRGState]
  step: Callable[..., tuple[Any, QSVRGState]]
  end_epoch: Callable[[QSVRGState], Any]
  epoch: Callable[..., tuple[Any, QSVRGState]]


def default_levels(n: int, bucket_size: int | None = None) -> int:
  """The paper's ``s = √n`` for a bucket of ``n`` values: ``max(1, round(sqrt(b)))``.

  ``b`` is the bucket length: ``n`` with one bucket per tensor (``bucket_size=None``),
  else ``min(bucket_size, n)``.
  """
  b = max(n, 1) if bucket_size is None else min(bucket_size, max(n, 1))
  return max(1, round(math.sqrt(b)))


def _check_leaf(path, leaf) -> None:
  treeutil.check_leaf(path, leaf, "qsvrg needs floating-point parameters")


def _check_options(loss_fn, learning_rate, collective, codec, levels, bucket_size) -> None:
  """Every argument check of :func:`qsvrg`, in one place."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
  if not callable(learning_rate):
    if (
      isinstance(learning_rate, bool)
      or not isinstance(learning_rate, (int, float))
      or (not learning_rate > 0)
    ):
      raise ValueError(
        f"learning_rate must be a positive number or a schedule, got {learning_rate!r}"
      )
  if collective not in COLLECTIVES:
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
  if codec is not None:
    if not isinstance(codec, codecs_lib.Codec) and not callable(codec):
      raise TypeError(
        f"codec must be a jaxcomp codec or a function of the leaf returning one, got {codec!r}"
      )
    if levels is not None or bucket_size is not None:
      raise ValueError("give either codec or levels/bucket_size (QSGD's), not both")
  else:
    codecs_lib.check_positive_int(levels, "levels", allow_none=True)
    codecs_lib.check_positive_int(bucket_size, "bucket_size", allow_none=True)
    if levels is not None:
      codecs_lib.QSGD(levels, bucket_size, "l2")  # validates levels


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`qsvrg`, checked."""

  loss_fn: Callable[[Any, Any], Array]
  learning_rate: float | Callable[[Array], Array]
  axis_name: Any
  levels: int | None
  bucket_size: int | None
  codec: Any  # a codec, a function of the leaf returning one, or None (QSGD)
  collective: str
  filter_fn: Callable[[tuple, Array], bool]
  seed: int

  def leaf_codec(self, leaf) -> codecs_lib.Codec:
    """The codec of a leaf: the one given, the function's choice, or QSGD with ``s``."""
    if isinstance(self.codec, codecs_lib.Codec):
      return self.codec
    if self.codec is not None:
      chosen = self.codec(leaf)
      if not isinstance(chosen, codecs_lib.Codec):
        raise TypeError(f"codec(leaf) must return a jaxcomp codec, got {chosen!r}")
      return chosen
    s = (
      self.levels
      if self.levels is not None
      else default_levels(math.prod(leaf.shape), self.bucket_size)
    )
    return codecs_lib.QSGD(s, self.bucket_size, "l2")

  def local(self, tree):
    return tree if self.axis_name is None else collectives.vary(tree, self.axis_name)

  def lr(self, count):
    if not callable(self.learning_rate):
      return jnp.asarray(self.learning_rate, _F32)
    with jax.numpy_dtype_promotion("standard"):  # optax schedules mix int and float
      return jnp.asarray(self.learning_rate(count), _F32)


def _zeros32(tree):
  return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _F32), tree)


# ----------------------------------------------------------------------------- steps


def _init(opts: _Options, params) -> QSVRGState:
  """The snapshot at ``params``; zero full gradient and iterate sum."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    _check_leaf(path, leaf)
  return QSVRGState(
    key=jax.random.key(opts.seed),
    count=jnp.zeros((), jnp.int32),
    inner_count=jnp.zeros((), jnp.int32),
    snapshot=jax.tree.map(jnp.asarray, params),
    full_grad=_zeros32(params),
    iterate_sum=_zeros32(params),
  )


def _snapshot(opts: _Options, params, state: QSVRGState, full_batch=None, *, grad=None):
  """Starts an epoch at ``y = params``: ``∇f(y)``, densely averaged over the devices."""
  axis_name = opts.axis_name
  if axis_name is not None:
    collectives.axis_size(axis_name)  # a clear error when the axis is not bound
  if grad is None:
    if full_batch is None:
      raise ValueError(
        "snapshot needs this device's full_batch, or its full local gradient as grad=..."
      )
    grad = jax.grad(opts.loss_fn)(opts.local(params), full_batch)
  full = jax.tree.map(lambda g: g.astype(_F32), grad)
  if axis_name is not None:  # one all-reduce per dtype, not one per leaf
    leaves, treedef = jax.tree.flatten(full)
    full = treedef.unflatten(collectives.dense_means(leaves, axis_name)[0])
  y = jax.tree.map(lambda p, s: jnp.asarray(p, s.dtype), params, state.snapshot)
  return state._replace(
    snapshot=y, full_grad=full, iterate_sum=_zeros32(params), inner_count=jnp.zeros((), jnp.int32)
  )


def _step(opts: _Options, params, state: QSVRGState, batch):
  """One inner iteration: ``x ← x − η · mean_j Q(∇f_j(x) − ∇f_j(y) + ∇f(y))``."""
  grad_fn = jax.grad(opts.loss_fn)
  gx = grad_fn(opts.local(params), batch)
  gy = grad_fn(opts.local(state.snapshot), batch)
  key, step_key = jax.random.split(state.key)
  if opts.axis_name is not None:
    collectives.axis_size(opts.axis_name)
    step_key = jax.random.fold_in(step_key, lax.axis_index(opts.axis_name))
  eta = opts.lr(state.count)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  gxs = treedef.flatten_up_to(gx)
  gys = treedef.flatten_up_to(gy)
  fulls = treedef.flatten_up_to(state.full_grad)
  sums = treedef.flatten_up_to(state.iterate_sum)
  vs = [a.astype(_F32) - b.astype(_F32) + c for a, b, c in zip(gxs, gys, fulls)]
  means = _exchange(opts, leaves, vs, step_key)
  new_params, new_sums = [], []
  for (_, x), mean, acc in zip(leaves, means, sums):
    x32 = jnp.asarray(x).astype(_F32)
    new_params.append((x32 - eta * mean.reshape(x32.shape)).astype(x.dtype))
    new_sums.append(acc + x32)
  new_state = state._replace(
    key=key,
    count=state.count + 1,
    inner_count=state.inner_count + 1,
    iterate_sum=treedef.unflatten(new_sums),
  )
  return treedef.unflatten(new_params), new_state


def _exchange(opts: _Options, leaves, vs, step_key) -> list:
  """The means over devices of the ``vs``, each leaf planned and exchanged by the
  pipeline as in :func:`compress` (:func:`pipeline.run`), with its own codec
  (:meth:`_Options.leaf_codec`) and no error feedback: dense leaves share one all-reduce
  (the payloads' all-gather at K <= 2), gathered payloads one all-gather, two-phase
  leaves one exchange per codec."""
  none = optax.MaskedNode()
  plan = []
  for i, ((path, x), v) in enumerate(zip(leaves, vs)):
    _check_leaf(path, x)
    chosen = treeutil.selected(opts.filter_fn, path, x)
    cod = opts.leaf_codec(x) if chosen else None
    plan.append(
      pipeline.plan_leaf(
        cod,
        opts.collective,
        opts.axis_name,
        opts.filter_fn,
        i,
        path,
        v,
        none,
        none,
        step_key,
        chosen=chosen,
      )
    )
  return [leaf.out for leaf in pipeline.run(opts.axis_name, plan)]


def _end_epoch(state: QSVRGState):
  """The mean iterate of the epoch (the snapshot if no step was taken)."""
  t = state.inner_count

  def one(acc, y):
    mean = acc / jnp.maximum(t, 1).astype(_F32)
    return jnp.where(t > 0, mean, y.astype(_F32)).astype(y.dtype)

  return jax.tree.map(one, state.iterate_sum, state.snapshot)


def _epoch(opts: _Options, params, state: QSVRGState, full_batch, batches):
  """``snapshot``, ``step`` over ``batches`` (a ``lax.scan``), ``end_epoch``."""
  state = _snapshot(opts, params, state, full_batch)

  def body(carry, batch):
    return _step(opts, *carry, batch), None

  (_, state), _ = lax.scan(body, (params, state), batches)
  return _end_epoch(state), state


# ----------------------------------------------------------------------------- factory


def qsvrg(
  loss_fn: Callable[[Any, Any], Array],
  learning_rate: float | Callable[[Array], Array],
  *,
  axis_name: Any = transforms.AXIS_REQUIRED,
  levels: int | None = None,
  bucket_size: int | None = None,
  codec: codecs_lib.Codec | Callable[[Array], codecs_lib.Codec] | None = None,
  collective: str = "auto",
  filter: Callable[[tuple, Array], bool] | None = None,  # pylint: disable=redefined-builtin
  seed: int = 0,
) -> QSVRG:
  r"""Quantized SVRG (Alistarh et al. 2017, §3.3): linear convergence with quantized steps.

  For ``f(x) = (1/K) Σ_j f_j(x)``, device ``j`` holding the data of ``f_j``, epoch ``p``
  with snapshot ``y = y^{(p)}`` runs:

  .. math::
    \nabla f(y) = \frac{1}{K} \sum_j \nabla f_j(y)
        \quad \text{(full local gradients, one dense } \mathtt{pmean)}, \\
    u_{t,j} = \tilde Q\big(\nabla f_{j,t}(x_t) - \nabla f_{j,t}(y) + \nabla f(y)\big),
    \qquad x_{t+1} = x_t - \eta \, \frac{1}{K} \sum_j u_{t,j},
    \qquad t = 1, \dots, T, \\
    x_1 = y^{(p)}, \qquad y^{(p+1)} = \frac{1}{T} \sum_{t=1}^{T} x_t,

  where ``∇f_{j,t}`` is device ``j``'s gradient on its minibatch of step ``t``, taken at
  ``x_t`` and at ``y`` on the *same* minibatch, and ``Q̃(v) = Q(v, √n)`` is QSGD with the
  l2 norm and ``s = √n`` levels (:class:`jaxcomp.codecs.QSGD`; ``n`` the size of the
  tensor, or of the bucket with ``bucket_size``). ``Q̃`` is unbiased, so ``u_t`` is an
  unbiased estimate of ``∇f(x_t)`` whose variance (SVRG's, plus the quantizer's
  ``min(n/s², √n/s) = 1`` times ``||v||²`` per device, Lemma 3.1) vanishes as ``x_t`` and
  ``y`` approach the optimum: hence a linear rate. Theorem 3.6: for ``f`` ``l``-strongly
  convex, each ``f_i`` strongly convex and ``L``-smooth, ``η = O(1/L)`` and
  ``T = O(L/l)``,
  ``E[f(y^{(p+1)})] - f(x*) <= 0.9^p (f(y^{(1)}) - f(x*))``.

  Each inner step the quantized vectors go through the compressed collective of
  :func:`jaxcomp.compress` (``"allgather"``: every device decodes the K payloads, the
  paper's broadcast; or ``"two_phase"``, which quantizes the chunk averages a second
  time with the same codec: not the paper's algorithm, but per-device traffic flat in
  K). The default, ``"auto"``, is the all-gather on two devices and the two-phase
  exchange on more (per leaf, where its chunks cost fewer bytes); pass
  ``collective="allgather"`` for the paper's exchange at any K. Every device then applies the
  same mean, so parameters and state stay identical on all devices. One collective
  carries every leaf: the payloads of all quantized leaves share one ``all_gather``
  (each decoded by its own codec) and the leaves ``filter`` leaves out share one
  all-reduce (:func:`jaxcomp.pmean_tree`), as does the snapshot's dense gradient.

  Choices made here: an epoch restarts from its snapshot (``x_1 = y``), and ``y`` is the
  mean of the T points where gradients were taken, ``x_1 .. x_T`` (the paper's
  ``(1/T) Σ_{t=1}^T x_t``; ``x_{T+1}`` is not in it). ``T`` is the leading length of
  ``batches`` in ``epoch`` (or the number of ``step`` calls between ``snapshot`` and
  ``end_epoch``).

  Bits per epoch and per device (Theorem 3.6): at most ``(F + 2.8n)(T + 1) + Fn`` with
  Elias-coded payloads (``F = 32``). Here payloads are fixed width: per bucket one
  float32 norm and ``ceil(log2(s+1)) + 1`` bits per value, so an epoch sends
  ``32n + T (n (ceil(log2(√n+1)) + 1) + 32)`` bits for one bucket per tensor (and one
  32-bit norm per leaf, not one in all): more than ``2.8n`` per step from ``n = 3`` on
  (``√n`` levels take about ``log2(n)/2 + 1`` bits each, while Elias coding exploits that
  most ``ξ_i`` are 0 or 1: 12 bits a value at ``n = 2**20``), but still far below the
  ``32n`` of a dense step. :func:`qsvrg_wire_report` reads the real numbers from the
  traced collectives.

  Usage inside ``jax.shard_map`` (check_vma on) or ``jax.pmap``: the state is the same
  on every device, so pass it and the parameters replicated and the data sharded::

    opt = jc.qsvrg(loss_fn, 0.5, axis_name="b")
    # Replicated on the mesh, as the outputs are (else the second call compiles again).
    params, state = jax.device_put((params, opt.init(params)), NamedSharding(mesh, P()))
    run = jax.jit(jax.shard_map(opt.epoch, mesh=mesh,
                                in_specs=(P(), P(), P("b"), P(None, "b")),
                                out_specs=(P(), P())))
    for p in range(epochs):
      params, state = run(params, state, full_data, batches_of_epoch(p))

  ``batches`` holds each device's T minibatches along a leading axis (sampled from its
  own shard). Gradients are local: they are taken with respect to
  :func:`jaxcomp.vary` of the parameters, so no dense all-reduce sneaks in.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, this device's mean loss on ``batch``
      (the minibatch ``f_{j,t}``, or the whole local shard ``f_j`` in ``snapshot``).
    learning_rate: ``η``, a float or a schedule of the total inner step count.
    axis_name: the mapped axis of the devices (required), or ``None``: the explicit
      one-device run (quantization simulated locally, nothing exchanged).
    levels: QSGD levels ``s`` for every leaf; ``None`` (default) uses
      ``round(sqrt(n))`` per leaf, ``n`` its size or its bucket size (the paper's ``Q̃``).
    bucket_size: values per QSGD bucket (``None``: one bucket per tensor, the paper's).
    codec: a :mod:`jaxcomp.codecs` codec for every leaf instead of QSGD (e.g.
      ``Identity()`` gives plain SVRG through the same code), or a function
      ``codec(leaf) -> Codec`` choosing one per leaf from its shape, e.g. the paper's
      Elias-coded payloads:
      ``lambda leaf: jc.codecs.EliasQSGD(max(1, round(math.sqrt(leaf.size))))``. Excludes
      ``levels`` and ``bucket_size``.
    collective: ``"auto"`` (default: the all-gather on two devices, the two-phase
      exchange on more, per leaf as in :func:`jaxcomp.compress`), ``"allgather"`` or
      ``"two_phase"`` (see above).
    filter: ``filter(path, leaf) -> bool``: leaves it rejects are exchanged with a
      dense ``pmean`` every step. Default: every leaf is quantized, as in the paper.
    seed: seed of the state's PRNG key.

  Returns:
    A :class:`QSVRG` of pure functions ``init``, ``snapshot``, ``step``, ``end_epoch``
    and ``epoch``.

  Example (one device; ``P`` and ``mesh`` as above for several):

    >>> import jax, jax.numpy as jnp, jaxcomp as jc
    >>> a = jax.random.normal(jax.random.key(0), (256, 16))
    >>> data = (a, a @ jnp.ones(16))  # consistent least squares: f* = 0
    >>> loss = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
    >>> opt = jc.qsvrg(loss, 0.1, axis_name=None)  # Q(v, s=4) on the 16 values: 4 bits each
    >>> w = jnp.zeros(16)
    >>> state = opt.init(w)
    >>> batches = jax.tree.map(lambda v: v.reshape(32, 8, *v.shape[1:]), data)  # T=32
    >>> epoch = jax.jit(opt.epoch)
    >>> for _ in range(8):
    ...   w, state = epoch(w, state, data, batches)
    >>> bool(loss(w, data) < 1e-5 * loss(jnp.zeros(16), data))
    True

  References:
    Alistarh, Grubic, Li, Tomioka, Vojnovic. *QSGD: Communication-Efficient SGD via
    Gradient Quantization and Encoding*. NeurIPS 2017, §3.3 and Theorem 3.6.
    https://arxiv.org/abs/1610.02132

    Johnson, Zhang. *Accelerating Stochastic Gradient Descent using Predictive Variance
    Reduction*. NeurIPS 2013.
  """
  transforms.require_axis_name(axis_name, "jc.qsvrg")
  _check_options(loss_fn, learning_rate, collective, codec, levels, bucket_size)
  opts = _Options(
    loss_fn=loss_fn,
    learning_rate=learning_rate,
    axis_name=axis_name,
    levels=levels,
    bucket_size=bucket_size,
    codec=codec,
    collective=collective,
    filter_fn=(lambda path, leaf: True) if filter is None else filter,
    seed=seed,
  )

  def init_fn(params) -> QSVRGState:
    return _init(opts, params)

  def snapshot_fn(params, state: QSVRGState, full_batch=None, *, grad=None) -> QSVRGState:
    return _snapshot(opts, params, state, full_batch, grad=grad)

  def step_fn(params, state: QSVRGState, batch) -> tuple[Any, QSVRGState]:
    return _step(opts, params, state, batch)

  def epoch_fn(params, state: QSVRGState, full_batch, batches) -> tuple[Any, QSVRGState]:
    return _epoch(opts, params, state, full_batch, batches)

  return QSVRG(init_fn, snapshot_fn, step_fn, _end_epoch, epoch_fn)


# ----------------------------------------------------------------------------- bits


@dataclasses.dataclass(frozen=True)
class QSVRGWireReport:
  """Bits of one QSVRG epoch per device, read from the traced collectives.

  Two units: *broadcast* bits are the payloads a device contributes (the sum of the
  operand sizes of its collectives: one dense ``∇f_j(y)`` and T quantized vectors), the
  unit of the paper's ``(F + 2.8n)(T + 1) + Fn`` bound; *received* bits follow
  :func:`jaxcomp.wire_report`'s ring convention (``(K-1)·B`` for an all-gather,
  ``2(K-1)/K·B`` for an all-reduce).
  """

  num_devices: int
  inner_steps: int  # T
  num_params: int  # n, all leaves together
  # the dense exchange of ∇f(y), once per epoch
  snapshot_ops: tuple[collective_trace.CollectiveOp, ...]
  step_ops: tuple[collective_trace.CollectiveOp, ...]  # one inner iteration

  @property
  def snapshot_bits(self) -> int:
    """Bits a device contributes to the dense exchange of ``∇f(y)`` (``32n``)."""
    return 8 * sum(op.operand_bytes * op.count for op in self.snapshot_ops if not op.fallback)

  @property
  def step_bits(self) -> int:
    """Bits a device contributes per inner iteration (its quantized payloads).

    With a codec that has an overflow fallback (:class:`jaxcomp.codecs.EliasQSGD`) this
    is its fixed buffer (plus the 4-byte overflow vote); the fallback path's bits,
    sent only on an overflow, are :attr:`fallback_step_bits`.
    """
    return 8 * sum(op.operand_bytes * op.count for op in self.step_ops if not op.fallback)

  @property
  def fallback_step_bits(self) -> int:
    """Bits per inner iteration of the overflow fallback path, when it is taken."""
    return 8 * sum(op.operand_bytes * op.count for op in self.step_ops if op.fallback)

  @property
  def broadcast_bits_per_epoch(self) -> int:
    """``snapshot_bits + T · step_bits``."""
    return self.snapshot_bits + self.inner_steps * self.step_bits

  @property
  def received_bits_per_epoch(self) -> float:
    """Ring-convention bits received per device per epoch (as ``jc.wire_report``)."""
    return 8 * (
      sum(op.bytes_received for op in self.snapshot_ops if not op.fallback)
      + self.inner_steps * sum(op.bytes_received for op in self.step_ops if not op.fallback)
    )

  @property
  def dense_bits_per_epoch(self) -> int:
    """Broadcast bits of unquantized SVRG, ``(T + 1) · 32n``."""
    return (self.inner_steps + 1) * 32 * self.num_params

  @property
  def paper_bound_bits(self) -> float:
    """Theorem 3.6's ``(F + 2.8n)(T + 1) + Fn`` with ``F = 32`` (Elias-coded payloads)."""
    n, t = self.num_params, self.inner_steps
    return (32 + 2.8 * n) * (t + 1) + 32 * n

  def __str__(self) -> str:
    return "\n".join(
      [
        f"QSVRG wire report, K={self.num_devices} devices, T={self.inner_steps}, "
        f"n={self.num_params}, per device per epoch:",
        f"  broadcast {self.broadcast_bits_per_epoch:,} bits = {self.snapshot_bits:,} (dense "
        f"∇f(y)) + {self.inner_steps} x {self.step_bits:,} (quantized steps)",
        f"  dense SVRG {self.dense_bits_per_epoch:,} bits "
        f"({self.dense_bits_per_epoch / self.broadcast_bits_per_epoch:.2f}x more); "
        f"paper's Elias bound {self.paper_bound_bits:,.0f} bits",
        f"  received (ring convention) {self.received_bits_per_epoch:,.0f} bits",
      ]
    )


def qsvrg_wire_report(
  opt: QSVRG, params, batch, *, axis_name, num_devices: int, inner_steps: int
) -> QSVRGWireReport:
  """Bits per device of a QSVRG epoch with ``inner_steps`` iterations.

  ``opt.snapshot`` and ``opt.step`` are traced inside ``jax.shard_map`` over an abstract
  mesh of ``num_devices`` devices (no devices needed) and their collectives are read
  as in :func:`jaxcomp.wire_report`; an epoch is one snapshot plus ``inner_steps``
  steps.

  Args:
    opt: the result of :func:`qsvrg` (with the same ``axis_name``).
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
    batch: one device's minibatch (arrays or ``jax.ShapeDtypeStruct``); the snapshot is
      traced on it too (its collectives do not depend on the batch size).
    axis_name: the axis ``opt`` averages over.
    num_devices: K >= 2.
    inner_steps: T >= 1.

  Returns:
    A :class:`QSVRGWireReport`.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 2:
    raise ValueError(f"num_devices must be an integer >= 2, got {num_devices!r}")
  if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
    raise ValueError(f"inner_steps must be an integer >= 1, got {inner_steps!r}")
  if axis_name is None:
    raise ValueError("qsvrg_wire_report needs the axis_name opt averages over")
  shapes = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree
  )
  params, batch = shapes(params), shapes(batch)
  state = jax.eval_shape(opt.init, params)
  kw = dict(axis_name=axis_name, num_devices=num_devices)
  ops = collective_trace.collective_ops
  snap = ops(lambda p, s, b: opt.snapshot(p, s, b), params, state, batch, **kw)
  step = ops(lambda p, s, b: opt.step(p, s, b)[0], params, state, batch, **kw)
  n = sum(int(np.prod(p.shape, dtype=np.int64)) for p in jax.tree.leaves(params))
  return QSVRGWireReport(
    num_devices=num_devices,
    inner_steps=inner_steps,
    num_params=n,
    snapshot_ops=collective_trace.merge_ops(snap),
    step_ops=collective_trace.merge_ops(step),
  )
