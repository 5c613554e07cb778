"""Default configuration: the README's demo, every method (results: docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters of :func:`examples.mnist1d.train.train_and_evaluate`.

  Every method is trained from the same initialisation, on the same batches in the
  same order, with the same optimizer after the gradient exchange; only the exchange
  (``methods``) differs.
  """

  # Data: MNIST-1D generated offline (``mnist1d.data.make_dataset``).
  num_samples: int = 5000  # train + test examples
  train_split: float = 0.8  # 4000 train / 1000 test
  data_seed: int = 42  # the MNIST-1D generator's seed (its published data)

  # Model: a small 1-D CNN (see models.py).
  conv_features: tuple[int, ...] = (32, 64, 128, 128)
  conv_kernels: tuple[int, ...] = (5, 3, 3, 3)
  conv_strides: tuple[int, ...] = (1, 2, 2, 1)
  hidden: int = 128
  num_classes: int = 10

  # Optimisation (applied to the exchanged mean gradient).
  # SGD with Nesterov momentum: 1-bit SGD is meant to feed SGD/momentum (the paper);
  # with Adam its quantized gradients (bucket means of each sign) throw off the
  # second-moment estimate and onebit trails dense by far (try optimizer="adamw").
  # Clipping the mean gradient to norm 1 keeps the high peak rate stable.
  optimizer: str = "momentum"  # "momentum" or "adamw" (see train.make_optimizer)
  per_device_batch_size: int = 32  # global batch = per_device_batch_size * devices
  num_steps: int = 600
  learning_rate: float = 0.2  # peak of a linear warmup + cosine decay schedule
  warmup_steps: int = 100
  weight_decay: float = 1e-4  # decoupled from the gradient
  grad_clip: float = 1.0  # global-norm clipping of the mean gradient (0: off)
  # Peak rate of 1-bit Adam (method "onebit_adam", an Adam: learning_rate above is
  # SGD's) when optimizer is "momentum"; with "adamw" it uses learning_rate.
  adam_learning_rate: float = 0.01
  seed: int = 0  # init and shuffling
  # DiLoCo (methods "diloco", "diloco_qsgd4"): local steps between syncs.
  diloco_sync_every: int = 10

  # Methods to compare, in table order (see train.make_exchange).
  methods: tuple[str, ...] = (
    "dense",
    "qsgd4",
    "qsgd2",
    "onebit",
    "dgc",
    "wangni",
    "mipd",
    "powersgd",
    "ef_signsgd",
    "onebit_adam",
  )

  # Logging.
  eval_every: int = 50  # steps between test-accuracy evaluations

  # Checkpoints (Orbax): every N steps and at the last, in workdir/checkpoints/<method>/;
  # a run finding one there resumes from it. 0: off.
  checkpoint_every: int = 0


def get_config() -> Config:
  """Returns the default configuration."""
  return Config()
