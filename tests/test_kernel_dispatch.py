"""Dispatch to the Pallas kernels never breaks a user.

Where the installed jax or the GPU cannot run the kernels (no Pallas, no Triton backend,
a GPU older than the backend supports), the codecs encode and decode on the XLA path,
with the same payloads, and warn once (``KernelFallbackWarning``). Each absence is
simulated on this machine by patching what ``jaxcomp.kernels._common`` probes.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxcomp as jc
from jaxcomp import kernels
from jaxcomp.kernels import _common

# every_case: which backend a kernel lowers to depends on the jax version, so every
# case runs on both jax lines (tests/conftest.py).
pytestmark = pytest.mark.every_case


def _missing(name):
  def imp():
    raise ImportError(f"No module named {name!r} (simulated)")

  return imp


def _has_kernel(fn, *args):
  """Whether ``fn`` calls a Pallas kernel (``pallas_call``: Triton; ``mpmd_map``: Mosaic GPU)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return "pallas_call" in text or "mpmd_map" in text


#: Codecs whose every shape the Mosaic GPU kernels take (4-bit QSGD, OneBit), and one
#: whose codes they do not pack (8-bit QSGD): where Mosaic GPU runs, only the latter
#: can fall back.
_ALL = (
  lambda impl: jc.codecs.QSGD(7, 64, "max", implementation=impl),
  lambda impl: jc.codecs.OneBit(64, implementation=impl),
)
_EIGHT_BIT = (lambda impl: jc.codecs.QSGD(127, 64, "max", implementation=impl),)


def _mosaic_runs() -> bool:
  """Whether this jax has Mosaic GPU (a GPU of compute capability 9.0 assumed)."""
  from jaxcomp.kernels import _mosaic

  return _mosaic.unavailable(interpret=False, capability=(9, 0)) is None


@pytest.fixture
def fresh_warnings(monkeypatch):
  """Each test starts with no fallback warned yet (the warning is once per process)."""
  monkeypatch.setattr(_common, "_warned", set())


def _as_if_on_gpu(monkeypatch, capability=(9, 0)):
  """The dispatch sees a CUDA GPU of this compute capability (the arrays stay on CPU)."""
  monkeypatch.setattr(_common, "cuda_available", lambda: True)
  monkeypatch.setattr(_common, "compute_capability", lambda: capability)


def _encode_decode_twice(implementation, makers=_ALL):
  """Encodes and decodes with each codec of ``makers`` (QSGD and OneBit), twice; returns
  their payloads and decodes and those of the XLA path."""
  x, key = jax.random.normal(jax.random.key(3), (1000,)), jax.random.key(0)
  out, ref = [], []
  for _ in range(2):
    for make in makers:
      codec, xla = make(implementation), make("xla")
      assert not _has_kernel(lambda x: codec.encode(x, key=key), x)
      p = codec.encode(x, key=key)
      out.append((p, codec.decode(p)))
      q = xla.encode(x, key=key)
      ref.append((q, xla.decode(q)))
  return out, ref


@pytest.mark.parametrize(
  "patch,implementation,match,makers",
  [
    pytest.param(
      lambda mp: (_as_if_on_gpu(mp), mp.setattr(_common, "_import_triton", _missing("triton"))),
      None,
      "no Pallas Triton backend",
      "mosaic-refuses",
      id="triton-removed-default",
    ),
    pytest.param(
      lambda mp: (_as_if_on_gpu(mp), mp.setattr(_common, "_import_triton", _missing("triton"))),
      "pallas",
      "no Pallas Triton backend",
      "mosaic-refuses",
      id="triton-removed-pallas",
    ),
    pytest.param(
      lambda mp: _as_if_on_gpu(mp),
      None,
      "deprecated Triton backend is not used",
      "mosaic-refuses",
      id="triton-superseded",
    ),
    pytest.param(
      lambda mp: _as_if_on_gpu(mp, capability=(7, 5)),
      None,
      "compute capability 7.5",
      "all",
      id="gpu-too-old",
    ),
    pytest.param(
      lambda mp: mp.setattr(_common, "_import_pallas", _missing("jax.experimental.pallas")),
      "pallas",
      "pallas does not import",
      "all",
      id="pallas-missing-interpret",
    ),
  ],
)
def test_codecs_fall_back_to_xla_with_one_warning(
  monkeypatch, fresh_warnings, patch, implementation, match, makers
):
  """Without a usable backend the codecs give the XLA path's payloads and warn once.

  ``"mosaic-refuses"``: where Mosaic GPU runs (jax >= 0.12) it takes 4-bit QSGD and
  OneBit, so only a shape it refuses (8-bit codes) can fall back; without Mosaic GPU
  (jax 0.10), and with Triton absent, every codec does.
  """
  if makers == "mosaic-refuses" and _mosaic_runs():
    makers = _EIGHT_BIT
  elif makers == "mosaic-refuses" and "deprecated Triton" in match:
    pytest.skip("this jax has no Mosaic GPU: Triton is not superseded")
  else:
    makers = _ALL
  patch(monkeypatch)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, ref = _encode_decode_twice(implementation, makers)
  chex.assert_trees_all_equal(out, ref)
  fallbacks = [w for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
  assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
  assert match in str(fallbacks[0].message)
  assert "XLA path" in str(fallbacks[0].message)


def test_usable_backend_dispatches_without_warning(monkeypatch, fresh_warnings):
  """The check above can fail: with the backend present the kernels run, silently."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", kernels.KernelFallbackWarning)
    assert _common.use_pallas("pallas")
    _as_if_on_gpu(monkeypatch)
    assert _common.use_pallas(None) and _common.use_pallas("pallas")
    assert not _common.use_pallas("xla") and not _common.use_pallas("native")


def test_no_gpu_default_is_not_a_fallback(fresh_warnings):
  """Off GPU, implementation=None means the CPU paths by design: no warning."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", kernels.KernelFallbackWarning)
    if kernels.cuda_available():
      pytest.skip("a CUDA GPU is present")
    assert not _common.use_pallas(None)
    x = jnp.ones((256,))
    jc.codecs.QSGD(7, 64).encode(x, key=jax.random.key(0))
