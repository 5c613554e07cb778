"""wire_report: bytes read from the traced collectives, and the ratios they imply."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jaxcomp as jc
from tests import helpers
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
  q4_ag = _report(jc.qsgd(bits=4, bucket_size=512, axis_name=AXIS, collective="allgather"))
  # all_gather: (K-1)·B against 2(K-1)/K·4n: 2/K x the codec's ratio = 1.97x.
  assert q4_ag.ratio == pytest.approx(2 / 8 * 32 / (4 + 32 / 512), rel=1e-3)
  ident = _report(jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="two_phase"))
  assert ident.ratio == pytest.approx(1.0)


def test_bytes_are_the_payload_arrays():
  codec = jc.codecs.QSGD(7, 512, "max")
  report = _report(jc.compress(codec, axis_name=AXIS, collective="allgather"))
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
  gather = np.array(
    [
      _report(jc.qsgd(bits=4, axis_name=AXIS, collective="allgather"), k=k).bytes_received
      for k in ks
    ]
  )
  np.testing.assert_allclose(gather / (np.array(ks) - 1), gather[0], rtol=1e-9)


def test_dense_leaves_are_counted_as_psum():
  params = {
    "w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
    "b": jax.ShapeDtypeStruct((64,), jnp.float32),
  }
  report = _report(jc.qsgd(axis_name=AXIS, collective="allgather"), params)
  psums = [op for op in report.ops if op.primitive.startswith("psum")]
  assert len(psums) == 1 and psums[0].operand_bytes == 64 * 4
  assert psums[0].bytes_received == pytest.approx(2 * 7 / 8 * 256)
  assert "ratio" in str(report)


def test_wire_report_needs_an_axis():
  with pytest.raises(ValueError):
    jc.wire_report(jc.qsgd(axis_name=None), BIG, axis_name=None, num_devices=8)


@helpers.NOTHING_COMPRESSED
def test_dense_baseline_is_in_each_leafs_own_dtype():
  """The dense baseline prices each leaf in its dtype: 2 bytes a value for bfloat16. A
  dense exchange of a bfloat16 model (the filter leaves every leaf out) is then 1.00x,
  and 4-bit QSGD of a bfloat16 matrix half its float32 ratio."""
  n = 1024 * 1024
  mixed = {
    "w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
    "v": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
  }
  q4 = _report(jc.qsgd(bits=4, bucket_size=512, axis_name=AXIS, collective="two_phase"), mixed)
  assert q4.dense_bytes == 2 * 7 / 8 * (2 + 4) * n
  assert "dense bfloat16/float32" in str(q4)
  bf16 = {"w": mixed["w"]}
  dense = _report(
    jc.compress(jc.codecs.Identity(), axis_name=AXIS, filter=lambda path, leaf: False), bf16
  )
  assert dense.bytes_received == dense.dense_bytes == 2 * 7 / 8 * 2 * n
  assert dense.ratio == 1.0 and "dense bfloat16" in str(dense)
  q4_bf16 = _report(jc.qsgd(bits=4, bucket_size=512, axis_name=AXIS, collective="two_phase"), bf16)
  assert q4_bf16.ratio == pytest.approx(16 / (4 + 32 / 512), rel=1e-3)  # 3.94x
  scattered = jc.wire_report(
    jc.qsgd(bits=4, axis_name=AXIS, collective="reduce_scatter", param_specs={"w": P(AXIS)}),
    bf16,
    axis_name=AXIS,
    num_devices=8,
    param_specs={"w": P(AXIS)},
  )
  assert scattered.dense_bytes == 7 / 8 * 2 * n  # a bfloat16 psum_scatter


def test_step_wire_report_baseline_is_the_baseline_steps_own_bytes():
  """jc.step_wire_report reads the baseline's bytes off its trace: a bfloat16 dense FSDP
  gather costs (K-1)·2 bytes a value of the shard, not float32's 4."""
  shard = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
  report = jc.step_wire_report(
    lambda s: jc.gather_weights(s, axis_name=AXIS, codec=jc.codecs.BlockInt8()),
    shard,
    axis_name=AXIS,
    num_devices=8,
    baseline=lambda s: jax.lax.all_gather(s, AXIS, tiled=True),
  )
  assert report.dense_bytes == 7 * 128 * 64 * 2
  assert report.bytes_received == 7 * (128 * 64 + 4 * 32)  # int8 codes, 32 float32 scales


