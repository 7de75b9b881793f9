"""Constraints on the next token, in the sampler and the engine (CPU): min_p before top-p as vLLM
orders them, logit_bias and allowed_token_ids, and structured outputs on xgrammar (the grammar's
rows follow it to end-of-sequence, the other rows of the batch are token-identical to a batch
without them, the matcher catches up on tokens sampled elsewhere, a reasoning block stays free,
bad specs are the request's ValueError, one compile per spec)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling.grammar import tokenizer_grammars
from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import Sampler, SamplingState
from pdserve.sampling.stop import StopChecker
from pdserve.tokenizer import Tokenizer, load_tokenizer

VOCAB = 248_320  # the tiny model's logits (more columns than the tokenizer's 248,077 ids)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def state(params: SamplingParams, tokenizer: Tokenizer, prompt: list[int] | None = None) -> SamplingState:
    """A request's sampling state, set up as the engine sets it up (the stop checker compiles)."""
    StopChecker(params, tokenizer, tokenizer.eos_token_ids)
    return SamplingState.create(params, prompt or [1, 2, 3], tokenizer.eos_token_ids)


# ---- filters and biases
def test_min_p_applies_before_top_p() -> None:
    """[.4, .3, .2, .1], min_p .3, top_p .75: min-p drops token 3, top-p over the renormalised
    [.44, .33, .22] keeps tokens 0 and 1; applied after top-p, min-p would keep token 2 too."""
    rows = 4000
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(rows, 4)
    params = SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)
    torch.manual_seed(0)
    tokens = Sampler().sample(logits, [SamplingState(params, [1]) for _ in range(rows)]).token_ids
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.4 / 0.7) < 0.03


def test_logit_bias_and_allowed_tokens_steer_their_rows_only() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(dim=-1)
    second = logits.topk(2, dim=-1).indices[:, 1]
    requests = [
        SamplingState(SamplingParams(temperature=0, logit_bias={7: 100}), [1]),
        SamplingState(SamplingParams(temperature=0, logit_bias={int(best[1]): -100}), [1]),
        SamplingState(SamplingParams(temperature=0), [1]),
        SamplingState(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[5, 9]), [1]),
    ]
    sampler = Sampler()
    for _ in range(20):
        tokens = sampler.sample(logits, requests).token_ids.tolist()
        assert tokens[:3] == [7, int(second[1]), int(best[2])]
        assert tokens[3] in (5, 9)
    sampled = SamplingState(SamplingParams(temperature=1.0, seed=0, logit_bias={"11": 100}), [1])
    assert {sampler.sample(logits[:1], [sampled]).token_ids.item() for _ in range(20)} == {11}


# ---- structured outputs in the sampler
def sample_steps(rows: list[tuple[int, SamplingState]], eos: tuple[int, ...], steps: int) -> None:
    """Sample up to `steps` tokens for each (key, state) row from random logits seeded by the
    step and the key (so a row gets the same logits whatever batch it is in), appending each
    token to the row's output until the row samples end-of-sequence."""
    sampler = Sampler()
    for step in range(steps):
        live = [(k, r) for k, r in rows if not (r.output_token_ids and r.output_token_ids[-1] in eos)]
        if not live:
            return
        logits = torch.stack(
            [torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * step + k)) for k, _ in live]
        )
        for (_, r), token in zip(
            live, sampler.sample(logits, [r for _, r in live]).token_ids.tolist(), strict=True
        ):
            r.output_token_ids.append(token)


def free_rows() -> list[tuple[int, SamplingState]]:
    return [
        (1, SamplingState.create(SamplingParams(temperature=0), [1, 2])),
        (2, SamplingState.create(SamplingParams(seed=5), [1, 2])),
    ]


