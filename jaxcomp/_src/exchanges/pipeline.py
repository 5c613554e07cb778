"""The exchange pipeline: a gradient leaf's route through a compressed exchange.

Layers, top to bottom: a transform (:func:`jaxcomp.compress` and the methods) opens its
update with :func:`open_update`, plans each leaf once (:func:`plan_leaf`: its route and
codec, :func:`route`), then runs the steps, each of which takes :class:`Leaf` records
and returns new ones (``NamedTuple._replace``, nothing mutated):

1. :func:`encode`: error feedback in (``x = g + e``), finiteness, and the fused
   error-feedback kernel's payload; no collective;
2. :func:`exchange_gathered`: one all-gather for every gathered payload (and the dense
   leaves' all-reduce; locally without an axis);
3. :func:`exchange_psum`: the summable payloads' all-reduce;
4. :func:`exchange_two_phase`: one ``all_to_all`` + ``all_gather`` per codec for the
   two-phase leaves;
5. :func:`exchange_reduce_scatter`: the compressed reduce-scatter shared by every leaf
   sharded over the axis (and the dense reduce-scatter of the sharded leaves the filter
   leaves out), which returns this device's shard of the mean (ZeRO/FSDP).

Each exchange calls one codec primitive of :mod:`jaxcomp._src.exchanges.collectives`
(``gather_means``, ``psum_means``, ``two_phase_means``, ``reduce_scatter_means``), which
encodes, moves and decodes with the leaf's codec, and takes the error feedback from what
it returns (:func:`_exchanged`). An exchange is one function from a list of leaves to a
list of leaves (:data:`EXCHANGES`), so a new collective is one new primitive, one new
function and one new route. Methods with their own selection (``jc.dgc``) hand the
pipeline leaves already encoded (:func:`encoded_leaf`) or dense (:func:`dense_leaf`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
import warnings

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from jaxcomp._src.codecs import sparse
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.plumbing import phases
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32


# ----------------------------------------------------------------------------- opening


class Opened(NamedTuple):
  """An update's gradient leaves, checked: ``(path, leaf)`` pairs and their treedef."""

  leaves: list  # [(key path, gradient leaf)]
  treedef: Any  # the gradient's PyTreeDef

  def flatten(self, tree) -> list:
    """A state tree shaped like the parameters, flattened up to the gradient's leaves."""
    return self.treedef.flatten_up_to(tree)

  def unflatten(self, values: Sequence) -> Any:
    return self.treedef.unflatten(list(values))


def open_update(updates, shapes: treeutil.LeafShapes | None, who: str) -> Opened:
  """The opening of every transform's ``update``: flatten the gradient, check that each
  leaf is a floating-point array and that the leaves match ``init``'s (``shapes``;
  ``None`` for a state made before shapes were recorded). ``who`` names the transform
  in the errors."""
  leaves, treedef = treeutil.flat(updates)
  for path, g in leaves:
    treeutil.check_leaf(path, g)
  if shapes is not None:
    shapes.check(updates, who)
  return Opened(leaves, treedef)


class Split(NamedTuple):
  """Positions of the selected (compressed) and the dense leaves of an update."""

  selected: tuple[int, ...]
  dense: tuple[int, ...]

  @classmethod
  def of(cls, flags: Sequence[bool]) -> Split:
    return cls(
      tuple(i for i, f in enumerate(flags) if f), tuple(i for i, f in enumerate(flags) if not f)
    )

  def merge(self, selected_values: Sequence, dense_values: Sequence) -> list:
    """One list in leaf order from the selected leaves' values and the dense ones'."""
    out = [None] * (len(self.selected) + len(self.dense))
    for i, v in zip(self.selected, selected_values, strict=True):
      out[i] = v
    for i, v in zip(self.dense, dense_values, strict=True):
      out[i] = v
    return out


