"""Shared helpers for the tests: an 8-device mesh, shard_map/pmap runners, HLO counts."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

import jaxcomp as jc

AXIS = "batch"
K = 8

# A test whose gradients are too small for the default filter means jaxcomp's "compresses
# nothing" warning, which pyproject.toml otherwise makes an error.
NOTHING_COMPRESSED = pytest.mark.filterwarnings("ignore:.*compresses nothing:UserWarning")


def mesh(k: int = K):
  return jax.make_mesh(
    (k,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:k]
  )


def shard(tree, m):
  """Puts arrays with a leading device axis on the mesh, one row per device."""
  return jax.device_put(tree, jax.NamedSharding(m, P(AXIS)))


def shard_map_init(tx, params, m):
  """``tx.init`` inside shard_map; per_device_state parts get a leading axis K."""
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=m.size)
  return jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs))(params)


def shard_map_update(tx, m, params):
  """jit(shard_map(update)) taking per-device grads (leading axis K) and the state."""
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=m.size)

  def step(grads, state):
    grads = jax.tree.map(lambda x: x[0], grads)
    return tx.update(grads, state)

  return jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs), out_specs=(P(), specs)))


def per_device_grads(key, shapes, k: int = K, dtype=jnp.float32):
  """A dict of per-device gradients: leaf ``name`` has shape ``(k, *shapes[name])``."""
  keys = jax.random.split(key, len(shapes))
  return {
    name: jax.random.normal(kk, (k, *shape), dtype)
    for kk, (name, shape) in zip(keys, sorted(shapes.items()))
  }


def kernel_vs_xla_under_pmap(make, impl: str, *, bitwise_outputs: bool):
  """Two pmap steps of ``jc.compress(make(impl), error_feedback=True)`` on 8 devices,
  checked against the same steps with ``make("xla")``; returns the kernel run's state.

  The outputs agree on every device, bit for bit when ``bitwise_outputs`` (else to a few
  ulp); the residuals and the non-finite counts as well (residuals to an ulp: XLA
  contracts ``x - q * step`` into an FMA in some fusions and not in others).
  """
  import chex  # pylint: disable=import-outside-toplevel

  eps = float(jnp.finfo(jnp.float32).eps)
  params = {"w": jnp.zeros((40, 50)), "b": jnp.zeros((64,))}
  grads = per_device_grads(jax.random.key(0), {"w": (40, 50), "b": (64,)})

  def run(codec):
    tx = jc.compress(
      codec,
      axis_name=AXIS,
      error_feedback=True,
      filter=lambda path, leaf: True,
      collective="allgather",
    )
    state = jax.pmap(lambda _: tx.init(params), axis_name=AXIS)(jnp.arange(K))
    step = jax.pmap(tx.update, axis_name=AXIS)
    out, state = step(grads, state)
    out, state = step(grads, state)
    return out, state

  (out_k, st_k), (out_x, st_x) = run(make(impl)), run(make("xla"))
  for leaf in jax.tree.leaves(out_k):  # identical on every device
    chex.assert_trees_all_equal(leaf[0], leaf[K - 1])
  if bitwise_outputs:
    chex.assert_trees_all_equal(out_k, out_x)  # payloads and decode-sums bit for bit
  tol = 8 * eps * float(max(jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)))
  chex.assert_trees_all_close(out_k, out_x, rtol=0, atol=tol)
  chex.assert_trees_all_close(st_k.residual, st_x.residual, rtol=0, atol=4 * tol)
  chex.assert_trees_all_equal(st_k.nonfinite_count, st_x.nonfinite_count)
  return params, grads, out_k, st_k


def collective_counts(hlo: str) -> dict[str, int]:
  """How many all-gathers, all-reduces and all-to-alls compiled HLO text holds."""
  return {
    name: len(re.findall(rf"\b{name}(?:-start)?\(", hlo))
    for name in ("all-gather", "all-reduce", "all-to-all")
  }


def all_reduce_operands(hlo: str) -> list[int]:
  """Operand count of every all-reduce in compiled HLO text (gloo runs one per operand)."""
  return [len(args.split(",")) for args in re.findall(r"all-reduce(?:-start)?\(([^)]*)\)", hlo)]
