"""Paged causal prefill attention on CUDA: a Triton flash-attention kernel over the KV pages.

One program takes a tile of consecutive query tokens of one sequence together with every query
head of one KV head's group (GQA): the tile's rows are (token, head) pairs, so each block of keys
and values is read from the pages once for the whole group (8 heads at the Qwen3.6 shape) instead
of once per head. Key blocks wholly before the tile's first query are folded in without a causal
mask; only the blocks that reach the diagonal are masked. The softmax runs in base 2 with the
scale folded in (fp32 row max, row sum and accumulator).

Shapes and the position rule are `pdserve.ops.paged_attention`'s: query i of a sequence with
q_len new tokens and context seq_len sits at seq_len - q_len + i and sees keys 0..that position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _fold_keys(
    q, m, l, acc, block, end, positions, n, kv_head,
    k_ptr, v_ptr, table_ptr, stride_kp, stride_ks, stride_kh, stride_table, qk_scale,
    MASKED: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Fold keys block..block+BLOCK_N of sequence n into (m, l, acc). MASKED: the block reaches the
    diagonal; keys past a row's position are masked, and keys from `end` on (past the last
    query, maybe past the block table) are not read. Else every key is visible to every row."""
    offs_n = block + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    in_ctx = offs_n < end
    if MASKED:
        page = tl.load(table_ptr + n * stride_table + offs_n // PAGE, mask=in_ctx, other=0)
    else:
        page = tl.load(table_ptr + n * stride_table + offs_n // PAGE)
    rows = page.to(tl.int64) * stride_kp + (offs_n % PAGE) * stride_ks + kv_head * stride_kh
    if MASKED:  # keys from `end` on are zeros: stale pool memory may hold NaN
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
    s = _dot(q, tl.trans(k), IEEE) * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] <= positions[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=in_ctx[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def _attend_tile(
    tile, n, kv_head, q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, TOKENS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Query tile `tile` of sequence n with kv head `kv_head`'s group of heads (nothing when the
    tile starts past the sequence's queries)."""
    q_start = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_start
    first = tile * TOKENS  # the tile's first query token within the sequence
    if first < q_len:
        seq_len = tl.load(seq_lens_ptr + n)
        r = tl.arange(0, BLOCK_M)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        valid = (r < TOKENS * GROUP) & (token < q_len)
        token = tl.where(valid, token, first)  # padding rows repeat the first query (never stored)
        positions = seq_len - q_len + token
        offs_d = tl.arange(0, D)
        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        first_pos = seq_len - q_len + first
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # every row sees keys 0..first_pos
        end = tl.minimum(first_pos + TOKENS, seq_len)  # past the tile's last query position
        for block in range(0, unmasked_end, BLOCK_N):
            m, l, acc = _fold_keys(
                q, m, l, acc, block, end, positions, n, kv_head,
                k_ptr, v_ptr, table_ptr, stride_kp, stride_ks, stride_kh, stride_table, qk_scale,
                MASKED=False, D=D, PAGE=PAGE, BLOCK_N=BLOCK_N, IEEE=IEEE,
            )  # fmt: skip
        for block in range(unmasked_end, end, BLOCK_N):  # reaches the diagonal: keys past it masked
            m, l, acc = _fold_keys(
                q, m, l, acc, block, end, positions, n, kv_head,
                k_ptr, v_ptr, table_ptr, stride_kp, stride_ks, stride_kh, stride_table, qk_scale,
                MASKED=True, D=D, PAGE=PAGE, BLOCK_N=BLOCK_N, IEEE=IEEE,
            )  # fmt: skip
        out = acc / l[:, None]
        tl.store(o_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=valid[:, None])  # fmt: skip


@triton.jit(do_not_specialize=["num_tiles", "tiles_per_seq", "num_seqs"])  # one build for every pass
def _prefill_gqa_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
    qk_scale, num_tiles, tiles_per_seq, num_seqs,
    PERSISTENT: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A grid of (query tiles, sequences, kv heads), one tile a program; or PERSISTENT: fewer
    programs than tiles, each taking every num_programs-th tile (tile-major, then sequence, then
    kv head), so the kernel holds only as many SMs as it has programs."""
    if PERSISTENT:
        for t in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            rest = t // tiles_per_seq
            _attend_tile(
                t % tiles_per_seq, rest % num_seqs, rest // num_seqs,
                q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
                stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
                qk_scale, GROUP=GROUP, TOKENS=TOKENS, D=D, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                IEEE=IEEE,
            )  # fmt: skip
    else:
        _attend_tile(
            tl.program_id(0), tl.program_id(1), tl.program_id(2),
            q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, seq_lens_ptr, cu_q_ptr,
            stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_table, stride_ot, stride_oh,
            qk_scale, GROUP=GROUP, TOKENS=TOKENS, D=D, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            IEEE=IEEE,
        )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    programs: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """q [T, H, D] packed -> [T, H, D]; kv_layer [2, P, page_size, Hkv, D]. The longest query run
    sizes the grid (read on the host when the caller does not give it). `programs`: run as at most
    this many persistent programs, leaving the other SMs to work on other streams (a long
    prompt's chunk beside decode steps: a program of the usual grid holds its SM for milliseconds
    at long contexts, and takes back each SM a decode kernel frees). block_m (rows: tokens x
    the group's heads), block_n, num_warps and num_stages pick the tile (defaults: measured on
    the H200, docs/benchmarks.md)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = num_heads // num_kv_heads
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    fp32 = q.element_size() > 2
    block_m = block_m or (32 if fp32 else 128)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = block_n or (32 if fp32 else 64)
    tokens = block_m // group
    out = torch.empty_like(q)
    keys, values = kv_layer[0], kv_layer[1]
    grid = (triton.cdiv(max_q_len, tokens), seq_lens.shape[0], num_kv_heads)
    num_tiles = grid[0] * grid[1] * grid[2]
    persistent = programs is not None and 0 < programs < num_tiles
    _prefill_gqa_kernel[(programs,) if persistent else grid](
        q, keys, values, out, block_tables, seq_lens, cu_seqlens_q,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, num_tiles, grid[0], grid[1], PERSISTENT=persistent,
        GROUP=group, TOKENS=tokens, D=head_dim, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=fp32, num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages,
    )  # fmt: skip
    return out
