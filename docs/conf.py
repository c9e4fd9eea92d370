"""Sphinx configuration of the qformats documentation.

Build (warnings are errors, as in CI)::

    pip install ".[docs]"                       # or, in a dev tree: PYTHONPATH=python
    sphinx-build -W -b html docs docs/_build/html

The API reference imports qformats (autodoc): the installed package, or, when none is
installed, ``python/`` of this checkout (its native extensions must be built,
``tools/dev_build.sh``). The benchmark and quality pages are generated at build time by
``_ext/qf_results.py`` from ``benchmarks/results/*.json`` (tables and matplotlib plots, written
to ``docs/_generated/``). ``_ext/qf_formats.py`` lists the format pages in the toctrees, in the
order of ``qformats.FORMATS``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
if importlib.util.find_spec("qformats") is None:
    sys.path.insert(0, str(ROOT / "python"))

import qformats  # noqa: E402

project = "qformats"
author = "the qformats authors"
copyright = "2026, the qformats authors"
release = version = qformats.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "qf_results",
    "qf_formats",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "Thumbs.db", ".DS_Store"]
nitpicky = False

# Markdown (MyST): tables, ``$...$`` math, heading anchors for [links](page.md#anchor).
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# The docstrings are Google style (Args:/Returns:/Raises:/Attributes:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True          # "Attributes:" as fields, not duplicate attribute entries
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
# torch.library and dataclasses generate members without docstrings; list only documented ones.
autodoc_inherit_docstrings = False

html_theme = "alabaster"
html_title = f"qformats {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Low-bit weight formats with bit-exact codecs and quantized GEMM",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "230px",
}

# Where the result files live (qf_results reads them; CI builds with the committed ones).
qf_results_dir = os.fspath(ROOT / "benchmarks" / "results")
