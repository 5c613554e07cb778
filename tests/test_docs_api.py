"""The docs site: every public name has an API entry, and the site builds without warnings.

The entries are the names in the ``.. autosummary::`` lists with a ``:toctree:`` under
docs/api/ (each gets a page of its own, generated at build time), or autodoc directives
(``.. automodule::`` and friends); the coverage checks parse them, no Sphinx needed.
"""

import glob
import html
import importlib
import importlib.util
import json
import os
import re
import shutil
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


_NEEDS_SPHINX = pytest.mark.skipif(
  importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None,
  reason="Sphinx not installed (pip install -e '.[docs]'; the test extra includes it)",
)


# One xdist worker runs the tests that read the built site (scripts/test.sh: --dist
# loadgroup), so that the site is built once.
pytestmark = pytest.mark.xdist_group("docs_site")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
  """What `bash scripts/docs.sh` runs, into a temporary directory: the built html/."""
  out = tmp_path_factory.mktemp("docs")
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
      str(out / "doctrees"),
      DOCS,
      str(out / "html"),
    ],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
  return out / "html"


@pytest.mark.slow
@pytest.mark.once
@_NEEDS_SPHINX
def test_docs_build_without_warnings(built_site):
  assert os.path.exists(built_site / "api" / "index.html")
  for name in ("demo_accuracy_vs_bytes", "method_map", "network_speedup", "two_level_speedup"):
    assert os.path.getsize(built_site / "_images" / f"{name}.svg") > 0, name


_MATH = re.compile(
  r'<span class="math notranslate nohighlight">\\\((.*?)\\\)</span>'
  r'|<div class="math notranslate nohighlight">\s*\\\[(.*?)\\\]\s*</div>',
  re.S,
)
# A resource fetched from elsewhere: <script src>, <link href>, <img src> off the site.
_REMOTE = re.compile(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="(?:https?:)?//', re.I)


def _pages_with_math(site) -> dict[str, list[tuple[str, bool]]]:
  """page -> [(TeX, display)] of every formula Sphinx wrote for MathJax."""
  pages = {}
  for path in glob.glob(os.path.join(site, "**", "*.html"), recursive=True):
    with open(path, encoding="utf-8") as f:
      found = [
        (html.unescape(inline or display), not inline)
        for inline, display in _MATH.findall(f.read())
      ]
    if found:
      pages[path] = found
  return pages


@pytest.mark.slow
@pytest.mark.once
@_NEEDS_SPHINX
def test_math_is_served_from_the_site(built_site):
  """Every page with math loads MathJax 3 from the site's _static/ (sphinx-mathjax-offline),
  and no page loads a script, style sheet or image from the network."""
  pages = _pages_with_math(built_site)
  assert len(pages) >= 10 and os.path.join(built_site, "methods", "qsgd.html") in pages
  mathjax = os.path.join(built_site, "_static", "mathjax", "tex-chtml.js")
  with open(mathjax, encoding="utf-8") as f:
    code = f.read()
  assert len(code) > 100_000 and "MathJax" in code and 'VERSION="3.' in code
  for path in glob.glob(os.path.join(built_site, "**", "*.html"), recursive=True):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert not _REMOTE.search(text), f"{path}: {_REMOTE.search(text).group(0)}"
    if path in pages:
      src = re.search(r'<script[^>]*src="([^"]*tex-chtml\.js)"', text)
      assert src, f"{path} has math and loads no MathJax"
      local = os.path.normpath(os.path.join(os.path.dirname(path), src.group(1)))
      assert local == mathjax, (path, src.group(1))


@pytest.mark.slow
@pytest.mark.once
@_NEEDS_SPHINX
def test_no_formula_is_left_as_raw_tex(built_site):
  """No `$` is left in the pages' text outside code and math: a `$...$` MyST did not take
  as math (a line in it read as a list item, say) shows as raw TeX, whatever MathJax does."""
  skip = re.compile(
    r"<(script|style|pre|code)\b.*?</\1>|<span class=\"math notranslate nohighlight\">.*?</span>"
    r"|<div class=\"math notranslate nohighlight\">.*?</div>",
    re.S,
  )
  for path in glob.glob(os.path.join(built_site, "**", "*.html"), recursive=True):
    with open(path, encoding="utf-8") as f:
      text = re.sub(r"<[^>]*>", "", skip.sub("", f.read()))
    left = re.search(r".{0,60}\$.{0,60}", text)
    assert not left, f"{path}: {left.group(0)!r}"


# Typesets each formula with the site's own MathJax (its node entry point, offline): the
# same TeX input component the pages load; an error node or an undefined macro (shown red)
# is a formula the browser would show broken.
_TYPESET_JS = """
const MathJax = require(process.argv[2] + '/node-main.js');
const formulas = JSON.parse(require('fs').readFileSync(0, 'utf8'));
MathJax.init({loader: {load: ['input/tex', 'output/chtml']}}).then((MJ) => {
  const bad = [];
  formulas.forEach(([tex, display], i) => {
    const mml = MJ.tex2mml(tex, {display});
    const html = MJ.startup.adaptor.outerHTML(MJ.tex2chtml(tex, {display}));
    if (/<merror|mathcolor="red"/.test(mml) || !html.includes('<mjx-container')) bad.push([i, mml]);
  });
  console.log(JSON.stringify({typeset: formulas.length, bad: bad}));
}).catch((e) => { console.error(e); process.exit(1); });
"""


@pytest.mark.slow
@pytest.mark.once
@_NEEDS_SPHINX
@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run MathJax")
def test_site_mathjax_typesets_every_formula_offline(built_site, tmp_path):
  pages = _pages_with_math(built_site)
  formulas = sorted({f for found in pages.values() for f in found})
  script = tmp_path / "typeset.js"
  script.write_text(_TYPESET_JS)
  done = subprocess.run(
    ["node", str(script), os.path.join(built_site, "_static", "mathjax")],
    input=json.dumps(formulas),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout)
  assert result["typeset"] == len(formulas) > 100
  assert not result["bad"], [(formulas[i][0], mml[:300]) for i, mml in result["bad"][:5]]
