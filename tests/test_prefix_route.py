"""The router's side of the prefix cache, against a real Redis: entries on and off block
boundaries are found by their token ids (block keys, tail markers, exact tails), the longest
per instance; a prompt whose holder is too busy goes elsewhere naming the holder to pull from;
the prefix source a burst item carries is validated."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.messages import GenerateItem, PrefillResult
from pdserve.prefix_keys import entry_key, parents_of, tail_keys, tail_marker
from pdserve.registry import InstanceInfo, InstanceRegistry, RedisServer
from pdserve.sampling.params import SamplingParams
from router.backend import GenerateRequest
from router.bursts import Background, BurstConfig, PrefillBursts
from router.disagg_metrics import DisaggMetrics
from router.instances import InstanceSet
from router.metrics import RouterMetrics
from router.prefix_metrics import PrefixCacheMetrics
from router.prefix_route import prefix_holders

BLOCK, SALT = 64, "tiny:test"


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.mark.parametrize("length", [0, 1, 2, 63, 100])
def test_tail_keys_are_the_entry_keys_of_each_tail(length: int) -> None:
    """The router's incremental tail hashing names each tail as an instance's `entry_key` does."""
    tokens = [(i * 7919) % 248_077 for i in range(length)]
    parent = parents_of(list(range(BLOCK)), BLOCK, SALT)[1]
    want = [(t, entry_key(parent, tokens[:t])) for t in range(min(BLOCK - 1, length), 0, -1)]
    assert tail_keys(parent, tokens, BLOCK - 1) == want


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


class RecordingPrefill:
    """A prefill instance's client that answers every request of a burst with a first token."""

    def __init__(self, bursts: list[dict]) -> None:
        self.bursts = bursts

    async def stream(self, method: str, burst: dict, timeout: float):
        self.bursts.append(burst)
        for item in burst["requests"]:
            yield PrefillResult(item["request_id"], token_id=1).to_wire()


def test_a_busy_holder_is_named_for_a_pull(redis_url: str) -> None:
    """The prefill instance caching a prompt's prefix gets it while it is at most 16 requests
    busier than the least loaded (InstanceSet.pick); beyond that the prompt goes to the least
    loaded one, whose item names the holder's entry as its prefix_source (it may pull it)."""
    prompt = list(range(3000, 3150))

    async def send(holder_running: int) -> tuple[str, list[dict], str]:
        async with InstanceRegistry(redis_url, namespace=f"t3-{holder_running}", secret=None) as registry:
            await publish(registry, "prefill-holder", entry_keys(prompt, 128))
            metrics = RouterMetrics()
            instances = InstanceSet(registry, metrics)
            extra = {"prefix_block_size": BLOCK, "prefix_salt": SALT}
            for i, (name, running) in enumerate((("prefill-holder", holder_running), ("prefill-idle", 0))):
                load = {"running": running, "waiting": 0}
                info = InstanceInfo(
                    "prefill", name, f"127.0.0.1:{i + 1}", load, extra={**extra, "agent": name}
                )
                instances.live["prefill"][name] = info
            sent: dict[str, list[dict]] = {}
            instances.client = lambda info: RecordingPrefill(sent.setdefault(info.instance_id, []))
            bursts = PrefillBursts(instances, DisaggMetrics(metrics), BurstConfig(), Background())
            request = GenerateRequest("r", prompt, SamplingParams(max_tokens=4))
            _, instance = await bursts.first_token(request)
            (burst,) = sent[instance.instance_id]
            return instance.instance_id, burst["requests"], metrics.render().decode()

    chosen, (item,), text = asyncio.run(send(holder_running=16))
    assert chosen == "prefill-holder" and item["prefix_source"] is None
    assert "pdserve:prefix_routed_requests_total 1.0" in text
    chosen, (item,), text = asyncio.run(send(holder_running=17))
    assert chosen == "prefill-idle"
    key = entry_keys(prompt, 128)[0]
    assert item["prefix_source"] == {"agent": "prefill-holder", "key": key, "num_tokens": 128}
    assert "pdserve:prefix_pull_hints_total 1.0" in text


def test_a_burst_counts_the_tokens_it_computes(redis_url: str) -> None:
    """A burst is full at `max_tokens` tokens past each prompt's cached prefix: four follow-up
    turns that hold 300 tokens, 290 of them cached, go out together; four uncached prompts of 300
    go out one by one (the 32 turns of a conversation burst had gone out four at a time). With
    one live instance there is no lookup (the registry has no Redis behind it) and the window
    sends the four uncached prompts together."""
    conversation = list(range(5000, 5290))

    async def send(prompts: list[list[int]], names: tuple[str, ...]) -> tuple[list[int], set[str]]:
        async with InstanceRegistry(redis_url, namespace=f"t4-{prompts[0][0]}", secret=None) as registry:
            await publish(registry, "prefill-0", entry_keys(conversation, 290))
            instances = InstanceSet(registry, RouterMetrics())
            if len(names) == 1:
                instances.registry = InstanceRegistry("redis://127.0.0.1:1", secret=None)  # nobody there
            for i, name in enumerate(names):
                extra = {"prefix_block_size": BLOCK, "prefix_salt": SALT, "agent": name}
                load = {"running": 0, "waiting": 0}
                info = InstanceInfo("prefill", name, f"127.0.0.1:{i + 1}", load, extra=extra)
                instances.live["prefill"][name] = info
            sent: dict[str, list[dict]] = {}
            instances.client = lambda info: RecordingPrefill(sent.setdefault(info.instance_id, []))
            config = BurstConfig(window_s=0.5, max_tokens=300)
            bursts = PrefillBursts(instances, DisaggMetrics(RouterMetrics()), config, Background())
            params = SamplingParams(max_tokens=4)
            requests = [GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
            await asyncio.gather(*(bursts.first_token(r) for r in requests))
            return [len(burst["requests"]) for bursts in sent.values() for burst in bursts], set(sent)

    two = ("prefill-0", "prefill-1")
    turns = [conversation + [i] * 10 for i in range(4)]
    assert asyncio.run(send(turns, two)) == ([4], {"prefill-0"})  # 40 tokens to compute: the window
    fresh = [[9000 + i] * 300 for i in range(4)]
    sizes, _ = asyncio.run(send(fresh, two))
    assert sorted(sizes) == [1, 1, 1, 1]
    assert asyncio.run(send(fresh, ("prefill-0",))) == ([4], {"prefill-0"})


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

    def report(gpu: int, peer: int, no_entry: int, evicted: int = 0, demoted: int = 0) -> dict:
        misses = {"no_entry": no_entry}
        return {
            "hit_tokens": {"gpu": gpu, "peer": peer},
            "misses": misses,
            "evicted": evicted,
            "demoted": demoted,
        }

    prefix.observe("a", report(100, 0, 1, evicted=4, demoted=1))
    prefix.observe("b", report(10, 50, 0))
    prefix.observe("a", report(130, 0, 1, evicted=9, demoted=3))  # +30; 5 evicted, 2 of them to host
    prefix.observe("b", report(5, 0, 2))  # restarted: counted from zero
    text = metrics.render().decode()
    assert 'pdserve:prefix_cache_hit_tokens_by_source_total{source="gpu"} 145.0' in text
    assert 'pdserve:prefix_cache_hit_tokens_by_source_total{source="peer"} 50.0' in text
    assert 'pdserve:prefix_cache_misses_total{reason="no_entry"} 3.0' in text
    assert 'pdserve:prefix_cache_evictions_total{to="host"} 3.0' in text
    assert 'pdserve:prefix_cache_evictions_total{to="dropped"} 6.0' in text
