"""jc.diloco(..., fast_axis=...): DiLoCo whose replicas are nodes, on a (2, 4) mesh of the
8 CPU devices (N = 2 nodes of L = 4 devices), under jax.shard_map with check_vma on.

Every device holds its replica's parameters (globally (N·L, *shape), P((node, gpu))); the
devices of a node average their gradients densely every step, so they hold the same
replica; on a sync the nodes exchange the pseudo-gradient over the slow axis, each
device 1/L of it."""

import math

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.methods import diloco as diloco_lib

SLOW, FAST = "node", "gpu"
AXES = (SLOW, FAST)
N, L = 2, 4
EPS = float(jnp.finfo(jnp.float32).eps)
# A matrix L divides (its shard: rows), one it does not (a padded flat shard), a bias.
SHAPES = {"w": (64, 32), "odd": (33, 35), "b": (32,)}
PARAMS = {n: jnp.zeros(s, jnp.float32) for n, s in SHAPES.items()}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N, L), AXES)


def _quadratic_grads(p, c):
  """Gradient of 0.5 ||p - c||^2 (device-specific centres c)."""
  return jax.tree.map(lambda x, y: x - y, p, c)


def _centres(seed=0, shapes=SHAPES):
  """One centre per device, device-major (node n, device l at row n·L + l)."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {n: jax.random.normal(k, (N * L, *s)) for k, (n, s) in zip(keys, sorted(shapes.items()))}


class Run:
  """DiLoCo across nodes under shard_map (check_vma on): each device holds its
  replica's row; ``run`` returns every step's (replicas, state) on the host."""

  def __init__(self, tx, mesh, params=PARAMS, grad_fn=_quadratic_grads):
    chex.clear_trace_counter()
    self.mesh, self.params = mesh, params
    self.specs = jc.state_specs(tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh)
    self.init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=self.specs))

    @chex.assert_max_traces(n=1)
    def step(replicas, state, data):
      p = jax.tree.map(lambda x: x[0], replicas)  # this device's replica
      grads = grad_fn(p, jax.tree.map(lambda x: x[0], data))
      updates, state = tx.update(grads, state, p)
      return jax.tree.map(lambda x: x[None], optax.apply_updates(p, updates)), state

    specs = (P(AXES), self.specs, P(AXES))
    self.step = jax.jit(
      jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(AXES), self.specs))
    )

  def run(self, steps, data):
    put = lambda x: jax.device_put(x, NamedSharding(self.mesh, P(AXES)))
    state = self.init(self.params)
    replicas = put(jax.tree.map(lambda x: jnp.broadcast_to(x, (N * L, *x.shape)), self.params))
    out = []
    for t in range(1, steps + 1):
      replicas, state = self.step(replicas, state, put(data(t)))
      out.append(jax.device_get((replicas, state)))
    return out


def _nodes(x):
  """A (N·L, ...) per-device array as (N, L, ...)."""
  x = np.asarray(x)
  return x.reshape((N, L) + x.shape[1:])


def _reference(lr, h, steps, centres, pieces=None):
  """The layout by hand, in float64: node n steps ``θ_n -= lr (θ_n - c̄_n)`` with its
  devices' mean gradient (c̄_n the mean of its devices' centres); at a sync of a leaf
  (``t ≡ offset mod H``) the anchor of that leaf becomes the nodes' mean (outer
  sgd(1.0)) and every node restarts from it; ``pieces[name]``: ``(start, stop, offset)``
  per run of rows synced together (default: the whole leaf at offset 0). Returns every
  step's (nodes, anchor)."""
  pieces = pieces or {}
  c = {n: _nodes(v).astype(np.float64).mean(1) for n, v in centres.items()}  # (N, ...)
  theta = {n: np.zeros_like(v) for n, v in c.items()}
  anchor = {n: np.zeros(v.shape[1:]) for n, v in c.items()}
  out = []
  for t in range(1, steps + 1):
    for n in c:
      theta[n] = theta[n] - lr * (theta[n] - c[n])
      for start, stop, offset in pieces.get(n, [(0, len(anchor[n]), 0)]):
        if (t - offset) % h == 0:
          anchor[n][start:stop] = theta[n][:, start:stop].mean(0)
          theta[n][:, start:stop] = anchor[n][start:stop]
    out.append(({n: v.copy() for n, v in theta.items()}, {n: v.copy() for n, v in anchor.items()}))
  return out


