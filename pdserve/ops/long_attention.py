"""A long prompt's chunk of attention in two parts, for a faster kernel than the paged one to take
most of the work (issue 12: at 131K-262K cached tokens, prefill attention is most of a long
prompt's TTFT, and the GQA paged kernel runs at ~435-449 TFLOP/s).

A chunk of T new queries at positions P..P+T-1 of one sequence attends to
  1. the cached keys before it, with no mask at all: every query sees every one of them. With no
     mask the group's 8 query heads fold into the rows (one KV head, 8T rows), so a plain dense
     attention kernel without GQA or mask support takes it: torch's cuDNN attention on the GPU
     (1.44x / 1.50x the paged kernel's speed for a whole chunk at 131K / 262K, H100, session 27),
     in pieces of KEY_BLOCK keys gathered out of the pages;
  2. the rest: the prefix's last P mod KEY_BLOCK keys and the chunk's own T, causal to the last
     key, through flash attention (GQA and that mask natively).
Each part returns its rows' log-sum-exp; the parts merge exactly (softmax over the union of the
keys). The parts have the FLOPs of the whole; the gathers cost ~2 x P x 2 KiB a layer.

The engine takes this path for a chunk alone in its pass after `--long-attention-from` cached
tokens (`EngineConfig.long_attention_from`, `takes_split`; default 16,384, 0: never), served on
the H200 in session 28 (docs/benchmarks.md: 262K's TTFT 22.9 -> 20.3 s). On a CPU the same
parts run through torch's CPU flash attention (what the tests compare with the reference).
"""

from __future__ import annotations

import torch

MIN_CHUNK = 1024  # a chunk of fewer new tokens keeps the paged kernel
BACKEND = "cudnn"  # the prefix's full pieces on the GPU: "cudnn" or "flash" (torch's kernels with the lse)
KEY_BLOCK = 16384  # the prefix's keys a kernel call takes (shapes that repeat: see long_chunk_attention)
# the prefix pieces' queries are padded to a multiple of this many tokens: a chunk of any length
# meets one of a few plans that warm-up built (a 262,136-token prompt's last chunk of 8,184 built
# its own under traffic: a 51 ms stall of every stream, H100, session 31)
PLAN_TOKENS = 1024


def takes_split(num_tokens: int, context_before: int, split_from: int) -> bool:
    """Whether a one-sequence chunk of `num_tokens` after `context_before` cached tokens goes in
    parts, the engine's threshold being `split_from` (`EngineConfig.long_attention_from`; 0: never)."""
    return 0 < split_from <= context_before and num_tokens >= MIN_CHUNK


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


def _tail(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] over k, v [S, Hkv, D] (S >= T), causal aligned to the last key (query i sees keys
    0..S - T + i) -> (o [T, H, D], lse [H, T] fp32). On the GPU flash attention (GQA, the bottom-right
    causal mask and any lengths natively: no plan to build); on a CPU through an explicit mask."""
    tokens, keys = q.shape[0], k.shape[0]
    if q.is_cuda:
        out = torch.ops.aten._flash_attention_forward(
            q[None], k[None], v[None], None, None, tokens, keys, 0.0, True, False, scale=scale
        )
        return out[0][0], out[1][0].float()
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1)[None] for x in (k, v))
    seen = torch.ones(tokens, keys, dtype=torch.bool).tril(keys - tokens)
    mask = torch.zeros(tokens, keys, dtype=q.dtype).masked_fill_(~seen, float("-inf"))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return o[0].transpose(0, 1), lse[0].float()


def _gather(kv_half: torch.Tensor, pages: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Keys (or values) first..first+count-1 of a sequence out of its pages: [1, Hkv, count, D],
    contiguous (strides that depend on `count` only: cuDNN keys its plans on them)."""
    rows = _pages_rows(kv_half, pages, first, count)
    return rows.permute(1, 0, 2)[None].contiguous()


