"""A 6,000-token prompt prefilled in chunks of 512 while two short requests decode beside it:
the long prompt's greedy tokens equal transformers', the short requests' outputs are those they
give alone, and they keep getting tokens during the long prefill (decode rows are scheduled
before prefill chunks)."""

from __future__ import annotations

import json
import shutil

import torch

from pdserve import LLM, SamplingParams
from tests.helpers import assert_no_leaks, random_prompts

LONG = 6000


def test_long_prompt_chunked_beside_decoding_requests(tiny_model_dir, tmp_path) -> None:
    model = tmp_path / "tiny-8k"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192  # the same weights, a longer context
    (model / "config.json").write_text(json.dumps(config))
    long_prompt, *short = random_prompts((LONG, 20, 30), seed=11, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(model), dtype="float32", max_model_len=8192, max_num_batched_tokens=512)
    alone = [out.token_ids for out in llm.generate(short, params)]

    engine = llm.engine
    short_ids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in short
    ]
    engine.step()  # the short ones are decoding
    long_id = engine.add_request(long_prompt, params)
    outputs, tokens_during_prefill = {}, 0
    while engine.has_unfinished():
        prefilling = long_id in engine.requests and not engine.requests[long_id].output_token_ids
        for out in engine.step():
            outputs[out.request_id] = out
            tokens_during_prefill += prefilling and out.request_id in short_ids
    assert tokens_during_prefill >= 10, "the short requests waited for the long prefill"
    assert [outputs[i].token_ids[:16] for i in short_ids] == alone
    assert_no_leaks(engine)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([long_prompt])
    ref = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False
    )
    assert outputs[long_id].token_ids == ref[0, LONG:].tolist()
