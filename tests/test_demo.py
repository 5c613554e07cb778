"""jc.decoupled_momentum (DeMo): Algorithm 1 against NumPy, the DCT, the removal of what
was sent, the bytes, the errors, NaN/Inf, pmap and training."""

import doctest

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest
import scipy.fft

import jaxcomp as jc
from jaxcomp._src.methods import demo as demo_lib
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.tools import wire
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

CHUNK, TOPK = 32, 16
# With 32x32 blocks: "w" is 2x3 whole blocks; "u" (100 x 33) is padded to 4x2 blocks of
# 32 x 32 (rows and columns); "c" (4, 8, 40) is viewed as 32 x 40, padded to 1x2 blocks;
# "b" goes dense (the default filter: one dimension).
SHAPES = {"w": (64, 96), "u": (100, 33), "c": (4, 8, 40), "b": (96,)}
PARAMS = {
  name: 0.1 * jax.random.normal(jax.random.key(i), shape)
  for i, (name, shape) in enumerate(sorted(SHAPES.items()))
}


def _grads(seed: int):
  """Per-device gradients (leading axis K): a shared part plus per-device noise."""
  g = helpers.per_device_grads(jax.random.key(seed), SHAPES)
  common = helpers.per_device_grads(jax.random.key(10_000 + seed), SHAPES, k=1)
  return jax.tree.map(lambda a, c: 0.5 * a + c, g, common)


def _run(tx, steps: int, *, params=PARAMS, seed: int = 0, apply: bool = True):
  """``steps`` updates of ``tx`` under shard_map (check_vma on) on 8 devices, one
  compilation; the parameters move by the updates when ``apply``. Returns the updates,
  the per-device gradients, the parameters each step saw and the DeMo states after
  every step (numpy copies)."""
  chex.clear_trace_counter()
  m = helpers.mesh()
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=K)
  state = helpers.shard_map_init(tx, params, m)

  @chex.assert_max_traces(n=1)
  def step(p, s, g):
    return tx.update(jax.tree.map(lambda x: x[0], g), s, p)

  update = jax.jit(
    jax.shard_map(step, mesh=m, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  params = jax.device_put(params, jax.NamedSharding(m, P()))  # as the updated ones
  outs, grads, seen, states = [], [], [], []
  for t in range(steps):
    g = _grads(seed + t)
    seen.append(jax.tree.map(np.asarray, params))
    u, state = update(params, state, helpers.shard(g, m))
    outs.append(jax.tree.map(np.asarray, u))
    grads.append(jax.tree.map(np.asarray, g))
    states.append(jax.tree.map(np.asarray, state[0]))
    if apply:
      params = optax.apply_updates(params, u)
  return outs, grads, seen, states


# ----------------------------------------------------------------------------- reference


def _as_matrix(shape):
  return (1, int(np.prod(shape))) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])