def test_grammar_rows_follow_their_spec_and_leave_the_others_alone(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids
    alone = free_rows()
    sample_steps(alone, eos, steps=8)
    regex = state(SamplingParams(temperature=0, structured_outputs={"regex": "[a-c]{2,4}x"}), tokenizer)
    choice = state(SamplingParams(seed=2, structured_outputs={"choice": ["red", "green"]}), tokenizer)
    mixed = free_rows()
    sample_steps([mixed[0], (3, regex), mixed[1], (4, choice)], eos, steps=8)
    assert [r.output_token_ids for _, r in mixed] == [r.output_token_ids for _, r in alone]
    assert regex.output_token_ids[-1] in eos and choice.output_token_ids[-1] in eos
    assert re.fullmatch("[a-c]{2,4}x", tokenizer.decode(regex.output_token_ids[:-1]))
    assert tokenizer.decode(choice.output_token_ids[:-1]) in ("red", "green")


def test_matcher_catches_up_on_tokens_sampled_elsewhere(tokenizer: Tokenizer) -> None:
    """A decode instance starts from the first token the prefill instance sampled: already in the
    output when the grammar first runs. Greedy on random logits, the mask must finish that choice."""
    row = state(
        SamplingParams(temperature=0, structured_outputs={"choice": ["yes sir", "no sir"]}), tokenizer
    )
    row.output_token_ids.extend(tokenizer.encode("no"))
    sample_steps([(7, row)], tokenizer.eos_token_ids, steps=10)
    assert tokenizer.decode(row.output_token_ids, skip_special_tokens=True) == "no sir"
    assert row.output_token_ids[-1] in tokenizer.eos_token_ids


def test_reasoning_stays_free_until_its_end_tag(tokenizer: Tokenizer) -> None:
    spec = {"choice": ["A"], "reasoning_tags": ["<think>", "</think>"]}
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    row = state(SamplingParams(temperature=0, structured_outputs=spec), tokenizer, prompt=opened)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    free_token = int(logits.argmax())
    row.output_token_ids.extend(tokenizer.encode("hmm"))
    assert Sampler().sample(logits, [row]).token_ids.item() == free_token  # reasoning: not masked
    row.output_token_ids.extend(tokenizer.encode("</think>"))  # the grammar starts right after it
    assert Sampler().sample(logits, [row]).token_ids.tolist() == tokenizer.encode("A")
    closed = state(SamplingParams(temperature=0, structured_outputs=spec), tokenizer, prompt=[1, 2])
    assert Sampler().sample(logits, [closed]).token_ids.tolist() == tokenizer.encode("A")  # no reasoning


def test_a_token_outside_the_grammar_ends_the_request(tokenizer: Tokenizer) -> None:
    row = state(SamplingParams(temperature=0, structured_outputs={"choice": ["yes"]}), tokenizer)
    row.output_token_ids.extend(tokenizer.encode("maybe"))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    assert Sampler().sample(logits, [row]).token_ids.item() in tokenizer.eos_token_ids


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
        ({"structured_outputs": {"choice": []}}, "choice must be"),
        ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos cannot"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"reasoning_tags": ["<think>"], "regex": "a"}}, "reasoning_tags"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_bad_constraints_are_refused(fields: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**fields)


@pytest.mark.parametrize("spec", [{"regex": "(unclosed"}, {"grammar": "root ::= nothing_defined"}])
def test_a_spec_that_does_not_compile_is_the_requests_error(tokenizer: Tokenizer, spec: dict) -> None:
    """... in xgrammar's words without its C++ log prefix (`[01:02:03] /project/cpp/x.cc:94: `)."""
    with pytest.raises(ValueError, match="does not compile") as refused:
        StopChecker(SamplingParams(structured_outputs=spec), tokenizer, tokenizer.eos_token_ids)
    assert ".cc:" not in str(refused.value) and "] " not in str(refused.value).split(": ", 1)[1][:12]


def test_a_spec_is_compiled_once(tokenizer: Tokenizer) -> None:
    grammars = tokenizer_grammars(tokenizer)
    first = grammars.compile({"json": dict(SCHEMA)})
    assert grammars.compile({"json": json.loads(json.dumps(SCHEMA))}) is first
    assert grammars.compile({"json": SCHEMA, "disable_any_whitespace": True}) is not first


# ---- in the engine
def test_constrained_requests_in_a_batch_leave_the_others_identical(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256)
    )
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(seed=9, max_tokens=12)]

    def run(constrained: list[SamplingParams]) -> dict[str, list[int]]:
        ids = [engine.add_request("Once upon a time", p, f"free-{i}") for i, p in enumerate(free)]
        ids += [engine.add_request("Hello", p, f"con-{i}") for i, p in enumerate(constrained)]
        out = {}
        while engine.has_unfinished():
            out.update({o.request_id: o for o in engine.step() if o.finished})
        return {i: (out[i].token_ids, out[i].text, out[i].finish_reason) for i in ids}

    alone = run([])
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    mixed = run(
        [
            SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec),
            SamplingParams(seed=4, max_tokens=80, structured_outputs={"choice": ["red", "green"]}),
        ]
    )
    assert {k: mixed[k] for k in alone} == alone
    assert mixed["con-0"][2] == "stop" and mixed["con-1"][2] == "stop"
    jsonschema.validate(json.loads(mixed["con-0"][1]), SCHEMA)
    assert mixed["con-1"][1] in ("red", "green")


def test_json_strings_refuse_raw_control_characters() -> None:
    """xgrammar's rule for a length-bounded string lets a raw tab through, which json.loads
    refuses (a tab sampled into `"hobbies": ["ab\tc"]` failed a served answer): our grammar
    refuses it, bounded or not, and still takes the escaped form where xgrammar does."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pdserve.sampling.grammar import json_schema_grammar

    bounded = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}
    free = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(bounded)), '{"a": "a\tb"}'), "xgrammar's own"
    for schema in (bounded, free):
        grammar = json_schema_grammar(json.dumps(schema), True)
        assert not accepts(grammar, '{"a": "a\tb"}') and not accepts(grammar, '{"a": "a\x01"}')
        assert accepts(grammar, '{"a": "ab"}')
    assert accepts(json_schema_grammar(json.dumps(free), True), '{"a": "a\\tb"}')
