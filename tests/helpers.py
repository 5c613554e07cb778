"""Shared helpers for the tests: an 8-device mesh, shard_map/pmap runners, HLO counts."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

AXIS = "batch"
K = 8


def mesh(k: int = K):
  return jax.make_mesh((k,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:k])


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

  return jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs),
                               out_specs=(P(), specs)))


def per_device_grads(key, shapes, k: int = K, dtype=jnp.float32):
  """A dict of per-device gradients: leaf ``name`` has shape ``(k, *shapes[name])``."""
  keys = jax.random.split(key, len(shapes))
  return {name: jax.random.normal(kk, (k, *shape), dtype)
          for kk, (name, shape) in zip(keys, sorted(shapes.items()))}


def collective_counts(hlo: str) -> dict[str, int]:
  """How many all-gathers, all-reduces and all-to-alls compiled HLO text holds."""
  return {name: len(re.findall(rf"\b{name}(?:-start)?\(", hlo))
          for name in ("all-gather", "all-reduce", "all-to-all")}


def all_reduce_operands(hlo: str) -> list[int]:
  """Operand count of every all-reduce in compiled HLO text (gloo runs one per operand)."""
  return [len(args.split(",")) for args in
          re.findall(r"all-reduce(?:-start)?\(([^)]*)\)", hlo)]
