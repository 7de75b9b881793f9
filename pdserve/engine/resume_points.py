"""Where a chat's next turn diverges from this turn's prompt, found from the chat template.

A template's generation prompt (`<|im_start|>assistant\\n<think>\\n` for Qwen3.6) is not always
what the next turn renders for the answer: a template that drops earlier reasoning renders
`<|im_start|>assistant\\n` + the answer. The next prompt then shares this one only up to where
the generation prompt's dropped part starts, a few tokens before its end, where no exact-end
checkpoint lies. Rendering a probe conversation both ways tells which tokens those are: a
prompt ending with them checkpoints where they start too (`PrefixCache.resume_suffixes`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)
_PROBE_USER = "Name three primes."
_PROBE_ANSWER = "2, 3 and 5."


def resume_suffix(tokenizer: object) -> tuple[int, ...] | None:
    """The tokens at the end of a generation prompt that the next turn does not repeat (None:
    no template, or the next turn repeats the whole prompt)."""
    try:
        first = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": _PROBE_USER}]))
        turn = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ANSWER},
            {"role": "user", "content": _PROBE_USER},
        ]
        second = tokenizer.encode(tokenizer.apply_chat_template(turn))
    except Exception as e:  # no template, or one that needs more than plain messages
        log.info("no resume point from the chat template: %s", e)
        return None
    common = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        common += 1
    dropped = tuple(first[common:])
    return dropped if 0 < len(dropped) < len(first) else None
