"""The prefill role in-process (no gRPC): a bad prompt fails alone and each result streams as
soon as it is ready; held state is freed on release, only with its own lease; a cancelled
stream aborts its queued work."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import pytest

from pdserve.config import EngineConfig
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineHost, ServiceConfig
from prefill_svc.service import PrefillService
from tests.helpers import assert_no_leaks


def request(rid: str, prompt: list[int], **params) -> dict:
    return {"request_id": rid, "prompt_token_ids": prompt, "params": asdict(SamplingParams(**params))}


def service_on(tiny_model_dir, **engine) -> PrefillService:
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=64, **engine
    )
    return PrefillService(EngineHost(ServiceConfig(engine=config, instance_id="prefill-test")))


async def collect(service: PrefillService, burst: list[dict]) -> dict[str, dict]:
    return {r["request_id"]: r async for r in service.prefill({"requests": burst})}


def test_burst_with_a_bad_prompt(tiny_model_dir) -> None:
    async def scenario() -> None:
        service = service_on(tiny_model_dir)
        service.host.start()
        try:
            burst = [
                request("a", [1, 2, 3], max_tokens=8),
                request("b", [5] * 100, max_tokens=8),  # longer than max_model_len
                request("c", [7, 8], max_tokens=1),  # ends at its first token
            ]
            results = await collect(service, burst)
            assert "max_model_len" in results["b"]["error"] and results["b"]["error_code"] == "invalid"
            lease = results["a"]["lease"]
            assert lease["num_tokens"] == 3 and not results["a"]["finished"]
            assert results["c"]["finished"] and results["c"]["lease"] is None
            assert set(service.engine.scheduler.held) == {"a"}
            with pytest.raises(ValueError, match="unique"):
                await collect(service, [request("x", [1]), request("x", [2])])
            again = (await collect(service, [request("a", [9, 9])]))["a"]
            assert "already in use" in again["error"]
            wrong = {"request_id": "a", "lease_id": "0" * 32, "pulled": True}
            assert (await service.release(wrong))["intact"] is False  # another lease: not freed
            right = {"request_id": "a", "lease_id": lease["lease_id"], "pulled": True}
            assert (await service.release(right))["intact"] is True
            assert (await service.release(right))["intact"] is False
            assert_no_leaks(service.engine)
        finally:
            service.host.stop()

    asyncio.run(scenario())


def test_burst_larger_than_the_state_slots_streams_results(tiny_model_dir) -> None:
    """Each result comes out as soon as it is ready: with 2 state slots, a burst of 6 would wait
    on itself if results were held back until the whole burst was done."""

    async def scenario() -> None:
        service = service_on(tiny_model_dir, max_num_seqs=2)
        service.host.start()
        try:
            burst = [request(f"r{i}", [3 + i, 4, 5], max_tokens=4) for i in range(6)]
            stream = service.prefill({"requests": burst})
            results = []
            for _ in range(6):  # release each lease as it arrives, as decode instances would
                result = await asyncio.wait_for(anext(stream), timeout=30)
                results.append(result)
                release = {"request_id": result["request_id"], "lease_id": result["lease"]["lease_id"]}
                assert (await service.release(release))["intact"] is True
            await stream.aclose()
            # each result says how long it queued (the last four for one of the two sequences)
            # and how long its prefill took
            assert all(r["prefill_s"] > 0 and r["queue_s"] >= 0 for r in results)
            first_two, rest = results[:2], results[2:]
            assert min(r["queue_s"] for r in rest) > max(r["queue_s"] for r in first_two)
            assert_no_leaks(service.engine)
        finally:
            service.host.stop()

    asyncio.run(scenario())


def test_expired_lease_is_not_intact_and_cancel_aborts_queued_work(tiny_model_dir) -> None:
    async def scenario() -> None:
        service = service_on(tiny_model_dir, max_num_seqs=1)
        service.engine.scheduler.lease_ttl_s = 0.0
        service.host.start()
        try:
            first = (await collect(service, [request("a", [1, 2, 3], max_tokens=4)]))["a"]
            await asyncio.sleep(0.1)  # the engine thread expires the lease
            release = {"request_id": "a", "lease_id": first["lease"]["lease_id"], "pulled": True}
            assert (await service.release(release))["intact"] is False
            service.engine.scheduler.lease_ttl_s = 60.0
            stream = service.prefill(
                {"requests": [request(f"q{i}", [1, 2, i], max_tokens=4) for i in range(4)]}
            )
            held = await asyncio.wait_for(anext(stream), timeout=30)  # one slot: the rest stay queued
            await stream.aclose()  # the router went away
            await service.abort({"request_ids": [held["request_id"]]})
            await asyncio.sleep(0.2)
            assert_no_leaks(service.engine)
        finally:
            service.host.stop()

    asyncio.run(scenario())


def test_queue_time_counts_from_the_burst_reaching_the_instance(tiny_model_dir) -> None:
    """A burst that arrives while the engine thread is busy (a long step) waits for it before it
    can be queued on the engine: that wait is queue time, not a gap no figure covers."""

    async def scenario() -> None:
        service = service_on(tiny_model_dir)
        service.host.start()
        try:
            service.thread.post(time.sleep, 0.5)  # the engine thread mid-"step"
            got = await collect(service, [request("late", [1, 2, 3], max_tokens=1)])
            assert got["late"]["queue_s"] >= 0.45 and got["late"]["prefill_s"] < 5
        finally:
            service.host.stop()

    asyncio.run(scenario())
