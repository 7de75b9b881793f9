"""The offline `LLM` as vLLM's: `n` completions per prompt, `seed` for the requests that set none,
generation_config.json defaults, and a multimodal checkpoint whose outer config ties the output
projection to the embedding (as transformers loads it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve.config import ModelConfig
from pdserve.llm import LLM
from pdserve.request_defaults import RequestDefaults, SeedStream, choice_seed, read_generation_defaults
from pdserve.sampling.params import SamplingParams

PROMPT = "Once upon a time"
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 256}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), **ENGINE)


def test_n_gives_n_completions_each_seeded_as_the_router_seeds_them(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate([PROMPT, "Hello"], params)
    assert len(outs) == 6 and [len(o.token_ids) for o in outs] == [6] * 6
    alone = [
        SamplingParams(temperature=1.0, seed=choice_seed(11, j), max_tokens=6, ignore_eos=True)
        for j in range(3)
    ]
    assert [o.token_ids for o in llm.generate([PROMPT] * 3, alone)] == [o.token_ids for o in outs[:3]]
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3  # three different samples
    greedy = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=6))
    assert len(greedy) == 2 and greedy[0].token_ids == greedy[1].token_ids


def test_seed_seeds_the_requests_that_set_none(tiny_model_dir: Path, llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    seeded = LLM(str(tiny_model_dir), seed=3, **ENGINE)
    first = [o.token_ids for o in seeded.generate([PROMPT, PROMPT], params)]
    second = [o.token_ids for o in seeded.generate([PROMPT, PROMPT], params)]
    assert first[0] != first[1] and first != second  # each request draws its own seed from the stream
    seeded.seeds = SeedStream(3)  # the stream of a fresh LLM(seed=3)
    assert [o.token_ids for o in seeded.generate([PROMPT, PROMPT], params)] == first
    explicit = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    assert seeded.generate(PROMPT, explicit)[0].token_ids == llm.generate(PROMPT, explicit)[0].token_ids
    assert llm.seeds.next_seed() is None  # without seed, requests stay unseeded


def test_generation_config_gives_the_default_params(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "max_new_tokens": 5, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model), **ENGINE)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p, default.max_tokens) == (0.0, 20, 0.95, 5)
    assert len(llm.generate(PROMPT)[0].token_ids) <= 5
    assert read_generation_defaults(model, "vllm") == {}
    assert read_generation_defaults(tmp_path, "auto") == {}  # no file: nothing
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_generation_defaults(model, str(tmp_path))
    (model / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p"):
        RequestDefaults.load(model)


def wrapped_tied_checkpoint(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model as a multimodal checkpoint: text weights under model.language_model., no
    lm_head, and `tie_word_embeddings` true on the outer config only (the text_config says false,
    as transformers saves it)."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    text = json.loads((tiny_model_dir / "config.json").read_text())
    assert text["tie_word_embeddings"] is False
    outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": text}
    (out / "config.json").write_text(json.dumps(outer))
    weights = load_file(tiny_model_dir / "model.safetensors")
    wrapped = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in weights.items()
        if k != "lm_head.weight"
    }
    save_file(wrapped, out / "model.safetensors")
    return out


def test_outer_tie_word_embeddings_loads_tied(tiny_model_dir: Path, tmp_path: Path) -> None:
    tied_dir = wrapped_tied_checkpoint(tiny_model_dir, tmp_path / "tied")
    assert ModelConfig.from_pretrained(tied_dir).tie_word_embeddings is True
    # the same model as a text checkpoint whose lm_head is a copy of the embedding
    copy_dir = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy_dir)
    weights = load_file(copy_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, copy_dir / "model.safetensors")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    tied = LLM(str(tied_dir), **ENGINE).generate(PROMPT, params)[0]
    copied = LLM(str(copy_dir), **ENGINE).generate(PROMPT, params)[0]
    assert tied.token_ids == copied.token_ids
    assert [sorted(step) for step in tied.logprobs] == [sorted(step) for step in copied.logprobs]
    # a tied checkpoint that also saved lm_head.weight loads too (the copy is not read)
    weights = load_file(tied_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["model.language_model.embed_tokens.weight"] * 0
    save_file(weights, tied_dir / "model.safetensors")
    assert LLM(str(tied_dir), **ENGINE).generate(PROMPT, params)[0].token_ids == tied.token_ids
