"""jc.diloco: local steps, synced pseudo-gradients, fragments, bytes, state and errors."""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.methods import diloco as diloco_lib
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

EPS = float(jnp.finfo(jnp.float32).eps)
SHAPES = {"w": (64, 32), "b": (32,)}  # w: 2048 values, compressed by default_filter
PARAMS = {n: jnp.zeros(s, jnp.float32) for n, s in SHAPES.items()}


def _quadratic_grads(p, c):
  """Gradient of 0.5 ||p - c||^2 (device-specific centres c: each replica's own optimum)."""
  return jax.tree.map(lambda x, y: x - y, p, c)


def _stack(tree, k=K):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)), tree)


def _centres(seed=0, k=K):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: jax.random.normal(kk, (k, *s)) for kk, (n, s) in zip(keys, sorted(SHAPES.items()))}


def _pmap_run(tx, params=PARAMS):
  """DiLoCo under jax.pmap on the quadratic: ``(replicas, state, step)``, with
  ``step(p, state, centres) -> (p, state)``."""

  def step(p, state, c):
    updates, state = tx.update(_quadratic_grads(p, c), state, p)
    return optax.apply_updates(p, updates), state

  p = _stack(params)
  return p, jax.pmap(tx.init, axis_name=AXIS)(p), jax.pmap(step, axis_name=AXIS)


class ShardMapRun:
  """DiLoCo under shard_map (check_vma on): replicas held with a leading device axis."""

  def __init__(self, tx, params=PARAMS, grad_fn=_quadratic_grads, mesh=None, check_vma=True):
    chex.clear_trace_counter()  # this run's step may trace once
    self.mesh = helpers.mesh() if mesh is None else mesh
    self.tx = tx
    self.specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=self.mesh.size)
    self.init = jax.jit(
      jax.shard_map(
        tx.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs, check_vma=check_vma
      )
    )

    @chex.assert_max_traces(n=1)
    def step(replicas, state, data):
      p = jax.tree.map(lambda x: x[0], replicas)
      grads = grad_fn(p, jax.tree.map(lambda x: x[0], data))
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
      return jax.tree.map(lambda x: x[None], p), state

    self.step = jax.jit(
      jax.shard_map(
        step,
        mesh=self.mesh,
        in_specs=(P(AXIS), self.specs, P(AXIS)),
        out_specs=(P(AXIS), self.specs),
        check_vma=check_vma,
      )
    )
    self.params = params

  def start(self):
    state = self.init(jax.device_put(self.params, jax.NamedSharding(self.mesh, P())))
    return helpers.shard(_stack(self.params, self.mesh.size), self.mesh), state

  def run(self, steps, data, replicas=None, state=None):
    """Every step's (replicas, state) as host arrays; ``data(t)`` is step t's input."""
    if replicas is None:
      replicas, state = self.start()
    out = []
    for t in range(1, steps + 1):
      replicas, state = self.step(replicas, state, helpers.shard(data(t), self.mesh))
      out.append(jax.device_get((replicas, state)))
    self.last = (replicas, state)
    return out


def _dp_sgd(lr, steps, centres):
  """Data-parallel SGD on the quadratic under shard_map: replicated params, the mean
  gradient from one all-reduce (jc.pmean_tree, as DiLoCo's dense mean), optax.sgd(lr)."""
  m = helpers.mesh()
  tx = optax.sgd(lr)

  def step(p, c):
    grads = _quadratic_grads(jc.vary(p, AXIS), jax.tree.map(lambda x: x[0], c))
    updates, _ = tx.update(jc.pmean_tree(grads, AXIS), tx.init(p))
    return optax.apply_updates(p, updates)

  step = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), P(AXIS)), out_specs=P()))
  p = jax.device_put(PARAMS, jax.NamedSharding(m, P()))
  for _ in range(steps):
    p = step(p, helpers.shard(centres, m))
  return jax.device_get(p)


@pytest.mark.parametrize("lr", [0.125, 0.3])
def test_sync_every_one_is_data_parallel_sgd_shard_map(lr):
  """sync_every=1, exchange=None, inner sgd(lr), outer sgd(1.0): data-parallel SGD.

  Each step's pseudo-gradient is ``-u_i = lr·g_i`` exactly (it is taken as
  ``(θ - θ_i) - u_i`` with ``θ_i = θ``), so the anchor follows SGD on the mean gradient;
  the only difference is where ``lr`` multiplies (``mean(lr·g_i)`` vs ``lr·mean(g_i)``):
  none for a power of two (bit for bit), one rounding per step otherwise. Every replica
  lands on the anchor at every step.
  """
  chex.clear_trace_counter()
  tx = jc.diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=1, axis_name=AXIS)
  centres = _centres()
  steps = 6
  history = ShardMapRun(tx).run(steps, lambda t: centres)
  replicas, state = history[-1]
  want = _dp_sgd(lr, steps, centres)
  for name in SHAPES:
    tol = 0.0 if lr == 0.125 else 2 * steps * EPS  # |values| < 1: an ulp <= EPS
    np.testing.assert_allclose(state.anchor[name], want[name], rtol=0, atol=tol)
    for r in replicas[name]:
      np.testing.assert_array_equal(r, state.anchor[name])


