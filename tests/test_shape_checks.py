"""A gradient that does not match ``init``'s parameters is an error, never a silent
broadcast against a stale state: the message names the leaf and both shapes, or which
side has which keys."""

import jax.numpy as jnp
import optax
import pytest

import jaxcomp as jc

PARAMS = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}

TRANSFORMS = {
  "compress_ef": lambda: jc.compress(jc.codecs.OneBit(), error_feedback=True, axis_name=None),
  "qsgd": lambda: jc.qsgd(axis_name=None),
  "dgc": lambda: jc.dgc(0.01, axis_name=None),
  "mipd": lambda: jc.mipd(axis_name=None),
  "chain": lambda: optax.chain(
    jc.per_device_state(jc.onebit_sgd(axis_name=None)), optax.sgd(1e-3, momentum=0.9)
  ),
}


@pytest.mark.parametrize(
  "bad,message",
  [
    (
      {"w": jnp.zeros((1, 32)), "b": jnp.zeros((32,))},
      r"\['w'\] has shape \(1, 32\), but init saw shape \(64, 32\)",
    ),
    (
      {"w": jnp.zeros((64, 32), jnp.bfloat16), "b": jnp.zeros((32,))},
      r"\['w'\] has dtype bfloat16, but init saw dtype float32",
    ),
  ],
  ids=["shape", "dtype"],
)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_mismatched_leaf_names_it(name, bad, message):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=message):
    tx.update(bad, state, PARAMS)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_missing_and_extra_keys(name):
  tx = TRANSFORMS[name]()
  state = tx.init(PARAMS)
  with pytest.raises(
    ValueError,
    match=r"the gradient has \['c'\].*init had \['b'\], which "
    r"the gradient lacks",
  ):
    tx.update(
      {"w": jnp.zeros((64, 32)), "c": jnp.zeros((32,))},
      state,
      {"w": jnp.zeros((64, 32)), "c": jnp.zeros((32,))},
    )


def test_matching_gradients_pass():
  """The positive control: gradients shaped like the parameters go through."""
  for make in TRANSFORMS.values():
    tx = make()
    out, _ = tx.update({"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}, tx.init(PARAMS), PARAMS)
    assert out["w"].shape == (64, 32) and out["b"].shape == (32,)