def _blocks(shape, chunk):
  r, c = _as_matrix(shape)
  br, bc = min(chunk, r), min(chunk, c)
  return r, c, br, bc, -(-r // br) * br, -(-c // bc) * bc


def _ref_idct(coef: np.ndarray, shape, chunk: int) -> np.ndarray:
  """The blockwise inverse of padded coefficients ``(rp, cp)``, cropped to ``shape``."""
  r, c, br, bc, rp, cp = _blocks(shape, chunk)
  out = np.zeros((rp, cp))
  for i in range(0, rp, br):
    for j in range(0, cp, bc):
      out[i : i + br, j : j + bc] = scipy.fft.idctn(coef[i : i + br, j : j + bc], norm="ortho")
  return out[:r, :c].reshape(shape)


def _ref_fast_components(x: np.ndarray, chunk: int, topk: int):
  """q = IDCT(TopK(DCT(x))) blockwise, float64, with scipy's orthonormal DCT-II; also
  the kept coefficients and where they are (padded ``(rp, cp)``, block by block)."""
  r, c, br, bc, rp, cp = _blocks(x.shape, chunk)
  mat = np.zeros((rp, cp))
  mat[:r, :c] = x.reshape(r, c)
  kept, sent = np.zeros_like(mat), np.zeros(mat.shape, bool)
  k = min(topk, br * bc)
  for i in range(0, rp, br):
    for j in range(0, cp, bc):
      coef = scipy.fft.dctn(mat[i : i + br, j : j + bc], norm="ortho").reshape(-1)
      keep, mask = np.zeros_like(coef), np.zeros(coef.shape, bool)
      top = np.argsort(-np.abs(coef), kind="stable")[:k]
      keep[top], mask[top] = coef[top], True
      kept[i : i + br, j : j + bc] = keep.reshape(br, bc)
      sent[i : i + br, j : j + bc] = mask.reshape(br, bc)
  return _ref_idct(kept, x.shape, chunk), kept, sent


def _reference(
  grads, params, *, lr, beta, wd, chunk, topk, compressed, remove=True, mean="devices"
):
  """Algorithm 1 (signum, decoupled weight decay) in float64 on K simulated devices.

  Returns the updates of every step and every device's momenta after each step; the
  reference steps its own parameters. For the negative controls: ``remove=False`` keeps
  what was sent in the momenta; ``mean="senders"`` averages each coefficient over the
  devices that sent it (the reference code's scatter-mean) instead of over K."""
  params = {n: np.asarray(p, np.float64) for n, p in params.items()}
  mom = {n: np.zeros((K, *SHAPES[n])) for n in compressed}
  outs, moms, means = [], [], []
  for g in grads:
    u, qmean = {}, {}
    for name in SHAPES:
      gi = np.asarray(g[name], np.float64)
      if name in compressed:
        qs, total, count = [], 0.0, 0
        for i in range(K):
          mom[name][i] = beta * mom[name][i] + gi[i]
          q, kept, sent = _ref_fast_components(mom[name][i], chunk, topk)
          if remove:
            mom[name][i] -= q
          qs.append(q)
          total, count = total + kept, count + sent
        if mean == "devices":
          qmean[name] = np.mean(qs, axis=0)
        else:
          per_sender = np.where(count > 0, total / np.maximum(count, 1), 0.0)
          qmean[name] = _ref_idct(per_sender, SHAPES[name], chunk)
      else:  # every component sent: the momentum empties, the step is sign(mean g)
        qmean[name] = gi.mean(axis=0)
      u[name] = -lr * (np.sign(qmean[name]) + wd * params[name])
      params[name] = params[name] + u[name]
    outs.append(u)
    moms.append({n: m.copy() for n, m in mom.items()})
    means.append(qmean)
  return outs, moms, means


def test_matches_a_numpy_reference_of_algorithm_1():
  """Five steps on 8 devices against float64 NumPy with scipy's DCT: the momenta to
  float32 rounding, the updates exactly (-η(sign(Q) + λθ)) wherever the reference mean
  Q is not within rounding of 0; leaves whose blocks need padding, a 3-D leaf folded
  into a matrix and a dense leaf included."""
  lr, beta, wd = 0.01, 0.9, 0.1
  tx = jc.decoupled_momentum(
    lr, axis_name=AXIS, chunk_size=CHUNK, topk=TOPK, momentum_decay=beta, weight_decay=wd
  )
  outs, grads, seen, states = _run(tx, 5)
  ref_outs, ref_moms, ref_means = _reference(
    grads, PARAMS, lr=lr, beta=beta, wd=wd, chunk=CHUNK, topk=TOPK, compressed=("w", "u", "c")
  )
  for t, (u, s, ru, rm, rq, p) in enumerate(zip(outs, states, ref_outs, ref_moms, ref_means, seen)):
    for name in ("w", "u", "c"):
      got = s.momentum.inner[name]
      scale = np.max(np.abs(rm[name]))
      np.testing.assert_allclose(got, rm[name], rtol=0, atol=2e-5 * scale, err_msg=f"{name} {t}")
    for name in SHAPES:
      clear = np.abs(rq[name]) > 1e-4 * np.max(np.abs(rq[name]))
      assert clear.mean() > 0.99, (name, t)
      want = -lr * (np.sign(rq[name]) + wd * p[name])
      np.testing.assert_allclose(u[name][clear], want[clear], rtol=1e-6, atol=1e-9)
      np.testing.assert_allclose(u[name][clear], ru[name][clear], rtol=1e-5, atol=1e-8)
  # The momenta differ between devices (each keeps what it did not send).
  assert not np.allclose(states[-1].momentum.inner["w"][0], states[-1].momentum.inner["w"][1])
  # Negative controls: the comparison tells apart a momentum that keeps what it sent,
  # and the reference code's mean over the senders of each coefficient.
  kept_outs, kept_moms, _ = _reference(
    grads,
    PARAMS,
    lr=lr,
    beta=beta,
    wd=wd,
    chunk=CHUNK,
    topk=TOPK,
    compressed=("w", "u", "c"),
    remove=False,
  )
  assert not np.allclose(states[0].momentum.inner["w"], kept_moms[0]["w"], atol=1e-3)
  senders_outs, _, _ = _reference(
    grads,
    PARAMS,
    lr=lr,
    beta=beta,
    wd=wd,
    chunk=CHUNK,
    topk=TOPK,
    compressed=("w", "u", "c"),
    mean="senders",
  )
  for other in (kept_outs, senders_outs):
    differ = np.mean([np.mean(np.sign(u["w"]) != np.sign(o["w"])) for u, o in zip(outs, other)])
    assert differ > 0.01, differ


def test_average_over_senders_matches_the_reference_codes_mean():
  """``average="senders"``: each coefficient averaged over the devices that sent it, as
  the reference code's scatter-mean; against the float64 reference over 5 steps (the
  momenta are those of the default, the signs those of the senders' mean)."""
  lr, beta, wd = 0.01, 0.9, 0.1
  tx = jc.decoupled_momentum(
    lr,
    axis_name=AXIS,
    chunk_size=CHUNK,
    topk=TOPK,
    momentum_decay=beta,
    weight_decay=wd,
    average="senders",
  )
  outs, grads, seen, _ = _run(tx, 5)
  _, _, ref_means = _reference(
    grads,
    PARAMS,
    lr=lr,
    beta=beta,
    wd=wd,
    chunk=CHUNK,
    topk=TOPK,
    compressed=("w", "u", "c"),
    mean="senders",
  )
  for t, (u, rq, p) in enumerate(zip(outs, ref_means, seen)):
    for name in SHAPES:
      clear = np.abs(rq[name]) > 1e-4 * np.max(np.abs(rq[name]))
      assert clear.mean() > 0.99, (name, t)
      want = -lr * (np.sign(rq[name]) + wd * p[name])
      np.testing.assert_allclose(u[name][clear], want[clear], rtol=1e-6, atol=1e-9)
  with pytest.raises(ValueError, match="average"):
    jc.decoupled_momentum(lr, axis_name=AXIS, average="nodes")


# ----------------------------------------------------------------------------- DCT


@pytest.mark.parametrize("n", [1, 2, 7, 32, 64])
def test_dct_basis_is_orthonormal_and_scipys(n):
  d = demo_lib.dct_basis(n)
  np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-12)
  np.testing.assert_allclose(d, scipy.fft.dct(np.eye(n), axis=0, norm="ortho"), atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 96), (100, 33), (4, 8, 40), (1000,), (3, 5)])