def test_sync_every_one_is_data_parallel_sgd_pmap():
  """The same equivalence under jax.pmap, where parameters are per device anyway."""
  lr = 0.125
  tx = jc.diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=1, axis_name=AXIS)
  centres = _centres()

  p, state, step = _pmap_run(tx)
  for _ in range(6):
    p, state = step(p, state, centres)
  want = _dp_sgd(lr, 6, centres)
  for name in SHAPES:
    for i in range(K):
      np.testing.assert_array_equal(np.asarray(p[name][i]), want[name])
      np.testing.assert_array_equal(np.asarray(state.anchor[name][i]), want[name])


def test_replicas_drift_between_syncs_and_agree_at_syncs():
  """H=4, inner sgd, outer sgd(1.0): replicas follow local SGD, the anchor moves only at
  syncs, to the replicas' mean, which is the closed form
  ``θ' = c̄ + (1 - lr)^H (θ - c̄)`` of H local steps on ``0.5||θ - c_i||^2``."""
  lr, h = 0.25, 4
  tx = jc.diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=h, axis_name=AXIS)
  centres = _centres()
  history = ShardMapRun(tx).run(2 * h, lambda t: centres)
  theta = {n: np.zeros(s, np.float64) for n, s in SHAPES.items()}
  c = {n: np.asarray(v, np.float64) for n, v in centres.items()}
  for t, (replicas, state) in enumerate(history, start=1):
    assert int(state.count) == t
    local = t % h or h  # local steps since the last sync
    for n in SHAPES:
      r = replicas[n].astype(np.float64)
      expect_local = c[n] + (1 - lr) ** local * (theta[n][None] - c[n])
      if t % h:
        np.testing.assert_allclose(r, expect_local, rtol=0, atol=1e-5)
        assert np.min(np.ptp(r, axis=0).max(axis=tuple(range(1, r.ndim - 1)))) > 0.1
        np.testing.assert_allclose(state.anchor[n], theta[n], rtol=0, atol=1e-5)
      else:
        new = expect_local.mean(0)
        np.testing.assert_allclose(state.anchor[n], new, rtol=0, atol=1e-5)
        for row in replicas[n]:  # every replica on the new anchor
          np.testing.assert_allclose(row, state.anchor[n], rtol=0, atol=2 * EPS)
    if t % h == 0:
      theta = {n: np.asarray(state.anchor[n], np.float64) for n in SHAPES}


def test_inner_state_survives_a_sync():
  """The inner Adam state is each replica's own, carried through syncs: after 5 steps
  (syncs at 2 and 4) it equals optax.adam's state after the same 5 local gradients."""
  h, steps = 2, 5
  inner = optax.adam(1e-2)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    _inner_state_survives(inner, h, steps)


def _inner_state_survives(inner, h, steps):
  tx = jc.diloco(inner, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=h, axis_name=AXIS)
  grads = [_centres(seed=10 + t) for t in range(steps + 1)]
  history = ShardMapRun(tx, grad_fn=lambda p, g: g).run(steps, lambda t: grads[t])
  _, state = history[-1]
  for i in (0, K - 1):
    s = inner.init(PARAMS)
    for t in range(1, steps + 1):
      _, s = inner.update(jax.tree.map(lambda g: g[i], grads[t]), s)
    got = jax.tree.map(lambda x: x[i], state.inner_state.inner)
    chex.assert_trees_all_close(got, jax.device_get(s), rtol=1e-6, atol=1e-7)
    assert int(got[0].count) == steps  # not reset at the syncs


def _lstsq_problem(seed=0):
  """Least squares with different data and a different optimum on every replica."""
  d, o, n = 32, 32, 256
  kx, kw, kd, kn = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (K, n, d)) + 0.3 * jnp.linspace(-1, 1, K)[:, None, None]
  w_true = jax.random.normal(kw, (d, o)) / np.sqrt(d)
  shift = 0.5 * jax.random.normal(kd, (K, d, o)) / np.sqrt(d)  # non-iid targets
  y = jnp.einsum("knd,kdo->kno", x, w_true[None] + shift) + 0.1 * jax.random.normal(kn, (K, n, o))
  return x, y


