"""A long prompt's chunk of attention in two parts, for a faster kernel than the paged one to take
most of the work (issue 12: at 131K-262K cached tokens, prefill attention is most of a long
prompt's TTFT, and the GQA paged kernel runs at ~435-449 TFLOP/s).

A chunk of T new queries at positions P..P+T-1 of one sequence attends to
  1. the P cached keys before it, with no mask at all: every query sees every one of them. With
     no mask the group's 8 query heads can be folded into the rows (one KV head, 8T rows), so a
     plain dense attention kernel without GQA or mask support takes it: torch's cuDNN (or flash)
     attention on the GPU, over the prefix's K/V gathered out of the pages;
  2. its own T keys, causally: a square causal attention (the KV heads repeated to the query heads).
Each part returns its rows' log-sum-exp; the two are merged exactly (softmax over the union of the
keys). Parts 1 and 2 have the same FLOPs as the whole; the gathers cost ~2 x P x 2 KiB a layer.

`SPLIT_FROM` (cached tokens before the chunk) is 0, never, until `python -m
pdserve.ops.bench_prefill_attention` has timed it against the paged kernel on the GPU. On a CPU
the same parts run through torch's CPU flash attention (what the tests compare with the reference).
"""

from __future__ import annotations

import torch

SPLIT_FROM = 0  # a one-sequence chunk after at least this many cached tokens takes this path; 0: none
MIN_CHUNK = 1024  # ... of at least this many new tokens
BACKEND = "cudnn"  # on the GPU: "cudnn" or "flash" (torch's SDPA kernels that return the log-sum-exp)


def takes_split(num_tokens: int, context_before: int | None) -> bool:
    """Whether a one-sequence chunk of `num_tokens` after `context_before` cached tokens is split."""
    return context_before is not None and 0 < SPLIT_FROM <= context_before and num_tokens >= MIN_CHUNK


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """q [1, h, L, D], k/v [1, h, S, D] -> (o [1, h, L, D] in q's dtype, lse [h, L] fp32, natural log)."""
    aten = torch.ops.aten
    if not q.is_cuda:
        out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif BACKEND == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    elif BACKEND == "flash":
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        raise ValueError(f"long_attention.BACKEND: 'cudnn' or 'flash', not {BACKEND!r}")
    o, lse = out[0], out[1]
    return o, lse.float().reshape(q.shape[1], q.shape[2])


def long_chunk_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, context_before: int, scale: float
) -> torch.Tensor:
    """q [T, H, D]: one sequence's new queries at positions context_before.., their K/V already in
    the pages; kv_layer [2, pages, page_size, Hkv, D]; table int [>= pages of the sequence]: its
    pages in order -> o [T, H, D] in q's dtype: `ops.paged_attention`'s result for that sequence."""
    num_tokens, heads, dim = q.shape
    page_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = heads // kv_heads
    end = context_before + num_tokens
    pages = table[: -(-end // page_size)].long()
    # [Hkv, tokens, D], each a contiguous copy out of the pages
    k, v = (kv_layer[i].index_select(0, pages).permute(2, 0, 1, 3).reshape(kv_heads, -1, dim) for i in (0, 1))
    folded = q.view(num_tokens, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    before = context_before
    o1, lse1 = _attend(folded, k[None, :, :before], v[None, :, :before], scale, causal=False)
    o1 = o1.view(kv_heads, num_tokens, group, dim).permute(1, 0, 2, 3).reshape(num_tokens, heads, dim)
    lse1 = lse1.view(kv_heads, num_tokens, group).permute(1, 0, 2).reshape(num_tokens, heads)
    own_k, own_v = (x[:, before:end].repeat_interleave(group, dim=0)[None] for x in (k, v))
    o2, lse2 = _attend(q.transpose(0, 1)[None], own_k, own_v, scale, causal=True)
    o2, lse2 = o2[0].transpose(0, 1), lse2.transpose(0, 1)
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp(), (lse2 - top).exp()
    merged = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return merged.to(q.dtype)
