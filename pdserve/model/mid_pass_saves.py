"""Prefix-cache checkpoints taken inside a prefill pass, where a chunk crosses a planned position.

A chat prompt checkpoints a few tokens before its end (the resume point before `<think>\\n`,
`pdserve.engine.checkpoint_plan`). Stopping the chunk there would cost every such prompt a
pass of its own for those few tokens. Instead the pass saves the GDN state at that position
on its way through:
  - conv: the state after token `p` is the last W-1 inputs up to `p`, taken from the layer's
    packed input (and, for the first W-1 tokens of a chunk, the history the slot held before
    it), written to the checkpoint before the conv op moves the slot on;
  - recurrent: the gated delta rule runs in pieces, each sequence split at its save points;
    after piece r, the state of each sequence saving there is copied to its checkpoint, and
    piece r+1 continues from the sequence's own slot. Sequences with no save run whole in the
    first piece, so a pass with one save point scans twice per GDN layer.
    Each sequence saving once with a short tail after it (a chat turn's pass too long for one
    recurrent piece) is scanned without gathers: the first piece is the whole pass in order, each
    saving sequence cut in two there (its head from its slot, which then holds the checkpoint's
    state; its tail from the checkpoint, a throwaway), then the tails again from the slots, a
    token at a time. Gathering the heads instead (every token but the tails) and concatenating
    the conv input for its checkpoints cost ~15 ms of a 30-prompt, 8,130-token pass's 137 ms on
    the H200 (`bench_prefill_step 30x271@267`, docs/benchmarks.md session 24); the conv op
    writes the checkpoints of any pass whose sequences save once. A piece whose
    segments are all short (at most RECURRENT_MAX tokens; on CUDA RECURRENT_MAX_CUDA, and
    RECURRENT_TOKENS_CUDA in all: a chat prompt's tail after its resume point is two tokens,
    a follow-up turn's new tokens a few hundred) runs through `ops.gdn_recurrent_prefill`,
    the recurrence a token at a time in one launch, instead of a chunked scan, whose host
    cost (~1.2 ms a call through fla) made every chat prompt's pass host-bound (py-spy of
    the served conversations, docs/benchmarks.md). So does a pass without saves whose chunks
    are all that short (cache hits' tails, follow-up turns): a plan of one piece, no
    checkpoint. A piece that is the whole pass in order scans the layer's tensors as they
    are (no gather, no scatter). A pass whose chunks all qualify, each saving at most once (a
    chat turn's pass), is one such piece that saves on its way: the recurrent scan writes each
    sequence's state to its checkpoint after `save_at` tokens (no second piece), and the conv op
    its conv history there (no conv rows: `conv`).
Attention layers and every other op see the pass as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch

from pdserve import ops
from pdserve.pinned import to_device, to_device_many

RECURRENT_MAX = 4  # a piece whose segments are all this short runs token by token (CPU)
# on CUDA: where one launch looping over the tokens costs less than fla's ~0.8-1.5 ms of host time
# a call, at most 512 tokens a segment and 2,048 a piece (its GPU time is ~1.2 us a token of the
# longest segment, ~0.47 us a token of the piece past 8 sequences: H200, one full-shape layer,
# `python -m pdserve.ops.bench_gdn_prefill`, docs/benchmarks.md session 16)
RECURRENT_MAX_CUDA = 512
RECURRENT_TOKENS_CUDA = 2048


@dataclass(slots=True)
class ScanPiece:
    tokens: torch.Tensor | None  # [Tp] int64: the packed tokens this piece scans (None: all, in order)
    cu_seqlens: torch.Tensor  # [Np+1] int32: their sequence boundaries
    state_slots: torch.Tensor  # [Np] int64
    save_from: torch.Tensor  # [Mp] int64: slots whose state after this piece is a checkpoint
    save_to: torch.Tensor  # [Mp] int64: those checkpoints (state slots); with save_at, [Np]
    recurrent: bool  # every segment is short: `ops.gdn_recurrent_prefill`, not the chunked scan
    # [Np] int32: the recurrent scan saves sequence n's state after save_at[n] tokens (0: none)
    # to save_to[n] itself, on its way through (the whole pass one piece)
    save_at: torch.Tensor | None = None
    chunks: torch.Tensor | None = None  # [NC, 2] int64: `ops.gdn_chunk_index` (a chunked piece)


@dataclass(slots=True)
class MidPassSaves:
    pieces: list[ScanPiece]
    conv_slots: torch.Tensor  # [M] int64: the sequence slot of each save
    conv_to: torch.Tensor  # [M] int64: its checkpoint
    conv_rows: torch.Tensor  # [M, W-1] int64: rows of cat(history of conv_slots, x), oldest first
    num_saves: int = 0  # M (0 when each sequence saves once: the conv op writes the checkpoints)
    # [N] int32 / int64: the conv op saves sequence n's history after conv_save_at[n] tokens
    # (0: none) to conv_save_to[n]; None: `save_conv` does (some sequence saves twice)
    conv_save_at: torch.Tensor | None = None
    conv_save_to: torch.Tensor | None = None

    @staticmethod
    def build(
        chunk_lens: list[int],
        state_slots: list[int],
        saves: list[list[tuple[int, int]]],
        history_len: int,
        device: torch.device | str,
    ) -> MidPassSaves | None:
        """`saves[i]`: (offset into sequence i's chunk, checkpoint) in order, each offset strictly
        inside the chunk. None when no sequence saves inside this pass and its chunks are not all
        short (a pass of short chunks alone, a cache hit's tail, is one piece of recurrent steps)."""
        on_cuda = torch.device(device).type == "cuda"
        limit = RECURRENT_MAX_CUDA if on_cuda else RECURRENT_MAX
        token_limit = RECURRENT_TOKENS_CUDA if on_cuda else sum(chunk_lens)
        rounds = max((len(s) for s in saves), default=0)
        if rounds == 0 and (max(chunk_lens, default=limit + 1) > limit or sum(chunk_lens) > token_limit):
            return None
        for length, points in zip(chunk_lens, saves, strict=True):
            offsets = [o for o, _ in points]
            if offsets != sorted(set(offsets)) or any(not 0 < o < length for o in offsets):
                raise ValueError(f"save offsets {offsets} must rise strictly inside a chunk of {length}")
        total, starts = sum(chunk_lens), [0]
        for length in chunk_lens[:-1]:
            starts.append(starts[-1] + length)
        if rounds == 1:  # the conv op writes the checkpoints: no conv rows
            none, rows = to_device_many([[], []], torch.int64, device)
            if max(chunk_lens) <= limit and total <= token_limit:  # and so does the recurrent scan
                piece = _saving_piece(chunk_lens, state_slots, saves, device)
                return MidPassSaves(
                    [piece], none, none, rows.view(0, history_len), 0, piece.save_at, piece.save_to
                )
            at, to = _save_points(state_slots, saves)
            at_t, to_t = to_device(at, torch.int32, device), to_device(to, torch.int64, device)
            tails = [length - a for length, a in zip(chunk_lens, at, strict=True) if a]
            if max(tails) <= limit and sum(tails) <= token_limit:
                pieces = _cut_scan(chunk_lens, state_slots, saves, device)
            else:
                pieces = [
                    _piece(r, starts, chunk_lens, state_slots, saves, limit, token_limit, device)
                    for r in (0, 1)
                ]
            return MidPassSaves(pieces, none, none, rows.view(0, history_len), 0, at_t, to_t)
        pieces = [
            _piece(r, starts, chunk_lens, state_slots, saves, limit, token_limit, device)
            for r in range(rounds + 1)
        ]
        flat = [
            (start, slot, offset, ck)
            for start, slot, points in zip(starts, state_slots, saves, strict=True)
            for offset, ck in points
        ]
        conv_slots = [slot for _, slot, _, _ in flat]
        conv_to = [ck for _, _, _, ck in flat]
        rows = [_conv_rows(m, len(flat), f[0], f[2], history_len) for m, f in enumerate(flat)]
        slots_t, to_t, rows_t = to_device_many([conv_slots, conv_to, sum(rows, [])], torch.int64, device)
        return MidPassSaves(pieces, slots_t, to_t, rows_t.view(len(rows), history_len), len(flat))

    def conv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        cu_seqlens: torch.Tensor,
        conv_pool: torch.Tensor,
        state_slots: torch.Tensor,
    ) -> torch.Tensor:
        """`ops.causal_conv1d_prefill` over the whole pass, saving the conv checkpoints: the op
        writes them itself when each sequence saves once, else `save_conv` first."""
        if self.conv_save_at is not None:
            return ops.causal_conv1d_prefill(
                x, weight, cu_seqlens, conv_pool, state_slots, self.conv_save_at, self.conv_save_to
            )
        self.save_conv(x, conv_pool)
        return ops.causal_conv1d_prefill(x, weight, cu_seqlens, conv_pool, state_slots)

    def save_conv(self, x: torch.Tensor, conv_pool: torch.Tensor) -> None:
        """Write each checkpoint's conv state from the layer's packed conv input `x` [T, C]; call
        it before the conv op, while the slots still hold the history before this pass."""
        if not self.num_saves:
            return
        history = conv_pool.index_select(0, self.conv_slots)  # [M, C, W-1]
        channels = history.shape[1]
        source = torch.cat([history.transpose(1, 2).reshape(-1, channels), x.to(conv_pool.dtype)])
        conv_pool.index_copy_(0, self.conv_to, source[self.conv_rows].transpose(1, 2))

    def scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        recurrent_pool: torch.Tensor,
    ) -> torch.Tensor:
        """`ops.gdn_chunk_prefill` over the whole pass, in pieces, saving the checkpoints."""
        out = torch.empty_like(v)
        for piece in self.pieces:
            t = piece.tokens
            inputs = (q, k, v, g, beta) if t is None else (q[t], k[t], v[t], g[t], beta[t])
            if piece.save_at is not None:  # the whole pass, its checkpoints saved by the scan
                out = ops.gdn_recurrent_prefill(
                    *inputs, piece.cu_seqlens, recurrent_pool, piece.state_slots, piece.save_at, piece.save_to
                )
                continue
            if piece.recurrent:
                o = ops.gdn_recurrent_prefill(*inputs, piece.cu_seqlens, recurrent_pool, piece.state_slots)
            else:
                o = ops.gdn_chunk_prefill(
                    *inputs, piece.cu_seqlens, recurrent_pool, piece.state_slots, chunks=piece.chunks
                )
            if t is None:
                out = o
            else:
                out[t] = o
            if piece.save_to.numel():
                recurrent_pool.index_copy_(0, piece.save_to, recurrent_pool.index_select(0, piece.save_from))
        return out


