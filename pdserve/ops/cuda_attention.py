"""Paged GQA attention on CUDA: Triton kernels that read K/V straight from the pages.

Decode (one query per sequence) is split-KV flash decoding: each (sequence, KV head, split)
program scores the whole query-head group against its share of the context, and a second kernel
merges the splits by their log-sum-exp; no host sync. The split count comes from the shapes (so
a captured graph replays it), the split length from each sequence's own length on the device: a
block table as wide as `max_model_len` (the captured decode graph's) costs no serial work on a
short context, and a long one is spread over every split. Prefill (packed, possibly continuing an
earlier context) is the GQA-tiled causal kernel of `cuda_prefill_attention`; it reads the longest
query length from the host once when the caller does not give it. Shapes are those of
`pdserve.ops.paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.cuda_prefill_attention import _dot, paged_prefill
from pdserve.ops.reference import store_kv

__all__ = ["paged_attention", "store_kv"]

_DECODE_BLOCK_N = 32
_MIN_SPLIT_TOKENS = 64  # small batches split long contexts further, to fill the SMs
_TARGET_PROGRAMS = 264  # two waves of the H200's 132 SMs


@triton.jit
def _online_softmax_block(
    q, m, l, acc, offs_n, in_ctx, visible, n, kv_head,
    k_ptr, v_ptr, table_ptr, stride_kp, stride_ks, stride_kh, stride_table, scale,
    D: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Fold one block of paged keys (positions offs_n of sequence n, KV head kv_head) into the
    running row max m, row sum l and output acc of the queries q [M, D]; `visible` [M or 1, BLOCK_N]
    masks the scores. Returns the new (m, l, acc)."""
    offs_d = tl.arange(0, D)
    page = tl.load(table_ptr + n * stride_table + offs_n // PAGE, mask=in_ctx, other=0).to(tl.int64)
    rows = page * stride_kp + (offs_n % PAGE) * stride_ks + kv_head * stride_kh
    k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
    s = tl.where(visible, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_table,
    scale,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + n)
    # this sequence's context in NUM_SPLITS equal runs of whole blocks, none under MIN_SPLIT tokens
    split_tokens = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + n * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)  # fmt: skip
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for block in range(start, end, BLOCK_N):
        offs_n = block + tl.arange(0, BLOCK_N)
        in_ctx = offs_n < end
        m, l, acc = _online_softmax_block(
            q, m, l, acc, offs_n, in_ctx, in_ctx[None, :], n, kv_head,
            k_ptr, v_ptr, table_ptr, stride_kp, stride_ks, stride_kh, stride_table, scale,
            D=D, PAGE=PAGE, IEEE=IEEE,
        )  # fmt: skip
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    part = (n * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
    keep = offs_g < GROUP
    tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], out, mask=keep[:, None])
    tl.store(part_lse_ptr + part, lse, mask=keep)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    base = (n * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(part_o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                    mask=(offs_s < NUM_SPLITS)[:, None], other=0.0)  # fmt: skip
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(o_ptr + n * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


def _paged_decode(
    q: torch.Tensor, kv_layer: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [N, H, D] -> [N, H, D]. The split count depends only on shapes (N, block table width), so a
    captured graph replays it for any context lengths; each sequence splits its own length."""
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = num_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * page_size
    wanted = triton.cdiv(_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    num_splits = max(1, min(wanted, triton.cdiv(max_tokens, _MIN_SPLIT_TOKENS)))
    part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    keys, values = kv_layer[0], kv_layer[1]
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, keys, values, block_tables, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        scale,
        NUM_SPLITS=num_splits, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim,
        PAGE=page_size, BLOCK_N=_DECODE_BLOCK_N, MIN_SPLIT=_MIN_SPLIT_TOKENS, IEEE=q.dtype == torch.float32,
        num_warps=4,
    )  # fmt: skip
    out = torch.empty_like(q)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_o, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), D=head_dim,
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (D a power of two >= 16); kv_layer [2, P, page_size, Hkv, D] -> o [T, H, D]."""
    if q.stride(2) != 1:
        q = q.contiguous()
    if q.shape[0] == seq_lens.shape[0]:  # one query per sequence: decode, sync-free
        return _paged_decode(q, kv_layer, seq_lens, block_tables, scale)
    return paged_prefill(q, kv_layer, cu_seqlens_q, seq_lens, block_tables, scale, max_q_len, programs)
