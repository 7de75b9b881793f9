"""Faults a stack must survive (2 prefill + 2 decode processes, real Redis, loopback): clients
that leave, a prefill SIGKILLed during a burst and restarted under its instance id, a Redis
restart, a decode SIGKILLed mid-stream, the router drained by SIGTERM. Run in this order on one
stack."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from dataclasses import asdict

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.messages import DecodeStart, Lease
from pdserve.registry import InstanceRegistry
from pdserve.rpc import RpcClient, RpcError
from tests.stack import Stack

PROMPTS = [
    f"Fault test prompt {i}: tell me about {w}" for i, w in enumerate(["ships", "bees", "clocks", "moss"] * 8)
]
BUSY = ("running", "waiting", "held", "receiving", "incoming")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    flags = {
        "prefill": ["--max-num-seqs", "8"],
        "decode": ["--max-num-seqs", "16"],
        "router": ["--shutdown-timeout", "2"],
    }
    s = Stack(
        tiny_model_dir, tmp_path_factory.mktemp("faults"), num_prefill=2, num_decode=2, extra_flags=flags
    )
    yield s.start()
    s.stop()


@pytest.fixture
def offline(cached_llm: LLM) -> LLM:
    """The offline engine (CPU, fp32, 512 tokens, the prefix cache on): the session's, its cache
    empty (tests/conftest.py)."""
    return cached_llm


def body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def registry_view(stack: Stack) -> dict[str, dict]:
    async with InstanceRegistry(stack.redis.url, password=stack.redis.password) as registry:
        return {
            f"{role}:{i.instance_id}": {"load": i.load, "extra": i.extra}
            for role in ("prefill", "decode")
            for i in await registry.instances(role)
        }


def wait_idle(stack: Stack, within: float) -> float:
    """Seconds until every instance reports no request and every slot free (as published)."""
    start = time.monotonic()
    while True:
        view = asyncio.run(registry_view(stack))
        loads = [v["load"] for v in view.values()]
        if len(loads) == 4 and all(
            not any(load.get(k) for k in BUSY) and load["free_state_slots"] == load["state_slots"]
            for load in loads
        ):
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"not idle after {within} s: {loads}"
        time.sleep(0.1)


def errors_logged(stack: Stack) -> list[str]:
    lines = [f"{name}: {line}" for name in stack.procs for line in stack.log(name).splitlines()]
    return [line for line in lines if " ERROR " in line or "Traceback" in line]


def test_disconnect_storm_frees_everything(stack: Stack) -> None:
    """64 streams, each dropped at a random moment (many before their first token)."""

    async def leave_early(client: httpx.AsyncClient, i: int) -> int:
        rng = random.Random(i)
        async with client.stream("POST", "/v1/completions", json=body(PROMPTS[i % 32] * 3, 200)) as response:
            status = response.status_code
            deadline = time.monotonic() + rng.uniform(0.0, 1.5)
            async for _ in response.aiter_lines():
                if time.monotonic() > deadline:
                    break
        return status

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            return await asyncio.gather(*(leave_early(client, i) for i in range(64)))

    statuses = asyncio.run(storm())
    assert set(statuses) <= {200, 503}, statuses  # no 500
    idle_after = wait_idle(stack, within=3.0)  # 2 s for the instances + a heartbeat to publish it
    assert idle_after < 3.0
    assert not errors_logged(stack), errors_logged(stack)[:5]


def test_prefill_killed_mid_burst_costs_no_request(stack: Stack, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = {p: o.text for p, o in zip(PROMPTS, offline.generate(PROMPTS, params), strict=True)}

    async def one(client: httpx.AsyncClient, prompt: str) -> str | int:
        response = await client.post("/v1/completions", json=body(prompt, 16, stream=False))
        return response.json()["choices"][0]["text"] if response.status_code == 200 else response.status_code

    async def burst_with_a_kill() -> list[str | int]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            calls = [asyncio.create_task(one(client, p)) for p in PROMPTS]
            await asyncio.sleep(0.4)
            stack.kill("prefill-0")
            return await asyncio.gather(*calls)

    got = asyncio.run(burst_with_a_kill())
    assert [g for g in got if not isinstance(g, str)] == [], "a client saw an error"
    assert got == [expected[p] for p in PROMPTS]


def test_prefill_restarted_under_its_id_serves_again(stack: Stack) -> None:
    stack.restart("prefill-0")
    stack.wait_healthy(120)  # loading the model
    back = time.monotonic()
    stack.kill("prefill-1")  # every request must now go through the restarted instance
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        while True:
            response = client.post("/v1/completions", json=body(PROMPTS[0], 4, stream=False))
            if response.status_code == 200:
                break
            assert time.monotonic() - back < 10, f"restarted prefill not serving: {response.text}"
            time.sleep(0.2)
    assert time.monotonic() - back < 10
    stack.restart("prefill-1")
    stack.wait_healthy(120)


def test_redis_restart_registry_and_prefixes_come_back(stack: Stack) -> None:
    prompt = " ".join(PROMPTS)  # ~350 tokens: a prefix-cache checkpoint (64-token blocks)

    async def prefix_keys() -> int:
        async with InstanceRegistry(stack.redis.url, password=stack.redis.password) as registry:
            return len([k async for k in registry._redis.scan_iter(match="pdserve:prefix:*")])

    with httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.post("/v1/completions", json=body(prompt, 2, stream=False)).status_code == 200
    time.sleep(1.5)  # a publishing round
    assert asyncio.run(prefix_keys()) > 0
    stack.redis.restart()
    start = time.monotonic()

    while True:
        view = asyncio.run(registry_view(stack))
        if len(view) == 4 and asyncio.run(prefix_keys()) > 0:
            break
        assert time.monotonic() - start < 10, f"after a Redis restart: {sorted(view)}"
        time.sleep(0.3)
    with httpx.Client(base_url=stack.url, timeout=30) as client:  # the router kept serving throughout
        while True:  # the router reads the registry every 0.5 s: it sees every instance again
            health = client.get("/health").json()
            if health["prefill"] == 2 and health["decode"] == 2:
                break
            assert time.monotonic() - start < 10, health
            time.sleep(0.1)
        assert client.post("/v1/completions", json=body(PROMPTS[1], 4, stream=False)).status_code == 200


def test_decode_killed_mid_stream(stack: Stack) -> None:
    """Streams on the killed decode get an error event within 1 s; the others finish."""

    async def stream(client: httpx.AsyncClient, i: int, state: dict) -> tuple[str, float]:
        # 300 tokens: seconds of decoding, still streaming once all 8 are (the kill); the others end
        async with client.stream("POST", "/v1/completions", json=body(PROMPTS[i], 300)) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                state["streaming"].add(i)
                if "error" in json.loads(line[6:]):
                    return "error", time.monotonic() - state["killed"]
        return "done", 0.0

    async def run() -> list[tuple[str, float]]:
        state = {"streaming": set(), "killed": 0.0}
        async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
            calls = [asyncio.create_task(stream(client, i, state)) for i in range(8)]
            deadline = time.monotonic() + 30
            while len(state["streaming"]) < 8:  # every stream is decoding
                assert time.monotonic() < deadline, f"only {len(state['streaming'])} of 8 streams started"
                await asyncio.sleep(0.01)
            state["killed"] = time.monotonic()
            stack.kill("decode-0")
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    errors = [delay for kind, delay in results if kind == "error"]
    assert errors and len(errors) < len(results), results  # both decode instances had streams
    assert max(errors) < 1.0, f"an error event came {max(errors):.2f} s after the kill"
    stack.restart("decode-0")
    stack.wait_healthy(120)


def test_forged_decode_calls_get_an_error_not_text(stack: Stack) -> None:
    """With the internal secret (a compromised router, say): a lease naming a real prefill
    instance's pages with a made-up lease id is read, refused by its holder and never decoded; a
    lease naming an agent outside the registry is refused without dialing anything."""

    async def forge(agent: str) -> RpcError:
        view = await registry_view(stack)
        decode = next(i for i in view if i.startswith("decode:"))
        async with InstanceRegistry(stack.redis.url, password=stack.redis.password) as registry:
            address = next(
                i.address for i in await registry.instances("decode") if f"decode:{i.instance_id}" == decode
            )
        lease = Lease("forged", "0" * 32, agent, kv_pages=[0, 1], state_slot=0, num_tokens=20)
        start = DecodeStart("forged", list(range(1, 21)), asdict(SamplingParams(max_tokens=8)), 5, lease)
        client = RpcClient(address, "pdserve.Decode")
        try:
            async for event in client.stream("decode", start.to_wire()):
                raise AssertionError(f"a forged call streamed {event}")
        except RpcError as e:
            return e
        finally:
            await client.close()
        raise AssertionError("the forged call ended without an error")

    real_agent = next(
        v["extra"]["agent"] for k, v in asyncio.run(registry_view(stack)).items() if k.startswith("prefill:")
    )
    refused = asyncio.run(forge(real_agent))
    assert refused.code == "ABORTED" and "was not used" in refused.message, refused
    outside = asyncio.run(forge("evil-instance#00000000"))
    assert outside.code == "ABORTED" and "not in the registry" in outside.message, outside


def test_router_sigterm_drains(stack: Stack) -> None:
    """SIGTERM: new requests get 503 + Retry-After; open streams go on for --shutdown-timeout
    (2 s), then end with an SSE error event and [DONE]; the router exits 0."""

    async def stream(client: httpx.AsyncClient, i: int) -> list[str]:
        async with client.stream("POST", "/v1/completions", json=body(PROMPTS[i], 460)) as response:
            return [line async for line in response.aiter_lines() if line.startswith("data: ")]

    async def run() -> tuple[list[list[str]], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            calls = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(1.0)
            signalled = time.monotonic()
            stack.procs["router"].send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await client.post("/v1/completions", json=body(PROMPTS[0], 4, stream=False))
            streams = await asyncio.gather(*calls)
            return streams, refused, time.monotonic() - signalled

    streams, refused, took = asyncio.run(run())
    assert refused.status_code == 503 and refused.headers["retry-after"]
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in lines[-2], lines[-2]
    assert 1.8 < took < 4.0, took
    assert stack.procs["router"].wait(timeout=10) == 0
