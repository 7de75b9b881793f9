"""On a CUDA device (skipped in CI): the engine runs there and agrees with the CPU reference."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.check import checkpoint_differences, checkpoint_states
from pdserve.memory import host_tier
from pdserve.model import mid_pass_saves
from tests.helpers import assert_no_leaks, random_prompts, transformers_torch_gdn

pytestmark = pytest.mark.gpu
CUDA_FP32 = {"device": "cuda", "dtype": "float32", "max_model_len": 512, "num_kv_pages": 256}


def first_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of the first sampled token of each prompt (one packed prefill)."""
    seen = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda s, patch=None: seen.append(execute(s, patch)) or seen[-1]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        del llm.engine.runner.execute
    return seen[0].float().cpu()


def test_cuda_fp32_logits_match_cpu(tiny_model_dir) -> None:
    """fla's chunked GDN computes its fp32 dots in tf32: logits agree to about 1%, not bit for bit
    (measured on the H200: 0.2-1.1% relative; with the reference GDN prefill on the GPU, 1e-5)."""
    prompts = random_prompts((1, 17, 64, 150), seed=7)
    cpu = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=512)
    # decode graphs for the 4 prompts only: each captured batch size compiles its own decode kernels
    gpu = LLM(str(tiny_model_dir), device="cuda", dtype="float32", max_model_len=512, num_kv_pages=256,
              max_num_seqs=4)  # fmt: skip
    ref, ours = first_logits(cpu, prompts), first_logits(gpu, prompts)
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 2e-2, f"CUDA fp32 logits differ from the CPU reference by {rel:.2e}"
    out = gpu.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in out)
    assert_no_leaks(gpu.engine)


def test_cuda_matches_transformers_on_cuda(tiny_model_dir, hf_model) -> None:
    """Against transformers: our fp32 agrees with its CPU fp32 logits to rounding (a 40-token
    prompt's GDN runs the recurrent op, exact fp32; transformers on the GPU runs fla's chunked scan,
    whose fp32 dots are tf32, ~1% off); our bf16 is no further from them than transformers' own
    bf16 on the GPU is (the tiny random model is bf16-sensitive: about 10% for both on the H200)."""
    prompt = random_prompts((40,), seed=8)[0]
    ids = torch.tensor([prompt], device="cuda")
    try:
        with torch.no_grad():
            with transformers_torch_gdn():
                ref = hf_model(ids.cpu()).logits[0, -1].float()
            hf_bf16 = hf_model.to("cuda", torch.bfloat16)(ids).logits[0, -1].float().cpu()
    finally:
        hf_model.to(device="cpu", dtype=torch.float32)

    def rel(x: torch.Tensor) -> float:
        return ((x - ref).norm() / ref.norm()).item()

    for dtype, bound in (("float32", 1e-4), ("bfloat16", 1.5 * rel(hf_bf16))):
        # prefill logits only: no decode graphs to capture (and no decode kernels to compile)
        llm = LLM(str(tiny_model_dir), device="cuda", dtype=dtype, max_model_len=512, num_kv_pages=64,
                  enforce_eager=True)  # fmt: skip
        err = rel(first_logits(llm, [prompt])[0])
        assert err <= bound, f"{dtype}: {err:.2e} from transformers fp32 (bound {bound:.2e})"
        assert_no_leaks(llm.engine)
        del llm


def test_cuda_graph_decode_equals_eager(tiny_model_dir) -> None:
    """Decode by graph replay (padded batch sizes, reserved padding page/slot) equals eager decode."""
    prompts = random_prompts((3, 30, 70, 5, 11), seed=9)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(str(tiny_model_dir), **CUDA_FP32, enforce_eager=True)
    graphs = LLM(str(tiny_model_dir), **CUDA_FP32, max_num_seqs=8)
    assert graphs.engine.runner.graphs is not None
    replays = []
    replay = graphs.engine.runner.graphs.replay
    graphs.engine.runner.graphs.replay = lambda batch: replays.append(batch.num_seqs) or replay(batch)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == expected
    assert 5 in replays, "decode steps of 5 sequences should replay the graph of size 8"
    assert_no_leaks(graphs.engine)


