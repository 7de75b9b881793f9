"""One engine holding both roles (`pdserve engine`, the one-GPU layout), in-process: a request
goes through the prefill role, then the decode role decodes it in place from its lease (no bytes
move; tests/test_decode_in_place.py: decoding on before the claim).
Greedy output equals the offline engine's token for token; a lease that is gone is refused;
memory is all back afterwards."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import asdict

import pytest

from decode_svc.service import DecodeService
from pdserve import LLM
from pdserve.config import EngineConfig
from pdserve.messages import DecodeStart, Lease
from pdserve.rpc import RpcError
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineHost, ServiceConfig
from prefill_svc.service import PrefillService
from tests.helpers import assert_no_leaks, random_prompts

MAX_TOKENS = 16
PROMPTS = random_prompts((5, 33, 80), seed=3, vocab=1000)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SIZES = {"cpu": {}, "cuda": {"num_kv_pages": 256}}  # not 90% of the GPU for a tiny model


@functools.cache
def offline_tokens(model_dir: str, device: str) -> list[list[int]]:
    """The offline engine's greedy tokens of PROMPTS on `device`: once for both ways of decoding."""
    offline = LLM(model_dir, device=device, dtype="float32", max_model_len=256, **SIZES[device])
    return [out.token_ids for out in offline.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("in_place", [True, False], ids=["decoding-on", "held"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_colocated_equals_offline(tiny_model_dir, device: str, in_place: bool) -> None:
    """On the GPU: against the offline engine on the same GPU (CUDA graphs, the same kernels).
    `in_place`: the engine decodes on after the first token (what `pdserve engine` does) and
    the decode stream gets what it made meanwhile; else it holds the request until then."""
    prompts, params, sizes = PROMPTS, PARAMS, SIZES[device]
    expected = offline_tokens(str(tiny_model_dir), device)

    async def scenario() -> list[list[int]]:
        engine = EngineConfig(
            model=str(tiny_model_dir), device=device, dtype="float32", max_model_len=256, **sizes
        )
        host = EngineHost(ServiceConfig(engine=engine, instance_id="both"), nixl=False)
        host.engine.decode_in_place = in_place
        prefill, decode = PrefillService(host), DecodeService(host)
        host.start()
        try:
            burst = [
                {"request_id": f"r{i}", "prompt_token_ids": p, "params": asdict(params)}
                for i, p in enumerate(prompts)
            ]
            firsts = {r["request_id"]: r async for r in prefill.prefill({"requests": burst})}

            async def finish(i: int) -> list[int]:
                first = firsts[f"r{i}"]
                assert first["lease"]["agent"] == host.agent.name
                start = DecodeStart(
                    f"r{i}", prompts[i], asdict(params), first["token_id"], Lease(**first["lease"])
                )
                tokens = [first["token_id"]]
                async for event in decode.decode(start.to_wire()):
                    if event["transfer"] is not None:
                        assert event["transfer"]["bytes"] == 0  # decoded in place
                    tokens += event["token_ids"]
                return tokens

            got = await asyncio.gather(*(finish(i) for i in range(len(prompts))))
            gone = DecodeStart("r0", prompts[0], asdict(params), 1, Lease(**firsts["r0"]["lease"]))
            with pytest.raises(RpcError, match="no longer held"):
                async for _ in decode.decode(gone.to_wire()):
                    pass
            assert_no_leaks(host.engine)
            return got
        finally:
            host.stop()

    assert asyncio.run(scenario()) == expected
