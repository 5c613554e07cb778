"""Per-layer FSDP (ZeRO-3): gather a layer's weights in its forward, reduce-scatter its
gradient, compressed, in its backward.

Written around a layer's use of its weights, ``w = fsdp_gather(shards, ...)``, the
exchange happens where the layer is: inside ``lax.scan`` over stacked layers, each
layer's full-size gradient exists only while that layer's backward runs, is encoded,
reduce-scattered and dropped, so the model's full-size gradient is never materialized
(and on a GPU XLA can overlap one layer's exchange with the next layer's backward).
"""

from __future__ import annotations

import functools
import weakref

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp

from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import qweights

Array = jax.Array
_F32 = jnp.float32


def _grad_keys(key, n: int, axis_name, codec) -> list:
  """One key per leaf for the gradient codec, distinct on every device (a constant
  key for a deterministic codec, which ignores it)."""
  if codec is None or not codec.needs_key:
    return [jax.random.key(0)] * n
  if key is None:
    raise ValueError(f"grad_codec {type(codec).__name__} is stochastic: pass key=...")
  return list(jax.random.split(jax.random.fold_in(key, lax.axis_index(axis_name)), n))


def _split_key(key):
  """(weight key, gradient key) from one key (``None`` stays ``None``)."""
  if key is None:
    return None, None
  wk, gk = jax.random.split(key)
  return wk, gk


def _backward(axis_name, grad_codec, compressed, feedback, key, cts) -> tuple:
  """Cotangents of ``(shards, feedback, key)`` from the local full-size gradients
  ``cts`` (each in its shard's dtype, which the gather keeps): the leaves
  ``compressed`` marks go through ``grad_codec``'s reduce-scatter, the others through
  the dense one."""
  n = len(cts)
  if feedback is None:
    vs = [g.astype(_F32) for g in cts]
  else:
    vs = [g.astype(_F32) + e.astype(_F32) for g, e in zip(cts, feedback)]
  # No key is needed where the filter leaves every leaf dense.
  keys = _grad_keys(_split_key(key)[1], n, axis_name, grad_codec if any(compressed) else None)
  out = [None] * n
  for codec, on in ((grad_codec, True), (None, False)):
    idx = [i for i in range(n) if compressed[i] == on]
    # Without residuals, a dense leaf's gradient is reduce-scattered in its own dtype,
    # as dense FSDP's transposed all_gather does (a bfloat16 leaf in half float32's
    # bytes); with them, the float32 sum of gradient and residual.
    xs = [cts[i] if codec is None and feedback is None else vs[i] for i in idx]
    if idx:
      got = collectives.reduce_scatter_means(codec, xs, [keys[i] for i in idx], axis_name)
      for i, o in zip(idx, got):
        out[i] = o
  grads = [o.mean.astype(g.dtype) for o, g in zip(out, cts)]
  if feedback is None:
    return grads, None, None
  new = []
  for v, o, e in zip(vs, out, feedback):
    # A non-finite gradient must not poison the residual: keep the old one.
    new.append(jnp.where(jnp.all(jnp.isfinite(v)), v - o.sent, e.astype(_F32)).astype(e.dtype))
  return grads, new, None


_LOST = (
  "jc.fsdp_gather was given error-feedback residuals, but this differentiation does "
  "not ask for their gradient, which is where the new residuals come back: they would "
  "be dropped and error feedback silently switched off. Differentiate with respect to "
  "the residuals too, e.g. grads, feedback = jax.grad(loss, argnums=(0, 1))(params, "
  "feedback), and carry the new residuals to the next step (or pass feedback=None to "
  "go without)"
)

_SHARED = (
  "the same error-feedback residuals were fed to two jc.fsdp_gather calls under one "
  "differentiation (tied weights, or the loss evaluated twice): the residual would be "
  "added to both exchanges and their new residuals summed, so the error it holds would "
  "be sent twice. Give each gather its own residuals (jc.init_fsdp_feedback per "
  "gather; under lax.scan, pass them in xs), or gather the tied weights once and use "
  "the result twice"
)


