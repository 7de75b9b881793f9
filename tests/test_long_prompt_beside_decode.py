"""A 6,000-token prompt prefilled in chunks of 512 while two short requests decode beside it:
the long prompt's greedy tokens equal transformers', the short requests' outputs are those they
give alone, and they keep getting tokens during the long prefill: in mixed steps (decode rows
are scheduled before prefill chunks), and with the chunks past 1,024 tokens run as background
passes beside the decode steps (pdserve.engine.background_pass: on a CPU, their layers in turn
between the steps)."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import mid_pass_saves
from tests.helpers import assert_no_leaks, random_prompts

LONG = 6000


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_long_prompt_chunked_beside_decoding_requests(tiny_model_dir, tmp_path, device: str) -> None:
    model = tmp_path / "tiny-8k"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192  # the same weights, a longer context
    (model / "config.json").write_text(json.dumps(config))
    long_prompt, *short = random_prompts((LONG, 20, 30), seed=11, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = {}
    for background in (0, 1024):
        # on the GPU the background passes run on a green context's stream beside the decode graphs;
        # 600 KV pages, not 90% of the GPU (a second engine is built while the first is alive)
        llm = LLM(str(model), device=device, dtype="float32", max_model_len=8192, max_num_batched_tokens=512,
                  background_prefill_tokens=background, max_num_seqs=4, num_kv_pages=600)  # fmt: skip
        alone = [out.token_ids for out in llm.generate(short, params)]
        engine = llm.engine
        short_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        short_ids = [engine.add_request(p, short_params) for p in short]
        engine.step()  # the short ones are decoding
        long_id = engine.add_request(long_prompt, params)
        outputs, tokens_during_prefill, beside_background = {}, 0, 0
        while engine.has_unfinished():
            prefilling = long_id in engine.requests and not engine.requests[long_id].output_token_ids
            for out in engine.step():
                outputs[out.request_id] = out
                tokens_during_prefill += prefilling and out.request_id in short_ids
                beside_background += engine.background.current is not None and out.request_id in short_ids
        assert tokens_during_prefill >= 10, "the short requests waited for the long prefill"
        assert (beside_background >= 10) == bool(background), (
            f"{beside_background} tokens beside a background pass"
        )
        assert [outputs[i].token_ids[:16] for i in short_ids] == alone
        assert_no_leaks(engine)
        got[background] = outputs[long_id].token_ids
    assert got[1024] == got[0]
    if device == "cuda":
        return  # transformers' answer is the CPU case's

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([long_prompt])
    ref = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False
    )
    assert got[0] == ref[0, LONG:].tolist()


def test_abort_during_a_background_pass_frees_its_memory(tiny_model_dir) -> None:
    """A long prompt aborted while its chunk runs as a background pass: the pass is waited for,
    its reserved checkpoints freed, and its pages and slot returned; the short request decodes on."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=128, background_prefill_tokens=200)
    engine = llm.engine
    long_prompt, short = random_prompts((400, 12), seed=12, vocab=1000)
    short_id = engine.add_request(short, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    long_id = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4))
    for _ in range(50):
        engine.step()
        if engine.background.current is not None:
            break
    assert engine.background.current is not None and engine.background.current.seq.request_id == long_id
    assert engine.abort(long_id)
    assert engine.background.current is None
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert long_id not in outputs and outputs[short_id].finished
    assert_no_leaks(engine)


