"""The collective primitives: what every exchange of jaxcomp is made of.

Two layers, each used from the one above only:

* the transport, which knows no codec: :func:`gather_tree`, :func:`all_to_all_tree`,
  :func:`psum_tree` (:func:`pmean_tree`), :func:`psum_scatter_tree` move pytrees of
  arrays as one buffer per collective; :func:`agree` and :func:`fallback_cond` pick a
  branch every device takes; the axis helpers (:func:`axis_size`, :func:`vary`, ...) type values
  varying or invariant over the axis;
* the codec primitives, one per collective pattern, all of one shape (codecs, tensors,
  keys, axis -> an :class:`Exchanged` per tensor): :func:`gather_means`,
  :func:`dense_means`, :func:`psum_means`, :func:`two_phase_means`,
  :func:`reduce_scatter_means`. Each encodes, moves and decodes; a codec is called from
  here and nowhere above. The methods whose compressor is not a codec have theirs:
  :func:`chunked_mean` (DGC's chunks chosen across the devices), :func:`factor_sums`
  (PowerSGD's low-rank factors), :func:`two_phase_payloads` (1-bit Adam's masked
  signs).

The pipeline (:mod:`jaxcomp._src.exchanges.pipeline`) decides which leaf takes which primitive.
All run under ``jax.shard_map`` (``check_vma=True``: the gathered results are marked
invariant) and ``jax.pmap``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.plumbing.phases import DECODE_SCOPE
from jaxcomp._src.plumbing.phases import ENCODE_SCOPE
from jaxcomp._src.plumbing.phases import FALLBACK_SCOPE

Array = jax.Array
_F32 = jnp.float32


def axis_size(axis_name) -> int:
  """Size of a bound named axis, or a clear ``ValueError`` when it is not bound."""
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
      f"axis_name={axis_name!r} is not bound here: call the transform inside "
      f"jax.shard_map(..., mesh=...) over a mesh with that axis, or inside "
      f"jax.pmap(..., axis_name={axis_name!r}); use axis_name=None to compress "
      f"locally without a collective."
    ) from e


def varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` is marked device-varying (shard_map's check_vma)."""
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def tracks_varying(axis_name) -> bool:
  """Whether values are typed varying/invariant over ``axis_name`` (shard_map check_vma).

  ``lax.axis_index`` differs on every device, so it is typed varying exactly when the
  tracking is on; under ``jax.pmap`` and ``shard_map(check_vma=False)`` it is not.
  """
  return axis_name in varying_axes(lax.axis_index(axis_name))


def check_local(path, g, axis_name) -> None:
  """Raises a ``ValueError`` when the gradient ``g`` is already replicated over the axis.

  A compressor must see each device's own gradient: one that was all-reduced before
  (``jax.grad`` inside ``jax.shard_map`` with respect to replicated parameters inserts a
  dense ``psum``) would pay the dense exchange and then compress K equal copies. Only
  decidable where values are typed varying/invariant (``check_vma``); a no-op elsewhere
  and with ``axis_name=None``.
  """
  if axis_name is None or not tracks_varying(axis_name):
    return
  if axis_name not in varying_axes(g):
    raise ValueError(
      f"the gradient at {jax.tree_util.keystr(path)} is already replicated over "
      f"axis {axis_name!r}: it was all-reduced before compression. Inside "
      f"jax.shard_map, jax.grad with respect to replicated parameters sums the "
      f"gradient over devices (a dense psum); differentiate with respect to "
      f"jc.vary(params, {axis_name!r}) to get the local gradient."
    )


def vary(tree, axis_name):
  """Marks every array of ``tree`` as varying over ``axis_name`` (no data movement).

  Inside ``jax.shard_map`` (``check_vma=True``), ``jax.grad`` with respect to
  *replicated* parameters returns the gradient already summed over the devices: the
  transpose of the implicit broadcast is a ``psum``, a dense all-reduce that a compressed
  exchange exists to avoid. Differentiate with respect to ``vary(params, axis)`` instead
  to get each device's local gradient::

    grads = jax.grad(loss)(jc.vary(params, "batch"), batch)
    updates, opt_state = tx.update(grads, opt_state, params)

  ``axis_name`` may be a tuple of mesh axes (a two-level exchange's ``(slow, fast)``):
  the arrays are marked varying over each. A no-op under ``jax.pmap`` and
  ``shard_map(check_vma=False)``, and for arrays already varying.
  """
  names = _axis_names(axis_name)
  if not all(tracks_varying(a) for a in names):
    return tree

  def one(x):
    missing = tuple(a for a in names if a not in varying_axes(x))
    if not missing:
      return x
    return lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")

  return jax.tree.map(one, tree)