def _check_against(history, want, atol=1e-5):
  for (replicas, state), (nodes, anchor) in zip(history, want):
    for n in anchor:
      np.testing.assert_allclose(state.anchor[n], anchor[n], rtol=0, atol=atol, err_msg=n)
      got = _nodes(replicas[n])
      for l in range(L):
        np.testing.assert_allclose(got[:, l], nodes[n], rtol=0, atol=atol, err_msg=n)


@pytest.mark.parametrize("exchange", [None, "identity"])
def test_local_steps_and_syncs_follow_the_reference(mesh, exchange):
  """H = 3, inner sgd, outer sgd(1.0), a dense mean (or the identity codec through
  jc.compress, all-gathered): every step's replicas and anchor are the hand-computed
  ones (node-mean gradients each step, the nodes' mean at every sync)."""
  lr, h, steps = 0.25, 3, 7
  ex = None
  if exchange == "identity":
    ex = jc.compress(jc.codecs.Identity(), axis_name=SLOW, collective="allgather")
  tx = jc.diloco(
    optax.sgd(lr), optax.sgd(1.0), sync_every=h, axis_name=SLOW, exchange=ex, fast_axis=FAST
  )
  centres = _centres()
  history = Run(tx, mesh).run(steps, lambda t: centres)
  _check_against(history, _reference(lr, h, steps, centres))
  assert [int(s.count) for _, s in history] == list(range(1, steps + 1))


@pytest.mark.parametrize("lr", [0.125, 0.3])
def test_sync_every_one_is_data_parallel_sgd_over_all_devices(mesh, lr):
  """sync_every=1, no exchange, inner sgd(lr), outer sgd(1.0): data-parallel SGD over
  all N·L devices (replicated parameters, jc.pmean_tree of the gradient over both axes).
  The means are taken in another order (over a node, then over the nodes), so they agree
  to a few roundings per step, not bit for bit; every replica sits on the anchor."""
  steps = 6
  tx = jc.diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=1, axis_name=SLOW, fast_axis=FAST)
  centres = _centres()
  replicas, state = Run(tx, mesh).run(steps, lambda t: centres)[-1]

  sgd = optax.sgd(lr)

  def dp_step(p, c):
    grads = _quadratic_grads(jc.vary(p, AXES), jax.tree.map(lambda x: x[0], c))
    updates, _ = sgd.update(jc.pmean_tree(grads, AXES), sgd.init(p))
    return optax.apply_updates(p, updates)

  dp = jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(AXES)), out_specs=P()))
  p = PARAMS
  for _ in range(steps):
    p = dp(p, jax.device_put(centres, NamedSharding(mesh, P(AXES))))
  for n in SHAPES:
    np.testing.assert_allclose(state.anchor[n], p[n], rtol=0, atol=4 * steps * EPS)
    for row in replicas[n]:
      np.testing.assert_allclose(row, state.anchor[n], rtol=0, atol=2 * EPS)