def warn_if_nothing_compressed(who: str, chosen: Sequence[bool], rule: str) -> None:
  """Warns once when a transform's selection leaves none of the gradient's leaves to
  compress: every leaf is then averaged dense, the run moves as many bytes as a plain
  ``pmean`` and nothing in it says so (``jc.wire_report`` would). ``chosen`` is the
  selection per leaf, ``rule`` names what decided it (the default filter, the user's).

  Called from each method's ``init``, which decides the selection once; Python's
  warning registry shows the same message once.
  """
  if not chosen or any(chosen):
    return
  warnings.warn(
    f"{who} compresses nothing: {rule} leaves out all {len(chosen)} gradient leaves, so "
    f"every leaf is averaged dense in full precision (as many bytes as a plain pmean). "
    f"Pass filter=lambda path, leaf: True to compress every leaf, or a filter that "
    f"selects the leaves to compress",
    UserWarning,
    stacklevel=2,
  )


def filter_rule(filter_fn, default_fn, extra: str = "") -> str:
  """How :func:`warn_if_nothing_compressed` names a selection: the default filter (with
  its thresholds) or the one the user passed; ``extra`` adds another rule (PowerSGD's
  ``min_compression``)."""
  if filter_fn is default_fn:
    rule = "the default filter (jc.default_filter: at least 1024 values and 2 dimensions)"
  else:
    rule = f"filter={getattr(filter_fn, '__name__', filter_fn)!s}"
  return rule + extra


# ----------------------------------------------------------------------------- sharding


def _is_spec(x) -> bool:
  return x is None or isinstance(x, P)


def _axis_names(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def leaf_specs(param_specs, tree) -> list:
  """A ``PartitionSpec`` per leaf of ``tree`` from ``param_specs``: a pytree of specs
  with ``tree``'s structure, or a prefix of it (a spec stands for every leaf below it).
  ``None`` entries are ``P()``. A ``ValueError`` says where the structures differ."""
  leaves, treedef = treeutil.flat(tree)
  specs, spec_def = jax.tree.flatten(param_specs, is_leaf=_is_spec)
  try:
    subtrees = spec_def.flatten_up_to(treedef.unflatten([x for _, x in leaves]))
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"param_specs must be a pytree of PartitionSpecs with the structure of params "
      f"(or a prefix of it): {e}"
    ) from e
  out = []
  for spec, sub in zip(specs, subtrees):
    spec = P() if spec is None else spec
    if not isinstance(spec, P):
      raise TypeError(f"param_specs must hold PartitionSpecs, got {spec!r}")
    out.extend([spec] * len(jax.tree.leaves(sub)))
  return out


def sharded_leaves(param_specs, tree, axis_name) -> list[bool]:
  """Whether each leaf of ``tree`` is sharded over ``axis_name`` along its first axis.

  ``param_specs=None``: every leaf is (the shards of ``P(axis_name)``). A spec that
  names ``axis_name`` in another dimension, or with other axes in the first, is
  refused: the reduce-scatter hands device j the j-th block of rows, which is what
  ``P(axis_name, ...)`` gives it.
  """
  leaves, _ = treeutil.flat(tree)
  if param_specs is None:
    return [True] * len(leaves)
  out = []
  for (path, leaf), spec in zip(leaves, leaf_specs(param_specs, tree)):
    where = jax.tree_util.keystr(path)
    if len(spec) > np.ndim(leaf):
      raise ValueError(
        f"param_specs at {where}: {spec} has more entries than the leaf has dimensions "
        f"(shape {np.shape(leaf)})"
      )
    first = _axis_names(spec[0]) if len(spec) else ()
    if any(axis_name in _axis_names(e) for e in list(spec)[1:]) or (
      axis_name in first and first != (axis_name,)
    ):
      raise ValueError(
        f"param_specs at {where} is {spec}: a leaf sharded over the data axis "
        f"{axis_name!r} must be sharded along its first dimension by that axis alone, "
        f"P({axis_name!r}, ...)"
      )
    out.append(first == (axis_name,))
  return out


def full_shape(shape, sharded: bool, k: int) -> tuple[int, ...]:
  """The local gradient's shape for a parameter shard of ``shape``: the first axis times
  K where the leaf is sharded over the data axis, else ``shape``."""
  shape = tuple(int(d) for d in shape)
  if not sharded:
    return shape
  if not shape:
    raise ValueError("a 0-d parameter cannot be sharded over the data axis")
  return (shape[0] * k,) + shape[1:]