def _lstsq_loss(p, x, y):
  return 0.5 * jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1))


@pytest.mark.parametrize("exchange", [None, "qsgd4"], ids=["dense", "qsgd4"])
def test_converges_with_different_data_per_replica(exchange):
  """Non-iid least squares: DiLoCo (inner SGD, outer Nesterov, H=8) brings the global
  loss of the anchor within 2% of the optimum's excess at init, dense and with 4-bit
  QSGD pseudo-gradients; each replica's own optimum is far from the global one."""
  x, y = _lstsq_problem()
  ex = None if exchange is None else jc.qsgd(bits=4, axis_name=AXIS, collective="allgather")
  tx = jc.diloco(
    optax.sgd(0.1),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    sync_every=8,
    axis_name=AXIS,
    exchange=ex,
  )
  params = {"w": jnp.zeros((32, 32)), "b": jnp.zeros((32,))}
  run = ShardMapRun(tx, params=params, grad_fn=lambda p, d: jax.grad(_lstsq_loss)(p, *d))
  history = run.run(160, lambda t: (x, y))
  _, state = history[-1]
  xs, ys = np.asarray(x, np.float64).reshape(-1, 32), np.asarray(y, np.float64).reshape(-1, 32)
  a = np.concatenate([xs, np.ones((len(xs), 1))], 1)
  sol = np.linalg.lstsq(a, ys, rcond=None)[0]
  global_loss = lambda w, b: 0.5 * np.mean(np.sum((xs @ w + b - ys) ** 2, -1))
  best = global_loss(sol[:-1], sol[-1])
  start = global_loss(np.zeros((32, 32)), np.zeros(32))
  got = global_loss(np.asarray(state.anchor["w"], np.float64), np.asarray(state.anchor["b"]))
  assert (got - best) / (start - best) < 0.02, (got, best, start)
  # Non-iid: a replica's own optimum is a poor global model.
  own = np.linalg.lstsq(
    np.concatenate([np.asarray(x[0], np.float64), np.ones((256, 1))], 1),
    np.asarray(y[0], np.float64),
    rcond=None,
  )[0]
  assert (global_loss(own[:-1], own[-1]) - best) / (start - best) > 0.05


def test_fragments_sync_on_staggered_steps():
  """fragments=2, H=4: the leaves split into two fragments of equal size synced at
  t ≡ 0 and t ≡ 2 (mod 4); a fragment's anchor moves only on its steps, where the
  replicas agree on its leaves and still differ on the other fragment's."""
  shapes = {"a": (32, 32), "b": (32, 32)}
  params = {n: jnp.zeros(s) for n, s in shapes.items()}
  keys = jax.random.split(jax.random.key(3), 2)
  centres = {n: jax.random.normal(k, (K, *s)) for k, (n, s) in zip(keys, sorted(shapes.items()))}
  tx = jc.diloco(optax.sgd(0.25), optax.sgd(1.0), sync_every=4, axis_name=AXIS, fragments=2)
  history = ShardMapRun(tx, params=params).run(8, lambda t: centres)
  pieces = diloco_lib.fragment_pieces([(32, 32), (32, 32)], 2)  # the cut: a leaf boundary
  assert pieces == [[diloco_lib.Piece(0, 0, 32)], [diloco_lib.Piece(1, 0, 32)]]
  offsets = {"a": 0, "b": 2}
  assert sorted(offsets.values()) == [0, 2]
  prev = params
  for t, (replicas, state) in enumerate(history, start=1):
    for n in shapes:
      due = (t - offsets[n]) % 4 == 0
      moved = not np.array_equal(state.anchor[n], prev[n])
      assert moved == due, (t, n)
      spread = np.ptp(replicas[n], axis=0).max()
      assert (spread <= 4 * EPS) == due, (t, n, spread)
    prev = state.anchor


# A stacked-layers model: most of its values in one leaf of 8 layers (the rows).
STACKED = {
  "embed": (64, 32),
  "head": (32, 16),
  "layers": {"b": (8, 64), "w": (8, 32, 64)},
}
STACKED_PARAMS = jax.tree.map(jnp.zeros, STACKED, is_leaf=lambda x: isinstance(x, tuple))


def _fragment_trees(tx, params):
  """Each fragment's tree, as its sync exchanges it: the outer momentum's trace (the
  fragment's pieces; ``optax.MaskedNode()`` at the other leaves)."""
  state = jax.eval_shape(tx.init, params)
  return [outer[0].trace for outer in state.outer_state]


def _values(tree):
  return sum(x.size for x in jax.tree.leaves(tree))


