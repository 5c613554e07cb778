"""jc.sparseloco and its codec: chunked top-k with b-bit values, decaying error feedback,
against a NumPy float64 reference of the algorithm; bytes; errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.plumbing import bitpack
from tests.helpers import AXIS
from tests.helpers import K
from tests.test_diloco import ShardMapRun
from tests.test_diloco import _centres
from tests.test_diloco import _quadratic_grads

SHAPES = {"w": (64, 32), "b": (32,)}  # w: compressed (default_filter); b: dense mean
PARAMS = {n: jnp.zeros(s, jnp.float32) for n, s in SHAPES.items()}


# ----------------------------------------------------------------------------- reference


def np_chunked_topk(x, density, bits, chunk_size):
  """NumPy float64 reference of the codec's round trip: per chunk of the flat tensor, the
  ceil(density·c) largest magnitudes, each sent as sign · j · s / L with s the chunk's
  largest kept magnitude, L = 2**(bits-1), j = clip(round(L|v|/s), 1, L)."""
  flat = np.asarray(x, np.float64).reshape(-1)
  n = flat.size
  c = max(1, min(chunk_size, n))
  k = min(c, max(1, math.ceil(density * c - 1e-9)))
  levels = 2 ** (bits - 1)
  out = np.zeros(n)
  for start in range(0, n, c):
    v = flat[start : start + c]
    keep = np.argsort(-np.abs(v), kind="stable")[:k]
    s = np.abs(v[keep]).max()
    if s == 0:
      continue
    j = np.clip(np.round(levels * np.abs(v[keep]) / s), 1, levels)
    out[start + keep] = np.sign(v[keep]) * j * s / levels
  return out.reshape(np.shape(x))


def np_sparseloco(centres, *, lr, h, syncs, density, bits, chunk_size, beta, alpha):
  """NumPy float64 SparseLoCo on the quadratic 0.5||θ_r - c_r||²: inner SGD(lr) for H
  steps per replica, then Δ_r = θ - θ_r; for the compressed leaf e_r ← βe_r + Δ_r,
  s_r = Q(TopK(e_r)), e_r ← e_r - s_r; the dense leaf sends Δ_r; θ ← θ - α mean_r(s_r).
  Returns per sync (anchor, residuals of "w", the replicas' Δ of "w")."""
  theta = {n: np.zeros(s) for n, s in SHAPES.items()}
  e = np.zeros((K, *SHAPES["w"]))
  out = []
  for _ in range(syncs):
    reps = {n: np.broadcast_to(theta[n], (K, *s)).copy() for n, s in SHAPES.items()}
    for _ in range(h):
      for n in SHAPES:
        reps[n] -= lr * (reps[n] - np.asarray(centres[n], np.float64))
    delta = {n: theta[n][None] - reps[n] for n in SHAPES}
    e = beta * e + delta["w"]
    sent = np.stack([np_chunked_topk(e[r], density, bits, chunk_size) for r in range(K)])
    e = e - sent
    theta = {"w": theta["w"] - alpha * sent.mean(0), "b": theta["b"] - alpha * delta["b"].mean(0)}
    out.append(({n: v.copy() for n, v in theta.items()}, e.copy(), delta["w"]))
  return out


# ----------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape,chunk_size", [((1000,), 256), ((64, 32), 512), ((40,), 4096)])
def test_codec_keeps_k_per_chunk_within_the_quantizer_error(bits, shape, chunk_size):
  """k = ceil(density·c) entries per chunk, the largest in magnitude, each with its sign
  and within s/(2L) of its value (or below s/L when it is under s/(2L), lifted to s/L);
  the chunk's largest sent exactly; equal to the NumPy reference."""
  density = 0.05
  x = jax.random.normal(jax.random.key(1), shape)
  codec = jc.codecs.ChunkedTopK(density, bits=bits, chunk_size=chunk_size)
  got = np.asarray(codec.decode(codec.encode(x)), np.float64).reshape(-1)
  flat = np.asarray(x, np.float64).reshape(-1)
  c = min(chunk_size, flat.size)
  k = math.ceil(density * c)
  levels = 2 ** (bits - 1)
  for start in range(0, flat.size, c):
    v, d = flat[start : start + c], got[start : start + c]
    top = np.argsort(-np.abs(v))[: min(k, v.size)]
    assert set(np.flatnonzero(d)) == set(top)  # no kept value decodes to zero
    s = np.abs(v[top]).max()
    assert np.abs(d).max() == pytest.approx(s, rel=1e-6)
    np.testing.assert_array_equal(np.sign(d[top]), np.sign(v[top]))
    err = np.abs(d[top] - v[top])
    small = np.abs(v[top]) < s / (2 * levels)
    assert np.all(err[~small] <= s / (2 * levels) * (1 + 1e-6))
    assert np.all(err[small] < s / levels)
    mags = np.abs(d[top]) * levels / s  # on the grid 1..L
    np.testing.assert_allclose(mags, np.round(mags), atol=1e-5)
  want = np_chunked_topk(x, density, bits, chunk_size).reshape(-1)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_codec_wire_bytes_are_the_packed_arrays():
  """Per chunk k indices of ceil(log2 c) bits and k codes of b bits, packed in uint32
  words, and one float32 scale: the payload's arrays are exactly that, and what
  wire_bits counts; per entry, under a third of TopK's float32 value and 16-bit index."""
  n, c, density, bits = 8192 + 100, 4096, 0.02, 2
  codec = jc.codecs.ChunkedTopK(density, bits=bits, chunk_size=c)
  chunks, k = 3, math.ceil(density * c)
  payload = codec.encode(jnp.arange(1, n + 1, dtype=jnp.float32))
  arrays = payload.arrays
  assert arrays["indices"].dtype == arrays["codes"].dtype == jnp.uint32
  assert arrays["indices"].shape == (bitpack.num_words(chunks * k, 12),)
  assert arrays["codes"].shape == (bitpack.num_words(chunks * k, bits),)
  assert arrays["scales"].shape == (chunks,) and arrays["scales"].dtype == jnp.float32
  want = 4 * (bitpack.num_words(chunks * k, 12) + bitpack.num_words(chunks * k, 2) + chunks)
  assert payload.nbytes == want
  assert codec.wire_bits((n,)) == 8 * want
  # the short last chunk (100 values) sends k padding-free slots: its top k all real
  assert np.count_nonzero(np.asarray(codec.decode(payload))) == chunks * k
  topk = jc.codecs.TopK(density)  # float32 values, 16-bit indices: 48 bits an entry
  per_entry = topk.wire_bits((n,)) / topk.num_entries(n)
  assert codec.wire_bits((n,)) / (chunks * k) < per_entry / 3


def test_codec_pads_a_chunk_shorter_than_k_and_sums_payloads():
  """A last chunk of fewer than k values sends padding slots that decode to nothing;
  decode_sum of a stack is the sum of the decodes."""
  codec = jc.codecs.ChunkedTopK(0.5, bits=2, chunk_size=16)  # k = 8; last chunk: 3 values
  xs = jax.random.normal(jax.random.key(2), (3, 19))
  dec = [np.asarray(codec.decode(codec.encode(x))) for x in xs]
  assert all(np.count_nonzero(d[16:]) == 3 and np.count_nonzero(d[:16]) == 8 for d in dec)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *[codec.encode(x) for x in xs])
  np.testing.assert_allclose(codec.decode_sum(stacked), np.sum(dec, 0), rtol=1e-6, atol=1e-7)


