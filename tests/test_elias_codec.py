"""EliasQSGD: the on-device Elias encoder, its host decoder, and the overflow fallback."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs import elias
from jaxcomp._src.codecs import elias_codec
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K


@functools.cache
def _encode(codec):
  return jax.jit(lambda x, key: codec.encode_with_info(x, key=key))


@hypothesis.settings(max_examples=30)
@hypothesis.given(k=st.integers(1, 2**32 - 1))
def test_device_omega_code_matches_the_host_code(k):
  hi, lo, length = elias_codec.omega_code(jnp.asarray([k], jnp.uint32))
  bits = format(int(hi[0]), "032b") + format(int(lo[0]), "032b")
  want = "".join(str(int(b)) for b in elias.omega_encode(k))
  assert bits[: int(length[0])] == want
  assert int(length[0]) == len(want) == elias.omega_length(k)
  assert set(bits[int(length[0]) :]) <= {"0"}


@pytest.mark.parametrize(
  "n,bucket,levels,norm",
  [
    (1000, None, 31, "l2"),
    (1000, 128, 3, "l2"),
    (5000, 512, 7, "max"),
    (70, 32, 1, "l2"),
    (4096, None, 64, "l2"),
    (1, None, 1, "l2"),
  ],
)
def test_device_stream_is_bit_identical_to_the_host_stream(n, bucket, levels, norm):
  codec = jc.codecs.EliasQSGD(levels, bucket, norm, capacity=64.0)  # room for any stream
  x = jax.random.normal(jax.random.key(n), (n,))
  key = jax.random.key(1)
  payload, overflow = _encode(codec)(x, key)
  assert not bool(overflow)
  fixed = codec.fallback.encode(x, key=key)
  host = elias.qsgd_to_bytes(codec.fallback, fixed)
  used = int(payload.arrays["used_bits"])
  assert used == elias.stream_bits(codec.fallback, fixed)
  assert int.from_bytes(host[:4], "big") == used
  assert elias.words_to_bytes(np.asarray(payload.arrays["words"]), used).tobytes() == host[4:]
  # The host decoder inverts it: the same values as the fixed-width payload.
  np.testing.assert_array_equal(jax.jit(codec.decode)(payload), codec.fallback.decode(fixed))


def test_capacity_defaults_and_overflow_flag():
  n = 4096
  codec = jc.codecs.EliasQSGD(64)  # s = sqrt(n), l2, one bucket: the paper's setting
  cap = codec.capacity_bits(n)
  assert cap % 32 == 0
  assert 2.8 * n + 32 < cap <= 1.05 * (2.8 * n + 32) + 32 + elias.omega_length(n + 1)
  assert codec.wire_bits((n,)) == cap + 32  # the buffer and the used length
  assert codec.wire_bits((n,)) < codec.fallback.wire_bits((n,)) / 2.5
  x = jax.random.normal(jax.random.key(0), (n,))
  _, overflow = _encode(jc.codecs.EliasQSGD(64, capacity=1.0))(x, jax.random.key(0))
  assert bool(overflow)
  small, _ = _encode(jc.codecs.EliasQSGD(64, capacity=1.0))(x, jax.random.key(0))
  assert np.all(np.isnan(np.asarray(jc.codecs.EliasQSGD(64, capacity=1.0).decode(small))))
  with pytest.raises(ValueError):
    jc.codecs.EliasQSGD(64, capacity=0.0)
  with pytest.raises(ValueError):
    jc.codecs.EliasQSGD(0)


def test_flat_magnitudes_overflow_the_default_capacity():
  """The default buffer is sized by Corollary 3.3's 2.8n + 32, which Gaussian data meet;
  equal magnitudes take 3n + 33 bits at s = sqrt(n) and always overflow it (then the
  exchange sends the fixed-width payload). A capacity from dense_bound holds them."""
  n = 4096
  signs = jnp.where(jax.random.bernoulli(jax.random.key(2), 0.5, (n,)), -1.0, 1.0)
  alternating = signs * jnp.tile(jnp.array([2.0, 1.0]), n // 2)
  gaussian = jax.random.normal(jax.random.key(0), (n,))
  default = jc.codecs.EliasQSGD(64).capacity_bits(n)
  roomy = jc.codecs.EliasQSGD(64, capacity=1.05 * jc.elias.dense_bound(n, 64) / n)
  assert default < 3 * n + 33 < roomy.capacity_bits(n) < roomy.fallback.bits * n
  for key in jax.random.split(jax.random.key(1), 3):
    used = {}
    for name, x in [("signs", signs), ("alternating", alternating), ("gaussian", gaussian)]:
      payload, overflow = _encode(roomy)(x, key)
      assert not bool(overflow)
      used[name] = int(payload.arrays["used_bits"])
    assert used["signs"] == 3 * n + 33 > default  # overflows the default buffer
    assert used["alternating"] > default
    assert used["gaussian"] < 2.8 * n + 32 < default


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_allgather_exchange_and_fallback_under_shard_map(capacity):
  m = helpers.mesh()
  params = {"w": jnp.zeros((64, 64))}
  codec = jc.codecs.EliasQSGD(64, capacity=capacity)
  tx = jc.per_device_state(
    jc.compress(codec, axis_name=AXIS, filter=lambda p, x: True, collective="allgather")
  )
  ref = jc.per_device_state(
    jc.compress(codec.fallback, axis_name=AXIS, filter=lambda p, x: True, collective="allgather")
  )
  grads = helpers.shard(helpers.per_device_grads(jax.random.key(0), {"w": (64, 64)}), m)
  out, state = helpers.shard_map_update(tx, m, params)(grads, helpers.shard_map_init(tx, params, m))
  want, _ = helpers.shard_map_update(ref, m, params)(grads, helpers.shard_map_init(ref, params, m))
  # Same keys, same quantization: Elias-coded or fixed-width, the mean is the same.
  np.testing.assert_array_equal(out["w"], want["w"])
  overflowed = 1 if capacity else 0
  np.testing.assert_array_equal(state.inner.overflow_count, np.full((K,), overflowed))
  report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=K)
  coded = codec.wire_bits((64, 64)) // 8
  fixed = codec.fallback.wire_bits((64, 64)) // 8
  gathered = sum(
    op.bytes_received for op in report.ops if "all_gather" in op.primitive and not op.fallback
  )
  assert gathered == (K - 1) * coded
  assert report.fallback_bytes == (K - 1) * fixed
  assert "fallback" in str(report)


def test_elias_needs_allgather():
  with pytest.raises(ValueError, match="allgather"):
    jc.compress(jc.codecs.EliasQSGD(7), axis_name=AXIS, collective="two_phase")
