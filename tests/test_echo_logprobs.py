"""Completions `echo` with `logprobs`, `prompt_logprobs` and `max_tokens: 0` through the official
`openai` client against the live router of tests/router_server.py (an engine in-process): the
prompt's tokens come first in the legacy logprobs format (the first with null logprob and top),
then the output's, with the offline engine's values (fp32, 1e-4); vLLM's `prompt_logprobs` form
per completions choice and at the top of a chat answer."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.sampling.params import SamplingParams
from tests.router_requests import CHAT, MAX_MODEL_LEN, MODEL

pytest_plugins = ["tests.router_server"]  # the shared engine, server and client

PROMPT = "The quick brown fox jumps over"
TOP = 2


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLMEngine:
    config = EngineConfig(str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    return LLMEngine(config)


def generate(engine: LLMEngine, prompt: str, **params: object) -> RequestOutput:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, ignore_eos=True, **params))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the request did not finish")


def token_text(engine: LLMEngine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def check_echoed_logprobs(engine: LLMEngine, logprobs: dict, ref: RequestOutput) -> None:
    """The legacy logprobs of an echoed completion against the offline request `ref`."""
    ids = ref.prompt_token_ids + ref.token_ids
    entries = ref.prompt_logprobs[1:] + (ref.logprobs or [])
    assert logprobs["tokens"] == [token_text(engine, t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx([e["logprob"] for e in entries], abs=1e-4)
    for top, entry in zip(logprobs["top_logprobs"][1:], entries, strict=True):
        want = {token_text(engine, t): v for t, v in entry["top_logprobs"].items()}
        want.setdefault(token_text(engine, entry["token_id"]), entry["logprob"])
        assert top == pytest.approx(want, abs=1e-4)
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids))]
    assert logprobs["text_offset"] == offsets


def test_echo_logprobs_prompt_then_output(client: openai.OpenAI, offline: LLMEngine) -> None:
    ref = generate(offline, PROMPT, max_tokens=4, logprobs=TOP, prompt_logprobs=TOP)
    extra = {"ignore_eos": True, "prompt_logprobs": TOP}
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=TOP, extra_body=extra
    )
    choice = r.choices[0]
    assert choice.text == PROMPT + ref.text
    check_echoed_logprobs(offline, choice.logprobs.model_dump(), ref)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 4)
    # vLLM's prompt_logprobs beside it: the prompt token first, then its top alternatives, ranked
    vllm_form = choice.model_extra["prompt_logprobs"]
    assert vllm_form[0] is None and len(vllm_form) == len(ref.prompt_token_ids)
    for step, entry in zip(vllm_form[1:], ref.prompt_logprobs[1:], strict=True):
        own = step[str(entry["token_id"])]
        assert own["logprob"] == pytest.approx(entry["logprob"], abs=1e-4) and own["rank"] == entry["rank"]
        assert own["decoded_token"] == token_text(offline, entry["token_id"])
        assert {str(t) for t in entry["top_logprobs"]} <= set(step)

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=TOP,
        stream=True,
        extra_body=extra,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == PROMPT + ref.text
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in joined:
            joined[key].extend(getattr(c.logprobs, key) if c.logprobs else [])
    check_echoed_logprobs(offline, joined, ref)


def test_prompt_logprobs_without_echo(client: openai.OpenAI, offline: LLMEngine) -> None:
    ref = generate(offline, PROMPT, max_tokens=2, prompt_logprobs=0)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert r.choices[0].text == ref.text and r.choices[0].logprobs is None
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert [None if s is None else list(s) for s in got] == [None] + [
        [str(e["token_id"])] for e in ref.prompt_logprobs[1:]
    ]


def test_chat_prompt_logprobs_at_the_top(client: openai.OpenAI, offline: LLMEngine) -> None:
    prompt = offline.tokenizer.apply_chat_template(CHAT)
    ref = generate(offline, prompt, max_tokens=2, prompt_logprobs=1)
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    got = r.model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    values = [s[str(e["token_id"])]["logprob"] for s, e in zip(got[1:], ref.prompt_logprobs[1:], strict=True)]
    assert values == pytest.approx([e["logprob"] for e in ref.prompt_logprobs[1:]], abs=1e-4)


def test_echo_with_logprobs_alone_returns_the_prompt_logprobs(
    client: openai.OpenAI, offline: LLMEngine
) -> None:
    """What lm-evaluation-harness sends for a log-likelihood: echo, logprobs 1, max_tokens 1."""
    ref = generate(offline, PROMPT, max_tokens=1, logprobs=1, prompt_logprobs=1)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    check_echoed_logprobs(offline, r.choices[0].logprobs.model_dump(), ref)


def test_max_tokens_zero_returns_the_prompt_only(client: openai.OpenAI, offline: LLMEngine) -> None:
    ref = generate(offline, PROMPT, max_tokens=0, logprobs=TOP, prompt_logprobs=TOP)
    extra = {"prompt_logprobs": TOP}
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=TOP, extra_body=extra
    )
    assert r.choices[0].text == PROMPT and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0
    check_echoed_logprobs(offline, r.choices[0].logprobs.model_dump(), ref)


def test_echoed_token_ids_keep_their_special_tokens(client: openai.OpenAI, offline: LLMEngine) -> None:
    """A prompt of token ids is echoed as their text with the special tokens kept, as vLLM
    decodes it: the text the echoed logprobs' tokens and offsets describe (before: the special
    tokens were dropped from the text alone), streamed or not."""
    tokenizer = offline.tokenizer
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    ids = [start, *tokenizer.encode("user\nHi"), end]
    want = tokenizer.decode(ids, skip_special_tokens=False)
    assert want.startswith("<|im_start|>") and want.endswith("<|im_end|>")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    choice = r.choices[0]
    assert choice.text == want == "".join(choice.logprobs.tokens)
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, echo=True, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert streamed.startswith(want)