@functools.lru_cache(maxsize=256)
def _gather_fn(axis_name, weight_codec, grad_codec, compressed, shared: bool):
  """The custom-VJP gather of one static configuration, ``(shards, feedback, key)``.

  ``compressed``: per leaf, whether the codecs compress it (the filter's answer);
  ``shared``: whether this call's residuals were fed to an earlier gather too.
  """

  def forward(shards, feedback, key):
    del feedback
    return qweights.gather_leaves(weight_codec, shards, axis_name, _split_key(key)[0], compressed)

  def fwd(shards, feedback, key):
    # Called only under differentiation, with each input's ``perturbed`` bit: the new
    # residuals leave the backward only as the residuals' gradient, so a
    # differentiation of the shards that does not also ask for that gradient would
    # drop them, and one residual fed to two gathers would be counted twice.
    if feedback is not None:
      if any(s.perturbed for s in shards) and not all(e.perturbed for e in feedback):
        raise ValueError(_LOST)
      if shared and any(e.perturbed for e in feedback):
        raise ValueError(_SHARED)
    values = [s.value for s in shards]
    fb = None if feedback is None else [e.value for e in feedback]
    key = None if key is None else key.value
    # Nothing of the forward is kept for the backward but the residuals and the key:
    # under lax.scan, residuals are stacked over the layers.
    return forward(values, fb, key), (fb, key)

  def bwd(res, cts):
    # A gathered leaf the loss does not use has a symbolic zero cotangent.
    cts = [jnp.zeros(c.aval.shape, c.aval.dtype) if isinstance(c, SymbolicZero) else c for c in cts]
    return _backward(axis_name, grad_codec, compressed, *res, cts)

  fn = jax.custom_vjp(forward)
  fn.defvjp(fwd, bwd, symbolic_zeros=True)
  return fn


def fsdp_gather(
  shards,
  feedback=None,
  *,
  axis_name,
  key=None,
  weight_codec: Codec | None = None,
  grad_codec: Codec | None = None,
  filter=None,  # pylint: disable=redefined-builtin
):
  r"""A layer's full weights from its shards; its backward reduce-scatters the gradient.

  Call inside ``jax.shard_map`` over ``axis_name``, where the layer uses its weights
  (inside ``lax.scan`` over stacked layers too). The forward is
  :func:`jaxcomp.gather_weights` (shards cut along the first axis; exact by default,
  from ``weight_codec``'s payload when one is given). The backward receives this
  device's full-size local gradient ``g`` of the gathered weights and, right there,
  returns as the gradient of ``shards`` this device's shard of the mean over the K
  devices,

  .. math::
    \bar g^{(j)} = \frac{1}{K} \sum_{i=1}^{K} \mathrm{decode}\big(
      \mathrm{encode}(v_i^{(j)})\big), \qquad v_i = g_i + e_i,

  from compressed row chunks (chunk j of device i's ``v_i`` goes to device j, which
  decodes and sums the K payloads in float32; traffic ``(K-1)/K`` of the payload), so
  no layer's full-size gradient outlives its backward. ``grad_codec=None`` reduce-scatters
  in the gradient's dtype (``lax.psum_scatter(g, tiled=True) / K``: dense FSDP with this
  forward). Both codecs apply to the leaves ``filter`` compresses (by default weights
  of at least 1024 values and 2 dimensions, judged by the full weight's shape); the
  others (biases, norms' scales) are gathered and reduce-scattered dense, in their
  dtype (in float32 where ``feedback`` is given, which is added in float32).

  **Error feedback** (optional, for biased codecs): pass ``feedback``, residuals shaped
  like the gathered weights (e.g. zeros at the start, in float32 or a narrower float
  dtype to halve their memory). The residual ``e`` is added before encoding, and the new
  residual ``e' = v - decode(encode(v))`` comes back as the *gradient of* ``feedback``
  (the input's "cotangent"): ``jax.grad(loss, argnums=(0, 1))`` gives the shards'
  gradient and the next residual, plain arrays to carry in the training state and
  checkpoint. A differentiation of the shards that does not also differentiate the
  residuals (the usual ``jax.grad(loss)(params, feedback)``) would drop the new
  residuals, so it is refused with a ``ValueError`` when traced; so is one residual fed
  to two gathers under one differentiation (tied weights, found by the array's
  identity: give each gather its own residuals, under ``lax.scan`` in ``xs``). The
  residual is full-size per device: it costs a copy of the layer. Unbiased codecs
  (:class:`~jaxcomp.codecs.QSGD`) need none (ZeRO++'s qgZ sends none).

  Args:
    shards: a pytree of this device's weight shards (floating-point, cut along axis 0).
    feedback: ``None``, or residuals shaped like the gathered weights (a pytree like
      ``shards``).
    axis_name: the data axis.
    key: a PRNG key (same on every device; folded with the device index inside), needed
      by stochastic codecs; under ``lax.scan``, one per layer.
    weight_codec: the forward gather's codec: ``None`` (the default) for the exact
      float gather, ``jc.codecs.BlockInt8()`` for int8 weights (ZeRO++'s qwZ: the
      forward then computes with rounded weights, a choice made here).
    grad_codec: the backward reduce-scatter's codec (``None``: dense, in the gradient's
      dtype).
    filter: ``filter(path, leaf) -> bool``, which leaves the codecs compress, asked of
      the full weight's shape and dtype; ``None`` is :func:`jaxcomp.default_filter`.

  Returns:
    The full weights, a pytree like ``shards`` (typed varying over the axis).

  Example:
    Inside ``shard_map``, with stacked layers ``ws`` ``(L, D/K, D)`` and ``keys`` ``(L,)``::

      def layer(h, xs):
        w_shard, k = xs
        w = jc.fsdp_gather(w_shard, axis_name="data", key=k,
                           weight_codec=jc.codecs.BlockInt8(),
                           grad_codec=jc.codecs.QSGD(7, 512, norm="max"))
        return jax.nn.relu(h @ w), None

      h, _ = lax.scan(jax.checkpoint(layer), x, (ws, keys))

  References:
    Rajbhandari et al. *ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models*. SC 2020. https://arxiv.org/abs/1910.02054;
    Wang et al. *ZeRO++*. 2023. https://arxiv.org/abs/2306.10209
  """
  k = collectives.axis_size(axis_name)
  qweights.check_shards(shards, k)
  leaves, treedef = jax.tree.flatten(shards)
  compressed = qweights.compressed_leaves(filter, shards, k)
  fb = None
  if feedback is not None:
    fb = _check_feedback(feedback, treedef, leaves, k, grad_codec, compressed)
  _check_per_device(leaves, "shards", axis_name)
  _check_per_device(fb or [], "feedback", axis_name)
  fn = _gather_fn(axis_name, weight_codec, grad_codec, compressed, _fed_before(fb or []))
  return treedef.unflatten(fn(leaves, fb, key))


