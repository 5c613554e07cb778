"""1-bit SGD (``jc.onebit_sgd``, docs/methods/onebit_sgd.md): OneBit with one pair of
reconstruction values per matrix column (§3).

Every path compress offers for it (local, all-gather and two-phase, with error feedback,
under shard_map and pmap) is checked against a float64 numpy computation of the
per-column means, step by step.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp as jc
from tests import _docs_blocks
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

C = jc.codecs
PER_COLUMN = C.OneBit(per_column=True)


def _matrix(shape):
  return (1, 1) if not shape else (shape[0], math.prod(shape[1:]))


def _qcol(x):
  """float64 1-bit SGD quantization of x's matrix view, one (pos, neg) mean per column."""
  x = np.asarray(x, np.float64)
  m, n = _matrix(x.shape)
  v = x.reshape(m, n)
  nonneg = v >= 0  # -0.0 and +0.0 join the non-negative group
  pos_count, neg_count = nonneg.sum(0), (~nonneg).sum(0)
  pos = np.where(pos_count > 0, np.where(nonneg, v, 0).sum(0) / np.maximum(pos_count, 1), 0)
  neg = np.where(neg_count > 0, np.where(nonneg, 0, v).sum(0) / np.maximum(neg_count, 1), 0)
  return np.where(nonneg, pos[None, :], neg[None, :]).reshape(x.shape)