def test_fragments_of_a_stacked_model_balance():
  """F=4 on a model whose stacked (8, 32, 64) leaf holds 84% of the values: the leaf is
  split between its rows, so the largest fragment holds at most 1.5x the mean (whole
  leaves would put that leaf alone in one fragment: 3.4x)."""
  tx = jc.diloco(
    optax.sgd(0.1), optax.sgd(1.0, momentum=0.9), sync_every=4, axis_name=AXIS, fragments=4
  )
  trees = _fragment_trees(tx, STACKED_PARAMS)
  sizes = [_values(t) for t in trees]
  assert sum(sizes) == _values(STACKED_PARAMS)
  assert max(sizes) <= 1.5 * np.mean(sizes), sizes


def test_fragment_pieces_cover_every_row_once():
  """Every fragment is one run of consecutive rows of the leaves laid end to end: the
  pieces cover each leaf's rows once, in order; a cut moves to a leaf boundary within
  S/(8F) of where it falls, else to the nearest row; each fragment within S/(4F), or a
  row, of S/F."""
  cases = [
    [(64, 32), (32, 16), (8, 64), (8, 32, 64)],
    [(1000,), (3,), (), (7, 5), (40, 2, 2)],
    [(32, 32), (32, 32)],
    [(1,), (500, 4), (2,)],
  ]
  for shapes in cases:
    sizes = [int(np.prod(s)) for s in shapes]
    row = [sz // (s[0] if s else 1) for s, sz in zip(shapes, sizes)]
    total = sum(sizes)
    for f in range(1, 6):
      pieces = diloco_lib.fragment_pieces(shapes, f)
      flat = [p for ps in pieces for p in ps]
      for i, s in enumerate(shapes):  # each leaf: its rows in order, once
        mine = [(p.start, p.stop) for p in flat if p.leaf == i]
        bounds = [b for pair in mine for b in pair]
        assert bounds[0] == 0 and bounds[-1] == (s[0] if s else 1)
        assert all(a == b for a, b in zip(bounds[1:-1:2], bounds[2:-1:2])), mine
      assert [p.leaf for p in flat] == sorted(p.leaf for p in flat)  # runs in tree order
      loads = [sum((p.stop - p.start) * row[p.leaf] for p in ps) for ps in pieces]
      coarse = max(row[p.leaf] for ps in pieces[1:] for p in ps[:1]) if f > 1 else 0
      for load in loads:
        assert abs(load - total / f) <= max(total / (4 * f), coarse) + 1e-9, (shapes, f, loads)
  # A cut near a leaf boundary stays on it: two leaves of 1024 and 1000 values, F=2.
  assert diloco_lib.fragment_pieces([(32, 32), (1000,)], 2) == [
    [diloco_lib.Piece(0, 0, 32)],
    [diloco_lib.Piece(1, 0, 1000)],
  ]


def test_fewer_rows_than_fragments_warns():
  """One leaf of 2 rows cannot make 4 balanced fragments: a warning says why and how;
  the 2 fragments that hold a row sync it on their steps, the others are empty."""
  params = {"w": jnp.zeros((2, 512))}
  tx = jc.diloco(optax.sgd(0.25), optax.sgd(1.0), sync_every=4, axis_name=AXIS, fragments=4)
  with pytest.warns(
    UserWarning, match=r"fragments=4 are not balanced within 1.5x.*\['w'\] has 2 row"
  ):
    run = ShardMapRun(tx, params=params)
  centres = {"w": jax.random.normal(jax.random.key(0), (K, 2, 512))}
  with pytest.warns(UserWarning, match="are not balanced"):
    history = run.run(8, lambda t: centres)
  pieces = diloco_lib.fragment_pieces([(2, 512)], 4)
  assert [len(ps) for ps in pieces] == [0, 1, 0, 1]
  assert isinstance(history[0][1].outer_state[0], optax.EmptyState)
  offset = {p.start: f for f, ps in enumerate(pieces) for p in ps}  # row -> its fragment
  for t, (replicas, _) in enumerate(history, start=1):
    spread = np.ptp(replicas["w"], axis=0).max(axis=-1)  # per row
    synced = [(t - diloco_lib.fragment_offsets(4, 4)[offset[r]]) % 4 == 0 for r in range(2)]
    assert (spread <= 4 * EPS).tolist() == synced, (t, spread)


def test_split_fragments_follow_the_reference():
  """Stacked model, F=4, H=4 (offsets 0, 1, 2, 3), inner SGD, outer Nesterov, dense
  mean: every value follows DiLoCo's math (float64 reference) with its fragment's
  schedule, the fragments being runs of rows of the leaves laid end to end."""
  lr, h, f, mu, outer_lr = 0.25, 4, 4, 0.9, 0.7
  tx = jc.diloco(
    optax.sgd(lr),
    optax.sgd(outer_lr, momentum=mu, nesterov=True),
    sync_every=h,
    axis_name=AXIS,
    fragments=f,
  )
  leaves, treedef = jax.tree.flatten(STACKED_PARAMS)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  centres = treedef.unflatten([jax.random.normal(k, (K, *x.shape)) for k, x in zip(keys, leaves)])
  history = ShardMapRun(tx, params=STACKED_PARAMS).run(3 * h, lambda t: centres)
  # The reference, on the leaves laid end to end (float64).
  c = np.concatenate(
    [np.asarray(x, np.float64).reshape(K, -1) for x in jax.tree.leaves(centres)], 1
  )
  row = [x.size // x.shape[0] for x in leaves]
  starts = np.cumsum([0] + [x.size for x in leaves])
  frag = np.zeros(c.shape[1], np.int64)
  for g, pieces in enumerate(diloco_lib.fragment_pieces([x.shape for x in leaves], f)):
    for p in pieces:
      frag[starts[p.leaf] + p.start * row[p.leaf] : starts[p.leaf] + p.stop * row[p.leaf]] = g
  offsets = np.asarray(diloco_lib.fragment_offsets(h, f))[frag]
  theta = np.zeros(c.shape[1])
  replicas = np.zeros_like(c)
  trace = np.zeros_like(theta)
  for t, (got_replicas, got) in enumerate(history, start=1):
    replicas = replicas - lr * (replicas - c)
    due = (t - offsets) % h == 0
    delta = (theta[None] - replicas).mean(0)
    new_trace = delta + mu * trace
    step = -outer_lr * (delta + mu * new_trace)
    trace = np.where(due, new_trace, trace)
    theta = np.where(due, theta + step, theta)
    replicas = np.where(due[None], theta[None], replicas)
    got_anchor = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.anchor)])
    got_rows = np.concatenate([x.reshape(K, -1) for x in jax.tree.leaves(got_replicas)], 1)
    np.testing.assert_allclose(got_anchor, theta, rtol=0, atol=1e-5, err_msg=f"t={t}")
    np.testing.assert_allclose(got_rows, replicas, rtol=0, atol=1e-5, err_msg=f"t={t}")


