"""Compressed exchanges of one tensor across a named axis (shard_map or pmap).

Each function takes a float32 tensor already local to the device and returns the mean
over the axis, identical on every device, together with what this device's own payloads
decode to (for error feedback). All run under ``jax.shard_map`` (``check_vma=True``: the
gathered results are marked invariant) and ``jax.pmap``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from jaxcomp._src.codecs import Codec
from jaxcomp._src.codecs import flat_chunk_length
from jaxcomp._src.phases import DECODE_SCOPE
from jaxcomp._src.phases import ENCODE_SCOPE

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

  A no-op under ``jax.pmap`` and ``shard_map(check_vma=False)``, and for arrays already
  varying.
  """
  if not tracks_varying(axis_name):
    return tree

  def one(x):
    if axis_name in varying_axes(x):
      return x
    return lax.pcast(x, axis_name, to="varying")

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


class Exchanged(NamedTuple):
  mean: Array  # the averaged tensor, float32, identical on all devices
  sent: Array  # what this device's first-stage payload decodes to (float32)
  chunk_residual: Array | None  # new second-stage residual (two-phase with EF)
  overflow: Array  # bool scalar: a codec capacity overflowed on this device


def local(codec: Codec, x: Array, key: Array) -> Exchanged:
  """No collective: encode and decode on this device (single-device simulation)."""
  with jax.named_scope(ENCODE_SCOPE):
    payload, overflow = codec.encode_with_info(x, key=key)
  fallback = codec.fallback
  with jax.named_scope(DECODE_SCOPE):
    if fallback is not None:  # what the receivers would decode, overflow or not
      sent = fallback.decode(fallback.encode(x, key=key), _F32)
    else:
      sent = codec.decode(payload, _F32)
  return Exchanged(sent, sent, None, overflow)


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
  that the barrier is still dropped on CPU; ``python -m benchmarks.studies.xla_cpu_pitfalls``
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


def payload_means(codecs, payloads, axis_name) -> list[Array]:
  """Means over devices of what each device's ``payloads`` decode to (float32), one
  each, with a codec per payload (e.g. QSGD levels chosen per leaf).

  One ``all_gather`` for all of them (:func:`gather_tree`); each gathered payload is
  decoded and summed by its own codec (a fused kernel where the codec has one), and the
  means are written once on XLA:CPU (see :func:`_decode_means`). With ``axis_name=None``
  the local decodings. For codecs without a fallback.
  """
  codecs, payloads = list(codecs), list(payloads)
  if len(codecs) != len(payloads):
    raise ValueError(f"got {len(codecs)} codecs for {len(payloads)} payloads")
  if axis_name is None:
    with jax.named_scope(DECODE_SCOPE):
      return [c.decode(p, _F32) for c, p in zip(codecs, payloads)]
  k = axis_size(axis_name)
  gathered = gather_tree(payloads, axis_name)
  with jax.named_scope(DECODE_SCOPE):
    return _decode_means(codecs, gathered, k)


def _gather_with_dense(codecs, payloads, dense, axis_name) -> tuple[list, list]:
  """:func:`payload_means` of ``payloads`` and the exact means of the ``dense`` arrays,
  all from one ``all_gather``; for axes of at most 2 devices.

  At K = 2 an all-gather moves as many bytes as an all-reduce (``(K-1)·B = 2(K-1)/K·B``)
  and ``x_0 + x_1`` is the all-reduce's sum bit for bit (one addition, commutative), so
  the full-precision leaves can share the payloads' collective: one message round per
  step instead of two. On more devices the all-gather would move ``K/2`` times the
  bytes: use :func:`payload_means` and :func:`pmean_tree` there.
  """
  k = axis_size(axis_name)
  if k > 2:
    raise ValueError(f"_gather_with_dense needs an axis of at most 2 devices, got {k}")
  payloads, dense = list(payloads), list(dense)
  gathered = gather_tree(payloads + dense, axis_name)
  with jax.named_scope(DECODE_SCOPE):
    means = _decode_means(list(codecs), gathered[: len(payloads)], k)
    dense_means = [(g[0] + g[1] if k == 2 else g[0]) / k for g in gathered[len(payloads) :]]
  return means, dense_means


