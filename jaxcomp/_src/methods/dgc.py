"""Deep Gradient Compression (Lin et al., ICLR 2018) as an optax transform.

Written as named steps over a frozen :class:`_Options`: ``_local_gradients`` (local
clipping), ``_dense_momentum`` for the leaves left out, ``_accumulate`` (momentum
correction), ``_sparse_leaves`` (selection, masking, the exchange of one warm-up
stage), ``_exchange`` (the stage's ``lax.switch``), wired by ``_update``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxcomp._src.codecs import base as codecs_lib
from jaxcomp._src.codecs import sparse
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import hierarchy
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import transforms
from jaxcomp._src.plumbing import phases
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32
COLLECTIVES = ("auto", "allgather", "chunked")
CLIP_MODES = ("global", "per_tensor")


def warmup_densities(density: float, warmup_steps: int) -> tuple[tuple[int, float], ...]:
  """The stages of DGC's exponential warm-up: ``((first_step, density), ...)``.

  The paper raises the sparsity over the first epochs as 75%, 93.75%, 98.4375%, 99.6%
  and then holds 99.9%: densities ``0.25**j`` (j = 1, 2, ...) while they exceed the
  target ``density``, each for an equal share of ``warmup_steps``, then ``density``.
  With ``warmup_steps=0`` (or a target of at least 25%) there is one stage.
  """
  sparse.check_density(density)
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
  stages = []
  if warmup_steps > 0:
    d = 0.25
    while d > density:
      stages.append(d)
      d *= 0.25
  out = [(warmup_steps * j // len(stages), d) for j, d in enumerate(stages)]
  out.append((warmup_steps if stages else 0, float(density)))
  return tuple(out)


def dgc_density_schedule(density: float = 0.001, warmup_steps: int = 0) -> optax.Schedule:
  """DGC's warm-up as an optax schedule: step count -> density sent at that step.

  >>> import jaxcomp as jc
  >>> sched = jc.dgc_density_schedule(0.001, warmup_steps=400)
  >>> [round(float(sched(s)), 6) for s in (0, 100, 200, 300, 400)]
  [0.25, 0.0625, 0.015625, 0.003906, 0.001]
  """
  stages = warmup_densities(density, warmup_steps)
  starts = jnp.asarray([s for s, _ in stages], jnp.int32)
  values = jnp.asarray([d for _, d in stages], _F32)

  def schedule(count):
    return values[_stage(jnp.asarray(count, jnp.int32), starts)]

  return schedule


def _stage(count: Array, starts: Array) -> Array:
  return (
    jnp.sum(count >= starts[1:], dtype=jnp.int32)
    if starts.shape[0] > 1
    else (jnp.zeros((), jnp.int32))
  )


class DGCState(NamedTuple):
  """State of :func:`dgc`, all of it per device (see :func:`jaxcomp.per_device_state`).

  ``momentum`` has an array for every leaf (dense leaves get momentum SGD too);
  ``velocity`` (the locally accumulated, not yet sent update) only for the compressed
  leaves, ``optax.MaskedNode()`` elsewhere.
  """

  count: Array  # shape=(), int32: steps taken (drives the warm-up)
  key: Array  # typed PRNG key (the sampled threshold's sample)
  momentum: Any  # u, float32, leaf shapes
  velocity: Any  # v, float32, leaf shapes for compressed leaves
  nonfinite_count: Array  # shape=(), int32: steps skipped because g had NaN/Inf
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


def _clip(gs: list[Array], threshold: float, mode: str) -> list[Array]:
  """Scales the leaves down to ``threshold``: by their joint norm, or each by its own.

  On shards (inside :func:`jaxcomp.two_level`, where a node is DGC's worker) a norm is
  the whole leaf's: the squares are summed over the node's devices."""
  thr = jnp.float32(threshold)

  def factor(sq):
    norm = jnp.sqrt(sq)
    return jnp.where(norm > thr, thr / jnp.where(norm > 0, norm, 1.0), 1.0)

  squares = [jnp.sum(jnp.square(g)) for g in gs]
  if mode == "global":
    scale = factor(hierarchy.sum_over_shards(sum(squares)))
    return [g * scale for g in gs]
  squares = hierarchy.sum_over_shards(jnp.stack(squares))  # one psum for every leaf
  return [g * factor(squares[i]) for i, g in enumerate(gs)]


def _check_options(density, warmup_steps, momentum, clip_norm, clip, collective, chunk_size):
  """Every argument check of :func:`dgc`, in one place; returns the warm-up stages."""
  stages = warmup_densities(density, warmup_steps)
  if not 0 <= momentum < 1:
    raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
  if clip_norm is not None and not clip_norm > 0:
    raise ValueError(f"clip_norm must be positive or None, got {clip_norm!r}")
  if clip not in CLIP_MODES:
    raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}")
  pipeline.refuse_reduce_scatter(collective, "jc.dgc", pipeline.DGC_NO_REDUCE_SCATTER)
  if collective not in COLLECTIVES:
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
  codecs_lib.check_positive_int(chunk_size, "chunk_size")
  return stages


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`dgc`, checked and resolved."""

  codecs: tuple  # a TopK per warm-up stage
  starts: tuple[int, ...]  # each stage's first step
  momentum: float
  nesterov: bool
  clip_norm: float | None
  clip: str
  momentum_masking: bool
  axis_name: Any
  collective: str
  chunk_size: int
  filter_fn: transforms.FilterFn
  seed: int


# ----------------------------------------------------------------------------- routes


def chunked_bytes(n: int, density: float, chunk: int, k: int) -> float:
  """Bytes per device of the chunked exchange (:func:`collectives.chunked_mean`) of a
  leaf of ``n`` values on ``k`` devices: two all-reduces of float32, the ``ceil(n/c)``
  chunk norms and the chosen ``m`` chunks, each counted ``2(K-1)/K`` times its operand
  (as :func:`jaxcomp.wire_report` counts an all-reduce)."""
  nc = -(-n // chunk)
  m = min(nc, max(1, math.ceil(density * n / chunk - 1e-9)))  # as chunked_mean's
  return 2 * (k - 1) / k * 4 * (nc + m * chunk)


def gathered_bytes(codec: sparse.TopK, shape: tuple[int, ...], k: int) -> float:
  """Bytes per device of the all-gather exchange of a leaf of ``shape``: the ``K-1``
  other devices' (value, index) payloads."""
  return (k - 1) * codec.wire_bits(tuple(shape), _F32) / 8


def leaf_route(opts: _Options, shape: tuple[int, ...]) -> str:
  """The exchange a compressed leaf of ``shape`` takes: ``collective`` as given, and for
  ``"auto"`` whichever of the all-gather and the chunked exchange moves fewer bytes at
  this device count and the target density (the last warm-up stage's). The all-gather
  grows with K and the chunked exchange does not, so ``"auto"`` all-gathers on few
  devices and small leaves, and chunks large leaves on many devices. One route per leaf
  for the whole run, warm-up included: the two select differently (each device's top-k
  entries, or chunks chosen together), and the run keeps one selection per leaf.
  Without an axis: ``"allgather"`` (nothing is exchanged)."""
  if opts.axis_name is None:
    return "allgather"
  if opts.collective != "auto":
    return opts.collective
  k = collectives.axis_size(opts.axis_name)
  codec = opts.codecs[-1]
  chunked = chunked_bytes(math.prod(shape), codec.density, opts.chunk_size, k)
  return "chunked" if chunked < gathered_bytes(codec, shape, k) else "allgather"


# ----------------------------------------------------------------------------- steps


def _init(opts: _Options, params) -> DGCState:
  """Zero momentum for every leaf, zero velocity for the compressed ones."""
  leaves, treedef = treeutil.flat(params)
  mom, vel = [], []
  for path, leaf in leaves:
    treeutil.check_leaf(path, leaf)
    mom.append(jnp.zeros(leaf.shape, _F32))
    on = treeutil.selected(opts.filter_fn, path, leaf)
    vel.append(jnp.zeros(leaf.shape, _F32) if on else optax.MaskedNode())
  pipeline.warn_if_nothing_compressed(
    "jc.dgc",
    [not isinstance(v, optax.MaskedNode) for v in vel],
    pipeline.filter_rule(opts.filter_fn, transforms.default_filter),
  )
  return DGCState(
    count=jnp.zeros((), jnp.int32),
    key=jax.random.key(opts.seed),
    momentum=treedef.unflatten(mom),
    velocity=treedef.unflatten(vel),
    nonfinite_count=jnp.zeros((), jnp.int32),
    shapes=treeutil.LeafShapes.of(params),
  )


def _dense_momentum(opts: _Options, g, u):
  """Momentum SGD for a leaf the filter leaves out: (local update, new momentum)."""
  m = opts.momentum
  u = m * (u + g) if opts.nesterov else m * u + g
  return (g + u if opts.nesterov else u), u


def _accumulate(opts: _Options, g, u, v):
  """Momentum correction (§3.2): the momentum before sparsification, ``v += u``."""
  m = opts.momentum
  if opts.nesterov:
    u = m * (u + g)
    return u, v + u + g
  u = m * u + g
  return u, v + u


def _select(opts: _Options, codec, g, u, v, key):
  """One compressed leaf's momentum correction and top-k selection: (its pipeline leaf,
  or its mean already; new u; new v). The chunked exchange (CSC,
  :func:`collectives.chunked_mean`) runs here, since its selection is made across the
  devices; the all-gather's payloads go to the pipeline already encoded
  (:func:`pipeline.encoded_leaf`)."""
  u, v = _accumulate(opts, g, u, v)
  if leaf_route(opts, v.shape) == "chunked":
    mean, sent_mask = collectives.chunked_mean(v, codec.density, opts.chunk_size, opts.axis_name)
    leaf = mean.reshape(v.shape)
  else:
    payload = codec.encode(v, key=key)
    idx = payload.arrays["indices"].astype(jnp.int32)
    sent_mask = jnp.zeros((v.size,), bool).at[idx].set(True, mode="drop").reshape(v.shape)
    leaf = pipeline.encoded_leaf(codec, v, payload)
  new_u = jnp.where(sent_mask, 0.0, u) if opts.momentum_masking else u
  return leaf, new_u, jnp.where(sent_mask, 0.0, v)


def _sparse_leaves(opts: _Options, stage_index: int, gs, us, vs, keys, dense=()):
  """One warm-up stage's exchange of the compressed leaves: (outputs, new u, new v,
  means of the full-precision ``dense`` leaves, which share the exchange: the
  pipeline's :func:`pipeline.exchange_gathered`)."""
  codec = opts.codecs[stage_index]
  with jax.named_scope(phases.ENCODE_SCOPE):  # accumulation, selection, masks
    picked = [_select(opts, codec, *a) for a in zip(gs, us, vs, keys)]
  sparse = [leaf for leaf, _, _ in picked if isinstance(leaf, pipeline.Leaf)]
  # Every leaf's indices and values in one all-gather (with the dense leaves at K <= 2).
  plan = iter(
    pipeline.exchange_gathered(opts.axis_name, sparse + [pipeline.dense_leaf(d) for d in dense])
  )
  outs = [next(plan).out if isinstance(o, pipeline.Leaf) else o for o, _, _ in picked]
  dense_means = [leaf.out for leaf in plan]
  return outs, [u for _, u, _ in picked], [v for _, _, v in picked], dense_means


def _exchange(opts: _Options, count, args, dense, num):
  """The warm-up stage of step ``count`` exchanges the compressed leaves ``args``;
  returns (its :func:`_sparse_leaves` result, the means of the ``dense`` leaves).

  With one stage its all-gather carries the dense leaves too. With several, the stage
  is a ``lax.switch`` branch, and the dense leaves' all-reduce goes before it: under
  check_vma it also makes the branch index invariant (every device must take the
  same collectives).
  """
  axis_name = opts.axis_name
  if len(opts.codecs) == 1:
    sparse_out = _sparse_leaves(opts, 0, *args, dense)
    return sparse_out, sparse_out[3]
  stage = _stage(count, jnp.asarray(opts.starts, jnp.int32))
  if axis_name is not None and collectives.tracks_varying(axis_name):
    # The count is the same on every device but held in per-device state: the branch
    # index must be typed invariant so that every device takes the same collectives.
    # It rides in the dense leaves' all-reduce (the sum of K equal stages).
    dense_means, (total,) = collectives.dense_means(dense, axis_name, counts=[stage])
    stage = total // num
  else:
    dense_means = collectives.dense_means(dense, axis_name)[0] if dense else []
  branches = [functools.partial(_sparse_leaves, opts, j) for j in range(len(opts.codecs))]
  return lax.switch(stage, branches, *args), dense_means


def _local_gradients(opts: _Options, leaves, on, step_key):
  """(float32 gradients, clipped; finite everywhere; K; this device's step key)."""
  axis_name = opts.axis_name
  gs = [g.astype(_F32) for _, g in leaves]
  num = 1
  if axis_name is not None:
    num = collectives.axis_size(axis_name)
    step_key = jax.random.fold_in(step_key, lax.axis_index(axis_name))
    for (path, _), g, sel in zip(leaves, gs, on):
      if sel:
        collectives.check_local(path, g, axis_name)
  finite = (
    jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in gs])) if gs else (jnp.ones((), bool))
  )
  if axis_name is not None:  # the shards of a tensor-parallel group skip together
    finite = ~collectives.any_over_other_axes(~finite, axis_name)
  if opts.clip_norm is not None and gs:
    gs = _clip(gs, opts.clip_norm / math.sqrt(num), opts.clip)
  return gs, finite, num, step_key


