"""Sphinx configuration of tgattn's documentation: ``sphinx-build -W --keep-going docs docs/_build/html``.

Pages are Markdown (MyST), one per area: a new area is a new ``docs/<area>.md`` listed in a
toctree of ``index.md`` (its API in ``docs/api/``). ```python`` blocks run as tests
(``tests/test_docs.py``); ```py`` blocks are shown only. The API reference is autodoc + napoleon
over the package's Google-style docstrings; ``tests/test_docs.py`` checks that it covers every
name of the packages' ``__all__``. Math is rendered by MathJax, served from the built site itself
(``sphinx-mathjax-offline``): neither building nor reading the pages needs the network.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TGATTN_DATA", str(ROOT.parent / "shared" / "data"))

import tgattn  # noqa: E402

project = "tgattn"
author = "the tgattn authors"
copyright = "the tgattn authors, MIT license"
release = version = tgattn.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx-mathjax-offline",  # MathJax copied into _static: no CDN
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # types beside documented arguments only
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_inherit_docstrings = False  # hooks PyG documents (message, edge_update) stay out unless tgattn documents them
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: NamedTuple fields are documented once, by autodoc

html_theme = "furo"
html_title = f"tgattn {release}"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
html_show_sourcelink = False
highlight_language = "none"  # unlabelled blocks are tables and program output, not Python


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are described in their class's docstring, not as "Alias for field number 0"."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
