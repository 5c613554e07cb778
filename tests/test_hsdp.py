"""jc.hsdp: parameters sharded over the fast axis of a (2, 4) mesh of the 8 CPU devices
(2 nodes of L = 4 devices), replicated over the nodes, the exchange between nodes
compressed; under jax.shard_map with check_vma on."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from tests import helpers

SLOW, FAST = "node", "gpu"
AXES = (SLOW, FAST)
N, L = 2, 4

# Every first axis divisible by L. "w" has 2048 values: the default filter compresses
# it, but not its (16, 32) shard of 512.
PARAMS = {"w": jnp.zeros((64, 32)), "v": jnp.zeros((32, 40)), "b": jnp.zeros((12,))}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N, L), AXES)


def _grads(key, params=PARAMS):
  """One full-size gradient per device: each leaf with a leading axis of N·L."""
  keys = jax.random.split(key, len(params))
  return {
    name: jax.random.normal(k, (N * L,) + p.shape, p.dtype)
    for k, (name, p) in zip(keys, sorted(params.items()))
  }


def _shard(x, f):
  """Rows f of L of ``x``: what P(FAST) gives device f."""
  s = x.shape[0] // L
  return x[f * s : (f + 1) * s]


def _specs(tx, mesh, params=PARAMS):
  return jc.state_specs(
    tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh, param_specs=P(FAST)
  )


def _placed(params, mesh):
  return jax.device_put(params, NamedSharding(mesh, P(FAST)))


def _init(tx, mesh, params=PARAMS):
  specs = _specs(tx, mesh, params)
  params = _placed(params, mesh)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(FAST), out_specs=specs)
  return jax.jit(init)(params), specs


def _shard_grads(shards, g):
  """The gradient of the shards through jc.fsdp_gather when the gathered weights'
  local gradient is ``g``: the node's mean of this device's shard (dense backward)."""

  def loss(shards):
    w = jc.fsdp_gather(shards, axis_name=FAST)
    return sum(jnp.vdot(w[k], g[k]) for k in w)

  return jax.grad(loss)(jc.vary(shards, SLOW))


def _run(tx, route, mesh, grads, params=PARAMS, steps=1):
  """``steps`` updates of the ``jc.hsdp`` ``tx`` on the same per-device gradients: for
  ``grads="shards"`` through jc.fsdp_gather's backward, for ``"full"`` as they are.
  Returns every device's updates, ``(N·L, steps, *shard)`` per leaf, and the state."""
  state, specs = _init(tx, mesh, params)
  grads = jax.device_put(grads, NamedSharding(mesh, P(AXES)))

  def run(g, state, shards):
    g = jax.tree.map(lambda x: x[0], g)

    def step(state, _):
      gi = _shard_grads(shards, g) if route == "shards" else g
      u, state = tx.update(gi, state, shards)
      return state, u

    state, us = jax.lax.scan(step, state, None, length=steps)
    return jax.tree.map(lambda u: u[None], us), state

  fn = jax.shard_map(run, mesh=mesh, in_specs=(P(AXES), specs, P(FAST)), out_specs=(P(AXES), specs))
  return jax.jit(fn)(grads, state, _placed(params, mesh))


def _hsdp(inner, route):
  return jc.hsdp(inner, fast_axis=FAST, grads=route)


ROUTES = ("shards", "full")