def test_peak_bytes_per_sync_fall_with_fragments():
  """4-bit QSGD pseudo-gradients of the stacked model, H=4: a sync step sends one
  fragment, at most 1.5x a quarter of the whole model's bytes at F=4 (with whole leaves
  the stacked leaf's fragment sends 3x that). Each fragment's bytes are the exchange's
  on its tree; together, over H, they are DiLoCo's traced wire report."""
  h, f = 4, 4
  # All-gathered: with the two-phase route the dense leaves (not compressed) dominate the
  # bytes of the fragment that holds them, and fragments balance values, not bytes.
  ex = lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="allgather")
  tx = jc.diloco(
    optax.sgd(0.1),
    optax.sgd(1.0, momentum=0.9),
    sync_every=h,
    axis_name=AXIS,
    exchange=ex(),
    fragments=f,
  )
  report = lambda tx, params: jc.wire_report(tx, params, axis_name=AXIS, num_devices=K)
  # The fragments' trees do not depend on the exchange; without one, init needs no bound
  # axis (the exchange's "auto" route reads K at init).
  dense = jc.diloco(
    optax.sgd(0.1), optax.sgd(1.0, momentum=0.9), sync_every=h, axis_name=AXIS, fragments=f
  )
  per_sync = [report(ex(), t).bytes_received for t in _fragment_trees(dense, STACKED_PARAMS)]
  assert sum(per_sync) / h == pytest.approx(report(tx, STACKED_PARAMS).bytes_received, rel=1e-12)
  whole = report(ex(), STACKED_PARAMS).bytes_received
  assert max(per_sync) <= 1.5 * whole / f, (per_sync, whole)


@pytest.mark.parametrize("fragments", [None, 2])
def test_wire_report_divides_by_sync_every(fragments):
  """The sync's collectives count 1/H per step: DiLoCo's report is the exchange's over
  H (for the dense mean, the dense all-reduce's); fragments send the same bytes in all."""
  h = 5
  params = {"w": jnp.zeros((64, 32)), "v": jnp.zeros((32, 64)), "b": jnp.zeros((32,))}
  for ex in (None, lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="allgather")):
    tx = jc.diloco(
      optax.sgd(0.1),
      optax.sgd(1.0),
      sync_every=h,
      axis_name=AXIS,
      exchange=None if ex is None else ex(),
      fragments=fragments,
    )
    report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=K)
    if ex is None:
      want = report.dense_bytes / h
    else:
      exchange_report = jc.wire_report(ex(), params, axis_name=AXIS, num_devices=K)
      want = exchange_report.bytes_received / h
    if fragments is None or ex is None:  # the same collectives, once every H steps
      assert report.bytes_received == pytest.approx(want, rel=1e-12)
    else:  # per-fragment payloads: their own padding and scales, within a few percent
      assert report.bytes_received == pytest.approx(want, rel=0.05)
    assert report.ops and all(op.every == h for op in report.ops)
    assert f"once every {h} steps" in str(report)


