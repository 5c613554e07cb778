r"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024), as an optax transform.

Data parallelism without an all-reduce of the gradients: each device keeps its own
momentum ``m_i ← β m_i + g_i``, sends only its *fast components* (the ``k`` largest
coefficients of the DCT of each chunk of ``m_i``), removes what it sent from ``m_i``
and steps with the sign of the mean of everyone's fast components. The rest of the
momentum stays on the device, where it keeps accumulating until it is large enough
to be sent: the paper's observation is that the slow, high-energy components need
not be synchronised every step for the devices to stay together.

As :func:`jaxcomp.onebit_adam`, it is the optimizer, exchange included:
:func:`decoupled_momentum` chains :func:`scale_by_decoupled_momentum` (the momenta,
the exchange, the sign) with optax's decoupled weight decay and learning rate. The
core is written as named steps: ``_layout`` (how a leaf is cut into DCT blocks),
``_encode`` / ``_decode`` (the blockwise DCT and its inverse), ``_fast_components``
(top-k and the packed payload), ``_mean_of_payloads`` (the decoding of the gathered
payloads), wired by ``_update``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
_WHO = "jc.decoupled_momentum"


class DeMoState(NamedTuple):
  """State of :func:`scale_by_decoupled_momentum`, the first of
  :func:`decoupled_momentum`'s chain.

  Every field differs between devices (each device's momentum holds what it has not
  sent yet), so both sit in :class:`jaxcomp.PerDeviceState` wrappers, every leaf with a
  leading axis of 1 per device, which :func:`jaxcomp.state_specs` places on the data
  axis. ``momentum`` holds an array for each compressed leaf and ``optax.MaskedNode()``
  elsewhere (the dense leaves keep no momentum: see :func:`decoupled_momentum`).
  """

  momentum: Any  # PerDeviceState: m_i, shape=(1, *leaf shape), float32, per device
  nonfinite_count: Any  # PerDeviceState: shape=(1,), int32: steps with a NaN/Inf gradient
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


# ----------------------------------------------------------------------------- DCT