@pytest.mark.parametrize("route", ROUTES)
def test_identity_codec_gives_the_shard_of_the_mean_over_both_axes(mesh, route):
  """Both routes: device (n, f) gets rows f of the mean over all N·L devices of their
  full-size gradients, for every node n."""
  grads = _grads(jax.random.key(0))
  tx = _hsdp(jc.compress(jc.codecs.Identity(), axis_name=SLOW), route)
  out, _ = _run(tx, route, mesh, grads)
  for name, g in grads.items():
    mean = np.asarray(g).mean(0)
    for i in range(N * L):
      got = np.asarray(out[name])[i, 0]
      assert got.shape == (PARAMS[name].shape[0] // L,) + PARAMS[name].shape[1:]
      assert out[name].dtype == g.dtype
      np.testing.assert_allclose(got, _shard(mean, i % L), rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("route", ROUTES)
def test_qsgd_mean_is_unbiased(mesh, route):
  """2-bit QSGD (ternary, the noisiest) between nodes, averaged over T steps of fresh
  keys: every coordinate of every device's shard within 5.5 standard errors of the exact
  mean over both axes (for ~3.6K coordinates per node a false alarm has probability
  about 1.5e-4 per node)."""
  t = 300
  grads = _grads(jax.random.key(1))
  tx = _hsdp(jc.qsgd(bits=2, bucket_size=128, axis_name=SLOW), route)
  out, _ = _run(tx, route, mesh, grads, steps=t)
  for n in range(N):
    zs = []
    for name in ("w", "v"):
      exact = np.asarray(grads[name], np.float64).mean(0)
      for f in range(L):
        draws = np.asarray(out[name], np.float64)[n * L + f].reshape(t, -1)
        se = draws.std(0, ddof=1) / math.sqrt(t)
        assert np.all(se > 0), f"{name}: no randomness between steps"
        zs.append((draws.mean(0) - _shard(exact, f).reshape(-1)) / se)
    z = np.abs(np.concatenate(zs))
    assert z.max() < 5.5, (n, z.max())
  # The bias is sent dense (the filter says so from its shape): exact at every step.
  mean_b = np.asarray(grads["b"]).mean(0)
  for i in range(N * L):
    np.testing.assert_allclose(
      np.asarray(out["b"])[i, -1], _shard(mean_b, i % L), rtol=1e-6, atol=1e-6
    )


def test_nodes_agree_and_devices_draw_their_own_bits(mesh):
  """The slow exchange hands the devices f of every node the same shard of the mean;
  the L devices of a node code different shards with independent keys."""
  grads = _grads(jax.random.key(2))
  tx = _hsdp(jc.qsgd(bits=2, axis_name=SLOW), "full")
  out, state = _run(tx, "full", mesh, grads)
  w = np.asarray(out["w"]).reshape(N, L, -1)
  np.testing.assert_array_equal(w[0], w[1])
  assert isinstance(state, jc.TwoLevelState) and isinstance(state.inner, jc.PerDeviceState)
  data = np.asarray(jax.random.key_data(state.inner.inner.key)).reshape(N, L, -1)
  for node in data:
    assert len({row.tobytes() for row in node}) == L


def _residual_shapes(tx, mesh, params=PARAMS):
  state, _ = _init(tx, mesh, params)
  res = state.inner.inner.residual
  return {k: None if isinstance(v, optax.MaskedNode) else v.shape for k, v in res.items()}


def test_the_filter_judges_the_whole_weight(mesh):
  """The weight "w" (64, 32) has 2048 values: the default filter compresses it although its
  (16, 32) shard has 512; 1-bit SGD's residual is then the shard's, per device. The
  filter is asked about the whole weights' shapes, never the shards'."""
  res = _residual_shapes(_hsdp(jc.onebit_sgd(axis_name=SLOW), "shards"), mesh)
  assert res == {"w": (N * L, 16, 32), "v": (N * L, 8, 40), "b": None}
  seen = []

  def filt(path, leaf):
    seen.append((jax.tree_util.keystr(path), tuple(leaf.shape)))
    return leaf.ndim >= 2

  for route in ROUTES:
    seen.clear()
    _specs(_hsdp(jc.onebit_sgd(axis_name=SLOW, filter=filt), route), mesh)
    assert set(seen) == {("['b']", (12,)), ("['v']", (32, 40)), ("['w']", (64, 32))}


def test_state_specs_place_the_shards_state(mesh):
  """Per-device state of a shard over both axes, an optimizer's moments after it as
  the parameters, P(fast)."""
  inner = _hsdp(jc.onebit_sgd(axis_name=SLOW), "shards")
  assert jc.per_device_state(inner) is inner  # it places its own state
  tx = optax.chain(inner, optax.adam(1e-3))
  specs = _specs(tx, mesh)
  assert specs[0].inner.inner.residual["w"] == P(AXES)
  assert specs[1][0].mu["w"] == P(FAST) and specs[1][0].nu["b"] == P(FAST)


@pytest.mark.parametrize("route", ROUTES)
def test_wire_bytes_split_by_axis(mesh, route):
  """Over the slow axis each device moves one compressed shard from the other node
  (4-bit QSGD on the (256, 1024) shard, all-gathered at N = 2). Over the fast axis:
  nothing for "shards" (fsdp_gather's backward did the reduce-scatter), a dense
  reduce-scatter of the float32 gradient for "full", (L-1)/L of it."""
  params = {"w": jnp.zeros((1024, 1024))}
  tx = _hsdp(jc.qsgd(bits=4, axis_name=SLOW), route)
  report = jc.wire_report(
    tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh, param_specs=P(FAST)
  )
  payload = jc.codecs.QSGD(7, 512, "max").wire_bits((1024 // L, 1024)) / 8
  assert report.by_axis[(SLOW,)] == (N - 1) * payload
  fast = report.by_axis.get((FAST,), 0)
  assert fast == (0 if route == "shards" else (L - 1) / L * 4 * 1024 * 1024)
  # The baseline is dense HSDP: the shard's pmean over the nodes (and the fast
  # reduce-scatter for "full").
  dense = 2 * (N - 1) / N * 4 * 1024 * 1024 / L
  assert report.dense_bytes == dense + fast


def test_onebit_adam_on_shards(mesh):
  """1-bit Adam is the optimizer on the shards: moments once per shard of a node
  (P(fast)), error buffers per device; its warm-up steps (dense exchange) equal
  optax.adam's on the shard of the mean over both axes."""
  freeze = 2
  grads = _grads(jax.random.key(3))
  tx = _hsdp(jc.onebit_adam(1e-2, freeze_step=freeze, axis_name=SLOW), "shards")
  specs = _specs(tx, mesh)
  assert specs.inner[0].m["w"].inner == P(FAST)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    out, state = _run(tx, "shards", mesh, grads, steps=freeze + 1)
    ref = optax.adam(1e-2)
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    ref_state = ref.init(PARAMS)
    for i in range(freeze):
      want, ref_state = ref.update(mean, ref_state)
      for name in PARAMS:
        for d in range(N * L):
          np.testing.assert_allclose(
            np.asarray(out[name])[d, i], _shard(want[name], d % L), rtol=2e-5, atol=1e-6
          )
  assert state.inner[0].m["w"].inner.shape == (L, 16, 32)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(out))


@pytest.mark.parametrize(
  "make",
  [
    lambda: jc.onebit_sgd(axis_name=SLOW),
    lambda: jc.ef_signsgd(axis_name=SLOW),
    lambda: jc.sparsify(density=0.1, axis_name=SLOW),
    lambda: jc.qsgd(bits=4, axis_name=SLOW, collective="two_phase", error_feedback=True),
    lambda: jc.dgc(0.1, momentum=0.0, warmup_steps=0, axis_name=SLOW),
  ],
  ids=["onebit_sgd", "ef_signsgd", "sparsify", "qsgd_two_phase_ef", "dgc"],
)
def test_every_compress_method_runs_on_shards(mesh, make):
  """Two steps (the state round-trips): finite shard updates, the dense bias exact."""
  grads = _grads(jax.random.key(4))
  out, _ = _run(_hsdp(make(), "shards"), "shards", mesh, grads, steps=2)
  assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(out))
  mean_b = np.asarray(grads["b"]).mean(0)
  for i in range(N * L):
    np.testing.assert_allclose(
      np.asarray(out["b"])[i, 1], _shard(mean_b, i % L), rtol=1e-6, atol=1e-6
    )


MLP = {
  "w1": jnp.zeros((16, 32)),
  "b1": jnp.zeros((32,)),
  "w2": jnp.zeros((32, 8)),
  "b2": jnp.zeros((8,)),
}


def _mlp_params():
  k1, k2 = jax.random.split(jax.random.key(5))
  return {
    "w1": jax.random.normal(k1, (16, 32)) / 4,
    "b1": jnp.zeros((32,)),
    "w2": jax.random.normal(k2, (32, 8)) / 6,
    "b2": jnp.zeros((8,)),
  }


def _mlp_loss(p, batch):
  x, y = batch
  logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _mlp_batch(mesh):
  x = jax.random.normal(jax.random.key(6), (16 * N * L, 16))
  y = (x[:, :8].argmax(1)).astype(jnp.int32)  # a learnable rule
  return (x, y), jax.device_put((x, y), NamedSharding(mesh, P(AXES)))


def _train_hsdp(inner, mesh, steps):
  """HSDP: P(fast) shards, fsdp_gather per layer in the forward, jc.hsdp + adam on the
  shards. Returns the whole parameters after ``steps`` steps."""
  tx = optax.chain(jc.hsdp(inner, fast_axis=FAST), optax.adam(3e-2))
  specs = _specs(tx, mesh, MLP)
  params = _placed(_mlp_params(), mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(FAST), out_specs=specs))(params)

  def loss(shards, batch):
    return _mlp_loss({k: jc.fsdp_gather(s, axis_name=FAST) for k, s in shards.items()}, batch)

  def step(shards, state, batch):
    g = jax.grad(loss)(jc.vary(shards, SLOW), batch)  # the shards' node means
    u, state = tx.update(g, state, shards)
    return optax.apply_updates(shards, u), state

  run = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(FAST), specs, P(AXES)), out_specs=(P(FAST), specs))
  )
  _, batch = _mlp_batch(mesh)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    for _ in range(steps):
      params, state = run(params, state, batch)
  return jax.tree.map(np.asarray, params)


