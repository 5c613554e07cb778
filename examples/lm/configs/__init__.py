"""Configurations of the LM example: ``load(name)`` gives a module with ``get_config()``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import types

_NAMES = ("tiny", "bench", "small", "deep", "default", "wide", "large")


def names() -> list[str]:
  """The built-in configs, smallest first."""
  return list(_NAMES)


def load(name: str) -> types.ModuleType:
  """The config module ``name`` (a built-in name or the path of a ``.py`` file)."""
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise ValueError(f"no config file {name!r}")
    spec = importlib.util.spec_from_file_location("lm_user_config", name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
  if name not in _NAMES:
    raise ValueError(f"unknown config {name!r}; expected one of {_NAMES} or a .py path")
  return importlib.import_module(f"examples.lm.configs.{name}")
