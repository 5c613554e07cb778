"""Tests of jc.network: the α-β cost model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from tests import helpers

net = jc.network


@pytest.mark.parametrize(
  "primitive, k, want_steps, want_traffic",
  [
    ("psum", 2, 2, 1000.0),
    ("psum", 8, 14, 1750.0),
    ("all_gather", 8, 7, 7000.0),
    ("all_to_all", 8, 7, 875.0),
    ("psum_scatter", 4, 3, 750.0),
    ("ppermute", 16, 1, 1000.0),
    ("pmax", 2, 2, 1000.0),
    # names jax also gives the same collectives (wire.canonical)
    ("psum_invariant", 8, 14, 1750.0),
    ("psum2", 2, 2, 1000.0),
    ("all_gather_invariant", 8, 7, 7000.0),
    ("reduce_scatter", 4, 3, 750.0),
  ],
)
def test_steps_and_traffic(primitive, k, want_steps, want_traffic):
  assert net.steps(primitive, k) == want_steps
  assert net.traffic(primitive, 1000, k) == pytest.approx(want_traffic)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="unknown collective"):
    net.steps("broadcast", 4)
  with pytest.raises(ValueError, match=">= 2"):
    net.traffic("psum", 10, 1)
  with pytest.raises(ValueError, match="bandwidth"):
    net.Link(1e-6, 0.0)
  with pytest.raises(ValueError, match="latency"):
    net.Link(-1.0, 1e9)
  with pytest.raises(ValueError, match="two distinct sizes"):
    net.fit_link([("psum", 100, 2, 1e-3), ("psum", 100, 2, 1.1e-3)])


def test_collective_time():
  link = net.Link(latency_s=1e-4, bandwidth=1e8)
  # psum of 8 MB over 4 devices: 6 rounds, 2*3/4*8e6 = 1.2e7 bytes.
  assert link.collective_time("psum", 8e6, 4) == pytest.approx(6e-4 + 0.12)


def test_fit_link_recovers_parameters():
  true = net.Link(latency_s=2e-4, bandwidth=1.25e8)
  sizes = [2**p for p in range(10, 26, 2)]
  samples = [("psum", b, 2, true.collective_time("psum", b, 2)) for b in sizes]
  fit = net.fit_link(samples)
  assert fit.latency_s == pytest.approx(true.latency_s, rel=1e-9)
  assert fit.bandwidth == pytest.approx(true.bandwidth, rel=1e-9)
  # With 3% multiplicative noise the fit stays within ~10% (30 samples).
  rng = np.random.default_rng(0)
  noisy = [(p, b, k, t * (1 + 0.03 * rng.standard_normal())) for p, b, k, t in samples * 4]
  fit = net.fit_link(noisy)
  assert fit.latency_s == pytest.approx(true.latency_s, rel=0.15)
  assert fit.bandwidth == pytest.approx(true.bandwidth, rel=0.05)


def test_fit_link_clips_negative_latency():
  # Timings proportional to bytes with a slight sub-linear start: alpha would be < 0.
  samples = [
    ("psum", b, 2, b / 1e8 * (0.9 if b < 2**12 else 1.0)) for b in (2**10, 2**11, 2**20, 2**22)
  ]
  fit = net.fit_link(samples)
  assert fit.latency_s == 0.0
  assert fit.bandwidth == pytest.approx(1e8, rel=0.1)


@helpers.NOTHING_COMPRESSED
def test_exchange_time_prices_every_collective_of_a_report():
  params = {
    "w": jax.ShapeDtypeStruct((4096,), jnp.float32),
    "b": jax.ShapeDtypeStruct((16,), jnp.float32),
  }
  link = net.Link(latency_s=1e-5, bandwidth=1e9)
  tx = jc.qsgd(bits=4, axis_name="b", collective="two_phase")
  for k in (2, 8, 1024):
    report = jc.wire_report(tx, params, axis_name="b", num_devices=k)
    want = sum(
      op.count
      * (net.steps(op.primitive, k) * 1e-5 + net.traffic(op.primitive, op.operand_bytes, k) / 1e9)
      for op in report.ops
      if not op.fallback
    )
    assert net.exchange_time(report, link) == pytest.approx(want)
    # The traffic part is the report's byte count at the link's bandwidth.
    zero_latency = net.Link(0.0, 1e9)
    assert net.exchange_time(report, zero_latency) == pytest.approx(report.bytes_received / 1e9)
    step = net.predict_step_time(0.25, report, link)
    assert step == pytest.approx(0.25 + want)
    assert net.compute_time(step, report, link) == pytest.approx(0.25)


def test_exchange_time_fallback_ops_are_apart():
  params = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
  tx = jc.compress(
    jc.codecs.EliasQSGD(7, 512, "max"),
    axis_name="b",
    filter=lambda p, x: True,
    collective="allgather",
  )
  report = jc.wire_report(tx, params, axis_name="b", num_devices=4)
  assert any(op.fallback for op in report.ops)
  link = net.Link(0.0, 1e9)
  regular = net.exchange_time(report, link)
  assert regular == pytest.approx(report.bytes_received / 1e9)
  assert net.exchange_time(report, link, fallback=True) == pytest.approx(
    (report.bytes_received + report.fallback_bytes) / 1e9
  )


def test_links_per_primitive_price_only_their_collectives():
  params = {
    "w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
    "b": jax.ShapeDtypeStruct((16,), jnp.float32),
  }
  # two_phase at K=8: all_to_all and all_gather of the payloads, a psum of the bias
  tx = jc.qsgd(bits=4, axis_name="b", collective="two_phase")
  report = jc.wire_report(tx, params, axis_name="b", num_devices=8)
  primitives = {op.primitive for op in report.ops if not op.fallback}
  gathers = {"all_gather", "all_gather_invariant"}  # jax names it either way
  assert primitives & gathers and primitives - gathers
  link, slow = net.Link(1e-5, 1e9), net.Link(3e-5, 2e8)
  want = sum(
    op.count
    * (slow if op.primitive in gathers else link).collective_time(op.primitive, op.operand_bytes, 8)
    for op in report.ops
    if not op.fallback
  )
  got = net.exchange_time(report, link, links={"all_gather": slow})
  assert got == pytest.approx(want) and got > net.exchange_time(report, link)
  assert net.exchange_time(report, link, links={}) == net.exchange_time(report, link)
  step = net.predict_step_time(0.1, report, link, links={"all_gather": slow})
  assert step == pytest.approx(0.1 + want)
  assert net.compute_time(step, report, link, links={"all_gather": slow}) == pytest.approx(0.1)
  with pytest.raises(ValueError, match="unknown collective"):
    net.exchange_time(report, link, links={"allgather": slow})
  with pytest.raises(TypeError, match="Link"):
    net.exchange_time(report, link, links={"all_gather": (1e-5, 1e9)})


# ----------------------------------------------------------------------------- a link per axis

FAST = net.Link(latency_s=1e-6, bandwidth=1e11)
SLOW = net.Link(latency_s=1e-4, bandwidth=1e8)
BY_AXIS = {"gpu": FAST, "node": SLOW}


def _report(*ops):
  ops = tuple(ops)
  received = sum(op.bytes_received for op in ops)
  return jc.WireReport(
    num_devices=8, bytes_sent=received, bytes_received=received, dense_bytes=0.0, ops=ops
  )


def _op(primitive, operand_bytes, axes, devices, count=1):
  # bytes_received is not what the model prices; any number does.
  return jc.CollectiveOp(primitive, operand_bytes, count, 0.0, axes=axes, devices=devices)


def test_each_collective_on_the_link_of_its_axis():
  # A two-level exchange by hand, N = 2 nodes of L = 4: reduce-scatter and all-gather
  # over gpu (K = 4) on the fast link, the shards' all-gather over node (K = 2) on the
  # slow one, twice a step.
  report = _report(
    _op("psum_scatter", 4_000_000, ("gpu",), 4),
    _op("all_gather", 125_000, ("node",), 2, count=2),
    _op("all_gather", 1_000_000, ("gpu",), 4),
  )
  want = (
    (3 * 1e-6 + 0.75 * 4e6 / 1e11)  # psum_scatter: 3 rounds, 3/4·B
    + 2 * (1 * 1e-4 + 1 * 125e3 / 1e8)  # all_gather over 2 nodes: 1 round, B
    + (3 * 1e-6 + 3 * 1e6 / 1e11)  # all_gather over 4 devices: 3 rounds, 3·B
  )
  assert net.exchange_time(report, BY_AXIS) == pytest.approx(want, rel=1e-12)
  assert net.predict_step_time(0.5, report, BY_AXIS) == pytest.approx(0.5 + want, rel=1e-12)
  assert net.compute_time(0.5 + want, report, BY_AXIS) == pytest.approx(0.5, rel=1e-9)
  # One link for all: the slow one prices the fast collectives too.
  assert net.exchange_time(report, SLOW) > 10 * want


def test_a_collective_over_both_axes_is_priced_on_the_slowest_link():
  # A flat psum over (gpu, node), K = 8: 14 rounds and 2·7/8·B on the slow link.
  report = _report(_op("psum", 8_000_000, ("gpu", "node"), 8))
  want = 14 * 1e-4 + 1.75 * 8e6 / 1e8
  assert net.exchange_time(report, BY_AXIS) == pytest.approx(want, rel=1e-12)
  assert net.exchange_time(report, BY_AXIS) == pytest.approx(net.exchange_time(report, SLOW))
  # The slowest per collective: a link slow in latency only wins for tiny operands.
  laggy = {"gpu": net.Link(latency_s=1.0, bandwidth=1e11), "node": SLOW}
  tiny = _report(_op("psum", 8, ("gpu", "node"), 8))
  assert net.exchange_time(tiny, laggy) == pytest.approx(14 * 1.0 + 1.75 * 8 / 1e11)


def test_links_by_axis_errors():
  report = _report(_op("psum", 1000, ("gpu", "node"), 8))
  with pytest.raises(ValueError, match="no link for mesh axes"):
    net.exchange_time(report, {"gpu": FAST})
  with pytest.raises(TypeError, match="must be a jc.network.Link"):
    net.exchange_time(report, {"gpu": FAST, "node": 1e8})
  with pytest.raises(ValueError, match="empty"):
    net.exchange_time(report, {})
  with pytest.raises(ValueError, match="per primitive"):
    net.exchange_time(report, BY_AXIS, links={"psum": SLOW})
  # Axes not recorded: the slowest link of the mapping.
  bare = _report(_op("psum", 1000, (), 0))
  assert net.exchange_time(bare, BY_AXIS) == pytest.approx(net.exchange_time(bare, SLOW))


def test_two_level_report_on_a_fast_and_a_slow_link():
  # The reports of jc.wire_report on an abstract (node, gpu) mesh: two-level sends its
  # compressed shards over the slow link and so beats the flat exchange there, and its
  # time is its ops' times, each at its axis's devices on its axis's link.
  n, l = 4, 8
  mesh = jax.sharding.AbstractMesh((n, l), ("node", "gpu"))
  params = {"w": jnp.zeros((512, 256))}
  kw = dict(axis_name=("node", "gpu"), num_devices=n * l, mesh=mesh)
  two = jc.wire_report(
    jc.two_level(jc.qsgd(bits=4, axis_name="node"), fast_axis="gpu"), params, **kw
  )
  flat = jc.wire_report(jc.qsgd(bits=4, axis_name=("node", "gpu")), params, **kw)
  by_hand = 0.0
  for op in two.ops:
    link = BY_AXIS[op.axes[0]]
    assert len(op.axes) == 1 and op.devices == (n if op.axes == ("node",) else l)
    by_hand += op.count * link.collective_time(op.primitive, op.operand_bytes, op.devices)
  assert net.exchange_time(two, BY_AXIS) == pytest.approx(by_hand, rel=1e-12)
  assert net.exchange_time(two, BY_AXIS) < net.exchange_time(flat, BY_AXIS)
  assert net.exchange_time(flat, BY_AXIS) == pytest.approx(net.exchange_time(flat, SLOW))
