"""Wrappers that are safe around a collective: skipping non-finite steps, accumulation.

optax's own wrappers decide per device. ``optax.apply_if_finite`` puts the inner update
in a ``lax.cond`` on this device's gradient, so a device whose gradient is non-finite
skips the collectives that the others enter (a deadlock under ``jax.pmap``; under
``jax.shard_map`` the per-device predicate does not even trace). ``optax.MultiSteps``
runs the inner update, exchange included, on every mini-step and keeps its result only
on the last. The wrappers here make the same decisions from values every device
agrees on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxcomp._src.exchanges import collectives

Array = jax.Array


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`."""

  inner_state: Any  # the wrapped transform's state (kept as it was on a skipped step)
  notfinite_count: Array  # shape=(), dtype=int32: steps skipped, the same on every device


def _all_finite(tree) -> Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return jnp.ones((), bool)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def skip_nonfinite(
  tx: optax.GradientTransformation, *, axis_name: Any
) -> optax.GradientTransformation:
  r"""Skips a step on every device when any device's gradient is non-finite.

  Runs ``tx`` every step, so the collectives inside it never sit in a per-device
  branch. Every jaxcomp exchange returns a non-finite mean, on every device, when any
  device's input is non-finite (a NaN is never hidden), so the updates ``tx`` returns
  already say, identically everywhere, whether the step is sound: the agreement rides
  in the exchange's own collective. On a skipped step every device returns zero updates
  and keeps its previous inner state (error-feedback residuals, momenta, keys, counts),
  and ``notfinite_count`` counts the step::

    tx = jc.skip_nonfinite(optax.chain(jc.per_device_state(jc.onebit_sgd(axis_name="b")),
                                       optax.sgd(0.1)), axis_name="b")

  Use it where ``optax.apply_if_finite`` would go: that wrapper puts ``tx`` in a
  ``lax.cond`` on this device's gradient, and a device that skips leaves the others
  waiting in a collective (a deadlock under ``jax.pmap``; under ``jax.shard_map`` the
  per-device predicate is rejected at trace time).

  ``tx`` must return the same updates on every device (it contains the exchange), as
  every jaxcomp transform and a chain of one with optax optimizers do. Under
  ``jax.shard_map`` (check_vma on) a decision that still differs between devices, over
  ``axis_name`` (no exchange in ``tx``) or over a tensor-parallel axis (the shards of a
  sharded parameter), is agreed with a scalar all-reduce over those axes.

  Args:
    tx: the transform to guard, typically the whole chain.
    axis_name: the data-parallel axis.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`SkipNonfiniteState`.
  """

  def init_fn(params):
    return SkipNonfiniteState(tx.init(params), jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    collectives.axis_size(axis_name)  # a clear error when the axis is not bound
    new_updates, inner = tx.update(updates, state.inner_state, params)
    bad = ~_all_finite(new_updates)
    others = tuple(sorted(collectives.varying_axes(bad)))
    if others:
      bad = lax.psum(bad.astype(jnp.int32), others) > 0
    new_updates = jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), new_updates)
    inner = jax.tree.map(lambda new, old: jnp.where(bad, old, new), inner, state.inner_state)
    return new_updates, SkipNonfiniteState(inner, state.notfinite_count + bad.astype(jnp.int32))

  return optax.GradientTransformation(init_fn, update_fn)


def _zeros_typed(like) -> Array:
  """Zeros of ``like``'s shape and dtype, typed varying over the axes ``like`` is."""
  zeros = jnp.zeros(like.shape, like.dtype)
  mat = getattr(like, "manual_axis_type", None)
  axes = tuple(sorted(getattr(mat, "varying", ()) or getattr(like, "vma", ()) or ()))
  return lax.pcast(zeros, axes, to="varying") if axes else zeros


def _match_varying(new: Array, old: Array) -> Array:
  extra = tuple(sorted(collectives.varying_axes(old) - collectives.varying_axes(new)))
  return lax.pcast(new, extra, to="varying") if extra else new


