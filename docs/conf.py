"""Sphinx configuration of the jaxcomp docs: `bash scripts/docs.sh` builds docs/_build/html.

Pages are markdown (myst-parser); the API reference is generated from the docstrings
(autodoc + napoleon: Google style; math through MathJax). The build runs offline with
warnings as errors, so nothing here fetches from the network (no intersphinx), and the
built site needs none either: MathJax is served from its _static/ (sphinx-mathjax-offline),
and the figures are drawn at build time from the results kept in docs/results/.
"""

import os
import sys

# Import jaxcomp from this checkout (also where it is not installed in the venv).
sys.path.insert(0, os.path.abspath(".."))

from benchmarks import figures  # noqa: E402  (after the path insert)
import jaxcomp  # noqa: E402

project = "jaxcomp"
author = "jaxcomp authors"
copyright = "jaxcomp authors"  # pylint: disable=redefined-builtin
release = jaxcomp.__version__
version = release

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.mathjax",
  # MathJax 3 from the built site's _static/mathjax/, not a CDN: formulas typeset where
  # the browser cannot reach the internet (many clusters). It sets mathjax_path.
  "sphinx-mathjax-offline",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# Markdown files whose name starts with "_" are working notes, not pages of the site
# (methods/_legacy.md: the old long method notes, kept for reference).
exclude_patterns = ["_build", "_*.md", "**/_*.md", "Thumbs.db", ".DS_Store"]

# -- MyST (markdown pages) ---------------------------------------------------------------
# dollarmath: $x$ and $$...$$ in pages; amsmath: \begin{align}...; colon_fence: ::: blocks.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
# Headings up to ### get slug anchors, so links like `benchmarks.md#some-heading` resolve.
myst_heading_anchors = 4

# -- autodoc / napoleon --------------------------------------------------------------------
autodoc_member_order = "bysource"
# Type hints go into the parameter list, not the signature: optax/jax types make long
# signatures unreadable.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_preserve_defaults = True
# Each public object gets a page of its own, generated at build time from the
# autosummary lists of docs/api/*.rst (docs/_templates/autosummary/object.rst) into
# docs/api/generated/ (not tracked).
autosummary_generate = True
templates_path = ["_templates"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
# References to names outside the docs (jax.Array, optax.GradientTransformation, ...) stay
# plain text: no intersphinx offline, and nitpicky stays off.
nitpicky = False

# -- HTML ------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxcomp {release}"
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
}
html_static_path = []

# -- Figures -----------------------------------------------------------------------------------
# Drawn from the results files kept in docs/results/ (the numbers of docs/benchmarks.md's
# tables, with their commands) into docs/_figures/ (not tracked), on every build: a new
# results file redraws its figures, no training needed. Pages show them with
# ```{figure} _figures/NAME.svg```.
figures.draw()
