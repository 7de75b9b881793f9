"""The prefill service in-process (no gRPC): a bad prompt fails alone, the rest of its burst is
handed over; held state is freed on release; malformed bursts are refused whole."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from pdserve.config import EngineConfig
from pdserve.sampling.params import SamplingParams
from prefill_svc.service import PrefillConfig, PrefillService
from tests.helpers import assert_no_leaks


def request(rid: str, prompt: list[int], **params) -> dict:
    return {"request_id": rid, "prompt_token_ids": prompt, "params": asdict(SamplingParams(**params))}


def test_burst_with_a_bad_prompt(tiny_model_dir) -> None:
    async def scenario() -> None:
        engine = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=64)
        service = PrefillService(PrefillConfig(engine=engine, instance_id="prefill-test"))
        service.start()
        try:
            burst = [
                request("a", [1, 2, 3], max_tokens=8),
                request("b", [5] * 100, max_tokens=8),  # longer than max_model_len
                request("c", [7, 8], max_tokens=1),  # ends at its first token
            ]
            results = {r["request_id"]: r for r in (await service.prefill({"requests": burst}))["results"]}
            assert "max_model_len" in results["b"]["error"]
            assert results["a"]["payload"]["num_tokens"] == 3 and not results["a"]["finished"]
            assert results["c"]["finished"] and results["c"]["payload"] is None
            assert set(service.held) == {"a"}
            with pytest.raises(ValueError, match="unique"):
                await service.prefill({"requests": [request("x", [1]), request("x", [2])]})
            again = (await service.prefill({"requests": [request("a", [9, 9])]}))["results"][0]
            assert "already in use" in again["error"]
            assert (await service.release({"request_id": "a"}))["released"] is True
            assert (await service.release({"request_id": "a"}))["released"] is False
            assert_no_leaks(service.engine)
        finally:
            service.stop()

    asyncio.run(scenario())
