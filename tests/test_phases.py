"""jc.profile_phases: a compiled step's time split into gradient/encode/exchange/decode."""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.plumbing import phases
from tests.helpers import AXIS

SYNTHETIC_HLO = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_enc (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %c = f32[8]{0} broadcast(f32[] constant(2)), metadata={op_name="jit(step)/jaxcomp_decode/mul"}
  %a = f32[8]{0} add(%p0, %p0), metadata={op_name="jit(step)/jaxcomp_encode/add"}
  ROOT %m = f32[8]{0} multiply(%a, %c), metadata={op_name="jit(step)/jaxcomp_encode/mul"}
}

%fused_dec (p1: f32[8]) -> f32[8] {
  %p1 = f32[8]{0} parameter(0)
  ROOT %s = f32[8]{0} subtract(%p1, %p1), metadata={op_name="jit(step)/jaxcomp_encode/jaxcomp_decode/sub"}
}

%fused_grad (p2: f32[8]) -> f32[8] {
  %p2 = f32[8]{0} parameter(0)
  ROOT %t = f32[8]{0} tanh(%p2), metadata={op_name="jit(step)/transpose(jvp(Model))/tanh"}
}

%branch (b0: f32[8]) -> f32[8] {
  %b0 = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%b0), replica_groups={}, to_apply=%sum
}

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

