"""Depthwise causal conv1d + SiLU on CUDA: Triton kernels for the packed prefill (reading each
sequence's history from its slot) and for the decode step (shifting the history in place).

Shapes and semantics are those of `pdserve.ops.causal_conv1d_prefill` / `causal_conv1d_step`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.per_pass import PerPass


@triton.jit(do_not_specialize=["T"])  # one build for every pass size
def _conv_prefill_kernel(
    x_ptr, w_ptr, pool_ptr, slot_ptr, seq_ptr, cu_ptr, out_ptr,
    T, C, stride_xt, stride_wc, stride_ps, stride_ot,
    HIST: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """A [BT tokens, BC channels] tile: each input W-1 rows back comes from x inside the token's own
    sequence, else from its slot's history (read only: the caller rewrites the history afterwards)."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_t = offs_t < T
    mask_c = offs_c < C
    seq = tl.load(seq_ptr + offs_t, mask=mask_t, other=0)
    start = tl.load(cu_ptr + seq, mask=mask_t, other=0)
    slot = tl.load(slot_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(HIST + 1):
        pos = offs_t - HIST + j
        from_x = pos >= start
        x = tl.load(x_ptr + pos.to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                    mask=(mask_t & from_x)[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
        back = HIST + pos - start  # index into the history, for the inputs before the sequence
        h = tl.load(pool_ptr + slot[:, None] * stride_ps + offs_c[None, :] * HIST + back[:, None],
                    mask=(mask_t & ~from_x)[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_c * stride_wc + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += tl.where(from_x[:, None], x.to(tl.float32), h.to(tl.float32)) * w[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])  # fmt: skip


@triton.jit
def _conv_history_kernel(
    x_ptr, pool_ptr, slot_ptr, cu_ptr, save_at_ptr, save_to_ptr, C, stride_xt, stride_ps,
    HIST: tl.constexpr, H_PAD: tl.constexpr, BC: tl.constexpr, SAVE: tl.constexpr,
):  # fmt: skip
    """(sequence n, BC channels): the slot's new history, the last HIST inputs of history + sequence:
    from x inside the sequence, else from the old history (read before any of it is written).
    SAVE: the history after the sequence's first save_at tokens instead, written to its save_to
    slot (nothing where save_at is outside 1..length); the slot itself is left as it is."""
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_h = tl.arange(0, H_PAD)
    start = tl.load(cu_ptr + n)
    length = tl.load(cu_ptr + n + 1) - start
    slot = tl.load(slot_ptr + n).to(tl.int64)
    tile = (offs_c < C)[:, None] & (offs_h < HIST)[None, :]
    dest = slot
    if SAVE:
        prefix = tl.load(save_at_ptr + n)
        # a tensor compare (the interpreter takes no scalar bool in a mask)
        prefixes = tl.zeros([H_PAD], tl.int32) + prefix
        tile = tile & ((prefixes > 0) & (prefixes <= length))[None, :]
        length = prefix
        dest = tl.load(save_to_ptr + n).to(tl.int64)
    back = offs_h + length  # the new history's j-th input, counted from the old history's start
    from_x = back >= HIST
    pos = (start - HIST + back).to(tl.int64)
    x = tl.load(x_ptr + pos[None, :] * stride_xt + offs_c[:, None], mask=tile & from_x[None, :], other=0.0)
    hist_ptrs = pool_ptr + slot * stride_ps + offs_c[:, None] * HIST
    old = tl.load(hist_ptrs + back[None, :], mask=tile & ~from_x[None, :], other=0.0)
    tl.debug_barrier()  # every thread has read the old history before any thread overwrites it
    new = tl.where(from_x[None, :], x.to(old.dtype), old)
    tl.store(pool_ptr + dest * stride_ps + offs_c[:, None] * HIST + offs_h[None, :], new, mask=tile)


PREFILL_TILE = dict(BT=32, BC=128, num_warps=4)  # tokens x channels a program (bench_prefill_tiles)
# each token's sequence index, made once a pass
_seq_of_token = PerPass(
    lambda cu_seqlens, num_tokens: torch.searchsorted(
        cu_seqlens[1:].long(), torch.arange(num_tokens, device=cu_seqlens.device), right=True
    )
)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    tile: dict[str, int] | None = None,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, C]; weight [C, W]; cu_seqlens int32 [N+1]; conv_pool [S, C, W-1] (each slot's [C, W-1]
    contiguous); slot_ids int64 [N] -> out [T, C] in x's dtype. Sync-free: one Triton launch for the
    outputs, then one for each slot's new history (the last W-1 inputs of history + sequence),
    and before it, with `save_at` / `save_to`, one for the checkpoints' histories.
    `tile`: the output kernel's BT, BC, num_warps other than `PREFILL_TILE` (a sweep's)."""
    num_tokens, channels = x.shape
    history_len = conv_pool.shape[2]
    if conv_pool.stride(2) != 1 or conv_pool.stride(1) != history_len:
        raise ValueError("causal_conv1d_prefill: each slot's [C, W-1] history must be contiguous")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    tile = tile or PREFILL_TILE
    grid = (triton.cdiv(num_tokens, tile["BT"]), triton.cdiv(channels, tile["BC"]))
    _conv_prefill_kernel[grid](
        x, weight, conv_pool, slot_ids, _seq_of_token(cu_seqlens, num_tokens), cu_seqlens, out,
        num_tokens, channels, x.stride(0), weight.stride(0), conv_pool.stride(0), out.stride(0),
        HIST=history_len, **tile,
    )  # fmt: skip
    if save_at is not None and save_to is not None:  # first: they read the slots' old history
        _histories(x, conv_pool, slot_ids, cu_seqlens, save_at, save_to)
    _histories(x, conv_pool, slot_ids, cu_seqlens)
    return out


def _histories(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> None:
    """Each slot's new history (`_conv_history_kernel`); with save_at / save_to, the checkpoints'
    histories instead (the slots left as they are)."""
    saving = save_at is not None and save_to is not None
    history_len, channels = conv_pool.shape[2], x.shape[1]
    _conv_history_kernel[(slot_ids.shape[0], triton.cdiv(channels, 256))](
        x, conv_pool, slot_ids, cu_seqlens, save_at if saving else slot_ids, save_to if saving else slot_ids,
        channels, x.stride(0), conv_pool.stride(0),
        HIST=history_len, H_PAD=triton.next_power_of_2(history_len), BC=256, SAVE=saving,
    )  # fmt: skip


@triton.jit
def _conv_step_kernel(
    x_ptr,
    w_ptr,
    pool_ptr,
    slot_ptr,
    out_ptr,
    stride_xb,
    stride_wc,
    stride_ps,
    stride_ob,
    C,
    HIST: tl.constexpr,
    BC: tl.constexpr,
):
    """One (sequence, block of BC channels): out = silu(w . [history, x]); history <- [history[1:], x]."""
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs_c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    hist_ptrs = pool_ptr + slot * stride_ps + offs_c * HIST
    x = tl.load(x_ptr + b * stride_xb + offs_c, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + offs_c * stride_wc + HIST, mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(hist_ptrs, mask=mask, other=0.0)
    for j in tl.static_range(HIST):
        w_j = tl.load(w_ptr + offs_c * stride_wc + j, mask=mask, other=0.0).to(tl.float32)
        acc += prev.to(tl.float32) * w_j
        if j + 1 < HIST:
            nxt = tl.load(hist_ptrs + j + 1, mask=mask, other=0.0)
            tl.store(hist_ptrs + j, nxt, mask=mask)
            prev = nxt
    tl.store(hist_ptrs + HIST - 1, x.to(pool_ptr.dtype.element_ty), mask=mask)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * stride_ob + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """x [B, C]; weight [C, W]; conv_pool [S, C, W-1] (each slot's [C, W-1] contiguous);
    slot_ids int64 [B] -> out [B, C] in x's dtype. One sync-free launch; the history moves in place."""
    batch, channels = x.shape
    history_len = conv_pool.shape[2]
    if conv_pool.stride(2) != 1 or conv_pool.stride(1) != history_len:
        raise ValueError("causal_conv1d_step: each slot's [C, W-1] history must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    block_c = 256
    grid = (batch, triton.cdiv(channels, block_c))
    _conv_step_kernel[grid](
        x,
        weight,
        conv_pool,
        slot_ids,
        out,
        x.stride(0),
        weight.stride(0),
        conv_pool.stride(0),
        out.stride(0),
        channels,
        HIST=history_len,
        BC=block_c,
    )
    return out
