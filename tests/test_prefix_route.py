"""The router's side of the prefix cache, against a real Redis: entries on and off block
boundaries are found by their token ids (block keys, tail markers, exact tails), the longest
per instance; the prefix source a burst item carries is validated."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.messages import GenerateItem
from pdserve.prefix_keys import entry_key, parents_of, tail_marker
from pdserve.registry import InstanceRegistry, RedisServer
from router.metrics import RouterMetrics
from router.prefix_metrics import PrefixCacheMetrics
from router.prefix_route import prefix_holders

BLOCK, SALT = 64, "tiny:test"


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


def entry_keys(tokens: list[int], n: int) -> list[str]:
    """What an instance holding an entry of `tokens[:n]` publishes (PrefixCache.published_keys)."""
    parent = parents_of(tokens[:n], BLOCK, SALT)[n // BLOCK]
    tail = tokens[n // BLOCK * BLOCK : n]
    keys = [entry_key(parent, tail).hex()]
    return keys + [tail_marker(parent).hex()] if tail else keys


async def publish(registry: InstanceRegistry, owner: str, keys: list[str]) -> None:
    for key in keys:
        await registry.set_prefix_owner(key, owner, ttl_s=30)


def test_longest_prefix_per_instance(redis_url: str) -> None:
    conversation = list(range(1000, 1300))
    prompt = conversation[:250] + [7, 7, 7]  # the next turn: 250 tokens in common, then new ones

    async def run() -> list:
        async with InstanceRegistry(redis_url, namespace="t1", secret=None) as registry:
            await publish(registry, "prefill-0", entry_keys(conversation, 128))  # a block boundary
            await publish(registry, "prefill-0", entry_keys(conversation, 150))  # a prompt's end
            await publish(registry, "decode-1", entry_keys(conversation, 249))  # a generation's end
            await publish(registry, "decode-2", entry_keys(conversation, 260))  # diverges from it
            await publish(registry, "gone", entry_keys(conversation, 200))  # not live
            live = {"prefill-0", "decode-1", "decode-2"}
            return await prefix_holders(registry, prompt, BLOCK, SALT, live)

    holders = asyncio.run(run())
    assert [(h.instance_id, h.num_tokens) for h in holders] == [("decode-1", 249), ("prefill-0", 150)]
    assert holders[0].key == entry_keys(conversation, 249)[0]


def test_a_prompt_is_never_served_whole(redis_url: str) -> None:
    """An entry of the whole prompt is not a hit: its last token must be computed."""
    prompt = list(range(2000, 2100))

    async def run() -> list:
        async with InstanceRegistry(redis_url, namespace="t2", secret=None) as registry:
            await publish(registry, "p", entry_keys(prompt, 100))
            await publish(registry, "p", entry_keys(prompt, 99))
            return await prefix_holders(registry, prompt, BLOCK, SALT, {"p"})

    assert [(h.instance_id, h.num_tokens) for h in asyncio.run(run())] == [("p", 99)]


def test_prefix_source_is_validated() -> None:
    source = {"agent": "decode-0#ab12", "key": "ab" * 32, "num_tokens": 300}
    wire = {"request_id": "r", "prompt_token_ids": [1, 2], "params": {}, "prefix_source": source}
    assert GenerateItem.from_wire(wire).prefix_source == source
    assert GenerateItem.from_wire({**wire, "prefix_source": None}).prefix_source is None
    for bad in ({**source, "key": "not hex"}, {**source, "num_tokens": 0}, {**source, "address": "x"}, []):
        with pytest.raises(ValueError, match="prefix_source"):
            GenerateItem.from_wire({**wire, "prefix_source": bad})


def test_instance_counters_become_router_counters() -> None:
    """Each instance's running totals count once; a total that went down is a restart."""
    metrics = RouterMetrics()
    prefix = PrefixCacheMetrics(metrics)

    def report(gpu: int, peer: int, no_entry: int) -> dict:
        return {"hit_tokens": {"gpu": gpu, "peer": peer}, "misses": {"no_entry": no_entry}}

    prefix.observe("a", report(100, 0, 1))
    prefix.observe("b", report(10, 50, 0))
    prefix.observe("a", report(130, 0, 1))  # +30
    prefix.observe("b", report(5, 0, 2))  # restarted: counted from zero
    text = metrics.render().decode()
    assert 'pdserve:prefix_cache_hit_tokens_by_source_total{source="gpu"} 145.0' in text
    assert 'pdserve:prefix_cache_hit_tokens_by_source_total{source="peer"} 50.0' in text
    assert 'pdserve:prefix_cache_misses_total{reason="no_entry"} 3.0' in text
