"""jc.dgc: the four techniques of Deep Gradient Compression, exchanges and wire bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs import sparse
from jaxcomp._src.methods import dgc as dgc_lib
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

SHAPES = {"w": (64, 48), "b": (48,)}
PARAMS = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}


def _run_sharded(tx, steps, seed=0):
  """Per-step updates of tx (a chain with a per-device dgc) on 8 devices."""
  m = helpers.mesh()
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  outs, grads = [], []
  for t in range(steps):
    g = helpers.per_device_grads(jax.random.key(seed + t), SHAPES)
    u, state = update(helpers.shard(g, m), state)
    outs.append(jax.tree.map(np.asarray, u))
    grads.append(jax.tree.map(lambda x: np.asarray(x).mean(0), g))
  return outs, grads, state


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("collective", ["allgather", "chunked"])
def test_density_one_is_momentum_sgd(nesterov, collective):
  dgc = jc.dgc(
    1.0,
    0.9,
    nesterov=nesterov,
    momentum_masking=False,
    method="exact",
    axis_name=AXIS,
    collective=collective,
    chunk_size=64,
  )
  tx = optax.chain(jc.per_device_state(dgc), optax.sgd(0.1))
  outs, grads, _ = _run_sharded(tx, 6)
  ref = optax.sgd(0.1, momentum=0.9, nesterov=nesterov)
  rs = ref.init(PARAMS)
  for u, g in zip(outs, grads):
    r, rs = ref.update(g, rs)
    for name in SHAPES:
      np.testing.assert_allclose(u[name], r[name], rtol=1e-5, atol=1e-6)


def test_density_one_with_masking_is_plain_sgd():
  # Everything is sent every step, so masking zeroes all of the momentum.
  dgc = jc.dgc(1.0, 0.9, method="exact", axis_name=AXIS, collective="allgather")
  outs, grads, _ = _run_sharded(optax.chain(jc.per_device_state(dgc), optax.sgd(0.1)), 4)
  for u, g in zip(outs[1:], grads[1:]):
    np.testing.assert_allclose(u["w"], -0.1 * g["w"], rtol=1e-5, atol=1e-6)
    # The dense leaf keeps dense momentum SGD (masking concerns sent entries only).
  assert not np.allclose(outs[1]["b"], -0.1 * grads[1]["b"], atol=1e-4)


def _local_step(tx, grads, state):
  return jax.jit(tx.update)(grads, state)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("masking", [False, True])
def test_residual_conservation_and_masking(nesterov, masking):
  tx = jc.dgc(
    0.02, 0.9, nesterov=nesterov, momentum_masking=masking, method="exact", axis_name=None
  )
  state = tx.init(PARAMS)
  for t in range(4):
    g = {
      n: jax.random.normal(jax.random.key(t * 7 + i), s)
      for i, (n, s) in enumerate(sorted(SHAPES.items()))
    }
    u0, v0 = state.momentum["w"], state.velocity["w"]
    out, state = _local_step(tx, g, state)
    u_new = 0.9 * (u0 + g["w"]) if nesterov else 0.9 * u0 + g["w"]
    v_in = v0 + u_new + (g["w"] if nesterov else 0.0)
    sent = np.asarray(out["w"])
    # What was sent plus what is held equals what came in, exactly.
    np.testing.assert_allclose(sent + np.asarray(state.velocity["w"]), v_in, rtol=1e-6, atol=1e-6)
    mask = sent != 0
    assert mask.sum() == sparse.num_entries(0.02, 64 * 48)
    assert np.all(np.asarray(state.velocity["w"])[mask] == 0)
    want_u = np.where(mask, 0.0, u_new) if masking else u_new
    np.testing.assert_allclose(state.momentum["w"], want_u, rtol=1e-6, atol=1e-6)
    # The sent entries are the largest of the accumulated velocity.
    assert np.min(np.abs(v_in[mask])) >= np.max(np.abs(np.asarray(v_in)[~mask]))


def test_warmup_schedule_and_sent_counts():
  sched = jc.dgc_density_schedule(0.001, warmup_steps=8)
  np.testing.assert_allclose(
    [float(sched(s)) for s in range(10)],
    [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001],
    rtol=1e-7,
  )
  assert jc.dgc_density_schedule(0.3, warmup_steps=8)(0) == pytest.approx(0.3)
  assert float(jc.dgc_density_schedule(0.01, 0)(0)) == pytest.approx(0.01)
  tx = jc.dgc(0.001, 0.9, warmup_steps=8, method="exact", axis_name=None)
  state = tx.init(PARAMS)
  n = 64 * 48
  for t in range(10):
    g = {"w": jax.random.normal(jax.random.key(t), (64, 48)), "b": jnp.ones(48)}
    out, state = _local_step(tx, g, state)
    density = [0.25, 0.0625, 0.015625, 0.00390625, 0.001][min(t // 2, 4)]
    assert int(np.sum(np.asarray(out["w"]) != 0)) == sparse.num_entries(density, n)
  with pytest.raises(ValueError):
    jc.dgc_density_schedule(0.001, warmup_steps=-1)


CLIP_SHAPES = {"w": (64, 48), "v": (32, 40), "b": (48,)}  # two compressed leaves, one dense


def _clipped_reference(grads, clip_norm, mode, num):
  """numpy: each device's gradient leaves scaled down to clip_norm / sqrt(num), by the
  norm over all leaves ("global") or each by its own ("per_tensor")."""
  thr = clip_norm / np.sqrt(num)
  lead = next(iter(grads.values())).shape[0]
  sq = {
    n: np.sum(np.asarray(g, np.float64).reshape(lead, -1) ** 2, axis=1) for n, g in grads.items()
  }
  total = sum(sq.values())
  out = {}
  for n, g in grads.items():
    norm = np.sqrt(total if mode == "global" else sq[n])
    scale = np.minimum(1.0, thr / norm).reshape(lead, *[1] * (g.ndim - 1))
    out[n] = np.asarray(g, np.float64) * scale
  return out


@pytest.mark.parametrize("mode", ["global", "per_tensor"])
@pytest.mark.parametrize("sharded", [False, True])
def test_local_gradient_clipping_by_hand(mode, sharded):
  """Two steps at density 1 without masking: every leaf (compressed or dense) is momentum
  SGD on the clipped gradients, out_t = mean_d u_d, u_d = 0.9 u_d + clip(g_d), computed
  here in numpy. The threshold is 20 per device: the global norm (about 66) and the
  norms of w (about 55) and v (36) are above it, b's (about 7) is not."""
  num = K if sharded else 1
  clip_norm = 20.0 * np.sqrt(num)
  params = {n: jnp.zeros(s) for n, s in CLIP_SHAPES.items()}
  dgc = jc.dgc(
    1.0,
    0.9,
    clip_norm=float(clip_norm),
    clip=mode,
    momentum_masking=False,
    method="exact",
    axis_name=AXIS if sharded else None,
    collective="allgather",
  )
  if sharded:
    m = helpers.mesh()
    tx = jc.per_device_state(dgc)
    state = helpers.shard_map_init(tx, params, m)
    update = helpers.shard_map_update(tx, m, params)
    step = lambda g, st: update(helpers.shard(g, m), st)
  else:
    tx = dgc
    state = tx.init(params)
    step = lambda g, st: jax.jit(tx.update)(jax.tree.map(lambda x: x[0], g), st)
  u = {n: np.zeros((num, *s)) for n, s in CLIP_SHAPES.items()}
  for t in range(2):
    g = helpers.per_device_grads(jax.random.key(t), CLIP_SHAPES, k=num)
    out, state = step(g, state)
    clipped = _clipped_reference(g, clip_norm, mode, num)
    for name in CLIP_SHAPES:
      u[name] = 0.9 * u[name] + clipped[name]
      np.testing.assert_allclose(out[name], u[name].mean(0), rtol=2e-5, atol=1e-6)
  # The two modes differ on this gradient (b is not clipped per tensor, w and v less).
  g = helpers.per_device_grads(jax.random.key(0), CLIP_SHAPES, k=num)
  other = _clipped_reference(g, clip_norm, "global" if mode == "per_tensor" else "per_tensor", num)
  mine = _clipped_reference(g, clip_norm, mode, num)
  assert not np.allclose(other["b"], mine["b"], rtol=1e-3)