def test_a_node_holds_one_replica_and_nodes_drift_between_syncs(mesh):
  """Inner Adam, outer Nesterov, 4-bit QSGD with error feedback, H = 3, different data on
  every device: at every step the L devices of a node hold the same parameters and the
  same inner state, bit for bit; between syncs the nodes' parameters differ, and at a
  sync every device lands on the anchor."""
  h, steps = 3, 6
  tx = jc.diloco(
    optax.adam(1e-2),
    optax.sgd(0.7, momentum=0.9, nesterov=True),
    sync_every=h,
    axis_name=SLOW,
    exchange=jc.qsgd(bits=4, axis_name=SLOW, error_feedback=True),
    fast_axis=FAST,
  )
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    run = Run(tx, mesh)
    history = run.run(steps, lambda t: _centres(seed=t))
  for t, (replicas, state) in enumerate(history, start=1):
    for n in SHAPES:
      nodes = _nodes(replicas[n])
      for l in range(1, L):
        np.testing.assert_array_equal(nodes[:, l], nodes[:, 0], err_msg=f"{n} t={t}")
      spread = np.abs(nodes[1, 0] - nodes[0, 0]).max()
      if t % h:
        assert spread > 1e-3, (n, t, spread)
      else:  # on the anchor, to one rounding of θ_n + (θ_new - θ_n)
        for node in nodes[:, 0]:
          np.testing.assert_allclose(node, state.anchor[n], rtol=0, atol=2 * EPS)
    mu = state.inner_state.inner[0].mu
    for n in SHAPES:
      nodes = _nodes(mu[n])
      for l in range(1, L):
        np.testing.assert_array_equal(nodes[:, l], nodes[:, 0])
      assert not np.array_equal(nodes[0, 0], nodes[1, 0])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(history[-1][1].anchor))


