"""jc.two_level: dense inside a node, compressed between nodes, on a (2, 4) mesh of the
8 CPU devices (2 nodes of L = 4 devices), under jax.shard_map with check_vma on."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc

SLOW, FAST = "node", "gpu"
AXES = (SLOW, FAST)
N, L = 2, 4


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N, L), AXES)


# A matrix L divides (cut by rows), a matrix it does not (cut from the flattened leaf,
# padded), a bias and a scalar.
PARAMS = {
  "w": jnp.zeros((64, 64)),
  "odd": jnp.zeros((33, 35)),
  "b": jnp.zeros((10,)),
  "s": jnp.zeros(()),
}


def _grads(key, params=PARAMS):
  """One gradient per device: each leaf with a leading axis of N·L, device-major."""
  keys = jax.random.split(key, len(params))
  return {
    name: jax.random.normal(k, (N * L,) + p.shape, p.dtype)
    for k, (name, p) in zip(keys, sorted(params.items()))
  }


def _run(tx, mesh, grads, params=PARAMS, steps=1):
  """``steps`` updates of ``tx`` (held per device) on the same per-device gradients,
  inside shard_map over ``mesh`` (check_vma on): the updates of each step, stacked."""
  specs = jc.state_specs(tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  grads = jax.device_put(grads, NamedSharding(mesh, P(AXES)))

  def run(g, state):
    g = jax.tree.map(lambda x: x[0], g)

    def step(state, _):
      u, state = tx.update(g, state, params)
      return state, u

    state, us = jax.lax.scan(step, state, None, length=steps)
    return us, state

  fn = jax.shard_map(run, mesh=mesh, in_specs=(P(AXES), specs), out_specs=(P(), specs))
  return jax.jit(fn)(grads, state)


def _two_level(inner):
  return jc.per_device_state(jc.two_level(inner, fast_axis=FAST))


def test_identity_codec_equals_the_mean_over_both_axes(mesh):
  grads = _grads(jax.random.key(0))
  tx = _two_level(jc.compress(jc.codecs.Identity(), axis_name=SLOW))
  out, _ = _run(tx, mesh, grads)
  for name, g in grads.items():
    got = out[name][0]
    assert got.shape == PARAMS[name].shape and got.dtype == g.dtype
    np.testing.assert_allclose(got, g.mean(0), rtol=1e-6, atol=1e-6, err_msg=name)


def test_qsgd_mean_is_unbiased(mesh):
  """2-bit QSGD (ternary, the noisiest) averaged over T steps of fresh keys: every
  coordinate's mean within 5.5 standard errors of the exact mean over both axes (for
  ~5.3K coordinates a false alarm has probability about 2e-4)."""
  t = 400
  grads = _grads(jax.random.key(1))
  tx = _two_level(jc.qsgd(bits=2, bucket_size=128, axis_name=SLOW))
  out, _ = _run(tx, mesh, grads, steps=t)
  zs = []
  for name in ("w", "odd"):
    draws = np.asarray(out[name], np.float64).reshape(t, -1)
    exact = np.asarray(grads[name], np.float64).mean(0).reshape(-1)
    se = draws.std(0, ddof=1) / math.sqrt(t)
    assert np.all(se > 0), f"{name}: no randomness between steps"
    zs.append((draws.mean(0) - exact) / se)
  z = np.abs(np.concatenate(zs))
  assert z.max() < 5.5, z.max()
  # The bias is sent dense (the filter says so from its shape): exact at every step.
  np.testing.assert_allclose(out["b"][-1], grads["b"].mean(0), rtol=1e-6, atol=1e-6)


def test_every_device_draws_its_own_bits(mesh):
  """The inner exchange folds the slow-axis index into its key at each step; two_level
  folds the fast one in at init, so the L devices of a node do not code their shards
  with the same random bits: the state's keys differ between a node's devices."""
  tx = _two_level(jc.qsgd(bits=2, axis_name=SLOW))
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)
  data = np.asarray(jax.random.key_data(state.inner.inner.key)).reshape(N, L, -1)
  assert isinstance(state, jc.TwoLevelState) and isinstance(state.inner, jc.PerDeviceState)
  for node in data:
    assert len({row.tobytes() for row in node}) == L


def _residual_sizes(tx, mesh, params=PARAMS):
  specs = jc.state_specs(tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  inner = state.inner  # per_device_state hands two_level back: it places its state
  inner = inner.inner if isinstance(inner, jc.PerDeviceState) else inner  # the flat one's
  residual = inner.residual  # two_level(powersgd) holds its residuals per device itself
  residual = residual.inner if isinstance(residual, jc.PerDeviceState) else residual
  return {k: None if isinstance(v, optax.MaskedNode) else v.shape for k, v in residual.items()}


def test_residuals_are_a_shard_of_each_leaf(mesh):
  """1-bit SGD's error feedback: 1/L of each compressed leaf per device (global arrays
  of N·L rows), against the whole leaf per device for the flat exchange."""
  two = _residual_sizes(_two_level(jc.onebit_sgd(axis_name=SLOW)), mesh)
  flat = _residual_sizes(jc.per_device_state(jc.onebit_sgd(axis_name=AXES)), mesh)
  assert flat["w"] == (N * L, 64, 64) and flat["odd"] == (N * L, 33, 35)
  assert two["w"] == (N * L, 64 // L, 64)  # rows: L divides the first axis
  assert two["odd"] == (N * L, -(-33 * 35 // L))  # flattened and padded
  assert two["b"] is None and two["s"] is None  # dense: no residual


def test_compressed_leaves_are_chosen_from_the_whole_leaf(mesh):
  """A (32, 40) matrix has 1280 values and 2 dimensions: the default filter compresses
  it. Its shard (8, 40) has 320, and the flat shard of (33, 35) is 1-D: asked about the
  shards, the filter would send both dense, silently."""
  params = {"m": jnp.zeros((32, 40)), "odd": jnp.zeros((33, 35)), "b": jnp.zeros((64,))}
  res = _residual_sizes(_two_level(jc.onebit_sgd(axis_name=SLOW)), mesh, params)
  assert res["m"] == (N * L, 8, 40) and res["odd"] == (N * L, 289)
  assert res["b"] is None
  seen = []

  def filt(path, leaf):
    seen.append((jax.tree_util.keystr(path), tuple(leaf.shape)))
    return leaf.ndim >= 2

  tx = _two_level(jc.onebit_sgd(axis_name=SLOW, filter=filt))
  jc.state_specs(tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh)
  assert set(seen) == {("['b']", (64,)), ("['m']", (32, 40)), ("['odd']", (33, 35))}


def test_onebit_sgd_trains_to_the_mean_with_error_feedback(mesh):
  """Error feedback over the slow axis on shards: the average of T one-bit updates
  approaches the exact mean (the residual carries what each step dropped), at the
  O(1/T) rate of a bounded residual."""
  t = 64
  grads = _grads(jax.random.key(2), {"w": PARAMS["w"]})
  out, _ = _run(_two_level(jc.onebit_sgd(axis_name=SLOW)), mesh, grads, {"w": PARAMS["w"]}, t)
  exact = np.asarray(grads["w"]).mean(0)
  one = np.abs(np.asarray(out["w"][0]) - exact).mean()
  avg = np.abs(np.asarray(out["w"]).mean(0) - exact).mean()
  assert avg < one / 10, (avg, one)


def test_wire_bytes_split_by_axis(mesh):
  """Over the slow axis each device moves one compressed shard per other node (4-bit
  QSGD on a shard of 1/L of the leaf, all-gathered at N = 2); over the fast axis a dense
  reduce-scatter and all-gather of the float32 leaf. The flat exchange over all N·L
  devices moves L times more per device than the slow axis carries here, or more."""
  params = {"w": jnp.zeros((1024, 1024))}
  n = 1024 * 1024
  two = jc.wire_report(
    _two_level(jc.qsgd(bits=4, axis_name=SLOW)), params, axis_name=AXES, num_devices=8, mesh=mesh
  )
  shard_payload = jc.codecs.QSGD(7, 512, "max").wire_bits((1024 // L, 1024)) / 8
  assert two.by_axis[(SLOW,)] == (N - 1) * shard_payload
  assert two.by_axis[(FAST,)] == 2 * (L - 1) / L * 4 * n
  flat = jc.wire_report(
    jc.per_device_state(jc.qsgd(bits=4, axis_name=AXES)),
    params,
    axis_name=AXES,
    num_devices=8,
    mesh=mesh,
  )
  assert set(flat.by_axis) == {tuple(sorted(AXES))}
  assert L * two.by_axis[(SLOW,)] <= flat.bytes_received
  assert f"over {SLOW}" in str(two) and f"over {FAST}" in str(two)


def test_state_specs_need_the_mesh_sizes(mesh):
  tx = _two_level(jc.qsgd(axis_name=SLOW))
  with pytest.raises(ValueError, match="num_devices=4 but the mesh's axes"):
    jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=4, mesh=mesh)
  with pytest.raises(ValueError, match="mesh="):
    jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=8)


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: jc.mipd(axis_name=SLOW), "jc.mipd"),
  ],
)
def test_methods_not_supported_yet_say_so(make, match):
  with pytest.raises(NotImplementedError, match=match):
    jc.two_level(make(), fast_axis=FAST)


def test_onebit_adam_holds_its_state_per_shard(mesh):
  """1-bit Adam inside two_level: its moments are 1/L of each leaf, held once per shard
  of a node (P(fast), replicated over the slow axis), its error buffers per device.
  During the warm-up (dense exchange, plain Adam) its updates equal optax.adam's on the
  mean over both axes to float32 rounding; after it, the frozen-variance steps with the
  1-bit momentum exchange stay finite and the moments keep their shapes."""
  freeze, steps = 3, 6
  grads = _grads(jax.random.key(4))
  tx = jc.two_level(jc.onebit_adam(1e-2, freeze_step=freeze, axis_name=SLOW), fast_axis=FAST)
  assert jc.per_device_state(tx) is tx
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  core = specs.inner[0]
  assert isinstance(core.m["w"], jc.NodeShardState) and core.m["w"].inner == P(FAST)
  assert core.worker_error.inner["w"] == P(AXES)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam: float ** int32 count
    out, state = _run(tx, mesh, grads, steps=steps)
    ref, mean = optax.adam(1e-2), jax.tree.map(lambda g: g.mean(0), grads)
    ref_state = ref.init(PARAMS)
    for i in range(freeze):
      want, ref_state = ref.update(mean, ref_state)
      for name in PARAMS:
        np.testing.assert_allclose(out[name][i], want[name], rtol=2e-5, atol=1e-6)
    want, _ = ref.update(mean, ref_state)  # Adam's step where 1-bit Adam's freezes
  m = state.inner[0].m
  assert m["w"].inner.shape == (L, 64 // L, 64) and m["odd"].inner.shape == (L, 289)
  assert state.inner[0].worker_error.inner["w"].shape == (N * L, 64 // L, 64)
  assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(out))
  # The frozen-variance steps compress: they are not Adam's dense steps any more.
  assert not np.allclose(out["w"][freeze], want["w"], rtol=1e-3)


def test_dgc_at_full_density_is_the_mean(mesh):
  """DGC at density 1 without momentum sends all of every shard's accumulated
  gradient: the mean over both axes, at every step (nothing accumulates)."""
  grads = _grads(jax.random.key(8))
  out, _ = _run(_two_level(jc.dgc(1.0, 0.0, axis_name=SLOW)), mesh, grads, steps=2)
  for name, g in grads.items():
    for step in range(2):
      np.testing.assert_allclose(out[name][step], g.mean(0), rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("clip", ["global", "per_tensor"])
def test_dgc_clips_the_node_gradient_by_its_whole_norm(mesh, clip):
  """DGC's local clipping with the node as its worker: each node's mean gradient is
  clipped at clip_norm / sqrt(N) by the norm of the whole gradient (global) or of each
  whole leaf (per_tensor), the squares summed over the node's shards (the padding adds
  nothing). At density 1 without momentum the result is the mean of the clipped node
  means; the threshold sits between the node norms so that one node is clipped and the
  other is not, and a per-shard norm would clip differently."""
  grads = _grads(jax.random.key(11))
  grads = {
    k: g * jnp.repeat(jnp.asarray([1.0, 0.05]), L).reshape((-1,) + (1,) * (g.ndim - 1))
    for k, g in grads.items()
  }
  nodes = {
    k: np.asarray(g, np.float64).reshape((N, L) + g.shape[1:]).mean(1) for k, g in grads.items()
  }
  if clip == "global":
    norms = np.sqrt(sum(np.sum(v.reshape(N, -1) ** 2, 1) for v in nodes.values()))
    clip_norm = float(norms.mean()) * math.sqrt(N)
    thr = clip_norm / math.sqrt(N)
    assert norms.max() > thr > norms.min()
    scale = {k: np.minimum(1.0, thr / norms) for k in nodes}
  else:
    leaf = {k: np.sqrt(np.sum(v.reshape(N, -1) ** 2, 1)) for k, v in nodes.items()}
    clip_norm = float(leaf["w"].mean()) * math.sqrt(N)
    thr = clip_norm / math.sqrt(N)
    assert leaf["w"].max() > thr > leaf["w"].min()
    scale = {k: np.minimum(1.0, thr / np.where(n > 0, n, 1.0)) for k, n in leaf.items()}
  tx = _two_level(jc.dgc(1.0, 0.0, axis_name=SLOW, clip_norm=clip_norm, clip=clip))
  out, _ = _run(tx, mesh, grads)
  for name, v in nodes.items():
    want = (v * scale[name].reshape((N,) + (1,) * (v.ndim - 1))).mean(0)
    np.testing.assert_allclose(out[name][0], want, rtol=1e-5, atol=1e-6, err_msg=name)


def _dgc_reference(grads, density, m, steps):
  """DGC with the node as its worker, in float64: each node's mean gradient, cut into L
  shards as two_level cuts them; per shard momentum correction ``u = m u + g``,
  ``v += u``, the top ``ceil(density · shard size)`` of ``|v|`` sent and zeroed in ``v``
  and ``u``; the result the mean over nodes of what was sent, reassembled. Dense leaves:
  momentum SGD on the node means, averaged. Every step's updates."""
  out = {name: [] for name in grads}
  for name, g in grads.items():
    g = np.asarray(g, np.float64).reshape((N, L) + g.shape[1:]).mean(1)  # node means
    n = math.prod(g.shape[1:])
    rows = g.shape[1] % L == 0 if g.ndim > 1 else False
    size = n // L if rows else -(-n // L)
    flat = np.zeros((N, L * size))
    flat[:, :n] = g.reshape(N, -1)
    shards = flat.reshape(N, L, size)
    compressed = g.ndim >= 2 and n >= 1024  # the default filter, on the whole leaf
    u, v = np.zeros_like(shards), np.zeros_like(shards)
    for _ in range(steps):
      u = m * u + shards
      if not compressed:
        out[name].append(u.reshape(N, -1)[:, :n].mean(0).reshape(g.shape[1:]))
        continue
      v = v + u
      k = math.ceil(density * size)
      sent = np.zeros_like(v)
      for i in range(N):
        for j in range(L):
          idx = np.argsort(-np.abs(v[i, j]))[:k]
          sent[i, j, idx] = v[i, j, idx]
          v[i, j, idx] = 0.0
          u[i, j, idx] = 0.0
      out[name].append(sent.reshape(N, -1)[:, :n].mean(0).reshape(g.shape[1:]))
  return out