def test_blockwise_dct_round_trip_and_energy(shape):
  """decode(encode(x)) = x (the padding dropped), and the coefficients keep the energy:
  the blocks are orthonormal transforms of the zero-padded leaf."""
  lay = demo_lib._layout(shape, CHUNK, TOPK)
  x = jax.random.normal(jax.random.key(0), shape)
  coef = demo_lib._encode(x, lay)
  assert coef.shape == (lay.blocks, lay.per_block)
  np.testing.assert_allclose(demo_lib._decode(coef, lay), x, atol=1e-5)
  np.testing.assert_allclose(jnp.sum(coef**2), jnp.sum(x**2), rtol=1e-5)


def test_layout_blocks_and_index_bits():
  lay = demo_lib._layout((512, 256), 64, 32)
  assert (lay.br, lay.bc, lay.blocks, lay.k, lay.index_bits) == (64, 64, 32, 32, 12)
  small = demo_lib._layout((3, 5), 64, 32)  # one block of 3x5: k clamped to its 15
  assert (small.br, small.bc, small.blocks, small.k, small.index_bits) == (3, 5, 1, 15, 4)
  vec = demo_lib._layout((100,), 16, 4)  # a vector: one row, blocks of 16
  assert (vec.br, vec.bc, vec.blocks, vec.index_bits) == (1, 16, 7, 4)


# ----------------------------------------------------------------------------- removal


