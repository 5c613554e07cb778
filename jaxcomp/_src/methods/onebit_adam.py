r"""1-bit Adam (Tang et al., ICML 2021) as an optax transform that includes its exchange.

Adam's update is not linear in the gradient, so compressing the gradient with error
feedback (what works for momentum SGD) breaks it; the paper's observation is that Adam's
second moment ``v`` settles early in training. 1-bit Adam runs plain Adam for a warm-up,
then freezes ``v`` and uses it as a fixed preconditioner: the rest of the update is the
momentum, which is linear in the gradient and is exchanged with 1-bit compression and
two-stage error feedback. The exchange is the optimizer's own, so the transform takes
*local* gradients and returns the parameter updates (like ``optax.adam``).

As ``optax.adamw`` is ``chain(scale_by_adam, add_decayed_weights,
scale_by_learning_rate)``, :func:`onebit_adam` chains :func:`scale_by_onebit_adam` (the
moments, the exchange, the step direction) with optax's weight decay and learning rate.
The core is written as named steps over a frozen :class:`_Options`: ``_init``,
``_warmup_moments`` / ``_compressed_moments`` (the two stages, the latter through
``_exchange``), ``_compute_directions``, wired by ``_update``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import transforms
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import phases
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32
_WORD = 32  # signs per uint32 word
COMPRESS = ("momentum", "preconditioned")


class OneBitAdamState(NamedTuple):
  """State of :func:`scale_by_onebit_adam`, the first of :func:`onebit_adam`'s chain.

  ``count``, ``m`` and ``v`` are the same on every device (they are updated from the
  exchanged, device-independent values only) and stay replicated under
  ``jax.shard_map``, like the parameters. The error-feedback buffers and the non-finite
  count differ between devices: they sit in :class:`jaxcomp.PerDeviceState` wrappers
  (every leaf with a leading axis of 1 per device), which :func:`jaxcomp.state_specs`
  places on the data axis. ``worker_error`` and ``server_error`` hold an array for each
  compressed leaf and ``optax.MaskedNode()`` elsewhere.
  """

  count: Array  # shape=(), dtype=int32: steps taken (selects the stage)
  m: Any  # first moment, leaf shapes, float32, replicated
  v: Any  # second moment, leaf shapes, float32, replicated (frozen after warm-up)
  worker_error: Any  # PerDeviceState: e_w, shape=(1, *leaf shape), float32, per device
  server_error: Any  # PerDeviceState: e_s, shape=(1, chunk), float32, per device
  nonfinite_count: Any  # PerDeviceState: shape=(1,), int32: steps with a NaN/Inf gradient
  moments_nonfinite_count: Array  # shape=(), int32, replicated: steps whose new m or v
  #   was not finite for some leaf (the previous kept; the update marked non-finite)
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one compressed leaf of ``n`` values is cut for the two-phase exchange.

  The flattened leaf is zero-padded to ``k`` chunks of ``chunk`` values (a multiple of
  32: whole words of signs); device ``j`` owns chunk ``j``. Each chunk is cut into
  ``buckets`` buckets of ``bucket`` values (the last one may be shorter), one scale each.
  """

  n: int
  k: int
  chunk: int
  bucket: int

  @property
  def buckets(self) -> int:
    return -(-self.chunk // self.bucket)

  def valid(self) -> np.ndarray:
    """``(k, chunk)`` bool: which entries are the leaf's (the rest is padding)."""
    return np.arange(self.k * self.chunk).reshape(self.k, self.chunk) < self.n


def _layout(n: int, k: int, bucket_size: int | None) -> _Layout:
  per_device = -(-n // k)
  chunk = max(_WORD, -(-per_device // _WORD) * _WORD)
  bucket = chunk if bucket_size is None else min(bucket_size, chunk)
  return _Layout(n, k, chunk, bucket)


# ----------------------------------------------------------------------------- 1-bit code


def _rms(v: Array, counts: Array) -> Array:
  r"""``sqrt(Σ v² / count)`` along the last axis of ``v`` (zero-padded rows); 0 where
  ``count`` is 0; NaN/Inf where a row is not finite.

  The sum is taken of ``(v / max|v|)²`` and scaled back, so that it neither overflows
  for finite values nor underflows for tiny ones.
  """
  amax = jnp.max(jnp.abs(v), axis=-1)
  safe = jnp.where(amax > 0, amax, 1.0)
  ss = jnp.sum(jnp.square(v / safe[..., None]), axis=-1)
  return jnp.where(counts > 0, safe * jnp.sqrt(ss / jnp.maximum(counts, 1.0)), 0.0)


def _bucket_counts(live: Array, lay: _Layout) -> Array:
  """``(rows, buckets)`` float32: the live entries of each bucket of ``(rows, chunk)``."""
  rows = live.shape[0]
  pad = lay.buckets * lay.bucket - lay.chunk
  lb = (jnp.pad(live, ((0, 0), (0, pad))) if pad else live).reshape(rows, lay.buckets, lay.bucket)
  return jnp.sum(lb, axis=-1, dtype=_F32)


def _bucket_rms(v: Array, lay: _Layout, counts: Array) -> Array:
  """Per-bucket scales ``(rows, buckets)`` of ``(rows, chunk)`` rows of ``v``."""
  rows = v.shape[0]
  pad = lay.buckets * lay.bucket - lay.chunk
  vb = (jnp.pad(v, ((0, 0), (0, pad))) if pad else v).reshape(rows, lay.buckets, lay.bucket)
  return _rms(vb, counts)


def _pack_signs(v: Array) -> Array:
  """``(rows, chunk)`` -> ``(rows, chunk / 32)`` uint32: bit set where ``v < 0``."""
  rows, chunk = v.shape
  bits = (v < 0).reshape(-1).astype(jnp.uint32)
  return bitpack.pack_bits(bits, 1).reshape(rows, chunk // _WORD)


def _decode(words: Array, scales: Array, lay: _Layout) -> Array:
  """``(rows, chunk)`` float32: ``-s`` where the sign bit is set, ``+s`` elsewhere."""
  rows = words.shape[0]
  bits = bitpack.unpack_bits(words.reshape(-1), 1, rows * lay.chunk).reshape(rows, lay.chunk)
  s = jnp.repeat(scales, lay.bucket, axis=-1, total_repeat_length=lay.buckets * lay.bucket)[
    :, : lay.chunk
  ]
  return jnp.where(bits != 0, -s, s)


class _Exchanged(NamedTuple):
  mean: Array  # the decoded, re-compressed average: the same on every device
  sent: Array  # what this device's worker payload decodes to (leaf shape)
  server_error: Array  # new e_s of the chunk this device owns, shape (chunk,)


def _server(layouts, server_errors, live_chunks, received, mine):
  """The server stage of :func:`_exchange` on device ``mine``: the average of the K
  decoded chunks it owns plus ``e_s``, compressed again. Returns (its payloads, the new
  server errors)."""
  seconds, new_errors = [], []
  for got, lay, e_s, live_rows in zip(received, layouts, server_errors, live_chunks):
    valid = live_rows[mine]  # the padding is not live
    with jax.named_scope(phases.DECODE_SCOPE):
      # Padding and dead entries were sent as +s: masked, so e_s stays zero there.
      avg = jnp.sum(_decode(got["words"], got["scales"], lay), axis=0) / lay.k
      avg = jnp.where(valid, avg, 0.0)
    with jax.named_scope(phases.ENCODE_SCOPE):
      y = avg + e_s
      scales2 = _bucket_rms(y[None], lay, _bucket_counts(valid[None], lay))
      words2 = _pack_signs(y[None])
      sent2 = jnp.where(valid, _decode(words2, scales2, lay)[0], 0.0)
      # A non-finite average must not poison the server error: keep the old one.
      new_errors.append(jnp.where(jnp.all(jnp.isfinite(y)), y - sent2, e_s))
    seconds.append({"words": words2[0], "scales": scales2[0]})
  return seconds, new_errors


def _exchange(
  xs, lives, layouts, server_errors, axis_name, per_tensor_scale: bool
) -> list[_Exchanged]:
  r"""The compressed all-reduce of 1-bit Adam (Algorithm 1; DeepSpeed's
  ``compressed_allreduce``) for several leaves: one ``all_to_all``, one ``all_gather``.

  Worker stage: every device sends chunk ``j`` of ``C[x]`` (packed signs and float32
  scales) to device ``j``. Server stage: device ``j`` averages the K decoded chunks
  ``j``, adds its server error ``e_s``, compresses that again and all-gathers it, and
  keeps ``e_s' = y - C[y]``. With ``axis_name=None`` the same arithmetic on one device.
  ``C[x] = s · sign(x)`` with ``s = ||x||_2 / sqrt(d)`` over the ``d`` values of each
  scale's group (``sign(0) = +1``): the whole leaf for the worker when
  ``per_tensor_scale``, else each bucket of each chunk; each bucket of the owned chunk
  for the server.

  Only the live entries (``lives``: the leaf's coordinates whose frozen ``v`` is
  positive, the same on every device; the rest must be 0 in ``x``) count in the scales,
  are sent nonzero, and are decoded: the others, like the chunks' padding, decode to 0.
  """
  firsts, payloads, live_chunks = [], [], []
  with jax.named_scope(phases.ENCODE_SCOPE):
    for x, live, lay in zip(xs, lives, layouts):
      flat = x.reshape(-1)
      pad = lay.k * lay.chunk - lay.n
      chunks = (jnp.pad(flat, (0, pad)) if pad else flat).reshape(lay.k, lay.chunk)
      live = live.reshape(-1)
      live_rows = (jnp.pad(live, (0, pad)) if pad else live).reshape(lay.k, lay.chunk)
      if per_tensor_scale:
        scale = _rms(flat, jnp.sum(live, dtype=_F32))
        # One scale for the whole leaf, sent along with each chunk: the bytes of
        # DeepSpeed's all-gather of the worker's scale, without a collective of its own.
        scales = jnp.broadcast_to(scale, (lay.k, 1))
      else:
        scales = _bucket_rms(chunks, lay, _bucket_counts(live_rows, lay))
      words = _pack_signs(chunks)
      sent = jnp.where(live_rows, _decode(words, scales, lay), 0.0)
      firsts.append(sent.reshape(-1)[: lay.n].reshape(x.shape))
      live_chunks.append(live_rows)
      payloads.append({"words": words, "scales": scales})
  gathered, new_errors = collectives.two_phase_payloads(
    payloads,
    functools.partial(_server, layouts, server_errors, live_chunks),
    axis_name,
  )
  out = []
  with jax.named_scope(phases.DECODE_SCOPE):
    for g, lay, x, sent, e_s, live_rows in zip(
      gathered, layouts, xs, firsts, new_errors, live_chunks
    ):
      mean = jnp.where(live_rows, _decode(g["words"], g["scales"], lay), 0.0)
      mean = mean.reshape(-1)[: lay.n]  # padding dropped
      out.append(_Exchanged(mean.reshape(x.shape), sent, e_s))
  return out


# ----------------------------------------------------------------------------- options


def momentum_bound(b1: float, b2: float) -> float:
  r"""The largest ``|m| / sqrt(v)`` that Adam's moments can reach, for any gradients.

  With ``m_0 = v_0 = 0``, ``m_t = (1-β1) Σ_k β1^k g_{t-k}`` and
  ``v_t = (1-β2) Σ_k β2^k g_{t-k}^2``; writing ``β1^k = (β1/√β2)^k · √β2^k``,
  Cauchy-Schwarz gives

  .. math::
    |m_t| \le \frac{1-\beta_1}{\sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}} \sqrt{v_t}
    \qquad (\beta_1^2 < \beta_2),

  tight for a gradient ``g_{t-k} ∝ (β1/β2)^k``. (Kingma & Ba 2015, §2.1, bound the
  bias-corrected step the same way for a single gradient.) About 7.27 for ``β1 = 0.9,
  β2 = 0.999``.
  """
  if not b1 * b1 < b2:
    raise ValueError(f"the momentum bound needs b1**2 < b2, got b1={b1!r}, b2={b2!r}")
  return float((1 - b1) / np.sqrt((1 - b2) * (1 - b1 * b1 / b2)))


def _check_options(
  learning_rate, freeze_step, b1, b2, eps, weight_decay, bucket_size, compress, bound_momentum
):
  """Every argument check of :func:`onebit_adam` and :func:`scale_by_onebit_adam`
  (``learning_rate`` and ``weight_decay`` are ``None`` for the latter)."""
  if learning_rate is not None and (
    not callable(learning_rate) and not isinstance(learning_rate, numbers.Real)
  ):
    raise TypeError(f"learning_rate must be a float or an optax schedule, got {learning_rate!r}")
  if (
    isinstance(freeze_step, bool)
    or not isinstance(freeze_step, numbers.Integral)
    or (freeze_step < 0)
  ):
    raise ValueError(f"freeze_step must be an integer >= 0, got {freeze_step!r}")
  for name, value in (("b1", b1), ("b2", b2)):
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {value!r}")
  if not eps > 0:
    raise ValueError(f"eps must be positive, got {eps!r}")
  if weight_decay is not None and not weight_decay >= 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
  if bucket_size is not None and (
    isinstance(bucket_size, bool)
    or not isinstance(bucket_size, numbers.Integral)
    or bucket_size < 1
  ):
    raise ValueError(f"bucket_size must be a positive integer or None, got {bucket_size!r}")
  if compress not in COMPRESS:
    raise ValueError(f"compress must be one of {COMPRESS}, got {compress!r}")
  if not isinstance(bound_momentum, bool):
    raise TypeError(f"bound_momentum must be a bool, got {bound_momentum!r}")
  if bound_momentum and not b1 * b1 < b2:
    raise ValueError(
      f"bound_momentum=True needs b1**2 < b2 (Adam's |m| <= B sqrt(v) holds only then), got "
      f"b1={b1!r}, b2={b2!r}; pass bound_momentum=False to run without the bound"
    )


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`scale_by_onebit_adam`, checked and normalised."""

  freeze_step: int
  b1: float
  b2: float
  eps: float
  bias_correction: bool
  bucket_size: int | None
  compress: str
  bound_momentum: bool
  axis_name: Any
  filter_fn: transforms.FilterFn

  def num_devices(self) -> int:
    return 1 if self.axis_name is None else collectives.axis_size(self.axis_name)

  def v_correction(self, t: Array) -> Array | None:
    """``1 - β2^min(t, T_w)``: the warm-up's bias correction of v, then the frozen one."""
    if not self.bias_correction or self.freeze_step == 0:
      return None
    return 1 - jnp.float32(self.b2) ** jnp.minimum(t, jnp.float32(self.freeze_step))

  def bound(self, m: Array, v: Array) -> Array:
    """``m`` clipped to Adam's ``|m| <= B sqrt(v)`` (``momentum_bound``), when on."""
    if not self.bound_momentum:
      return m
    limit = momentum_bound(self.b1, self.b2) * jnp.sqrt(v)
    # Only finite values: an Inf must stay visible to the NaN/Inf policy, not be clipped.
    return jnp.where(jnp.isfinite(m), jnp.clip(m, -limit, limit), m)


# ----------------------------------------------------------------------------- steps


def _init(opts: _Options, params) -> OneBitAdamState:
  """Zero moments for every leaf; error buffers (per device) for the compressed ones."""
  leaves, treedef = treeutil.flat(params)
  k = None
  moments, worker, server = [], [], []
  for path, leaf in leaves:
    treeutil.check_leaf(path, leaf)
    moments.append(jnp.zeros(leaf.shape, _F32))
    if treeutil.selected(opts.filter_fn, path, leaf):
      k = opts.num_devices() if k is None else k
      lay = _layout(int(np.prod(leaf.shape, dtype=np.int64)), k, opts.bucket_size)
      worker.append(jnp.zeros((1, *leaf.shape), _F32))
      server.append(jnp.zeros((1, lay.chunk), _F32))
    else:
      worker.append(optax.MaskedNode())
      server.append(optax.MaskedNode())
  pipeline.warn_if_nothing_compressed(
    "jc.onebit_adam",
    [not isinstance(w, optax.MaskedNode) for w in worker],
    pipeline.filter_rule(opts.filter_fn, transforms.default_filter),
  )
  return OneBitAdamState(
    count=jnp.zeros((), jnp.int32),
    m=treedef.unflatten(moments),
    v=treedef.unflatten(list(moments)),
    worker_error=transforms.PerDeviceState(treedef.unflatten(worker)),
    server_error=transforms.PerDeviceState(treedef.unflatten(server)),
    nonfinite_count=transforms.PerDeviceState(jnp.zeros((1,), jnp.int32)),
    moments_nonfinite_count=jnp.zeros((), jnp.int32),
    shapes=treeutil.LeafShapes.of(params),
  )


def _check_update(opts: _Options, leaves, ms, comp) -> None:
  """The errors of a misuse under shard_map: a replicated gradient, a wrapped state."""
  axis_name = opts.axis_name
  if axis_name is None or not collectives.tracks_varying(axis_name):
    return
  if any(axis_name in collectives.varying_axes(m) for m in ms):
    raise ValueError(
      f"jc.onebit_adam's m and v vary over axis {axis_name!r}: its state is held per "
      f"device (a chain around it wrapped in jc.per_device_state?). m and v must be "
      f"replicated (the updates must be) and its per-device buffers are wrapped "
      f"already: wrap jc.onebit_adam itself (per_device_state returns it unchanged) "
      f"or nothing; get the specs with jc.state_specs(tx, params, ...)."
    )
  for i in comp:
    collectives.check_local(*leaves[i], axis_name)


def _adam_moments(opts: _Options, mean, m, v):
  """Adam's moment updates from a (dense, exchanged) mean gradient."""
  mean = mean.astype(_F32)
  return (1 - opts.b1) * mean + opts.b1 * m, (1 - opts.b2) * jnp.square(mean) + opts.b2 * v


def _dense_means(opts: _Options, xs: list) -> list:
  """The dense all-reduce (one buffer per dtype) of the leaves ``xs``
  (:func:`collectives.dense_means`)."""
  if opts.axis_name is None or not xs:
    return xs
  return collectives.dense_means(xs, opts.axis_name)[0]


class _Moments(NamedTuple):
  m: list  # new first moments, every leaf
  v: list  # new second moments, every leaf
  worker_error: list  # new e_w, compressed leaves
  server_error: list  # new e_s, compressed leaves


def _warmup_moments(opts: _Options, gs, ms, vs, ews, ess) -> _Moments:
  """Warm-up: Adam's moments of every leaf from the dense mean gradient."""
  new_m, new_v = [], []
  for i, mean in enumerate(_dense_means(opts, gs)):
    a, b = _adam_moments(opts, mean, ms[i], vs[i])
    new_m.append(a)
    new_v.append(b)
  return _Moments(new_m, new_v, ews, ess)


def _compressed_moments(opts: _Options, gs, ms, vs, ews, ess, split, layouts) -> _Moments:
  """Compression stage: ``v`` frozen, the momentum exchanged 1-bit with error feedback."""
  comp, dense = split
  new_m, new_v = list(ms), list(vs)
  for i, mean in zip(dense, _dense_means(opts, [gs[i] for i in dense])):
    new_m[i], new_v[i] = _adam_moments(opts, mean, ms[i], vs[i])
  # Coordinates with v = 0 had no gradient in the whole warm-up: Adam's step there is
  # 0 / (0 + eps) = 0, which a sign cannot say (it would step s / eps). Their
  # momentum is kept at 0, as DeepSpeed's exp_avg_mask does by hand.
  live = [vs[i] > 0 for i in comp]
  # compress="preconditioned": the step direction m / (sqrt(v̂) + eps), a fixed
  # linear map of m while v is frozen, is what is compressed (and fed back).
  denom = [None] * len(comp)
  if opts.compress == "preconditioned":
    c2 = opts.v_correction(jnp.float32(opts.freeze_step))
    denom = [jnp.sqrt(vs[i] if c2 is None else vs[i] / c2) + opts.eps for i in comp]
  with jax.named_scope(phases.ENCODE_SCOPE):
    xs = []
    for i, e, d, ok in zip(comp, ews, denom, live):
      # Frozen v breaks Adam's invariant |m| <= B sqrt(v): a gradient larger than the
      # warm-up's (a loss near zero at the freeze, a unit that revives) would make
      # m / sqrt(v) unbounded, and the scaled sign spreads one such outlier's magnitude
      # over its whole group, whose error feedback then grows without end. The bound
      # restores the invariant: only a momentum live Adam could not have is cut.
      m_local = opts.bound((1 - opts.b1) * gs[i].astype(_F32) + opts.b1 * ms[i], vs[i])
      # Dead coordinates enter neither the scales nor the errors (both modes).
      xs.append(jnp.where(ok, (m_local if d is None else m_local / d) + e, 0.0))
  exchanged = _exchange(xs, live, layouts, ess, opts.axis_name, opts.bucket_size is None)
  new_ews = []
  for i, x, e, ex, d, ok in zip(comp, xs, ews, exchanged, denom, live):
    # The exchanged momentum (the same on every device) is held to the same bound: the
    # decoded scaled sign gives a coordinate its group's magnitude, whatever its v.
    new_m[i] = jnp.where(ok, opts.bound(ex.mean if d is None else ex.mean * d, vs[i]), 0.0)
    # A non-finite x on this device must not poison its worker error.
    new_ews.append(jnp.where(jnp.all(jnp.isfinite(x)), x - ex.sent, e))
  return _Moments(new_m, new_v, new_ews, [ex.server_error for ex in exchanged])


class _Steps(NamedTuple):
  directions: list  # m̂ / (sqrt(v̂) + ε) per leaf, in the gradient's dtype
  m: list  # the moments kept: the new ones where finite, else the previous
  v: list
  moments_bad: Array  # shape=(), bool: some leaf's new moments were not finite


def _compute_directions(opts: _Options, count, gs, new: _Moments, ms, vs, comp) -> _Steps:
  """Adam's step direction of every leaf (bias-corrected; compressed leaves with the
  frozen ``v``'s correction), keeping the previous moments where the new ones overflow."""
  t = (count + 1).astype(_F32)
  c1 = 1 - jnp.float32(opts.b1) ** t if opts.bias_correction else None
  c2 = 1 - jnp.float32(opts.b2) ** t if opts.bias_correction else None
  c2_frozen = opts.v_correction(t)
  out, keep_m, keep_v, bad = [], [], [], jnp.zeros((), bool)
  is_comp = set(comp)
  for i, (g, m, v, m_old, v_old) in enumerate(zip(gs, new.m, new.v, ms, vs)):
    m_hat, v_hat = m, v
    if opts.bias_correction:
      m_hat = m / c1
      cv = c2_frozen if i in is_comp else c2
      if cv is not None:
        v_hat = v / cv
    u = m_hat / (jnp.sqrt(v_hat) + opts.eps)
    # New moments that are not finite (the same on every device) keep the old ones,
    # and the update says so: a finite gradient whose square overflows v would
    # otherwise step 0 silently (and, in the warm-up, leave v at 0 to be frozen).
    ok = jnp.all(jnp.isfinite(m)) & jnp.all(jnp.isfinite(v))
    bad = jnp.logical_or(bad, ~ok)
    out.append(treeutil.mark_nonfinite(u.astype(g.dtype), ok))
    keep_m.append(jnp.where(ok, m, m_old))
    keep_v.append(jnp.where(ok, v, v_old))
  return _Steps(out, keep_m, keep_v, bad)


def _update(opts: _Options, updates, state: OneBitAdamState):
  """One step of :func:`scale_by_onebit_adam`: moments (warm-up or compressed), then
  the step directions and the new state."""
  leaves, treedef = pipeline.open_update(updates, state.shapes, "jc.onebit_adam")
  gs = [g for _, g in leaves]
  ms, vs = treedef.flatten_up_to(state.m), treedef.flatten_up_to(state.v)
  ews = treedef.flatten_up_to(state.worker_error.inner)
  ess = treedef.flatten_up_to(state.server_error.inner)
  split = pipeline.Split.of([not isinstance(e, optax.MaskedNode) for e in ews])
  comp = split[0]
  _check_update(opts, leaves, ms, comp)
  layouts = [_layout(gs[i].size, opts.num_devices(), opts.bucket_size) for i in comp]
  ews = [ews[i][0] for i in comp]
  ess = [ess[i][0] for i in comp]
  compressed = functools.partial(_compressed_moments, opts, gs, ms, vs, ews, ess, split, layouts)
  warmup = functools.partial(_warmup_moments, opts, gs, ms, vs, ews, ess)
  if opts.freeze_step == 0:
    new = compressed()
  else:
    new = lax.cond(state.count >= opts.freeze_step, compressed, warmup)
  steps = _compute_directions(opts, state.count, gs, new, ms, vs, comp)

  bad = functools.reduce(
    jnp.logical_or, [~jnp.all(jnp.isfinite(g)) for g in gs], jnp.zeros((), bool)
  )
  moments_bad = steps.moments_bad
  if opts.axis_name is not None:
    bad = collectives.any_over_other_axes(bad, opts.axis_name)
    moments_bad = collectives.any_over_other_axes(moments_bad, opts.axis_name)
  worker = [optax.MaskedNode()] * len(gs)
  server = [optax.MaskedNode()] * len(gs)
  for i, e_w, e_s in zip(comp, new.worker_error, new.server_error):
    worker[i], server[i] = e_w[None], e_s[None]
  new_state = OneBitAdamState(
    count=state.count + 1,
    m=treedef.unflatten(steps.m),
    v=treedef.unflatten(steps.v),
    worker_error=transforms.PerDeviceState(treedef.unflatten(worker)),
    server_error=transforms.PerDeviceState(treedef.unflatten(server)),
    nonfinite_count=transforms.PerDeviceState(state.nonfinite_count.inner + bad.astype(jnp.int32)),
    moments_nonfinite_count=state.moments_nonfinite_count + moments_bad.astype(jnp.int32),
    shapes=state.shapes,
  )
  return treedef.unflatten(steps.directions), new_state


# ----------------------------------------------------------------------------- transforms


def scale_by_onebit_adam(
  *,
  freeze_step: int,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  bias_correction: bool = True,
  bucket_size: int | None = None,
  compress: str = "momentum",
  bound_momentum: bool = True,
  axis_name: Any = transforms.AXIS_REQUIRED,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
) -> optax.GradientTransformation:
  r"""Rescales local gradients by 1-bit Adam's step direction, exchange included.

  The core of :func:`onebit_adam` without its learning rate and weight decay, as
  ``optax.scale_by_adam`` is the core of ``optax.adamw``: each device's *local*
  gradient in, the step direction out, the same on every device,

  .. math::
    d = \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^{\min(t, T_w)})} + \epsilon}

  with ``m`` and ``v`` from Adam on the dense mean gradient during the warm-up
  (``t <= T_w``) and, after it, ``v`` frozen and the momentum exchanged 1-bit with
  two-stage error feedback: the math, the byte counts and the NaN/Inf policy are in
  :func:`onebit_adam`. ``jc.onebit_adam(lr, weight_decay=λ, ...)`` is
  ``optax.chain(jc.scale_by_onebit_adam(...), optax.add_decayed_weights(λ),
  optax.scale_by_learning_rate(lr))``.

  The transform places its own state (:class:`OneBitAdamState`): ``count``, ``m`` and
  ``v`` replicated, the error buffers per device and wrapped already, so
  :func:`jaxcomp.per_device_state` hands it back unchanged.

  Args:
    freeze_step: ``T_w``, the number of full-precision warm-up steps.
    b1, b2, eps, bias_correction, bucket_size, compress, bound_momentum: as in
      :func:`onebit_adam`.
    axis_name, filter: as in :func:`onebit_adam`.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the step directions, in the
    gradient's dtype.

  Example:
    >>> import jax.numpy as jnp, jaxcomp as jc
    >>> tx = jc.scale_by_onebit_adam(freeze_step=100, axis_name=None)  # one device
    >>> state = tx.init({"w": jnp.ones((64, 32))})
    >>> updates, state = tx.update({"w": jnp.ones((64, 32))}, state)
    >>> round(float(updates["w"][0, 0]), 4)  # Adam's first direction: sign(g)
    1.0

  References:
    Tang et al. *1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed*. ICML 2021, Algorithm 1. https://arxiv.org/abs/2102.02888
  """
  transforms.require_axis_name(axis_name, "jc.scale_by_onebit_adam")
  _check_options(None, freeze_step, b1, b2, eps, None, bucket_size, compress, bound_momentum)
  opts = _Options(
    freeze_step=int(freeze_step),
    b1=float(b1),
    b2=float(b2),
    eps=float(eps),
    bias_correction=bias_correction,
    bucket_size=bucket_size,
    compress=compress,
    bound_momentum=bound_momentum,
    axis_name=axis_name,
    filter_fn=transforms.default_filter if filter is None else filter,
  )

  def init_fn(params):
    return _init(opts, params)

  def update_fn(updates, state, params=None):
    del params
    return _update(opts, updates, state)

  tx = transforms.places_own_state(optax.GradientTransformation(init_fn, update_fn))
  return transforms.register_exchange(tx, "jc.scale_by_onebit_adam", axis_name)


def onebit_adam(
  learning_rate: float | optax.Schedule,
  *,
  freeze_step: int,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  bias_correction: bool = True,
  bucket_size: int | None = None,
  compress: str = "momentum",
  bound_momentum: bool = True,
  axis_name: Any = transforms.AXIS_REQUIRED,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
) -> optax.GradientTransformation:
  r"""1-bit Adam: Adam whose momentum is exchanged 1-bit with two-stage error feedback.

  Takes each device's *local* gradient ``g_i`` and returns the parameter updates, the
  same on every device (already multiplied by ``-learning_rate``, like ``optax.adam``);
  it is the whole optimizer, exchange included: do not chain another optimizer after it.
  With ``t = count + 1``, ``T_w = freeze_step``, K devices and
  ``ĝ = (1/K) Σ_i g_i`` (Algorithm 1):

  *Warm-up* (``t <= T_w``): Adam on the mean gradient, ``ĝ`` from a dense all-reduce
  (one buffer per dtype, :func:`jaxcomp.pmean_tree`):

  .. math::
    m \leftarrow \beta_1 m + (1-\beta_1)\,ĝ, \qquad
    v \leftarrow \beta_2 v + (1-\beta_2)\,ĝ^2 .

  *Compression* (``t > T_w``): ``v`` is frozen. Each device updates its own momentum
  ``m_i = β1 m + (1-β1) g_i`` and the momentum is averaged by a compressed all-reduce
  with error feedback on both of its stages:

  .. math::
    x_i = m_i + e_i, \quad e_i \leftarrow x_i - C[x_i]; \qquad
    y_j = \tfrac{1}{K}\textstyle\sum_i C[x_i]_j + \bar e_j, \quad
    \bar e_j \leftarrow y_j - C[y_j]; \qquad m \leftarrow (C[y_0], \dots, C[y_{K-1}])

  where ``C[x] = (||x||_2 / sqrt(d)) · sign(x)`` is the paper's scaled sign (the scale
  makes ``||C[x]|| = ||x||``; ``sign(0) = +1``), ``e_i`` is device ``i``'s worker
  error (the whole leaf) and ``ē_j`` the server error of chunk ``j``, kept by device
  ``j``, which owns the ``j``-th of K chunks of the leaf: chunk ``j`` of every
  ``C[x_i]`` goes to device ``j`` (``all_to_all``), which averages them and all-gathers
  ``C[y_j]``. ``m`` is then the same on every device. Nothing is dropped, only delayed:
  summed over steps, the applied momenta equal the devices' mean momenta minus the
  errors still held.

  In both stages the update is

  .. math::
    u = -\eta_t \left(\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^{\min(t, T_w)})}
        + \epsilon} + \lambda\,\theta\right)

  (``bias_correction=False``: without the two divisions, as DeepSpeed's ``OnebitAdam``).
  Before ``freeze_step`` it is ``optax.adamw`` (``optax.adam`` for ``λ = 0``) on the
  mean gradient, to float rounding.

  Scales (``bucket_size``): ``None`` follows DeepSpeed: one scale per leaf for a
  worker's payload and one per chunk for the server's; an integer gives one scale per
  ``bucket_size`` values of each chunk in both stages (4 more bytes each, a smaller
  compression error). Leaves the filter leaves out (biases, small tensors) get
  full-precision Adam throughout: ``ĝ`` by a dense all-reduce, ``v`` never frozen.

  Coordinates whose frozen ``v`` is 0 (no gradient on any warm-up step) keep ``m = 0``
  and take no step: Adam's step there is ``0 / (0 + ε) = 0``, which a sign cannot say
  (it would step ``s / ε``). DeepSpeed asks for that mask by hand (``exp_avg_mask``).

  *Momentum bound* (``bound_momentum=True``, the default; not in the paper). Live
  Adam's moments satisfy ``|m| <= B sqrt(v)`` for every gradient sequence, with
  ``B = (1-β1) / sqrt((1-β2)(1 - β1²/β2))`` (7.27 for the
  default betas), so its steps are at most ``η B`` per coordinate. A frozen ``v``
  breaks that: where the gradient after the freeze is larger than in the warm-up (a
  loss near zero at ``T_w``, so ``v`` tiny; a ReLU unit that revives), ``m / sqrt(v)``
  is unbounded, the scaled sign hands that coordinate's magnitude to its whole group,
  and the error feedback feeds it back: the run goes from a near-zero loss to NaN in a
  few steps. In the compression stage the local momentum ``m_i`` and the exchanged
  ``m`` are therefore clipped to ``±B sqrt(v)`` (elementwise, identical on every device
  for the exchanged one): a momentum live Adam could not have is cut, nothing else
  changes. The part cut is dropped, not fed back. ``False`` gives the paper's and
  DeepSpeed's unbounded update.

  What is compressed (``compress``): ``"momentum"`` is Algorithm 1, ``x_i = m_i + e_i``.
  ``"preconditioned"`` compresses the step direction instead,
  ``x_i = m_i / (sqrt(v̂) + ε) + e_i``, a fixed linear map of the momentum while ``v``
  is frozen (the same on every device), and sets ``m`` back from the exchanged one:
  without compression both are the same algorithm, and they move the same bytes. A
  scaled sign spreads one magnitude over its group, so with ``"momentum"`` a coordinate
  whose ``sqrt(v)`` is far below the group's RMS momentum gets a step of up to
  ``η s / sqrt(v)``; with ``"preconditioned"`` every coordinate's step is about ``η``
  times the group's RMS step direction, as in Adam. Prefer it when ``v`` spans orders of
  magnitude within a tensor (e.g. ReLU units that are nearly dead at the freeze).

  Bytes per device per step in the compression stage, for a compressed leaf of ``n``
  float32 values cut in K chunks of ``c = ceil(n/K)`` values (rounded up to a multiple
  of 32) with ``b`` scales each: ``(K-1)(c/8 + 4b)`` in the ``all_to_all`` and as much in
  the ``all_gather``, against ``2(K-1)/K · 4n`` for a dense all-reduce: about 32 times
  less. The stage is a ``lax.cond`` on ``count`` inside one compiled update, and
  :func:`jaxcomp.wire_report` reports its costliest branch, the warm-up (a dense
  all-reduce); report the compression stage on its own with ``freeze_step=0``.

  It is ``optax.chain(jc.scale_by_onebit_adam(...), optax.add_decayed_weights(λ),
  optax.scale_by_learning_rate(η))``, as ``optax.adamw`` is (no decay step when
  ``λ = 0``), so its state is that chain's tuple, :class:`OneBitAdamState` first.

  State (:class:`OneBitAdamState`, ``state[0]``): ``count``, ``m`` and ``v`` are
  replicated; the error buffers are per device and already wrapped, so
  :func:`jaxcomp.per_device_state` hands the transform back unchanged (wrapping it, as
  every other method, is correct; wrapping a chain around it is not);
  :func:`jaxcomp.state_specs` places both::

    tx = jc.onebit_adam(1e-3, freeze_step=2000, axis_name="b")
    specs = jc.state_specs(tx, params, axis_name="b", num_devices=mesh.size)
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    # in the step: grads = jax.grad(loss)(jc.vary(params, "b"), batch)
    #              updates, opt_state = tx.update(grads, opt_state, params)

  Under ``jax.pmap`` the same transform works as is. ``init`` must run where
  ``axis_name`` is bound (the server chunks depend on K); with ``axis_name=None`` it
  runs the same arithmetic on one device (K = 1: the compression is simulated).

  NaN/Inf policy (as :func:`jaxcomp.compress`): a leaf whose ``m_i + e_i`` is not finite
  on this device keeps its worker error, a chunk whose ``y_j`` is not finite keeps its
  server error, and a leaf whose new ``m`` or ``v`` is not finite keeps the previous
  ones (the same decision on every device: it reads exchanged values), so no state is
  poisoned; the updates are not finite, on every device (a NaN is never hidden), and
  ``nonfinite_count`` counts the steps where this device's gradient was not finite. A
  finite gradient can still overflow the moments (``g²`` past ``FLT_MAX`` from about
  ``1.8e19``): the leaf keeps its previous ``m`` and ``v`` (in the warm-up, a ``v`` of 0
  that would be frozen and stop the leaf for good), its update is non-finite and
  ``moments_nonfinite_count`` (replicated) counts the step, as it counts every step whose
  new moments were rejected. To skip such steps wrap the transform in
  :func:`jaxcomp.skip_nonfinite`.

  Args:
    learning_rate: ``η``, a float or an optax schedule of the step count.
    freeze_step: ``T_w``, the number of full-precision warm-up steps (the paper: 15-25%
      of training; ``v`` must have settled by then). ``0`` compresses from the first
      step with ``v = 0``, so the compressed leaves never move: only for byte counts of
      the compression stage (as ``jc.dgc(warmup_steps=0)``), not for training.
    b1, b2, eps: Adam's ``β1``, ``β2``, ``ε`` (added to ``sqrt(v̂)``).
    weight_decay: ``λ``, decoupled weight decay as in ``optax.adamw`` (needs ``params``
      in ``update``); applied to every leaf.
    bias_correction: Adam's bias correction (``True``, as ``optax.adam`` and the paper's
      warm-up); ``False`` for DeepSpeed's update, which has none.
    bucket_size: values per scale (see above); ``None``: DeepSpeed's.
    compress: ``"momentum"`` (Algorithm 1, DeepSpeed) or ``"preconditioned"`` (see
      above).
    bound_momentum: hold the compression stage's momentum to Adam's own bound
      ``|m| <= B sqrt(v)`` (see above; ``True``). ``False``: the paper's and
      DeepSpeed's unbounded update. Needs ``b1**2 < b2`` when ``True``.
    axis_name: the mapped axis to average over (required), or ``None``: the explicit
      one-device simulation, which exchanges nothing.
    filter: ``filter(path, leaf) -> bool`` choosing the compressed leaves; defaults to
      :func:`jaxcomp.default_filter`.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the parameter steps.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp as jc
    >>> tx = jc.onebit_adam(1e-3, freeze_step=100, axis_name=None)  # one device
    >>> params = {"w": jnp.ones((64, 32))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((64, 32))}, state, params)
    >>> round(float(updates["w"][0, 0]), 6)  # Adam's first step: -lr · sign(g)
    -0.001

  References:
    Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He. *1-bit Adam: Communication
    Efficient Large-Scale Training with Adam's Convergence Speed*. ICML 2021, Algorithm 1
    and Section 4. https://arxiv.org/abs/2102.02888
  """
  transforms.require_axis_name(axis_name, "jc.onebit_adam")
  _check_options(
    learning_rate, freeze_step, b1, b2, eps, weight_decay, bucket_size, compress, bound_momentum
  )
  core = scale_by_onebit_adam(
    freeze_step=freeze_step,
    b1=b1,
    b2=b2,
    eps=eps,
    bias_correction=bias_correction,
    bucket_size=bucket_size,
    compress=compress,
    bound_momentum=bound_momentum,
    axis_name=axis_name,
    filter=filter,
  )
  # No decay step for λ = 0: optax's asks for params even then, and onebit_adam without
  # weight decay takes none (both steps' states are empty, so the layout is the same).
  decay = optax.add_decayed_weights(float(weight_decay)) if weight_decay else optax.identity()
  tx = optax.chain(core, decay, optax.scale_by_learning_rate(learning_rate))
  # Under jc.two_level its moments and buffers are held per shard (elementwise Adam).
  tx = transforms.places_own_state(tx)
  return transforms.register_exchange(tx, "jc.onebit_adam", axis_name)
