"""The logprobs formats of the OpenAI answers, from the engine's entries.

An entry is `{"token_id", "logprob", "top_logprobs": {id: logprob}}` (prompt entries add
"rank"; the first prompt token's entry has its "token_id" only: nothing predicts it). `text`
turns a token id into its text: its own decode, special tokens kept, as vLLM does.

- chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`;
- completions (legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`,
  the chosen token always among its top; null logprob and top for the first prompt token;
- vLLM's `prompt_logprobs`: `[null, {token_id: {logprob, rank, decoded_token}}, ...]`, the prompt
  token first, then its top alternatives ranked 1, 2, ...
"""

from __future__ import annotations

from collections.abc import Callable

MIN_LOGPROB = -9999.0  # JSON has no -inf: a token the filters removed gets this (as in vLLM)
TokenText = Callable[[int], str]


def clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(text: TokenText, entries: list[dict]) -> dict:
    def item(token_id: int, value: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": clamp(value), "bytes": list(token.encode())}

    return {
        "content": [
            {
                **item(e["token_id"], e["logprob"]),
                "top_logprobs": [item(*top) for top in e["top_logprobs"].items()],
            }
            for e in entries
        ]
    }


def completion_logprobs(text: TokenText, entries: list[dict], offset: int) -> tuple[dict, int]:
    """The legacy format of `entries` whose text starts at `offset`; and the offset after them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        token = text(e["token_id"])
        if "logprob" in e:
            top = {text(t): clamp(v) for t, v in e["top_logprobs"].items()}
            top.setdefault(token, clamp(e["logprob"]))
            value = clamp(e["logprob"])
        else:  # the first prompt token (echo)
            top = value = None
        out["tokens"].append(token)
        out["token_logprobs"].append(value)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


def vllm_prompt_logprobs(text: TokenText, entries: list[dict]) -> list[dict | None]:
    def ranked(token_id: int, value: float, rank: int) -> dict:
        return {"logprob": clamp(value), "rank": rank, "decoded_token": text(token_id)}

    out: list[dict | None] = [None]
    for e in entries[1:]:
        step = {e["token_id"]: ranked(e["token_id"], e["logprob"], e["rank"])}
        for rank, (token, value) in enumerate(e["top_logprobs"].items(), start=1):
            step.setdefault(token, ranked(token, value, rank))
        out.append(step)
    return out