def _qseg(x, r):
  """:func:`_qcol` with each column cut into r segments of m / r rows, a pair of means each."""
  x = np.asarray(x, np.float64)
  m, n = _matrix(x.shape)
  segs = x.reshape(r, m // r, n).transpose(1, 0, 2).reshape(m // r, r * n)
  return _qcol(segs).reshape(m // r, r, n).transpose(1, 0, 2).reshape(x.shape)


def _data(shape, seed):
  """Normal values with sign-dominated columns, exact zeros and -0.0."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  m, n = _matrix(shape)
  v = x.reshape(m, n)
  if n > 2:
    v[:, 0] = -np.abs(v[:, 0]) - 100.0  # all negative
    v[:, 1] = np.abs(v[:, 1])  # all non-negative
    v[: m // 2, 2] = 0.0
    v[m // 2 :, 2] = -0.0
  return v.reshape(shape).astype(np.float32)


# ----------------------------------------------------------------------------- the codec

SHAPES = [(6, 5), (64, 48), (33, 7), (3, 4, 5), (40,), (1, 9), (), (0,), (3, 0)]


def test_codec_decodes_to_the_per_column_means():
  xs = {shape: _data(shape, seed=i) for i, shape in enumerate(SHAPES)}

  @jax.jit  # one compilation for all shapes
  def run(xs):
    return {s: PER_COLUMN.decode(PER_COLUMN.encode(x)) for s, x in xs.items()}

  for shape, out in run({s: jnp.asarray(x) for s, x in xs.items()}).items():
    out = np.asarray(out, np.float64)
    assert out.shape == shape
    np.testing.assert_allclose(out, _qcol(xs[shape]), rtol=2e-6, atol=0, err_msg=str(shape))
    # exactly two values per column, signs kept, column sums preserved
    m, n = _matrix(shape)
    x2, o2 = xs[shape].astype(np.float64).reshape(m, n), out.reshape(m, n)
    for j in range(n):
      assert len(np.unique(o2[:, j])) <= 2
    assert np.all(o2[x2 < 0] < 0) and np.all(o2[x2 >= 0] >= 0)
    np.testing.assert_allclose(o2.sum(0), x2.sum(0), rtol=1e-5, atol=1e-5 * np.abs(x2).sum())


def test_columns_not_consecutive_buckets():
  # Negative control: the same codec with buckets of m consecutive values (rows of the
  # transposed layout are not columns) decodes differently.
  x = _data((16, 12), seed=3)
  per_column = np.asarray(PER_COLUMN.decode(PER_COLUMN.encode(jnp.asarray(x))))
  rows = np.asarray(C.OneBit(16).decode(C.OneBit(16).encode(jnp.asarray(x))))
  np.testing.assert_allclose(per_column, _qcol(x), rtol=2e-6)
  assert np.max(np.abs(rows - _qcol(x))) > 0.1


@pytest.mark.parametrize("shape", [(6, 5), (64, 48), (33, 7), (3, 4, 5), (40,), (1000, 3)])
def test_payload_bits_from_the_arrays(shape):
  m, n = _matrix(shape)
  payload = jax.eval_shape(PER_COLUMN.encode, jax.ShapeDtypeStruct(shape, jnp.float32))
  bits = 8 * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(payload))
  # Signs packed column after column (one padding of at most 31 bits in all), and a
  # float32 pair per column.
  assert bits <= m * n + 64 * n + 31
  assert bits == 32 * math.ceil(m * n / 32) + 64 * n
  assert payload.arrays["pos"].shape == payload.arrays["neg"].shape == (n,)
  assert PER_COLUMN.wire_bits(shape) == bits
  assert PER_COLUMN.wire_bits(shape, jnp.bfloat16) == bits


@pytest.mark.parametrize("implementation", [None, "xla", "pallas", "native"])
def test_per_column_runs_on_xla(implementation):
  codec = C.OneBit(implementation=implementation, per_column=True)
  assert codec.kernel_backend(4096) is None and not codec.uses_kernel(4096)
  assert not codec.fuses_feedback(4096, jnp.float32)


def test_arguments():
  assert C.OneBit(128, "xla") == C.OneBit(bucket_size=128, implementation="xla")  # positional
  assert C.OneBit(per_column=True) != C.OneBit()
  assert len({C.OneBit(per_column=True), C.OneBit(per_column=True), C.OneBit()}) == 2
  with pytest.raises(ValueError, match="bucket_size"):
    C.OneBit(64, per_column=True)
  with pytest.raises(TypeError, match="per_column"):
    C.OneBit(per_column="yes")
  with pytest.raises(TypeError):
    C.OneBit(None, None, True)  # keyword only
  with pytest.raises(ValueError, match="per_column"):
    jc.onebit_sgd(per_column=True, bucket_size=256, axis_name=None)
  with pytest.raises(ValueError, match="per_column"):
    jc.onebit_sgd(per_column=True, bucket_size=1024, axis_name=None)  # an explicit 1024 too
  jc.onebit_sgd(per_column=True, axis_name=None)
  jc.onebit_sgd(per_column=True, bucket_size=None, axis_name=None)
  jc.onebit_sgd(bucket_size=1024, axis_name=None)


def test_chunks_are_blocks_of_whole_columns():
  x = jnp.arange(5 * 13, dtype=jnp.float32).reshape(5, 13)
  chunks = PER_COLUMN.to_chunks(x, 4)
  assert PER_COLUMN.chunk_shape((5, 13), 4) == (5, 4)
  assert chunks.shape == (4, 5, 4)
  for j in range(4):
    cols = np.asarray(x)[:, 4 * j : 4 * j + 4]
    want = np.pad(cols, ((0, 0), (0, 4 - cols.shape[1])))  # zero columns past the end
    np.testing.assert_array_equal(np.asarray(chunks[j]), want)
  np.testing.assert_array_equal(np.asarray(PER_COLUMN.from_chunks(chunks, (5, 13))), x)
  y = jnp.arange(3 * 4 * 5, dtype=jnp.float32).reshape(3, 4, 5)
  np.testing.assert_array_equal(
    np.asarray(PER_COLUMN.from_chunks(PER_COLUMN.to_chunks(y, 8), y.shape)), y
  )
  # The flat codecs keep their flat, aligned chunks.
  assert C.OneBit(64).chunk_shape((5, 13), 4) == (32,)


def test_columns_fewer_than_devices_are_cut_into_segments():
  """Where K does not divide the columns, chunks of whole columns would carry zero
  columns: each column is cut into r segments of m / r rows instead, segment s of column
  j being segment column j r + s, dealt out in blocks as whole columns are."""
  assert PER_COLUMN.column_segments((1024, 3), 8) == 8  # 24 segments, 3 per device
  assert PER_COLUMN.chunk_shape((1024, 3), 8) == (128, 3)
  assert PER_COLUMN.column_segments((4096,), 8) == 8
  assert PER_COLUMN.column_segments((256, 64), 8) == 1  # K divides n: whole columns
  assert PER_COLUMN.column_segments((5, 13), 4) == 1  # no divisor of 5 up to 4 but 1
  assert C.OneBit(64).column_segments((1024, 3), 8) == 1
  x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  r = PER_COLUMN.column_segments(x.shape, 8)
  ms, c = PER_COLUMN.chunk_shape(x.shape, 8)
  assert (r, ms, c) == (2, 8, 1)  # 6 segments of 8 (a word and two means each), 2 zero
  chunks = np.asarray(PER_COLUMN.to_chunks(jnp.asarray(x), 8))
  for j in range(8):
    for i in range(c):
      col, seg = divmod(j * c + i, r)
      want = x[seg * ms : (seg + 1) * ms, col] if col < x.shape[1] else 0.0  # zero padding
      np.testing.assert_array_equal(chunks[j][:, i], want)
  np.testing.assert_array_equal(np.asarray(PER_COLUMN.from_chunks(chunks, x.shape)), x)
  # A segment's pair of means is its own: the decoded chunk is _qseg's quantization.
  y = _data((64, 3), 1)
  decoded = jax.vmap(lambda v: PER_COLUMN.decode(PER_COLUMN.encode(v), jnp.float32))(
    PER_COLUMN.to_chunks(jnp.asarray(y, jnp.float32), 8)
  )
  got = np.asarray(PER_COLUMN.from_chunks(decoded, y.shape), np.float64)
  np.testing.assert_allclose(got, _qseg(y, PER_COLUMN.column_segments(y.shape, 8)), rtol=1e-6)


# ----------------------------------------------------------------------------- the exchanges

PARAMS = {
  "w": jnp.zeros((32, 44)),  # 44 columns on 8 devices: chunks of 6, 4 padded
  "k": jnp.zeros((3, 8, 50)),  # rank 3: 400 columns of 3 values
  "b": jnp.zeros((96,)),  # a vector: one column, in 8 segments on the two-phase route
}
ALL = lambda path, leaf: True  # noqa: E731
STEPS = 3


def _grads(step):
  g = helpers.per_device_grads(
    jax.random.key(40 + step), {name: p.shape for name, p in PARAMS.items()}
  )
  g["w"] = g["w"] + 0.3  # columns with more of one sign
  return g


def _reference(collective, steps=STEPS):
  """The exchange in float64: per step, outputs; then the residuals."""
  e = {n: np.zeros((K, *p.shape)) for n, p in PARAMS.items()}
  r = {n: np.zeros(p.shape) for n, p in PARAMS.items()}
  outs = []
  for t in range(steps):
    g = jax.tree.map(lambda a: np.asarray(a, np.float64), _grads(t))
    out = {}
    for n, p in PARAMS.items():
      # two-phase: blocks of column segments (whole columns where K divides n)
      segs = PER_COLUMN.column_segments(p.shape, K) if collective == "two_phase" else 1
      x = g[n] + e[n]
      q = np.stack([_qseg(x[d], segs) for d in range(K)])
      e[n] = x - q
      avg = q.mean(0)
      if collective == "two_phase":  # chunk owners quantize the average again, with EF
        y = avg + r[n]
        out[n] = _qseg(y, segs)
        r[n] = y - out[n]
      else:
        out[n] = avg
    outs.append(out)
  return outs, e, r


def _assemble(chunk_residual, shape):
  """The per-device chunk residuals (K, m, c) as the (m, n) matrix they cover."""
  return np.asarray(PER_COLUMN.from_chunks(jnp.asarray(chunk_residual), shape))


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_shard_map_matches_the_hand_computation(collective):
  m = helpers.mesh()
  tx = jc.per_device_state(
    jc.onebit_sgd(per_column=True, axis_name=AXIS, collective=collective, filter=ALL)
  )
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  outs, e, r = _reference(collective)
  for t in range(STEPS):
    out, state = update(helpers.shard(_grads(t), m), state)
    for n in PARAMS:
      np.testing.assert_allclose(
        np.asarray(out[n], np.float64), outs[t][n], rtol=1e-5, atol=1e-5, err_msg=f"{n} step {t}"
      )
  inner = state.inner
  for n, p in PARAMS.items():
    np.testing.assert_allclose(np.asarray(inner.residual[n]), e[n], rtol=1e-5, atol=1e-5)
    if collective == "two_phase":
      cres = np.asarray(inner.chunk_residual[n])
      mm, cols = _matrix(p.shape)
      segs = PER_COLUMN.column_segments(p.shape, K)
      assert cres.shape == (K, mm // segs, -(-cols * segs // K))
      np.testing.assert_allclose(_assemble(cres, p.shape), r[n], rtol=1e-5, atol=1e-5)
      # the padding columns stay zero
      padding = cres.transpose(1, 0, 2).reshape(mm // segs, -1)[:, cols * segs :]
      np.testing.assert_array_equal(padding, 0.0)
    else:
      assert isinstance(inner.chunk_residual[n], optax.MaskedNode)


def test_local_matches_the_hand_computation():
  tx = jc.onebit_sgd(per_column=True, filter=ALL, axis_name=None)  # one device
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  e = {n: np.zeros(p.shape) for n, p in PARAMS.items()}
  for t in range(STEPS):
    g = {n: a[0] for n, a in _grads(t).items()}
    out, state = update(g, state)
    for n in PARAMS:
      x = np.asarray(g[n], np.float64) + e[n]
      want = _qcol(x)
      e[n] = x - want
      np.testing.assert_allclose(np.asarray(out[n], np.float64), want, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, state.residual), e, rtol=1e-5, atol=1e-5)


def test_pmap_equals_shard_map():
  tx = jc.onebit_sgd(per_column=True, axis_name=AXIS, filter=ALL)  # two-phase on 8
  state = jax.pmap(lambda _: tx.init(PARAMS), axis_name=AXIS)(jnp.arange(K))
  step = jax.pmap(tx.update, axis_name=AXIS)
  outs, _, _ = _reference("two_phase", steps=2)
  gathered, _, _ = _reference("allgather", steps=2)
  for t in range(2):
    out, state = step(_grads(t), state)
    for n in PARAMS:
      got = np.asarray(out[n])
      chex.assert_trees_all_equal(got[0], got[K - 1])
      # "auto" all-gathers the short vector (8 segments of 12 would cost more).
      want = gathered[t][n] if n == "b" else outs[t][n]
      np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_wire_report_counts_whole_columns():
  params = {"w": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
  report = jc.wire_report(
    jc.onebit_sgd(per_column=True, axis_name=AXIS), params, axis_name=AXIS, num_devices=K
  )
  # Each of the two phases moves one chunk of 8 columns per device pair: 256 x 8 signs
  # and 16 float32 per chunk.
  chunk = 256 * 8 // 8 + 16 * 4
  assert report.bytes_received == pytest.approx(2 * (K - 1) * chunk)


@pytest.mark.parametrize(
  "shape, collective, ratio",
  [
    ((4096,), "two_phase", 28.44),  # 8 segments of 512
    ((1024, 3), "two_phase", 21.33),  # 24 segments of 128
    ((1024, 7), "two_phase", 26.35),  # 7 whole columns and one zero column
    ((96,), "allgather", 4.80),  # 8 segments of 12: one word and two means each
  ],
)
def test_default_exchange_never_pays_more_than_the_allgather(shape, collective, ratio):
  """Fewer columns than devices: the two-phase exchange cuts the columns into segments
  rather than pad with zero columns (a (1024, 3) kernel on 8 devices: 21.3x fewer bytes
  than the dense all-reduce, where chunks of whole columns, 5 of 8 zeros, give 11.3x),
  and the default exchange ("auto") takes it only where its 2(K-1) chunk payloads cost
  less than the all-gather's K-1 whole payloads."""
  params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
  report = jc.wire_report(
    jc.onebit_sgd(per_column=True, axis_name=AXIS, filter=ALL),
    params,
    axis_name=AXIS,
    num_devices=K,
  )
  whole = PER_COLUMN.wire_bits(shape) // 8
  chunk = PER_COLUMN.wire_bits(PER_COLUMN.chunk_shape(shape, K)) // 8
  allgather = (K - 1) * whole
  assert report.bytes_received <= allgather
  want = allgather if collective == "allgather" else 2 * (K - 1) * chunk
  assert report.bytes_received == pytest.approx(want)
  assert report.ratio == pytest.approx(ratio, abs=0.01)


def test_the_pages_byte_table_is_what_its_code_prints():
  """docs/methods/onebit_sgd.md's bytes per leaf: its code, run as a reader runs it,
  prints the page's table to the byte (the bytes come from the payload arrays)."""
  page, section = "docs/methods/onebit_sgd.md", "Per-column layout, in every exchange"
  done = _docs_blocks.run_script(_docs_blocks.section_code(page, section))
  assert done.returncode == 0, done.stderr[-3000:]
  printed = [line for line in done.stdout.splitlines() if line.startswith("|")]
  assert printed == _docs_blocks.table_after(page, section)
