"""The ops of the hybrid model behind one interface: GDN linear attention, causal conv1d, paged attention,
and the small per-layer ops (norms with the residual add, q/k norm + rotary + KV store, gates, the MoE
router) of `pdserve.ops.layer_ops`, re-exported here. The routed-expert MoE is `pdserve.ops.moe`.

Packed tokens: `T` tokens of `N` sequences, sequence `n` is tokens `cu_seqlens[n]:cu_seqlens[n+1]`
(int32 `[N+1]`). The ops read and write the state pools in place (see docs/architecture.md): GDN
state through `slot_ids` (int64 `[N]`, distinct), K/V through `slot_mapping` and `block_tables`.

Every op checks shapes and index dtypes (metadata only, no host sync) and raises `ValueError` on a
mismatch, then hands the call to the implementation for the tensors' device (`pdserve.ops.dispatch`).
The GDN scans live in `pdserve.ops.gdn_ops`, re-exported here with the rest.
"""

from __future__ import annotations

import torch

from pdserve.ops.dispatch import check_pass, implementation
from pdserve.ops.gdn_ops import (
    GDN_CHUNK,
    gdn_chunk_index,
    gdn_chunk_prefill,
    gdn_recurrent_prefill,
    gdn_recurrent_step,
)
from pdserve.ops.layer_ops import (
    add_rms_norm,
    gated_rms_norm,
    gdn_gates,
    output_gate,
    qk_norm_rope_store,
    rms_norm,
    route_topk,
)
from pdserve.ops.shapes import Shapes as _Shapes

__all__ = [
    "add_rms_norm",
    "causal_conv1d_prefill",
    "causal_conv1d_step",
    "gated_rms_norm",
    "gdn_chunk_index",
    "gdn_chunk_prefill",
    "GDN_CHUNK",
    "gdn_gates",
    "gdn_recurrent_prefill",
    "gdn_recurrent_step",
    "output_gate",
    "paged_attention",
    "qk_norm_rope_store",
    "rms_norm",
    "route_topk",
    "store_kv",
]


def _check_conv(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    tokens: str,
    sequences: str,
) -> _Shapes:
    shapes = _Shapes(op)
    shapes("x", x, f"{tokens} C")
    shapes("weight", weight, "C W")
    shapes.fix("W-1", shapes.sizes["W"] - 1)
    shapes("conv_pool", conv_pool, "S C W-1")
    shapes("slot_ids", slot_ids, sequences, torch.int64)
    return shapes


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over packed sequences, continuing each slot's history. No bias.

    x: [T, C]; weight: [C, W] (the checkpoint's conv1d.weight [C, 1, W] squeezed);
    cu_seqlens: int32 [N+1]; conv_pool: [S, C, W-1]: the last W-1 inputs of each slot, oldest
    first, pre-activation (zeros for a fresh request); slot_ids: int64 [N].
    Sequence n is convolved as if conv_pool[slot_ids[n]] came right before it; afterwards the slot
    holds the last W-1 inputs of (history + sequence), so chained calls equal one call.
    With `save_at` (int32 [N]) and `save_to` (int64 [N]): the history after sequence n's first
    `save_at[n]` tokens is also written to conv_pool[save_to[n]] (a prefix checkpoint inside the
    pass, as `gdn_recurrent_prefill`'s); `save_at[n]` outside 1..length saves nothing.
    Returns out: [T, C] in x's dtype (computed in fp32).
    """
    shapes = _check_conv("causal_conv1d_prefill", x, weight, conv_pool, slot_ids, tokens="T", sequences="N")
    check_pass(shapes, cu_seqlens, save_at, save_to)
    return implementation(x).causal_conv1d_prefill(
        x, weight, cu_seqlens, conv_pool, slot_ids, save_at=save_at, save_to=save_to
    )


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    """One token per sequence of the causal conv1d + SiLU.

    x: [B, C]; weight: [C, W]; conv_pool: [S, C, W-1]; slot_ids: int64 [B]: conv_pool[slot_ids]
    is the history and is shifted by one (x appended, oldest dropped) in place.
    Returns out: [B, C] in x's dtype.
    """
    _check_conv("causal_conv1d_step", x, weight, conv_pool, slot_ids, tokens="B", sequences="B")
    return implementation(x).causal_conv1d_step(x, weight, conv_pool, slot_ids)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the K/V of T tokens into their pages.

    k, v: [T, Hkv, D]; kv_layer: [2, P, page_size, Hkv, D], contiguous (one layer of the KV pool:
    index 0 K, 1 V); slot_mapping: int64 [T], flat slot = page * page_size + offset.
    """
    shapes = _Shapes("store_kv")
    shapes("k", k, "T Hkv D")
    shapes("v", v, "T Hkv D")
    shapes("kv_layer", kv_layer, "2 P page_size Hkv D")
    shapes("slot_mapping", slot_mapping, "T", torch.int64)
    if not kv_layer.is_contiguous():
        raise ValueError("store_kv: kv_layer must be contiguous (a layer slice of the pool)")
    implementation(k).store_kv(k, v, kv_layer, slot_mapping)


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
    """Causal softmax attention of packed queries over paged K/V, with grouped KV heads.

    q: [T, H, D]; kv_layer: [2, P, page_size, Hkv, D]; H is a multiple of Hkv and query head h
    reads kv head h // (H // Hkv). cu_seqlens_q: int32 [N+1], at least one query per sequence.
    seq_lens: int32 [N]: each sequence's context length including its new tokens, whose K/V are
    already stored. block_tables: int32 [N, max_pages]: the pages of each sequence in order
    (entries past its last page are ignored but must be valid page indices).
    Query i of sequence n (q_len tokens) sits at position seq_lens[n] - q_len + i and attends to
    key positions 0..that position. T == N means decode (one query each) and takes a batched path.
    `max_q_len`: the most queries of one sequence, when the caller knows it (the GPU kernel sizes
    its grid by it; without it, it reads cu_seqlens_q on the host). `programs`: the prefill kernel
    runs as at most this many persistent programs on the GPU, leaving the other SMs free (a long
    prompt's chunk prefilled beside decode steps); the result is the same.
    Returns o: [T, H, D] in q's dtype (softmax in fp32).
    """
    shapes = _Shapes("paged_attention")
    shapes("q", q, "T H D")
    shapes("kv_layer", kv_layer, "2 P page_size Hkv D")
    shapes.multiple("H", of="Hkv")
    shapes("seq_lens", seq_lens, "N", torch.int32)
    shapes.fix("N+1", shapes.sizes["N"] + 1)
    shapes("cu_seqlens_q", cu_seqlens_q, "N+1", torch.int32)
    shapes("block_tables", block_tables, "N max_pages", torch.int32)
    impl = implementation(q)
    return impl.paged_attention(q, kv_layer, cu_seqlens_q, seq_lens, block_tables, scale, max_q_len, programs)
