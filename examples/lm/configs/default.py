"""Default configuration: a ~4.8M-parameter byte-level transformer, every method."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
  """Hyperparameters of :func:`examples.lm.train.train_and_evaluate`.

  Every method trains the same model from the same initialisation on the same
  batches with the same AdamW schedule; only the gradient exchange (``methods``)
  differs (1-bit Adam, which is an Adam itself, replaces AdamW).
  """

  # Data: the Python standard library's .py sources, bytes as tokens.
  validation_percent: int = 5  # files whose path hash falls below this go to validation
  seq_len: int = 128  # tokens (bytes) per example

  # Model (models.py): decoder-only, pre-norm, causal attention.
  vocab_size: int = 256
  width: int = 256  # model dimension d
  depth: int = 6  # transformer blocks
  num_heads: int = 4
  mlp_ratio: int = 4
  positions: str = "rotary"  # "rotary" or "learned"
  compute_dtype: str = "bfloat16"  # matmuls; parameters (master weights) stay float32

  # Optimisation: AdamW with linear warm-up and cosine decay, after the exchange.
  per_device_batch_size: int = 8  # sequences per device per mini-step
  accumulation_steps: int = 1  # mini-steps per update (jc.multi_steps)
  num_steps: int = 2000  # updates
  learning_rate: float = 3e-3  # peak
  warmup_steps: int = 100
  weight_decay: float = 0.1
  b2: float = 0.95
  grad_clip: float = 1.0  # global norm of the exchanged mean gradient (0: off)
  seed: int = 0  # init and batch order

  # Method settings (train.make_exchange).
  powersgd_rank: int = 4
  # qsgd4 / diloco_qsgd4: values per max-norm bucket. 128, not jc.qsgd's 512: the
  # variance bound grows with sqrt(bucket) (Lemma 3.1), and under AdamW that noise costs
  # loss at equal updates (docs/guides/lm.md); 32 bits of scale per 128 values.
  qsgd_bucket_size: int = 128
  qsgd_error_feedback: bool = False  # qsgd4: feed the quantization error back (worse)
  dgc_density: float = 0.01
  onebit_adam_freeze: float = 0.25  # fraction of the steps in full-precision warm-up
  # onebit / ef_signsgd: fraction of the updates whose exchange is the dense mean before
  # the 1-bit codes start (train.dense_warmup; 0: compressed from the first update). As
  # long as 1-bit Adam's warm-up: docs/guides/lm.md says why the codes need one.
  sign_warmup: float = 0.25
  diloco_sync_every: int = 10  # DiLoCo: local updates between syncs (H)
  diloco_outer_lr: float = 0.7  # DiLoCo's outer Nesterov SGD (the paper's 0.7 / 0.9)
  diloco_outer_momentum: float = 0.9
  # sparseloco (jc.sparseloco, opt-in): DiLoCo's H and inner AdamW; the pseudo-gradient
  # as the top 1/64 of each chunk of 4096 values (64 kept, the paper's 1-3%) in 2 bits,
  # error feedback with decay 0.95 in place of the outer momentum, outer SGD at lr 1.
  sparseloco_density: float = 1 / 64
  sparseloco_bits: int = 2
  sparseloco_chunk_size: int = 4096
  sparseloco_decay: float = 0.95
  sparseloco_outer_lr: float = 1.0
  # demo (jc.decoupled_momentum, opt-in): the top 32 DCT components of each 64x64 block
  # of the momentum (the paper's chunk 64, k 32), momentum decay 0.999, stepped with
  # their sign at AdamW's schedule shape and weight decay, peaking at
  # demo_learning_rate (0: learning_rate).
  demo_learning_rate: float = 0.0
  demo_chunk_size: int = 64
  demo_topk: int = 32
  demo_momentum_decay: float = 0.999

  # Methods to compare, in table order.
  methods: tuple[str, ...] = (
    "dense",
    "qsgd4",
    "qsgd2",
    "onebit",
    "ef_signsgd",
    "powersgd",
    "onebit_adam",
    "dgc",
    "diloco",
    "diloco_qsgd4",
  )

  # Evaluation and logging.
  eval_every: int = 100  # updates between validation losses
  eval_batches: int = 4  # validation windows = eval_batches x global batch
  target_loss: float = 0.0  # stop a method once its validation loss is <= this (0: off)

  # Checkpoints (Orbax): every N updates and at the last, in workdir/checkpoints/<method>/;
  # a run finding one there resumes from it. 0: off.
  checkpoint_every: int = 0


def get_config() -> Config:
  """Returns the default configuration."""
  return Config()