def test_chunked_sends_whole_chunks_chosen_by_summed_norms():
  dgc = jc.dgc(
    0.05,
    0.0,
    method="exact",
    axis_name=AXIS,
    collective="chunked",
    chunk_size=64,
    momentum_masking=False,
  )
  tx = jc.per_device_state(dgc)
  m = helpers.mesh()
  state = helpers.shard_map_init(tx, PARAMS, m)
  g = helpers.per_device_grads(jax.random.key(0), SHAPES)
  out, state = helpers.shard_map_update(tx, m, PARAMS)(helpers.shard(g, m), state)
  flat_g = np.asarray(g["w"]).reshape(K, -1)
  chunks = np.abs(flat_g).sum(0).reshape(-1, 64).sum(1)  # psum of the chunks' L1 norms
  n_chunks = int(np.ceil(0.05 * 64 * 48 / 64))
  top = np.argsort(-chunks)[:n_chunks]
  want = np.zeros_like(flat_g[0])
  for c in top:
    want[c * 64 : (c + 1) * 64] = flat_g[:, c * 64 : (c + 1) * 64].mean(0)
  np.testing.assert_allclose(np.asarray(out["w"]).reshape(-1), want, rtol=1e-5, atol=1e-6)
  # The velocity is zeroed on the sent chunks on every device, kept elsewhere.
  vel = np.asarray(state.inner.velocity["w"]).reshape(K, -1)
  sent = np.zeros(64 * 48, bool)
  for c in top:
    sent[c * 64 : (c + 1) * 64] = True
  assert np.all(vel[:, sent] == 0)
  np.testing.assert_allclose(vel[:, ~sent], flat_g[:, ~sent], rtol=1e-6)