def multi_steps(
  opt: optax.GradientTransformation,
  every_k_schedule: int | Callable[[Array], Array],
  *,
  use_grad_mean: bool = True,
) -> optax.GradientTransformation:
  r"""Gradient accumulation whose inner update (and exchange) runs once per k mini-steps.

  The state is ``optax.MultiStepsState``, as for ``optax.MultiSteps``, and so are the
  updates: zero on the first ``k - 1`` mini-steps, then ``opt``'s update of the
  accumulated (mean, with ``use_grad_mean``) gradient. The difference is where ``opt``
  runs: ``optax.MultiSteps`` calls it on every mini-step and keeps the result only on
  the last (``jnp.where``), so a compressed exchange inside it would cross the wire k
  times per update; here it sits in a ``lax.cond`` on the mini-step counter, which is
  the same on every device, so every device takes the same branch and the exchange runs
  once per k mini-steps::

    tx = jc.multi_steps(optax.chain(jc.per_device_state(jc.qsgd(axis_name="b")),
                                    optax.adam(1e-3)), every_k_schedule=4)

  Under ``jax.shard_map`` the accumulated gradients are local (each device sums its
  own): :func:`state_specs` gives them a spec over the data axis.

  Put :func:`skip_nonfinite` inside it (``multi_steps(skip_nonfinite(...), k)``): it then
  sees the accumulated gradient and a NaN mini-step costs one update. Outside, the
  skipped step would keep the poisoned accumulator and skip every update after it.

  Args:
    opt: the inner transform (the exchange and the optimizer after it).
    every_k_schedule: k, or a function of the number of updates taken returning it.
    use_grad_mean: accumulate the mean of the mini-step gradients (else their sum).

  Returns:
    An ``optax.GradientTransformation`` with state ``optax.MultiStepsState``.
  """
  schedule = every_k_schedule if callable(every_k_schedule) else (lambda _: every_k_schedule)
  if not callable(every_k_schedule) and (
    isinstance(every_k_schedule, bool)
    or not isinstance(every_k_schedule, int)
    or every_k_schedule < 1
  ):
    raise ValueError(
      f"every_k_schedule must be a positive int or a schedule, got {every_k_schedule!r}"
    )

  def init_fn(params):
    return optax.MultiStepsState(
      mini_step=jnp.zeros((), jnp.int32),
      gradient_step=jnp.zeros((), jnp.int32),
      inner_opt_state=opt.init(params),
      acc_grads=jax.tree.map(jnp.zeros_like, params),
      skip_state=(),
    )

  def update_fn(updates, state, params=None):
    k = jnp.asarray(schedule(state.gradient_step), jnp.int32)
    n = state.mini_step
    if use_grad_mean:
      acc = jax.tree.map(
        lambda g, a: a + (g.astype(a.dtype) - a) / (n + 1).astype(a.dtype), updates, state.acc_grads
      )
    else:
      acc = jax.tree.map(lambda g, a: a + g.astype(a.dtype), updates, state.acc_grads)
    emit = n == k - 1
    grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)

    def final(grads, inner):
      new_updates, new_inner = opt.update(grads, inner, params)
      # The state leaves the cond with the types it came in with (lax.cond needs both
      # branches alike; a leaf may come in typed varying over more axes than it needs).
      return new_updates, jax.tree.map(_match_varying, new_inner, inner)

    out_like = jax.eval_shape(final, grads, state.inner_opt_state)

    def mid(grads, inner):
      del grads
      return jax.tree.map(_zeros_typed, out_like[0]), inner

    new_updates, inner = lax.cond(emit, final, mid, grads, state.inner_opt_state)
    new_state = optax.MultiStepsState(
      mini_step=jnp.where(emit, 0, n + 1).astype(jnp.int32),
      gradient_step=state.gradient_step + emit.astype(jnp.int32),
      inner_opt_state=inner,
      acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
      skip_state=state.skip_state,
    )
    return new_updates, new_state

  return optax.GradientTransformation(init_fn, update_fn)