@helpers.NOTHING_COMPRESSED
def test_state_is_stable_and_one_compile():
  """Inner Adam, outer Nesterov, 4-bit QSGD with error feedback, 2 fragments: the state
  keeps its shapes, dtypes and specs over syncs and steps between them, in one compile
  (ShardMapRun's step asserts a single trace)."""
  chex.clear_trace_counter()
  tx = jc.diloco(
    optax.adam(1e-2),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    sync_every=2,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name=AXIS, error_feedback=True, collective="allgather"),
    fragments=2,
  )
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    run = ShardMapRun(tx)
    replicas, state0 = run.start()
    history = run.run(4, lambda t: _centres(seed=t), replicas, state0)
  state0 = jax.device_get(state0)
  for _, state in history:
    chex.assert_trees_all_equal_shapes_and_dtypes(state0, state)
  # The exchange's state advances on its fragment's sync steps only: fragment 0 (b and
  # w's first 31 rows, offset 0) syncs at t = 2, 4, so its key changes there only.
  keys = [
    jax.random.key_data(s.exchange_state[0].inner.key) for s in [state0] + [s for _, s in history]
  ]
  changed = [not np.array_equal(keys[t], keys[t - 1]) for t in range(1, 5)]
  assert changed == [False, True, False, True]
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(history[-1][1].anchor))


def test_state_specs():
  """Anchor, count and outer state replicated; inner and exchange states per device."""
  tx = jc.diloco(
    optax.adam(1e-3),
    optax.sgd(0.7, momentum=0.9),
    sync_every=4,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name=AXIS, error_feedback=True, collective="allgather"),
  )
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  assert specs.count == P()
  assert specs.anchor == {"w": P(), "b": P()}
  assert all(s == P() for s in jax.tree.leaves(specs.outer_state))
  adam = specs.inner_state.inner[0]
  assert adam.mu == {"w": P(AXIS), "b": P(AXIS)} and adam.count == P(AXIS)
  ex = specs.exchange_state[0].inner
  assert ex.key == P(AXIS) and ex.residual["w"] == P(AXIS)


def test_per_device_state_hands_diloco_back_unchanged():
  """Wrapping jc.diloco in jc.per_device_state, as every other method, is the same
  transform: its per-device parts are wrapped already."""
  tx = jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name=AXIS)
  assert jc.per_device_state(tx) is tx


@helpers.NOTHING_COMPRESSED
@pytest.mark.parametrize("fragments", [None, 2])
def test_checkpoint_round_trip_resumes_bit_identically(fragments):
  """The state (typed keys included) saved as plain arrays after 3 steps and restored
  as jc.restore_target places it continues exactly as the uninterrupted run; with
  fragments=2 the (64, 32) leaf is split between the two, its pieces' outer and
  exchange states held in each."""
  chex.clear_trace_counter()
  tx = jc.diloco(
    optax.sgd(0.05, momentum=0.9),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    sync_every=2,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name=AXIS, error_feedback=True, collective="allgather"),
    fragments=fragments,
  )
  if fragments:  # w's rows in both fragments
    assert [len(t["w"]) for t in _fragment_trees(tx, PARAMS)] == [31, 33]
  run = ShardMapRun(tx)
  data = lambda t: _centres(seed=t)
  replicas, state = run.start()
  run.run(3, data, replicas, state)
  replicas, live = run.last
  saved = jax.tree.map(np.asarray, jc.unwrap_keys(live))  # what a checkpointer writes
  target = jc.restore_target(tx, PARAMS, mesh=run.mesh, specs=run.specs)
  for t, x in zip(jax.tree.leaves(target), jax.tree.leaves(live)):
    assert t.sharding.is_equivalent_to(x.sharding, x.ndim), (t, x.sharding)
  restored = jax.tree.map(
    lambda x, like: jax.device_put(x, like.sharding), saved, jc.unwrap_keys(live)
  )
  state = jc.wrap_keys(restored, target)
  assert jax.dtypes.issubdtype(state.exchange_state[0].inner.key.dtype, jax.dtypes.prng_key)
  resumed = run.run(2, lambda t: data(t + 3), replicas, state)
  full = run.run(2, lambda t: data(t + 3), replicas, live)
  chex.assert_trees_all_equal(jc.unwrap_keys(resumed[-1]), jc.unwrap_keys(full[-1]))
  assert int(resumed[-1][1].count) == 5


