"""A long prompt's chunk attention in two parts (`pdserve.ops.long_attention`: the unmasked prefix
with the query heads folded, the chunk's own keys causally, merged by log-sum-exp) equals the paged
attention it stands in for, op by op and in the engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import attention
from pdserve.ops import long_attention, reference
from tests.helpers import random_prompts

HEADS, KV_HEADS, DIM, PAGE = 16, 2, 64, 16


@pytest.mark.parametrize("key_block", [32768, 64, 37])
@pytest.mark.parametrize("tokens, before", [(32, 64), (40, 57), (17, 1), (5, 300)])
def test_split_chunk_equals_paged_attention(tokens: int, before: int, key_block: int, monkeypatch) -> None:
    """Boundaries on and off the pages, a one-token prefix, a chunk shorter than a page; the prefix
    in one piece, in pieces of 64 keys, of 37 (the last piece shorter)."""
    monkeypatch.setattr(long_attention, "KEY_BLOCK", key_block)
    gen = torch.Generator().manual_seed(tokens + before)
    end = before + tokens
    pages = -(-end // PAGE)
    kv = torch.randn(2, pages + 4, PAGE, KV_HEADS, DIM, generator=gen)
    table = (torch.randperm(pages + 3, generator=gen)[: pages + 2] + 1).int()  # longer than needed
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    cu, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([end], dtype=torch.int32)
    want = reference.paged_attention(q, kv, cu, lens, table[None], DIM**-0.5)
    got = long_attention.long_chunk_attention(q, kv, table, before, DIM**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_long_chunks_split(monkeypatch) -> None:
    monkeypatch.setattr(long_attention, "MIN_CHUNK", 256)
    assert long_attention.takes_split(256, 1000, split_from=1000)
    assert not long_attention.takes_split(255, 1000, split_from=1000)  # a short chunk
    assert not long_attention.takes_split(256, 999, split_from=1000)  # a short prefix
    assert not long_attention.takes_split(10_000, 10**6, split_from=0)  # off


def test_engine_tokens_equal_with_the_split(tiny_model_dir, monkeypatch) -> None:
    """A 1,800-token prompt prefilled in chunks of 256, with `long_attention_from=256` its chunks
    after the first in parts (the prefix in pieces of 300 keys): the greedy tokens of the run
    without, and the parts ran (every attention layer, each full chunk after the first)."""
    (prompt,) = random_prompts((1800,), seed=21, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(long_attention_from: int) -> list[int]:
        llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=256,
                  enable_prefix_caching=False, long_attention_from=long_attention_from)  # fmt: skip
        return llm.generate([prompt], params)[0].token_ids

    want = run(0)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3])
        return long_attention.long_chunk_attention(*args, **kwargs)

    monkeypatch.setattr(long_attention, "MIN_CHUNK", 256)
    monkeypatch.setattr(long_attention, "KEY_BLOCK", 300)  # pieces of 300 keys, the last shorter
    monkeypatch.setattr(attention, "long_chunk_attention", counted)
    assert run(256) == want
    assert sorted(set(calls)) == list(range(256, 1792, 256))  # each full chunk after the first


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1024, 1000])
@pytest.mark.parametrize("key_block", [32768, 4096])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_split_chunk_on_the_gpu_equals_the_paged_kernel(
    backend: str, key_block: int, tokens: int, monkeypatch
) -> None:
    """bf16 at the Qwen3.6 heads (16 query, 2 KV, head dim 256): 1,024 (or 1,000: the pieces'
    queries padded to 1,024) new tokens over 8,200 cached, torch's GPU attention for the parts (the
    prefix in one piece, or two full pieces of 4,096 keys on `backend` and 8 keys on flash),
    against the GQA paged kernel."""
    from pdserve.ops import cuda_prefill_attention

    monkeypatch.setattr(long_attention, "BACKEND", backend)
    monkeypatch.setattr(long_attention, "KEY_BLOCK", key_block)
    before, heads, kv_heads, dim = 8200, 16, 2, 256
    end = before + tokens
    pages = -(-end // PAGE)
    kv = torch.randn(2, pages + 1, PAGE, kv_heads, dim, device="cuda").to(torch.bfloat16)
    table = (torch.randperm(pages, device="cuda") + 1).int()
    q = torch.randn(tokens, heads, dim, device="cuda").to(torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([end], dtype=torch.int32, device="cuda")
    want = cuda_prefill_attention.paged_prefill(q, kv, cu, lens, table[None], dim**-0.5, tokens)
    got = long_attention.long_chunk_attention(q, kv, table, before, dim**-0.5)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