def _check_feedback(feedback, treedef, leaves, k: int, grad_codec, compressed) -> list:
  """``feedback``'s leaves, or a ``ValueError`` saying what is wrong with them."""
  if grad_codec is None:
    raise ValueError("feedback needs a grad_codec: the full-precision exchange has no error")
  if not any(compressed):
    raise ValueError(
      "feedback has nothing to correct: the filter leaves every leaf of shards dense "
      "(full precision, no error); pass feedback=None, or a filter that compresses them"
    )
  fb, fb_def = jax.tree.flatten(feedback)
  if fb_def != treedef:
    raise ValueError(f"feedback must have the structure of shards: {fb_def} vs {treedef}")
  for i, (x, e) in enumerate(zip(leaves, fb)):
    full = (k * x.shape[0],) + tuple(x.shape[1:])
    if tuple(jnp.shape(e)) != full or not jnp.issubdtype(jnp.result_type(e), jnp.floating):
      raise ValueError(
        f"feedback leaf {i} must be a float array of the gathered shape {full}, "
        f"got {jnp.shape(e)} {jnp.result_type(e)}"
      )
  return fb


# The residual arrays fsdp_gather has been given, by id, held weakly (an entry goes
# with its array, so with the trace that made it): a trace-time check, not state.
_FED = weakref.WeakValueDictionary()


def _fed_before(leaves) -> bool:
  """Whether any of these residual arrays was given to an earlier gather still alive
  in this trace (it is recorded for the next call either way)."""
  seen = False
  for e in leaves:
    try:
      seen |= _FED.get(id(e)) is e
      _FED[id(e)] = e
    except TypeError:  # not weakly referenceable (a NumPy scalar): nothing to track
      pass
  return seen


def _check_per_device(leaves, what: str, axis_name) -> None:
  """A ``ValueError`` unless every leaf is typed varying over the axis (check_vma).

  Shards and residuals are each device's own. One typed replicated would have its
  gradient (the shard of the mean, the new residual) summed over the devices by JAX's
  transpose of the implicit broadcast: a dense all-reduce, and a wrong value.
  """
  if not collectives.tracks_varying(axis_name):
    return
  for i, x in enumerate(leaves):
    if axis_name not in collectives.varying_axes(x):
      raise ValueError(
        f"{what} leaf {i} is replicated over axis {axis_name!r}: it must be this "
        f"device's own array (passed into shard_map with P({axis_name!r}) on its "
        f"sharded axis, or a per-device leading axis)"
      )


def init_fsdp_feedback(shards, *, num_devices: int, dtype=jnp.float32):
  """Zero error-feedback residuals for :func:`fsdp_gather`: one per shard, of the
  gathered shape ``(num_devices · n0, ...)``, in ``dtype``.

  For stacked layers, ``jax.vmap`` it over the layer axis.
  """
  return jax.tree.map(
    lambda x: jnp.zeros((num_devices * x.shape[0],) + tuple(x.shape[1:]), dtype), shards
  )