ENTRY %main (arg: f32[8]) -> f32[8] {
  %arg = f32[8]{0} parameter(0)
  %enc_fusion = f32[8]{0} fusion(%arg), kind=kLoop, calls=%fused_enc
  %dec_fusion = f32[8]{0} fusion(%enc_fusion), kind=kLoop, calls=%fused_dec
  %grad_fusion = f32[8]{0} fusion(%dec_fusion), kind=kLoop, calls=%fused_grad
  %cond = f32[8]{0} conditional(pred[] constant(true), %grad_fusion, %grad_fusion), true_computation=%branch, false_computation=%branch
  ROOT %copy = f32[8]{0} copy(%cond), metadata={op_name="jit(step)/sgd/mul"}
}
"""


def test_op_phases_reads_scopes_collectives_and_autodiff():
  got = phases.op_phases(SYNTHETIC_HLO)
  assert phases.module_name(SYNTHETIC_HLO) == "jit_step"
  assert got["enc_fusion"] == "encode"  # two encode ops outvote a CSE'd decode constant
  assert got["dec_fusion"] == "decode"  # the innermost jaxcomp scope counts
  assert got["grad_fusion"] == "gradient"
  assert got["cond"] == "exchange"  # a conditional that runs an all-reduce
  assert got["ar"] == "exchange"
  assert got["copy"] == "update"


def test_not_hlo_is_a_clear_error():
  with pytest.raises(ValueError, match="HloModule"):
    phases.module_name("not HLO")
  with pytest.raises(TypeError, match="Compiled"):
    phases.op_phases(42)


def _qsgd_step():
  """A compiled 2-device shard_map train step with QSGD: (run, compiled)."""
  mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2])
  params = {"w": jnp.ones((256, 512)) * 0.01, "b": jnp.zeros((512,))}
  tx = optax.chain(
    jc.per_device_state(jc.qsgd(axis_name=AXIS, collective="allgather")), optax.sgd(0.1)
  )
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=2)

  def step(p, s, x):
    def loss(p):
      return jnp.mean(jnp.tanh(x[0] @ p["w"] + p["b"]) ** 2)

    g = jax.grad(loss)(jc.vary(p, AXIS))
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  x = jax.device_put(
    jax.random.normal(jax.random.key(0), (2, 32, 256)), jax.NamedSharding(mesh, P(AXIS))
  )
  compiled = f.lower(params, state, x).compile()
  return (lambda: jax.block_until_ready(compiled(params, state, x))), compiled


def test_compiled_step_has_every_phase():
  _, compiled = _qsgd_step()
  found = set(phases.op_phases(compiled).values())
  assert set(phases.PHASES) <= found


def test_profile_phases_splits_a_qsgd_step():
  run, compiled = _qsgd_step()
  run()
  with warnings.catch_warnings():
    # A complete trace: every kernel has its events, no "incomplete" warning.
    warnings.filterwarnings("error", message="the trace has no event", category=RuntimeWarning)
    prof = jc.profile_phases(run, compiled, calls=3)
  assert prof.calls == 3 and prof.untraced == ()
  for p in ("gradient", "encode", "exchange", "decode"):
    assert prof.phases[p] > 0, (p, str(prof))
    assert prof.top_ops[p], p
  total = sum(prof.phases[p] for p in phases.PHASES) + prof.phases["idle"]
  assert total == pytest.approx(prof.step_s, rel=1e-9)
  assert "encode" in str(prof) and "ms" in str(prof)


def test_profile_phases_names_the_kernels_the_trace_lost():
  """A kernel of the entry computation with no event in the trace (here one the program
  does not have: a trace that lost it reads the same) makes the profile say it is
  incomplete: listed in ``untraced``, a RuntimeWarning, a note in ``str``."""
  run, compiled = _qsgd_step()
  run()
  lines = compiled.as_text().splitlines()
  entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  lines.insert(entry + 1, "  %lost_fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop")
  with pytest.warns(RuntimeWarning, match="1 of the step's kernels"):
    prof = jc.profile_phases(run, "\n".join(lines), calls=1)
  assert prof.untraced == ("lost_fusion.1",)
  assert "1 kernels untraced: incomplete" in str(prof)


def test_profile_phases_checks_its_arguments():
  run, compiled = _qsgd_step()
  with pytest.raises(ValueError, match="calls"):
    jc.profile_phases(run, compiled, calls=0)
  other = jax.jit(lambda a: a * 2.0).lower(jnp.ones(4)).compile()
  with pytest.raises(RuntimeError, match="no op events of module 'jit__lambda', only of"):
    jc.profile_phases(run, other, calls=1)  # run() never executes `other`


def test_profile_phases_reports_an_empty_trace_as_incomplete():
  """A trace with no op events at all (what a profiler that lost every event writes;
  here run() runs nothing) gives a profile that says it is empty, not an exception: under
  jax.distributed an exception in one process would stop them all."""
  _, compiled = _qsgd_step()
  with pytest.warns(RuntimeWarning, match="no op events at all"):
    prof = jc.profile_phases(lambda: None, compiled, calls=2)
  assert set(prof.untraced) == phases._entry_kernels(compiled) and prof.untraced
  assert all(prof.phases[p] == 0 for p in phases.PHASES)
  assert prof.phases["idle"] == prof.step_s and prof.calls == 2
  assert "untraced: incomplete" in str(prof)


@pytest.mark.parametrize("name", ["onebit", "dgc", "mipd", "sparsify"])
def test_every_method_scopes_its_encode_and_decode(name):
  tx = {
    "onebit": lambda: jc.onebit_sgd(axis_name=AXIS),
    "dgc": lambda: jc.dgc(0.01, 0.9, axis_name=AXIS, collective="allgather"),
    "mipd": lambda: jc.mipd(0.5, axis_name=AXIS),
    "sparsify": lambda: jc.sparsify(density=0.05, axis_name=AXIS),
  }[name]()
  devices = jax.devices()[:2]
  params = {"w": jnp.ones((2, 64, 96)), "v": jnp.ones((2, 48, 64)), "b": jnp.ones((2, 96))}
  grads = jax.tree.map(lambda p: p * 0.1, params)
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  found = set(phases.op_phases(update.lower(grads, state, params).compile()).values())
  assert {"encode", "exchange", "decode"} <= found, found


def test_codec_benchmark_lists_the_costliest_ops():
  from benchmarks import codecs as codec_bench  # pylint: disable=import-outside-toplevel

  x = jax.random.normal(jax.random.key(0), (1 << 14,))
  step, ops = codec_bench.top_ops(jc.codecs.OneBit(1024), x, jax.random.key(1))
  assert step > 0 and 0 < len(ops) <= 5
  assert all(t > 0 for _, t in ops) and [t for _, t in ops] == sorted(
    (t for _, t in ops), reverse=True
  )
