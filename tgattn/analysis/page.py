"""An interactive page of attention (``python -m tgattn show --html``), in the spirit of bertviz.

The text is shown twice, as running text that wraps. Hovering a token selects it: the left copy
colours the tokens the selected token attends to in one layer and head (chosen above the text),
the right copy its strongest inputs after all layers (attention rollout, Abnar & Zuidema 2020);
above each, its strongest tokens with their values. A grid shows, for every layer and head, where
in the text the selected token looks; a click on a cell picks that layer and head. A click on a
token keeps the selection; ``#token=5&layer=2&head=0`` in the address opens the page there.

The page carries the data of :func:`tgattn.analysis.export.influence_data`: per token and view
its top ``top_k`` keys above a threshold, quantised, so it grows with ``N * top_k`` (about 14 MB
at 10,000 tokens, 4 layers x 4 heads, ``top_k=10``), and says what was pruned and the weight it
held. Its size is checked against a budget before anything is written.

The page is one file: its style, script and data are inside it, and it loads nothing, so it
opens without a network connection and can be sent as it is. The template is ``show.html``
beside this module.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .budget import MAX_BYTES, THRESHOLD, TOP_K

if TYPE_CHECKING:
    from .weights import Layer

TEMPLATE = Path(__file__).with_name("show.html")
# every character that could end or change the data block's parsing, written as a JSON escape
_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def attention_page(
    tokens: Sequence[str],
    attention: Sequence["Layer"],
    *,
    query: int = -1,
    title: str = "",
    top_k: int = TOP_K,
    threshold: float = THRESHOLD,
    max_bytes: int = MAX_BYTES,
    progress: bool = False,
) -> str:
    """The page, one self-contained HTML document, opened on token ``query`` (default: the last).

    ``top_k`` and ``threshold`` choose the edges kept (:func:`tgattn.analysis.export.influence_data`);
    a page larger than ``max_bytes`` raises ``ValueError`` with its size.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> page = attention_page(["The", "<!--<script>"], [(builders.causal(2), torch.ones(3, 2))], title="<sky>")
        >>> "<title>&lt;sky&gt;</title>" in page, "http" in page.replace("http-equiv", ""), "<!--<script>" in page
        (True, False, False)
    """
    from .export import influence_data

    data = influence_data(tokens, attention, query=query, title=title, top_k=top_k, threshold=threshold,
                          progress=progress)
    return page_from_data(data, max_bytes=max_bytes)


def page_from_data(data: dict, *, max_bytes: int = MAX_BYTES) -> str:
    """The page of data from :func:`~tgattn.analysis.export.influence_data` (or a file read back by
    :func:`~tgattn.analysis.export.load_influence`).

    The data block is JSON with ``<``, ``>``, ``&`` and the line separators written as ``\\uXXXX``
    escapes, so no token or title (``</script>``, ``<!--<script>``, ...) changes how the page parses.
    """
    # allow_nan=False: a bare NaN is not JSON, the page's parser would refuse it (non-finite values are null + flags)
    block = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_SAFE)
    page = TEMPLATE.read_text(encoding="utf-8")
    page = page.replace('type="application/json">DATA</script>', f'type="application/json">{block}</script>', 1)
    page = page.replace("<title>TITLE</title>", f"<title>{html.escape(data['title'])}</title>", 1)
    size = len(page.encode("utf-8"))
    if size > max_bytes:
        raise ValueError(f"the page would take {size / 1e6:.2f} MB, more than the budget of {max_bytes / 1e6:.2f} MB: "
                         f"keep fewer keys per token (--keep, now {data['keep']['top_k']}) or raise the budget "
                         "(--max-page-mb)")
    return page
