"""Optax gradient transformations that exchange compressed gradients."""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import contextvars
import functools
from typing import Any
from typing import NamedTuple
import weakref

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src.codecs import base as codecs_lib
from jaxcomp._src.codecs import wangni
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.plumbing import treeutil
from jaxcomp._src.plumbing.treeutil import default_filter as default_filter

Array = jax.Array
_F32 = jnp.float32
FilterFn = Callable[[tuple, Array], bool]


class _Required:
  """The type of :data:`AXIS_REQUIRED`."""

  def __repr__(self) -> str:
    return "<required>"


#: The default of ``axis_name`` in every exchanging transform: there is none. A
#: transform built without an axis would compress locally and exchange nothing, and
#: under ``jax.pmap`` the replicas would drift apart without an error; a sentinel
#: rather than a bare required keyword so that the error can say what to pass
#: (:func:`require_axis_name`).
AXIS_REQUIRED: Any = _Required()


def require_axis_name(axis_name: Any, who: str) -> None:
  """A ``TypeError`` saying what to pass when ``who`` was built without ``axis_name``."""
  if axis_name is AXIS_REQUIRED:
    raise TypeError(
      f"{who} needs axis_name: the name of the mapped axis of jax.shard_map or jax.pmap "
      f"to average over (e.g. axis_name='batch'), or axis_name=None to simulate the "
      f"compression on one device without exchanging anything"
    )


class CompressState(NamedTuple):
  """State of :func:`compress`.

  ``residual``, ``residual_scale`` and ``chunk_residual`` are pytrees shaped like the
  parameters, with an array where a leaf is compressed with error feedback and
  ``optax.MaskedNode()`` elsewhere. All of it is per device (residuals differ between
  devices).
  """

  key: Array  # typed PRNG key, shape=()
  residual: Any  # first-stage error feedback, the gradient leaf's shape, dtype=residual_dtype
  chunk_residual: Any  # second-stage (two-phase) error feedback, shape=codec.chunk_shape
  #                        (leaf shape, K): (chunk,) or (m, columns), dtype=float32
  nonfinite_count: Array  # shape=(), dtype=int32: steps whose input had NaN/Inf
  overflow_count: Array  # shape=(), dtype=int32: steps a codec took its overflow path
  residual_scale: Any = None  # int8 residuals: shape=(ceil(size/256),), dtype=float32
  shapes: treeutil.LeafShapes = None  # static record of the gradient leaves (no arrays)


class _Options(NamedTuple):
  """:func:`compress`'s arguments, checked (static)."""

  codec: codecs_lib.Codec
  axis_name: Any
  collective: str
  error_feedback: bool
  seed: int
  filter_fn: FilterFn
  param_specs: Any
  residual_dtype: str
  error_decay: float = 1.0


def _check_options(
  codec, axis_name, collective, error_feedback, residual_dtype, param_specs
) -> str:
  """Raises on arguments :func:`compress` cannot take; the residual dtype's name."""
  if not isinstance(codec, codecs_lib.Codec):
    raise TypeError(f"codec must be a jaxcomp codec, got {codec!r}")
  if collective not in pipeline.COLLECTIVES:
    raise ValueError(f"collective must be one of {pipeline.COLLECTIVES}, got {collective!r}")
  if codec.fallback is not None and collective not in ("allgather", "auto"):
    raise ValueError(
      f"{type(codec).__name__} (a variable-length format with a fixed-width "
      f"fallback) needs collective='allgather', got {collective!r}"
    )
  if collective == "psum" and codec.summable_fields is None:
    raise ValueError(
      f"collective='psum' needs a codec whose payloads can be summed across devices "
      f"(e.g. RandomK(density, shared=True)); {codec!r} cannot: use 'allgather' or "
      f"'two_phase'"
    )
  if collective == "reduce_scatter" and axis_name is None:
    raise ValueError(
      "collective='reduce_scatter' needs the axis_name the parameters are sharded over"
    )
  if param_specs is not None and collective != "reduce_scatter":
    raise ValueError(
      f"param_specs say which leaves are sharded over the data axis, for "
      f"collective='reduce_scatter'; got collective={collective!r}"
    )
  name = pipeline.residual_dtype(residual_dtype)
  if name != "float32" and not error_feedback:
    raise ValueError(f"residual_dtype={residual_dtype!r} needs error_feedback=True")
  return name


def _check_decay(error_decay, error_feedback: bool) -> float:
  """``error_decay`` as a float in [0, 1]; a decay other than 1 needs error feedback."""
  if (
    isinstance(error_decay, bool)
    or not isinstance(error_decay, (int, float, np.floating))
    or not 0 <= error_decay <= 1
  ):
    raise ValueError(f"error_decay must be a number in [0, 1], got {error_decay!r}")
  if error_decay != 1 and not error_feedback:
    raise ValueError(
      f"error_decay={error_decay!r} decays the residual: it needs error_feedback=True"
    )
  return float(error_decay)


def _decayed(o: _Options, residual, scales):
  """The residuals times ``error_decay`` (an int8 residual: its block scales)."""
  if o.error_decay == 1:
    return residual, scales
  d = jnp.float32(o.error_decay)
  out_e, out_s = [], []
  for e, es in zip(residual, scales):
    if isinstance(e, optax.MaskedNode):
      out_e.append(e)
      out_s.append(es)
    elif e.dtype == jnp.int8:
      out_e.append(e)
      out_s.append(es * d)
    else:
      out_e.append((e.astype(_F32) * d).astype(e.dtype))
      out_s.append(es)
  return out_e, out_s


def _sharded(o: _Options, tree) -> list[bool]:
  """Per leaf of ``tree``, whether it is sharded over the axis (reduce-scatter only)."""
  if o.collective != "reduce_scatter":
    return [False] * len(jax.tree.leaves(tree))
  return pipeline.sharded_leaves(o.param_specs, tree, o.axis_name)


