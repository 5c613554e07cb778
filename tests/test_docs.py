"""The docstring examples run (doctest), the README's usage names exist, the links
between the README, the guides, the method pages and the benchmarks page resolve, and
the method pages share one template."""

import doctest
import glob
import os
import re

import pytest

import jaxcomp as jc
from jaxcomp import codecs
from jaxcomp import elias as elias_public
from jaxcomp._src.codecs import elias
from jaxcomp._src.codecs import float8
from jaxcomp._src.codecs import normal
from jaxcomp._src.codecs import sparse
from jaxcomp._src.codecs import wangni
from jaxcomp._src.exchanges import qweights
from jaxcomp._src.methods import dgc
from jaxcomp._src.methods import diloco
from jaxcomp._src.methods import qsvrg
from jaxcomp._src.methods import sparseloco
from jaxcomp._src.methods import transforms
from jaxcomp._src.tools import network
from jaxcomp.kernels import quantize as quantize_kernel


@pytest.mark.parametrize(
  "module",
  [
    codecs,
    elias_public,
    transforms,
    dgc,
    diloco,
    sparseloco,
    sparse,
    wangni,
    elias,
    qsvrg,
    qweights,
    float8,
    normal,
    quantize_kernel,
    network,
  ],
  ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_readme_names_are_public():
  with open("README.md") as f:
    readme = f.read()
  for name in sorted(set(re.findall(r"\bjc\.([a-z_]+)", readme))):
    assert name in jc.__all__, name


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _anchors(path):
  """GitHub/MyST heading slugs of a markdown file (headings inside code fences skipped)."""
  slugs, fenced = set(), False
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("```"):
        fenced = not fenced
      heading = None if fenced else re.match(r"#+\s+(.*)", line)
      if heading:
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
        slugs.add(slug.replace(" ", "-"))
  return slugs


def _links(path):
  """(target, anchor) of every relative markdown link outside code fences."""
  with open(path, encoding="utf-8") as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if not target.startswith(("http://", "https://", "mailto:")):
      file, _, anchor = target.partition("#")
      yield os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path, anchor


@pytest.mark.parametrize(
  "page",
  ["README.md", "docs/benchmarks.md"]
  + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs/guides/*.md")))
  + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs/methods/*.md"))),
)
def test_links_resolve(page):
  for target, anchor in _links(os.path.join(ROOT, page)):
    assert os.path.exists(target), (page, target)
    if anchor and target.endswith(".md"):
      assert anchor in _anchors(target), (page, target, anchor)


def test_landing_guides_and_benchmarks_have_one_title():
  for path in [os.path.join(ROOT, "docs", p) for p in ("index.md", "benchmarks.md")] + glob.glob(
    os.path.join(ROOT, "docs/guides/*.md")
  ):
    with open(path, encoding="utf-8") as f:
      text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    assert text.startswith("# "), path
    assert len(re.findall(r"^# ", text, flags=re.M)) == 1, path


# docs/methods/index.md names these sections: every method page has them, in this order.
METHOD_SECTIONS = [
  "The method",
  "Use",
  "Bytes on the wire",
  "Tests",
  "Results",
  "What is exactly the paper, and what departs (and why)",
]


@pytest.mark.parametrize(
  "page",
  sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs/methods/*.md"))
    if not p.endswith("index.md")
  ),
)
def test_method_pages_share_one_template(page):
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
  assert len(re.findall(r"^# ", text, flags=re.M)) == 1, page
  assert re.findall(r"^## (.+)$", text, flags=re.M) == METHOD_SECTIONS, page
