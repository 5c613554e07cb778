"""The exchange pipeline: a gradient leaf's route through a compressed exchange.

Layers, top to bottom: a transform (:func:`jaxcomp.compress` and the methods) opens its
update with :func:`open_update`, plans each leaf once (:func:`plan_leaf`: its route and
codec), then runs the steps, each of which takes :class:`Leaf` records and returns new
ones (``NamedTuple._replace``, nothing mutated):

1. :func:`encode`: error feedback and encoding (and the exchange of the routes that go
   alone: local, psum, fallback);
2. :func:`exchange_gathered`: the all-gather shared by every gathered payload (and the
   dense leaves' all-reduce);
3. :func:`exchange_two_phase`: the ``all_to_all`` + ``all_gather`` shared by every
   two-phase leaf.

The collectives they call live in :mod:`jaxcomp._src.collectives`, which encodes and
decodes with the leaf's codec. An exchange is one function from a list of leaves to a
list of leaves (:data:`EXCHANGES`), so a new collective (a reduce-scatter returning this
device's shard) is one new function and one new route.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxcomp._src import collectives
from jaxcomp._src import phases
from jaxcomp._src import treeutil

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


# ----------------------------------------------------------------------------- leaves


class Leaf(NamedTuple):
  """One gradient leaf through a :func:`jaxcomp.compress` step: its route and codec,
  decided once, then what each step made of it (a step returns a new record)."""

  g: Array
  codec: Any  # the leaf's codec
  route: str  # one of collectives.ROUTES, decided once by plan_leaf
  key: Array  # this leaf's encoding key
  residual: Any  # e in, e' out; optax.MaskedNode: no error feedback here
  chunk_residual: Any  # the two-phase owner's residual; MaskedNode elsewhere
  out: Array  # the mean; the gradient until its exchange sets it
  x32: Array | None = None  # float32 g + e, what the residual is taken from
  x: Array | None = None  # x32 in the gradient's dtype: what is encoded
  finite: Array | None = None  # bool scalar: this device's input is finite
  overflow: Array | None = None  # bool scalar: the codec took its overflow path
  payload: Any = None  # gathered routes: this device's payload

  @property
  def feedback(self) -> bool:
    return not isinstance(self.residual, optax.MaskedNode)


def leaf_mode(codec, collective: str, axis_name, shape, dtype) -> str:
  """The collective a leaf of ``shape`` takes (``collective`` as requested without an
  axis; resolved per leaf with one, :func:`collectives.leaf_collective`)."""
  if axis_name is None:
    return collective
  k = collectives.axis_size(axis_name)
  return collectives.leaf_collective(collective, codec, k, shape, dtype)


def plan_leaf(codec, collective, axis_name, filter_fn, i, path, g, e, e2, step_key) -> Leaf:
  """Decides a leaf's route once, up front (:func:`collectives.route`).

  Everything the route depends on is static (filter, shape, dtype, codec, resolved
  collective), so later steps dispatch on one field instead of re-deriving it. A leaf to
  compress must be this device's own gradient: one already all-reduced is refused here,
  before any work is traced for it.
  """
  chosen = treeutil.selected(filter_fn, path, g)
  mode = leaf_mode(codec, collective, axis_name, g.shape, g.dtype)
  use_ef = not isinstance(e, optax.MaskedNode)
  fused = (
    use_ef
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
    route=collectives.route(codec, mode, axis_name, selected=chosen, fused=fused),
    key=jax.random.fold_in(step_key, i),
    residual=e,
    chunk_residual=e2,
    out=g,
  )


def _feedback(leaf: Leaf, sent: Array) -> Any:
  """``e' = x - Q^{-1}(Q(x))`` where the input was finite; else ``e`` is kept.

  A non-finite step must not poison the residual: the previous one carries over, and
  the step is counted in ``nonfinite_count`` instead.
  """
  if not leaf.feedback:
    return leaf.residual
  return jnp.where(leaf.finite, leaf.x32 - sent.reshape(leaf.g.shape), leaf.residual)


def _exchanged(leaf: Leaf, ex: collectives.Exchanged) -> Leaf:
  """``leaf`` after an exchange that returned ``ex``: its mean, both residuals, overflow."""
  leaf = leaf._replace(out=ex.mean.reshape(leaf.g.shape).astype(leaf.g.dtype))
  leaf = leaf._replace(residual=_feedback(leaf, ex.sent), overflow=ex.overflow)
  if ex.chunk_residual is not None:
    leaf = leaf._replace(chunk_residual=ex.chunk_residual)
  return leaf


#: The routes whose leaf is exchanged on its own in :func:`encode`.
_ALONE: dict[str, Callable] = {
  "local": lambda codec, x, key, axis_name: collectives.local(codec, x, key),
  "psum": collectives.psum_mean,
  "fallback": collectives.allgather_mean,
}


def encode(axis_name, leaf: Leaf) -> Leaf:
  """Adds the residual, encodes, and exchanges the routes that go alone.

  Dense leaves are only checked for finiteness (their mean propagates a NaN anyway; the
  count covers every leaf). Gathered and fused leaves keep their payload for the shared
  all-gather, two-phase leaves their input for the shared two-phase exchange; the
  local, psum and fallback routes exchange here, one leaf at a time.
  """
  g, codec = leaf.g, leaf.codec
  if leaf.route == "dense":
    return leaf._replace(finite=jnp.all(jnp.isfinite(g)))
  if leaf.route == "fused":
    # One kernel reads g and e and writes the payload and e' (the same payload as the
    # unfused path); a non-finite input keeps e.
    payload, new_e, finite = codec.encode_feedback(g, leaf.residual, key=leaf.key)
    residual = lax.cond(finite, lambda: new_e, lambda e=leaf.residual: e)
    return leaf._replace(payload=payload, residual=residual, finite=finite)
  x32 = g.astype(_F32) + leaf.residual if leaf.feedback else g.astype(_F32)
  # What is encoded keeps the gradient's dtype.
  leaf = leaf._replace(x32=x32, finite=jnp.all(jnp.isfinite(x32)), x=x32.astype(g.dtype))
  if leaf.route == "two_phase":
    return leaf
  if leaf.route == "gathered":
    payload, overflow = codec.encode_with_info(leaf.x, key=leaf.key)
    leaf = leaf._replace(payload=payload, overflow=overflow)
    return leaf._replace(residual=_feedback(leaf, codec.decode(payload, _F32)))
  return _exchanged(leaf, _ALONE[leaf.route](codec, leaf.x, leaf.key, axis_name))


def exchange_gathered(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """Averages the gathered payloads and the dense leaves, all in one exchange.

  One all-gather for every payload pays the collective's latency once per step, not
  once per leaf; at K <= 2 the dense leaves ride in it too (the same bytes as an
  all-reduce there), else they share one all-reduce (:func:`collectives.exchange_means`).
  """
  gathered = [i for i, leaf in enumerate(plan) if leaf.route in ("gathered", "fused")]
  dense = [i for i, leaf in enumerate(plan) if leaf.route == "dense"]
  dense = dense if axis_name is not None else []
  if not gathered and not dense:
    return plan
  codecs = [plan[i].codec for i in gathered]
  means, dense_means = collectives.exchange_means(
    codecs, [plan[i].payload for i in gathered], [plan[i].g for i in dense], axis_name
  )
  out = list(plan)
  for i, mean in zip(dense, dense_means):
    out[i] = plan[i]._replace(out=mean)
  for i, mean in zip(gathered, means):
    out[i] = plan[i]._replace(out=mean.reshape(plan[i].g.shape).astype(plan[i].g.dtype))
  return out


def exchange_two_phase(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """The two-phase leaves in one ``all_to_all`` and one ``all_gather``, then their
  first-stage feedback (what was sent is known only after the exchange) and the chunk
  owners' second-stage residuals."""
  phased = [i for i, leaf in enumerate(plan) if leaf.route == "two_phase"]
  if not phased:
    return plan
  leaves = [plan[i] for i in phased]
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
  out = list(plan)
  for i, leaf, ex in zip(phased, leaves, exs):
    out[i] = _exchanged(leaf, ex)
  return out


#: The shared exchanges, in the order a step runs them: each maps the planned leaves to
#: the leaves with their means (a new collective is one more entry).
EXCHANGES: tuple[Callable[[Any, list[Leaf]], list[Leaf]], ...] = (
  exchange_gathered,
  exchange_two_phase,
)


def run(axis_name, plan: list[Leaf]) -> list[Leaf]:
  """Encodes every leaf, then runs every shared exchange: the leaves with their means."""
  # Error feedback and encoding, in the profile phase "encode" (the collectives and
  # decodes of the local/psum/fallback routes inside keep their own scopes).
  with jax.named_scope(phases.ENCODE_SCOPE):
    plan = [encode(axis_name, leaf) for leaf in plan]
  for exchange in EXCHANGES:
    plan = exchange(axis_name, plan)
  return plan
