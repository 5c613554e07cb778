"""Configurations of the MNIST-1D example; each module has ``get_config()``."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import types

_DIR = pathlib.Path(__file__).resolve().parent


def names() -> list[str]:
  """The config modules of this package (``--config`` names)."""
  return sorted(p.stem for p in _DIR.glob("*.py") if not p.stem.startswith("_"))


def load(name: str) -> types.ModuleType:
  """The config module ``name``: one of :func:`names`, or the path of a ``.py`` file with
  a ``get_config()`` (e.g. ``benchmarks/configs/params2m.py``).

  Raises:
    ValueError: no such config, or the module has no ``get_config``.
  """
  if name.endswith(".py"):
    path = pathlib.Path(name)
    if not path.is_file():
      raise ValueError(f"--config: no such file {name!r}")
    spec = importlib.util.spec_from_file_location(f"_mnist1d_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  elif name in names():
    module = importlib.import_module(f"{__name__}.{name}")
  else:
    raise ValueError(
      f"--config: unknown {name!r}; choose from {','.join(names())} "
      "or give the path of a config file"
    )
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"--config: {name!r} has no get_config()")
  return module