def test_sent_components_are_removed_from_the_momentum():
  """After the first step m_i = g_i - q_i: its DCT is 0 at the k sent coefficients of
  each block (the largest of DCT(g_i)) and DCT(g_i) elsewhere."""
  tx = jc.decoupled_momentum(0.01, axis_name=AXIS, chunk_size=CHUNK, topk=TOPK)
  _, grads, _, states = _run(tx, 1)
  lay = demo_lib._layout(SHAPES["w"], CHUNK, TOPK)  # whole blocks: no padding
  for i in (0, 5):
    before = np.asarray(demo_lib._encode(jnp.asarray(grads[0]["w"][i]), lay))
    after = np.asarray(demo_lib._encode(jnp.asarray(states[0].momentum.inner["w"][i]), lay))
    sent = np.argsort(-np.abs(before), axis=-1)[:, :TOPK]
    mask = np.zeros(before.shape, bool)
    np.put_along_axis(mask, sent, True, axis=-1)
    scale = np.max(np.abs(before))
    np.testing.assert_allclose(after[mask], 0.0, atol=1e-5 * scale)
    np.testing.assert_allclose(after[~mask], before[~mask], atol=1e-5 * scale)
    sent_min = np.min(np.where(mask, np.abs(before), np.inf), axis=-1)
    kept_max = np.max(np.where(mask, 0.0, np.abs(before)), axis=-1)
    assert np.all(sent_min >= kept_max)  # the largest of each block were sent


def test_payload_packs_the_indices_in_the_fewest_bits():
  lay = demo_lib._layout((64, 96), CHUNK, TOPK)
  coef = demo_lib._encode(jax.random.normal(jax.random.key(1), (64, 96)), lay)
  payload, sent = demo_lib._fast_components(coef, lay)
  assert payload["values"].dtype == jnp.float32
  assert payload["values"].shape == (lay.blocks * TOPK,)
  assert lay.index_bits == 10  # 32 x 32 coefficients
  assert payload["indices"].shape == (bitpack.num_words(lay.blocks * TOPK, 10),)
  vals, idx = demo_lib._unpack(payload, lay)
  np.testing.assert_array_equal(demo_lib._scatter(vals, idx, lay), sent)
  assert int(jnp.sum(sent != 0)) == lay.blocks * TOPK


# ----------------------------------------------------------------------------- bytes


def _payload_bytes(shapes, chunk, topk):
  """Bytes of one device's gathered payload (float32 values, packed uint32 index
  words) and of the dense leaves' all-reduce operand."""
  ag = dense = 0
  for shape in shapes.values():
    n = int(np.prod(shape))
    if len(shape) < 2 or n < 1024:
      dense += 4 * n
      continue
    lay = demo_lib._layout(shape, chunk, topk)
    ag += 4 * lay.blocks * lay.k + 4 * bitpack.num_words(lay.blocks * lay.k, lay.index_bits)
  return ag, dense


@pytest.mark.parametrize("chunk,topk", [(CHUNK, TOPK), (64, 32)])
def test_wire_bytes_are_the_payload(chunk, topk):
  """One all-gather of the payload arrays (every compressed leaf together) and one
  all-reduce of the dense leaf: each device receives (K-1) payloads."""
  tx = jc.decoupled_momentum(1e-3, axis_name=AXIS, chunk_size=chunk, topk=topk)
  report = jc.wire_report(tx, PARAMS, axis_name=AXIS, num_devices=K)
  ag, dense = _payload_bytes(SHAPES, chunk, topk)
  by_name = {wire.canonical(op.primitive): op for op in report.ops}
  assert set(by_name) == {"all_gather", "psum"}, report.ops
  assert by_name["all_gather"].operand_bytes == ag
  assert by_name["psum"].operand_bytes == dense
  assert report.bytes_received == pytest.approx((K - 1) * ag + 2 * (K - 1) / K * dense)
  n = sum(int(np.prod(s)) for s in SHAPES.values())
  assert report.dense_bytes == pytest.approx(2 * (K - 1) / K * 4 * n)
  assert report.ratio == pytest.approx(report.dense_bytes / report.bytes_received)
  assert report.ratio > 1.0


def test_default_compression_on_a_large_matrix():
  """With the defaults (64x64 blocks, 32 sent, 12-bit indices) a 1024x1024 matrix's
  payload is 1024 x 32 x (4 + 1.5) bytes, and against a dense all-reduce on 8 devices
  the ratio is 2(K-1)/K · 4 · 2^20 / ((K-1) · 180224)."""
  params = {"w": jnp.zeros((1024, 1024))}
  report = jc.wire_report(
    jc.decoupled_momentum(1e-3, axis_name=AXIS), params, axis_name=AXIS, num_devices=K
  )
  payload = 256 * 32 * 4 + 256 * 32 * 12 // 8
  assert report.bytes_received == pytest.approx((K - 1) * payload)
  assert report.ratio == pytest.approx(2 * 4 * 2**20 / K / payload)