@pytest.mark.parametrize("background", [0, 200])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_short_request_starts_during_a_long_prefill(tiny_model_dir, device: str, background: int) -> None:
    """A short prompt that arrives while a long one is being prefilled in chunks is admitted at
    the next step (the long chunk yields the tokens it needs), not after the whole long prompt;
    both give the tokens they give alone. With a background threshold the long chunks then run
    as background passes beside it (on the GPU: its prefill beside a green context's pass)."""
    llm = LLM(str(tiny_model_dir), device=device, dtype="float32", max_num_batched_tokens=128, max_num_seqs=4,
              background_prefill_tokens=background, enable_prefix_caching=False, num_kv_pages=64)  # fmt: skip
    long_prompt, short = random_prompts((480, 20), seed=13, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [out.token_ids for out in llm.generate([long_prompt, short], params)]
    engine = llm.engine
    long_id = engine.add_request(long_prompt, params)
    engine.step()  # the long prompt's first chunk
    short_id = engine.add_request(short, params)
    outputs, steps, first_token_step, background_steps = {}, 0, None, 0
    while engine.has_unfinished():
        steps += 1
        outs = engine.step()
        background_steps += engine.background.current is not None
        for out in outs:
            outputs[out.request_id] = out
            if out.request_id == short_id and first_token_step is None:
                first_token_step = steps
    long_seq_steps = -(-len(long_prompt) // 128)
    assert first_token_step is not None and first_token_step <= 2 < long_seq_steps - 1, first_token_step
    assert (background_steps > 0) == bool(background)
    assert [outputs[long_id].token_ids, outputs[short_id].token_ids] == alone
    assert_no_leaks(engine)


def test_a_long_prompts_first_chunk_already_runs_beside_decoding(tiny_model_dir) -> None:
    """Every chunk of a prompt of at least the threshold's tokens runs as a background pass beside
    the decode rows, its first one too (session 24: a 131K-token prompt's first four 8K chunks,
    which ended below the threshold, ran in mixed steps of 115-183 ms, the streams' worst gaps);
    its tokens are those it gives alone."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=128, background_prefill_tokens=200,
              enable_prefix_caching=False)  # fmt: skip
    long_prompt, short = random_prompts((400, 12), seed=14, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([long_prompt], params)[0].token_ids
    engine = llm.engine
    short_id = engine.add_request(short, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.step()
    long_id = engine.add_request(long_prompt, params)
    engine.step()  # the long prompt's first chunk (tokens 0-127, below the threshold)
    current = engine.background.current
    assert current is not None and current.seq.request_id == long_id and current.seq.num_computed_tokens == 0
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert outputs[long_id].token_ids == alone and outputs[short_id].finished
    assert_no_leaks(engine)


@pytest.mark.gpu
def test_cuda_background_pass_starts_without_waiting_for_the_device(tiny_model_dir, tmp_path) -> None:
    """Starting a background pass and launching its first layers (the step log's `bg_ms`) never
    waits for the GPU: with the default stream held ~0.2 s by a spin kernel queued just before
    the step, the host spends milliseconds on the pass. Its chunks (1,024 tokens, over
    RECURRENT_MAX_CUDA) scan through fla, whose host read of cu_seqlens waited for the spin and
    the step (session 24's 130-147 ms `bg_ms` at a long prompt's first background pass)."""
    model = tmp_path / "tiny-8k"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    llm = LLM(str(model), device="cuda", dtype="float32", max_model_len=8192, max_num_batched_tokens=1024,
              background_prefill_tokens=2048, max_num_seqs=4, num_kv_pages=600,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    for attempt in range(2):  # the first builds what the pass needs (kernels, the green context)
        long_prompt, short = random_prompts((3000, 12), seed=30 + attempt, vocab=1000)
        engine.add_request(short, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        engine.step()
        engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of one SM spinning, ahead of the step on the default stream
        began = time.perf_counter()
        engine.step()  # launches the decode step, then starts the long prompt's first chunk beside it
        stepped = time.perf_counter() - began
        started, host_s = engine.background.current, engine.background.host.total
        while engine.has_unfinished():
            engine.step()
    assert started is not None and started.item.num_new_tokens > mid_pass_saves.RECURRENT_MAX_CUDA  # fla
    assert host_s < 0.05, (
        f"the pass's start took {host_s * 1e3:.0f} ms of host time, the step {stepped * 1e3:.0f}"
    )


@pytest.mark.parametrize("express", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_short_prompt_beside_a_long_pass_runs_as_the_express_pass(
    tiny_model_dir, device: str, express: bool
) -> None:
    """With `express_prefill`, a short prompt admitted beside decode rows while a long prompt's
    chunk runs in the background is taken out of the step too, as the express pass (a step of
    128 prompt tokens beside the decode rows was a 27-70 ms gap in every stream, H200); without
    it, it runs in the decode step. Either way every request gives the tokens it gives alone,
    the long prompt's pass goes on, and nothing leaks."""
    llm = LLM(str(tiny_model_dir), device=device, dtype="float32", max_num_batched_tokens=128,
              background_prefill_tokens=200, enable_prefix_caching=False, num_kv_pages=64,
              express_prefill=express)  # fmt: skip
    long_prompt, decoding, late = random_prompts((500, 12, 20), seed=15, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [out.token_ids for out in llm.generate([long_prompt, decoding, late], params)]
    engine = llm.engine
    lane, split, taken_beside = engine.background, engine.background.split, []

    def recording_split(scheduled):
        step, taken = split(scheduled)
        if taken is not None and lane.current is not None:
            taken_beside.append((taken.seq.request_id, lane.current.seq.request_id))
        return step, taken

    lane.split = recording_split
    ids = [engine.add_request(decoding, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))]
    engine.step()
    ids.append(engine.add_request(long_prompt, params))
    while lane.current is None:
        engine.step()
    ids.append(engine.add_request(late, params))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    assert taken_beside == ([(ids[2], ids[1])] if express else [])
    assert [outputs[ids[1]].token_ids, outputs[ids[0]].token_ids[:6], outputs[ids[2]].token_ids] == [
        alone[0],
        alone[1],
        alone[2],
    ]
    assert_no_leaks(engine)