@functools.cache
def dct_basis(n: int) -> np.ndarray:
  r"""The orthonormal DCT-II matrix ``D`` of size ``n × n`` (float64, built once).

  .. math::
    D_{ah} = c_a \cos\left(\frac{\pi (2h + 1) a}{2n}\right), \qquad
    c_0 = \sqrt{1/n}, \; c_{a>0} = \sqrt{2/n}

  so that ``X = D x`` is the DCT-II of ``x`` with ``norm="ortho"`` (scipy's, the
  reference code's) and ``D^T D = I``: the inverse is ``D^T`` (a DCT-III), and a
  coefficient's magnitude is its share of the chunk's energy, which is what makes
  top-k by magnitude pick the dominant components.
  """
  if n < 1:
    raise ValueError(f"the DCT needs n >= 1, got {n}")
  a = np.arange(n)[:, None]
  h = np.arange(n)[None, :]
  d = np.cos(np.pi * (2 * h + 1) * a / (2 * n)) * np.sqrt(2.0 / n)
  d[0] /= np.sqrt(2.0)
  return d


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one compressed leaf is cut into DCT blocks.

  The leaf is viewed as a matrix of ``rows × cols`` (a vector as one row, a tensor of
  more dimensions as ``prod(shape[:-1]) × shape[-1]``), zero-padded to whole blocks of
  ``br × bc`` (``min(chunk_size, rows) × min(chunk_size, cols)``): ``nbr × nbc``
  blocks, each with ``br · bc`` coefficients of which ``k`` are sent.
  """

  shape: tuple
  rows: int
  cols: int
  br: int
  bc: int
  k: int

  @property
  def nbr(self) -> int:
    return -(-self.rows // self.br)

  @property
  def nbc(self) -> int:
    return -(-self.cols // self.bc)

  @property
  def blocks(self) -> int:
    return self.nbr * self.nbc

  @property
  def per_block(self) -> int:
    return self.br * self.bc

  @property
  def index_bits(self) -> int:
    """The fewest bits that hold an index within a block: ``ceil(log2(br · bc))``."""
    return max(1, math.ceil(math.log2(self.per_block)))


def _layout(shape: tuple, chunk_size: int, topk: int) -> _Layout:
  shape = tuple(int(s) for s in shape)
  if len(shape) <= 1:
    rows, cols = 1, int(np.prod(shape, dtype=np.int64))
  else:
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
  br, bc = min(chunk_size, rows), min(chunk_size, cols)
  return _Layout(shape, rows, cols, br, bc, min(topk, br * bc))


def _matmul(a, b, spec):
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)


def _encode(x: Array, lay: _Layout) -> Array:
  """``(blocks, br · bc)``: the 2-D DCT-II ``D_r X D_c^T`` of every block of ``x``."""
  mat = x.reshape(lay.rows, lay.cols)
  pad = ((0, lay.nbr * lay.br - lay.rows), (0, lay.nbc * lay.bc - lay.cols))
  mat = jnp.pad(mat, pad) if any(p for _, p in pad) else mat
  b = mat.reshape(lay.nbr, lay.br, lay.nbc, lay.bc)
  dr = jnp.asarray(dct_basis(lay.br), _F32)
  dc = jnp.asarray(dct_basis(lay.bc), _F32)
  b = _matmul(dr, b, "ah,ihjw->iajw")
  b = _matmul(b, dc, "iajw,bw->ijab")
  return b.reshape(lay.blocks, lay.per_block)


def _decode(coef: Array, lay: _Layout) -> Array:
  """The inverse of :func:`_encode` (``D_r^T C D_c`` per block), the padding dropped:
  an array of the leaf's shape."""
  c = coef.reshape(lay.nbr, lay.nbc, lay.br, lay.bc)
  dr = jnp.asarray(dct_basis(lay.br), _F32)
  dc = jnp.asarray(dct_basis(lay.bc), _F32)
  c = _matmul(dr, c, "ah,ijab->ijhb")
  c = _matmul(c, dc, "ijhb,bw->ihjw")
  mat = c.reshape(lay.nbr * lay.br, lay.nbc * lay.bc)[: lay.rows, : lay.cols]
  return mat.reshape(lay.shape)


# ----------------------------------------------------------------------------- payloads


def _fast_components(coef: Array, lay: _Layout) -> tuple[dict, Array]:
  """The ``k`` largest-magnitude coefficients of every block: the payload (float32
  values, indices packed in :attr:`_Layout.index_bits` bits each) and the dense
  ``(blocks, br · bc)`` array of what it carries (zeros elsewhere)."""
  _, idx = lax.top_k(jnp.abs(coef), lay.k)
  values = jnp.take_along_axis(coef, idx, axis=-1)
  words = bitpack.pack_bits(idx.reshape(-1).astype(jnp.uint32), lay.index_bits)
  return {"values": values.reshape(-1), "indices": words}, _scatter(values, idx, lay)


def _scatter(values: Array, idx: Array, lay: _Layout) -> Array:
  """``(blocks, br · bc)`` zeros with ``values`` at ``idx`` (both ``(blocks, k)``; the
  indices of a block are distinct, so the set is exact)."""
  rows = jnp.arange(lay.blocks)[:, None]
  return jnp.zeros((lay.blocks, lay.per_block), values.dtype).at[rows, idx].set(values)


def _unpack(payload: dict, lay: _Layout) -> tuple[Array, Array]:
  """``(values, indices)``, each ``(blocks, k)``, of one device's payload."""
  n = lay.blocks * lay.k
  idx = bitpack.unpack_bits(payload["indices"], lay.index_bits, n).astype(jnp.int32)
  return payload["values"].reshape(lay.blocks, lay.k), idx.reshape(lay.blocks, lay.k)


#: How ``Q`` averages the sent components: over all K devices (Algorithm 1), or each
#: coefficient over the devices that sent it (the reference code).
AVERAGES = ("devices", "senders")


