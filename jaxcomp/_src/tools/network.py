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

**A link per mesh axis.** On a ``(node, gpu)`` mesh the devices of a node talk over a
fast link (NVLink, ICI) and the nodes over a slow one (InfiniBand, Ethernet, DCN). Give
:func:`exchange_time` a mapping ``{axis name: Link}`` in place of the one link and each
collective of the report is priced on the link of its mesh axes (``op.axes``) at its
own devices (``op.devices``): a :func:`jaxcomp.two_level` exchange's reduce-scatter and
all-gather over ``gpu`` on the fast link at K = L, its compressed exchange over
``node`` on the slow link at K = N. A collective over several axes (a flat exchange
over ``("node", "gpu")``, K = N·L) is priced on the *slowest* of their links, at all
its K devices:

.. math::
  T_\mathrm{op} = \max_{a \in \mathrm{axes}}
    \left(\mathrm{steps}(K)\,\alpha_a + \mathrm{traffic}(B, K)\,\beta_a\right).

This is the ring's cost: with the L devices of a node adjacent on the ring, each of its
rounds moves ``B/K`` over every hop at once, N of the hops cross between nodes, and a
round ends when its slowest hop does; so every round costs the slow link's α and
``B/K``·β. It is an upper bound of that ring (the fast hops' rounds are not quite
idle: a pipelined ring overlaps them) and ignores the tree and hierarchical algorithms
a collective library may pick instead at large K (NCCL's trees pay ``log K`` latencies,
not ``K``). A link's bandwidth is per device: where the L devices of a node share one
network interface and all use it at once (the slow exchange of a two-level exchange
runs L shards' exchanges together), give the slow link ``bandwidth / L``; a flat ring
has one hop per node across it in each round and gets the whole interface.

References:
  Hockney. *The communication challenge for MPP: Intel Paragon and Meiko CS-2*.
  Parallel Computing 1994 (the α-β model). Thakur, Rabenseifner, Gropp. *Optimization
  of Collective Communication Operations in MPICH*. IJHPCA 2005 (ring costs).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
import dataclasses
from typing import Any

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


LinkSpec = Link | Mapping[Any, Link]  # one link, or a link per mesh axis name


def _check_links_by_axis(link: LinkSpec) -> dict | None:
  """``link`` as a dict by axis name when it is a mapping (checked), else ``None``."""
  if isinstance(link, Link):
    return None
  if not isinstance(link, Mapping):
    raise TypeError(
      f"link must be a jc.network.Link or a mapping of mesh axis names to Links, "
      f"got {type(link).__name__}"
    )
  if not link:
    raise ValueError("the mapping of links by mesh axis is empty")
  for axis, l in link.items():
    if not isinstance(l, Link):
      raise TypeError(f"link[{axis!r}] must be a jc.network.Link, got {type(l).__name__}")
  return dict(link)


def _op_time(op: wire.CollectiveOp, link: LinkSpec, k: int) -> float:
  """Seconds of one run of ``op`` at ``k`` devices on ``link``, or, for a mapping of
  links by mesh axis, on the slowest link of its axes (this module's docstring).

  An op whose axes the trace did not record is priced on the slowest link of the
  mapping (the conservative reading).
  """
  by_axis = _check_links_by_axis(link)
  if by_axis is None:
    return link.collective_time(op.primitive, op.operand_bytes, k)
  axes = tuple(op.axes) or tuple(by_axis)
  missing = [a for a in axes if a not in by_axis]
  if missing:
    raise ValueError(
      f"no link for mesh axes {missing} (a {op.primitive} over {tuple(op.axes)}); "
      f"links are given for {sorted(map(str, by_axis))}"
    )
  return max(by_axis[a].collective_time(op.primitive, op.operand_bytes, k) for a in axes)


def exchange_time(
  report: wire.WireReport,
  link: LinkSpec,
  *,
  fallback: bool = False,
  links: Mapping[str, Link] | None = None,
) -> float:
  """Seconds per step of the collectives in ``report`` (``jc.wire_report``) on ``link``.

  A collective that runs once every ``n`` steps (``op.every``, e.g. the sync of
  :func:`jaxcomp.diloco`) counts ``1/n`` of its time: the average over steps.

  Args:
    report: the wire report of a transform at ``report.num_devices`` devices; each
      collective is priced at the devices of its own mesh axes (``op.devices``).
    link: the link's α and β; or a link per mesh axis, ``{"node": Link(...), "gpu":
      Link(...)}``: each collective on the link of its axes, one over several axes on
      the slowest of them (this module's docstring: the ring's cost).
    fallback: also count the rare overflow path's collectives (a step that takes it).
    links: links fitted for particular collectives, by primitive name (e.g.
      ``{"all_gather": fit_link(timed_all_gathers)}``; ``"all_gather"`` also prices
      ``all_gather_invariant``, ``"psum"`` ``psum_invariant``), used for those instead of
      ``link``: a runtime whose all-gather moves more than its ideal traffic (gloo's,
      ``docs/benchmarks.md#collectives-across-the-throttled-link``) shows it as a lower
      fitted bandwidth. Only with one ``link`` (a link per primitive *and* axis is not
      modelled).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp as jc
    >>> mesh = jax.sharding.AbstractMesh((4, 8), ("node", "gpu"))
    >>> tx = jc.two_level(jc.qsgd(bits=4, axis_name="node"), fast_axis="gpu")
    >>> report = jc.wire_report(tx, {"w": jnp.zeros((1024, 1024))},
    ...                         axis_name=("node", "gpu"), num_devices=32, mesh=mesh)
    >>> links = {"gpu": jc.network.Link(5e-6, 150e9), "node": jc.network.Link(20e-6, 1.25e9)}
    >>> round(jc.network.exchange_time(report, links), 5)
    0.00032
  """
  by_primitive = _per_primitive(links)
  if by_primitive and _check_links_by_axis(link) is not None:
    raise ValueError(
      "links by primitive go with one link, not with a link per mesh axis: a link per "
      "primitive and axis is not modelled"
    )
  return float(
    sum(
      op.count
      / op.every
      * _op_time(
        op,
        by_primitive.get(wire.canonical(op.primitive), link),
        # Each collective at its own axes' devices (a two-level exchange's fast and
        # slow axes), the report's K where the trace did not record them.
        op.devices or report.num_devices,
      )
      for op in report.ops
      if fallback or not op.fallback
    )
  )


def predict_step_time(
  compute_s: float,
  report: wire.WireReport,
  link: LinkSpec,
  *,
  links: Mapping[str, Link] | None = None,
) -> float:
  """``compute_s`` plus the exchange time of ``report`` on ``link`` (no overlap);
  ``link`` (one, or one per mesh axis) and ``links`` as in :func:`exchange_time`."""
  return float(compute_s) + exchange_time(report, link, links=links)


def compute_time(
  step_s: float, report: wire.WireReport, link: LinkSpec, *, links: Mapping[str, Link] | None = None
) -> float:
  """The compute part of a step timed on ``link``: ``step_s`` minus its exchange time.

  Time a method on a fast link, where the exchange is a small part of the step, and
  this gives its compute time for :func:`predict_step_time` on slower links. ``link``
  and ``links`` as in :func:`exchange_time`.
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