def test_wire_bytes_chunked_flat_allgather_linear():
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  n = 1024 * 1024
  ks = [2, 8, 64, 512]
  gather = [
    jc.wire_report(
      jc.dgc(0.001, axis_name=AXIS, collective="allgather"), params, axis_name=AXIS, num_devices=k
    ).bytes_received
    for k in ks
  ]
  chunked = [
    jc.wire_report(
      jc.dgc(0.001, axis_name=AXIS, collective="chunked"), params, axis_name=AXIS, num_devices=k
    )
    for k in ks
  ]
  k_entries = sparse.num_entries(0.001, n)
  for k, b in zip(ks, gather):  # (K-1) · k · (4 value + 4 index) bytes
    assert b == (k - 1) * k_entries * 8
  for k, r in zip(ks, chunked):  # 2(K-1)/K · 4 · (n/512 + ceil(density n / 512) · 512)
    assert r.bytes_received == pytest.approx(2 * (k - 1) / k * 4 * (n // 512 + 3 * 512))
  assert gather[-1] / gather[1] == pytest.approx(511 / 7)
  assert chunked[1].ratio > 250


def test_dense_leaves_and_outputs_identical_under_pmap():
  dgc = jc.dgc(0.01, 0.9, method="sampled", axis_name=AXIS, warmup_steps=4, collective="allgather")
  tx = optax.chain(jc.per_device_state(dgc), optax.sgd(0.1))
  outs, _, _ = _run_sharded(tx, 6)
  # pmap: the same transform (state per device already, no wrapper) gives the same
  # numbers: sampling draws from the same per-device keys.
  ptx = optax.chain(dgc, optax.sgd(0.1))
  replicated = jax.tree.map(lambda p: jnp.broadcast_to(p, (K, *p.shape)), PARAMS)
  pstate = jax.pmap(ptx.init, axis_name=AXIS)(replicated)
  step = jax.pmap(lambda g, s: ptx.update(g, s), axis_name=AXIS)
  for t in range(6):
    g = helpers.per_device_grads(jax.random.key(t), SHAPES)
    u, pstate = step(g, pstate)
    for name in SHAPES:
      rows = np.asarray(u[name])
      assert np.all(rows == rows[0])  # identical on every device
      np.testing.assert_allclose(rows[0], outs[t][name], rtol=1e-6, atol=1e-7)


def test_nonfinite_gradient_keeps_state_and_is_not_hidden():
  tx = jc.dgc(0.05, 0.9, method="exact", axis_name=None)
  state = tx.init(PARAMS)
  g = {"w": jnp.ones((64, 48)), "b": jnp.ones(48)}
  _, state = _local_step(tx, g, state)
  bad = {"w": g["w"].at[3, 4].set(jnp.nan), "b": g["b"]}
  out, state2 = _local_step(tx, bad, state)
  assert not np.all(np.isfinite(np.asarray(out["w"])))
  assert int(state2.nonfinite_count) == 1
  jax.tree.map(np.testing.assert_array_equal, state.momentum, state2.momentum)


def test_bad_arguments():
  with pytest.raises(ValueError):
    jc.dgc(0.0, axis_name=None)
  with pytest.raises(ValueError):
    jc.dgc(0.01, momentum=1.0, axis_name=None)
  with pytest.raises(ValueError):
    jc.dgc(0.01, clip_norm=0.0, axis_name=None)
  with pytest.raises(ValueError, match="clip"):
    jc.dgc(0.01, clip_norm=1.0, clip="per_leaf", axis_name=None)
  with pytest.raises(ValueError):
    jc.dgc(0.01, collective="two_phase", axis_name=None)
  with pytest.raises(ValueError):
    jc.dgc(0.01, method="approx", axis_name=None)
  with pytest.raises(ValueError):
    jc.dgc(0.01, chunk_size=0, axis_name=None)
  tx = jc.dgc(0.01, axis_name=AXIS, collective="allgather")
  with pytest.raises(ValueError, match="not bound"):
    tx.update(PARAMS, tx.init(PARAMS))


def test_warmup_stage_rides_in_the_dense_all_reduce():
  # Under shard_map the step count is typed varying: the warm-up stage (the branch index)
  # is made invariant through the dense leaves' all-reduce, not a pmax of its own.
  tx = jc.per_device_state(
    jc.dgc(0.01, 0.9, method="exact", axis_name=AXIS, warmup_steps=4, collective="allgather")
  )
  m = helpers.mesh()
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  g = helpers.shard(helpers.per_device_grads(jax.random.key(0), SHAPES), m)
  hlo = update.lower(g, state).compile().as_text()
  counts = helpers.collective_counts(hlo)
  assert counts["all-reduce"] == 1, counts  # b and the stage, one buffer
  # One all-gather per warm-up stage's branch (each its own density), run one at a time.
  assert counts["all-gather"] == len(dgc_lib.warmup_densities(0.01, 4)), counts
  for t in range(6):  # the stage still follows the count: the densities of the schedule
    g = helpers.shard(helpers.per_device_grads(jax.random.key(t), SHAPES), m)
    out, state = update(g, state)
    d = float(jc.dgc_density_schedule(0.01, 4)(t))
    sent = np.count_nonzero(np.asarray(out["w"]))
    assert sent <= K * int(np.ceil(d * 64 * 48)), (t, sent)
    assert sent >= int(np.ceil(d * 64 * 48)), (t, sent)


def test_two_devices_send_dense_leaves_with_the_payloads():
  tx = jc.dgc(0.01, 0.9, method="exact", axis_name=AXIS, collective="allgather")
  devices = jax.devices()[:2]
  replicated = jax.tree.map(lambda p: jnp.broadcast_to(p, (2, *p.shape)), PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(replicated)
  step = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  g = helpers.per_device_grads(jax.random.key(1), SHAPES, k=2)
  out, _ = step(g, state)
  # The first step's dense update is the mean gradient, exactly lax.pmean's.
  want = jax.pmap(lambda x: jax.lax.pmean(x, AXIS), axis_name=AXIS, devices=devices)(g["b"])
  np.testing.assert_array_equal(out["b"], want)
  counts = helpers.collective_counts(step.lower(g, state).compile().as_text())
  assert counts == {"all-gather": 1, "all-reduce": 0, "all-to-all": 0}, counts
