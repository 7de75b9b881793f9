"""End to end: router -> prefill -> NIXL -> 2 decode processes, a real redis-server, the official
`openai` client. Disaggregated output must equal `pdserve.LLM` offline, token for token."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.registry import InstanceRegistry
from tests.stack import Stack

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "你好，世界",
    "Once upon a time, in a land far away",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = Stack(tiny_model_dir, tmp_path_factory.mktemp("stack")).start()
    yield s
    s.stop()


@pytest.fixture
def offline(cached_llm: LLM) -> LLM:
    """The offline engine (CPU, fp32, 512 tokens, the prefix cache on): the session's, its cache
    empty (tests/conftest.py)."""
    return cached_llm


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)


def metric(stack: Stack, name: str, labels: str = "") -> float:
    text = httpx.get(f"{stack.url}/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    return sum(values)


def greedy(offline: LLM, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate(prompt, params)[0].text


def test_completions_equal_offline(stack: Stack, client: openai.OpenAI, offline: LLM) -> None:
    extra = {"ignore_eos": True}
    for prompt in PROMPTS:
        expected = greedy(offline, prompt)
        plain = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        assert plain.choices[0].text == expected
        assert plain.usage.completion_tokens == MAX_TOKENS
        assert plain.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert metric(stack, "pdserve:transfer_bytes_count") >= 2 * len(PROMPTS), "state must cross by NIXL"
    # the router's request series carry its served name, as vLLM's carry model_name
    done = metric(stack, "pdserve:request_success_total", '{finished_reason="length",model_name="tiny"}')
    assert done >= 2 * len(PROMPTS)
    assert metric(stack, "pdserve:generation_tokens_total", '{model_name="tiny"}') >= done * MAX_TOKENS


def test_chat_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    expected = greedy(offline, offline.tokenizer.apply_chat_template(messages))
    extra = {"ignore_eos": True}
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stop_strings_and_logprobs_equal_offline(client: openai.OpenAI, offline: LLM) -> None:
    """Decode replays the first token into its own detokenizer, so a stop string spanning the
    hand-over is still cut, and each token's logprobs come from the process that sampled it."""
    prompt = "The capital of France is"
    free = greedy(offline, prompt)
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], logprobs=2, ignore_eos=True)
    expected = offline.generate(prompt, params)[0]
    reply = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stop=[stop],
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    ours = choice.logprobs.token_logprobs
    theirs = [entry["logprob"] for entry in expected.logprobs][: len(ours)]
    assert len(ours) >= 2 and ours == pytest.approx(theirs, abs=1e-4)


def test_stop_reason_from_prefill_and_decode(stack: Stack, offline: LLM) -> None:
    """vLLM's `stop_reason` crosses both hops: a stop token id that ends the request at its first
    token (on the prefill instance) and one that ends it later (on a decode instance)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = offline.generate(PROMPTS[0], params)[0].token_ids
    for stop_id in (ids[0], next(i for i in ids if i not in ids[:2])):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        body |= {"ignore_eos": True, "stop_token_ids": [stop_id]}
        choice = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
        text = httpx.post(f"{stack.url}/v1/completions", json={**body, "stream": True}, timeout=60).text
        chunks = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]
        last = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
        assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", stop_id)]


def test_seeded_sampling_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    """The decode instance continues the seeded random stream the prefill instance started."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    expected = offline.generate("A seeded story:", params)[0].text
    reply = client.completions.create(
        model="tiny",
        prompt="A seeded story:",
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        seed=42,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == expected


async def one_stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, object]:
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    return text, usage


