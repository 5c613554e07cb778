r"""An α-β cost model of gradient exchanges: where compression pays off, and by how much.

A collective of a ring algorithm over K devices takes ``steps(K)`` sequential message
rounds and moves ``traffic(B, K)`` bytes through each device's link (B: the operand's
bytes on one device; the traffic is :mod:`jaxcomp._src.tools.wire`'s convention):

=================  ==========  ====================
collective         steps       bytes per device
=================  ==========  ====================
all_gather         K-1         (K-1)·B
all_to_all         K-1         (K-1)/K·B
psum, pmax, pmin   2(K-1)      2(K-1)/K·B
psum_scatter       K-1         (K-1)/K·B
ppermute           1           B
=================  ==========  ====================

so with a per-round latency α and a per-byte time β (``1 / bandwidth``),

.. math::
  T_\mathrm{op} = \mathrm{steps}(K)\,\alpha + \mathrm{traffic}(B, K)\,\beta, \qquad
  T_\mathrm{step} = T_\mathrm{compute} + \sum_\mathrm{ops} \mathrm{count}\cdot T_\mathrm{op},

the collectives of one step running one after another (the conservative reading: XLA
may overlap independent ones). :func:`fit_link` fits α and β to timed collectives on a
link; :func:`exchange_time` prices a :class:`jaxcomp.WireReport` (which lists every
collective of a transform's ``update`` at any K); :func:`predict_step_time` adds the
compute time measured on a fast link. ``benchmarks/network.py`` fits the model on a
throttled veth link and checks its predictions against measured training steps.

References:
  Hockney. *The communication challenge for MPP: Intel Paragon and Meiko CS-2*.
  Parallel Computing 1994 (the α-β model). Thakur, Rabenseifner, Gropp. *Optimization
  of Collective Communication Operations in MPICH*. IJHPCA 2005 (ring costs).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
import dataclasses

import numpy as np

from jaxcomp._src.tools import wire

_STEPS = {  # by canonical name (wire.canonical)
  "all_gather": lambda k: k - 1,
  "all_to_all": lambda k: k - 1,
  "psum": lambda k: 2 * (k - 1),
  "pmax": lambda k: 2 * (k - 1),
  "pmin": lambda k: 2 * (k - 1),
  "psum_scatter": lambda k: k - 1,
  "ppermute": lambda k: 1,
}


def _check_primitive(primitive: str) -> None:
  if wire.canonical(primitive) not in _STEPS:
    raise ValueError(
      f"unknown collective {primitive!r}; expected one of {sorted(_STEPS)} "
      f"(or {sorted(wire.SAME_AS)})"
    )


def _check_k(k: int) -> None:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
    raise ValueError(f"the number of devices must be an integer >= 2, got {k!r}")


def steps(primitive: str, k: int) -> int:
  """Sequential message rounds of ``primitive`` over ``k`` devices (ring algorithms)."""
  _check_primitive(primitive)
  _check_k(k)
  return _STEPS[wire.canonical(primitive)](k)


def traffic(primitive: str, operand_bytes: float, k: int) -> float:
  """Bytes through each device's link for one ``primitive`` of ``operand_bytes``."""
  _check_primitive(primitive)
  _check_k(k)
  return wire.TRAFFIC[wire.canonical(primitive)](operand_bytes, k)


@dataclasses.dataclass(frozen=True)
class Link:
  """A link's α-β parameters.

  Attributes:
    latency_s: α, seconds per sequential message round.
    bandwidth: 1/β, bytes per second through one device's link.
  """

  latency_s: float
  bandwidth: float

  def __post_init__(self):
    if not self.latency_s >= 0 or not np.isfinite(self.latency_s):
      raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s!r}")
    if not self.bandwidth > 0:
      raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

  def collective_time(self, primitive: str, operand_bytes: float, k: int) -> float:
    """Seconds of one collective: ``steps·α + traffic·β``."""
    return (
      steps(primitive, k) * self.latency_s + traffic(primitive, operand_bytes, k) / self.bandwidth
    )