#: While :func:`recording_shard_inits` runs: a list each ``init`` that takes parameter
#: shards (a reduce-scatter) appends to, so that :func:`jaxcomp.state_specs` can tell a
#: chain that expects shards from one that would take a shard for a whole parameter. A
#: context variable, not a module counter: traces on other threads do not interfere.
_SHARD_INITS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "jaxcomp_shard_inits", default=None
)


@contextlib.contextmanager
def recording_shard_inits():
  """Yields a list that gets an entry per ``init`` taking shards inside the block."""
  log: list = []
  token = _SHARD_INITS.set(log)
  try:
    yield log
  finally:
    _SHARD_INITS.reset(token)


def _init_state(o: _Options, params) -> CompressState:
  """Zero residuals for ``params`` (this device's shards, under a reduce-scatter)."""
  leaves, treedef = treeutil.flat(params)
  sharded = _sharded(o, params)
  log = _SHARD_INITS.get()
  if any(sharded) and log is not None:
    log.append(True)
  k = None
  if o.axis_name is not None and o.collective in ("two_phase", "auto", "reduce_scatter"):
    k = collectives.axis_size(o.axis_name)
  grads, residual, scales, chunk_residual, chosen = [], [], [], [], []
  for (path, leaf), sh in zip(leaves, sharded):
    treeutil.check_leaf(path, leaf)
    if sh and not jnp.ndim(leaf):
      raise ValueError(
        f"param at {jax.tree_util.keystr(path)} is 0-d and cannot be sharded over "
        f"{o.axis_name!r}: declare it P() in param_specs"
      )
    like = jax.ShapeDtypeStruct(pipeline.full_shape(jnp.shape(leaf), sh, k), leaf.dtype)
    grads.append(like)  # what update receives: the full-size local gradient
    chosen.append(treeutil.selected(o.filter_fn, path, like))
    on = o.error_feedback and chosen[-1]
    e, es = pipeline.residual_zeros(like.shape, o.residual_dtype) if on else (None, None)
    residual.append(optax.MaskedNode() if e is None else e)
    scales.append(optax.MaskedNode() if es is None else es)
    mode = pipeline.leaf_collective(o.collective, sh)
    two_phase = (
      on
      and o.axis_name is not None
      and mode in ("two_phase", "auto")
      and pipeline.leaf_mode(o.codec, mode, o.axis_name, like.shape, like.dtype) == "two_phase"
    )
    if two_phase:
      shape = pipeline.chunk_residual_shape(o.codec, like.shape, k)
      chunk_residual.append(jnp.zeros(shape, _F32))
    else:
      chunk_residual.append(optax.MaskedNode())
  if o.filter_fn is not _dense_on_purpose:
    pipeline.warn_if_nothing_compressed(
      f"jc.compress ({type(o.codec).__name__})",
      chosen,
      pipeline.filter_rule(o.filter_fn, default_filter),
    )
  return CompressState(
    key=jax.random.key(o.seed),
    residual=treedef.unflatten(residual),
    chunk_residual=treedef.unflatten(chunk_residual),
    nonfinite_count=jnp.zeros((), jnp.int32),
    overflow_count=jnp.zeros((), jnp.int32),
    residual_scale=treedef.unflatten(scales),
    shapes=treeutil.LeafShapes.of(treedef.unflatten(grads)),
  )