def _update(opts: _Options, updates, state: DGCState):
  """One DGC step: clip, dense momentum for the leaves left out, accumulate, select and
  exchange the compressed ones (this step's warm-up stage)."""
  leaves, treedef = pipeline.open_update(updates, state.shapes, "jc.dgc")
  us = treedef.flatten_up_to(state.momentum)
  vs = treedef.flatten_up_to(state.velocity)
  on = [not isinstance(v, optax.MaskedNode) for v in vs]
  key, step_key = jax.random.split(state.key)
  gs, finite, num, step_key = _local_gradients(opts, leaves, on, step_key)
  split = pipeline.Split.of(on)
  local = [_dense_momentum(opts, gs[i], us[i]) for i in split.dense]  # (update, new u)
  args = (
    [gs[i] for i in split.selected],
    [us[i] for i in split.selected],
    [vs[i] for i in split.selected],
    [jax.random.fold_in(step_key, i) for i in split.selected],
  )
  dense = [out for out, _ in local] if opts.axis_name is not None else []
  sparse_out, dense_means = _exchange(opts, state.count, args, dense, num)
  if opts.axis_name is None:
    dense_means = [out for out, _ in local]
  outs = split.merge(sparse_out[0], dense_means)
  new_u = split.merge(sparse_out[1], [u for _, u in local])
  new_v = split.merge(sparse_out[2], [vs[i] for i in split.dense])
  new_u = [jnp.where(finite, a, b) for a, b in zip(new_u, us)]
  new_v = [jnp.where(finite, a, b) if o else b for a, b, o in zip(new_v, vs, on)]
  outs = [o.astype(g.dtype) for o, (_, g) in zip(outs, leaves)]
  new_state = DGCState(
    count=state.count + 1,
    key=key,
    momentum=treedef.unflatten(new_u),
    velocity=treedef.unflatten(new_v),
    nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
    shapes=state.shapes,
  )
  return treedef.unflatten(outs), new_state