def test_cuda_prefix_cache_matches_uncached(tiny_model_dir) -> None:
    """Shared pages + a restored GDN checkpoint on the GPU: the cached request's logits match the
    uncached one's within fla's tf32 rounding (chunk boundaries move with the cache), and its
    decode runs by graph replay."""
    prefix = random_prompts((150,), seed=31)[0]
    first = prefix + [11, 12, 13]
    second = first + [21, 22, 23, 24]  # a continuation: restores the checkpoint at first's end
    kwargs = {**CUDA_FP32, "max_num_seqs": 4}
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, **kwargs)
    cached = LLM(str(tiny_model_dir), enable_prefix_caching=True, **kwargs)
    cached.generate(first, SamplingParams(max_tokens=1))
    ref, ours = first_logits(plain, [second]), first_logits(cached, [second])
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2
    out = cached.generate(second, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert out.num_cached_tokens == len(first) and len(out.token_ids) == 16
    cached.engine.prefix_cache.clear()
    assert_no_leaks(cached.engine)


@pytest.mark.parametrize("aside", [False, True])
def test_cuda_host_tier_hit_matches_uncached(
    tiny_model_dir, aside: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries evicted to the host tier on the GPU (copied out in order on the engine's stream, or
    on the tier's copy stream while the next prompts take their device pages and checkpoints at
    once) come back as they were: follow-ups restored from there, alone and packed, give the
    uncached logits."""
    monkeypatch.setattr(host_tier, "MAX_ASIDE_BYTES", host_tier.ASIDE_BYTES_ON_GPU if aside else 0)
    kwargs = {**CUDA_FP32, "max_num_seqs": 4}
    plain = LLM(str(tiny_model_dir), enable_prefix_caching=False, **kwargs)
    cached = LLM(str(tiny_model_dir), enable_prefix_caching=True, num_prefix_checkpoints=3, **kwargs)
    cache = cached.engine.prefix_cache
    cache.configure_host_tier(64 << 20)
    firsts = random_prompts((140, 150, 160, 170, 180), seed=51)
    for prompt in firsts:  # two entries each: the device holds three, the others go to the host
        cached.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    on_host = {e.num_tokens for e in cache.entries.values() if e.kind == "end" and e.tier == "host"}
    assert {140, 150} <= on_host, on_host
    more = random_prompts((20, 25), seed=52)
    turns = [firsts[0] + more[0], firsts[1] + more[1]]
    before = cache.stats.hit_tokens["host"]
    for batch in ([turns[0]], turns):
        ref, ours = first_logits(plain, batch), first_logits(cached, batch)
        assert ((ours - ref).norm() / ref.norm()).item() < 2e-2
    assert cache.stats.hit_tokens["host"] - before >= 140 + 150
    cache.clear()
    assert_no_leaks(cached.engine)


@pytest.mark.parametrize("scan", ["recurrent", "chunked"])
def test_cuda_checkpoints_packed_equal_alone(
    tiny_model_dir, scan: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 9's pack check on the GPU: packed and one at a time (short pieces a token at a time,
    or with the limits lowered fla's varlen chunked scan; the checkpoint copies on the engine's
    stream), every checkpoint holds the same GDN state."""
    if scan == "chunked":
        monkeypatch.setattr(mid_pass_saves, "RECURRENT_MAX_CUDA", mid_pass_saves.RECURRENT_MAX)
    suffix = tuple(random_prompts((8,), seed=40)[0])
    prompts = [p + list(suffix) for p in random_prompts((70, 129, 200, 333), seed=42)]
    kw = {**CUDA_FP32, "max_num_seqs": 4, "num_prefix_checkpoints": 16}  # 12 checkpoints: all on the device
    llm = LLM(str(tiny_model_dir), **kw, enable_prefix_caching=True)
    alone = checkpoint_states(llm.engine, prompts, suffix, packed=False)
    packed = checkpoint_states(llm.engine, prompts, suffix, packed=True)
    assert {c.kind for c in alone.values()} == {"resume", "end", "decode"}
    for name, diff in checkpoint_differences(packed, alone).items():
        assert diff <= 1e-3, f"{name} of a checkpoint differs by {diff:.2e} packed"
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("save_at", [0, 300])
def test_cuda_prefill_pass_never_waits_for_the_device(tiny_model_dir, save_at: int) -> None:
    """A prefill pass launches without one host sync (torch's sync debug mode raises at any
    synchronising call): fla's chunked scan gets its chunk index from the host (the whole pass,
    or the cut scan's first piece when each prompt saves), so a pass launched while a step runs
    ahead, or a background pass beside a decode step, never waits for them. Without the index
    the same pass raises: the check sees fla's read."""
    from pdserve.ops.bench_prefill_step import PassSpec, prefill_batch

    llm = LLM(str(tiny_model_dir), **{**CUDA_FP32, "max_model_len": 1024}, max_num_seqs=8)  # 8 slots taken
    runner = llm.engine.runner
    spec = PassSpec(prompts=2, length=600, save_at=save_at)  # segments over RECURRENT_MAX_CUDA: fla
    with torch.inference_mode():
        runner.model(prefill_batch(runner, spec)[0])  # fla's autotuners time their configs (syncing) once
        batch = prefill_batch(runner, spec)[0]
        chunked = [batch] if batch.saves is None else [p for p in batch.saves.pieces if not p.recurrent]
        assert chunked, "no chunked scan in the pass: the case tests nothing"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.model(batch)
            for owner in chunked:  # the same pass without the index: fla reads cu_seqlens
                setattr(owner, "gdn_chunks" if owner is batch else "chunks", None)
            with pytest.raises(RuntimeError, match="synchroniz"):
                runner.model(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