def test_codec_poisons_a_non_finite_input():
  """A NaN outside the kept entries still makes the decoded tensor non-finite."""
  x = jnp.arange(64.0).at[0].set(jnp.nan)
  codec = jc.codecs.ChunkedTopK(0.1, chunk_size=64)
  assert not np.all(np.isfinite(codec.decode(codec.encode(x))))


# ----------------------------------------------------------------------------- the method


def _run(h, syncs, **kw):
  lr, centres = 0.25, _centres(seed=3)
  tx = jc.sparseloco(optax.sgd(lr), sync_every=h, axis_name=AXIS, **kw)
  history = ShardMapRun(tx, params=PARAMS).run(h * syncs, lambda t: centres)
  return history, centres, lr


def test_matches_numpy_reference_over_syncs():
  """Under shard_map (check_vma on, 8 devices), inner SGD, H=3, three syncs: the anchor,
  every replica and every residual equal the NumPy float64 reference of the algorithm
  (chunked top-k at 5%, 2-bit values, β=0.9, α=0.8) to float32 rounding (replicas and
  reference alike draw the same top-k: no two magnitudes of a chunk are near-equal here)."""
  h, syncs = 3, 3
  kw = dict(density=0.05, bits=2, chunk_size=512, decay=0.9, outer_learning_rate=0.8)
  history, centres, lr = _run(h, syncs, **kw)
  ref = np_sparseloco(
    centres,
    lr=lr,
    h=h,
    syncs=syncs,
    density=kw["density"],
    bits=kw["bits"],
    chunk_size=kw["chunk_size"],
    beta=kw["decay"],
    alpha=kw["outer_learning_rate"],
  )
  for s, (theta, e, _) in enumerate(ref):
    replicas, state = history[(s + 1) * h - 1]
    for n in SHAPES:
      np.testing.assert_allclose(state.anchor[n], theta[n], rtol=1e-5, atol=1e-6)
      for r in replicas[n]:  # on the anchor, to one rounding of θ_r + (θ - θ_r)
        np.testing.assert_allclose(r, state.anchor[n], rtol=0, atol=1e-7)
    residual = state.exchange_state[0].inner.residual["w"]
    np.testing.assert_allclose(residual, e, rtol=1e-5, atol=1e-6)
  # the algorithm did something: the anchor moved, and top-k left a residual behind
  assert np.abs(ref[-1][0]["w"]).max() > 0.1 and np.abs(ref[-1][1]).max() > 0.01


