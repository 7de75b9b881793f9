"""`--reasoning-parser qwen3`: the `<think>...</think>` block of a Qwen3 answer as `reasoning_content`.

Qwen3.5/3.6 templates open the block in the prompt (`<|im_start|>assistant\\n<think>\\n`) when
thinking is on, so the output starts inside it and only closes it; with `enable_thinking: false`
the prompt holds an empty block and the output is the answer. A model may also open the block
itself. So: the output is reasoning up to `</think>` when the prompt opened the block or the
output starts with `<think>`, and content otherwise; a thought cut off by max_tokens is all
reasoning. The whitespace around the block is trimmed (not the text inside it); `<think>`
anywhere but at the start is text.

Streaming: `feed(delta)` returns the (reasoning, content) text that is certain; a possible
partial `</think>` (or `<think>` at the start) is held until the next delta or `finish()`.
"""

from __future__ import annotations

from router.stream_text import TrimmedText, partial_tag_length

THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """Does the rendered prompt end inside an open `<think>` block?"""
    return prompt.rstrip().endswith(THINK_START)


class Qwen3ReasoningParser:
    """Splits one choice's output into reasoning and content, a delta at a time."""

    def __init__(self, prompt_opened: bool) -> None:
        self.prompt_opened = prompt_opened
        self.state = "start"  # -> "reasoning" -> "content"
        self._buf = ""
        self._reasoning = TrimmedText(lstrip=True)
        self._strip_content = False  # after </think>: drop the blank lines before the answer

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self.state = head[len(THINK_START) :], "reasoning"
            elif THINK_START.startswith(head) and not final:
                return "", ""  # "", "<thi": not decided yet
            else:
                self.state = "reasoning" if self.prompt_opened else "content"
        if self.state == "reasoning":
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = 0 if final else partial_tag_length(self._buf, (THINK_END,))
                reasoning = self._reasoning.add(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning + (self._reasoning.flush() if final else ""), ""
            reasoning = self._reasoning.add(self._buf[:end])
            self._reasoning.cut()
            self._buf, self.state, self._strip_content = self._buf[end + len(THINK_END) :], "content", True
        content, self._buf = self._buf, ""
        if self._strip_content:
            content = content.lstrip()
            self._strip_content = not content
        return reasoning, content
