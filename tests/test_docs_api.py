"""The docs site: every public name has an API entry, and the site builds without warnings.

The entries are the names in the ``.. autosummary::`` lists with a ``:toctree:`` under
docs/api/ (each gets a page of its own, generated at build time), or autodoc directives
(``.. automodule::`` and friends); the coverage checks parse them, no Sphinx needed.
"""

import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import jaxcomp
from jaxcomp import codecs
from jaxcomp import elias
from jaxcomp import network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
API = os.path.join(DOCS, "api")

# `.. autoclass:: Name` in .rst (or an {eval-rst} block), ```{autoclass} Name``` in MyST.
_ENTRY = re.compile(
  r"(?:\.\.\s+|```\{)auto(function|class|data|module|exception)"
  r"(?:::|\})\s+([\w.]+)"
)
_MODULE = re.compile(r"(?:\.\.\s+|```\{)(?:current)?module(?:::|\})\s+([\w.]+)")
_AUTOMODULE = re.compile(r"(?:\.\.\s+|```\{)automodule(?:::|\})\s+([\w.]+)")


_AUTOSUMMARY = re.compile(r"(?:\.\.\s+|```\{)autosummary(?:::|\})")


def _api_sources() -> list[str]:
  return sorted(glob.glob(os.path.join(API, "*.rst")) + glob.glob(os.path.join(API, "*.md")))


def api_entries() -> dict[str, tuple[str, str]]:
  """Fully qualified name -> (directive kind, api file), from the autodoc directives.

  A short name is qualified by the module last set in its file (``currentmodule``,
  ``module`` or ``automodule``), as Sphinx does.
  """
  entries = {}
  for path in _api_sources():
    module = None
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
    for i, raw in enumerate(lines):
      line = raw.strip()
      if m := _MODULE.match(line) or _AUTOMODULE.match(line):
        module = m.group(1)
      found = []
      if m := _ENTRY.match(line):
        found.append(m.groups())
      elif _AUTOSUMMARY.match(line):
        found.extend(("autosummary", name) for name in _autosummary_names(lines[i + 1 :]))
      for kind, name in found:
        if kind != "module" and not name.startswith("jaxcomp") and module:
          name = f"{module}.{name}"
        entries[name] = (kind, os.path.relpath(path, ROOT))
  return entries


def _autosummary_names(rest: list[str]) -> list[str]:
  """The names an ``autosummary`` directive lists (the lines after it): none unless it
  has a ``:toctree:`` option (only those generate entries)."""
  options, names = set(), []
  for line in rest:
    if line.strip() and not line.startswith(" "):
      break
    if m := re.match(r"\s+:(\w+):", line):
      options.add(m.group(1))
    elif line.strip():
      names.append(line.strip())
  return names if "toctree" in options else []


def _public(module) -> list[str]:
  return [f"{module.__name__}.{name}" for name in module.__all__]


@pytest.mark.parametrize("module", [jaxcomp, codecs, network, elias], ids=lambda m: m.__name__)
def test_every_public_name_has_an_api_entry(module):
  entries = api_entries()
  missing = [name for name in _public(module) if name not in entries]
  assert not missing, (
    f"no entry under docs/api/ for {missing}: list each in an "
    "autosummary with :toctree: generated in its group's page (and in the summary "
    "table of docs/api/index.md)"
  )


def test_every_api_entry_exists():
  for name, (kind, path) in api_entries().items():
    if kind == "module":
      importlib.import_module(name)
    else:
      module_name, _, attr = name.rpartition(".")
      assert hasattr(importlib.import_module(module_name), attr), (
        f"{path} documents {name}, which does not exist"
      )


def test_api_index_lists_every_entry():
  """docs/api/index.md's summary tables name each documented function and class."""
  with open(os.path.join(API, "index.md"), encoding="utf-8") as f:
    index = f.read()
  listed = set()
  for block in re.findall(r"```\{eval-rst\}\n(.*?)```", index, re.S):
    module = re.search(r"currentmodule::\s+([\w.]+)", block).group(1)
    listed |= {
      f"{module}.{name}"
      for name in re.findall(r"^\s{3,}(\w+)\s*$", block.split("autosummary::", 1)[1], re.M)
    }
  documented = {name for name, (kind, _) in api_entries().items() if kind != "module"}
  assert documented - listed == set(), "not in docs/api/index.md's tables"
  assert listed - documented == set(), "in docs/api/index.md's tables with no entry"


def test_getting_started_has_the_readme_snippet():
  """docs/getting_started.md repeats the README's "Use" example word for word."""

  from tests import _docs_blocks

  readme = _docs_blocks.section_code("README.md", "Use")
  assert _docs_blocks.section_code("docs/getting_started.md", "Use") == readme


@pytest.mark.slow
@pytest.mark.once
@pytest.mark.skipif(
  importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None,
  reason="Sphinx not installed (pip install -e '.[docs]'; the test extra includes it)",
)
def test_docs_build_without_warnings(tmp_path):
  """What `bash scripts/docs.sh` runs, into a temporary directory."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-q",
      "-b",
      "html",
      "-d",
      str(tmp_path / "doctrees"),
      DOCS,
      str(tmp_path / "html"),
    ],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
  assert os.path.exists(tmp_path / "html" / "api" / "index.html")
