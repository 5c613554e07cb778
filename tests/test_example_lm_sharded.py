"""The LM example's sharded methods (examples/lm/sharded.py): ZeRO-2 and per-layer FSDP
train the one-block tiny transformer, their step's bytes are read off the traced
program, and per-layer gathering computes the model's own gradient."""

import dataclasses
import math

import pytest

pytest.importorskip("flax", minversion="0.12")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from examples.lm import models  # noqa: E402
from examples.lm import sharded  # noqa: E402
from examples.lm import train  # noqa: E402
from examples.lm.configs import tiny  # noqa: E402
import jaxcomp as jc  # noqa: E402

STEPS = 4
AXIS = train.AXIS


def small_config(**overrides):
  """The tiny config cut to one block (compile time grows with the number of leaves)."""
  return dataclasses.replace(
    tiny.get_config(), depth=1, num_steps=STEPS, eval_every=STEPS, **overrides
  )


def model_params(config):
  graphdef, state = nnx.split(models.create_model(config, rngs=nnx.Rngs(config.seed)))
  return graphdef, jax.device_get(state.to_pure_dict())


def mesh_of(k):
  return jax.make_mesh((k,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.slow
@pytest.mark.once
def test_sharded_methods_train_and_report(tmp_path):
  methods = ("zero_dense", "zero_qsgd4", "fsdp_int8_qsgd4", "fsdp_fp8")
  results = train.train_and_evaluate(small_config(methods=methods), str(tmp_path))
  table = open(tmp_path / "results.md").read()
  dense_bytes = results["zero_dense"]["dense_bytes"]
  for method, r in results.items():
    h = r["history"]
    assert all(math.isfinite(v) for v in h["val_loss"] + h["train_loss"][1:]), method
    assert h["val_loss"][-1] < h["val_loss"][0] - 0.3, (method, h["val_loss"])
    assert r["skipped_steps"] == 0 and r["peak_bytes"] > 0, method
    assert r["dense_bytes"] == dense_bytes and f"| {method} |" in table
    # Evaluated and returned whole: the shards gathered onto every device.
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(r["params"]))
  # ZeRO's all-gather and psum_scatter move the bytes of one all-reduce.
  assert results["zero_dense"]["ratio"] == pytest.approx(1.0)
  # Unbiased 4-bit codes: close to the dense exchange after 4 updates.
  gap = results["zero_qsgd4"]["val_loss"] / results["zero_dense"]["val_loss"] - 1
  assert abs(gap) < 0.05, gap
  assert results["fsdp_int8_qsgd4"]["ratio"] > 3
  assert results["fsdp_fp8"]["ratio"] > 3.5  # 8.25 bits a value both ways, against 32


def test_step_traffic_prices_each_exchange():
  config = small_config()
  graphdef, params = model_params(config)
  k = 8
  n = sum(p.size for p in jax.tree.leaves(params))
  scatter = (k - 1) / k * 4 * n  # a float32 psum_scatter (or all_gather) of the model
  big = sum(p.size for p in jax.tree.leaves(params) if jc.default_filter((), p))
  small = n - big  # leaves the default filter sends dense
  traffic = {m: sharded.step_traffic(m, graphdef, params, config, k) for m in sharded.METHODS}
  by = {m: t.by_collective for m, t in traffic.items()}
  gathered = lambda m: sum(v for c, v in by[m].items() if c.startswith("all_gather"))
  assert by["zero_dense"] == pytest.approx({"all_gather": scatter, "reduce_scatter": scatter})
  # ZeRO + QSGD: the same gather, the big leaves' codes in one all_to_all (about 4 bits
  # plus a scale per 512 values: >= 6x fewer than float32), the small ones dense.
  assert gathered("zero_qsgd4") == pytest.approx(scatter)
  assert by["zero_qsgd4"]["reduce_scatter"] == pytest.approx((k - 1) / k * 4 * small)
  assert by["zero_qsgd4"]["all_to_all"] < (k - 1) / k * 4 * big / 6
  # FSDP: every group gathered once (no rematerialized gather: sharded.py says why);
  # int8 blocks of 256 take a little over a quarter of the float32 bytes.
  assert gathered("fsdp_dense") == pytest.approx(scatter)
  assert by["fsdp_dense"]["reduce_scatter"] == pytest.approx(scatter)
  assert scatter / 4 < gathered("fsdp_int8_qsgd4") < scatter / 3.5
  assert "reduce_scatter" not in by["fsdp_int8_qsgd4"]  # every leaf's gradient as QSGD
  assert by["fsdp_int8_qsgd4"]["all_to_all"] < scatter / 6
  # FP8 both ways: a byte a value plus a scale byte per 32 (per shard: a short leaf's
  # shard is one short block), the weights in the gathers, the gradients in all_to_alls.
  assert scatter / 4 < gathered("fsdp_fp8") < 1.1 * scatter / 4
  assert "reduce_scatter" not in by["fsdp_fp8"]
  assert scatter / 4 < by["fsdp_fp8"]["all_to_all"] < 1.1 * scatter / 4


def test_fsdp_and_zero_compute_the_mean_gradient():
  """Per-layer gathering (FSDP) and ZeRO's gathered model give each device its shard of
  the data-parallel mean gradient, to float32 rounding. The model computes in float32
  here: in bf16, where XLA places the casts differs between the programs, and a few
  coordinates differ by bf16's rounding (about 1e-3 relative) rather than float32's."""
  config = small_config(compute_dtype="float32")
  graphdef, params = model_params(config)
  k = jax.device_count()
  mesh = mesh_of(k)
  specs = sharded.param_specs(params, k)
  tokens = np.random.default_rng(0).integers(0, 256, (k, 2, config.seq_len + 1), np.uint8)
  rows = jax.device_put(tokens, jax.NamedSharding(mesh, P(AXIS)))

  def mean_grad(p, t):
    loss = lambda q: train.cross_entropy(graphdef, q, t[0])[0] / (2 * config.seq_len)
    return jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), jax.grad(loss)(jc.vary(p, AXIS)))

  want = jax.jit(jax.shard_map(mean_grad, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))(
    params, rows
  )
  for method in ("fsdp_dense", "zero_dense"):
    exchange = sharded.make_exchange(method, specs)

    def grads(s, t, method=method, exchange=exchange):
      _, g = sharded.local_grads(method, graphdef, s, t[0], jax.random.key(0))
      return g if exchange is None else exchange.update(g, optax.EmptyState())[0]

    shards = jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
    got = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=specs))(
      shards, rows
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_sharded_clip_is_the_global_norm_of_the_whole():
  k = jax.device_count()
  mesh = mesh_of(k)
  rng = np.random.default_rng(1)
  grads = {"w": rng.normal(size=(4 * k, 3)).astype(np.float32), "b": rng.normal(size=(k,))}
  grads["b"] = grads["b"].astype(np.float32)
  specs = {"w": P(AXIS), "b": P(AXIS)}
  placed = jax.device_put(grads, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
  for max_norm in (1.0, 100.0):  # clipped, and left as it is
    tx = sharded.clip_by_global_norm(max_norm)
    got = jax.jit(
      jax.shard_map(lambda g: tx.update(g, None)[0], mesh=mesh, in_specs=(specs,), out_specs=specs)
    )(placed)
    want = optax.clip_by_global_norm(max_norm).update(grads, None)[0]
    for name in grads:
      np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-5)


def test_bad_sharded_input():
  with pytest.raises(ValueError, match=r"\['b'\] has shape \(6,\)"):
    sharded.param_specs({"w": jnp.zeros((8, 2)), "b": jnp.zeros((6,))}, 4)
  with pytest.raises(ValueError, match="accumulation_steps"):
    sharded.make_tx("zero_qsgd4", small_config(accumulation_steps=2), P(AXIS), optax.sgd(1.0))
  with pytest.raises(ValueError, match="checkpoint-every"):
    train.train_method(
      "fsdp_dense",
      small_config(checkpoint_every=2),
      graphdef=None,
      init_params=None,
      corpus=None,
      mesh=mesh_of(jax.device_count()),
    )
