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
BACKEND = "cudnn"  # the prefix's full pieces on the GPU: "cudnn" or "flash" (torch's kernels with the lse)
KEY_BLOCK = 32768  # the prefix's keys a kernel call takes (shapes that repeat: see long_chunk_attention)


def takes_split(num_tokens: int, context_before: int | None) -> bool:
    """Whether a one-sequence chunk of `num_tokens` after `context_before` cached tokens is split."""
    return context_before is not None and 0 < SPLIT_FROM <= context_before and num_tokens >= MIN_CHUNK


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, backend: str):
    """q [1, h, L, D], k/v [1, h, S, D] -> (o [1, h, L, D] in q's dtype, lse [h, L] fp32, natural log)."""
    aten = torch.ops.aten
    if not q.is_cuda:
        out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif backend == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    elif backend == "flash":
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        raise ValueError(f"long_attention.BACKEND: 'cudnn' or 'flash', not {backend!r}")
    o, lse = out[0], out[1]
    return o, lse.float().reshape(q.shape[1], q.shape[2])


def _unfold(o: torch.Tensor, lse: torch.Tensor, kv_heads: int, tokens: int):
    """A folded part's (o [1, Hkv, T * G, D], lse [Hkv, T * G]) as ([T, H, D] fp32, [T, H])."""
    group, dim = o.shape[2] // tokens, o.shape[3]
    o = o.view(kv_heads, tokens, group, dim).permute(1, 0, 2, 3).reshape(tokens, -1, dim).float()
    return o, lse.view(kv_heads, tokens, group).permute(1, 0, 2).reshape(tokens, -1)


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Fold a part (o, lse) into the running softmax (acc, acc_lse), both [T, H, (D)] fp32, in place."""
    total = torch.logaddexp(acc_lse, lse)
    acc.mul_((acc_lse - total).exp_()[..., None]).add_(o.float().mul_((lse - total).exp_()[..., None]))
    acc_lse.copy_(total)
    return acc


def _gather(kv_half: torch.Tensor, pages: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Keys (or values) first..first+count-1 of a sequence out of its pages: [1, Hkv, count, D],
    contiguous (strides that depend on `count` only: cuDNN keys its plans on them)."""
    page_size, kv_heads, dim = kv_half.shape[1:]
    lo, hi = first // page_size, -(-(first + count) // page_size)
    rows = kv_half.index_select(0, pages[lo:hi]).permute(2, 0, 1, 3).reshape(kv_heads, -1, dim)
    skip = first - lo * page_size
    return rows[None, :, skip : skip + count].contiguous()


def long_chunk_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, context_before: int, scale: float
) -> torch.Tensor:
    """q [T, H, D]: one sequence's new queries at positions context_before.., their K/V already in
    the pages; kv_layer [2, pages, page_size, Hkv, D]; table int [>= pages of the sequence]: its
    pages in order -> o [T, H, D] in q's dtype: `ops.paged_attention`'s result for that sequence.

    cuDNN builds an execution plan for every new shape and stride (40-70 ms of host time each,
    measured on an H100), so only shapes that repeat go to it: the prefix goes to the kernel
    KEY_BLOCK keys at a time, each piece gathered into a tensor of its own; the last, shorter
    piece and the chunk's own keys (their lengths change from chunk to chunk) go to flash
    attention, which builds nothing; each part's rows are merged into the running softmax."""
    num_tokens, heads, dim = q.shape
    kv_heads = kv_layer.shape[3]
    group = heads // kv_heads
    pages = table.long()
    # the chunk's own keys, causally (square), the KV heads repeated to the query heads
    own_k, own_v = (_gather(kv_layer[i], pages, context_before, num_tokens) for i in (0, 1))
    own_k, own_v = (x.repeat_interleave(group, dim=1) for x in (own_k, own_v))
    o, lse = _attend(q.transpose(0, 1)[None], own_k, own_v, scale, causal=True, backend="flash")
    acc, acc_lse = o[0].transpose(0, 1).float(), lse.transpose(0, 1).contiguous()
    # the prefix, unmasked: the group's query heads folded into the rows of one KV head
    folded = q.view(num_tokens, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    for start in range(0, context_before, KEY_BLOCK):
        count = min(KEY_BLOCK, context_before - start)
        k, v = (_gather(kv_layer[i], pages, start, count) for i in (0, 1))
        backend = BACKEND if count == KEY_BLOCK else "flash"
        o, lse = _attend(folded, k, v, scale, causal=False, backend=backend)
        _merge(acc, acc_lse, *_unfold(o, lse, kv_heads, num_tokens))
    return acc.to(q.dtype)


def warm_up(kv_layer: torch.Tensor, heads: int, chunk: int) -> None:
    """Build the GPU kernels' plans of a chunk of `chunk` tokens over one full prefix piece
    (cuDNN's first call took 0.2-1.7 s, each new shape 40-70 ms), on zeros. Nothing when off or
    on a CPU."""
    if SPLIT_FROM <= 0 or not kv_layer.is_cuda:
        return
    kv_heads, dim = kv_layer.shape[3], kv_layer.shape[4]
    like = {"dtype": kv_layer.dtype, "device": kv_layer.device}
    q = torch.zeros(1, kv_heads, chunk * (heads // kv_heads), dim, **like)
    k = torch.zeros(1, kv_heads, KEY_BLOCK, dim, **like)
    _attend(q, k, k, dim**-0.5, causal=False, backend=BACKEND)