def test_residual_is_decayed_residual_plus_delta_minus_sent():
  """The EF accumulator, read off the jax state alone: at every sync each replica's
  new residual is β·e + Δ - sent with sent = ChunkedTopK's round trip of β·e + Δ, and
  the anchor moves by -α times the mean of what was sent."""
  h, syncs, beta, alpha = 2, 3, 0.95, 1.0
  history, centres, lr = _run(h, syncs, density=0.03, chunk_size=1024, decay=beta)
  codec = jc.codecs.ChunkedTopK(0.03, bits=2, chunk_size=1024)
  e = np.zeros((K, *SHAPES["w"]), np.float32)
  anchor = np.zeros(SHAPES["w"], np.float32)
  for s in range(syncs):
    before, _ = history[(s + 1) * h - 2]  # the replicas before the sync step
    _, state = history[(s + 1) * h - 1]
    p = before["w"]
    delta = anchor[None] - (p - lr * (p - np.asarray(centres["w"])))
    acc = beta * e + delta
    sent = np.stack([np.asarray(codec.decode(codec.encode(jnp.asarray(a)))) for a in acc])
    new_e = state.exchange_state[0].inner.residual["w"]
    np.testing.assert_allclose(new_e, acc - sent, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.anchor["w"], anchor - alpha * sent.mean(0), atol=1e-6)
    e, anchor = new_e, state.anchor["w"]


@pytest.mark.parametrize("fragments", [None, 2])
def test_is_diloco_with_that_exchange(fragments):
  """jc.sparseloco is jc.diloco(inner, optax.sgd(α), exchange=jc.compress(ChunkedTopK,
  error_feedback=True, error_decay=β)): the same states, bit for bit (with Streaming
  DiLoCo's fragments too, each with its own residuals)."""
  h, syncs = 2, 2
  kw = dict(density=0.05, bits=3, chunk_size=256, decay=0.8, outer_learning_rate=0.7)
  matrices = lambda path, leaf: leaf.ndim == 2  # the fragments' pieces of w: under 1024
  history, centres, lr = _run(h, syncs, fragments=fragments, filter=matrices, **kw)
  codec = jc.codecs.ChunkedTopK(0.05, bits=3, chunk_size=256)
  exchange = jc.compress(
    codec,
    axis_name=AXIS,
    collective="allgather",
    error_feedback=True,
    error_decay=0.8,
    filter=matrices,
  )
  tx = jc.diloco(
    optax.sgd(lr),
    optax.sgd(0.7),
    sync_every=h,
    axis_name=AXIS,
    exchange=exchange,
    fragments=fragments,
  )
  other = ShardMapRun(tx, params=PARAMS).run(h * syncs, lambda t: centres)
  unkey = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  same = lambda a, b: np.testing.assert_array_equal(unkey(a), unkey(b))
  jax.tree.map(same, history[-1], other[-1])
  ex = history[-1][1].exchange_state
  assert len(ex) == (fragments or 1)
  assert all(np.abs(e.inner.residual["w"]).max() > 0 for e in ex)  # every fragment sparse


