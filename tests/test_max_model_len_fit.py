"""issue 12: max_model_len not given is the model's max_position_embeddings when the KV pool holds
one request that long, else the longest that fits, said at start (vLLM's default); a given one
that does not fit stops the start; a prompt past the limit is refused naming the numbers."""

from __future__ import annotations

import logging

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling.params import SamplingParams
from tests.helpers import random_prompts

PAGE = 16


def engine(model_dir, **kwargs: object) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), dtype="float32", page_size=PAGE, **kwargs))


def test_the_model_length_is_kept_when_it_fits(tiny_model_dir) -> None:
    e = engine(tiny_model_dir, num_kv_pages=1000)
    assert e.config.max_model_len == e.model_config.max_position_embeddings == 4096


def test_the_length_is_lowered_to_what_fits_and_said(tiny_model_dir, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.model_runner"):
        e = engine(tiny_model_dir, num_kv_pages=40)
    assert e.config.max_model_len == 40 * PAGE
    assert "max_model_len 640: the KV pool holds 40 pages of 16 tokens" in caplog.text
    assert "max_position_embeddings 4096" in caplog.text
    fits, too_long = random_prompts((639, 640), seed=7)
    e.add_request(fits, SamplingParams(temperature=0, max_tokens=4))
    outputs = []
    while e.has_unfinished():
        outputs.extend(e.step())
    last = outputs[-1]  # the limit, not max_tokens, ends it: one token fits after 639
    assert last.finished and last.finish_reason == "length" and len(last.token_ids) == 1
    with pytest.raises(ValueError, match=r"the prompt has 640 tokens; max_model_len 640 \(the longest"):
        e.add_request(too_long, SamplingParams(max_tokens=1))


def test_a_given_length_that_does_not_fit_stops_the_start(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="num_kv_pages 40 cannot hold max_model_len 4096"):
        engine(tiny_model_dir, num_kv_pages=40, max_model_len=4096)