def test_concurrent_burst_is_packed_and_spread(stack: Stack, offline: LLM) -> None:
    prompts = [("word " * (1 + 7 * i)).strip() for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    batches_before = metric(stack, "pdserve:prefill_batch_size_count")
    requests_before = metric(stack, "pdserve:prefill_batch_size_sum")
    waits = ("time_to_first_token", "prefill_burst_wait", "request_queue_time", "request_prefill_time")
    waits_before = {w: stack.metric(f"pdserve:{w}_seconds_sum") for w in waits}
    counts_before = {w: stack.metric(f"pdserve:{w}_seconds_count") for w in waits}

    async def run_all():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(
                *(one_stream(client, p, n) for p, n in zip(prompts, lengths, strict=True))
            )
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for prompt, n, (text, usage) in zip(prompts, lengths, results, strict=True):
        assert usage.completion_tokens == n
        assert usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert text == greedy(offline, prompt, n)
    batches = metric(stack, "pdserve:prefill_batch_size_count") - batches_before
    requests = metric(stack, "pdserve:prefill_batch_size_sum") - requests_before
    assert requests == 32 and batches < 32, f"32 requests went out in {batches} bursts: none was packed"
    # where each first token waited: in the router, queued on the instance, prefilling; together
    # no longer than the router's TTFT (which adds the wire)
    spent = {w: stack.metric(f"pdserve:{w}_seconds_sum") - waits_before[w] for w in waits}
    assert all(stack.metric(f"pdserve:{w}_seconds_count") - counts_before[w] == 32 for w in waits)
    assert spent["request_prefill_time"] > 0 and min(spent.values()) >= 0
    parts = spent["prefill_burst_wait"] + spent["request_queue_time"] + spent["request_prefill_time"]
    assert parts <= spent["time_to_first_token"], spent
    for i in range(2):
        assert metric(stack, "pdserve:decode_requests_total", f'{{instance="decode-{i}"}}') > 0


def test_all_memory_free_after_load(stack: Stack) -> None:
    async def loads():
        registry = InstanceRegistry(stack.redis.url)
        try:
            return [i.load for role in ("prefill", "decode") for i in await registry.instances(role)]
        finally:
            await registry.close()

    deadline = time.monotonic() + 10
    while True:
        found = asyncio.run(loads())
        leaks = [
            x
            for x in found
            # pages the prefill instance's prefix cache holds are in use by design, not leaked
            if x["free_kv_pages"] + x["prefix_cache_pages"] != x["kv_pages"]
            or x["free_state_slots"] != x["state_slots"]
        ]
        if len(found) == 3 and not leaks:
            return
        assert time.monotonic() < deadline, f"memory not freed: {found}"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("{not json", 400),
        ({"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400),
        ({"model": "nope", "prompt": "hi"}, 404),
        ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400),
        ({"model": "tiny", "prompt": "hi " * 600, "max_tokens": 4}, 400),
    ],
)
def test_bad_input_gets_openai_errors(stack: Stack, body, status) -> None:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{stack.url}/v1/completions", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status
    assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert httpx.get(f"{stack.url}/v1/unknown").status_code == 404
    assert httpx.get(f"{stack.url}/health").json()["decode"] == 2


def test_killed_decode_fails_its_streams_fast(stack: Stack, offline: LLM) -> None:
    """Runs last: kills decode-1 while streams run on both instances."""

    async def long_stream(client: openai.AsyncOpenAI, i: int, started: asyncio.Event) -> tuple[str, float]:
        try:
            stream = await client.completions.create(
                model="tiny",
                prompt=f"story {i}",
                max_tokens=240,  # seconds of decoding: still streaming at the kill; the others end
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    started.set()
            return "ok", time.monotonic()
        except (openai.APIError, httpx.HTTPError) as e:
            return f"error: {e}", time.monotonic()

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
        started = asyncio.Event()
        tasks = [asyncio.create_task(long_stream(client, i, started)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        stack.kill("decode-1")
        done, _ = await asyncio.wait(tasks, timeout=90)
        await client.close()
        return [t.result() for t in done], killed_at

    outcomes, killed_at = asyncio.run(scenario())
    assert len(outcomes) == 8, "every stream must end (no hang)"
    errors = [(o, t) for o, t in outcomes if o.startswith("error")]
    assert errors and len(errors) < 8, f"outcomes: {outcomes}"
    assert all("decode" in o for o, _ in errors), errors
    assert max(t for _, t in errors) - killed_at < 5.0, (
        "clients of the dead instance must hear within seconds"
    )
    # new requests go to the live instance
    expected = greedy(offline, "after the crash", 8)
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
    for _ in range(3):
        out = c.completions.create(
            model="tiny",
            prompt="after the crash",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected


def test_killed_prefill_gets_a_clear_error_not_a_hang(stack: Stack) -> None:
    """Runs last: with its only prefill instance dead the router answers 503 at once, stays up,
    and reports the instance gone once its heartbeat expires."""
    stack.kill("prefill-0")
    c = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=30)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model="tiny", prompt="anyone there?", max_tokens=4)
    assert err.value.status_code == 503 and "prefill" in err.value.message
    assert time.monotonic() - start < 5.0
    deadline = time.monotonic() + 10
    while httpx.get(f"{stack.url}/health").json()["prefill"] != 0:
        assert time.monotonic() < deadline, "the dead prefill instance never left the registry"
        time.sleep(0.5)