# ----------------------------------------------------------------------------- transform


def dgc(
  density: float = 0.001,
  momentum: float = 0.9,
  *,
  nesterov: bool = False,
  clip_norm: float | None = None,
  clip: str = "global",
  warmup_steps: int = 0,
  momentum_masking: bool = True,
  method: str = "sampled",
  axis_name: Any = transforms.AXIS_REQUIRED,
  collective: str = "auto",
  chunk_size: int = 512,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
  seed: int = 0,
) -> optax.GradientTransformation:
  r"""Deep Gradient Compression: sparse top-k exchange with momentum correction.

  Per device and per compressed leaf (§3 of the paper), with local gradient ``g``:

  .. math::
    u \leftarrow m u + g, \quad v \leftarrow v + u \qquad
    (\text{Nesterov: } u \leftarrow m (u + g), \; v \leftarrow v + u + g)

  then the top ``k = ceil(density · n)`` entries of ``|v|`` are sent, the returned update
  is the mean over devices of what was sent, and ``v`` is zeroed where it was sent (local
  accumulation: nothing is lost, only delayed). The four techniques:

  * *momentum correction*: the momentum is applied *before* sparsification (above), so
    the accumulated ``v`` is what dense momentum SGD would have applied; momentum lives
    here, so chain a **plain** ``optax.sgd(lr)`` (no momentum) after it.
  * *momentum factor masking* (``momentum_masking=True``): ``u`` is zeroed where ``v`` was
    sent, so stale momentum does not push those coordinates again.
  * *local gradient clipping* (``clip_norm``, §3.2): each device clips its gradient
    before accumulating it, at ``clip_norm · K^{-1/2}`` (K devices). As in the paper,
    ``clip_norm`` is the threshold of the *summed* gradient of the K devices (whose norm
    is about ``sqrt(K)`` times a local one); a dense recipe that clips the *mean*
    gradient at ``c`` corresponds to ``clip_norm = K · c`` (local threshold
    ``c · sqrt(K)``). ``clip="global"`` (the paper's: Pascanu et al.'s rescaling by the
    norm of the whole gradient) scales every leaf by one factor, from the norm over all
    leaves; ``clip="per_tensor"`` (the authors' reference code, which applies its clipping
    function to one tensor at a time) scales each leaf by its own norm.
  * *warm-up* (``warmup_steps``): densities 25%, 6.25%, 1.5625%, 0.39%, ... over the
    first ``warmup_steps`` steps (:func:`dgc_density_schedule`). Payload sizes must be
    static, so each stage is its own compiled branch of a ``lax.switch`` on the step
    count: every step sends only its stage's bytes; the program holds one exchange per
    stage (compile time grows with the number of stages: ``docs/benchmarks.md#compile-time``).

  Leaves the filter leaves out (biases, small tensors) get dense momentum SGD: each
  device keeps its momentum of its local gradients and the mean of ``u`` (or of
  ``g + m u`` with Nesterov) is all-reduced, which by linearity is momentum SGD on the
  averaged gradient, so the whole model sees the same optimizer. All of them share one
  all-reduce (:func:`jaxcomp.pmean_tree`); on two devices with the all-gather exchange
  and no warm-up they ride in the payloads' all-gather instead (the same bytes there),
  so a step is one collective.

  Exchange (``collective``):

  * ``"allgather"`` (the paper's): each device all-gathers the others' ``k`` (value,
    index) pairs (:class:`jaxcomp.codecs.TopK`) and scatter-adds them; per-device
    traffic ``(K-1)·k·(4 + index bytes)``, growing with K.
  * ``"chunked"`` (the coarse-grained variant, CSC): ``v`` is cut into chunks of
    ``chunk_size``; the chunks' L1 norms are all-reduced, every device picks the same
    top ``ceil(density·n/chunk_size)`` chunks and only those are all-reduced. Traffic
    ``2(K-1)/K · 4 · (n/chunk_size + density·n)`` bytes, flat in K; no indices.
    Its chunks are chosen over the devices' summed norms, so it sends whole chunks,
    not each device's own top-k entries.
  * ``"auto"`` (the default): per compressed leaf, whichever of the two moves fewer
    bytes at the device count it runs on and the target density (:func:`leaf_route`;
    one route per leaf for the whole run, warm-up included): the all-gather on two
    devices and for small leaves, the chunked exchange for large leaves on many
    devices. Pass ``collective="allgather"`` for the paper's exchange at any K.

  Returns the averaged sparse update (identical on every device). With
  ``axis_name=None`` nothing is exchanged (one-device simulation).

  Inside :func:`jaxcomp.two_level` (built with ``axis_name=<the slow axis>``) the node is
  DGC's worker: each device runs DGC on its 1/L shard of the node's mean gradient, with
  its own momentum, velocity, warm-up count and key for that shard (state 1/L of each
  leaf), and sends the top ``ceil(density · shard size)`` of its shard. The node so
  sends ``density`` of each leaf, chosen per shard rather than over the whole leaf: a
  blockwise top-k, with the L shards as blocks, the same relaxation as the chunked
  exchange's choice of whole chunks. The filter still judges the whole leaves.
  ``clip_norm`` clips the node's gradient by its whole norm (the squares summed over
  the node's devices) at ``clip_norm / sqrt(N)`` for N nodes.

  Args:
    density: fraction of each compressed leaf sent per step after warm-up (0.1% = 99.9%
      sparsity, the paper's setting).
    momentum: momentum ``m``.
    nesterov: Nesterov momentum correction.
    clip_norm: clipping threshold of the summed gradient (each device clips its own
      at ``clip_norm / sqrt(K)``), or None.
    clip: ``"global"`` (one norm over all leaves, the paper's) or ``"per_tensor"`` (each
      leaf's own norm, the reference code's).
    warmup_steps: length of the exponential density warm-up (0: none).
    momentum_masking: zero the momentum where ``v`` was sent.
    method: :class:`jaxcomp.codecs.TopK` selection: ``"sampled"`` (the reference code's
      sampled threshold, which here only speeds up an exact selection), ``"exact"``
      (``lax.top_k``) or ``"blocked"``; all three send the same entries.
    axis_name: the mapped axis to average over (required), or ``None``: the explicit
      one-device simulation, which exchanges nothing.
    collective: ``"auto"`` (default: per leaf, whichever of the two moves fewer bytes
      at this device count and density), ``"allgather"`` or ``"chunked"``.
    chunk_size: chunk length of ``"chunked"``.
    filter: which leaves are compressed (default :func:`jaxcomp.default_filter`).
    seed: seed of the state's PRNG key.

  Example (8 devices, ``P`` is ``jax.sharding.PartitionSpec``)::

    tx = optax.chain(jc.per_device_state(jc.dgc(0.001, 0.9, axis_name="b",
                                                warmup_steps=400, clip_norm=1.0)),
                     optax.sgd(lr))

  References:
    Lin, Han, Mao, Wang, Dally. *Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training*. ICLR 2018. https://arxiv.org/abs/1712.01887
    (``docs/methods/dgc.md``: what is exactly the paper and what departs).
  """
  transforms.require_axis_name(axis_name, "jc.dgc")
  stages = _check_options(density, warmup_steps, momentum, clip_norm, clip, collective, chunk_size)
  opts = _Options(
    codecs=tuple(sparse.TopK(d, method) for _, d in stages),  # validates method
    starts=tuple(s for s, _ in stages),
    momentum=float(momentum),
    nesterov=nesterov,
    clip_norm=clip_norm,
    clip=clip,
    momentum_masking=momentum_masking,
    axis_name=axis_name,
    collective=collective,
    chunk_size=chunk_size,
    filter_fn=transforms.default_filter if filter is None else filter,
    seed=seed,
  )

  def init_fn(params):
    return _init(opts, params)

  def update_fn(updates, state, params=None):
    del params
    return _update(opts, updates, state)

  tx = optax.GradientTransformation(init_fn, update_fn)
  # On shards (jc.two_level): top-k per shard, the node as DGC's worker, clipped by the
  # norm of the node's whole gradient.
  return transforms.register_exchange(tx, "jc.dgc", axis_name, collective=None)