def _train_two_level(inner, mesh, steps):
  """The same model replicated, through jc.two_level: the unsharded reference."""
  tx = optax.chain(jc.per_device_state(jc.two_level(inner, fast_axis=FAST)), optax.adam(3e-2))
  specs = jc.state_specs(tx, MLP, axis_name=AXES, num_devices=N * L, mesh=mesh)
  params = _mlp_params()
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def step(params, state, batch):
    g = jax.grad(_mlp_loss)(jc.vary(params, AXES), batch)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  run = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXES)), out_specs=(P(), specs))
  )
  _, batch = _mlp_batch(mesh)
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(steps):
      params, state = run(params, state, batch)
  return jax.tree.map(np.asarray, params)


MATRICES = lambda path, leaf: leaf.ndim >= 2  # the MLP's kernels are small: compress them


def test_hsdp_training_matches_the_unsharded_two_level_run(mesh):
  """Identity codec: HSDP (shards, fsdp_gather, adam on shards) takes the steps of the
  replicated two-level run, to float32 rounding; the loss falls."""
  steps = 8
  identity = lambda: jc.compress(jc.codecs.Identity(), axis_name=SLOW, filter=MATRICES)
  sharded = _train_hsdp(identity(), mesh, steps)
  ref = _train_two_level(identity(), mesh, steps)
  for name in MLP:
    np.testing.assert_allclose(sharded[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
  (x, y), _ = _mlp_batch(mesh)
  before = float(_mlp_loss(_mlp_params(), (x, y)))
  after = float(_mlp_loss(sharded, (x, y)))
  assert after < 0.8 * before, (before, after)


def test_hsdp_training_with_qsgd_lowers_the_loss(mesh):
  (x, y), _ = _mlp_batch(mesh)
  params = _train_hsdp(jc.qsgd(bits=4, axis_name=SLOW, filter=MATRICES), mesh, 8)
  before = float(_mlp_loss(_mlp_params(), (x, y)))
  assert float(_mlp_loss(params, (x, y))) < 0.8 * before


def test_bad_input_is_refused(mesh):
  with pytest.raises(ValueError, match="the slow axis"):
    jc.hsdp(jc.qsgd(axis_name=FAST), fast_axis=FAST)
  with pytest.raises(ValueError, match="the slow axis"):
    jc.hsdp(jc.qsgd(axis_name=AXES), fast_axis=FAST)
  with pytest.raises(ValueError, match="'shards' or 'full'"):
    jc.hsdp(jc.qsgd(axis_name=SLOW), fast_axis=FAST, grads="sharded")
  with pytest.raises(ValueError, match="reduce_scatter"):
    jc.hsdp(jc.qsgd(axis_name=SLOW, collective="reduce_scatter"), fast_axis=FAST)
  with pytest.raises(TypeError, match="jc.hsdp wraps one jaxcomp exchange"):
    jc.hsdp(optax.sgd(0.1), fast_axis=FAST)
  with pytest.raises(NotImplementedError, match="jc.hsdp does not support jc.mipd"):
    jc.hsdp(jc.mipd(axis_name=SLOW), fast_axis=FAST)
  with pytest.raises(NotImplementedError, match="jc.hsdp does not support jc.powersgd"):
    jc.hsdp(jc.powersgd(axis_name=SLOW), fast_axis=FAST)


def test_a_gradient_summed_over_the_nodes_is_refused(mesh):
  """Differentiating the shards without jc.vary(shards, SLOW): JAX sums the gradient
  over the nodes densely (the transpose of the implicit broadcast), which the slow
  exchange exists to replace; the exchange says so."""
  tx = _hsdp(jc.qsgd(axis_name=SLOW), "shards")
  state, specs = _init(tx, mesh)
  grads = jax.device_put(_grads(jax.random.key(7)), NamedSharding(mesh, P(AXES)))

  def step(g, state, shards):
    g = jax.tree.map(lambda x: x[0], g)

    def loss(shards):
      w = jc.fsdp_gather(shards, axis_name=FAST)
      return sum(jnp.vdot(w[k], g[k]) for k in w)

    return tx.update(jax.grad(loss)(shards), state, shards)[0]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(AXES), specs, P(FAST)), out_specs=P(FAST))
  with pytest.raises(ValueError, match="already replicated over axis 'node'"):
    jax.jit(fn)(grads, state, _placed(PARAMS, mesh))


