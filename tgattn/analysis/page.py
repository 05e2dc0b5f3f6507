"""An interactive page of attention (``python -m tgattn show --html``), in the spirit of bertviz.

The text is shown twice, as running text that wraps, so that 200 tokens fit a screen. Hovering
a token selects it: the left copy colours every token by the weight the selected token gives
it in one layer and head (chosen above the text), the right copy by its share in the
selected token after all layers (attention rollout, Abnar & Zuidema 2020); above each, its
strongest tokens with their values. A click keeps the selection; ``#token=5&layer=2&head=0``
in the address opens the page on that token, layer and head.

The page is one file: its style, script and data are inside it, and it loads nothing, so it
opens without a network connection and can be sent as it is. The template is ``show.html``
beside this module.
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Sequence

import torch

from .rollout import attention_rollout
from .weights import Layer, as_layers, count_nodes

TEMPLATE = Path(__file__).with_name("show.html")
DIGITS = 4  # weights are written with this many decimals: enough for any colour, a smaller page


def page_data(tokens: Sequence[str], attention: Sequence[Layer], *, query: int = -1, title: str = "") -> dict:
    """What the page shows, as JSON-ready lists: tokens, each layer's edges and per-head weights,
    and the rollout through all layers (sparse, rows = queries i).

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(2)  # edges (j, i): (0, 0), (0, 1), (1, 1)
        >>> data = page_data(["a", "b"], [(ei, torch.tensor([[1.0], [0.25], [0.75]]))])
        >>> data["layers"][0], data["query"]
        ({'src': [0, 0, 1], 'dst': [0, 1, 1], 'heads': [[1.0, 0.25, 0.75]]}, 1)
        >>> data["rollout"]["vals"]  # rownorm(0.5 A + 0.5 I)
        [1.0, 0.125, 0.875]
    """
    layers = as_layers(attention)
    n = count_nodes(layers, len(tokens))
    rollout = attention_rollout(layers, num_nodes=n).coalesce()  # [N, N], mean over heads
    rows, cols = rollout.indices().tolist()
    return {
        "title": title,
        "tokens": list(tokens),
        "query": query % n,
        "layers": [
            {
                "src": edge_index[0].tolist(),
                "dst": edge_index[1].tolist(),
                "heads": _rounded((alpha if alpha.dim() == 2 else alpha[:, None]).detach().double().cpu().T),
            }
            for edge_index, alpha in layers
        ],
        "rollout": {"rows": rows, "cols": cols, "vals": _rounded(rollout.values())},
    }


def attention_page(tokens: Sequence[str], attention: Sequence[Layer], *, query: int = -1, title: str = "") -> str:
    """The page, one self-contained HTML document, opened on token ``query`` (default: the last).

    Example:
        >>> from tgattn import builders
        >>> page = attention_page(["The", "sky"], [(builders.causal(2), torch.ones(3, 2))], title="<sky>")
        >>> "<title>&lt;sky&gt;</title>" in page, "http" in page.replace("http-equiv", "")
        (True, False)
    """
    data = json.dumps(page_data(tokens, attention, query=query, title=title), ensure_ascii=False)
    data = data.replace("</", "<\\/")  # a token "</script>" must not end the data block
    page = TEMPLATE.read_text(encoding="utf-8")
    page = page.replace("<title>TITLE</title>", f"<title>{html.escape(title)}</title>", 1)
    return page.replace('type="application/json">DATA</script>', f'type="application/json">{data}</script>', 1)


def _rounded(values: torch.Tensor) -> list:
    return torch.round(values, decimals=DIGITS).tolist()