#: Each exchanging factory at its defaults (the axis given) and the explicit collective
#: its "auto" default stands for on 8 devices; on 2 devices every one all-gathers.
DEFAULTS_AT_8 = {
  "compress": (lambda **kw: jc.compress(jc.codecs.QSGD(7, 512, "max"), **kw), "two_phase"),
  "qsgd4": (lambda **kw: jc.qsgd(bits=4, **kw), "two_phase"),
  "qsgd2": (lambda **kw: jc.qsgd(bits=2, bucket_size=128, **kw), "two_phase"),
  # Sparse codecs have no two-phase route: the all-gather at every K.
  "sparsify": (lambda **kw: jc.sparsify(density=0.05, **kw), "allgather"),
  "topk": (lambda **kw: jc.compress(jc.codecs.TopK(0.01), **kw), "allgather"),
  # A 1024x1024 leaf at 0.1%: the chunked exchange moves fewer bytes on 8 devices.
  "dgc": (lambda **kw: jc.dgc(0.001, **kw), "chunked"),
}


@pytest.mark.parametrize("name", sorted(DEFAULTS_AT_8))
def test_defaults_take_the_route_with_fewer_bytes(name):
  """The default collective is the route that pays at the device count: on 8 devices
  the two-phase (DGC: chunked) exchange where the method has one, exactly its bytes; on
  2 devices the all-gather, exactly its bytes."""
  make, at_8 = DEFAULTS_AT_8[name]
  default8 = _report(make(axis_name=AXIS)).bytes_received
  assert default8 == _report(make(axis_name=AXIS, collective=at_8)).bytes_received
  default2 = _report(make(axis_name=AXIS), k=2).bytes_received
  assert default2 == _report(make(axis_name=AXIS, collective="allgather"), k=2).bytes_received
  # Where "auto" takes another route on 8 devices, it is the cheaper one.
  gathered8 = _report(make(axis_name=AXIS, collective="allgather")).bytes_received
  assert default8 <= gathered8
  if at_8 != "allgather":
    assert default8 < 0.5 * gathered8


def test_qsgd4_default_gives_the_two_phase_ratio():
  """The choosing guide's promise for jc.qsgd(bits=4): 4 bits and a float32 per 512
  values, both phases: 32 / (4 + 32/512) = 7.88x fewer bytes than a dense pmean on 8
  devices, not the all-gather's 2/K of it (1.97x)."""
  report = _report(jc.qsgd(bits=4, axis_name=AXIS))
  assert report.ratio == pytest.approx(32 / (4 + 32 / 512), rel=1e-3)


def test_dgc_auto_chooses_per_leaf():
  """On 8 devices a large leaf is chunked and a small one all-gathered: each leaf takes
  the exchange that moves fewer bytes for it, and the default's bytes are the sum."""
  params = {
    "big": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
    "small": jax.ShapeDtypeStruct((64, 64), jnp.float32),
  }
  auto = _report(jc.dgc(0.001, axis_name=AXIS), params).bytes_received
  per_leaf = []
  for name, leaf in params.items():
    one = {name: leaf}
    per_leaf.append(
      min(
        _report(jc.dgc(0.001, axis_name=AXIS, collective=c), one).bytes_received
        for c in ("allgather", "chunked")
      )
    )
  assert auto == sum(per_leaf)
  small = {"small": params["small"]}
  assert (
    _report(jc.dgc(0.001, axis_name=AXIS), small).bytes_received
    == _report(jc.dgc(0.001, axis_name=AXIS, collective="allgather"), small).bytes_received
  )


def test_shared_random_k_defaults_to_psum():
  """Summable payloads (RandomK with shared indices) are all-reduced by default: their
  values only, 2(K-1)/K times, fewer bytes than all-gathering values and indices."""
  codec = jc.codecs.RandomK(0.01, shared=True)
  auto = _report(jc.compress(codec, axis_name=AXIS))
  psum = _report(jc.compress(codec, axis_name=AXIS, collective="psum"))
  gather = _report(jc.compress(codec, axis_name=AXIS, collective="allgather"))
  assert auto.bytes_received == psum.bytes_received < gather.bytes_received


def test_dgc_ratios_match_the_arithmetic_for_k8():
  """docs/guides/wire_accounting.md's DGC rows: a 1024x1024 leaf at 0.1% on 8 devices.
  Chunked (the default there): the 2048 chunk norms and ceil(1049/512) = 3 chunks of
  512, two all-reduces; all-gathered: 7 payloads of 1049 (float32, int32) pairs."""
  n, k = 1024 * 1024, 8
  dense = 2 * (k - 1) / k * 4 * n
  auto = _report(jc.dgc(0.001, axis_name=AXIS))
  assert auto.bytes_received == 2 * (k - 1) / k * 4 * (2048 + 3 * 512)
  assert auto.ratio == pytest.approx(dense / (2 * (k - 1) / k * 4 * 3584))  # 292.6x
  gathered = _report(jc.dgc(0.001, axis_name=AXIS, collective="allgather"))
  assert gathered.bytes_received == (k - 1) * 1049 * 8  # 124.9x