def exchange_means(codecs, payloads, dense, axis_name) -> tuple[list, list]:
  """Means of the ``payloads`` (decoded, a codec each) and of the full-precision
  ``dense`` arrays.

  With payloads on at most 2 devices, one ``all_gather`` carries both
  (:func:`_gather_with_dense`); otherwise the payloads take :func:`payload_means` and
  the dense arrays one all-reduce (:func:`pmean_tree`). The values are the same either
  way.
  """
  payloads, dense = list(payloads), list(dense)
  if dense and axis_name is None:
    raise ValueError("dense arrays need an axis to average over")
  if payloads and dense and axis_size(axis_name) <= 2:
    return _gather_with_dense(codecs, payloads, dense, axis_name)
  means = payload_means(codecs, payloads, axis_name) if payloads else []
  return means, (pmean_tree(dense, axis_name) if dense else [])


def pmean_and_count(dense, counts, axis_name) -> tuple[list, list]:
  """``pmean`` of the ``dense`` arrays and ``psum`` of the integer scalars ``counts``,
  in one all-reduce (:func:`psum_tree`; the counts travel as float32).

  For what the devices must agree on next to the dense leaves (a non-finite flag, a
  branch index held in per-device state): one message round, not one per flag. The
  counts' sums are exact up to 2**24 and come back as int32, typed invariant.
  """
  dense, counts = list(dense), list(counts)
  summed = psum_tree(dense + [c.astype(_F32) for c in counts], axis_name)
  k = axis_size(axis_name)
  return (
    [x / k for x in summed[: len(dense)]],
    [jnp.round(x).astype(jnp.int32) for x in summed[len(dense) :]],
  )


def allgather_mean(codec: Codec, x: Array, key: Array, axis_name) -> Exchanged:
  """All-gather the payloads, decode all K, average. Traffic per device: (K-1)·B.

  A codec with a ``fallback`` codec (a variable-length format in a fixed buffer, e.g.
  Elias-coded QSGD) whose buffer overflowed on *any* device makes every device send
  the fallback's payload of the same quantization instead: a ``pmax`` of the overflow
  flags (4 bytes) picks the branch of a ``lax.cond``, so all devices run the same
  collectives. The fallback branch runs under ``jax.named_scope("jaxcomp_fallback")``
  and :func:`jaxcomp.wire_report` lists its bytes apart.
  """
  k = axis_size(axis_name)
  with jax.named_scope(ENCODE_SCOPE):
    payload, overflow = codec.encode_with_info(x, key=key)
  fallback = codec.fallback
  if fallback is None:
    with jax.named_scope(ENCODE_SCOPE):
      sent = codec.decode(payload, _F32)
    return Exchanged(payload_means([codec], [payload], axis_name)[0], sent, None, overflow)
  # The fallback codes the same quantization (same key): decode what was sent from it.
  with jax.named_scope(ENCODE_SCOPE):
    fixed = fallback.encode(x, key=key)
    sent = fallback.decode(fixed, _F32)
  any_overflow = lax.pmax(overflow.astype(jnp.int32), axis_name) > 0

  def coded(_):
    gathered = gather_tree(payload, axis_name)
    with jax.named_scope(DECODE_SCOPE):
      return codec.decode_sum(gathered)

  def fixed_width(_):
    with jax.named_scope("jaxcomp_fallback"):
      gathered = gather_tree(fixed, axis_name)
      with jax.named_scope(DECODE_SCOPE):
        return fallback.decode_sum(gathered)

  total = lax.cond(any_overflow, fixed_width, coded, None)
  return Exchanged(total / k, sent, None, overflow)


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