def test_bad_input():
  """Clear errors: sync_every, fragments, non-transforms, update without params."""
  sgd = optax.sgd(0.1)
  for bad in (0, -1, 1.5, True, None):
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
      jc.diloco(sgd, sgd, sync_every=bad, axis_name=AXIS)
  for bad in (0, 5, 2.0, True):
    with pytest.raises(ValueError, match="fragments must be an integer"):
      jc.diloco(sgd, sgd, sync_every=4, axis_name=AXIS, fragments=bad)
  with pytest.raises(TypeError, match="inner must be an optax GradientTransformation"):
    jc.diloco(lambda g: g, sgd, sync_every=2, axis_name=AXIS)
  with pytest.raises(TypeError, match="exchange must be"):
    jc.diloco(sgd, sgd, sync_every=2, axis_name=AXIS, exchange=jc.codecs.Identity())
  tx = jc.diloco(sgd, sgd, sync_every=2, axis_name=None)
  with pytest.raises(ValueError, match="update needs params"):
    tx.update(PARAMS, tx.init(PARAMS))


def test_replicated_params_under_shard_map_are_refused():
  """Under shard_map, replicated params (P()) cannot drift: a clear error says how to
  hold them."""
  m = helpers.mesh()
  tx = jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name=AXIS)
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)

  def step(params, state, c):
    grads = _quadratic_grads(jc.vary(params, AXIS), jax.tree.map(lambda x: x[0], c))
    return tx.update(grads, state, params)

  f = jax.shard_map(step, mesh=m, in_specs=(P(), specs, P(AXIS)), out_specs=(P(AXIS), specs))
  state = ShardMapRun(tx).start()[1]
  with pytest.raises(ValueError, match="hold the parameters per device"):
    jax.jit(f).lower(PARAMS, state, helpers.shard(_centres(), m))


NOT_AVERAGING = {  # exchanges that average over no axis, or not over AXIS
  "axis_name=None": lambda: jc.qsgd(bits=4, axis_name=None),
  "own transform": lambda: optax.scale(1.0),
  # All-gathered: under "auto" its init would need 'other' bound to read K, and
  # jc.state_specs would refuse it before DiLoCo's own check, which this is about.
  "qsgd(axis_name='other')": lambda: jc.qsgd(bits=4, axis_name="other", collective="allgather"),
}


@pytest.mark.parametrize(
  "where, exchange",
  [
    (where, name)
    for where in ("pmap", "shard_map check_vma=False")
    for name in sorted(NOT_AVERAGING)
    if not (where == "pmap" and "other" in name)  # pmap binds one axis: the next test
  ],
)
def test_exchange_that_does_not_average_over_the_axis_is_refused(where, exchange):
  """Under pmap and shard_map(check_vma=False) values carry no varying type; an exchange
  whose result depends on no collective over DiLoCo's axis (built with axis_name=None,
  or for another axis, or an optax transform doing no collective) let each replica step
  the anchor with its own pseudo-gradient, and the anchors drifted apart silently. The
  sync's trace refuses it, naming the axis and the fix."""
  tx = jc.diloco(
    optax.sgd(0.25),
    optax.sgd(1.0),
    sync_every=1,
    axis_name=AXIS,
    exchange=NOT_AVERAGING[exchange](),
  )
  other = "other" in exchange
  over = "'other'" if other else "none"
  match = rf"over axis '{AXIS}' \(its collectives run over: {over}\).*axis_name='{AXIS}'"

  def one_step():  # a sync (H=1): this replica's parameters after it
    if where == "pmap":
      p, state, step = _pmap_run(tx)
      return step(p, state, _centres())[0]
    mesh = helpers.mesh()
    if other:  # a mesh with both axes, the replicas on AXIS
      mesh = jax.make_mesh(
        (4, 2), (AXIS, "other"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
      )
    run = ShardMapRun(tx, mesh=mesh, check_vma=False)
    return run.run(1, lambda t: _centres(k=mesh.shape[AXIS]))[-1][0]

  with pytest.raises(ValueError, match=match):
    replicas = one_step()
    # Reached only if nothing was refused: right after a sync every replica
    # must sit on the anchor, the same on every device.
    spread = max(np.ptp(np.asarray(x), axis=0).max() for x in jax.tree.leaves(replicas))
    assert spread <= 4 * EPS, f"no error, and the replicas' anchors differ by {spread}"


def test_exchange_over_another_axis_is_refused():
  """An exchange that averages over another mesh axis (check_vma on), or an unbound one
  (pmap), is an error naming the axis DiLoCo syncs over."""
  mesh2 = jax.make_mesh((4, 2), (AXIS, "other"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  tx = jc.diloco(
    optax.sgd(0.1),
    optax.sgd(1.0),
    sync_every=2,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name="other", collective="allgather"),
  )
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=4)

  def step(replicas, state, c):
    p = jax.tree.map(lambda x: x[0], replicas)
    p = jc.vary(p, "other")
    return tx.update(_quadratic_grads(p, jax.tree.map(lambda x: x[0], c)), state, p)

  f = jax.jit(
    jax.shard_map(step, mesh=mesh2, in_specs=(P(AXIS), specs, P(AXIS)), out_specs=(P(AXIS), specs))
  )
  init = jax.shard_map(tx.init, mesh=mesh2, in_specs=P(), out_specs=specs)
  state = jax.jit(init)(jax.device_put(PARAMS, jax.NamedSharding(mesh2, P())))
  per_device = jax.NamedSharding(mesh2, P(AXIS))
  replicas, c = jax.device_put((_stack(PARAMS, 4), _centres(k=4)), per_device)
  with pytest.raises(ValueError, match=f"axis_name='{AXIS}'"):
    f.lower(replicas, state, c)

  # Under pmap an exchange over an axis that is not bound is refused too.
  tx = jc.diloco(
    optax.sgd(0.1),
    optax.sgd(1.0),
    sync_every=1,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name="nope", collective="allgather"),
  )
  p = _stack(PARAMS, 2)
  state = jax.pmap(tx.init, axis_name=AXIS)(p)
  with pytest.raises(ValueError, match="not bound"):
    jax.pmap(lambda p, s: tx.update(p, s, p), axis_name=AXIS)(p, state)


