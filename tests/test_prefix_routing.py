"""Prefix-aware routing: with two prefill instances, a prompt goes to the one whose cache holds
its prefix (published in Redis), and is served from that cache; sent to the other one (as the
router does when the holder is too busy) naming the holder, it is pulled from there."""
# the prompt a warmed instance caches is a prefix of the routed one: an entry of a whole prompt
# serves the prompts that continue it (the same prompt again must compute its last token)

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.registry import InstanceRegistry
from pdserve.rpc import RpcClient
from router.prefix_route import prefix_holders
from tests.helpers import random_prompts
from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    s = Stack(tiny_model_dir, tmp_path_factory.mktemp("stack2"), num_prefill=2, num_decode=1).start()
    yield s
    s.stop()


async def prefill_directly(
    stack: Stack, instance_id: str, prompt: list[int], prefix_source: dict | None = None
) -> dict:
    """Prefill `prompt` on one instance (not through the router) and free the hand-over; its result."""
    async with InstanceRegistry(stack.redis.url) as registry:
        (instance,) = [i for i in await registry.instances("prefill") if i.instance_id == instance_id]
    client = RpcClient(instance.address, "pdserve.Prefill")
    request = {
        "request_id": f"direct-{len(prompt)}-{prefix_source is not None}",
        "prompt_token_ids": prompt,
        "params": asdict(SamplingParams(temperature=0, max_tokens=2)),
        "prefix_source": prefix_source,
    }
    try:
        (result,) = [r async for r in client.stream("prefill", {"requests": [request]}, timeout=60)]
        assert result["lease"] is not None, result
        release = {"request_id": request["request_id"], "lease_id": result["lease"]["lease_id"]}
        await client.unary("release", release)
    finally:
        await client.close()
    return result


async def warm_cache_of(stack: Stack, instance_id: str, prompt: list[int]) -> dict:
    """Prefill `prompt` on one instance directly (not through the router), free the hand-over,
    and wait until Redis names that instance as the owner of the prompt's cached prefix; that
    entry as a `prefix_source`."""
    await prefill_directly(stack, instance_id, prompt)
    registry = InstanceRegistry(stack.redis.url)
    try:
        (instance,) = [i for i in await registry.instances("prefill") if i.instance_id == instance_id]
        extra = instance.extra
        block_size, salt = extra["prefix_block_size"], extra["prefix_salt"]
        deadline = time.monotonic() + 10
        while True:  # its entry of the whole prompt is found for a prompt continuing it
            holders = await prefix_holders(registry, [*prompt, 1], block_size, salt, {instance_id})
            if holders and holders[0].num_tokens == len(prompt):
                return {"agent": extra["agent"], "key": holders[0].key, "num_tokens": len(prompt)}
            assert time.monotonic() < deadline, "the prefix was never published"
            await asyncio.sleep(0.2)
    finally:
        await registry.close()


def test_request_goes_to_the_instance_caching_its_prefix(stack: Stack, cached_llm: LLM) -> None:
    prompt = random_prompts((150,), seed=21)[0]
    asyncio.run(warm_cache_of(stack, "prefill-1", prompt))  # least-load ties would pick prefill-0
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
    turn = prompt + random_prompts((20,), seed=23)[0]
    reply = client.completions.create(
        model="tiny", prompt=turn, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == 150
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert "pdserve:prefix_cache_hit_tokens_total 150.0" in metrics
    assert "pdserve:prefix_routed_requests_total 1.0" in metrics
    offline = cached_llm  # CPU, fp32, 512 tokens, the prefix cache on, empty (tests/conftest.py)
    expected = offline.generate(turn, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert reply.choices[0].text == expected.text
    # a prompt nobody caches is routed by load alone and computes everything
    other = random_prompts((150,), seed=22)[0]
    fresh = client.completions.create(
        model="tiny", prompt=other, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_prefix_cache_hit_equals_offline(stack: Stack, cached_llm: LLM) -> None:
    """The prefill instance runs with the prefix cache: a long prompt sent again finds its own
    entry, which it cannot use whole (its last token is computed), and checkpoints its last
    token but one; the third time reuses that (reported as cached tokens); every answer is the
    offline one."""
    prompt = " ".join(f"fact {i} is that the sky is blue;" for i in range(25))
    offline = cached_llm  # CPU, fp32, 512 tokens, the prefix cache on, empty (tests/conftest.py)
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=60)
    for attempt in range(3):
        reply = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].text == expected
        cached = reply.usage.prompt_tokens_details.cached_tokens
        want = reply.usage.prompt_tokens - 1 if attempt == 2 else 0
        assert cached == want, f"attempt {attempt}: {cached} cached tokens"


def test_a_prefill_instance_pulls_from_a_busy_holder(stack: Stack, cached_llm: LLM) -> None:
    """prefill-0 is sent a turn naming prefill-1's entry of its prefix (what the router does when
    prefill-1 is too busy to take it): it pulls the pages and checkpoint through NIXL, and the
    first token is the offline one."""
    prompt = random_prompts((150,), seed=24)[0]
    source = asyncio.run(warm_cache_of(stack, "prefill-1", prompt))
    turn = prompt + random_prompts((20,), seed=25)[0]
    result = asyncio.run(prefill_directly(stack, "prefill-0", turn, source))
    assert result["num_cached_tokens"] == 150, "pulled from prefill-1, not computed"
    offline = cached_llm  # CPU, fp32, 512 tokens, the prefix cache on, empty (tests/conftest.py)
    expected = offline.generate(turn, SamplingParams(temperature=0, max_tokens=1))[0].token_ids
    assert [result["token_id"]] == expected
    deadline = time.monotonic() + 5  # the instances' counters reach the router with their load
    while (
        'pdserve:prefix_cache_pulls_total{outcome="done"} 1.0' not in httpx.get(f"{stack.url}/metrics").text
    ):
        assert time.monotonic() < deadline, "the pull is not counted in the router's /metrics"
        time.sleep(0.3)
