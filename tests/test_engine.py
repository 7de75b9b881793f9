"""The offline API's behaviour: seeded sampling, stop conditions, bad input, bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from tests.helpers import assert_no_leaks, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(autouse=True)
def no_leaks(llm: LLM):
    yield
    assert_no_leaks(llm.engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    prompt = "Once upon a time"
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    batch = llm.generate(["noise", prompt, "more noise here"], [others, seeded, others])
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(prompt, other_seed)[0].token_ids != alone


def test_max_tokens_and_ignore_eos(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_finish_with_stop(llm: LLM) -> None:
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free.token_ids[: first + 1]


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    target = free.token_ids[3]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (target,)  # pretend the model's eos is a token greedy decoding emits
    try:
        stopped = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12))[0]
        ignored = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 4
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_eos_that_is_also_a_stop_token_id_has_no_stop_reason(llm: LLM) -> None:
    """As vLLM: eos is checked before stop_token_ids, so a token that is both ends the request
    with stop_reason None (with ignore_eos it is a stop token id only, and names itself)."""
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    target = free.token_ids[3]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (target,)
    try:
        as_eos, as_stop_id = (
            llm.generate(
                "Hello", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target], ignore_eos=i)
            )[0]
            for i in (False, True)
        )
    finally:
        engine.eos_token_ids = saved
    assert (as_eos.finish_reason, as_eos.stop_reason, as_eos.token_ids[-1]) == ("stop", None, target)
    assert (as_stop_id.finish_reason, as_stop_id.stop_reason) == ("stop", target)
    assert as_stop_id.token_ids == as_eos.token_ids


def test_stop_string_is_not_emitted(llm: LLM) -> None:
    free = llm.generate("The sky", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = llm.generate("The sky", SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "reason"),
    [
        ("", {}, "empty"),
        ([[]], {}, "empty"),
        ([1] * 300, {}, "max_model_len"),
        ([5, 300_000], {}, "vocabulary"),
        ([-1], {}, "vocabulary"),
        ([3, True], {}, "vocabulary"),
        ([3, 4.0], {}, "vocabulary"),
        ("hi", {"max_tokens": 1.5}, "max_tokens"),  # 0 is valid: the prompt scored only
        ("hi", {"max_tokens": -3}, "max_tokens"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"temperature": float("inf")}, "temperature must be finite"),
        ("hi", {"repetition_penalty": 10**400}, "repetition_penalty must be finite"),  # past float's range
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"stop_token_ids": [300_000], "min_tokens": 1}, "stop_token_ids"),
    ],
)
def test_bad_input_raises_value_error(llm: LLM, prompt, kwargs, reason) -> None:
    with pytest.raises(ValueError, match=reason):
        llm.generate(prompt, SamplingParams(**kwargs) if kwargs else None)


def test_bad_request_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4))
    assert not llm.engine.scheduler.waiting


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_incomplete_checkpoint_names_the_missing_tensor(tiny_model_dir, tmp_path) -> None:
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.w13"):
        LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=64)


def test_wrong_shape_names_the_tensor(tiny_model_dir, tmp_path) -> None:
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.3.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=64)


def test_corrupt_checkpoint_fails_at_load(tiny_model_dir, tmp_path) -> None:
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=64)


def test_unsupported_model_type_and_missing_field(tiny_model_dir, tmp_path) -> None:
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="llama"):
        LLM(str(ckpt), device="cpu")
    del config["num_experts"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts"):
        LLM(str(ckpt), device="cpu")


def test_multimodal_wrapper_checkpoint_loads(tiny_model_dir, tmp_path, llm: LLM) -> None:
    """A `qwen3_5_moe` config with `text_config` and `model.language_model.` names + mtp/visual extras."""
    ckpt = copy_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    text = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    tensors = load_file(ckpt / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["mtp.fc.weight"] = tensors["model.norm.weight"].clone()
    renamed["model.visual.patch_embed.weight"] = tensors["model.norm.weight"].clone()
    save_file(renamed, ckpt / "model.safetensors")
    prompt = random_prompts((12,), seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    wrapped = LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=64).generate(prompt, params)
    plain = llm.generate(prompt, params)  # the same weights from the plain checkpoint
    assert wrapped[0].token_ids == plain[0].token_ids


def test_dummy_weights_run_without_a_checkpoint(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu", load_format="dummy", max_model_len=64)
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert_no_leaks(llm.engine)


def test_a_vanishing_top_p_keeps_the_top_token(llm: LLM) -> None:
    """A top_p that rounds to 0 in fp32 must not break the step (it would fail every request in it)."""
    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    tiny = SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=5, ignore_eos=True, seed=3)
    assert llm.generate("Hello", tiny)[0].token_ids == greedy.token_ids