@pytest.mark.parametrize(
  "exchange",
  [
    lambda: jc.qsgd(bits=4, axis_name=AXIS),
    lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="two_phase", error_feedback=True),
    lambda: jc.onebit_sgd(axis_name=AXIS),
    lambda: jc.ef_signsgd(axis_name=AXIS),
    lambda: jc.powersgd(1, axis_name=AXIS),
    lambda: jc.sparsify(density=0.1, axis_name=AXIS),
    lambda: jc.mipd(0.5, axis_name=AXIS),
    lambda: jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="allgather"),
    lambda: optax.chain(optax.scale(2.0), jc.qsgd(bits=4, axis_name=AXIS)),
  ],
  ids=[
    "qsgd",
    "qsgd_two_phase_ef",
    "onebit",
    "ef_signsgd",
    "powersgd",
    "sparsify",
    "mipd",
    "identity",
    "chain",
  ],
)
def test_exchanges_that_average_pass_the_check(exchange):
  """The negative control: jaxcomp's exchanges over the axis (and a chain around one)
  trace through the check (the wire report traces with check_vma off, as pmap does)."""
  tx = jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, axis_name=AXIS, exchange=exchange())
  report = jc.wire_report(tx, PARAMS, axis_name=AXIS, num_devices=K)
  assert report.bytes_received > 0


def test_pmap_with_a_compressed_exchange():
  """Under jax.pmap, 4-bit QSGD pseudo-gradients (two-phase, error feedback), H=2: the
  replicas differ after the local step and all sit on the anchor after the sync."""
  tx = jc.diloco(
    optax.sgd(0.25),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    sync_every=2,
    axis_name=AXIS,
    exchange=jc.qsgd(bits=4, axis_name=AXIS, collective="two_phase", error_feedback=True),
  )
  centres = _centres()

  p, state, step = _pmap_run(tx)
  p, state = step(p, state, centres)
  assert np.ptp(np.asarray(p["w"]), axis=0).max() > 0.1  # drifted apart
  p, state = step(p, state, centres)
  anchor = np.asarray(state.anchor["w"])
  np.testing.assert_array_equal(anchor, np.broadcast_to(anchor[0], anchor.shape))
  np.testing.assert_allclose(np.asarray(p["w"]), anchor, rtol=0, atol=2 * EPS)
  assert not np.array_equal(anchor[0], np.zeros_like(anchor[0]))


def test_network_model_prices_a_sync_once_per_period():
  """jc.network.exchange_time averages a sync's time over its period: DiLoCo's time per
  step is the exchange's over H."""
  link = jc.network.Link(latency_s=1e-3, bandwidth=100e6 / 8)
  params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((64,))}
  ex = lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="allgather")
  tx = jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=8, axis_name=AXIS, exchange=ex())
  per_step = jc.network.exchange_time(
    jc.wire_report(tx, params, axis_name=AXIS, num_devices=K), link
  )
  every_step = jc.network.exchange_time(
    jc.wire_report(ex(), params, axis_name=AXIS, num_devices=K), link
  )
  assert per_step == pytest.approx(every_step / 8, rel=1e-12)
