"""A small 1-D CNN for MNIST-1D."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class CNN(nn.Module):
  """Conv stack -> global max pool -> MLP head, with ReLU.

  The global max pool makes the head invariant to where a pattern sits, which MNIST-1D
  (randomly translated templates) rewards; a flattening head, which has to learn each
  position apart, overfits the small training set more easily.

  With the default configuration (Conv 32/k5, Conv 64/k3/s2, Conv 128/k3/s2,
  Conv 128/k3, max pool, Dense 128, Dense 10) it has about 98k parameters, 99% of them
  in the five kernels that jaxcomp's default filter compresses (``ndim >= 2`` and
  ``size >= 1024``); the first conv kernel (160 values) and the biases go through a
  dense ``pmean``.
  """

  features: Sequence[int] = (32, 64, 128, 128)
  kernels: Sequence[int] = (5, 3, 3, 3)
  strides: Sequence[int] = (1, 2, 2, 1)
  hidden: int = 128
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Maps inputs ``(batch, length)`` to logits ``(batch, num_classes)``."""
    x = x[..., None]  # (batch, length, 1 channel)
    for f, k, s in zip(self.features, self.kernels, self.strides):
      x = nn.relu(nn.Conv(f, (k,), strides=(s,), padding="SAME")(x))
    x = jnp.max(x, axis=1)  # global max pool over the length: (batch, channels)
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


def create_model(config) -> CNN:
  """The CNN described by ``config``."""
  return CNN(
    features=config.conv_features,
    kernels=config.conv_kernels,
    strides=config.conv_strides,
    hidden=config.hidden,
    num_classes=config.num_classes,
  )