def _check_full_size(o: _Options, updates, state: CompressState) -> None:
  """Under a reduce-scatter, a gradient of a sharded leaf shaped like its shard (not the
  full-size local gradient init expects) gets an error that says so."""
  if o.collective != "reduce_scatter" or state.shapes is None:
    return
  leaves, _ = treeutil.flat(updates)
  if len(leaves) != len(state.shapes.shapes):
    return  # the generic check names the missing or extra leaves
  k = collectives.axis_size(o.axis_name)
  for (path, g), want, sh in zip(leaves, state.shapes.shapes, _sharded(o, updates)):
    if sh and want and tuple(jnp.shape(g)) == (want[0] // k,) + tuple(want[1:]):
      raise ValueError(
        f"jc.compress(collective='reduce_scatter'): the gradient at "
        f"{jax.tree_util.keystr(path)} has the shard's shape {tuple(jnp.shape(g))}; update "
        f"takes this device's full-size local gradient {want} (differentiate with respect "
        f"to the gathered parameters) and returns its shard of the mean"
      )


def _flags(o: _Options, plan) -> tuple[Array, Array]:
  """Whether any leaf's input was non-finite, and whether any codec overflowed (agreed
  over a model axis)."""
  any_bad = functools.reduce(jnp.logical_or, [~leaf.finite for leaf in plan], jnp.zeros((), bool))
  any_overflow = functools.reduce(
    jnp.logical_or,
    [leaf.overflow for leaf in plan if leaf.overflow is not None],
    jnp.zeros((), bool),
  )
  if o.axis_name is not None:
    any_bad = collectives.any_over_other_axes(any_bad, o.axis_name)
    any_overflow = collectives.any_over_other_axes(any_overflow, o.axis_name)
  return any_bad, any_overflow


def _update(o: _Options, updates, state: CompressState):
  """One exchange: the mean of ``updates`` (this device's shard of it for sharded
  leaves) and the new state."""
  _check_full_size(o, updates, state)
  opened = pipeline.open_update(updates, state.shapes, "jc.compress")
  key, step_key = jax.random.split(state.key)
  if o.axis_name is not None:
    collectives.axis_size(o.axis_name)  # a clear error where the axis is not bound
    if not o.codec.shared_randomness:  # else every device draws the same bits
      step_key = jax.random.fold_in(step_key, lax.axis_index(o.axis_name))
  scales = state.residual_scale
  scales = opened.flatten(scales) if scales is not None else [None] * len(opened.leaves)
  residuals, scales = _decayed(o, opened.flatten(state.residual), scales)
  plan = [
    pipeline.plan_leaf(
      o.codec,
      o.collective,
      o.axis_name,
      o.filter_fn,
      i,
      path,
      g,
      e,
      e2,
      step_key,
      es=es,
      sharded=sh,
    )
    for i, ((path, g), e, e2, es, sh) in enumerate(
      zip(
        opened.leaves,
        residuals,
        opened.flatten(state.chunk_residual),
        scales,
        _sharded(o, updates),
      )
    )
  ]
  plan = pipeline.run(o.axis_name, plan)
  any_bad, any_overflow = _flags(o, plan)
  new_state = state._replace(
    key=key,
    residual=opened.unflatten([leaf.residual for leaf in plan]),
    chunk_residual=opened.unflatten([leaf.chunk_residual for leaf in plan]),
    nonfinite_count=state.nonfinite_count + any_bad.astype(jnp.int32),
    overflow_count=state.overflow_count + any_overflow.astype(jnp.int32),
    residual_scale=(
      None
      if state.residual_scale is None
      else opened.unflatten([leaf.residual_scale for leaf in plan])
    ),
  )
  return opened.unflatten([leaf.out for leaf in plan]), new_state


def compress(
  codec: codecs_lib.Codec,
  *,
  axis_name: Any = AXIS_REQUIRED,
  collective: str = "auto",
  error_feedback: bool = False,
  seed: int = 0,
  filter: FilterFn | None = None,  # pylint: disable=redefined-builtin
  param_specs: Any = None,
  residual_dtype: Any = jnp.float32,
  error_decay: float = 1.0,
) -> optax.GradientTransformation:
  r"""Exchanges the gradient through a compressed collective and returns its mean.

  Inside ``jax.shard_map`` or ``jax.pmap`` with ``axis_name`` bound, ``update`` encodes
  each selected leaf with ``codec``, moves the *payloads* (packed integers and scales)
  through the collective, decodes them and returns the mean over devices, identical on
  every device. Leaves the filter leaves out are averaged in full precision, all in one
  all-reduce (``lax.pmean`` of one flat buffer per dtype), or on 2 devices with the
  all-gather exchange inside the payloads' all-gather (the same bytes, the same sums,
  one collective per step). With ``axis_name=None`` the leaf is encoded and decoded
  locally (a one-device simulation).

  Collectives:

  * ``"allgather"``: all-gather the payloads, decode all K and average them. Traffic per
    device ``(K-1)·B``: grows with K, but needs only one round.
  * ``"two_phase"``: the scatter-reduce/all-gather pattern of 1-bit SGD §3.1: the tensor
    is cut into K chunks; chunk j's payloads go to device j (``all_to_all``), which
    averages them, re-encodes the average and all-gathers it. Traffic per device about
    ``2(K-1)/K·B``, flat in K; the average is quantized a second time.
  * ``"auto"`` (the default): the route with the fewest bytes at the device count it
    runs on, per leaf (:func:`jaxcomp._src.exchanges.pipeline.resolve`): ``"allgather"``
    on K <= 2 devices, ``"two_phase"`` on more, except for a leaf whose two-phase chunks
    would cost as many bytes as the whole leaf (mostly padding or per-chunk scales, as
    in a short vector), and ``"psum"`` for summable payloads. Codecs with no two-phase
    route take the all-gather at every K: sparse codecs (``TopK``, ``RandomK``, the
    Wangni sparsifier), whose chunk owner would sparsify the average of K sparse chunks
    again and keep about 1/K of it, and codecs with a fallback. On two devices the
    all-gather and the two-phase exchange both move ``B`` per device, but the all-gather
    encodes and decodes once, takes one collective instead of two, and does not quantize
    the average a second time.
  * ``"psum"``: for linear payloads (``codec.summable_fields``, e.g.
    ``RandomK(density, shared=True)``, whose indices are the same on every device): the
    values are all-reduced with ``lax.psum``; traffic ``2(K-1)/K`` times the values'
    bytes, flat in K, and shared indices never cross the wire.
  * ``"reduce_scatter"``: for parameters sharded over ``axis_name`` (ZeRO/FSDP, as
    ZeRO++'s qgZ): ``init`` takes this device's parameter *shards* (each leaf cut along
    its first axis, as ``P(axis_name)`` cuts it), ``update`` this device's full-size
    local gradient, and returns this device's *shard* of the mean. Each leaf is cut into
    K rows, row j encoded and sent to device j in one ``all_to_all`` for all leaves;
    the owner decodes its K payloads and sums them in float32
    (:func:`jaxcomp._src.exchanges.collectives.reduce_scatter_means`). Traffic per device
    ``(K-1)/K·B``, half the two-phase exchange's, with one quantization. Leaves that
    ``param_specs`` declare unsharded are averaged and returned whole (as ``"auto"``);
    sharded leaves the filter leaves out take a dense ``psum_scatter``. An optimizer
    chained after it runs on the shards, so its state is sharded too (ZeRO-1/2); see
    ``docs/guides/sharded.md``.

  The compressed leaves share each collective: their payloads are encoded first, then
  moved in one ``all_gather`` (``"allgather"``) or one ``all_to_all`` and one
  ``all_gather`` (``"two_phase"``), so a step pays each collective's latency once, not
  once per leaf and payload array. Exceptions: codecs with a fallback exchange each
  leaf in its own overflow branch (one all-gather per leaf), and ``"psum"`` issues one
  all-reduce per leaf, which XLA combines like the dense leaves' ``pmean``\ s.

  Codecs with a static capacity for a random number of entries
  (:class:`jaxcomp.codecs.UnbiasedSparsifier`) take an unbiased overflow path when it is
  exceeded; ``overflow_count`` in the state counts the steps where that happened.

  Error feedback (``error_feedback=True``, Seide et al. 2014, §3): with ``e`` the
  residual of the previous step, the device sends ``Q(g + e)`` and keeps
  ``e' = g + e - Q^{-1}(Q(g + e))``, so no part of the gradient is ever dropped, only
  delayed. In the two-phase exchange the owner of each chunk keeps a second residual for
  its re-quantization in the same way. Residuals are float32 whatever the gradient dtype,
  unless ``residual_dtype`` says otherwise: ``jnp.bfloat16`` halves them and ``"int8"``
  holds a quarter (an int8 per value and a float32 scale per 256 values, rounded to
  nearest), for a sharded model whose full-size float32 residual would cost more than
  its shards.
  ``error_decay=β`` decays the residual before it is added (SparseLoCo, Sarfi et al.
  2025): the device sends ``Q(g + β e)`` and keeps ``e' = g + β e - Q^{-1}(Q(g + β e))``,
  so ``e`` is an exponential moving sum of what was not sent, whose old entries fade
  instead of waiting, however stale, for their turn (:func:`jaxcomp.sparseloco`, where
  ``e`` stands in for DiLoCo's outer momentum). It applies to the first-stage residual
  only, not to a two-phase owner's, and a step whose input was not finite keeps the
  decayed residual.
  With the all-gather exchange and a codec whose kernel fuses it
  (:meth:`~jaxcomp.codecs.Codec.fuses_feedback`: QSGD and OneBit on a GPU, and on a CPU
  with the native kernels for float32 gradients), the sum
  ``g + e``, the encoding and ``e'`` are one kernel pass, and receivers decode the K
  payloads straight into their sum.

  NaN/Inf policy: a leaf whose input is not finite on this device does not update its
  residual (the previous residual is kept, so the error-feedback state is never
  poisoned), ``nonfinite_count`` in the state counts such steps (compressed and
  full-precision leaves alike), and the returned mean is not finite either, on every
  device (a NaN is never hidden). To skip such steps wrap the whole chain in
  :func:`jaxcomp.skip_nonfinite`, which decides from that mean, the same on every
  device; not in ``optax.apply_if_finite``, whose per-device branch around the
  collectives deadlocks under ``jax.pmap``.

  Gradients must match the parameters given to ``init`` (keys, shapes, dtypes): a
  ``ValueError`` names the first leaf that does not.

  Randomness: the state holds a typed key, split every step and folded with the device
  index, so devices draw independent bits and the same ``seed`` gives the same run.

  Under ``jax.shard_map`` the state differs between devices; hold it with a leading
  device axis (see :func:`per_device_state`). Under ``jax.pmap`` it is per device already.

  Args:
    codec: a :mod:`jaxcomp.codecs` codec.
    axis_name: the mapped axis to average over (required, like the axis of the
      ``jax.shard_map`` or ``jax.pmap`` it runs in), or ``None``: the explicit
      one-device simulation, which encodes and decodes locally and exchanges nothing.
    collective: ``"auto"`` (default: the route with the fewest bytes at this device
      count, see above), ``"allgather"``, ``"two_phase"``, ``"psum"`` or
      ``"reduce_scatter"``.
    error_feedback: keep and re-inject the compression error.
    seed: seed of the state's PRNG key.
    filter: ``filter(path, leaf) -> bool`` choosing which leaves are compressed
      (decided from path, shape and dtype of the gradient leaf); defaults to
      :func:`default_filter`.
    param_specs: with ``collective="reduce_scatter"``, the parameters'
      ``PartitionSpec``\ s (a pytree like the parameters, or a prefix of it): leaves
      whose spec starts with ``axis_name`` are sharded, the others averaged whole.
      ``None``: every leaf is sharded, ``P(axis_name)``.
    residual_dtype: the error-feedback residual's dtype: ``jnp.float32`` (default),
      ``jnp.bfloat16`` or ``jnp.int8`` (block-scaled); needs ``error_feedback=True``.
    error_decay: ``β`` in [0, 1], the factor of the residual each step (default 1: none);
      other values need ``error_feedback=True``.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the (compressed) mean gradient.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp as jc
    >>> codec = jc.codecs.QSGD(7, 512, "max")
    >>> tx = optax.chain(jc.compress(codec, axis_name=None), optax.sgd(0.1))  # one device
    >>> params = {"w": jnp.ones((64, 32))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((64, 32))}, state, params)
    >>> updates["w"].shape
    (64, 32)
  """
  require_axis_name(axis_name, "jc.compress")
  name = _check_options(codec, axis_name, collective, error_feedback, residual_dtype, param_specs)
  o = _Options(
    codec,
    axis_name,
    collective,
    error_feedback,
    seed,
    default_filter if filter is None else filter,
    param_specs,
    name,
    _check_decay(error_decay, error_feedback),
  )

  def init_fn(params):
    return _init_state(o, params)

  def update_fn(updates, state, params=None):
    del params
    return _update(o, updates, state)

  tx = optax.GradientTransformation(init_fn, update_fn)
  return register_exchange(tx, f"jc.compress ({type(codec).__name__})", axis_name, collective)


def qsgd(
  bits: int = 4,
  bucket_size: int | None = 512,
  norm: str = "max",
  *,
  levels: int | None = None,
  axis_name: Any = AXIS_REQUIRED,
  collective: str = "auto",
  error_feedback: bool = False,
  seed: int = 0,
  filter: FilterFn | None = None,  # pylint: disable=redefined-builtin
  implementation: str | None = None,
  param_specs: Any = None,
  residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
  r"""QSGD: stochastic quantization of the gradient exchange to ``s`` levels per sign.

  Uses :class:`jaxcomp.codecs.QSGD` on buckets of ``bucket_size`` values scaled by their
  max (``norm="max"``, the paper's practical variant, §4) or l2 norm (the quantizer of
  §3). The quantizer is unbiased, ``E[Q(v)] = v``, with variance at most
  ``min(d/s^2, sqrt(d)/s) ||v||^2`` per bucket of ``d`` values (Lemma 3.1), so it needs
  no error feedback.

  ``bits`` is the width of a value on the wire, sign included: ``s = 2**(bits-1) - 1``
  levels per sign fill it exactly (the magnitude ``s·ξ_i`` in ``0..s`` takes
  ``bits - 1`` bits), so 4 bits is ``s = 7`` and 2 bits ``s = 1`` (ternary). ``levels``
  sets ``s`` directly instead (and wins over ``bits``): the value then takes
  ``ceil(log2(s + 1)) + 1`` bits. The paper's §4 example, 4 bits with buckets of 512 and
  the bound ``sqrt(512)/2^4 ≈ 1.41``, counts ``s = 2^4 = 16``, which is ``levels=16``
  here (6 bits per value on the wire); its §5 experiments use 2 bits with buckets of
  128, and 4 or 8 bits with buckets of 512. ``docs/methods/qsgd.md`` tabulates bits,
  ``s`` and the bound.

  Chain it before the optimizer: ``optax.chain(jc.qsgd(axis_name="batch"), optax.adam(1e-3))``.

  Caveats. With ``collective="two_phase"`` the owner of each chunk quantizes the
  average a second time; that noise is not averaged over devices, so at 2 bits the
  exchange is noisier than ``"allgather"`` (which sends ``K/2`` times more bytes).
  Error feedback assumes a compressor that shrinks its input
  (``||Q(x) - x|| < ||x||``); coarse unbiased QSGD (2 bits: variance up to
  ``sqrt(d)`` times ``||x||^2``) is not one, and with ``error_feedback=True`` it trains
  worse, not better: keep the default ``False`` for QSGD. The default filter
  (:func:`default_filter`) quantizes tensors from 1024 values and 2 dimensions; the paper
  leaves tensors under 10K values unquantized (§5): pass
  ``filter=lambda path, leaf: leaf.size >= 10_000`` for that.

  Args:
    bits: bits per value on the wire, sign included (>= 2); ``s = 2**(bits-1) - 1``.
    bucket_size: values per bucket (``None``: one bucket per tensor).
    norm: ``"max"`` or ``"l2"``.
    levels: ``s``, levels per sign (``1 <= s < 2**24``), instead of ``bits``.
    axis_name, collective, error_feedback, seed, filter, param_specs, residual_dtype: as
      in :func:`compress`. The default ``collective="auto"`` all-gathers on two devices
      and runs the two-phase exchange on more, whose per-device traffic is flat in the
      device count; ``"reduce_scatter"`` returns this device's shard of the mean for
      sharded parameters (ZeRO++'s qgZ: unbiased, no feedback needed).
    implementation: the codec's (``None``: Pallas kernels on a CUDA GPU, the native
      kernels on a CPU backend, else XLA; ``"xla"``, ``"pallas"`` or ``"native"``).

  Returns:
    An ``optax.GradientTransformation`` (:func:`compress` with the QSGD codec).

  Example:
    >>> import jaxcomp as jc
    >>> tx = jc.qsgd(levels=16, axis_name="batch")  # the paper's s = 2^4: 6 bits a value
    >>> tx = jc.qsgd(bits=4, axis_name="batch")     # 4 bits a value: s = 7

  References:
    Alistarh et al. *QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding*. NeurIPS 2017. https://arxiv.org/abs/1610.02132
  """
  require_axis_name(axis_name, "jc.qsgd")
  if isinstance(bits, bool) or not isinstance(bits, int) or bits < 2:
    raise ValueError(f"bits must be an integer >= 2 (sign included), got {bits!r}")
  if levels is None:
    levels = 2 ** (bits - 1) - 1
  codec = codecs_lib.QSGD(levels, bucket_size, norm, implementation)  # validates levels
  return compress(
    codec,
    axis_name=axis_name,
    collective=collective,
    error_feedback=error_feedback,
    seed=seed,
    filter=filter,
    param_specs=param_specs,
    residual_dtype=residual_dtype,
  )


class _DefaultBucket(int):
  """``onebit_sgd``'s default bucket size: 1024, told apart from an explicit 1024 (with
  ``per_column=True`` only an explicit one is an error)."""

  def __repr__(self) -> str:
    return "1024"


_ONEBIT_BUCKET = _DefaultBucket(1024)


def onebit_sgd(
  *,
  bucket_size: int | None = _ONEBIT_BUCKET,
  per_column: bool = False,
  axis_name: Any = AXIS_REQUIRED,
  collective: str = "auto",
  seed: int = 0,
  filter: FilterFn | None = None,  # pylint: disable=redefined-builtin
  implementation: str | None = None,
  param_specs: Any = None,
  residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
  r"""1-bit SGD with error feedback and the two-phase exchange (Seide et al., 2014).

  Each device sends ``G_q(t) = Q(G(t) + Δ(t-1))`` with :class:`jaxcomp.codecs.OneBit`
  (a sign bit per value; each bucket decodes to the mean of its non-negative and of its
  negative entries) and keeps ``Δ(t) = G(t) + Δ(t-1) - Q^{-1}(G_q(t))``. The exchange is
  the paper's §3.1 scheme: each device owns 1/K of the gradient, receives the K quantized
  slices of it, sums them, re-quantizes the sum with its own error feedback and sends it
  to all, so per-device traffic does not grow with K (``32 / (1 + 64/1024)``, about 30x
  less than a float32 all-reduce with buckets of 1024). On two devices
  (``collective="auto"``, the default) the payloads are all-gathered instead: the same
  bytes, half the encoding work, one collective, and the sum is not quantized a second
  time.

  The buckets are ``bucket_size`` consecutive values by default, or, with
  ``per_column=True``, the paper's: one pair of reconstruction values per column of each
  matrix (a tensor of shape ``(m, ...)`` viewed as ``(m, prod(rest))``), exchanged in
  chunks of whole columns. A column of m values then costs ``m + 64`` bits, so short
  columns (a flax convolution kernel ``(width, in, out)`` has columns of ``width``
  values) cost far more than 1 bit per value. The column axis is the first one: a flax
  ``Dense`` kernel ``(in, out)`` has ``out`` columns of ``in`` values, one per output
  unit (its fan-in weights), and a vector is one column. Where K does not divide the
  number of columns (fewer columns than devices, a vector), the two-phase exchange cuts
  each column into segments with a pair of means each rather than send zero columns
  (:meth:`~jaxcomp.codecs.OneBit.column_segments`); ``collective="auto"`` all-gathers a
  leaf wherever the two-phase exchange would still move as many bytes or more.

  The paper applies AdaGrad/momentum to the aggregated gradient: chain this *before* the
  optimizer, e.g. ``optax.chain(jc.onebit_sgd(axis_name="batch"), optax.sgd(0.1, 0.9))``.

  Args:
    bucket_size: values per reconstruction bucket (default 1024; ``None``: one bucket
      per tensor). Not with ``per_column=True``.
    per_column: one pair of reconstruction values per matrix column (the paper, §3).
    axis_name, collective, seed, filter, param_specs, residual_dtype: as in
      :func:`compress` (``collective="reduce_scatter"`` for sharded parameters).
    implementation: the codec's (``None``: Pallas kernels on a CUDA GPU, the native
      kernels on a CPU backend, else XLA; ``"xla"``, ``"pallas"`` or ``"native"``).
      ``per_column=True`` runs on XLA.

  Returns:
    An ``optax.GradientTransformation`` (:func:`compress` with error feedback).

  References:
    Seide, Fu, Droppo, Li, Yu. *1-Bit Stochastic Gradient Descent and its Application
    to Data-Parallel Distributed Training of Speech DNNs*. Interspeech 2014.
  """
  require_axis_name(axis_name, "jc.onebit_sgd")
  if per_column:
    if bucket_size is not _ONEBIT_BUCKET and bucket_size is not None:
      raise ValueError(
        f"per_column=True takes each matrix column as a bucket; "
        f"bucket_size={bucket_size!r} cannot be combined with it"
      )
    bucket_size = None
  elif isinstance(bucket_size, _DefaultBucket):
    bucket_size = int(bucket_size)
  codec = codecs_lib.OneBit(bucket_size, implementation, per_column=per_column)
  return compress(
    codec,
    axis_name=axis_name,
    collective=collective,
    error_feedback=True,
    seed=seed,
    filter=filter,
    param_specs=param_specs,
    residual_dtype=residual_dtype,
  )


def ef_signsgd(
  *,
  bucket_size: int | None = None,
  axis_name: Any = AXIS_REQUIRED,
  collective: str = "auto",
  seed: int = 0,
  filter: FilterFn | None = None,  # pylint: disable=redefined-builtin
  param_specs: Any = None,
  residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
  r"""EF-signSGD: the scaled sign with error feedback (Karimireddy et al., 2019).

  Each device compresses ``p = g + e`` with :class:`jaxcomp.codecs.ScaledSign`,
  ``C(p) = ‖p‖₁/d · sign(p)`` per bucket of ``d`` values (one sign bit per value and one
  float32 scale per bucket on the wire), sends it, and keeps ``e' = p - C(p)``; the
  mean over devices of the ``C(p)`` is returned. The scaled sign is biased, and
  error feedback is what makes it converge at SGD's rate (the paper's analysis of EF-SGD
  holds for any δ-approximate compressor). ``collective="auto"`` all-gathers the payloads on two
  devices and runs the two-phase exchange on more (the chunk owners compress the
  average again, with their own error feedback), as for :func:`onebit_sgd`.

  The paper folds the step size into what is compressed (``p = γ g + e``); here the
  residual is kept in gradient units and the optimizer applies the step afterwards,
  which is the same algorithm for a constant step (``C`` is positively homogeneous:
  ``C(γ p) = γ C(p)``) and chains with any optimizer. Chain it before the optimizer:
  ``optax.chain(jc.ef_signsgd(axis_name="batch"), optax.sgd(0.1))``.

  Args:
    bucket_size: values per scale (``None``: one scale per tensor, the paper's
      ``‖p‖₁/d`` over the whole vector; in the two-phase exchange, per chunk).
    axis_name, collective, seed, filter, param_specs, residual_dtype: as in
      :func:`compress` (``collective`` is ``"allgather"``, ``"two_phase"``, ``"auto"``
      or ``"reduce_scatter"``; ``seed`` is unused by this deterministic codec but kept
      for the state's key).

  Returns:
    An ``optax.GradientTransformation`` (:func:`compress` with error feedback).

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp as jc
    >>> tx = optax.chain(jc.ef_signsgd(axis_name=None), optax.sgd(0.1))  # one device
    >>> params = {"w": jnp.ones((64, 32))}
    >>> updates, _ = tx.update({"w": jnp.ones((64, 32))}, tx.init(params), params)

  References:
    Karimireddy, Rebjock, Stich, Jaggi. *Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes*. ICML 2019. https://arxiv.org/abs/1901.09847
  """
  require_axis_name(axis_name, "jc.ef_signsgd")
  if collective not in ("allgather", "two_phase", "auto", "reduce_scatter"):
    raise ValueError(
      f"ef_signsgd's collective must be 'allgather', 'two_phase', 'auto' or "
      f"'reduce_scatter', got {collective!r}"
    )
  return compress(
    codecs_lib.ScaledSign(bucket_size),
    axis_name=axis_name,
    collective=collective,
    error_feedback=True,
    seed=seed,
    filter=filter,
    param_specs=param_specs,
    residual_dtype=residual_dtype,
  )


class ExchangeInfo(NamedTuple):
  """What a wrapper needs to know of a jaxcomp exchange it is given (static)."""

  who: str  # the factory's name, for errors
  axis_name: Any  # the axis it averages over
  collective: str | None  # its collective argument (None: a method without one)
  shardable: str | None  # None: it runs on any shards of the leaves; else why not
  # Its own two-level schedule, ``two_level(fast_axis) -> GradientTransformation``, for
  # an exchange that must not run on shards cut by the generic one (PowerSGD's matrices
  # kept as matrices); None: the generic one (or none, where ``shardable`` says why).
  two_level: Callable[[Any], optax.GradientTransformation] | None = None


#: The jaxcomp exchanges built so far, by their ``init`` function: what
#: :func:`jaxcomp.two_level` checks before running one on shards of the gradient (an
#: optax transform cannot be asked which axis it averages over, or whether it may be
#: cut into shards).
_EXCHANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_exchange(
  tx: optax.GradientTransformation,
  who: str,
  axis_name: Any,
  collective: str | None = None,
  shardable: str | None = None,
  two_level: Callable[[Any], optax.GradientTransformation] | None = None,
) -> optax.GradientTransformation:
  """Records ``tx`` as a jaxcomp exchange (:class:`ExchangeInfo`); returns ``tx``.

  ``two_level``, when given, is what :func:`jaxcomp.two_level` runs in place of its
  generic schedule (the wrapped exchange on 1/L shards of each leaf): a factory taking
  the fast axis and returning the whole two-level exchange, state placement included.
  """
  _EXCHANGES[tx.init] = ExchangeInfo(who, axis_name, collective, shardable, two_level)
  return tx


def exchange_info(tx: optax.GradientTransformation) -> ExchangeInfo | None:
  """The :class:`ExchangeInfo` of a jaxcomp exchange, or None for any other transform."""
  return _EXCHANGES.get(tx.init)


class PerDeviceState(NamedTuple):
  """State of :func:`per_device_state`: the inner state with a leading device axis."""

  inner: Any  # the wrapped transform's state, every leaf with a leading axis of 1 per device


#: The ``init`` functions of the transforms that place their own state under shard_map
#: (replicated by design, or with their per-device parts wrapped already):
#: :func:`per_device_state` hands them back unchanged.
_PLACES_OWN_STATE: weakref.WeakSet = weakref.WeakSet()


def places_own_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Registers ``tx`` as placing its own state (:func:`per_device_state` returns it)."""
  _PLACES_OWN_STATE.add(tx.init)
  return tx


def places_own(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx`` places its own state (:func:`places_own_state`)."""
  return tx.init in _PLACES_OWN_STATE


def per_device_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Marks ``tx``'s state as per device, with a leading axis of size 1 on each device.

  Under ``jax.shard_map`` a value that differs between devices (error-feedback
  residuals, device-folded keys) cannot be held as replicated. Wrap the compressor (and
  only it: the optimizer after it sees identical updates on every device, so its state
  stays replicated) and pass its state with ``P(axis_name)``: globally each leaf has a
  leading axis of length K, one row per device, checkpointable as one array.
  :func:`state_specs` builds the specs of a whole chain::

    tx = optax.chain(jc.per_device_state(jc.onebit_sgd(axis_name="b")), optax.sgd(0.1))
    specs = jc.state_specs(tx, params, axis_name="b", num_devices=mesh.size)
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    step = jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("b")),
                         out_specs=(P(), specs))

  Wrapping is correct for every jaxcomp transform, so one pattern serves every method:
  :func:`jaxcomp.mipd` (whose state is the same on every device) and
  :func:`jaxcomp.onebit_adam` (whose state holds replicated moments beside per-device
  buffers it wraps itself) come back unchanged. Wrap the transform itself, not a chain
  around those two.

  Under ``jax.pmap`` state is per device already; do not wrap.
  """
  if tx.init in _PLACES_OWN_STATE:
    return tx

  def init_fn(params):
    return PerDeviceState(jax.tree.map(lambda x: x[None], tx.init(params)))

  def update_fn(updates, state, params=None):
    inner = jax.tree.map(lambda x: x[0], state.inner)
    updates, inner = tx.update(updates, inner, params)
    return updates, PerDeviceState(jax.tree.map(lambda x: x[None], inner))

  return optax.GradientTransformation(init_fn, update_fn)


def _dense_on_purpose(path, leaf) -> bool:
  """The filter of :func:`dense_mean`'s reduce-scatter: no leaf is compressed, which
  :func:`compress` would otherwise warn of as a likely mistake."""
  del path, leaf
  return False


def dense_mean(
  *, axis_name: Any = AXIS_REQUIRED, collective: str = "psum", param_specs: Any = None
) -> optax.GradientTransformation:
  r"""The dense exchange as a transform: the mean gradient, uncompressed.

  .. math:: g \leftarrow \frac{1}{K} \sum_{k=1}^{K} g_k

  over the ``K`` devices of ``axis_name``. It is the A/B baseline for the compressors:
  a chain that swaps ``jc.qsgd(...)`` for ``jc.dense_mean(...)`` with the same
  ``collective`` changes nothing but the exchange's codec, and :func:`wire_report`
  prices it at the dense baseline.

  * ``collective="psum"`` (default): each leaf in its own dtype, exactly ``lax.pmean``
    of every leaf, with no state. The leaves of one dtype travel as one all-reduce
    (:func:`jaxcomp.pmean_tree`), as data-parallel frameworks bucket gradients: a
    ``pmean`` per leaf pays one message round per leaf.
  * ``collective="reduce_scatter"``: for parameters sharded over ``axis_name``
    (ZeRO-1/2), the dense counterpart of :func:`compress`'s reduce-scatter, with its
    contract: ``init`` takes this device's parameter shards, ``update`` its full-size
    local gradient and returns its shard of the mean: ``lax.psum_scatter(g,
    tiled=True) / K`` of the sharded leaves (one reduce-scatter per dtype) and the mean,
    whole, of those ``param_specs`` declare unsharded. Its state is :func:`compress`'s
    (the leaf shapes it checks gradients against; no residual).

  Under ``jax.shard_map`` take the gradient with respect to ``jc.vary(params, axis)``
  (else ``jax.grad`` has psummed it already, and this would average a mean); under
  ``jax.pmap`` the gradient is per device as it is.

  Args:
    axis_name: the axis (or tuple of axes) to average over.
    collective: ``"psum"`` or ``"reduce_scatter"``.
    param_specs: with ``"reduce_scatter"``, as in :func:`compress`.

  Returns:
    An ``optax.GradientTransformation``; its state is ``optax.EmptyState()`` for
    ``"psum"``.

  Example:
    >>> import optax, jaxcomp as jc
    >>> tx = optax.chain(jc.dense_mean(axis_name="batch"), optax.sgd(0.1))
  """
  if axis_name is AXIS_REQUIRED or axis_name is None:
    raise TypeError(
      "jc.dense_mean needs axis_name: the name of the mapped axis of jax.shard_map or "
      f"jax.pmap to average over (e.g. axis_name='batch'), got {axis_name!r}"
    )
  if collective == "reduce_scatter":
    return compress(
      codecs_lib.Identity(),
      axis_name=axis_name,
      collective=collective,
      filter=_dense_on_purpose,
      param_specs=param_specs,
    )
  if collective != "psum":
    raise ValueError(
      f"jc.dense_mean's collective must be 'psum' or 'reduce_scatter', got {collective!r}"
    )
  if param_specs is not None:
    raise ValueError(
      "param_specs say which leaves are sharded over the data axis, for "
      "collective='reduce_scatter'; jc.dense_mean(collective='psum') averages every leaf whole"
    )

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return collectives.pmean_tree(updates, axis_name), state

  return optax.GradientTransformation(init_fn, update_fn)


def sparsify(
  epsilon: float | None = None,
  density: float | None = None,
  method: str = "greedy",
  *,
  axis_name: Any = AXIS_REQUIRED,
  error_feedback: bool = False,
  capacity: float | None = None,
  seed: int = 0,
  filter: FilterFn | None = None,  # pylint: disable=redefined-builtin
  collective: str = "auto",
  param_specs: Any = None,
  residual_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
  r"""Optimal unbiased sparsification of the gradient exchange (Wangni et al., 2018).

  Each device sends ``Q(g)_i = Z_i g_i / p_i`` with ``Z_i ~ Bernoulli(p_i)`` and
  ``p_i = min(λ|g_i|, 1)`` (:class:`jaxcomp.codecs.UnbiasedSparsifier`): entries with
  ``p_i = 1`` as (index, value), the others as (index, sign) plus one shared ``1/λ``.
  ``method="greedy"`` (Algorithm 3) aims at ``density`` kept entries in expectation;
  ``method="exact"`` (Algorithm 2) keeps the fewest entries in expectation with
  ``E||Q(g)||² <= (1 + epsilon)||g||²``. The payloads are all-gathered and averaged.

  ``Q`` is unbiased, so no error feedback is needed (``error_feedback=True`` is offered
  and carries ``g - Q(g)`` forward). The payload has a static capacity; a draw that
  exceeds it is thinned unbiasedly and counted in the state's ``overflow_count``.

  Chain it before the optimizer: ``optax.chain(jc.sparsify(density=0.05,
  axis_name="b"), optax.sgd(lr, momentum=0.9))``.

  Args:
    epsilon: variance budget of ``method="exact"``.
    density: expected fraction of entries sent (``"greedy"``); with ``"exact"`` the
      density the payload's capacity is planned for.
    method: ``"greedy"`` or ``"exact"``.
    axis_name, error_feedback, seed, filter: as in :func:`compress`.
    capacity: override of the payload capacity (see the codec).
    collective: ``"auto"`` (default), which is the all-gather at every device count
      (the sparsifier has no two-phase route: a chunk owner would sparsify the average
      of K sparse chunks again), ``"allgather"``, or ``"reduce_scatter"`` (for parameters
      sharded over ``axis_name``; each device's row of each leaf is sparsified on its own).
    param_specs, residual_dtype: as in :func:`compress`.

  References:
    Wangni, Wang, Liu, Zhang. *Gradient Sparsification for Communication-Efficient
    Distributed Optimization*. NeurIPS 2018. https://arxiv.org/abs/1710.09854
  """
  require_axis_name(axis_name, "jc.sparsify")
  if collective not in ("auto", "allgather", "reduce_scatter"):
    raise ValueError(
      f"sparsify's collective must be 'auto', 'allgather' or 'reduce_scatter', got {collective!r}"
    )
  codec = wangni.UnbiasedSparsifier(
    epsilon=epsilon, density=density, method=method, capacity=capacity
  )
  return compress(
    codec,
    axis_name=axis_name,
    collective=collective,
    error_feedback=error_feedback,
    seed=seed,
    filter=filter,
    param_specs=param_specs,
    residual_dtype=residual_dtype,
  )