def _axis_names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def any_over_other_axes(flag: Array, axis_name) -> Array:
  """``flag`` (a bool scalar) or-ed over the mesh axes other than ``axis_name`` that it
  varies over (shard_map's check_vma); ``flag`` itself when there are none.

  On a mesh with more axes than the data axis (tensor parallelism over ``"model"``), a
  flag computed from one shard of a sharded gradient differs between the shards. The
  step-level flags that end up in state (a non-finite input, an overflow) must be the
  same on every device of a model group, or that state could not be held per data
  device; and a skipped step must be skipped by every shard. On a 1-D mesh, under
  ``jax.pmap`` and with check_vma off nothing is known to vary: no collective is added.
  """
  others = tuple(sorted(varying_axes(flag) - set(_axis_names(axis_name))))
  if not others:
    return flag
  return lax.psum(flag.astype(jnp.int32), others) > 0


def all_gather_invariant(x: Array, axis_name) -> Array:
  """``lax.all_gather`` whose result is replicated (invariant) over ``axis_name``."""
  # ``to="invarying"`` types the result invariant across the axis, so that shard_map's
  # check_vma accepts it as replicated.
  return lax.all_gather(x, axis_name, to="invarying")


def _as_words(x: Array, unit) -> Array:
  """Flat ``x`` as unsigned words of ``unit``'s width (no data change; bool as 0/1)."""
  x = x.reshape(-1)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  return lax.bitcast_convert_type(x, unit).reshape(-1)


def _from_words(w: Array, like) -> Array:
  """Inverse of :func:`_as_words` on a ``(K, words)`` block: ``(K, *like.shape)``."""
  k = w.shape[0]
  dtype = jnp.dtype(jnp.uint8 if like.dtype == jnp.bool_ else like.dtype)
  ratio = dtype.itemsize // w.dtype.itemsize
  if ratio > 1:
    w = w.reshape(k, -1, ratio)
  x = lax.bitcast_convert_type(w, dtype)
  if like.dtype == jnp.bool_:
    x = x != 0
  return x.reshape((k,) + like.shape)


def _fusable(leaves) -> bool:
  return len(leaves) > 1 and not any(jnp.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves)


def _exchange_words(leaves, exchange, *, per_device: bool) -> list[Array]:
  """``exchange`` run once on all ``leaves`` packed into one buffer of unsigned words.

  The words have the narrowest itemsize among the leaves, so the buffer holds exactly
  their bytes. ``exchange`` maps the packed buffer (``(words,)``, or ``(K, words)`` with
  ``per_device``: each leaf keeps its leading axis of K slices) to ``(K, words)``; the
  result is split back into ``(K, ...)`` arrays of the leaves' dtypes.
  """
  unit = jnp.dtype(f"uint{8 * min(jnp.dtype(x.dtype).itemsize for x in leaves)}")
  pack = jax.vmap(lambda a: _as_words(a, unit)) if per_device else (lambda a: _as_words(a, unit))
  words = [pack(x) for x in leaves]
  got = exchange(jnp.concatenate(words, axis=-1))
  out, offset = [], 0
  for x, w in zip(leaves, words):
    like = jax.ShapeDtypeStruct(x.shape[1:] if per_device else x.shape, x.dtype)
    out.append(_from_words(got[:, offset : offset + w.shape[-1]], like))
    offset += w.shape[-1]
  return out


def _by_varying(leaves) -> list[list[int]]:
  """Positions of ``leaves`` grouped by the mesh axes they vary over, in first-seen order.

  Leaves fused into one buffer come out typed varying over the union of their axes: on a
  mesh with a tensor-parallel axis, a replicated parameter's mean would come back typed
  varying over "model" next to a sharded one, and could no longer be returned as
  replicated. One collective per group keeps each leaf's type (one group on a 1-D mesh).
  """
  groups: dict = {}
  for i, x in enumerate(leaves):
    groups.setdefault(varying_axes(x), []).append(i)
  return list(groups.values())


def _grouped(leaves, exchange) -> list:
  """``exchange`` (a list of arrays -> a list of arrays) run once per :func:`_by_varying`
  group of ``leaves``; the results in the leaves' order."""
  out = [None] * len(leaves)
  for idx in _by_varying(leaves):
    for i, y in zip(idx, exchange([leaves[i] for i in idx])):
      out[i] = y
  return out


def gather_tree(tree, axis_name):
  """All-gathers every array of ``tree`` (stacked on a new leading axis) in one collective.

  The arrays are bit-cast to unsigned words of the narrowest itemsize among them,
  concatenated, all-gathered once and split again: the bytes on the wire are exactly the
  arrays' bytes, and a payload of several arrays (codes, scales, indices), or of several
  tensors, costs one collective's latency instead of one per array. (XLA combines
  independent all-reduces, but XLA:CPU does not combine all-gathers.)
  """
  leaves, treedef = jax.tree.flatten(tree)

  def exchange(group):
    if not _fusable(group):
      return [all_gather_invariant(a, axis_name) for a in group]
    return _exchange_words(group, lambda b: all_gather_invariant(b, axis_name), per_device=False)

  return treedef.unflatten(_grouped(leaves, exchange))