# ----------------------------------------------------------------------------- errors


def test_bad_input_errors():
  with pytest.raises(ValueError, match="topk=65 exceeds"):
    jc.decoupled_momentum(1e-3, axis_name=AXIS, chunk_size=8, topk=65)
  jc.decoupled_momentum(1e-3, axis_name=AXIS, chunk_size=8, topk=64)  # every one: allowed
  with pytest.raises(ValueError, match="topk must be a positive integer"):
    jc.decoupled_momentum(1e-3, axis_name=AXIS, topk=0)
  with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
    jc.decoupled_momentum(1e-3, axis_name=AXIS, chunk_size=2.5)
  with pytest.raises(ValueError, match="momentum_decay"):
    jc.decoupled_momentum(1e-3, axis_name=AXIS, momentum_decay=1.0)
  with pytest.raises(ValueError, match="weight_decay"):
    jc.decoupled_momentum(1e-3, axis_name=AXIS, weight_decay=-0.1)
  with pytest.raises(TypeError, match="learning_rate"):
    jc.decoupled_momentum("fast", axis_name=AXIS)
  with pytest.raises(TypeError, match="needs axis_name"):
    jc.decoupled_momentum(1e-3)
  with pytest.raises(TypeError, match="needs axis_name"):
    jc.scale_by_decoupled_momentum()
  tx = jc.decoupled_momentum(1e-3, axis_name=None, weight_decay=0.1)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="params"):
    tx.update(PARAMS, state)
  plain = jc.decoupled_momentum(1e-3, axis_name=None)  # no weight decay: no params needed
  plain.update(PARAMS, plain.init(PARAMS))


def test_replicated_gradient_is_refused_under_check_vma():
  """The gradient must be each device's own: a replicated one (params not marked with
  jc.vary) would send K copies of the same components."""
  tx = jc.decoupled_momentum(1e-3, axis_name=AXIS)
  m = helpers.mesh()
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  state = helpers.shard_map_init(tx, PARAMS, m)
  step = jax.jit(
    jax.shard_map(
      lambda g, s: tx.update(g, s, None), mesh=m, in_specs=(P(), specs), out_specs=(P(), specs)
    )
  )
  with pytest.raises(ValueError, match="already replicated"):
    step(PARAMS, state)


def test_a_filter_that_leaves_nothing_to_compress_warns():
  tx = jc.decoupled_momentum(1e-3, axis_name=None)
  with pytest.warns(UserWarning, match=r"jc.decoupled_momentum compresses nothing"):
    tx.init({"b": jnp.zeros((10,))})


def test_zeros_dtypes_and_stable_state():
  """Zero gradients step nothing (sign(0) = 0); the updates keep each gradient's dtype
  (bfloat16 too, the momentum in float32); the state keeps its shapes and dtypes."""
  params = {
    "w32": jnp.zeros((64, 48), jnp.float32),
    "w16": jnp.zeros((64, 48), jnp.bfloat16),
    "b": jnp.zeros((48,), jnp.float32),
  }
  tx = jc.decoupled_momentum(0.01, axis_name=None)
  state = tx.init(params)
  update = jax.jit(tx.update)
  zeros, state1 = update(params, state, params)
  chex.assert_trees_all_equal(zeros, params)
  g = jax.tree.map(lambda p: jnp.ones_like(p), params)
  u, state2 = update(g, state1, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(u, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2)
  assert state2[0].momentum.inner["w16"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(u["w16"], np.float32), -0.01, rtol=1e-2)


def test_skip_nonfinite_composes():
  tx = jc.skip_nonfinite(jc.decoupled_momentum(0.01, axis_name=AXIS), axis_name=AXIS)
  m = helpers.mesh()
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  _, state = update(helpers.shard(_grads(0), m), state)
  g = _grads(1)
  g["u"] = g["u"].at[0, 0, 0].set(jnp.inf)
  u, state2 = update(helpers.shard(g, m), state)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  assert int(state2.notfinite_count) == 1


def test_two_level_refuses_it():
  with pytest.raises(NotImplementedError, match="DCT blocks"):
    jc.two_level(jc.decoupled_momentum(0.01, axis_name="slow"), fast_axis="fast")


# ----------------------------------------------------------------------------- state


def test_state_is_per_device_and_placed():
  tx = jc.decoupled_momentum(1e-3, axis_name=AXIS)
  assert jc.per_device_state(tx) is tx
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  assert specs[0].momentum.inner["w"] == P(AXIS)
  assert isinstance(specs[0].momentum.inner["b"], optax.MaskedNode)
  state = helpers.shard_map_init(tx, PARAMS, helpers.mesh())
  assert state[0].momentum.inner["w"].shape == (K, *SHAPES["w"])
  assert state[0].nonfinite_count.inner.shape == (K,)


def test_nonfinite_gradient_is_loud_and_poisons_no_state():
  tx = jc.decoupled_momentum(0.01, axis_name=AXIS, chunk_size=CHUNK, topk=TOPK)
  m = helpers.mesh()
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  _, state = update(helpers.shard(_grads(0), m), state)
  before = jax.tree.map(np.asarray, state[0])
  g = _grads(1)
  g["w"] = g["w"].at[3, 5, 7].set(jnp.nan)  # device 3 only
  u, state = update(helpers.shard(g, m), state)
  after = jax.tree.map(np.asarray, state[0])
  assert np.all(np.isnan(np.asarray(u["w"])))  # the whole leaf, on every device
  for name in ("u", "c", "b"):
    assert np.all(np.isfinite(np.asarray(u[name])))
  np.testing.assert_array_equal(after.momentum.inner["w"][3], before.momentum.inner["w"][3])
  assert not np.array_equal(after.momentum.inner["w"][0], before.momentum.inner["w"][0])
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after.momentum))
  np.testing.assert_array_equal(after.nonfinite_count.inner, [0, 0, 0, 1, 0, 0, 0, 0])