def _pages_rows(kv_half: torch.Tensor, pages: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Keys (or values) first..first+count-1 of a sequence out of its pages: [count, Hkv, D]."""
    page_size, kv_heads, dim = kv_half.shape[1:]
    lo, hi = first // page_size, -(-(first + count) // page_size)
    skip = first - lo * page_size
    return kv_half.index_select(0, pages[lo:hi]).view(-1, kv_heads, dim)[skip : skip + count]


def long_chunk_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, context_before: int, scale: float
) -> torch.Tensor:
    """q [T, H, D]: one sequence's new queries at positions context_before.., their K/V already in
    the pages; kv_layer [2, pages, page_size, Hkv, D]; table int [>= pages of the sequence]: its
    pages in order -> o [T, H, D] in q's dtype: `ops.paged_attention`'s result for that sequence.

    cuDNN builds an execution plan for every new shape and stride (40-70 ms of host time each,
    measured on an H100), so only shapes that repeat go to it: the prefix's first KEY_BLOCK x n
    keys, KEY_BLOCK at a time, each piece gathered into a [Hkv, KEY_BLOCK, D] tensor of its own,
    the queries padded to a multiple of PLAN_TOKENS tokens (warm-up builds each of those plans).
    The rest of the prefix and the chunk's own keys (lengths that change from chunk to chunk)
    go to flash attention in one call, causal to the last key. The parts merge into a running
    softmax kept in the folded layout ([Hkv, T x G, D] fp32)."""
    num_tokens, heads, dim = q.shape
    kv_heads = kv_layer.shape[3]
    group = heads // kv_heads
    rows = num_tokens * group
    pages = table.long()
    pieces = context_before // KEY_BLOCK
    first = pieces * KEY_BLOCK  # the tail: keys first.. (the prefix's rest, then the chunk's own)
    k, v = (_pages_rows(kv_layer[i], pages, first, context_before + num_tokens - first) for i in (0, 1))
    o, lse = _tail(q, k, v, scale)
    acc = o.view(num_tokens, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim).float()
    acc_lse = lse.view(kv_heads, group, num_tokens).transpose(1, 2).reshape(kv_heads, -1)
    folded = _folded_queries(q, kv_heads, pieces > 0)
    for piece in range(pieces):
        k, v = (_gather(kv_layer[i], pages, piece * KEY_BLOCK, KEY_BLOCK) for i in (0, 1))
        o, lse = _attend(folded, k, v, scale, causal=False, backend=BACKEND)
        o, lse = o[:, :, :rows], lse[:, :rows]  # the padding rows' results dropped
        total = torch.logaddexp(acc_lse, lse)
        acc.mul_((acc_lse - total).exp_()[..., None]).addcmul_(o[0], (lse - total).exp_()[..., None])
        acc_lse = total
    return (
        acc.view(kv_heads, num_tokens, group, dim)
        .permute(1, 0, 2, 3)
        .reshape(num_tokens, heads, dim)
        .to(q.dtype)
    )


def _folded_queries(q: torch.Tensor, kv_heads: int, padded: bool) -> torch.Tensor:
    """q [T, H, D] -> [1, Hkv, T x G, D] (each KV head's query heads as rows), with `padded` zero
    rows up to a multiple of PLAN_TOKENS tokens."""
    num_tokens, heads, dim = q.shape
    group = heads // kv_heads
    folded = q.view(num_tokens, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    if not padded or num_tokens % PLAN_TOKENS == 0:
        return folded
    rows = plan_tokens(num_tokens) * group
    out = folded.new_zeros(1, kv_heads, rows, dim)
    out[:, :, : num_tokens * group] = folded
    return out


def plan_tokens(num_tokens: int) -> int:
    """The query tokens a prefix piece's kernel call takes for a chunk of num_tokens."""
    return -(-num_tokens // PLAN_TOKENS) * PLAN_TOKENS


def warm_up(kv_layer: torch.Tensor, heads: int, chunk: int) -> None:
    """Build the GPU kernels' plans of every chunk up to `chunk` tokens (each multiple of
    PLAN_TOKENS from MIN_CHUNK's) over one full prefix piece, on zeros, on the current stream
    (cuDNN's first call took 0.2-1.7 s, each new shape 40-70 ms); then run two whole chunks over
    `kv_layer`'s own pages (read, never written), one of `chunk` tokens and one of an odd length
    after an odd prefix: the tail's flash kernels (each length class a kernel of its own), the
    gathers and the merge load at their first launch, and that first launch was a 79-92 ms stall
    of every stream at a served prompt's first chunk in parts (H100, session 32). Nothing on a
    CPU, or where the pages cannot hold those chunks."""
    if not kv_layer.is_cuda:
        return
    kv_heads, dim = kv_layer.shape[3], kv_layer.shape[4]
    like = {"dtype": kv_layer.dtype, "device": kv_layer.device}
    k = torch.zeros(1, kv_heads, KEY_BLOCK, dim, **like)
    # the largest first: the allocator serves the smaller ones out of its blocks
    for tokens in range(plan_tokens(chunk), plan_tokens(MIN_CHUNK) - 1, -PLAN_TOKENS):
        q = torch.zeros(1, kv_heads, tokens * (heads // kv_heads), dim, **like)
        _attend(q, k, k, dim**-0.5, causal=False, backend=BACKEND)
    pages, page_size = kv_layer.shape[1], kv_layer.shape[2]
    if pages * page_size < KEY_BLOCK + chunk + 1:
        return
    table = torch.arange(pages, dtype=torch.int32, device=kv_layer.device)
    for tokens, before in ((chunk, KEY_BLOCK), (chunk - 1, KEY_BLOCK + 1)):
        q = torch.zeros(tokens, heads, dim, **like)
        long_chunk_attention(q, kv_layer, table, before, dim**-0.5)