def psum_mean(codec: Codec, x: Array, key: Array, axis_name) -> Exchanged:
  """All-reduce the summable arrays of a linear payload (e.g. shared-index RandomK).

  Requires ``codec.summable_fields``: the payload arrays named there are summed with ``psum``
  and the others (shared indices, drawn from the same key on every device) are taken
  from this device, so the summed payload decodes to the sum of the K decodings.
  Traffic per device: ``2(K-1)/K`` times the summable arrays' bytes, flat in K.
  """
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


def chunk_length(codec: Codec, n: int, k: int) -> int:
  """Length of each of the K flat chunks of an n-vector: ceil(n/K) rounded to the
  alignment (:meth:`Codec.chunk_shape` of codecs that chunk a flat tensor)."""
  return flat_chunk_length(codec.alignment, n, k)


def two_phase_means(codec: Codec, xs, keys, axis_name, chunk_residuals=None) -> list[Exchanged]:
  """Scatter-reduce then all-gather on payloads (1-bit SGD §3.1, CGX, DeepSpeed).

  Each tensor is cut into K chunks (:meth:`Codec.to_chunks`: by default flat slices of
  equal aligned length, for per-column codecs blocks of whole columns). Each device
  encodes its K chunks and sends chunk j to device j (``all_to_all``); device j decodes
  the K payloads of its chunk, averages them, adds its second-stage residual (when
  ``chunk_residuals`` gives one), re-encodes the average and ``all_gather``s it; every
  device decodes the K averaged chunks. Per-device traffic is about
  ``2 (K-1)/K · B(n)``, independent of K. All tensors share one ``all_to_all`` and one
  ``all_gather`` (their payloads fused, :func:`all_to_all_tree`, :func:`gather_tree`):
  the same payloads and results, two collectives' latency.
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
  received = all_to_all_tree([f[0] for f in firsts], axis_name)
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
  gathered = gather_tree([s[0] for s in seconds], axis_name)
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


def psum_scatter_tree(tree, axis_name):
  """``lax.psum_scatter(x, scatter_dimension=0, tiled=True) / K`` of every array of
  ``tree`` (its first axis divisible by K), as one reduce-scatter per dtype.

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
      out[i] = mine[offset : offset + n].reshape(rows[i].shape[1:]) / k
      offset += n
  return treedef.unflatten(out)


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


def chunk_residual_shape(codec: Codec, shape, k: int) -> tuple[int, ...]:
  """Shape of the second-stage residual of a tensor of ``shape`` (an int: a flat tensor of
  that many values): one chunk, :meth:`Codec.chunk_shape`."""
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  return tuple(codec.chunk_shape(shape, k))


COLLECTIVES = ("allgather", "two_phase", "psum", "auto", "reduce_scatter")


#: Why :func:`jaxcomp.dgc` and :func:`jaxcomp.mipd` have no reduce-scatter exchange.
DGC_NO_REDUCE_SCATTER = (
  "its top-k selection, momentum correction and residual run on each device's whole "
  "gradient, and its exchange sums sparse entries chosen over the whole tensor"
)
MIPD_NO_REDUCE_SCATTER = (
  "its prediction and the kept entries it exchanges are chosen over the whole "
  "gradient, with state that is the same on every device"
)


def refuse_reduce_scatter(collective: str, who: str, why: str) -> None:
  """A ``ValueError`` saying why ``who`` has no ``collective="reduce_scatter"``."""
  if collective == "reduce_scatter":
    raise ValueError(
      f"{who} does not support collective='reduce_scatter': {why}. For parameters "
      f"sharded over the data axis use jc.compress (or jc.qsgd, jc.onebit_sgd, "
      f"jc.ef_signsgd, jc.sparsify) with collective='reduce_scatter'"
    )