def _mean_of_payloads(gathered: dict, lay: _Layout, k: int, average: str) -> Array:
  """The mean of the ``k`` devices' decoded fast components (leaf shape): each
  coefficient's sum over ``k`` (``average="devices"``), or over the devices that sent it
  (``"senders"``: the reference code's scatter-mean; 0 where none did).

  The devices' coefficients are scattered and summed in device order (a scan: one
  device's payload at a time, a program whose size does not grow with K), then decoded
  once (the DCT is linear). No scatter-add of all the payloads at once: where two
  devices sent the same coefficient, its order of accumulation would be left to the
  backend, and the replicas must compute the same sum bit for bit, or they drift apart.
  """

  senders = average == "senders"

  def add(carry, payload):
    total, count = carry
    vals, idx = _unpack(payload, lay)
    total = total + _scatter(vals, idx, lay)
    if senders:
      count = count + _scatter(jnp.ones_like(vals), idx, lay)
    return (total, count), None

  zeros = jnp.zeros((lay.blocks, lay.per_block), gathered["values"].dtype)
  (total, count), _ = lax.scan(add, (zeros, zeros), gathered, length=k)
  return _decode(total / (jnp.maximum(count, 1) if senders else k), lay)


# ----------------------------------------------------------------------------- options


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_options(learning_rate, chunk_size, topk, momentum_decay, weight_decay) -> None:
  """Every argument check of :func:`decoupled_momentum` and
  :func:`scale_by_decoupled_momentum` (``learning_rate`` and ``weight_decay`` are
  ``None`` for the latter)."""
  if learning_rate is not None and (
    not callable(learning_rate) and not isinstance(learning_rate, numbers.Real)
  ):
    raise TypeError(f"learning_rate must be a float or an optax schedule, got {learning_rate!r}")
  if not _is_int(chunk_size) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
  if not _is_int(topk) or topk < 1:
    raise ValueError(f"topk must be a positive integer, got {topk!r}")
  if topk > chunk_size * chunk_size:
    raise ValueError(
      f"topk={topk} exceeds the {chunk_size}x{chunk_size} = {chunk_size * chunk_size} "
      f"DCT coefficients of a chunk (chunk_size={chunk_size}): it would send every "
      f"component, a dense exchange with extra indices"
    )
  if not isinstance(momentum_decay, numbers.Real) or not 0.0 <= momentum_decay < 1.0:
    raise ValueError(f"momentum_decay must be in [0, 1), got {momentum_decay!r}")
  if weight_decay is not None and (
    not isinstance(weight_decay, numbers.Real) or not weight_decay >= 0
  ):
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`scale_by_decoupled_momentum`, checked and normalised."""

  chunk_size: int
  topk: int
  momentum_decay: float
  axis_name: Any
  filter_fn: transforms.FilterFn
  average: str = "devices"

  def num_devices(self) -> int:
    return 1 if self.axis_name is None else collectives.axis_size(self.axis_name)


# ----------------------------------------------------------------------------- steps


def _init(opts: _Options, params) -> DeMoState:
  """A zero momentum (per device) for each compressed leaf; none for the dense ones."""
  leaves, treedef = treeutil.flat(params)
  momentum = []
  for path, leaf in leaves:
    treeutil.check_leaf(path, leaf)
    if treeutil.selected(opts.filter_fn, path, leaf):
      momentum.append(jnp.zeros((1, *leaf.shape), _F32))
    else:
      momentum.append(optax.MaskedNode())
  pipeline.warn_if_nothing_compressed(
    _WHO,
    [not isinstance(m, optax.MaskedNode) for m in momentum],
    pipeline.filter_rule(opts.filter_fn, transforms.default_filter),
  )
  return DeMoState(
    momentum=transforms.PerDeviceState(treedef.unflatten(momentum)),
    nonfinite_count=transforms.PerDeviceState(jnp.zeros((1,), jnp.int32)),
    shapes=treeutil.LeafShapes.of(params),
  )


def _check_update(opts: _Options, leaves, comp) -> None:
  """Under shard_map with check_vma: the gradients must be each device's own."""
  if opts.axis_name is None or not collectives.tracks_varying(opts.axis_name):
    return
  for i in comp:
    collectives.check_local(*leaves[i], opts.axis_name)