def test_state_specs_place_the_state(mesh):
  """The anchor, count and outer state replicated; the inner state per device (the
  same on the devices of a node); the exchange's state two-level: its residuals 1/L of
  each compressed leaf per device."""
  tx = jc.diloco(
    optax.adam(1e-3),
    optax.sgd(0.7, momentum=0.9),
    sync_every=4,
    axis_name=SLOW,
    exchange=jc.onebit_sgd(axis_name=SLOW),
    fast_axis=FAST,
  )
  assert jc.per_device_state(tx) is tx
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  assert specs.count == P()
  assert specs.anchor == {n: P() for n in SHAPES}
  assert all(s == P() for s in jax.tree.leaves(specs.outer_state))
  adam = specs.inner_state.inner[0]
  assert adam.mu == {n: P(AXES) for n in SHAPES}
  ex = specs.exchange_state[0]
  assert isinstance(ex, jc.TwoLevelState)
  assert ex.inner.inner.residual["w"] == P(AXES)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)
  residual = state.exchange_state[0].inner.inner.residual
  assert residual["w"].shape == (N * L, 64 // L, 32)  # a shard of rows per device
  assert residual["odd"].shape == (N * L, -(-33 * 35 // L))  # flattened and padded
  assert isinstance(residual["b"], optax.MaskedNode)  # dense: no residual


def test_slow_axis_carries_one_compressed_delta_per_node(mesh):
  """4-bit QSGD, H = 4: over the slow axis each device exchanges its 1/L shard of the
  pseudo-gradient (all-gathered from the other node at N = 2), once every H steps; the
  fast axis carries the dense gradient mean every step and the gather of the sync.
  DiLoCo over all N·L devices as replicas moves at least L times more per device."""
  h = 4
  params = {"w": jnp.zeros((1024, 1024))}
  kw = dict(axis_name=AXES, num_devices=N * L, mesh=mesh)
  make = lambda axis, **f: jc.diloco(
    optax.sgd(0.1),
    optax.sgd(1.0),
    sync_every=h,
    axis_name=axis,
    exchange=jc.qsgd(bits=4, axis_name=axis),
    **f,
  )
  nodes = jc.wire_report(make(SLOW, fast_axis=FAST), params, **kw)
  flat = jc.wire_report(make(AXES), params, **kw)
  shard = jc.codecs.QSGD(7, 512, "max").wire_bits((1024 // L, 1024)) / 8
  assert nodes.by_axis[(SLOW,)] == pytest.approx((N - 1) * shard / h, rel=1e-12)
  n = 1024 * 1024 * 4
  every_step = 2 * (L - 1) / L * n  # the gradient's all-reduce inside the node
  gather = (L - 1) / L * n / h  # the sync's all-gather of the mean over the node
  assert nodes.by_axis[(FAST,)] == pytest.approx(every_step + gather, rel=1e-12)
  assert set(flat.by_axis) == {tuple(sorted(AXES))}
  assert L * nodes.by_axis[(SLOW,)] <= flat.bytes_received


def test_fragments_sync_on_their_own_steps(mesh):
  """Streaming DiLoCo across nodes: two leaves of equal size are the two fragments
  (H = 4: "a" syncs at t ≡ 0, "b" at t ≡ 2 mod 4), each following the reference."""
  shapes = {"a": (64, 32), "c": (64, 32)}
  params = {n: jnp.zeros(s) for n, s in shapes.items()}
  lr, h, steps = 0.25, 4, 8
  tx = jc.diloco(
    optax.sgd(lr),
    optax.sgd(1.0),
    sync_every=h,
    axis_name=SLOW,
    exchange=jc.compress(jc.codecs.Identity(), axis_name=SLOW, collective="allgather"),
    fragments=2,
    fast_axis=FAST,
  )
  assert [[p.leaf for p in f] for f in diloco_lib.fragment_pieces(list(shapes.values()), 2)] == [
    [0],
    [1],
  ]
  centres = _centres(shapes=shapes)
  history = Run(tx, mesh, params).run(steps, lambda t: centres)
  _check_against(history, _reference(lr, h, steps, centres, pieces={"c": [(0, 64, 2)]}))


def test_a_leaf_split_between_fragments_syncs_its_rows_in_turn(mesh):
  """One (64, 32) leaf, two fragments (H = 4): rows 0-31 sync at t ≡ 0, rows 32-63 at
  t ≡ 2 (mod 4), each piece cut into its L shards for the slow exchange; the float64
  reference per run of rows."""
  shapes = {"a": (64, 32)}
  params = {"a": jnp.zeros((64, 32))}
  lr, h, steps = 0.25, 4, 8
  tx = jc.diloco(
    optax.sgd(lr),
    optax.sgd(1.0),
    sync_every=h,
    axis_name=SLOW,
    exchange=jc.compress(jc.codecs.Identity(), axis_name=SLOW, collective="allgather"),
    fragments=2,
    fast_axis=FAST,
  )
  pieces = diloco_lib.fragment_pieces([(64, 32)], 2)
  assert [[(p.start, p.stop) for p in f] for f in pieces] == [[(0, 32)], [(32, 64)]]
  centres = _centres(shapes=shapes)
  history = Run(tx, mesh, params).run(steps, lambda t: centres)
  want = _reference(lr, h, steps, centres, pieces={"a": [(0, 32, 0), (32, 64, 2)]})
  _check_against(history, want)


def test_parameters_held_once_per_node(mesh):
  """The replicas may be held once per node (globally (N, *shape), P(node)), the
  gradient taken w.r.t. jc.vary(p, fast): the same steps as one row per device."""
  lr, h, steps = 0.25, 2, 4
  tx = jc.diloco(
    optax.sgd(lr),
    optax.sgd(1.0),
    sync_every=h,
    axis_name=SLOW,
    exchange=jc.qsgd(bits=8, axis_name=SLOW),
    fast_axis=FAST,
  )
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

  def step(replicas, state, c):
    p = jax.tree.map(lambda x: x[0], replicas)  # varies over the nodes only
    grads = _quadratic_grads(jc.vary(p, FAST), jax.tree.map(lambda x: x[0], c))
    updates, state = tx.update(grads, state, p)
    return jax.tree.map(lambda x: x[None], optax.apply_updates(p, updates)), state

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(SLOW), specs, P(AXES)), out_specs=(P(SLOW), specs))
  )
  centres = jax.device_put(_centres(), NamedSharding(mesh, P(AXES)))
  replicas = jax.tree.map(lambda x: jnp.zeros((N, *x.shape)), PARAMS)
  replicas = jax.device_put(replicas, NamedSharding(mesh, P(SLOW)))
  for _ in range(steps):
    replicas, state = f(replicas, state, centres)
  per_device = Run(tx, mesh).run(steps, lambda t: _centres())[-1]
  for n in SHAPES:
    np.testing.assert_array_equal(np.asarray(replicas[n]), _nodes(per_device[0][n])[:, 0])
    np.testing.assert_array_equal(np.asarray(state.anchor[n]), per_device[1].anchor[n])


def test_bad_input(mesh):
  """Clear errors: the fast axis is the nodes' axis, or missing; an exchange over the
  wrong axis or not a jaxcomp exchange; a method two_level cannot shard; a gradient
  already summed over the node."""
  sgd = optax.sgd(0.1)
  kw = dict(sync_every=2, axis_name=SLOW)
  for fast, axis in ((SLOW, SLOW), (FAST, AXES), (AXES, SLOW)):
    with pytest.raises(ValueError, match="fast_axis must be one mesh axis"):
      jc.diloco(sgd, sgd, sync_every=2, axis_name=axis, fast_axis=fast)
  with pytest.raises(ValueError, match="need axis_name"):
    jc.diloco(sgd, sgd, sync_every=2, axis_name=None, fast_axis=FAST)
  for axis in (FAST, AXES, None, "other"):
    with pytest.raises(ValueError, match=f"must average over the nodes, axis_name='{SLOW}'"):
      jc.diloco(sgd, sgd, **kw, exchange=jc.qsgd(axis_name=axis), fast_axis=FAST)
  for ex in (optax.scale(1.0), optax.chain(jc.qsgd(axis_name=SLOW))):
    with pytest.raises(TypeError, match="one jaxcomp exchange"):
      jc.diloco(sgd, sgd, **kw, exchange=ex, fast_axis=FAST)
  with pytest.raises(NotImplementedError, match="jc.mipd"):
    jc.diloco(sgd, sgd, **kw, exchange=jc.mipd(axis_name=SLOW), fast_axis=FAST)

  tx = jc.diloco(sgd, sgd, **kw, fast_axis=FAST)
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

  def loss(p, c):
    return sum(0.5 * jnp.sum((p[n] - c[n]) ** 2) for n in p)

  def step(replicas, state, c):  # jax.grad w.r.t. p, not jc.vary(p, FAST): summed
    p = jax.tree.map(lambda x: x[0], replicas)
    return tx.update(jax.grad(loss)(p, jax.tree.map(lambda x: x[0], c)), state, p)

  out_specs = (P(SLOW), specs)
  f = jax.shard_map(step, mesh=mesh, in_specs=(P(SLOW), specs, P(AXES)), out_specs=out_specs)
  replicas = jax.tree.map(lambda x: jnp.zeros((N, *x.shape)), PARAMS)
  replicas = jax.device_put(replicas, NamedSharding(mesh, P(SLOW)))
  centres = jax.device_put(_centres(), NamedSharding(mesh, P(AXES)))
  with pytest.raises(ValueError, match="already replicated over axis 'gpu'"):
    jax.jit(f).lower(replicas, state, centres)


def test_guide_section_runs_as_written():
  """docs/guides/two_level.md's "DiLoCo across nodes" example, as written: it trains,
  the devices of a node agree, and the report splits the bytes over the two axes."""
  import contextlib
  import io
  import re

  from tests import _docs_blocks

  guide = "docs/guides/two_level.md"
  code = _docs_blocks.section_code(guide, "DiLoCo across nodes")
  out = io.StringIO()
  with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
    exec(compile(code, guide, "exec"), {"__name__": "two_level_guide_diloco"})
  text = out.getvalue()
  loss = float(re.search(r"loss (\S+)", text).group(1))
  assert np.isfinite(loss) and loss < math.log(10), text
  assert "over node:" in text and "over gpu:" in text, text
