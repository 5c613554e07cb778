"""Checkpoint and resume with Orbax: a resumed run is bit-identical to an uninterrupted one.

The state is saved after N steps, restored into fresh arrays placed by an abstract
target (``jc.restore_target``, not the live objects), and stepped M more times; params
and every leaf of the state (residuals, chunk residuals, key data, counts) must equal
those of N+M uninterrupted steps bit for bit.
"""

import dataclasses
import doctest
import functools
import itertools
import shutil

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.plumbing import checkpoint
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

ocp = pytest.importorskip("orbax.checkpoint")

SHAPES = {"w": (64, 32), "b": (32,)}  # w compressed, b dense (default_filter)
N, M = 3, 2
BATCH = 4

EXCHANGES = {
  "onebit_sgd": lambda: jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)),
  "dgc": lambda: jc.per_device_state(
    jc.dgc(0.01, 0.9, axis_name=AXIS, warmup_steps=2, collective="allgather")
  ),
  "mipd": lambda: jc.mipd(0.5, axis_name=AXIS),  # replicated state
  "qsgd_two_phase": lambda: jc.per_device_state(
    jc.qsgd(axis_name=AXIS, collective="two_phase", error_feedback=True)
  ),
}


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


class Run:
  """A least-squares model trained under shard_map: one compile, many runs."""

  def __init__(self, exchange):
    self.mesh = helpers.mesh()
    self.tx = optax.chain(exchange, optax.sgd(0.1, momentum=0.9))
    params = {n: jnp.full(s, 0.01, jnp.float32) for n, s in SHAPES.items()}
    self.params0 = jax.device_put(params, jax.NamedSharding(self.mesh, P()))
    self.specs = jc.state_specs(self.tx, params, axis_name=AXIS, num_devices=K)
    self.init = jax.jit(
      jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs)
    )

    def step(params, state, x, y):
      grads = jax.grad(_loss)(jc.vary(params, AXIS), x[0], y[0])
      updates, state = self.tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    self.step = jax.jit(
      jax.shard_map(
        step,
        mesh=self.mesh,
        in_specs=(P(), self.specs, P(AXIS), P(AXIS)),
        out_specs=(P(), self.specs),
      )
    )

  def batch(self, t):
    kx, ky = jax.random.split(jax.random.key(100 + t))
    x = jax.random.normal(kx, (K, BATCH, SHAPES["w"][0]))
    y = jax.random.normal(ky, (K, BATCH, SHAPES["w"][1]))
    return helpers.shard((x, y), self.mesh)

  def steps(self, params, state, start, stop):
    for t in range(start, stop):
      params, state = self.step(params, state, *self.batch(t))
    return params, state

  def target(self):
    """Abstract (params, state): shapes, dtypes and shardings, no live arrays."""
    params = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding), self.params0
    )
    return {
      "params": params,
      "opt_state": jc.restore_target(self.tx, params, mesh=self.mesh, specs=self.specs),
    }


def _save(path, params, state):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, jc.unwrap_keys({"params": params, "opt_state": state}))


def _restore(path, target):
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, jc.unwrap_keys(target))
  return jc.wrap_keys(restored, target)


def _comparable(tree):
  """Key data in place of typed keys (chex compares arrays of numbers)."""
  return jax.device_get(jc.unwrap_keys(tree))


def _per_device_leaves(state):
  """Leaves of the ``per_device_state`` parts of a state."""
  parts = [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jc.PerDeviceState))
    if isinstance(x, jc.PerDeviceState)
  ]
  return jax.tree.leaves(parts)


@functools.cache
def _run(name: str) -> Run:
  return Run(EXCHANGES[name]())