def _compressed(opts: _Options, gs, ms, layouts):
  """Algorithm 1 for the compressed leaves: the new local momenta and the decoded mean
  of every device's fast components (the same on every device)."""
  payloads, kept = [], []
  with jax.named_scope(phases.ENCODE_SCOPE):
    for g, m, lay in zip(gs, ms, layouts):
      x = opts.momentum_decay * m + g.astype(_F32)  # m_i ← β m_i + g_i
      payload, sent = _fast_components(_encode(x, lay), lay)
      finite = jnp.all(jnp.isfinite(x))
      # A non-finite momentum is sent as NaN (top-k alone might leave the NaN out and
      # hide it): every device's mean of this leaf is then NaN, and so is its step.
      payload["values"] = jnp.where(finite, payload["values"], jnp.nan)
      # m_i ← m_i − q_i, unless that would poison the momentum: keep the old one.
      kept.append(jnp.where(finite, x - _decode(sent, lay), m))
      payloads.append(payload)
  k = opts.num_devices()
  if opts.axis_name is None:
    gathered = jax.tree.map(lambda a: a[None], payloads)
  else:
    gathered = collectives.gather_tree(payloads, opts.axis_name)
  with jax.named_scope(phases.DECODE_SCOPE):
    means = [_mean_of_payloads(p, lay, k, opts.average) for p, lay in zip(gathered, layouts)]
  return kept, means


def _update(opts: _Options, updates, state: DeMoState):
  """One step of :func:`scale_by_decoupled_momentum`: the signs of the mean fast
  components (compressed leaves) and of the mean gradient (dense leaves)."""
  leaves, treedef = pipeline.open_update(updates, state.shapes, _WHO)
  gs = [g for _, g in leaves]
  ms = treedef.flatten_up_to(state.momentum.inner)
  split = pipeline.Split.of([not isinstance(m, optax.MaskedNode) for m in ms])
  comp, dense = split
  _check_update(opts, leaves, comp)
  layouts = [_layout(gs[i].shape, opts.chunk_size, opts.topk) for i in comp]
  kept, means = _compressed(opts, [gs[i] for i in comp], [ms[i][0] for i in comp], layouts)
  dense_gs = [gs[i].astype(_F32) for i in dense]
  if opts.axis_name is not None and dense_gs:
    dense_gs = collectives.dense_means(dense_gs, opts.axis_name)[0]
  # signum: the step is the sign of the mean (sign(0) = 0), in the gradient's dtype.
  out = split.merge(means, dense_gs)
  out = [jnp.sign(u).astype(g.dtype) for u, g in zip(out, gs)]
  bad = functools.reduce(
    jnp.logical_or, [~jnp.all(jnp.isfinite(g)) for g in gs], jnp.zeros((), bool)
  )
  if opts.axis_name is not None:
    bad = collectives.any_over_other_axes(bad, opts.axis_name)
  momentum = [optax.MaskedNode()] * len(gs)
  for i, m in zip(comp, kept):
    momentum[i] = m[None]
  new_state = DeMoState(
    momentum=transforms.PerDeviceState(treedef.unflatten(momentum)),
    nonfinite_count=transforms.PerDeviceState(state.nonfinite_count.inner + bad.astype(jnp.int32)),
    shapes=state.shapes,
  )
  return treedef.unflatten(out), new_state


# ----------------------------------------------------------------------------- transforms