def _per_primitive(links: Mapping[str, Link] | None) -> dict[str, Link]:
  """``links`` checked, keyed by canonical primitive name."""
  out = {}
  for primitive, l in (links or {}).items():
    _check_primitive(primitive)
    if not isinstance(l, Link):
      raise TypeError(f"links[{primitive!r}] must be a jc.network.Link, got {type(l).__name__}")
    out[wire.canonical(primitive)] = l
  return out


def exchange_time(
  report: wire.WireReport,
  link: Link,
  *,
  fallback: bool = False,
  links: Mapping[str, Link] | None = None,
) -> float:
  """Seconds per step of the collectives in ``report`` (``jc.wire_report``) on ``link``.

  A collective that runs once every ``n`` steps (``op.every``, e.g. the sync of
  :func:`jaxcomp.diloco`) counts ``1/n`` of its time: the average over steps.

  Args:
    report: the wire report of a transform at ``report.num_devices`` devices; each
      collective is priced at the devices of its own mesh axes (``op.devices``), all on
      ``link`` (a link per mesh axis is not modelled yet).
    link: the link's α and β.
    fallback: also count the rare overflow path's collectives (a step that takes it).
    links: links fitted for particular collectives, by primitive name (e.g.
      ``{"all_gather": fit_link(timed_all_gathers)}``; ``"all_gather"`` also prices
      ``all_gather_invariant``, ``"psum"`` ``psum_invariant``), used for those instead of
      ``link``: a runtime whose all-gather moves more than its ideal traffic (gloo's,
      ``docs/benchmarks.md#collectives-across-the-throttled-link``) shows it as a lower
      fitted bandwidth.
  """
  by_primitive = _per_primitive(links)
  return float(
    sum(
      op.count
      / op.every
      * by_primitive.get(wire.canonical(op.primitive), link).collective_time(
        # Each collective at its own axes' devices (a two-level exchange's fast and
        # slow axes), the report's K where the trace did not record them.
        op.primitive,
        op.operand_bytes,
        op.devices or report.num_devices,
      )
      for op in report.ops
      if fallback or not op.fallback
    )
  )


def predict_step_time(
  compute_s: float, report: wire.WireReport, link: Link, *, links: Mapping[str, Link] | None = None
) -> float:
  """``compute_s`` plus the exchange time of ``report`` on ``link`` (no overlap);
  ``links`` as in :func:`exchange_time`."""
  return float(compute_s) + exchange_time(report, link, links=links)


def compute_time(
  step_s: float, report: wire.WireReport, link: Link, *, links: Mapping[str, Link] | None = None
) -> float:
  """The compute part of a step timed on ``link``: ``step_s`` minus its exchange time.

  Time a method on a fast link, where the exchange is a small part of the step, and
  this gives its compute time for :func:`predict_step_time` on slower links. ``links``
  as in :func:`exchange_time`.
  """
  return max(float(step_s) - exchange_time(report, link, links=links), 0.0)


def fit_link(samples: Iterable[tuple[str, float, int, float]]) -> Link:
  """Least-squares α and β from timed collectives.

  Args:
    samples: ``(primitive, operand_bytes, k, seconds)`` of single collectives, e.g. a
      ``psum`` of several sizes timed on the link. At least two distinct sizes.

  Returns:
    The :class:`Link` minimising the squared *relative* error of
    ``steps·α + traffic·β`` over the samples (so small messages, which pin α, weigh as
    much as large ones), with α clipped at 0.
  """
  rows, times = [], []
  for primitive, operand_bytes, k, seconds in samples:
    rows.append((steps(primitive, k), traffic(primitive, operand_bytes, k)))
    times.append(float(seconds))
  if len({r[1] for r in rows}) < 2:
    raise ValueError("fit_link needs collectives of at least two distinct sizes")
  a = np.asarray(rows, np.float64)
  t = np.asarray(times, np.float64)
  if np.any(t <= 0):
    raise ValueError("timings must be positive")
  w = 1.0 / t  # relative errors
  (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
  if alpha < 0:  # latency below resolution: refit the bandwidth alone
    alpha = 0.0
    beta = float(np.sum(a[:, 1] * w * w * t) / np.sum((a[:, 1] * w) ** 2))
  if not beta > 0:
    raise ValueError(
      f"fitted per-byte time is not positive ({beta}); are the timings dominated by noise?"
    )
  return Link(latency_s=float(alpha), bandwidth=float(1.0 / beta))