def resolve(collective: str, codec: Codec, k: int) -> str:
  """The exchange ``collective`` stands for on ``k`` devices (``"auto"`` resolved).

  ``"auto"`` is ``"allgather"`` for K <= 2, where it moves the same bytes as the
  two-phase exchange (``(K-1)·B = 2(K-1)/K·B = B``) with one encode and decode, one
  collective and no second quantization, and for codecs with a fallback (which need
  it); else ``"two_phase"``, whose traffic stays flat in K.
  """
  if collective != "auto":
    return collective
  return "allgather" if k <= 2 or codec.fallback is not None else "two_phase"


def leaf_collective(collective: str, codec: Codec, k: int, shape, dtype) -> str:
  """The exchange ``collective`` stands for on ``k`` devices for one leaf.

  As :func:`resolve`, and ``"auto"`` keeps a leaf on the all-gather when the two-phase
  exchange would move at least as many bytes for it: ``2(K-1)`` chunk payloads
  (:meth:`Codec.chunk_shape`) against ``K-1`` payloads of the whole leaf. That happens
  when the chunks are mostly padding, as with per-column buckets on a matrix of fewer
  columns than devices (a vector is one column: its K chunks are K whole columns, K-1 of
  them zeros).
  """
  mode = resolve(collective, codec, k)
  if collective != "auto" or mode != "two_phase":
    return mode
  shape = tuple(int(d) for d in shape)
  chunk = tuple(codec.chunk_shape(shape, k))
  if 2 * codec.wire_bits(chunk, dtype) >= codec.wire_bits(shape, dtype):
    return "allgather"
  return mode


#: The exchanges a leaf can take (:func:`route`).
ROUTES = (
  "dense",
  "fused",
  "local",
  "two_phase",
  "psum",
  "gathered",
  "fallback",
  "dense_scatter",
  "reduce_scatter",
)


def route(codec: Codec, mode: str, axis_name, *, selected: bool, fused: bool = False) -> str:
  """The exchange one leaf takes in a step, decided once from static facts.

  * ``"dense"``: the filter leaves it out; averaged in full precision with the other
    dense leaves in one all-reduce (or inside the payloads' all-gather at K <= 2).
  * ``"fused"``: error feedback fused into the encoding kernel (``fused``, which the
    caller decides from :meth:`Codec.fuses_feedback`); gathered like ``"gathered"``.
  * ``"local"``: no axis: encoded and decoded on this device (:func:`local`).
  * ``"two_phase"``: batched with the other such leaves (:func:`two_phase_means`).
  * ``"psum"``: summable payloads, all-reduced on their own (:func:`psum_mean`).
  * ``"gathered"``: payloads all-gathered together with the other leaves'.
  * ``"fallback"``: a variable-length codec with an overflow branch: its own all-gather
    (:func:`allgather_mean`), since the branch decides per leaf what is sent.
  * ``"dense_scatter"``: a leaf sharded over the axis that the filter leaves out:
    its shard of the mean by a dense reduce-scatter (:func:`psum_scatter_tree`).
  * ``"reduce_scatter"``: a sharded leaf, batched with the other such leaves into one
    compressed reduce-scatter (:func:`reduce_scatter_means`).

  The order of the tests is the precedence: a fused leaf is gathered even without an
  axis (the payloads are then decoded locally).

  Args:
    codec: the leaf's codec.
    mode: the resolved collective (:func:`resolve`), or the requested one without an axis.
    axis_name: the mapped axis, or ``None``.
    selected: whether the filter compresses the leaf.
    fused: whether the leaf may take the fused error-feedback kernel.

  Returns:
    One of :data:`ROUTES`.
  """
  if not selected:
    return "dense_scatter" if mode == "reduce_scatter" else "dense"
  if fused and mode == "allgather" and codec.fallback is None:
    return "fused"
  if axis_name is None:
    return "local"
  if mode in ("two_phase", "psum", "reduce_scatter"):
    return mode
  return "gathered" if codec.fallback is None else "fallback"