def all_to_all_tree(tree, axis_name):
  """``all_to_all`` over the leading (device) axis of every array of ``tree``, fused.

  Each array's leading axis has the axis size K; slice j goes to device j, which gets
  the K slices sent to it stacked in rank order. As in :func:`gather_tree`, the arrays
  travel as one buffer of unsigned words (exactly their bytes): one collective.
  """
  leaves, treedef = jax.tree.flatten(tree)

  def a2a(a):
    return lax.all_to_all(a, axis_name, split_axis=0, concat_axis=0)

  def exchange(group):
    if not _fusable(group):
      return [a2a(a) for a in group]
    return _exchange_words(group, a2a, per_device=True)

  return treedef.unflatten(_grouped(leaves, exchange))


def psum_tree(tree, axis_name):
  """``lax.psum`` of every array of ``tree``, as one all-reduce of one buffer per dtype.

  XLA combines independent all-reduces into one instruction of many operands, but
  XLA:CPU's collectives (gloo) still run one all-reduce per operand, each paying the
  link's latency: a model's dozen bias and small-kernel gradients cost a dozen
  message rounds. Here the arrays of each dtype are flattened into one buffer, summed
  once and split again; every element is summed exactly as by its own ``psum``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict = {}
  for i, x in enumerate(leaves):  # one buffer per dtype (and per varying axes)
    groups.setdefault((jnp.dtype(x.dtype), varying_axes(x)), []).append(i)
  out = list(leaves)
  for idx in groups.values():
    if len(idx) == 1:
      out[idx[0]] = lax.psum(leaves[idx[0]], axis_name)
      continue
    total = lax.psum(jnp.concatenate([leaves[i].reshape(-1) for i in idx]), axis_name)
    offset = 0
    for i in idx:
      n = leaves[i].size
      out[i] = total[offset : offset + n].reshape(leaves[i].shape)
      offset += n
  return treedef.unflatten(out)


def pmean_tree(tree, axis_name):
  """``lax.pmean`` of every array of ``tree`` through :func:`psum_tree` (one all-reduce
  per dtype); each leaf is its ``psum`` divided by the axis size, as ``lax.pmean``."""
  k = axis_size(axis_name)
  return jax.tree.map(lambda x: x / k, psum_tree(tree, axis_name))


def shared_key(key: Array, axis_name) -> Array:
  """``key`` typed invariant over ``axis_name``; every device must hold the same key.

  Under ``shard_map(check_vma=True)`` a key held in per-device state is typed varying
  even when its value is the same everywhere; a ``pmax`` of its 8 bytes of key data
  makes it invariant, so what is derived from it (shared indices) is too.
  """
  if not tracks_varying(axis_name) or axis_name not in varying_axes(key):
    return key
  data = lax.pmax(jax.random.key_data(key), axis_name)
  return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def shard_rows(x: Array, k: int, what: str = "x") -> Array:
  """``x`` cut along its first axis into the K shards ``P(axis)`` gives the devices,
  stacked: ``(K, d0/K, *x.shape[1:])``; row j is device j's shard. A ``ValueError``
  names ``what`` when the first axis does not divide by K."""
  if x.ndim == 0 or x.shape[0] % k:
    raise ValueError(
      f"{what} has shape {tuple(x.shape)}: a reduce-scatter cuts each leaf along its "
      f"first axis into {k} shards, which needs a first axis divisible by {k}; declare "
      f"the leaf unsharded (P() in param_specs) or pad it"
    )
  return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))


def psum_scatter_tree(tree, axis_name, *, mean: bool = True):
  """``lax.psum_scatter(x, scatter_dimension=0, tiled=True) / K`` of every array of
  ``tree`` (its first axis divisible by K), as one reduce-scatter per dtype; the sums,
  not divided by K, with ``mean=False`` (PowerSGD's factors are sums).

  The dense counterpart of :func:`reduce_scatter_means`: device j gets the mean of
  row j (:func:`shard_rows`), shaped ``(d0/K, ...)``, in the arrays' dtype. The arrays
  of one dtype (and one set of varying axes) are cut into their K rows, concatenated
  row by row and scattered once, so a model's leaves cost one collective's latency.
  """
  k = axis_size(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  rows = [shard_rows(x, k, f"leaf {i}") for i, x in enumerate(leaves)]
  groups: dict = {}
  for i, x in enumerate(leaves):
    groups.setdefault((jnp.dtype(x.dtype), varying_axes(x)), []).append(i)
  out = [None] * len(leaves)
  for idx in groups.values():
    flat = jnp.concatenate([rows[i].reshape(k, -1) for i in idx], axis=1)
    mine = lax.psum_scatter(flat, axis_name, scatter_dimension=0, tiled=True)[0]
    offset = 0
    for i in idx:
      n = rows[i][0].size
      out[i] = mine[offset : offset + n].reshape(rows[i].shape[1:])
      out[i] = out[i] / k if mean else out[i]
      offset += n
  return treedef.unflatten(out)


def agree(flag: Array, axis_name) -> Array:
  """``flag`` (a bool scalar) or-ed over the devices: a ``pmax`` of 4 bytes, so that
  every device takes the same branch (and runs the same collectives). This device's
  flag with ``axis_name=None``."""
  if axis_name is None:
    return flag
  return lax.pmax(flag.astype(jnp.int32), axis_name) > 0


def fallback_cond(agreed: Array, coded, fixed):
  """``fixed()`` where ``agreed`` (an overflow flag every device holds alike,
  :func:`agree`), else ``coded()``: a ``lax.cond`` whose ``fixed`` branch runs under
  ``jax.named_scope(FALLBACK_SCOPE)``, which :func:`jaxcomp.wire_report` lists apart (a
  rare path)."""

  def fixed_width(_):
    with jax.named_scope(FALLBACK_SCOPE):
      return fixed()

  return lax.cond(agreed, fixed_width, lambda _: coded(), None)


# ----------------------------------------------------------------------------- codec primitives
#
# One primitive per collective pattern, each with the same shape: the codecs (or one
# codec), this device's tensors and their keys in, an :class:`Exchanged` per tensor out.
# Each one encodes, moves the payloads through the transport above and decodes: a codec
# is called from one layer only. Which leaf takes which primitive is the pipeline's
# business (:func:`jaxcomp._src.exchanges.pipeline.route`), not theirs.
#
# * :func:`gather_means`: all-gather (and no axis: encode and decode locally), with the
#   full-precision leaves riding along at K <= 2 and the overflow branch of codecs with
#   a fallback format;
# * :func:`dense_means`: the full-precision leaves' all-reduce (and integer flags);
# * :func:`psum_means`: an all-reduce of summable payloads;
# * :func:`two_phase_means`: ``all_to_all`` + ``all_gather`` (scatter-reduce on payloads);
# * :func:`reduce_scatter_means`: ``all_to_all`` to the shard owners (ZeRO/FSDP).


class Exchanged(NamedTuple):
  """What a codec primitive returns per tensor."""

  mean: Array  # the averaged tensor, float32, identical on all devices (a shard after a
  #              reduce-scatter)
  sent: Array  # what this device's first-stage payload decodes to (float32)
  chunk_residual: Array | None  # new second-stage residual (two-phase with EF)
  overflow: Array  # bool scalar: a codec capacity overflowed on this device


def _encoded(codec: Codec, x: Array, key: Array, payload) -> tuple:
  """``(payload, overflow, sent)``: ``x`` encoded (unless ``payload`` was, by a fused
  error-feedback kernel or a method's own selection), and what it decodes to."""
  with jax.named_scope(ENCODE_SCOPE):
    if payload is None:
      payload, overflow = codec.encode_with_info(x, key=key)
    else:
      overflow = jnp.zeros((), bool)
    return payload, overflow, codec.decode(payload, _F32)


def _local(codec: Codec, x: Array, key: Array, payload) -> Exchanged:
  """No collective: encode and decode on this device (single-device simulation)."""
  if payload is not None:
    with jax.named_scope(DECODE_SCOPE):
      sent = codec.decode(payload, _F32)
    return Exchanged(sent, sent, None, jnp.zeros((), bool))
  with jax.named_scope(ENCODE_SCOPE):
    payload, overflow = codec.encode_with_info(x, key=key)
  fallback = codec.fallback
  with jax.named_scope(DECODE_SCOPE):
    if fallback is not None:  # what the receivers would decode, overflow or not
      sent = fallback.decode(fallback.encode(x, key=key), _F32)
    else:
      sent = codec.decode(payload, _F32)
  return Exchanged(sent, sent, None, overflow)


def _gather_with_fallback(codec: Codec, x: Array, key: Array, axis_name) -> Exchanged:
  """One tensor of a codec with a ``fallback`` (a variable-length format in a fixed
  buffer, e.g. Elias-coded QSGD): its own all-gather, since whether the buffer
  overflowed on *any* device decides what every device sends (:func:`fallback_cond`:
  the fallback's payload of the same quantization)."""
  k = axis_size(axis_name)
  with jax.named_scope(ENCODE_SCOPE):
    payload, overflow = codec.encode_with_info(x, key=key)
    # The fallback codes the same quantization (same key): decode what was sent from it.
    fixed = codec.fallback.encode(x, key=key)
    sent = codec.fallback.decode(fixed, _F32)

  def coded():
    gathered = gather_tree(payload, axis_name)
    with jax.named_scope(DECODE_SCOPE):
      return codec.decode_sum(gathered)

  def fixed_width():
    gathered = gather_tree(fixed, axis_name)
    with jax.named_scope(DECODE_SCOPE):
      return codec.fallback.decode_sum(gathered)

  total = fallback_cond(agree(overflow, axis_name), coded, fixed_width)
  return Exchanged(total / k, sent, None, overflow)


def _gather_decode(codecs, payloads, dense, axis_name) -> tuple[list, list]:
  """Means of the ``payloads`` (decoded, a codec each) and of the ``dense`` arrays.

  At K <= 2 one ``all_gather`` carries both: an all-gather then moves as many bytes as
  an all-reduce (``(K-1)·B = 2(K-1)/K·B``) and ``x_0 + x_1`` is the all-reduce's sum bit
  for bit (one addition, commutative): one message round per step instead of two. On
  more devices the all-gather would move ``K/2`` times the bytes: the dense arrays take
  :func:`dense_means` there. The values are the same either way.
  """
  k = axis_size(axis_name)
  n = len(payloads)
  if payloads and dense and k <= 2:
    gathered = gather_tree(payloads + dense, axis_name)
    with jax.named_scope(DECODE_SCOPE):
      means = _decode_means(codecs, gathered[:n], k)
      return means, [(g[0] + g[1] if k == 2 else g[0]) / k for g in gathered[n:]]
  means = []
  if payloads:
    gathered = gather_tree(payloads, axis_name)
    with jax.named_scope(DECODE_SCOPE):
      means = _decode_means(codecs, gathered, k)
  return means, (dense_means(dense, axis_name)[0] if dense else [])


def gather_means(
  codecs, xs, keys, axis_name, *, payloads=None, dense=()
) -> tuple[list[Exchanged], list[Array]]:
  """The all-gather primitive: the means over devices of the ``xs`` (each encoded with
  its own codec, e.g. QSGD levels chosen per leaf) and of the full-precision ``dense``
  arrays. Traffic per device ``(K-1)·B``.

  One ``all_gather`` for every payload (:func:`gather_tree`: one collective's latency per
  step, not one per tensor); each gathered payload is decoded and summed by its own
  codec (a fused kernel where the codec has one) and the means are written once on
  XLA:CPU (:func:`_decode_means`). The dense arrays ride in that all-gather at K <= 2,
  else share one all-reduce (:func:`_gather_decode`). A codec with a ``fallback`` takes
  its own all-gather with the overflow branch (:func:`_gather_with_fallback`). With
  ``axis_name=None`` every tensor is encoded and decoded locally.

  Args:
    codecs: a codec per tensor.
    xs: this device's tensors (ignored where ``payloads`` has a payload).
    keys: a typed key per tensor.
    axis_name: the mapped axis, or ``None``.
    payloads: per tensor, ``None`` or its payload already encoded (by a fused
      error-feedback kernel, or a method's own selection).
    dense: full-precision arrays to average exactly (needs an axis).

  Returns:
    ``(exchanged, dense_means)``: an :class:`Exchanged` per tensor and the dense means.
  """
  codecs, xs, keys = list(codecs), list(xs), list(keys)
  payloads = [None] * len(codecs) if payloads is None else list(payloads)
  if not len(codecs) == len(xs) == len(keys) == len(payloads):
    raise ValueError(
      f"got {len(codecs)} codecs for {len(xs)} tensors, {len(keys)} keys and "
      f"{len(payloads)} payloads"
    )
  dense = list(dense)
  if dense and axis_name is None:
    raise ValueError("dense arrays need an axis to average over")
  if axis_name is None:
    return [_local(*a) for a in zip(codecs, xs, keys, payloads)], []
  out: list = [None] * len(codecs)
  for i, (c, x, key, p) in enumerate(zip(codecs, xs, keys, payloads)):
    if p is None and c.fallback is not None:
      out[i] = _gather_with_fallback(c, x, key, axis_name)
  batch = [i for i, ex in enumerate(out) if ex is None]
  coded = {i: _encoded(codecs[i], xs[i], keys[i], payloads[i]) for i in batch}
  means, dense_out = _gather_decode(
    [codecs[i] for i in batch], [coded[i][0] for i in batch], dense, axis_name
  )
  for i, mean in zip(batch, means):
    out[i] = Exchanged(mean, coded[i][2], None, coded[i][1])
  return out, dense_out


def dense_means(xs, axis_name, *, counts=()) -> tuple[list, list]:
  """The full-precision primitive: ``pmean`` of the ``xs`` and ``psum`` of the integer
  scalars ``counts``, in one all-reduce per dtype (:func:`psum_tree`; the counts travel
  as float32).

  The counts are what the devices must agree on next to the dense leaves (a non-finite
  flag, a branch index held in per-device state): one message round, not one per flag.
  Their sums are exact up to 2**24 and come back as int32, typed invariant.
  """
  xs, counts = list(xs), list(counts)
  summed = psum_tree(xs + [c.astype(_F32) for c in counts], axis_name)
  k = axis_size(axis_name)
  return (
    [x / k for x in summed[: len(xs)]],
    [jnp.round(x).astype(jnp.int32) for x in summed[len(xs) :]],
  )


def _psum_mean(codec: Codec, x: Array, key: Array, axis_name) -> Exchanged:
  fields = codec.summable_fields
  if fields is None:
    raise ValueError(
      f"{type(codec).__name__} payloads cannot be summed: use collective='allgather' or 'two_phase'"
    )
  k = axis_size(axis_name)
  if codec.shared_randomness:
    key = shared_key(key, axis_name)
  with jax.named_scope(ENCODE_SCOPE):
    payload, overflow = codec.encode_with_info(x, key=key)
    sent = codec.decode(payload, _F32)
  arrays = {
    name: lax.psum(a, axis_name) if name in fields else a for name, a in payload.arrays.items()
  }
  with jax.named_scope(DECODE_SCOPE):
    total = codec.decode(type(payload)(arrays, payload.shape, payload.dtype), _F32)
  return Exchanged(total / k, sent, None, overflow)


def psum_means(codec: Codec, xs, keys, axis_name) -> list[Exchanged]:
  """The all-reduce primitive for linear payloads (e.g. shared-index RandomK).

  Requires ``codec.summable_fields``: the payload arrays named there are summed with
  ``psum`` and the others (shared indices, drawn from the same key on every device) are
  taken from this device, so the summed payload decodes to the sum of the K decodings.
  Traffic per device: ``2(K-1)/K`` times the summable arrays' bytes, flat in K.
  """
  return [_psum_mean(codec, x, key, axis_name) for x, key in zip(xs, keys)]


def factor_sums(factors, axis_name, *, dense=()) -> tuple[list, list]:
  r"""The low-rank primitive (PowerSGD's factors): the sums over devices of the
  ``factors`` and the means of the full-precision ``dense`` arrays, in one all-reduce
  per dtype (:func:`psum_tree`).

  PowerSGD exchanges ``M ≈ P Qᵀ`` as its two factors, each the product of a device's
  ``M`` with a matrix every device holds alike (``P = M Q``, then ``Q = Mᵀ P̂``), so the
  sum of the factors is the factor of the sum: :math:`\sum_i M_i Q = (\sum_i M_i) Q`.
  The sums are returned as they are (the method orthogonalizes ``ΣP``; it divides
  ``ΣQ`` by K); the dense arrays share the first all-reduce. Traffic per device
  ``2(K-1)/K`` times their bytes. Without an axis, the arrays themselves.

  Returns:
    ``(factor sums, dense means)``.
  """
  factors, dense = list(factors), list(dense)
  if axis_name is None:
    return factors, dense
  summed = psum_tree(dense + factors, axis_name)
  k = axis_size(axis_name)
  return summed[len(dense) :], [x / k for x in summed[: len(dense)]]


def chunked_mean(v: Array, density: float, chunk: int, axis_name) -> tuple[Array, Array]:
  r"""The chunked sparse primitive (DGC's coarse-grained sparsification, CSC): the mean
  over devices of ``v`` on the chunks the devices choose together, and where they are.

  ``v`` (flattened, zero-padded) is cut into ``n_c = ceil(n/c)`` chunks of ``c =
  chunk`` values; their L1 norms are summed over the devices (one all-reduce of ``n_c``
  floats; a NaN norm counts as ``inf``, so a non-finite chunk is sent and shows), every
  device takes the same ``m = min(n_c, ceil(density·n/c))`` chunks of largest summed
  norm, and only those are all-reduced:

  .. math:: \bar v_J = \frac1K \sum_{i=1}^K v^{(i)}_J,\qquad
     J = \operatorname{top}_m\Big(\sum_i \|v^{(i)}_{\text{chunk } j}\|_1\Big).

  The selection needs the devices' norms, so it cannot be a codec (one device's
  encoding): the primitive is its own. Traffic ``2(K-1)/K · 4 (n_c + m·c)`` bytes per
  device, flat in K.

  Returns:
    ``(mean, mask)``, both ``v``'s shape: the float32 mean on the chosen chunks and 0
    elsewhere, and whether each value's chunk was chosen (what this device sent).
  """
  n = v.size
  nc = -(-n // chunk)
  m = min(nc, max(1, math.ceil(density * n / chunk - 1e-9)))
  blocks = jnp.pad(v.reshape(-1), (0, nc * chunk - n)).reshape(nc, chunk)
  norms = lax.psum(jnp.sum(jnp.abs(blocks), axis=1), axis_name)
  norms = jnp.where(jnp.isnan(norms), jnp.inf, norms)
  _, chosen = lax.top_k(norms, m)
  k = axis_size(axis_name)
  total = lax.psum(blocks[chosen], axis_name) / k
  mean = jnp.zeros((nc, chunk), _F32).at[chosen].set(total).reshape(-1)[:n]
  mask = jnp.zeros((nc,), bool).at[chosen].set(True)
  mask = jnp.broadcast_to(mask[:, None], (nc, chunk)).reshape(-1)[:n]
  return mean.reshape(v.shape), mask.reshape(v.shape)


def _decode_means(codecs, gathered, k: int) -> list[Array]:
  """``codec.decode_sum(g) / K`` of every gathered payload (one codec each),
  materialized once on XLA:CPU.

  XLA fuses a cheap elementwise producer into each of its consumers: the optimizer
  after the exchange reads the mean several times (global-norm clipping, momentum,
  the update), so XLA:CPU would unpack the payloads again in each consumer's fusion.
  ``lax.optimization_barrier`` is removed before fusion on CPU; a ``lax.cond`` is not,
  so on CPU the decode runs inside one whose two branches are the same computation
  (its predicate, read from the received words, only keeps XLA from folding it): the
  mean is written once and the consumers read it, with the same values (a test checks
  that the barrier is still dropped on CPU; the XLA:CPU table of ``docs/benchmarks.md``
  times both forms). Not on GPU, where a conditional's predicate goes to the host and
  where the Pallas decode-sum kernel already writes the mean once.
  """
  return _materialized(lambda: [c.decode_sum(g) / k for c, g in zip(codecs, gathered)], gathered)


def _materialized(compute, received):
  """``compute()``; on XLA:CPU inside a ``lax.cond`` with ``compute`` in both branches,
  so that its results are written once instead of fused into each reader (see
  :func:`_decode_means`). The predicate reads one value of ``received`` (a pytree of
  received arrays, invariant across devices) only so that XLA cannot fold it."""
  leaves = jax.tree.leaves(received)
  if jax.default_backend() != "cpu" or not leaves:
    return compute()
  token = leaves[0].reshape(-1)[0]
  if jnp.issubdtype(token.dtype, jax.dtypes.extended) or token.size == 0:
    return compute()
  token = (
    lax.bitcast_convert_type(token, jnp.dtype(f"uint{8 * token.dtype.itemsize}"))
    if token.dtype != jnp.bool_
    else token.astype(jnp.uint8)
  )
  return lax.cond(token != 0x5A, compute, compute)


def two_phase_payloads(payloads, owner, axis_name):
  """The two-phase exchange (scatter-reduce, then all-gather) of payloads a method
  encodes itself: the pattern of :func:`two_phase_means` for a compressor that is not a
  :class:`Codec` (1-bit Adam's signs, masked by its frozen variance).

  ``payloads`` is a pytree whose arrays have a leading axis of K chunks: chunk j goes
  to device j, all in one ``all_to_all`` (:func:`all_to_all_tree`). ``owner(received,
  index)`` turns what this device received (the same tree, row i from device i) and
  its index on the axis into ``(second, extra)``: ``second`` the payloads of the chunk
  it owns, all-gathered in one ``all_gather`` (:func:`gather_tree`), ``extra`` what the
  owner keeps (its residual). With ``axis_name=None`` the same arithmetic on one
  device (K = 1, index 0).

  Returns:
    ``(gathered, extra)``: ``second`` of every device stacked on a new leading axis (in
    rank order), and this device's ``extra``.
  """
  if axis_name is None:
    second, extra = owner(payloads, 0)
    return jax.tree.map(lambda a: a[None], second), extra
  second, extra = owner(all_to_all_tree(payloads, axis_name), lax.axis_index(axis_name))
  return gather_tree(second, axis_name), extra


def two_phase_means(codec: Codec, xs, keys, axis_name, chunk_residuals=None) -> list[Exchanged]:
  """Scatter-reduce then all-gather on payloads (1-bit SGD §3.1, CGX, DeepSpeed).

  Each tensor is cut into K chunks (:meth:`Codec.to_chunks`: by default flat slices of
  equal aligned length, for per-column codecs blocks of whole columns or of column
  segments). Each device encodes its K chunks and sends chunk j to device j
  (``all_to_all``); device j decodes
  the K payloads of its chunk, averages them, adds its second-stage residual (when
  ``chunk_residuals`` gives one), re-encodes the average and ``all_gather``s it; every
  device decodes the K averaged chunks. Per-device traffic is about
  ``2 (K-1)/K · B(n)``, independent of K. All tensors share one ``all_to_all`` and one
  ``all_gather`` (their payloads fused, :func:`two_phase_payloads`): the same payloads
  and results, two collectives' latency.
  """
  k = axis_size(axis_name)
  chunk_residuals = [None] * len(xs) if chunk_residuals is None else list(chunk_residuals)
  firsts = []
  for x, key in zip(xs, keys):
    with jax.named_scope(ENCODE_SCOPE):
      chunks = codec.to_chunks(x, k)
      key1, key2 = jax.random.split(key)
      payloads, overflow = jax.vmap(lambda v, kk: codec.encode_with_info(v, key=kk))(
        chunks, jax.random.split(key1, k)
      )
      sent = codec.from_chunks(jax.vmap(lambda p: codec.decode(p, _F32))(payloads), x.shape)
    firsts.append((payloads, sent, jnp.any(overflow), key2))

  def owner(received, _):
    seconds = []
    for x, (_, _, _, key2), got, chunk_residual in zip(xs, firsts, received, chunk_residuals):
      real = _real_entries(codec, x, k, axis_name)
      with jax.named_scope(DECODE_SCOPE):
        avg = codec.decode_sum(got) / k
        if real is not None:
          avg = jnp.where(real, avg, 0.0)
        if chunk_residual is not None:
          avg = avg + chunk_residual
      with jax.named_scope(ENCODE_SCOPE):
        mine, overflow2 = codec.encode_with_info(avg, key=key2)
        new_residual = None
        if chunk_residual is not None:
          new_residual = avg - codec.decode(mine, _F32)
          if real is not None:
            new_residual = jnp.where(real, new_residual, 0.0)
          # A non-finite average must not poison the residual: keep the old one.
          new_residual = jnp.where(jnp.all(jnp.isfinite(avg)), new_residual, chunk_residual)
      seconds.append((mine, new_residual, overflow2))
    return [s[0] for s in seconds], seconds

  gathered, seconds = two_phase_payloads([f[0] for f in firsts], owner, axis_name)
  out = []

  def decode_all():
    return [
      codec.from_chunks(jax.vmap(lambda p: codec.decode(p, _F32))(g), x.shape)
      for x, g in zip(xs, gathered)
    ]

  with jax.named_scope(DECODE_SCOPE):  # written once on CPU, see _decode_means
    means = _materialized(decode_all, gathered)
  for x, (_, sent, overflow, _), (_, new_residual, overflow2), mean in zip(
    xs, firsts, seconds, means
  ):
    out.append(
      Exchanged(mean.reshape(x.shape), sent.reshape(x.shape), new_residual, overflow | overflow2)
    )
  return out


def _real_entries(codec: Codec, x: Array, k: int, axis_name) -> Array | None:
  """Where this device's two-phase chunk of ``x`` holds values of ``x`` (the rest is the
  zero padding past its end), or ``None`` when no chunk is padded.

  The padding must stay zero in the second stage. Codecs that decode a zero to a bucket
  value (OneBit's mean of the non-negative entries, ScaledSign's ``+scale``) send it
  nonzero in the first stage; averaged and re-encoded, it would enter the last bucket's
  statistics and build up in the second-stage residual, never delivered.
  """
  if k * math.prod(codec.chunk_shape(x.shape, k)) == x.size:
    return None
  return codec.to_chunks(jnp.ones(x.shape, jnp.bool_), k)[lax.axis_index(axis_name)]


def reduce_scatter_means(codec: Codec | None, xs, keys, axis_name) -> list[Exchanged]:
  r"""A compressed reduce-scatter: this device's shard of the mean of every ``x``.

  The ZeRO/FSDP gradient exchange (ZeRO++'s qgZ, with any codec). Each tensor ``x``
  (this device's full-size local gradient, first axis divisible by K) is cut along its
  first axis into K rows, row j being the shard ``P(axis)`` gives device j
  (:func:`shard_rows`). Each row is encoded on its own (``jax.vmap``, a key per row
  split from ``key``), row j's payload goes to device j in one ``all_to_all`` for all
  tensors (:func:`all_to_all_tree`), and device j decodes the K payloads of its row and
  sums them in float32 (``codec.decode_sum``, never a low-precision reduction):

  .. math:: \bar g_j = \frac1K \sum_{i=1}^{K} Q^{-1}(Q(x^{(i)}_j)).

  Per device the traffic is ``(K-1)/K`` of the compressed payload of ``x`` (a dense
  float32 ``psum_scatter`` moves ``(K-1)/K · 4n`` bytes), and no device ever holds the
  full mean. With an unbiased codec (QSGD) the shard is an unbiased estimate of the
  mean's shard, its variance the codec's per row divided by K.

  ``codec=None`` is the dense exchange, :func:`psum_scatter_tree` (one reduce-scatter
  per dtype, in the arrays' dtype; ``sent`` is ``x`` itself).

  Args:
    codec: a codec without a fallback (a fixed-width payload), or ``None`` (dense).
    xs: the tensors, each this device's full-size local value.
    keys: a typed key per tensor (already folded with the device index where the
      codec's randomness is per device); split into K row keys.
    axis_name: the mapped axis of K devices the shards are spread over.

  Returns:
    An :class:`Exchanged` per tensor: ``mean`` this device's shard of the mean,
    ``(d0/K, *x.shape[1:])`` in float32; ``sent`` what this device's K payloads decode
    to, in ``x``'s full shape (float32), for error feedback; ``chunk_residual`` None;
    ``overflow`` whether the codec overflowed on any row.
  """
  k = axis_size(axis_name)
  xs, keys = list(xs), list(keys)
  if codec is None:
    means = psum_scatter_tree(xs, axis_name)
    return [
      Exchanged(m.astype(_F32), x.astype(_F32), None, jnp.zeros((), bool))
      for m, x in zip(means, xs)
    ]
  if codec.fallback is not None:
    raise ValueError(
      f"{type(codec).__name__} has a fallback format for overflows, which needs the "
      f"all-gather exchange; a reduce-scatter needs a fixed-width codec"
    )
  firsts = []
  for i, (x, key) in enumerate(zip(xs, keys)):
    rows = shard_rows(x, k, f"tensor {i}")
    with jax.named_scope(ENCODE_SCOPE):
      payloads, overflow = jax.vmap(lambda v, kk: codec.encode_with_info(v, key=kk))(
        rows, jax.random.split(key, k)
      )
      sent = jax.vmap(lambda p: codec.decode(p, _F32))(payloads).reshape(x.shape)
    firsts.append((payloads, sent, jnp.any(overflow)))
  received = all_to_all_tree([f[0] for f in firsts], axis_name)
  with jax.named_scope(DECODE_SCOPE):
    means = _decode_means([codec] * len(xs), received, k)
  return [Exchanged(m, sent, None, overflow) for m, (_, sent, overflow) in zip(means, firsts)]
