"""jc.diloco(overlap=True): the outer step one sync late, each replica keeping its progress."""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.methods import diloco as diloco_lib
from jaxcomp._src.methods import sparseloco as sparseloco_lib
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K
from tests.test_diloco import PARAMS
from tests.test_diloco import ShardMapRun
from tests.test_diloco import _centres

LR, H, MU, OUTER_LR = 0.25, 3, 0.9, 0.7
SYNCS = 4


def _nesterov():
  return optax.sgd(OUTER_LR, momentum=MU, nesterov=True)


def _flat(tree, k=None):
  """The leaves laid end to end: ``(n,)``, or ``(k, n)`` with a leading device axis."""
  leaves = jax.tree.leaves(tree)
  if k is None:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])
  return np.concatenate([np.asarray(x, np.float64).reshape(k, -1) for x in leaves], 1)


def _unflat(v, like):
  """``v`` (``(K, n)``) back into ``like``'s tree of ``(K, *shape)`` float32 leaves."""
  leaves, treedef = jax.tree.flatten(like)
  out, i = [], 0
  for x in leaves:
    out.append(jnp.asarray(v[:, i : i + x.size].reshape(K, *x.shape), jnp.float32))
    i += x.size
  return treedef.unflatten(out)


def _value_offsets(fragments):
  """Each value's sync offset in the period (the fragment it belongs to)."""
  leaves = jax.tree.leaves(PARAMS)
  starts = np.cumsum([0] + [x.size for x in leaves])
  offsets = np.zeros(starts[-1], np.int64)
  if fragments is None:
    return offsets
  row = [x.size // x.shape[0] for x in leaves]
  frag_offsets = diloco_lib.fragment_offsets(H, fragments)
  for g, pieces in enumerate(diloco_lib.fragment_pieces([x.shape for x in leaves], fragments)):
    for p in pieces:
      lo = starts[p.leaf] + p.start * row[p.leaf]
      offsets[lo : starts[p.leaf] + p.stop * row[p.leaf]] = frag_offsets[g]
  return offsets


def _dense_mean(delta):
  return delta.mean(0)


def _exchange_mean(exchange):
  """The library's exchange as a black box on the reference's Δ (its state advancing
  at each call, as in jc.diloco where it is called at syncs only)."""
  m = helpers.mesh()
  tx = jc.per_device_state(exchange)
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  state = jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs))(PARAMS)

  def call(delta, state):
    delta = jax.tree.map(lambda x: x[0], delta)
    return tx.update(delta, state, jax.tree.map(jnp.zeros_like, delta))

  call = jax.jit(jax.shard_map(call, mesh=m, in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  box = [state]

  def mean(delta):
    out, box[0] = call(helpers.shard(_unflat(delta, PARAMS), m), box[0])
    return _flat(out)

  return mean


def _reference(steps, centres, offsets, mean_fn, *, late=True):
  """Float64 reference of the overlapped equations (inner SGD on the quadratic, outer
  Nesterov), per value; ``late=False`` applies each mean at its own sync (the negative
  control). Every step's (anchor, replicas, pending, round starts)."""
  c = _flat(centres, K)
  theta = np.zeros(c.shape[1])
  reps, start = np.zeros_like(c), np.zeros_like(c)
  pending, trace = np.zeros_like(theta), np.zeros_like(theta)
  synced = np.zeros(theta.shape, bool)
  out = []
  for t in range(1, steps + 1):
    reps = reps - LR * (reps - c)
    due = (t - offsets) % H == 0
    if due.any():
      mean = mean_fn(start - reps)
      applied, apply = (pending, due & synced) if late else (mean, due)
      new_trace = applied + MU * trace
      step = -OUTER_LR * (applied + MU * new_trace)
      trace = np.where(apply, new_trace, trace)
      theta = np.where(apply, theta + step, theta)
      reps = np.where(due[None], theta[None] + (reps - start), reps)
      start = np.where(due[None], reps, start)
      pending = np.where(due, mean, pending)
      synced |= due
    out.append((theta.copy(), reps.copy(), pending.copy(), start.copy()))
  return out


def _overlapped(exchange=None, fragments=None):
  return jc.diloco(
    optax.sgd(LR),
    _nesterov(),
    sync_every=H,
    axis_name=AXIS,
    exchange=exchange,
    fragments=fragments,
    overlap=True,
  )


def _onebit():
  return jc.onebit_sgd(axis_name=AXIS)


@pytest.mark.parametrize(
  "exchange,fragments", [(None, None), (_onebit, None), (None, 2)], ids=["dense", "onebit", "F2"]
)
def test_follows_the_float64_reference(exchange, fragments):
  """8 replicas, 4 syncs (of each fragment): anchor, replicas and pending mean follow
  the float64 reference of the overlapped equations, with the dense mean, with 1-bit
  SGD (two-phase, error feedback: its state advances at syncs; called as a black box on
  the reference's Δ), and with 2 fragments on staggered steps; a reference that applies
  each mean at its own sync is far from it (negative control)."""
  steps = SYNCS * H + (H - 1 if fragments else 0)
  centres = _centres(seed=3)
  tx = _overlapped(None if exchange is None else exchange(), fragments)
  history = ShardMapRun(tx).run(steps, lambda t: centres)
  mean_fn = _dense_mean if exchange is None else _exchange_mean(exchange())
  offsets = _value_offsets(fragments)
  ref = _reference(steps, centres, offsets, mean_fn)
  for t, ((got_reps, got), want) in enumerate(zip(history, ref), start=1):
    got = (got.anchor, got_reps, got.pending, got.round_start.inner)
    for name, g, w in zip(("anchor", "replicas", "pending", "round_start"), got, want):
      g = _flat(g) if w.ndim == 1 else _flat(g, K)
      np.testing.assert_allclose(g, w, rtol=0, atol=2e-5, err_msg=f"{name}, t={t}")
  # The anchor moved (syncs past the first applied a mean) and the replicas differ.
  assert np.abs(ref[-1][0]).max() > 0.1
  assert np.abs(_flat(history[-1][0], K) - _flat(history[-1][0], K)[:1]).max() > 0.1
  if exchange is None:  # the negative control: the same sync's mean applied at once
    same = _reference(steps, centres, offsets, mean_fn, late=False)
    assert np.abs(same[-1][0] - _flat(history[-1][1].anchor)).max() > 0.05


def test_one_replica_with_unit_outer_sgd_is_local_training():
  """axis_name=None, outer=optax.sgd(1.0): the syncs leave the replica's trajectory
  that of inner Adam alone (the anchor is always its round start plus the pending
  mean), with 2 fragments too; the anchor does move (it trails by one round)."""
  for fragments in (None, 2):
    tx = jc.diloco(
      optax.adam(0.05),
      optax.sgd(1.0),
      sync_every=H,
      axis_name=None,
      fragments=fragments,
      overlap=True,
    )
    plain = optax.adam(0.05)
    c = jax.tree.map(lambda x: x[0], _centres(seed=1))
    grad = lambda p: jax.tree.map(lambda x, y: jnp.sin(x) - y, p, c)  # not quadratic
    with jax.numpy_dtype_promotion("standard"):
      p = q = PARAMS
      state, plain_state = tx.init(p), plain.init(q)
      step = jax.jit(tx.update)
      for _ in range(SYNCS * H + 2):
        u, state = step(grad(p), state, p)
        p = optax.apply_updates(p, u)
        v, plain_state = plain.update(grad(q), plain_state, q)
        q = optax.apply_updates(q, v)
    np.testing.assert_allclose(_flat(p), _flat(q), rtol=0, atol=1e-5)
    assert np.abs(_flat(q)).max() > 0.2
    # The anchor is one round behind: the replica at its last sync's start.
    np.testing.assert_allclose(
      _flat(state.anchor), _flat(state.round_start.inner) + _flat(state.pending), atol=1e-5
    )
    assert np.abs(_flat(state.anchor) - _flat(p)).max() > 0.01


def test_anchor_is_diloco_recursion_fed_the_delayed_means():
  """The anchor after sync s is A_{s-1} + outer(mean of sync s-1), the outer optimizer
  (optax's Nesterov, run here on its own) stepped by the pending means of the syncs
  before: DiLoCo's anchor recursion with the means one sync late."""
  steps = (SYNCS + 1) * H
  history = ShardMapRun(_overlapped()).run(steps, lambda t: _centres(seed=t))
  outer = _nesterov()
  anchor = PARAMS
  outer_state = outer.init(anchor)
  pending = None
  for t, (_, state) in enumerate(history, start=1):
    if t % H:
      continue
    if pending is not None:
      u, outer_state = outer.update(pending, outer_state, anchor)
      anchor = optax.apply_updates(anchor, u)
    chex.assert_trees_all_close(state.anchor, anchor, atol=1e-6, rtol=0)
    pending = state.pending
  assert np.abs(_flat(anchor)).max() > 0.1


def test_state_specs_wire_report_and_one_compile():
  """The round starts are per device, the pending mean replicated; shapes and dtypes
  are stable in one compile; the wire report is the non-overlapped one (same bytes,
  once every H steps)."""
  chex.clear_trace_counter()

  def make(overlap):
    return jc.diloco(
      optax.sgd(0.1),
      _nesterov(),
      sync_every=H,
      axis_name=AXIS,
      exchange=jc.qsgd(bits=4, axis_name=AXIS, error_feedback=True, collective="allgather"),
      overlap=overlap,
    )

  specs = jc.state_specs(make(True), PARAMS, axis_name=AXIS, num_devices=K)
  assert specs.round_start.inner == {"w": P(AXIS), "b": P(AXIS)}
  assert specs.pending == {"w": P(), "b": P()} and specs.anchor == {"w": P(), "b": P()}
  plain = jc.state_specs(make(False), PARAMS, axis_name=AXIS, num_devices=K)
  assert plain.round_start is None and plain.pending is None
  run = ShardMapRun(make(True))
  _, state0 = run.start()
  history = run.run(2 * H, lambda t: _centres(seed=t))
  for _, state in history:
    chex.assert_trees_all_equal_shapes_and_dtypes(jax.device_get(state0), state)
  got = jc.wire_report(make(True), PARAMS, axis_name=AXIS, num_devices=K)
  want = jc.wire_report(make(False), PARAMS, axis_name=AXIS, num_devices=K)
  assert want.bytes_received > 0
  assert got.bytes_received == pytest.approx(want.bytes_received, rel=1e-12)
  assert all(op.every == H for op in got.ops)


def test_checkpoint_round_trip_resumes_bit_identically():
  """Saved as plain arrays after 4 steps (past a sync, a mean pending) and restored as
  jc.restore_target places it, the state continues exactly as the uninterrupted run."""
  tx = _overlapped(jc.qsgd(bits=4, axis_name=AXIS, error_feedback=True, collective="allgather"))
  run = ShardMapRun(tx)
  data = lambda t: _centres(seed=t)
  run.run(H + 1, data)
  replicas, live = run.last
  saved = jax.tree.map(np.asarray, jc.unwrap_keys(live))
  target = jc.restore_target(tx, PARAMS, mesh=run.mesh, specs=run.specs)
  restored = jax.tree.map(
    lambda x, like: jax.device_put(x, like.sharding), saved, jc.unwrap_keys(live)
  )
  state = jc.wrap_keys(restored, target)
  resumed = run.run(H, lambda t: data(t + H + 1), replicas, state)
  full = run.run(H, lambda t: data(t + H + 1), replicas, live)
  chex.assert_trees_all_equal(jc.unwrap_keys(resumed[-1]), jc.unwrap_keys(full[-1]))


def test_sparseloco_passes_overlap_through():
  """jc.sparseloco(overlap=True) is jc.diloco(overlap=True) with its exchange: the same
  trajectory, step for step, and the sparse mean applied one sync late."""
  kw = dict(sync_every=H, axis_name=AXIS, overlap=True)
  params = {"w": jnp.zeros((64, 64))}
  centres = {"w": jax.random.normal(jax.random.key(2), (K, 64, 64))}
  a = jc.sparseloco(optax.sgd(LR), density=0.05, chunk_size=1024, **kw)
  b = jc.diloco(
    optax.sgd(LR),
    optax.sgd(1.0),
    exchange=sparseloco_lib.sparseloco_exchange(axis_name=AXIS, density=0.05, chunk_size=1024),
    **kw,
  )
  got = ShardMapRun(a, params=params).run(2 * H, lambda t: centres)
  want = ShardMapRun(b, params=params).run(2 * H, lambda t: centres)
  chex.assert_trees_all_equal(jc.unwrap_keys(got[-1]), jc.unwrap_keys(want[-1]))
  state = got[-1][1]
  assert np.abs(_flat(state.pending)).max() > 0  # the second sync's mean, pending
  assert np.abs(_flat(state.anchor)).max() > 0  # the first's, applied


def test_bad_input():
  """overlap must be a bool; fast_axis with overlap is refused, saying why."""
  with pytest.raises(ValueError, match="overlap must be True or False"):
    jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name=AXIS, overlap=1)
  with pytest.raises(NotImplementedError, match="overlap=True with fast_axis"):
    jc.diloco(
      optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name="n", fast_axis="d", overlap=True
    )
