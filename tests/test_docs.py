"""The docstring examples run (doctest) and the README's usage names exist."""

import doctest
import re

import pytest

import jaxcomp as jc
from jaxcomp import codecs
from jaxcomp import elias as elias_public
from jaxcomp.kernels import quantize as quantize_kernel
from jaxcomp._src import dgc
from jaxcomp._src import elias
from jaxcomp._src import normal
from jaxcomp._src import qsvrg
from jaxcomp._src import sparse
from jaxcomp._src import transforms
from jaxcomp._src import wangni


@pytest.mark.parametrize("module", [codecs, elias_public, transforms, dgc, sparse,
                                    wangni, elias, qsvrg, normal, quantize_kernel],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_readme_names_are_public():
  with open("README.md") as f:
    readme = f.read()
  for name in sorted(set(re.findall(r"\bjc\.([a-z_]+)", readme))):
    assert name in jc.__all__, name