def _piece(
    r: int,
    starts: list[int],
    chunk_lens: list[int],
    state_slots: list[int],
    saves: list[list[tuple[int, int]]],
    limit: int,
    token_limit: int,
    device: torch.device | str,
) -> ScanPiece:
    """Piece r: each sequence's tokens between its save points r-1 and r (or its end), and the
    checkpoints of those ending at a save point."""
    tokens, cu, slots, save_from, save_to = [], [0], [], [], []
    for start, length, slot, points in zip(starts, chunk_lens, state_slots, saves, strict=True):
        bounds = [0, *(o for o, _ in points), length]
        if r + 1 >= len(bounds):
            continue
        tokens.extend(range(start + bounds[r], start + bounds[r + 1]))
        cu.append(len(tokens))
        slots.append(slot)
        if r < len(points):
            save_from.append(slot)
            save_to.append(points[r][1])
    recurrent = max(b - a for a, b in pairwise(cu)) <= limit and len(tokens) <= token_limit
    total = sum(chunk_lens)
    whole = len(tokens) == total and tokens == list(range(total))
    chunks = [] if recurrent else ops.gdn_chunk_index([b - a for a, b in pairwise(cu)])
    tokens_t, slots_t, from_t, to_t, chunks_t = to_device_many(
        [tokens, slots, save_from, save_to, chunks], torch.int64, device
    )
    cu_t = to_device(cu, torch.int32, device)
    chunks_t = None if recurrent else chunks_t.view(-1, 2)
    return ScanPiece(None if whole else tokens_t, cu_t, slots_t, from_t, to_t, recurrent, chunks=chunks_t)