def scale_by_decoupled_momentum(
  *,
  chunk_size: int = 64,
  topk: int = 32,
  momentum_decay: float = 0.999,
  axis_name: Any = transforms.AXIS_REQUIRED,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
  average: str = "devices",
) -> optax.GradientTransformation:
  r"""DeMo's step direction, exchange included: the core of :func:`decoupled_momentum`.

  Each device's *local* gradient in, ``sign(Q)`` out (the same on every device), with
  ``Q`` the mean of the devices' fast components; without the learning rate and weight
  decay, as ``optax.scale_by_adam`` is the core of ``optax.adamw``. The math, the bytes
  and the NaN/Inf policy are in :func:`decoupled_momentum`. Its state
  (:class:`DeMoState`) is per device and wrapped already.

  Args:
    chunk_size, topk, momentum_decay, axis_name, filter, average: as in
      :func:`decoupled_momentum`.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the signs, in the gradient's
    dtype.

  References:
    Peng, Quesnelle, Kingma. *DeMo: Decoupled Momentum Optimization*. 2024, Algorithm 1.
    https://arxiv.org/abs/2411.19870
  """
  transforms.require_axis_name(axis_name, "jc.scale_by_decoupled_momentum")
  _check_options(None, chunk_size, topk, momentum_decay, None)
  if average not in AVERAGES:
    raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
  opts = _Options(
    chunk_size=int(chunk_size),
    topk=int(topk),
    momentum_decay=float(momentum_decay),
    axis_name=axis_name,
    filter_fn=transforms.default_filter if filter is None else filter,
    average=average,
  )

  def init_fn(params):
    return _init(opts, params)

  def update_fn(updates, state, params=None):
    del params
    return _update(opts, updates, state)

  tx = transforms.places_own_state(optax.GradientTransformation(init_fn, update_fn))
  return transforms.register_exchange(
    tx, "jc.scale_by_decoupled_momentum", axis_name, shardable=_NOT_SHARDABLE
  )


_NOT_SHARDABLE = (
  "its DCT blocks are cut from each whole leaf and its momentum is held per device; "
  "not implemented on shards"
)


