"""Small prefill passes replayed from CUDA graphs (pdserve.engine.prefill_graphs): the pass padded
to its graph's shape gives the tokens and checkpoints of the pass unpadded. On the CPU the padded
pass runs eagerly (what a graph replays); on CUDA the graphs are captured and replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.check import read_checkpoint
from pdserve.engine import prefill_graphs
from pdserve.engine.prefill_graphs import PrefillGraphs, graphable, shape_of
from pdserve.model import mid_pass_saves
from pdserve.model.forward_batch import ForwardBatch
from tests.helpers import assert_no_leaks, random_prompts
from tests.offline_llms import tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _count_replays(graphs: PrefillGraphs) -> list[int]:
    """The tokens of every pass `graphs` runs from now on."""
    runs, run = [], graphs.run

    def counted(batch: ForwardBatch) -> torch.Tensor:
        runs.append(batch.num_tokens)
        return run(batch)

    graphs.run = counted
    return runs


def _chat_turns(llm: LLM) -> tuple[list[list[int]], list[list[int]], list]:
    """Three prompts ending with a resume suffix (each saves a checkpoint inside its pass), then
    follow-ups that hit those checkpoints: the outputs of both rounds and the checkpoints."""
    cache = llm.engine.prefix_cache
    bodies = random_prompts((70, 33, 101), seed=5)
    suffix = random_prompts((3,), seed=6)[0]
    cache.resume_suffixes = [tuple(suffix)]
    first = [o.token_ids for o in llm.generate([b + suffix for b in bodies], GREEDY)]
    resumes = sorted((e for e in cache.entries.values() if e.kind == "resume"), key=lambda e: e.num_tokens)
    checkpoints = [read_checkpoint(llm.engine, e) for e in resumes]
    follow = [
        b + suffix + t + m for b, t, m in zip(bodies, first, random_prompts((9, 4, 17), 7), strict=True)
    ]
    second = [o.token_ids for o in llm.generate(follow, GREEDY)]
    return first, second, checkpoints


def test_shapes_and_what_is_graphable() -> None:
    def batch(lengths: list[int]) -> ForwardBatch:
        return ForwardBatch.build(
            [[1] * n for n in lengths], [0] * len(lengths), [[0] * 40] * len(lengths),
            list(range(len(lengths))), 16, "cpu",
        )  # fmt: skip

    assert shape_of(batch([270])) == (320, 3)
    assert shape_of(batch([64, 1, 1])) == (128, 5)  # tokens never pad to a sequence count
    assert shape_of(batch([1] * 31 + [33])) == (64, 33)
    one = batch([3, 2])
    assert not graphable(one)  # no scan plan: MidPassSaves not built
    one.saves = mid_pass_saves.MidPassSaves.build([3, 2], [0, 1], [[(1, 4)], []], 3, "cpu")
    assert graphable(one)
    two = batch([3, 2])
    two.saves = mid_pass_saves.MidPassSaves.build([3, 2], [0, 1], [[(1, 4), (2, 5)], []], 3, "cpu")
    assert not graphable(two)  # two rounds of saves: pieces
    assert not graphable(batch([1, 1]))  # a decode step: the decode graphs'


def test_padded_passes_equal_the_passes_unpadded(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat prompts saving their resume points in the pass, then follow-ups resuming from them,
    with every prefill pass padded to its graph's shape (run eagerly on the CPU): the same greedy
    tokens and checkpoints as the passes run unpadded."""
    monkeypatch.setattr(mid_pass_saves, "RECURRENT_MAX", 512)  # CUDA's limit: chat passes one piece
    llm = tiny_llm(tiny_model_dir)
    runner = llm.engine.runner
    want_first, want_second, want_checkpoints = _chat_turns(llm)
    llm.engine.prefix_cache.clear()
    runner.prefill_graphs = PrefillGraphs(
        runner.model, runner.kv_pool.allocate(1)[0], runner.state_pool.allocate(), runner.config.page_size, 40
    )
    runs = _count_replays(runner.prefill_graphs)
    first, second, checkpoints = _chat_turns(llm)
    assert len(runs) >= 2 and runs[0] == 3 * 3 + 70 + 33 + 101  # the first round in one padded pass
    assert (first, second) == (want_first, want_second)
    for got, want in zip(checkpoints, want_checkpoints, strict=True):
        torch.testing.assert_close(got.conv, want.conv)
        torch.testing.assert_close(got.recurrent, want.recurrent)
    graphs, runner.prefill_graphs = runner.prefill_graphs, None
    runner.kv_pool.free([graphs.pad_page])
    runner.state_pool.free(graphs.pad_slot)
    llm.engine.prefix_cache.clear()
    assert_no_leaks(llm.engine)


@pytest.mark.gpu
def test_graph_replays_equal_eager_passes_on_cuda(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA with `prefill_graphs=True`: the graphs are captured at start and replay the chat
    passes, with the greedy tokens of the same engine's eager passes."""
    monkeypatch.setattr(prefill_graphs, "SEQ_BUCKETS", (3, 5))  # a short capture for the test
    monkeypatch.setattr(prefill_graphs, "MAX_TOKENS", 256)
    # fp32: a padded pass's GEMMs have other sizes than the eager pass's, and may round apart
    args = {"device": "cuda", "dtype": "float32", "gpu_memory_utilization": 0.3}
    eager = tiny_llm(tiny_model_dir, **args)
    want = _chat_turns(eager)[:2]
    del eager
    torch.cuda.empty_cache()
    llm = tiny_llm(tiny_model_dir, prefill_graphs=True, **args)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and len(graphs.graphs) == 4 * 2
    runs = _count_replays(graphs)
    assert _chat_turns(llm)[:2] == want
    assert len(runs) >= 2
