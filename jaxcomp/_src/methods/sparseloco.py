r"""SparseLoCo (Sarfi et al. 2025): DiLoCo with a sparse, 2-bit, error-fed pseudo-gradient.

A composition of jaxcomp's pieces, nothing more: :func:`jaxcomp.diloco` with a plain
SGD outer step, whose pseudo-gradients are exchanged by :func:`jaxcomp.compress` with
the chunked top-k codec (:class:`jaxcomp.codecs.ChunkedTopK`) and error feedback that
decays (``error_decay``). The decaying residual takes the place of DiLoCo's outer
momentum.
"""

from __future__ import annotations

from typing import Any

import optax

from jaxcomp._src.codecs import sparse
from jaxcomp._src.methods import diloco as diloco_lib
from jaxcomp._src.methods import transforms


def _check_outer_lr(outer_learning_rate) -> None:
  if isinstance(outer_learning_rate, bool) or not isinstance(outer_learning_rate, (int, float)):
    raise ValueError(
      f"jc.sparseloco: outer_learning_rate must be a positive number, got {outer_learning_rate!r}"
    )
  if not outer_learning_rate > 0:
    raise ValueError(
      f"jc.sparseloco: outer_learning_rate must be a positive number, got {outer_learning_rate!r}"
    )


def sparseloco_exchange(
  *,
  axis_name: Any = transforms.AXIS_REQUIRED,
  density: float,
  bits: int = 2,
  chunk_size: int = 4096,
  decay: float = 0.95,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
  seed: int = 0,
) -> optax.GradientTransformation:
  r"""SparseLoCo's exchange: chunked top-k with ``bits``-bit values and decaying error feedback.

  On each device, with ``e`` its residual and ``Δ`` its input,

  .. math::
    e \leftarrow β e + Δ, \qquad s = Q(\mathrm{TopK_{chunk}}(e)), \qquad
    e \leftarrow e - s, \qquad \text{returns } \tfrac{1}{K}\textstyle\sum_r s_r,

  the payloads all-gathered (a sparse codec has no two-phase route). That is
  ``jc.compress(jc.codecs.ChunkedTopK(density, bits, chunk_size), axis_name=...,
  collective="allgather", error_feedback=True, error_decay=decay, filter=filter)``.
  Leaves outside ``filter`` (by default :func:`jaxcomp.default_filter`: tensors under
  1024 values or 1-D) are averaged densely, without a residual.

  Args:
    axis_name: the axis to average over (as in :func:`jaxcomp.compress`).
    density: fraction of each chunk sent, in (0, 1] (the paper: 1–3%).
    bits: bits per sent value, sign included, 2 to 8 (the paper: 2).
    chunk_size: values per chunk (default 4096, the size of the 64x64 tiles that the
      paper's code, after DeMo, cuts matrices into; here runs of the flat tensor).
    decay: ``β`` in [0, 1], the residual's decay (default 0.95).
    filter, seed: as in :func:`jaxcomp.compress`.

  Returns:
    An ``optax.GradientTransformation`` (a jaxcomp exchange).
  """
  transforms.require_axis_name(axis_name, "jc.sparseloco")
  codec = sparse.ChunkedTopK(density, bits=bits, chunk_size=chunk_size)
  return transforms.compress(
    codec,
    axis_name=axis_name,
    collective="allgather",
    error_feedback=True,
    error_decay=decay,
    filter=filter,
    seed=seed,
  )


