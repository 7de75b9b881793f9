"""The Gated DeltaNet ops of `pdserve.ops` (re-exported there): the chunked and the token-by-token
scans of a packed pass, the decode step, and the chunk index the chunked scan takes from the host."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.ops.dispatch import check_pass, implementation
from pdserve.ops.shapes import Shapes

GDN_CHUNK = 64  # tokens a chunk of the chunked GDN scan (fla's default)


def _check_gdn(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    tokens: str,
    sequences: str,
) -> Shapes:
    shapes = Shapes(op)
    shapes("q", q, f"{tokens} Hk Dk")
    shapes("k", k, f"{tokens} Hk Dk")
    shapes("v", v, f"{tokens} Hv Dv")
    shapes("g", g, f"{tokens} Hv")
    shapes("beta", beta, f"{tokens} Hv")
    shapes("recurrent_pool", recurrent_pool, "S Hv Dk Dv")
    shapes.multiple("Hv", of="Hk")
    shapes("slot_ids", slot_ids, sequences, torch.int64)
    return shapes


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    chunk_size: int = GDN_CHUNK,
    *,
    chunks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule over packed sequences, chunked; each sequence starts from its slot's state.

    q, k: [T, Hk, Dk] raw (l2-normalised here, in fp32; q then scaled by Dk**-0.5).
    v: [T, Hv, Dv]; g: [T, Hv] log-decay (<= 0, fp32); beta: [T, Hv]. Hv is a multiple of Hk and
    value head h reads key head h // (Hv // Hk).
    cu_seqlens: int32 [N+1]. recurrent_pool: [S, Hv, Dk, Dv] (one layer's slice of the state pool).
    slot_ids: int64 [N]: sequence n starts from recurrent_pool[slot_ids[n]], and its final state
    is written back there. Chunks of `chunk_size` tokens restart at each sequence start.
    chunks: int64 [NC, 2], `gdn_chunk_index` of the lengths: given, the CUDA scan reads nothing on
    the host (fla would read cu_seqlens, a sync waiting for the step in flight). Reference: unused.
    Returns o: [T, Hv, Dv] in v's dtype (computed in fp32).
    """
    shapes = _check_gdn(
        "gdn_chunk_prefill", q, k, v, g, beta, recurrent_pool, slot_ids, tokens="T", sequences="N"
    )
    check_pass(shapes, cu_seqlens)
    if chunk_size <= 0:
        raise ValueError(f"gdn_chunk_prefill: chunk_size must be positive, got {chunk_size}")
    if chunks is not None:
        shapes("chunks", chunks, "NC 2", torch.int64)
    return implementation(q).gdn_chunk_prefill(
        q, k, v, g, beta, cu_seqlens, recurrent_pool, slot_ids, chunk_size, chunks
    )


def gdn_chunk_index(lengths: Sequence[int], chunk_size: int = GDN_CHUNK) -> list[int]:
    """(sequence, chunk within it) of each `chunk_size`-token chunk of sequences of these lengths,
    in order, flat: `gdn_chunk_prefill`'s `chunks` (fla's chunk_indices), built on the host."""
    return [x for n, length in enumerate(lengths) for c in range(-(-length // chunk_size)) for x in (n, c)]


def gdn_recurrent_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gdn_chunk_prefill`'s inputs and result, computed a token at a time (the recurrence itself,
    one launch on CUDA): for short sequences, where the chunked scan's launches cost more host
    time than its work (a chat prompt's tail, a follow-up turn's new tokens).

    With `save_at` (int32 [N]) and `save_to` (int64 [N]): sequence n's state after its first
    `save_at[n]` tokens is also written to `recurrent_pool[save_to[n]]` on the way (a prefix
    checkpoint inside the pass, no second scan); `save_at[n]` outside 1..length saves nothing."""
    shapes = _check_gdn(
        "gdn_recurrent_prefill", q, k, v, g, beta, recurrent_pool, slot_ids, tokens="T", sequences="N"
    )
    check_pass(shapes, cu_seqlens, save_at, save_to)
    return implementation(q).gdn_recurrent_prefill(
        q, k, v, g, beta, cu_seqlens, recurrent_pool, slot_ids, save_at=save_at, save_to=save_to
    )


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence through the gated delta rule (the same maths as the prefill).

    q, k: [B, Hk, Dk] raw; v: [B, Hv, Dv]; g, beta: [B, Hv]; recurrent_pool: [S, Hv, Dk, Dv];
    slot_ids: int64 [B]: reads recurrent_pool[slot_ids] and writes the new states back in place.
    Returns o: [B, Hv, Dv] in v's dtype.
    """
    _check_gdn("gdn_recurrent_step", q, k, v, g, beta, recurrent_pool, slot_ids, tokens="B", sequences="B")
    return implementation(q).gdn_recurrent_step(q, k, v, g, beta, recurrent_pool, slot_ids)
