"""Finding the markers that tool-call and reasoning formats write (`<tool_call>`, `</think>`,
`[TOOL_CALLS]`) in a text that may still be growing."""
from __future__ import annotations


def find_marker(text: str, marker: str, start: int = 0) -> int | None:
    """Where `marker` begins in `text`, None if nowhere. `text[:start]` was searched before: only
    a marker its end may begin needs searching again."""
    at = text.find(marker, max(start - len(marker) + 1, 0))
    return None if at < 0 else at


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (short of all of it): what
    more text may turn into the marker."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-n:])), 0)