def sparseloco(
  inner: optax.GradientTransformation,
  *,
  sync_every: int,
  axis_name: Any = transforms.AXIS_REQUIRED,
  density: float,
  bits: int = 2,
  chunk_size: int = 4096,
  decay: float = 0.95,
  outer_learning_rate: float = 1.0,
  fragments: int | None = None,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
  overlap: bool = False,
) -> optax.GradientTransformation:
  r"""SparseLoCo: ``sync_every`` local steps, then a sparse 2-bit error-fed outer step.

  Every replica ``r`` (a device) takes ``H = sync_every`` steps of ``inner`` alone, then,
  with ``θ`` the parameters of the last sync, ``e_r`` its residual and ``α`` the outer
  learning rate (Sarfi et al. 2025):

  .. math::
    Δ_r = θ - θ_r, \quad e_r \leftarrow β e_r + Δ_r, \quad
    s_r = Q(\mathrm{TopK_{chunk}}(e_r)), \quad e_r \leftarrow e_r - s_r, \quad
    θ \leftarrow θ - α \tfrac{1}{R}\textstyle\sum_r s_r,

  and every replica restarts from the new ``θ``. ``TopK_chunk`` keeps the
  ``ceil(density · c)`` largest magnitudes of every chunk of ``c = chunk_size`` values
  and ``Q`` sends each as a sign and ``bits - 1`` bits of magnitude against the chunk's
  largest (:class:`jaxcomp.codecs.ChunkedTopK`). The replicas average what they *sent*,
  decoded, and step by it with plain SGD: the paper's observation is that the decaying
  residual ``e_r`` does the work of DiLoCo's outer Nesterov momentum (an exponential
  sum of past pseudo-gradients), locally, so the sparse aggregate needs no momentum.

  Exactly this composition::

    jc.diloco(inner, optax.sgd(outer_learning_rate), sync_every=sync_every,
              axis_name=axis_name, fragments=fragments, overlap=overlap,
              exchange=jc.compress(jc.codecs.ChunkedTopK(density, bits=bits,
                                                         chunk_size=chunk_size),
                                   axis_name=axis_name, collective="allgather",
                                   error_feedback=True, error_decay=decay,
                                   filter=filter))

  so everything :func:`jaxcomp.diloco` says holds: parameters per device between syncs,
  state placed by :func:`jaxcomp.state_specs` (the residuals are per device), one
  compiled program, :func:`jaxcomp.wire_report` counting the sync's bytes ``1/H`` per
  step. Leaves outside ``filter`` (default :func:`jaxcomp.default_filter`: under 1024
  values, or 1-D) are averaged densely, with no residual.

  Args:
    inner: the replicas' optimizer (the paper: AdamW).
    sync_every: ``H``, the inner steps between syncs.
    axis_name: the data-parallel axis the replicas live on.
    density: fraction of each chunk sent, in (0, 1] (the paper: 1–3%).
    bits: bits per sent value, sign included, 2 to 8 (the paper: 2).
    chunk_size: values per chunk (default 4096, the size of the 64x64 tiles that the
      paper's code, after DeMo, cuts matrices into; here runs of the flat tensor).
    decay: ``β``, the residual's decay per sync, in [0, 1] (default 0.95).
    outer_learning_rate: ``α`` (default 1: the anchor moves by the mean sent).
    fragments: Streaming DiLoCo's fragments (:func:`jaxcomp.diloco`); ``None``: one.
    filter: which leaves are compressed (:func:`jaxcomp.compress`).
    overlap: the outer step one sync late, each replica keeping its own progress
      meanwhile (:func:`jaxcomp.diloco`'s ``overlap``): the sparse mean of sync ``s``
      steps the anchor at sync ``s + 1``, so its exchange can run alongside the next
      ``H`` inner steps. The residuals still advance at the sync that sends.

  Returns:
    An ``optax.GradientTransformation`` (:func:`jaxcomp.diloco`'s, state
    :class:`jaxcomp.DiLoCoState`; the residuals are in its ``exchange_state``).

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp as jc
    >>> tx = jc.sparseloco(optax.sgd(0.1), sync_every=4, axis_name=None, density=0.02)
    >>> params = {"w": jnp.ones((64, 32))}
    >>> state = tx.init(params)
    >>> for _ in range(4):  # the 4th step syncs: the residual keeps what was not sent
    ...   updates, state = tx.update({"w": jnp.ones((64, 32))}, state, params)
    >>> int(state.count), state.exchange_state[0].inner.residual["w"].shape
    (4, (1, 64, 32))

  References:
    Sarfi, Thérien, Lidin, Belilovsky. *Communication Efficient LLM Pre-training with
    SparseLoCo*. 2025. https://arxiv.org/abs/2508.15706
  """
  transforms.require_axis_name(axis_name, "jc.sparseloco")
  _check_outer_lr(outer_learning_rate)
  exchange = sparseloco_exchange(
    axis_name=axis_name,
    density=density,
    bits=bits,
    chunk_size=chunk_size,
    decay=decay,
    filter=filter,
  )
  return diloco_lib.diloco(
    inner,
    optax.sgd(outer_learning_rate),
    sync_every=sync_every,
    axis_name=axis_name,
    exchange=exchange,
    fragments=fragments,
    overlap=overlap,
  )
