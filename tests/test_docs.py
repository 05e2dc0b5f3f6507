"""The README and the documentation site: their links hold, the site builds.

The site is built once, with warnings as errors, and must document every public name of the
package. The pages' code blocks run in tests/test_doc_blocks.py.
"""
import importlib
import re
import warnings

import pytest

from conftest import REPO

# The packages whose __all__ the API reference must cover (tgattn's own lazy exports included).
PUBLIC = ["tgattn", "tgattn.builders", "tgattn.engine", "tgattn.nn", "tgattn.hf", "tgattn.analysis", "tgattn.models",
          "tgattn.lm", "tgattn.distributed"]


def test_readme_links_point_at_files():
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs|data)/[^)#]+)", text)
    assert len(targets) >= 10
    missing = [t for t in targets if not (REPO / t).is_file()]
    assert not missing, missing


def test_readme_stays_short_and_names_the_pieces():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for name in ("GraphAttentionConv", "GraphAttention", "graph_attention", "tgattn.hf", "tgattn.nn", "tgattn.distributed"):
        assert name in text
    # both quick-start commands install torch first and pinned, then the package, then build the kernel
    commands = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert [c.split(" && ")[2:] for c in commands] == [
        ["pip install torch==2.13.0", 'pip install -e ".[plot]"', "python -m tgattn build", "python -m tgattn verify"],
        ["pip install torch==2.13.0", 'pip install -e ".[test]"', "python -m tgattn build", "python -m pytest"],
    ]


def _public_names():
    names = set()
    for module in PUBLIC:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            value = getattr(mod, name)
            if name.startswith("__") or (module == "tgattn" and getattr(value, "__module__", "").startswith("tgattn.nn")):
                continue  # __version__; tgattn.GPSConv is tgattn.nn.GPSConv, documented there
            names.add(name if type(value).__name__ == "module" else f"{module}.{name}")
    return names


@pytest.mark.slow  # a child process or a build: tens of seconds
def test_site_builds_without_warnings_and_documents_every_public_name(tmp_path, capfd):
    """One build (about 20 s): Sphinx with -W --keep-going, then its inventory and its pages."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("furo")
    pytest.importorskip("transformers")  # the API reference of tgattn.hf imports it
    from sphinx.cmd.build import build_main
    from sphinx.util.inventory import InventoryFile

    out = tmp_path / "html"
    with warnings.catch_warnings():  # Sphinx's and MyST's own deprecation notices about each other
        warnings.simplefilter("ignore")
        status = build_main(["-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"), str(REPO / "docs"), str(out)])
    err = capfd.readouterr().err
    assert status == 0 and "WARNING" not in err and "ERROR" not in err, err

    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for kind, entries in inventory.items() if kind.startswith("py:") for name in entries}
    modules = {name.split(".")[-1] for name in inventory.get("py:module", {})}
    missing = {name for name in _public_names() if name not in documented and name not in modules}
    assert not missing, sorted(missing)

    page = (out / "index.html").read_text()
    assert "_static/mathjax/tex-chtml.js" in page and (out / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert not re.search(r"<script[^>]+src=\"https?://", page)  # nothing loaded from the network
    assert (out / "_images" / "patterns.png").is_file() and (out / "_images" / "attention_4096_threads2.png").is_file()


@pytest.mark.slow  # loads the real model whose queries and keys the learned selections use
def test_the_gallery_picture_draws_every_pattern(tmp_path):
    """``python docs/make_gallery.py`` makes docs/images/patterns.png: each panel a builder's mask."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("all_minilm_l6_v2")
    import runpy

    from tgattn import builders

    gallery = runpy.run_path(str(REPO / "docs" / "make_gallery.py"))
    items = list(gallery["patterns"]())
    assert len(items) == 17
    full = dict((title, (e, nq, nk)) for title, e, nq, nk in items)["full"]
    assert builders.to_mask(*full).all()
    gallery["main"](tmp_path / "patterns.png")
    assert (tmp_path / "patterns.png").stat().st_size > 10_000
