"""wire_report: bytes read from the traced collectives, and the ratios they imply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from tests.helpers import AXIS

BIG = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}  # traced only, never built


def _report(tx, params=BIG, k=8):
  return jc.wire_report(tx, params, axis_name=AXIS, num_devices=k)


def test_ratios_match_the_arithmetic_for_k8():
  n = 1024 * 1024
  dense = 2 * 7 / 8 * 4 * n
  q4 = _report(jc.qsgd(bits=4, bucket_size=512, axis_name=AXIS, collective="two_phase"))
  # 4 bits + one float32 per 512 values, both phases: 32 / (4 + 32/512) = 7.88x.
  assert q4.dense_bytes == dense
  assert q4.ratio == pytest.approx(32 / (4 + 32 / 512), rel=1e-3)
  onebit = _report(jc.onebit_sgd(axis_name=AXIS))
  assert onebit.ratio == pytest.approx(32 / (1 + 64 / 1024), rel=1e-3)  # 30.1x
  q4_ag = _report(jc.qsgd(bits=4, bucket_size=512, axis_name=AXIS))
  # all_gather: (K-1)·B against 2(K-1)/K·4n: 2/K x the codec's ratio = 1.97x.
  assert q4_ag.ratio == pytest.approx(2 / 8 * 32 / (4 + 32 / 512), rel=1e-3)
  ident = _report(jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="two_phase"))
  assert ident.ratio == pytest.approx(1.0)


def test_bytes_are_the_payload_arrays():
  codec = jc.codecs.QSGD(7, 512, "max")
  report = _report(jc.compress(codec, axis_name=AXIS))
  payload = jax.eval_shape(lambda x: codec.encode(x, key=jax.random.key(0)), BIG["w"])
  per_array = sorted(a.size * a.dtype.itemsize for a in jax.tree.leaves(payload))
  gathered = [op.operand_bytes for op in report.ops if "all_gather" in op.primitive]
  assert gathered == [sum(per_array)]  # the payload's arrays, fused into one collective
  assert sum(per_array) * 8 == codec.wire_bits((1024, 1024))
  assert report.bytes_received == 7 * sum(per_array)


@pytest.mark.parametrize(
  "make",
  [
    lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="two_phase"),
    lambda: jc.onebit_sgd(axis_name=AXIS),
  ],
)
def test_two_phase_is_flat_in_k_and_allgather_linear(make):
  ks = [2, 4, 8, 32, 128, 512]
  two_phase = np.array([_report(make(), k=k).bytes_received for k in ks])
  one_payload = _report(make(), k=2).bytes_received  # 2(K-1)/K = 1 payload at K=2
  # 2(K-1)/K·B rises from B to 2B and no further (up to chunk padding).
  assert np.all(two_phase <= 2.05 * one_payload)
  assert two_phase[-1] / two_phase[-3] < 1.1
  gather = np.array([_report(jc.qsgd(bits=4, axis_name=AXIS), k=k).bytes_received for k in ks])
  np.testing.assert_allclose(gather / (np.array(ks) - 1), gather[0], rtol=1e-9)


def test_dense_leaves_are_counted_as_psum():
  params = {
    "w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
    "b": jax.ShapeDtypeStruct((64,), jnp.float32),
  }
  report = _report(jc.qsgd(axis_name=AXIS), params)
  psums = [op for op in report.ops if op.primitive.startswith("psum")]
  assert len(psums) == 1 and psums[0].operand_bytes == 64 * 4
  assert psums[0].bytes_received == pytest.approx(2 * 7 / 8 * 256)
  assert "ratio" in str(report)


def test_wire_report_needs_an_axis():
  with pytest.raises(ValueError):
    jc.wire_report(jc.qsgd(), BIG, axis_name=None, num_devices=8)
