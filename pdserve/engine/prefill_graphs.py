"""CUDA graphs for small prefill passes: a chat turn's pass replayed, not launched op by op.

A pass of a few hundred new tokens does ~20 ms of GPU work at the full shape but took 77-121 ms
served (docs/benchmarks.md, session 16): ~700 launches, each paying Python, torch's dispatch and
Triton's launcher. A pass whose GDN layers scan in one recurrent piece (every chunk short, at most
one checkpoint a sequence: `MidPassSaves` with a single `save_at` piece, or no save) has nothing
its host must read: it is replayed from a graph captured at start for its shape class, padded:
  - tokens up to the next multiple of TOKEN_STEP (at most MAX_TOKENS); the padding tokens are one
    extra sequence, the last, at the reserved KV page and state slot (as the decode graphs' rows:
    garbage there reaches only padding rows, every op mixing rows only within a sequence);
  - sequences up to the next of SEQ_BUCKETS (2^k + 1: never a token count, so no padded pass looks
    like a decode step to the attention op); the sequences between the real ones and the padding
    one have no tokens (their GDN programs and attention tiles do nothing) and save nothing.
The graph ends at the final norm's hidden states; the caller takes the rows it samples from them.
On the CPU the same padded pass runs eagerly (`run`), which is what tests compare with the pass
unpadded.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.mid_pass_saves import MidPassSaves, ScanPiece
from pdserve.model.qwen3_5_moe import Qwen3MoeHybrid

logger = logging.getLogger(__name__)
TOKEN_STEP = 64
MAX_TOKENS = 512
SEQ_BUCKETS = (3, 5, 9, 17, 33, 65)


def graphable(batch: ForwardBatch) -> bool:
    """A prefill pass whose GDN scan is one recurrent piece over the whole pass, small enough."""
    saves = batch.saves
    return (
        not batch.is_decode
        and saves is not None
        and len(saves.pieces) == 1
        and saves.pieces[0].recurrent
        and saves.pieces[0].tokens is None
        and batch.num_tokens <= MAX_TOKENS
        and batch.num_seqs + 1 <= SEQ_BUCKETS[-1]
    )


def shape_of(batch: ForwardBatch) -> tuple[int, int]:
    """(padded tokens, padded sequences) of a graphable pass."""
    return shape_for(batch.num_tokens, batch.num_seqs)


def shape_for(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """(padded tokens, padded sequences) of a pass of `num_tokens` in `num_seqs` sequences."""
    tokens = -(-num_tokens // TOKEN_STEP) * TOKEN_STEP
    return tokens, next(n for n in SEQ_BUCKETS if n >= num_seqs + 1)


class PrefillGraphs:
    def __init__(
        self, model: Qwen3MoeHybrid, pad_page: int, pad_slot: int, page_size: int, max_pages: int
    ) -> None:
        self.model = model
        self.pad_page, self.pad_slot = pad_page, pad_slot
        self.pad_flat_slot = pad_page * page_size
        self.max_pages = max_pages
        device = model.model.embed_tokens.weight.device
        t, n = MAX_TOKENS, SEQ_BUCKETS[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(t, dtype=i64, device=device)
        self.positions = torch.zeros(t, dtype=i64, device=device)
        self.slot_mapping = torch.full((t,), self.pad_flat_slot, dtype=i64, device=device)
        self.cu_seqlens = torch.zeros(n + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(n, dtype=i32, device=device)
        self.block_tables = torch.full((n, max_pages), pad_page, dtype=i32, device=device)
        self.state_slots = torch.full((n,), pad_slot, dtype=i64, device=device)
        self.save_at = torch.zeros(n, dtype=i32, device=device)
        self.save_to = torch.full((n,), pad_slot, dtype=i64, device=device)
        self.no_rows = torch.zeros(0, model.config.linear_conv_kernel_dim - 1, dtype=i64, device=device)
        self.shapes = [(t, s) for t in range(TOKEN_STEP, t + 1, TOKEN_STEP) for s in SEQ_BUCKETS]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}

    def _batch(self, tokens: int, seqs: int) -> ForwardBatch:
        """The static buffers as a pass of `tokens` tokens in `seqs` sequences."""
        cu, slots = self.cu_seqlens[: seqs + 1], self.state_slots[:seqs]
        piece = ScanPiece(None, cu, slots, slots[:0], self.save_to[:seqs], True, self.save_at[:seqs])
        # the checkpoints ride on the piece (the conv op and the scan write them): no conv rows
        saves = MidPassSaves(
            [piece], self.no_rows[:, 0], self.no_rows[:, 0], self.no_rows, 0, piece.save_at, piece.save_to
        )
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            cu_seqlens=cu,
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            slot_mapping=self.slot_mapping[:tokens],
            state_slots=slots,
            logits_indices=cu[1:].long() - 1,
            is_decode=False,
            max_query_len=tokens,
            saves=saves,
        )

    def _fill(self, batch: ForwardBatch) -> tuple[int, int]:
        """Copy a graphable pass into the static buffers, padded to its shape; -> the shape."""
        tokens, seqs = shape_of(batch)
        t, n, width = batch.num_tokens, batch.num_seqs, batch.block_tables.shape[1]
        if width > self.max_pages:
            raise ValueError(f"a pass of {width} pages a sequence: the graphs hold {self.max_pages}")
        piece = batch.saves.pieces[0]
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.slot_mapping)
        self.cu_seqlens[: n + 1].copy_(batch.cu_seqlens)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.state_slots[:n].copy_(batch.state_slots)
        if piece.save_at is not None:
            self.save_at[:n].copy_(piece.save_at)
            self.save_to[:n].copy_(piece.save_to)
        else:
            self.save_at[:n].zero_()
        # padding: sequences n..seqs-2 empty, sequence seqs-1 the tokens t..tokens
        self.input_ids[t:tokens].zero_()
        self.positions[t:tokens].copy_(torch.arange(tokens - t, device=self.positions.device))
        self.slot_mapping[t:tokens].fill_(self.pad_flat_slot)
        self.cu_seqlens[n + 1 : seqs].fill_(t)
        self.cu_seqlens[seqs] = tokens
        self.seq_lens[n : seqs - 1].zero_()
        self.seq_lens[seqs - 1] = tokens - t
        self.block_tables[n:seqs].fill_(self.pad_page)
        self.state_slots[n:seqs].fill_(self.pad_slot)
        self.save_at[n:seqs].zero_()
        self.save_to[n:seqs].fill_(self.pad_slot)
        return tokens, seqs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of a graphable pass: its graph replayed (CUDA), or the padded
        pass run eagerly (no graph captured: the CPU, and what tests compare)."""
        shape = self._fill(batch)
        graph = self.graphs.get(shape)
        if graph is None:
            return self.model(self._batch(*shape))[: batch.num_tokens]
        graph.replay()
        return self.hidden[shape][: batch.num_tokens]

    @torch.inference_mode()
    def capture(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """A graph for every shape (or those of `shapes`: a benchmark's), largest first, into one
        memory pool; each run twice first (Triton builds and autotunes outside the graph) on
        padding alone: every sequence empty but the padding one, so no real page or slot is touched."""
        pool = None
        self.cu_seqlens.zero_()
        for tokens, seqs in tqdm(sorted(shapes or self.shapes, reverse=True), desc="capturing prefill graphs",
                                 unit="graph", leave=False):  # fmt: skip
            self.cu_seqlens[seqs] = tokens
            self.seq_lens[seqs - 1] = tokens
            self.positions[:tokens].copy_(torch.arange(tokens, device=self.positions.device))
            for _ in range(2):
                self.model(self._batch(tokens, seqs))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # a batch of its own: what the ops derive from its cu_seqlens once a pass
            # (`pdserve.ops.per_pass`) is then made inside the graph, not kept from the warm-up
            batch = self._batch(tokens, seqs)
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[(tokens, seqs)] = self.model(batch)
            pool = graph.pool()
            self.graphs[(tokens, seqs)] = graph
            self.cu_seqlens[seqs] = 0
            self.seq_lens[seqs - 1] = 0
        torch.cuda.synchronize()
        logger.info("captured %d prefill graphs (passes of up to %d tokens)", len(self.graphs), MAX_TOKENS)
