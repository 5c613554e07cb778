"""The MNIST-1D CNN of ``examples/mnist1d/models.py``, written with ``flax.nnx``."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx
import jax
import jax.numpy as jnp


class CNN(nnx.Module):
  """Conv stack -> global max pool -> MLP head, with ReLU.

  Layer for layer the linen ``examples.mnist1d.models.CNN``: the same shapes and
  initialisers, hence the same parameter count and the same leaves for jaxcomp's
  default filter to compress, so the two trainers' byte counts agree. (The initial
  values differ: nnx draws them from ``nnx.Rngs`` streams, linen from ``init``'s key.)
  The input width is fixed here because nnx modules create their parameters eagerly.
  """

  def __init__(
    self,
    *,
    features: Sequence[int] = (32, 64, 128, 128),
    kernels: Sequence[int] = (5, 3, 3, 3),
    strides: Sequence[int] = (1, 2, 2, 1),
    hidden: int = 128,
    num_classes: int = 10,
    rngs: nnx.Rngs,
  ):
    channels = (1, *features)  # the input is one channel: (batch, length) -> (..., 1)
    self.convs = nnx.List(
      [
        nnx.Conv(c_in, c_out, (k,), strides=(s,), padding="SAME", rngs=rngs)
        for c_in, c_out, k, s in zip(channels[:-1], channels[1:], kernels, strides)
      ]
    )
    self.hidden = nnx.Linear(channels[-1], hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps inputs ``(batch, length)`` to logits ``(batch, num_classes)``."""
    x = x[..., None]  # (batch, length, 1 channel)
    for conv in self.convs:
      x = nnx.relu(conv(x))
    x = jnp.max(x, axis=1)  # global max pool over the length: (batch, channels)
    x = nnx.relu(self.hidden(x))
    return self.head(x)


def create_model(config, *, rngs: nnx.Rngs) -> CNN:
  """The CNN described by ``config`` (an ``examples.mnist1d.configs`` config)."""
  return CNN(
    features=config.conv_features,
    kernels=config.conv_kernels,
    strides=config.conv_strides,
    hidden=config.hidden,
    num_classes=config.num_classes,
    rngs=rngs,
  )