def leaf_collective(collective: str, sharded: bool) -> str:
  """The collective a leaf takes under ``collective``: with ``"reduce_scatter"`` the
  leaves not sharded over the axis are averaged whole (``"auto"``)."""
  if collective == "reduce_scatter" and not sharded:
    return "auto"
  return collective


# ----------------------------------------------------------------------------- residuals

#: The dtypes an error-feedback residual may be held in.
RESIDUAL_DTYPES = ("float32", "bfloat16", "int8")
_RESIDUAL_BLOCK = 256  # values per float32 scale of an int8 residual


def residual_dtype(dtype) -> str:
  """``dtype`` as one of :data:`RESIDUAL_DTYPES` (a ``ValueError`` naming the argument)."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in RESIDUAL_DTYPES:
    raise ValueError(f"residual_dtype must be one of {RESIDUAL_DTYPES}, got {dtype!r}")
  return name


def _int8_blocks(n: int) -> int:
  return -(-n // _RESIDUAL_BLOCK)


def residual_zeros(shape, dtype: str) -> tuple[Array, Any]:
  """A zero residual of ``shape`` held as ``dtype``: ``(values, scales)``; the scales
  (one float32 per block of 256 values) only for ``"int8"``, else ``MaskedNode``."""
  if dtype == "int8":
    size = int(np.prod(shape, dtype=np.int64))
    return jnp.zeros(shape, jnp.int8), jnp.zeros((_int8_blocks(size),), _F32)
  return jnp.zeros(shape, dtype), optax.MaskedNode()


def load_residual(values: Array, scales: Any) -> Array:
  """A held residual as float32 (:func:`store_residual`'s inverse, up to its rounding)."""
  if values.dtype != jnp.int8:
    return values.astype(_F32)
  n = values.size
  blocks = jnp.pad(values.reshape(-1), (0, scales.shape[0] * _RESIDUAL_BLOCK - n))
  out = blocks.reshape(scales.shape[0], -1).astype(_F32) * scales[:, None]
  return out.reshape(-1)[:n].reshape(values.shape)


def store_residual(e: Array, dtype: str) -> tuple[Array, Any]:
  """The float32 residual ``e`` held as ``dtype``, rounded to nearest.

  ``"bfloat16"`` keeps 8 significant bits; ``"int8"`` rounds each block of 256 values
  to ``round(e / s)·s`` with ``s = max|e| / 127`` of the block (a float32 per block):
  the rounding error is at most ``s/2`` per value, and it is not fed back (the residual
  delays what compression dropped; what holding it drops is lost).
  """
  if dtype != "int8":
    return e.astype(dtype), optax.MaskedNode()
  n = e.size
  nb = _int8_blocks(n)
  blocks = jnp.pad(e.reshape(-1), (0, nb * _RESIDUAL_BLOCK - n)).reshape(nb, -1)
  scales = jnp.max(jnp.abs(blocks), axis=1) / 127.0
  safe = jnp.where(scales > 0, scales, jnp.ones_like(scales))
  codes = jnp.clip(jnp.round(blocks / safe[:, None]), -127, 127).astype(jnp.int8)
  return codes.reshape(-1)[:n].reshape(e.shape), scales


# ----------------------------------------------------------------------------- routes

#: The collectives :func:`jaxcomp.compress` takes.
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


def has_two_phase_route(codec) -> bool:
  """Whether the two-phase exchange computes ``codec``'s method: false for sparse codecs
  (:class:`~jaxcomp.codecs.TopK`, :class:`~jaxcomp.codecs.RandomK`, the Wangni
  sparsifier), whose chunk owner would sparsify the average of K sparse chunks again,
  keeping about 1/K of what the devices sent (top-k drops the rest, the unbiased
  sparsifiers multiply the variance), and for codecs with a fallback, which need the
  all-gather."""
  return codec.fallback is None and not isinstance(codec, sparse.SparseCodec)


def resolve(collective: str, codec, k: int) -> str:
  """The exchange ``collective`` stands for on ``k`` devices (``"auto"`` resolved).

  ``"auto"`` takes the route that moves the fewest bytes among those that compute the
  codec's method:

  * ``"psum"`` for summable payloads (``RandomK(shared=True)``): ``2(K-1)/K`` times the
    values' bytes, fewer than the all-gather's ``K-1`` times values and indices at
    every K;
  * ``"allgather"`` for K <= 2, where it moves the same bytes as the two-phase exchange
    (``(K-1)·B = 2(K-1)/K·B = B``) with one encode and decode, one collective and no
    second quantization, and for codecs without a two-phase route
    (:func:`has_two_phase_route`) at every K;
  * else ``"two_phase"``, whose traffic stays flat in K (:func:`leaf_mode` keeps a leaf
    on the all-gather where its chunks would cost as much).
  """
  if collective != "auto":
    return collective
  if codec.summable_fields is not None:
    return "psum"
  return "two_phase" if k > 2 and has_two_phase_route(codec) else "allgather"


def leaf_mode(codec, collective: str, axis_name, shape, dtype) -> str:
  """The collective a leaf of ``shape`` takes: ``collective`` as requested without an
  axis; with one, as :func:`resolve`, and ``"auto"`` keeps a leaf on the all-gather when
  the two-phase exchange would move at least as many bytes for it: ``2(K-1)`` chunk
  payloads (:meth:`Codec.chunk_shape`) against ``K-1`` payloads of the whole leaf. That
  happens when the chunks are mostly padding or per-chunk scales, as with a short vector
  (per-column buckets cut a column into at most K segments of a pair of means each)."""
  if axis_name is None:
    return collective
  k = collectives.axis_size(axis_name)
  mode = resolve(collective, codec, k)
  if collective != "auto" or mode != "two_phase":
    return mode
  shape = tuple(int(d) for d in shape)
  chunk = tuple(codec.chunk_shape(shape, k))
  if 2 * codec.wire_bits(chunk, dtype) >= codec.wire_bits(shape, dtype):
    return "allgather"
  return mode


def chunk_residual_shape(codec, shape, k: int) -> tuple[int, ...]:
  """Shape of the second-stage residual of a tensor of ``shape`` (an int: a flat tensor of
  that many values): one chunk, :meth:`Codec.chunk_shape`."""
  shape = (shape,) if isinstance(shape, int) else tuple(shape)
  return tuple(codec.chunk_shape(shape, k))


#: The exchanges a leaf can take (:func:`route`), with the step that runs each.
ROUTES = (
  "dense",  # exchange_gathered
  "fused",  # exchange_gathered
  "encoded",  # exchange_gathered
  "local",  # exchange_gathered
  "gathered",  # exchange_gathered
  "fallback",  # exchange_gathered
  "psum",  # exchange_psum
  "two_phase",  # exchange_two_phase
  "dense_scatter",  # exchange_reduce_scatter
  "reduce_scatter",  # exchange_reduce_scatter
)


def route(codec, mode: str, axis_name, *, selected: bool, fused: bool = False) -> str:
  """The exchange one leaf takes in a step, decided once from static facts.

  * ``"dense"``: the filter leaves it out; averaged in full precision with the other
    dense leaves in one all-reduce (or inside the payloads' all-gather at K <= 2).
  * ``"fused"``: error feedback fused into the encoding kernel (``fused``, which the
    caller decides from :meth:`Codec.fuses_feedback`); gathered like ``"gathered"``.
  * ``"local"``: no axis: encoded and decoded on this device.
  * ``"two_phase"``: batched with the other such leaves of its codec
    (:func:`collectives.two_phase_means`).
  * ``"psum"``: summable payloads, all-reduced (:func:`collectives.psum_means`).
  * ``"gathered"``: payloads all-gathered together with the other leaves'
    (:func:`collectives.gather_means`).
  * ``"fallback"``: a variable-length codec with an overflow branch: its own all-gather
    inside :func:`collectives.gather_means`, since the branch decides per leaf what is
    sent.
  * ``"dense_scatter"``: a leaf sharded over the axis that the filter leaves out:
    its shard of the mean by a dense reduce-scatter.
  * ``"reduce_scatter"``: a sharded leaf, batched with the other such leaves into one
    compressed reduce-scatter (:func:`collectives.reduce_scatter_means`).

  (``"encoded"``, a payload a method selected and encoded itself, is never planned
  here: :func:`encoded_leaf`.) The order of the tests is the precedence: a fused leaf
  is gathered even without an axis (the payloads are then decoded locally).

  Args:
    codec: the leaf's codec.
    mode: the resolved collective (:func:`leaf_mode`), or the requested one without an
      axis.
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


# ----------------------------------------------------------------------------- leaves


class Leaf(NamedTuple):
  """One gradient leaf through an exchange: its route and codec, decided once, then
  what each step made of it (a step returns a new record)."""

  g: Array
  codec: Any  # the leaf's codec (None: a dense leaf)
  route: str  # one of ROUTES, decided once by plan_leaf
  key: Array | None  # this leaf's encoding key
  residual: Any  # e in, e' out; optax.MaskedNode: no error feedback here
  chunk_residual: Any  # the two-phase owner's residual; MaskedNode elsewhere
  out: Array  # the mean; the gradient until its exchange sets it
  x32: Array | None = None  # float32 g + e, what the residual is taken from
  x: Array | None = None  # x32 in the gradient's dtype: what is encoded
  finite: Array | None = None  # bool scalar: this device's input is finite
  overflow: Array | None = None  # bool scalar: the codec took its overflow path
  payload: Any = None  # fused and encoded routes: this device's payload
  residual_scale: Any = None  # an int8 residual's block scales; MaskedNode elsewhere

  @property
  def feedback(self) -> bool:
    return not isinstance(self.residual, optax.MaskedNode)


def plan_leaf(
  codec,
  collective,
  axis_name,
  filter_fn,
  i,
  path,
  g,
  e,
  e2,
  step_key,
  *,
  es=None,
  sharded=False,
  chosen=None,
) -> Leaf:
  """Decides a leaf's route once, up front (:func:`route`).

  Everything the route depends on is static (filter, shape, dtype, codec, resolved
  collective, whether the leaf is sharded over the axis), so later steps dispatch on one
  field instead of re-deriving it. A leaf to compress must be this device's own
  gradient: one already all-reduced is refused here, before any work is traced for it.
  ``e`` and ``e2`` are the residuals (``optax.MaskedNode()``: none), ``es`` the
  residual's block scales where it is held as int8. ``chosen`` is the filter's answer
  where the caller asked it of another leaf (QSVRG asks the parameter, not the vector
  it exchanges); else the filter is asked of ``g``.
  """
  if chosen is None:
    chosen = treeutil.selected(filter_fn, path, g)
  collective = leaf_collective(collective, sharded)
  mode = leaf_mode(codec, collective, axis_name, g.shape, g.dtype)
  use_ef = not isinstance(e, optax.MaskedNode)
  es = optax.MaskedNode() if es is None else es
  fused = (
    use_ef
    and e.dtype == _F32
    and chosen
    and mode == "allgather"
    and codec.fallback is None
    and codec.fuses_feedback(g.size, g.dtype)
  )
  if chosen:
    collectives.check_local(path, g, axis_name)
  return Leaf(
    g=g,
    codec=codec,
    route=route(codec, mode, axis_name, selected=chosen, fused=fused),
    key=jax.random.fold_in(step_key, i),
    residual=e,
    chunk_residual=e2,
    out=g,
    residual_scale=es,
  )


def dense_leaf(g: Array) -> Leaf:
  """A leaf averaged in full precision (a method's leaf outside its filter)."""
  none = optax.MaskedNode()
  return Leaf(g=g, codec=None, route="dense", key=None, residual=none, chunk_residual=none, out=g)


def encoded_leaf(codec, g: Array, payload) -> Leaf:
  """A leaf whose ``payload`` (``codec``'s, of ``g``) a method selected and encoded
  itself (DGC's top-k: its masks come from the payload's indices); gathered with the
  others, without error feedback here."""
  none = optax.MaskedNode()
  return Leaf(
    g=g,
    codec=codec,
    route="encoded",
    key=None,
    residual=none,
    chunk_residual=none,
    out=g,
    payload=payload,
  )


def _feedback(leaf: Leaf, sent: Array) -> Leaf:
  """``leaf`` with ``e' = x - Q^{-1}(Q(x))`` where the input was finite; else ``e`` is
  kept. ``e'`` is held in the residual's dtype (:func:`store_residual`).

  A non-finite step must not poison the residual: the previous one carries over, and
  the step is counted in ``nonfinite_count`` instead.
  """
  if not leaf.feedback:
    return leaf
  held = store_residual(leaf.x32 - sent.reshape(leaf.g.shape), leaf.residual.dtype.name)
  old = (leaf.residual, leaf.residual_scale)
  e, es = jax.tree.map(lambda new, prev: jnp.where(leaf.finite, new, prev), held, old)
  return leaf._replace(residual=e, residual_scale=es)


def _exchanged(leaf: Leaf, ex: collectives.Exchanged) -> Leaf:
  """``leaf`` after the primitive that returned ``ex``: its mean (this device's shard
  after a reduce-scatter), both residuals (the fused kernel set the first already),
  overflow."""
  shape = leaf.g.shape if leaf.route != "reduce_scatter" else ex.mean.shape
  leaf = leaf._replace(out=ex.mean.reshape(shape).astype(leaf.g.dtype), overflow=ex.overflow)
  if leaf.route not in ("fused", "encoded"):
    with jax.named_scope(phases.ENCODE_SCOPE):  # error feedback counts as encoding
      leaf = _feedback(leaf, ex.sent)
  if ex.chunk_residual is not None:
    leaf = leaf._replace(chunk_residual=ex.chunk_residual)
  return leaf


def encode(leaf: Leaf) -> Leaf:
  """Adds the residual and checks the input's finiteness; no collective.

  Dense leaves are only checked for finiteness (their mean propagates a NaN anyway; the
  count covers every leaf). A fused leaf gets its payload and new residual from one
  kernel; the other compressed leaves keep ``x = g + e`` (in the gradient's dtype) for
  their exchange's primitive to encode.
  """
  g, codec = leaf.g, leaf.codec
  if leaf.route in ("dense", "dense_scatter"):
    return leaf._replace(finite=jnp.all(jnp.isfinite(g)))
  if leaf.route == "encoded":
    return leaf
  if leaf.route == "fused":
    # One kernel reads g and e and writes the payload and e' (the same payload as the
    # unfused path); a non-finite input keeps e.
    payload, new_e, finite = codec.encode_feedback(g, leaf.residual, key=leaf.key)
    residual = lax.cond(finite, lambda: new_e, lambda e=leaf.residual: e)
    return leaf._replace(payload=payload, residual=residual, finite=finite)
  x32 = g.astype(_F32)
  if leaf.feedback:
    x32 = x32 + load_residual(leaf.residual, leaf.residual_scale)
  # What is encoded keeps the gradient's dtype.
  return leaf._replace(x32=x32, finite=jnp.all(jnp.isfinite(x32)), x=x32.astype(g.dtype))


#: The routes :func:`exchange_gathered` serves with a codec.
_GATHERED = ("fused", "encoded", "local", "gathered", "fallback")


def exchange_gathered(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """Averages the gathered payloads and the dense leaves, all in one exchange
  (:func:`collectives.gather_means`).

  One all-gather for every payload pays the collective's latency once per step, not
  once per leaf; at K <= 2 the dense leaves ride in it too (the same bytes as an
  all-reduce there), else they share one all-reduce. Without an axis the compressed
  leaves are encoded and decoded locally and the dense ones are their own mean.
  """
  coded = [i for i, leaf in enumerate(plan) if leaf.route in _GATHERED]
  dense = [i for i, leaf in enumerate(plan) if leaf.route == "dense"]
  dense = dense if axis_name is not None else []
  if not coded and not dense:
    return plan
  exs, dense_means = collectives.gather_means(
    [plan[i].codec for i in coded],
    [plan[i].x for i in coded],
    [plan[i].key for i in coded],
    axis_name,
    payloads=[plan[i].payload for i in coded],
    dense=[plan[i].g for i in dense],
  )
  out = list(plan)
  for i, mean in zip(dense, dense_means):
    out[i] = plan[i]._replace(out=mean)
  for i, ex in zip(coded, exs):
    out[i] = _exchanged(plan[i], ex)
  return out


def exchange_psum(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """The leaves with summable payloads, each all-reduced (:func:`collectives.psum_means`)."""
  summed = [i for i, leaf in enumerate(plan) if leaf.route == "psum"]
  out = list(plan)
  for i in summed:  # a codec per leaf
    leaf = plan[i]
    (ex,) = collectives.psum_means(leaf.codec, [leaf.x], [leaf.key], axis_name)
    out[i] = _exchanged(leaf, ex)
  return out


def _by_codec(plan: list[Leaf], indices) -> list[list[int]]:
  """``indices`` grouped by their leaves' codecs (equal codecs share a group; codecs may
  be unhashable), in first-seen order."""
  groups: list[tuple[Any, list[int]]] = []
  for i in indices:
    group = next((g for c, g in groups if c == plan[i].codec), None)
    if group is None:
      groups.append((plan[i].codec, group := []))
    group.append(i)
  return [g for _, g in groups]


def exchange_two_phase(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """The two-phase leaves in one ``all_to_all`` and one ``all_gather`` per codec
  (:func:`collectives.two_phase_means`), then their first-stage feedback (what was sent
  is known only after the exchange) and the chunk owners' second-stage residuals."""
  phased = [i for i, leaf in enumerate(plan) if leaf.route == "two_phase"]
  out = list(plan)
  for group in _by_codec(plan, phased):
    leaves = [plan[i] for i in group]
    chunk_residuals = [
      None if isinstance(leaf.chunk_residual, optax.MaskedNode) else leaf.chunk_residual
      for leaf in leaves
    ]
    exs = collectives.two_phase_means(
      leaves[0].codec,
      [leaf.x for leaf in leaves],
      [leaf.key for leaf in leaves],
      axis_name,
      chunk_residuals,
    )
    for i, leaf, ex in zip(group, leaves, exs):
      out[i] = _exchanged(leaf, ex)
  return out


def exchange_reduce_scatter(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """The leaves sharded over the axis: this device's shard of each mean.

  The compressed ones share one compressed reduce-scatter
  (:func:`collectives.reduce_scatter_means`: one ``all_to_all``, the owner decodes and
  sums in float32), then take their feedback from what this device sent; the ones the
  filter leaves out share one dense ``psum_scatter`` per dtype (the same primitive
  without a codec).
  """
  scattered = [i for i, leaf in enumerate(plan) if leaf.route == "reduce_scatter"]
  dense = [i for i, leaf in enumerate(plan) if leaf.route == "dense_scatter"]
  out = list(plan)
  if scattered:
    leaves = [plan[i] for i in scattered]
    exs = collectives.reduce_scatter_means(
      leaves[0].codec, [leaf.x for leaf in leaves], [leaf.key for leaf in leaves], axis_name
    )
    for i, leaf, ex in zip(scattered, leaves, exs):
      out[i] = _exchanged(leaf, ex)
  if dense:
    exs = collectives.reduce_scatter_means(
      None, [plan[i].g for i in dense], [None] * len(dense), axis_name
    )
    for i, ex in zip(dense, exs):
      out[i] = plan[i]._replace(out=ex.mean.astype(plan[i].g.dtype))
  return out


#: The shared exchanges, in the order a step runs them: each maps the planned leaves to
#: the leaves with their means (a new collective is one more entry).
EXCHANGES: tuple[Callable[[Any, list[Leaf]], list[Leaf]], ...] = (
  exchange_gathered,
  exchange_psum,
  exchange_two_phase,
  exchange_reduce_scatter,
)


def run(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """Encodes every leaf, then runs every shared exchange: the leaves with their means."""
  with jax.named_scope(phases.ENCODE_SCOPE):  # error feedback in, the fused kernels
    plan = [encode(leaf) for leaf in plan]
  for exchange in EXCHANGES:
    plan = exchange(axis_name, plan)
  return plan