# ----------------------------------------------------------------------------- pmap, training


def test_pmap_matches_shard_map():
  """jax.pmap with the state per device: the same updates, identical on every device."""
  tx = jc.decoupled_momentum(1e-2, axis_name=AXIS, chunk_size=CHUNK, topk=TOPK)
  outs, grads, _, _ = _run(tx, 3, apply=False)
  replicated = jax.tree.map(lambda p: jnp.broadcast_to(p, (K, *p.shape)), PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(replicated)
  step = jax.pmap(tx.update, axis_name=AXIS)
  for u, g in zip(outs, grads):
    pu, state = step(g, state, replicated)
    for name in SHAPES:
      pu_name = np.asarray(pu[name])
      for d in range(K):
        np.testing.assert_array_equal(pu_name[d], pu_name[0])
      # The same arithmetic; a mean within rounding of 0 may take either sign.
      assert np.mean(pu_name[0] == u[name]) > 0.999, name


def test_trains_a_linear_model_under_pmap():
  """Least squares y = X W* on 8 devices, each with its own minibatches: DeMo (1.6% of
  the DCT components sent) brings the loss down by well over an order of magnitude."""
  d_in, d_out, batch = 64, 32, 16
  w_star = jax.random.normal(jax.random.key(0), (d_in, d_out))
  params = {"w": jnp.zeros((d_in, d_out))}

  def loss(p, x):
    return jnp.mean((x @ p["w"] - x @ w_star) ** 2)

  lr = optax.cosine_decay_schedule(0.02, 300)
  tx = jc.decoupled_momentum(lr, axis_name=AXIS, topk=32, momentum_decay=0.9)

  def step(p, s, x):
    g = jax.grad(loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, jax.lax.pmean(loss(p, x), AXIS)

  rep = jax.tree.map(lambda a: jnp.broadcast_to(a, (K, *a.shape)), params)
  state = jax.pmap(tx.init, axis_name=AXIS)(rep)
  pstep = jax.pmap(step, axis_name=AXIS)
  start = float(loss(params, jax.random.normal(jax.random.key(1), (1024, d_in))))
  with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix int and float
    for t in range(300):
      x = jax.random.normal(jax.random.key(100 + t), (K, batch, d_in))
      rep, state, _ = pstep(rep, state, x)
      # One step in flight, as the trainers run: on jax 0.10, hundreds of queued pmap
      # steps on 8 virtual CPU devices (2 cores) deadlock XLA:CPU's in-process
      # collectives (a rendezvous aborts the process after 40 s).
      jax.block_until_ready(rep)
  w = np.asarray(rep["w"])
  np.testing.assert_array_equal(w[0], w[K - 1])  # replicas stay identical
  end = float(loss({"w": rep["w"][0]}, jax.random.normal(jax.random.key(1), (1024, d_in))))
  assert end < start / 30, (start, end)


def test_docstring_examples():
  result = doctest.testmod(demo_lib, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