@pytest.mark.parametrize(
  "name",
  # DGC's and MIPD's runs are the slowest to compile: on the first jax line only.
  [
    pytest.param(n, marks=pytest.mark.once) if n in ("dgc", "mipd") else n
    for n in sorted(EXCHANGES)
  ],
)
def test_resumed_run_is_bit_identical(name, tmp_path):
  r = _run(name)
  params, state = r.steps(r.params0, r.init(r.params0), 0, N + M)

  p_mid, s_mid = r.steps(r.params0, r.init(r.params0), 0, N)
  _save(tmp_path / "ckpt", p_mid, s_mid)
  restored = _restore(tmp_path / "ckpt", r.target())
  chex.assert_trees_all_equal(
    _comparable(restored), _comparable({"params": p_mid, "opt_state": s_mid})
  )
  p_res, s_res = r.steps(restored["params"], restored["opt_state"], N, N + M)

  chex.assert_trees_all_equal(_comparable(p_res), _comparable(params))
  chex.assert_trees_all_equal(_comparable(s_res), _comparable(state))
  # Every leaf back where init put it: per-device leaves split over the mesh's data
  # axis, the rest replicated; typed keys stay typed, of the same implementation.
  live = jax.tree.leaves({"params": p_mid, "opt_state": s_mid})
  for got, want in zip(jax.tree.leaves(restored), live, strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (got.sharding, want)
  per_device = _per_device_leaves(restored["opt_state"])
  assert bool(per_device) == (name != "mipd")
  for leaf in per_device:
    assert leaf.sharding == jax.NamedSharding(r.mesh, P(AXIS)), leaf.sharding
  for leaf in jax.tree.leaves(restored["params"]):
    assert leaf.sharding == jax.NamedSharding(r.mesh, P()), leaf.sharding
  keys = [
    x for x in jax.tree.leaves(restored) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  assert len(keys) == (0 if name == "mipd" else 1)
  assert all(jax.random.key_impl(k) == jax.random.key_impl(jax.random.key(0)) for k in keys)
  # The per-device residuals really differ between devices (so a replicated restore
  # would lose them), and MaskedNode leaves (the dense bias) survive.
  if name in ("onebit_sgd", "qsgd_two_phase"):
    residual = restored["opt_state"][0].inner.residual
    assert isinstance(residual["b"], optax.MaskedNode)
    rows = jax.device_get(residual["w"])
    assert not (rows[0] == rows[1]).all()


def test_zeroed_residual_differs(tmp_path):
  """Negative control: the comparison above would catch a residual lost on restore."""
  r = _run("onebit_sgd")
  params, state = r.steps(r.params0, r.init(r.params0), 0, N + M)
  p_mid, s_mid = r.steps(r.params0, r.init(r.params0), 0, N)
  _save(tmp_path / "ckpt", p_mid, s_mid)
  restored = _restore(tmp_path / "ckpt", r.target())
  inner = restored["opt_state"][0].inner
  zeroed = restored["opt_state"][0]._replace(
    inner=inner._replace(residual=jax.tree.map(jnp.zeros_like, inner.residual))
  )
  p_res, _ = r.steps(restored["params"], (zeroed, *restored["opt_state"][1:]), N, N + M)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(_comparable(p_res), _comparable(params))


def test_wrap_keys_keeps_the_implementation(tmp_path):
  """A non-default key implementation (rbg) and a batch of keys, sharded over the axis,
  round-trip through Orbax as raw data."""
  m = helpers.mesh()
  keys = jax.device_put(
    jax.random.split(jax.random.key(7, impl="rbg"), K), jax.NamedSharding(m, P(AXIS))
  )
  tree = {"keys": keys, "masked": optax.MaskedNode(), "count": jnp.int32(3)}
  target = {
    "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=keys.sharding),
    "masked": optax.MaskedNode(),
    "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=jax.NamedSharding(m, P())),
  }
  abstract = jc.unwrap_keys(target)["keys"]
  assert abstract.dtype == jnp.uint32 and abstract.shape == (K, 4)
  assert abstract.sharding == jax.NamedSharding(m, P(AXIS, None))

  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", jc.unwrap_keys(tree))
  with ocp.StandardCheckpointer() as ckptr:
    out = jc.wrap_keys(ckptr.restore(tmp_path / "ckpt", jc.unwrap_keys(target)), target)
  assert jax.random.key_impl(out["keys"]) == jax.random.key_impl(keys)
  assert out["keys"].sharding == keys.sharding
  assert isinstance(out["masked"], optax.MaskedNode)
  chex.assert_trees_all_equal(_comparable(out), _comparable(tree))


def test_docstring_examples():  # tests/test_docs.py's list predates the module
  result = doctest.testmod(checkpoint, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_train_batches_resume_where_the_run_was():
  from examples.mnist1d import input_pipeline  # pylint: disable=import-outside-toplevel

  x = np.arange(103 * 3, dtype=np.float32).reshape(103, 3)  # 8 batches of 12 per epoch
  y = np.arange(103, dtype=np.int32)
  batches = lambda start: input_pipeline.train_batches(
    x, y, num_devices=4, per_device_batch_size=3, seed=5, start_step=start
  )
  full = list(itertools.islice(batches(0), 30))
  for start in (1, 8, 13, 16):  # within the first epoch, at and across epoch ends
    chex.assert_trees_all_equal(list(itertools.islice(batches(start), 30 - start)), full[start:])


@pytest.mark.once
def test_example_trainer_resumes_bit_identical(tmp_path):
  """The MNIST-1D trainer with checkpoints: a run killed while saving step 6 (its save
  left unfinalized, a file cut short) resumes from step 4, never from the torn save, and
  ends where the uninterrupted run did."""
  for module in ("flax", "mnist1d", "matplotlib", "tqdm"):
    pytest.importorskip(module)
  from examples.mnist1d import train  # pylint: disable=import-outside-toplevel
  from examples.mnist1d.configs import quick  # pylint: disable=import-outside-toplevel

  # Checkpoints at 2, 4, 6; evaluations at 3 and 6, so the losses of step 4 are pending
  # at the checkpoint the second run resumes from.
  config = dataclasses.replace(
    quick.get_config(), methods=("onebit",), num_steps=6, eval_every=3, checkpoint_every=2
  )
  ckpts = tmp_path / "run" / "checkpoints" / "onebit"
  first = train.train_and_evaluate(config, str(tmp_path / "run"))["onebit"]
  assert sorted(p.name for p in ckpts.iterdir()) == ["4", "6"]  # the two latest
  shutil.move(ckpts / "6", tmp_path / "uninterrupted6")
  # A save cut short: Orbax writes into a temporary directory and renames it when done.
  torn = ckpts / "6.orbax-checkpoint-tmp-1764108000"
  shutil.copytree(tmp_path / "uninterrupted6", torn)
  for f in sorted(p for p in torn.rglob("*") if p.is_file() and p.stat().st_size)[:3]:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

  second = train.train_and_evaluate(config, str(tmp_path / "run"))["onebit"]
  assert (first["start_step"], second["start_step"]) == (0, 4)
  assert not torn.exists()  # removed when the manager opened
  # Same evaluations and losses (those before the checkpoint came with it), same params.
  for key in ("history", "test_accuracy", "layer_change"):  # NaN where undefined
    np.testing.assert_equal(second[key], first[key], err_msg=key)
  with ocp.StandardCheckpointer() as ckptr:  # params and opt_state at step 6
    chex.assert_trees_all_equal(
      ckptr.restore(ckpts / "6" / "state"), ckptr.restore(tmp_path / "uninterrupted6" / "state")
    )


def test_restore_target_with_tensor_parallel_params():
  """On a (4, 2) data x model mesh, the target matches the live state's shapes, dtypes
  and shardings leaf for leaf (param_specs: w1's columns, b1 and w2's rows over model)."""
  from examples import tensor_parallel as tp  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((4, 2), (tp.DATA, tp.MODEL), devices=jax.devices()[:8])
  pspecs = tp.param_specs(False)
  raw = tp.init_params(jax.random.key(0))
  tx = optax.chain(
    jc.per_device_state(jc.onebit_sgd(bucket_size=256, axis_name=tp.DATA)),
    optax.sgd(0.1, momentum=0.9),
  )
  specs = jc.state_specs(tx, raw, axis_name=tp.DATA, num_devices=4, param_specs=pspecs, mesh=mesh)
  params = jax.device_put(raw, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), pspecs))
  live = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=specs))(params)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), raw)
  target = jc.restore_target(tx, abstract, mesh=mesh, specs=specs, param_specs=pspecs)
  got = jax.tree.leaves(jc.unwrap_keys(target))
  want = jax.tree.leaves(jc.unwrap_keys(live))
  assert len(got) == len(want)
  for t, x in zip(got, want):
    assert (t.shape, t.dtype) == (x.shape, x.dtype)
    assert t.sharding.is_equivalent_to(x.sharding, x.ndim), (t.sharding, x.sharding)