def test_wire_report_against_dense_diloco():
  """Bytes per device per step: the sparse exchange's over H, and at 2% of chunks of
  4096 with 2-bit values far below dense DiLoCo's float32 mean."""
  h = 10
  params = {"w": jnp.zeros((256, 128)), "v": jnp.zeros((128, 256)), "b": jnp.zeros((128,))}
  tx = jc.sparseloco(optax.sgd(1e-3), sync_every=h, axis_name=AXIS, density=0.02)
  dense = jc.diloco(optax.sgd(1e-3), optax.sgd(1.0), sync_every=h, axis_name=AXIS)
  report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=K)
  base = jc.wire_report(dense, params, axis_name=AXIS, num_devices=K)
  codec = jc.codecs.ChunkedTopK(0.02, bits=2, chunk_size=4096)
  sent = sum(codec.wire_bits(params[n].shape) // 8 for n in ("w", "v"))
  # once every H steps: the all-gather of the payloads (each device receives the K - 1
  # others'), and b's float32 all-reduce (2(K-1)/K of its bytes, ring)
  want = ((K - 1) * sent + 2 * (K - 1) / K * 4 * 128) / h
  assert report.bytes_received == pytest.approx(want, rel=1e-9)
  assert all(op.every == h for op in report.ops)
  assert base.bytes_received / report.bytes_received > 10


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(density=0.0), "density"),
    (dict(density=1.5), "density"),
    (dict(density=True), "density"),
    (dict(density=0.01, bits=1), "bits"),
    (dict(density=0.01, bits=9), "bits"),
    (dict(density=0.01, bits=2.0), "bits"),
    (dict(density=0.01, chunk_size=0), "chunk_size"),
    (dict(density=0.01, chunk_size=-4), "chunk_size"),
    (dict(density=0.01, chunk_size=64.0), "chunk_size"),
    (dict(density=0.01, decay=1.5), "error_decay"),
    (dict(density=0.01, decay=-0.1), "error_decay"),
    (dict(density=0.01, outer_learning_rate=0.0), "outer_learning_rate"),
    (dict(density=0.01, sync_every=0), "sync_every"),
  ],
)
def test_bad_arguments(kw, match):
  kw = dict(dict(sync_every=4, axis_name=AXIS), **kw)
  with pytest.raises(ValueError, match=match):
    jc.sparseloco(optax.sgd(0.1), **kw)


def test_error_decay_needs_error_feedback_and_an_axis_is_required():
  with pytest.raises(ValueError, match="error_feedback"):
    jc.compress(jc.codecs.TopK(0.1), axis_name=AXIS, error_decay=0.9)
  with pytest.raises(TypeError, match="axis_name"):
    jc.sparseloco(optax.sgd(0.1), sync_every=4, density=0.01)


@pytest.mark.parametrize("residual_dtype", [jnp.float32, jnp.bfloat16, "int8"])
def test_compress_error_decay_scales_the_residual(residual_dtype):
  """jc.compress(error_decay=β): e' = g + β e - Q⁻¹(Q(g + β e)), for every residual dtype
  (int8: its block scales decayed), to the residual's own rounding."""
  beta = 0.5
  codec = jc.codecs.ChunkedTopK(0.1, chunk_size=256)
  tx = jc.compress(
    codec, axis_name=None, error_feedback=True, error_decay=beta, residual_dtype=residual_dtype
  )
  params = {"w": jnp.zeros((64, 32))}
  state = tx.init(params)
  keys = jax.random.split(jax.random.key(4), 3)
  e = np.zeros((64, 32), np.float32)
  tol = {jnp.float32: 1e-6, jnp.bfloat16: 2e-2, "int8": 2e-2}[residual_dtype]
  for key in keys:
    g = jax.random.normal(key, (64, 32))
    held = jc.codecs.ChunkedTopK(0.1, chunk_size=256)
    x = np.asarray(g) + beta * e
    sent = np.asarray(held.decode(held.encode(jnp.asarray(x))))
    out, state = tx.update({"w": g}, state, params)
    np.testing.assert_allclose(out["w"], sent, rtol=1e-6, atol=1e-6)
    r = np.asarray(pipeline.load_residual(state.residual["w"], state.residual_scale["w"]))
    np.testing.assert_allclose(r, x - sent, rtol=0, atol=tol * np.abs(x).max())
    e = r


def test_pmap_replicas_agree_on_the_anchor():
  """Under jax.pmap (state per device already): after each sync every replica sits on
  the same anchor, and the residuals differ between devices."""
  tx = jc.sparseloco(optax.sgd(0.25), sync_every=2, axis_name=AXIS, density=0.05, chunk_size=512)
  centres = _centres(seed=5)

  def step(p, state, c):
    updates, state = tx.update(_quadratic_grads(p, c), state, p)
    return optax.apply_updates(p, updates), state

  p = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(p)
  step = jax.pmap(step, axis_name=AXIS)
  for _ in range(4):
    p, state = step(p, state, centres)
  for n in SHAPES:
    np.testing.assert_allclose(p[n], np.broadcast_to(state.anchor[n][0], p[n].shape), atol=1e-7)
    np.testing.assert_array_equal(state.anchor[n], np.broadcast_to(state.anchor[n][0], p[n].shape))
  e = np.asarray(state.exchange_state[0].inner.residual["w"])
  assert np.abs(e).max() > 0 and not np.allclose(e[0], e[1])