@helpers.NOTHING_COMPRESSED
def test_full_gradient_whose_rows_l_does_not_divide_is_refused(mesh):
  """The "full" route cuts along the first axis into P(fast)'s rows: a gradient of 6
  rows on L = 4 devices has no such shards."""
  tx = _hsdp(jc.qsgd(axis_name=SLOW), "full")
  params = {"w": jnp.zeros((8, 4))}
  state, specs = _init(tx, mesh, params)

  def step(state, shards):
    g = jc.vary({"w": jnp.ones((6, 4))}, AXES)
    return tx.update(g, state, shards)[0]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, P(FAST)), out_specs=P(FAST))
  with pytest.raises(ValueError, match=r"\['w'\] has shape \(6, 4\).*must divide"):
    jax.jit(fn)(state, _placed(params, mesh))


@helpers.NOTHING_COMPRESSED
def test_specs_must_match_the_layout(mesh):
  """param_specs P(fast) without a jc.hsdp, a jc.hsdp with replicated param_specs, and
  a leaf whose first axis L does not divide: clear errors."""
  two = jc.two_level(jc.qsgd(axis_name=SLOW), fast_axis=FAST)
  with pytest.raises(ValueError, match="no jc.hsdp in tx"):
    _specs(two, mesh)
  tx = _hsdp(jc.qsgd(axis_name=SLOW), "shards")
  with pytest.raises(ValueError, match="do not shard"):
    jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  with pytest.raises(ValueError, match="does not divide"):
    _specs(tx, mesh, {"w": jnp.zeros((6, 4))})


def test_guide_snippet_runs_as_written():
  """docs/guides/two_level.md's HSDP example, as written: the loss falls, and its wire
  report has 4-bit shards over the slow axis and no collective over the fast one."""
  import contextlib
  import io
  import re

  from tests import _docs_blocks

  guide = "docs/guides/two_level.md"
  code = _docs_blocks.section_code(guide, "HSDP")
  out, ns = io.StringIO(), {"__name__": "hsdp_guide"}
  # optax.adam raises a float to its int32 count: standard promotion, as users run it.
  with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
    exec(compile(code, guide, "exec"), ns)
    report = jc.wire_report(ns["tx"], ns["params"], **ns["kw"])
  text = out.getvalue()
  before = float(re.search(r"loss before (\S+)", text).group(1))
  after = float(re.search(r"loss after (\S+)", text).group(1))
  assert np.isfinite(after) and after < before, text
  assert set(report.by_axis) == {(SLOW,)} and report.bytes_received > 0
  assert report.bytes_received < report.dense_bytes / 4, text  # 4-bit vs float32 pmean