def _save_points(state_slots: list[int], saves: list[list[tuple[int, int]]]) -> tuple[list[int], list[int]]:
    """(save_at, save_to) of a pass whose sequences save at most once, as the conv op and the
    recurrent scan take them: where each saves (0: none) and its checkpoint (else its own slot)."""
    at = [points[0][0] if points else 0 for points in saves]
    to = [points[0][1] if points else slot for points, slot in zip(saves, state_slots, strict=True)]
    return at, to


def _saving_piece(
    chunk_lens: list[int],
    state_slots: list[int],
    saves: list[list[tuple[int, int]]],
    device: torch.device | str,
) -> ScanPiece:
    """The whole pass as one recurrent piece whose scan writes each sequence's one checkpoint on
    its way through (no second piece, no gathers: a chat turn's pass, every prompt saving its
    resume point a few tokens before its end)."""
    at, to = _save_points(state_slots, saves)
    slots_t, to_t, none_t = to_device_many([state_slots, to, []], torch.int64, device)
    cu_t, at_t = to_device_many([[0, *accumulate(chunk_lens)], at], torch.int32, device)
    return ScanPiece(None, cu_t, slots_t, none_t, to_t, True, at_t)


def _cut_scan(
    chunk_lens: list[int],
    state_slots: list[int],
    saves: list[list[tuple[int, int]]],
    device: torch.device | str,
) -> list[ScanPiece]:
    """Two pieces for a pass whose sequences save once each, with short tails after (see the
    module): the whole pass in order, each saving sequence cut at its save point (its head from
    its slot, its tail from its checkpoint, whose result the copy of the head's state and the
    second piece overwrite), then the tails from the slots."""
    cu, slots, heads, checkpoints, tails, tail_cu = [0], [], [], [], [], [0]
    start = 0
    for length, slot, points in zip(chunk_lens, state_slots, saves, strict=True):
        if points:
            ((offset, ck),) = points
            cu.append(start + offset)
            slots += [slot, ck]
            heads.append(slot)
            checkpoints.append(ck)
            tails.extend(range(start + offset, start + length))
            tail_cu.append(len(tails))
        else:
            slots.append(slot)
        start += length
        cu.append(start)
    chunks = ops.gdn_chunk_index([b - a for a, b in pairwise(cu)])
    slots_t, heads_t, ck_t, tails_t, chunks_t = to_device_many(
        [slots, heads, checkpoints, tails, chunks], torch.int64, device
    )
    cu_t, tail_cu_t = to_device_many([cu, tail_cu], torch.int32, device)
    whole = ScanPiece(None, cu_t, slots_t, heads_t, ck_t, False, chunks=chunks_t.view(-1, 2))
    tails_piece = ScanPiece(tails_t, tail_cu_t, heads_t, heads_t[:0], ck_t[:0], True)  # in the heads' slots
    return [whole, tails_piece]


def _conv_rows(m: int, num_saves: int, start: int, offset: int, history_len: int) -> list[int]:
    """Rows of cat(history [num_saves * W-1], x) holding the W-1 conv inputs before token `offset`
    of a chunk packed from row `start` of x: from x inside the chunk, else save m's history."""
    window = [offset - history_len + w for w in range(history_len)]
    return [num_saves * history_len + start + p if p >= 0 else (m + 1) * history_len + p for p in window]