def decoupled_momentum(
  learning_rate: float | optax.Schedule,
  *,
  axis_name: Any = transforms.AXIS_REQUIRED,
  chunk_size: int = 64,
  topk: int = 32,
  momentum_decay: float = 0.999,
  weight_decay: float = 0.0,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
  average: str = "devices",
) -> optax.GradientTransformation:
  r"""DeMo: each device keeps its momentum and sends only its fast DCT components.

  Takes each device's *local* gradient ``g_i`` and returns the parameter updates, the
  same on every device (already multiplied by ``-learning_rate``, like ``optax.adam``);
  it is the whole optimizer, exchange included: do not chain another optimizer after it.
  For each compressed leaf, on every device ``i`` of the K on ``axis_name``
  (Algorithm 1):

  .. math::
    m_i \leftarrow \beta m_i + g_i, \quad
    q_i = \mathrm{IDCT}(\mathrm{TopK}_k(\mathrm{DCT}(m_i))), \quad
    m_i \leftarrow m_i - q_i, \quad
    Q = \tfrac{1}{K}\textstyle\sum_j q_j, \quad
    \theta \leftarrow \theta - \eta_t\,(\mathrm{sign}(Q) + \lambda\,\theta)

  ``DCT`` is the orthonormal 2-D DCT-II of each ``chunk_size × chunk_size`` block of
  the leaf (viewed as a matrix: a vector is one row, more dimensions are folded into
  the rows; blocks are ``min(chunk_size, rows) × min(chunk_size, cols)``, the leaf
  zero-padded to whole blocks), ``TopK_k`` keeps the ``k = topk`` largest-magnitude
  coefficients of each block (all of them if a block has fewer) and zeroes the rest.
  The step is the sign of the mean (the paper's signum variant, sign(0) = 0); the
  weight decay is decoupled, ``θ ← (1 - ηλ) θ - η sign(Q)`` as the reference code.

  *Why*: momentum concentrates the gradient's energy in a few coherent, fast-moving
  components, which are the part the devices must agree on each step; the rest stays in
  each device's momentum (``m_i − q_i``) and is sent once it has grown into the top-k.
  Nothing is averaged but what was sent, and the sign makes the step's size independent
  of the number and scale of the components that reached it.

  Leaves the filter leaves out (biases, small tensors) are DeMo with every component
  sent: the DCT is orthonormal, so sending all of ``m_i`` empties it each step and the
  step is ``sign(mean_i g_i)``; they go through one dense all-reduce and keep no
  momentum.

  Bytes per device per step: every device all-gathers, per compressed leaf, its
  ``blocks · k`` float32 values and as many indices packed in
  ``ceil(log2(br · bc))`` bits each (12 for 64×64 blocks), in one collective for all
  leaves; it receives ``(K-1)`` times that. A dense all-reduce moves ``2(K-1)/K · 4n``:
  with the defaults (``k = 32`` of 4096 coefficients per block, 44 bits each) the
  gathered payload is about 1/93 of a leaf's float32 bytes per device, and the ratio to a
  dense all-reduce falls as K grows (an all-gather's bytes grow with K).
  :func:`jaxcomp.wire_report` counts them from the payload arrays.

  State: ``state[0]`` is :class:`DeMoState`, each device's momentum and non-finite
  count, per device and already wrapped, so :func:`jaxcomp.per_device_state` hands the
  transform back unchanged and :func:`jaxcomp.state_specs` places it::

    tx = jc.decoupled_momentum(1e-3, axis_name="b")
    specs = jc.state_specs(tx, params, axis_name="b", num_devices=mesh.size)
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    # in the step: grads = jax.grad(loss)(jc.vary(params, "b"), batch)
    #              updates, opt_state = tx.update(grads, opt_state, params)

  Under ``jax.pmap`` the same transform works as is; ``axis_name=None`` runs the same
  arithmetic on one device (K = 1, nothing exchanged).

  NaN/Inf policy (as :func:`jaxcomp.onebit_adam`): a device whose new momentum of a leaf
  is not finite keeps its previous momentum there and sends that leaf's values as NaN,
  so the leaf's mean and its update are NaN on every device (a NaN is never hidden,
  even where top-k would have left it out); ``nonfinite_count`` counts the steps where
  this device's gradient was not finite. Wrap in :func:`jaxcomp.skip_nonfinite` to skip
  such steps.

  Args:
    learning_rate: ``η``, a float or an optax schedule of the step count.
    axis_name: the mapped axis to average over (required), or ``None``: the explicit
      one-device simulation, which exchanges nothing.
    chunk_size: the side of the DCT blocks (the reference's ``compression_chunk``, 64).
    topk: coefficients sent per block (the reference's ``compression_topk``, 32); at
      most ``chunk_size**2``.
    momentum_decay: ``β`` (the reference's ``compression_decay``, 0.999).
    weight_decay: ``λ``, decoupled weight decay (needs ``params`` in ``update``);
      applied to every leaf.
    filter: ``filter(path, leaf) -> bool`` choosing the compressed leaves; defaults to
      :func:`jaxcomp.default_filter`.
    average: ``"devices"`` (default): ``Q`` is the sum of the sent components over K,
      Algorithm 1's mean; ``"senders"``: each DCT coefficient is averaged over the
      devices that sent it (0 where none did), as the reference code's scatter-mean
      does. The sign is taken after the inverse DCT, so the two steps differ.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the parameter steps.

  Example:
    >>> import jax.numpy as jnp, jaxcomp as jc
    >>> tx = jc.decoupled_momentum(1e-3, axis_name=None)  # one device
    >>> params = {"w": jnp.ones((64, 32))}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones((64, 32))}, state, params)
    >>> round(float(updates["w"][0, 0]), 6)  # a constant block is one component
    -0.001

  References:
    Peng, Quesnelle, Kingma. *DeMo: Decoupled Momentum Optimization*. 2024, Algorithm 1
    (signum variant). https://arxiv.org/abs/2411.19870
  """
  transforms.require_axis_name(axis_name, _WHO)
  _check_options(learning_rate, chunk_size, topk, momentum_decay, weight_decay)
  core = scale_by_decoupled_momentum(
    chunk_size=chunk_size,
    topk=topk,
    momentum_decay=momentum_decay,
    axis_name=axis_name,
    filter=filter,
    average=average,
  )
  # No decay step for λ = 0: optax's asks for params even then.
  decay = optax.add_decayed_weights(float(weight_decay)) if weight_decay else optax.identity()
  tx = optax.chain(core, decay, optax.scale_by_learning_rate(learning_rate))
  tx = transforms.places_own_state(tx)
  return transforms.register_exchange(tx, _WHO, axis_name, shardable=_NOT_SHARDABLE)
