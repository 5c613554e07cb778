"""A decoder-only transformer in ``flax.nnx``: pre-norm blocks, causal attention.

Parameters are float32 (the master weights the optimizer updates); the matmuls run in
``compute_dtype`` (bfloat16 by default), and layer norms, the residual stream, the
softmax and the loss stay in float32.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp


def rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding of ``x`` ``(..., T, H, D)``, D even, in float32.

  Channel pairs ``(x_i, x_{i + D/2})`` are rotated by the angle ``t · base^(-2i/D)``
  at position ``t``, so that ``q·k`` depends on positions only through their
  difference.

  References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
  """
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[:, None] * freq[None, :]  # (T, D/2)
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]  # (T, 1, D/2)
  x = x.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
  """Causal multi-head self-attention, optionally with rotary positions."""

  def __init__(self, width: int, num_heads: int, *, rotary: bool, dtype, rngs: nnx.Rngs):
    if width % num_heads or (width // num_heads) % 2:
      raise ValueError(f"width {width} must split into {num_heads} heads of even size")
    self.num_heads, self.rotary, self.dtype = num_heads, rotary, dtype
    self.qkv = nnx.Linear(width, 3 * width, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(width, width, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.num_heads, d // self.num_heads), 3, 2)
    if self.rotary:
      positions = jnp.arange(t)
      q, k = rotary(q, positions).astype(self.dtype), rotary(k, positions).astype(self.dtype)
    # Scores and softmax in float32 (jax.nn.dot_product_attention mixes bf16 with
    # float32 constants, which strict dtype promotion rejects).
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d // self.num_heads))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.float32(-1e30))
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, T, H, D)
    return self.out(y.reshape(b, t, d)).astype(jnp.float32)


class Block(nnx.Module):
  """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (pre-norm)."""

  def __init__(self, config, *, dtype, rngs: nnx.Rngs):
    d = config.width
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = Attention(
      d, config.num_heads, rotary=config.positions == "rotary", dtype=dtype, rngs=rngs
    )
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, config.mlp_ratio * d, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(config.mlp_ratio * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.down(nnx.gelu(self.up(self.norm2(x)))).astype(jnp.float32)


class Transformer(nnx.Module):
  """Byte embedding (+ learned positions), ``depth`` blocks, final norm, linear head."""

  def __init__(self, config, *, rngs: nnx.Rngs):
    if config.positions not in ("rotary", "learned"):
      raise ValueError(f"positions must be 'rotary' or 'learned', got {config.positions!r}")
    dtype = jnp.dtype(config.compute_dtype)
    self.embed = nnx.Embed(config.vocab_size, config.width, rngs=rngs)
    self.positions = (
      nnx.Embed(config.seq_len, config.width, rngs=rngs) if config.positions == "learned" else None
    )
    self.blocks = nnx.List([Block(config, dtype=dtype, rngs=rngs) for _ in range(config.depth)])
    self.norm = nnx.LayerNorm(config.width, rngs=rngs)
    self.head = nnx.Linear(config.width, config.vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, run_block=None) -> jax.Array:
    """Maps tokens ``(batch, T)`` to float32 next-token logits ``(batch, T, vocab)``.

    ``run_block(i, block, x)``, when given, runs block ``i`` in place of ``block(x)``:
    per-layer FSDP (``examples/lm/sharded.py``) gathers the block's weights there, so
    only one block's full weights are alive at a time.
    """
    x = self.embed(tokens)
    if self.positions is not None:
      x = x + self.positions(jnp.arange(tokens.shape[-1]))
    for i, block in enumerate(self.blocks):
      x = block(x) if run_block is None else run_block(i, block, x)
    return self.head(self.norm(x)).astype(jnp.float32)


def create_model(config, *, rngs: nnx.Rngs) -> Transformer:
  """The transformer described by ``config`` (an ``examples.lm.configs`` config)."""
  return Transformer(config, rngs=rngs)
