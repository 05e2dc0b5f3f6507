"""Text that must fit: titles cut to a length (no torch, no matplotlib)."""
from __future__ import annotations

TITLE_CHARS = 110  # the picture's title at 12 points across its 12 inches, with room to spare


def fit(text: str, chars: int) -> str:
    """``text`` on one line of at most ``chars`` characters, its end cut with an ellipsis.

    Example:
        >>> fit("The sky is blue", 40), fit("The sky is blue", 10)
        ('The sky is blue', 'The sky i…')
    """
    text = " ".join(text.split())
    return text if len(text) <= chars else text[: chars - 1] + "…"