def test_dgc_runs_on_each_shard_with_the_node_as_worker(mesh):
  """DGC inside two_level follows the float64 reference of DGC run by each node on its
  mean gradient, shard by shard (top-k per shard at the same density: blockwise), with
  momentum correction and masking, over 4 steps; the dense leaves get momentum SGD."""
  density, m, steps = 1 / 64, 0.9, 4
  grads = _grads(jax.random.key(9))
  tx = _two_level(jc.dgc(density, m, axis_name=SLOW, collective="allgather"))
  out, _ = _run(tx, mesh, grads, steps=steps)
  want = _dgc_reference(grads, density, m, steps)
  for name in grads:
    for t in range(steps):
      np.testing.assert_allclose(out[name][t], want[name][t], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("warmup", [0, 8])
def test_dgc_sends_density_of_each_leaf_per_node(mesh, warmup):
  """Each device sends the top ``density`` of its shard (during the warm-up, its first
  stage's 25%): the entries it zeroed in its velocity after one step (momentum 0: v is
  the shard of the node's mean gradient, no zeros) add up over a node's L devices to
  the density × the leaf's size. Over the slow axis each device receives the other
  node's payload of its shard (after the warm-up). The state is 1/L of each leaf per
  device, its step count advanced on every device."""
  density = 1 / 64
  params = {"w": PARAMS["w"]}
  grads = _grads(jax.random.key(10), params)
  tx = _two_level(jc.dgc(density, 0.0, axis_name=SLOW, collective="allgather", warmup_steps=warmup))
  _, state = _run(tx, mesh, grads, params)
  dgc_state = state.inner.inner
  assert dgc_state.velocity["w"].shape == (N * L, 64 // L, 64)
  assert dgc_state.momentum["w"].shape == (N * L, 64 // L, 64)
  np.testing.assert_array_equal(dgc_state.count, [1] * (N * L))
  sent = density if warmup == 0 else 0.25
  zeros = (np.asarray(dgc_state.velocity["w"]) == 0).reshape(N, L, -1).sum(-1)
  np.testing.assert_array_equal(zeros.sum(1), [sent * 64 * 64] * N)
  if warmup == 0:
    report = jc.wire_report(tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh)
    shard_payload = jc.codecs.TopK(density).wire_bits((64 // L, 64)) / 8
    assert report.by_axis[(SLOW,)] == (N - 1) * shard_payload


def test_dgc_accumulates_what_it_did_not_send(mesh):
  """Local accumulation on shards: nothing is lost, only delayed. Without momentum the
  sum of T updates is T times the mean minus the nodes' mean unsent velocity, so their
  average approaches the exact mean as the velocity stays bounded."""
  t = 128
  grads = _grads(jax.random.key(11), {"w": PARAMS["w"]})
  tx = _two_level(jc.dgc(1 / 16, 0.0, axis_name=SLOW, collective="allgather"))
  out, state = _run(tx, mesh, grads, {"w": PARAMS["w"]}, t)
  exact = np.asarray(grads["w"]).mean(0)
  v = np.asarray(state.inner.inner.velocity["w"]).reshape(N, L, -1).mean(0).reshape(64, 64)
  np.testing.assert_allclose(
    np.asarray(out["w"], np.float64).sum(0), t * exact - v, rtol=0, atol=1e-3
  )
  one = np.abs(np.asarray(out["w"][0]) - exact).mean()
  avg = np.abs(np.asarray(out["w"]).mean(0) - exact).mean()
  assert avg < one / 10, (avg, one)


def test_refuses_what_it_cannot_wrap():
  with pytest.raises(TypeError, match="not a chain"):
    jc.two_level(optax.chain(jc.qsgd(axis_name=SLOW), optax.sgd(0.1)), fast_axis=FAST)
  with pytest.raises(TypeError, match="not a chain"):
    jc.two_level(optax.sgd(0.1), fast_axis=FAST)
  with pytest.raises(ValueError, match="reduce_scatter"):
    jc.two_level(jc.qsgd(axis_name=SLOW, collective="reduce_scatter"), fast_axis=FAST)
  for axis in (FAST, None, AXES):
    with pytest.raises(ValueError, match="the slow axis"):
      jc.two_level(jc.qsgd(axis_name=axis), fast_axis=FAST)


def test_replicated_gradient_is_refused(mesh):
  """A gradient already summed over the fast axis (jax.grad w.r.t. parameters not
  marked varying over it) is refused, as every exchange refuses one."""
  tx = _two_level(jc.qsgd(axis_name=SLOW))
  specs = jc.state_specs(tx, PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

  def step(state):
    g = jc.vary(PARAMS, SLOW)  # varying over the slow axis only
    return tx.update(g, state)[0]

  with pytest.raises(ValueError, match="already replicated over axis 'gpu'"):
    jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs,), out_specs=P()))(state)


def test_needs_the_fast_axis_bound():
  """jax.pmap maps one axis (and does not nest in this jax): a two-level exchange needs
  jax.shard_map over a 2-D mesh, and says which axis is missing."""
  tx = jc.two_level(jc.qsgd(axis_name=SLOW), fast_axis=FAST)
  params = jax.tree.map(lambda p: jnp.broadcast_to(p, (N * L,) + p.shape), PARAMS)
  with pytest.raises(ValueError, match="axis_name='gpu' is not bound"):
    jax.pmap(tx.init, axis_name=SLOW)(params)


@pytest.mark.parametrize("exchange", [None, "jc.powersgd(2, axis_name=SLOW)"])
def test_guide_snippet_runs_as_written(exchange):
  """docs/guides/two_level.md's example, as written (and with jc.powersgd(2) in place of
  QSGD): it trains, and its wire report splits the bytes over the two axes."""
  import contextlib
  import io
  import re

  from tests import _docs_blocks

  guide = "docs/guides/two_level.md"
  code = _docs_blocks.section_code(guide, "Use")
  if exchange is not None:
    old = "jc.qsgd(bits=4, axis_name=SLOW)"
    assert old in code
    code = code.replace(old, exchange)
  out = io.StringIO()
  # optax.adam raises a float to its int32 count: standard promotion, as users run it.
  with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
    exec(compile(code, guide, "exec"), {"__name__": "two_level_guide"})
  text = out.getvalue()
  loss = float(re.search(r"loss (\S+)", text).group(1))
  assert np.isfinite(loss) and loss < math.log(10), text
  assert "over node:" in text and "over gpu:" in text, text


def test_link_model_prices_each_collective_at_its_axis(mesh):
  """jc.network.exchange_time prices a two-level report's collectives at their own
  axes' devices: the slow all-gather at N = 2 (one round), the fast ones at L = 4."""
  params = {"w": jnp.zeros((1024, 1024))}
  report = jc.wire_report(
    _two_level(jc.qsgd(bits=4, axis_name=SLOW)), params, axis_name=AXES, num_devices=8, mesh=mesh
  )
  assert {op.axes: op.devices for op in report.ops} == {(SLOW,): N, (FAST,): L}
  link = jc.network.Link(latency_s=1e-3, bandwidth=1e9)
  want = sum(
    link.collective_time(op.primitive, op.operand_bytes, N if op.axes == (SLOW,) else L)
    for op in report.ops
  )
  assert jc.network.exchange_time(report, link) == pytest.approx(want, rel=1e-12)


def test_a_nonfinite_gradient_is_visible_on_every_device(mesh):
  """One device's NaN reaches the mean on every device (through its node's
  reduce-scatter, then the slow exchange and the gather). It is counted where the input
  was non-finite, as a flat exchange counts it on the device whose gradient was: here
  the exchange's input is the node's mean, so on every device of that node."""
  grads = _grads(jax.random.key(5))
  grads["w"] = grads["w"].at[5, 3, 7].set(jnp.nan)  # device 5: node 1, its device 1
  tx = _two_level(jc.onebit_sgd(axis_name=SLOW))
  out, state = _run(tx, mesh, grads)
  assert not np.all(np.isfinite(out["w"][0]))
  np.testing.assert_allclose(out["b"][0], grads["b"].mean(0), rtol=1e-6, atol=1e-6)
  counts = np.asarray(state.inner.inner.nonfinite_count).reshape(N, L)
  np.testing.assert_array_equal(counts, [[0] * L, [1] * L])


@pytest.mark.parametrize(
  "make",
  [
    lambda: jc.ef_signsgd(axis_name=SLOW),
    lambda: jc.sparsify(density=0.1, axis_name=SLOW),
    lambda: jc.qsgd(bits=4, axis_name=SLOW, collective="two_phase", error_feedback=True),
    lambda: jc.compress(jc.codecs.RandomK(0.1, shared=True), axis_name=SLOW),
    lambda: jc.dgc(1 / 16, 0.0, axis_name=SLOW, collective="chunked", chunk_size=64),
    lambda: jc.dgc(1 / 16, 0.0, axis_name=SLOW, warmup_steps=1, nesterov=True),
  ],
  ids=[
    "ef_signsgd",
    "sparsify",
    "qsgd_two_phase_ef",
    "randomk_shared_psum",
    "dgc_chunked",
    "dgc_warmup_nesterov",
  ],
)
def test_every_compress_method_runs_on_shards(mesh, make):
  """The jc.compress family and DGC (momentum 0) under two_level: whole, finite means
  of the original shapes, the dense leaves exact; two steps, so the state round-trips
  (DGC's warm-up crosses from one stage's branch to the next)."""
  grads = _grads(jax.random.key(6))
  out, _ = _run(_two_level(make()), mesh, grads, steps=2)
  for name, g in grads.items():
    assert out[name].shape == (2,) + g.shape[1:]
    assert np.all(np.isfinite(out[name])), name
  for name in ("b", "s"):
    np.testing.assert_allclose(out[name][1], grads[name].mean(0), rtol=1e-6, atol=1e-6)


def test_bfloat16_leaves_keep_their_dtype(mesh):
  """A bfloat16 model: the node's reduce-scatter sums in bfloat16 (as lax.pmean would),
  the result has the leaves' dtype and the mean to bfloat16 rounding (8 bits: a few
  units of 2^-8 relative to the largest summand)."""
  params = {"w": jnp.zeros((64, 64), jnp.bfloat16), "b": jnp.zeros((10,), jnp.bfloat16)}
  grads = _grads(jax.random.key(7), params)
  out, _ = _run(_two_level(jc.compress(jc.codecs.Identity(), axis_name=SLOW)), mesh, grads, params)
  for name, g in grads.items():
    assert out[name].dtype == jnp.bfloat16
    exact = np.asarray(g, np.float32).mean(0)
    scale = np.abs(np.asarray(g, np.float32)).max()
    np.testing.assert_allclose(np.asarray(out[name][0], np.float32), exact, atol=8 * 2**-8 * scale)


# ----------------------------------------------------------------------------- PowerSGD
# jc.powersgd under jc.two_level runs its own schedule: the rows of each matrix split
# over the devices of a node, flat PowerSGD over the slow axis of the node means.

# Rows L divides, rows it does not (33; 30 or 6 for the 3-D leaf, by matrix view), a
# matrix the filter leaves out by its path, a bias and a scalar (dense).
PSGD_PARAMS = {
  "w": jnp.zeros((64, 48)),
  "odd": jnp.zeros((33, 35)),
  "k3": jnp.zeros((6, 5, 12)),
  "skip": jnp.zeros((16, 16)),
  "b": jnp.zeros((10,)),
  "s": jnp.zeros(()),
}


def _psgd_filter(path, leaf):
  return leaf.ndim >= 2 and "skip" not in jax.tree_util.keystr(path)


def _psgd(axis_name, **kw):
  return jc.powersgd(2, axis_name=axis_name, filter=_psgd_filter, **kw)


def _steps(tx, mesh, axes, grads, params):
  """``tx`` (held per device) over T steps inside shard_map over ``mesh`` (check_vma
  on), step t on ``grads[t]`` (each leaf ``(T, devices, *shape)``, device-major): the
  updates of each step, stacked, and the last state."""
  specs = jc.state_specs(tx, params, axis_name=axes, num_devices=mesh.size, mesh=mesh)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  grads = jax.device_put(grads, NamedSharding(mesh, P(None, axes)))

  def run(g, state):
    def step(state, g_t):
      u, state = tx.update(g_t, state, params)
      return state, u

    state, us = jax.lax.scan(step, state, jax.tree.map(lambda x: x[:, 0], g))
    return us, state

  fn = jax.shard_map(run, mesh=mesh, in_specs=(P(None, axes), specs), out_specs=(P(), specs))
  return jax.jit(fn)(grads, state)


def _step_grads(key, t, params):
  """T steps of per-device gradients, each leaf ``(T, N·L, *shape)``."""
  keys = jax.random.split(key, len(params))
  return {
    name: jax.random.normal(k, (t, N * L) + p.shape, p.dtype)
    for k, (name, p) in zip(keys, sorted(params.items()))
  }


def _node_means(grads):
  return {k: g.reshape(g.shape[:1] + (N, L) + g.shape[2:]).mean(2) for k, g in grads.items()}


@pytest.mark.parametrize(
  "view, options",
  [("last", {}), ("first", {}), ("last", {"error_feedback": False, "warm_start": False})],
  ids=["last", "first", "no_feedback_fresh_q"],
)
def test_powersgd_equals_flat_powersgd_of_the_node_means(mesh, view, options):
  """two_level(powersgd) on (2, 4) computes flat PowerSGD on 2 devices fed the node
  means: the same updates at every step (warm start and error feedback carried over 4
  steps of different gradients), the same Q, and each node's residual the devices'
  row blocks stacked, to float32 rounding (the sums over rows and over devices are
  taken in another order); without them, the same fresh Q drawn from the shared key."""
  t = 4
  grads = _step_grads(jax.random.key(8), t, PSGD_PARAMS)
  two_tx = _two_level(_psgd(SLOW, matrix_view=view, **options))
  out, state = _steps(two_tx, mesh, AXES, grads, PSGD_PARAMS)
  flat_mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), (SLOW,))
  flat_tx = jc.per_device_state(_psgd(SLOW, matrix_view=view, **options))
  want, flat_state = _steps(flat_tx, flat_mesh, SLOW, _node_means(grads), PSGD_PARAMS)
  for name in PSGD_PARAMS:
    assert out[name].shape == want[name].shape and out[name].dtype == want[name].dtype
    np.testing.assert_allclose(out[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
  inner, flat_inner = state.inner, flat_state.inner
  for name in ("w", "odd", "k3") if not options else ():
    np.testing.assert_allclose(inner.q[name], flat_inner.q[name][0], rtol=1e-4, atol=1e-5)
    e = np.asarray(flat_inner.residual[name])  # (N, *leaf shape): one per node
    rows = np.asarray(inner.residual.inner[name])  # (N·L, ceil(m/L), n): one per device
    whole = rows.reshape(N, -1, rows.shape[-1])[:, : e.size // (N * rows.shape[-1])]
    np.testing.assert_allclose(whole.reshape(e.shape), e, rtol=1e-4, atol=1e-5, err_msg=name)
  for name in ("skip", "b", "s"):  # dense: the exact mean over both axes
    assert isinstance(inner.residual.inner[name], optax.MaskedNode)
    assert isinstance(inner.q[name], optax.MaskedNode)
    np.testing.assert_allclose(out[name], grads[name].mean(1), rtol=1e-6, atol=1e-6)
  # Not the mean: rank 2 of a random 64 x 48 matrix drops most of it.
  assert not np.allclose(out["w"][0], grads["w"][0].mean(0), atol=1e-2)


def test_powersgd_nonfinite_step_as_flat_powersgd(mesh):
  """A NaN on one device at step 1 of 3 (device 5: node 1) reaches the update on every
  device, Q keeps its value, node 1's devices keep their residual rows and the other
  node's carry their whole M forward, and the next steps go on from there: all as flat
  PowerSGD does with node 1's mean non-finite. The step is counted on node 1's devices."""
  grads = _step_grads(jax.random.key(10), 3, PSGD_PARAMS)
  grads["w"] = grads["w"].at[1, 5, 3, 7].set(jnp.nan)
  out, state = _steps(_two_level(_psgd(SLOW)), mesh, AXES, grads, PSGD_PARAMS)
  flat_mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), (SLOW,))
  flat_tx = jc.per_device_state(_psgd(SLOW))
  want, flat_state = _steps(flat_tx, flat_mesh, SLOW, _node_means(grads), PSGD_PARAMS)
  assert not np.any(np.isfinite(out["w"][1])) and np.all(np.isfinite(out["w"][2]))
  for name in PSGD_PARAMS:
    np.testing.assert_allclose(out[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
  counts = np.asarray(state.inner.nonfinite_count.inner).reshape(N, L)
  np.testing.assert_array_equal(counts, [[0] * L, [1] * L])
  np.testing.assert_array_equal(flat_state.inner.nonfinite_count, [0, 1])


def test_powersgd_asks_the_filter_about_whole_leaves(mesh):
  """The filter sees each matrix's whole shape, as without jc.two_level (no shard of
  it is ever built to be asked about)."""
  seen = []

  def filt(path, leaf):
    seen.append((jax.tree_util.keystr(path), tuple(leaf.shape)))
    return _psgd_filter(path, leaf)

  tx = _two_level(jc.powersgd(axis_name=SLOW, filter=filt))
  grads = _step_grads(jax.random.key(9), 1, PSGD_PARAMS)
  _steps(tx, mesh, AXES, grads, PSGD_PARAMS)
  # PowerSGD asks about leaves of rank >= 2 only (it sends vectors dense), whole.
  want = {(f"['{k}']", tuple(p.shape)) for k, p in PSGD_PARAMS.items() if p.ndim >= 2}
  assert set(seen) == want


def test_powersgd_residuals_are_row_blocks(mesh):
  """Per device 1/L of flat PowerSGD's residuals (ceil(m/L) rows of each matrix view);
  Q, the same on every device of every node, is held once (replicated, P())."""
  tx = _two_level(_psgd(SLOW))
  specs = jc.state_specs(tx, PSGD_PARAMS, axis_name=AXES, num_devices=N * L, mesh=mesh)
  assert isinstance(specs, jc.TwoLevelState)
  assert specs.inner.q["w"] == P() and specs.inner.residual.inner["w"] == P(AXES)
  two = _residual_sizes(tx, mesh, PSGD_PARAMS)
  flat = _residual_sizes(jc.per_device_state(_psgd(AXES)), mesh, PSGD_PARAMS)
  assert flat["w"] == (N * L, 64, 48) and two["w"] == (N * L, 64 // L, 48)
  assert flat["odd"] == (N * L, 33, 35) and two["odd"] == (N * L, -(-33 // L), 35)
  assert two["k3"] == (N * L, -(-30 // L), 12)  # the (30, 12) matrix view, padded
  assert two["skip"] is None and two["b"] is None and two["s"] is None
  per_device = {k: math.prod(v[1:]) for k, v in two.items() if v}
  flat_per_device = {k: math.prod(v[1:]) for k, v in flat.items() if v}
  assert per_device["w"] * L == flat_per_device["w"]
  assert sum(per_device.values()) * L <= sum(flat_per_device.values()) + L * 35 + L * 12


def test_powersgd_wire_bytes_split_by_axis(mesh):
  """Over the slow axis each device all-reduces its rows of P (m/L × r) and its slice
  of Q (n/L × r), 1/L of flat PowerSGD's P and Q over the slow axis of the node means;
  the flat exchange over all N·L devices sends more than L times that per device."""
  m, n, r = 1024, 512, 4
  params = {"w": jnp.zeros((m, n))}
  two = jc.wire_report(
    _two_level(jc.powersgd(r, axis_name=SLOW)), params, axis_name=AXES, num_devices=8, mesh=mesh
  )
  psum = 2 * (N - 1) / N  # an all-reduce's bytes per byte of operand
  assert two.by_axis[(SLOW,)] == psum * 4 * r * (m + n) / L
  flat_mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), (SLOW,))
  node_flat = jc.wire_report(
    jc.per_device_state(jc.powersgd(r, axis_name=SLOW)),
    params,
    axis_name=SLOW,
    num_devices=N,
    mesh=flat_mesh,
  )
  assert node_flat.bytes_received == L * two.by_axis[(SLOW,)]
  flat = jc.wire_report(
    jc.per_device_state(jc.powersgd(r, axis_name=AXES)),
    params,
    axis_name=AXES,
    num_devices=8,
    mesh=mesh,
  )
  assert L * two.by_axis[(SLOW,)] < flat.bytes_received
  # Over the fast axis (each (L-1)/L of the whole operand): the dense reduce-scatter of
  # the gradient, the P blocks gathered, Q reduce-scattered and gathered; and an
  # all-reduce of two int32 flags (the matrix's and the dense leaves' finiteness).
  fast = (L - 1) / L * 4 * (m * n + r * m + 2 * r * n) + 2 * (L - 1) / L * 4 * 2
  assert two.by_axis[(FAST,)] == pytest.approx(fast, rel=1e-12)


def test_powersgd_bfloat16_leaves_keep_their_dtype(mesh):
  """A bfloat16 model: the updates have the leaves' dtype (the node's mean is taken in
  bfloat16, as lax.pmean would; P, Q and the residuals are float32, as flat PowerSGD's)."""
  params = {"w": jnp.zeros((64, 48), jnp.bfloat16), "b": jnp.zeros((10,), jnp.bfloat16)}
  grads = _step_grads(jax.random.key(11), 2, params)
  out, state = _steps(_two_level(_psgd(SLOW)), mesh, AXES, grads, params)
  assert out["w"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(out["w"], np.float32)))
  assert state.inner.residual.inner["w"].dtype == jnp.float32
  assert state.inner.q["w"].dtype == jnp.float32
