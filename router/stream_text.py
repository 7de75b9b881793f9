"""Text helpers of the streaming output parsers (router.reasoning, router.tool_parsers).

A parser fed text a token at a time must not send text that may turn out to be the start of a
tag (`partial_tag_length`), and the parsers trim the whitespace around what they cut out
(`TrimmedText`): the blank lines between `</think>` and the answer, before and between tool
calls. Both work the same whatever the split of the text into deltas, so a stream's deltas
joined always equal the answer parsed in one piece.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_tag_length(text: str, tags: Iterable[str]) -> int:
    """The length of the longest end of `text` that is the start (not the whole) of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def find_first(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str | None]:
    """(position, tag) of the earliest of `tags` in `text` from `start`; (-1, None) if none."""
    found, first = -1, None
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (found < 0 or at < found):
            found, first = at, tag
    return found, first


class TrimmedText:
    """One output channel (reasoning or content) that drops leading whitespace while `lstrip` is
    set and holds trailing whitespace back until more text follows it: `cut()` drops what is held
    (a tag follows), `flush()` sends it (the output ended)."""

    def __init__(self, lstrip: bool = False) -> None:
        self.lstrip = lstrip
        self._held = ""

    def add(self, text: str) -> str:
        if self.lstrip:
            text = text.lstrip()
            if not text:
                return ""
            self.lstrip = False
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body) :]
        return out

    def cut(self, lstrip: bool = True) -> None:
        """A tag starts here: the held whitespace is dropped, and the next text's leading too."""
        self._held = ""
        self.lstrip = lstrip

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
