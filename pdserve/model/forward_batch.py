"""The tensors that describe one forward pass over a packed batch.

A batch is `N` sequences with `T` new tokens in all, packed one after another. Prefill
chunks and decode tokens may share a batch (a decode token is a sequence of length 1).
The model reads only these tensors: no per-request Python objects cross into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import ops
from pdserve.model.mid_pass_saves import MidPassSaves
from pdserve.pinned import to_device_many


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    cu_seqlens: torch.Tensor  # [N+1] int32: new-token boundaries
    seq_lens: torch.Tensor  # [N] int32: context length of each sequence after this pass
    block_tables: torch.Tensor  # [N, max_pages] int32: KV pages of each sequence
    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (page * page_size + offset) of each token
    state_slots: torch.Tensor  # [N] int64: GDN state slot of each sequence
    logits_indices: torch.Tensor  # [N] int64: the token whose logits each sequence needs
    is_decode: bool  # every sequence has exactly one new token: the single-step ops apply
    max_query_len: int = 1  # the most new tokens of one sequence (a host int: no device read)
    saves: MidPassSaves | None = None  # prefix checkpoints this pass takes on its way through
    gdn_chunks: torch.Tensor | None = None  # [NC, 2] int64: `ops.gdn_chunk_index` (prefill only)
    # a background pass beside decode steps: its prefill attention holds at most this many SMs
    attention_programs: int | None = None
    # a long prompt's chunk whose attention goes in parts (`ops.long_attention`): the tokens
    # cached before it (a host int); None: the paged kernel
    long_context: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @staticmethod
    def build(
        token_ids: list[list[int]],
        start_positions: list[int],
        block_tables: list[list[int]],
        state_slots: list[int],
        page_size: int,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Lay out `N` sequences' new tokens; sequence `i` starts at `start_positions[i]`."""
        if not (len(token_ids) == len(start_positions) == len(block_tables) == len(state_slots)):
            raise ValueError("token_ids, start_positions, block_tables and state_slots differ in length")
        if any(len(t) == 0 for t in token_ids):
            raise ValueError("every sequence in a batch needs at least one new token")
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for toks, start, table in zip(token_ids, start_positions, block_tables, strict=True):
            end = start + len(toks)
            ids.extend(toks)
            positions.extend(range(start, end))
            for page in range(start // page_size, (end - 1) // page_size + 1):  # a run of slots a page
                first = page * page_size
                shift = table[page] * page_size - first
                slots.extend(range(shift + max(start, first), shift + min(end, first + page_size)))
            cu.append(cu[-1] + len(toks))
            seq_lens.append(end)
        width = max(1, max(len(t) for t in block_tables))
        tables = [p for t in block_tables for p in (*t, *[0] * (width - len(t)))]
        is_decode = all(len(t) == 1 for t in token_ids)
        chunks = [] if is_decode else ops.gdn_chunk_index([len(t) for t in token_ids])
        # two copies for the whole batch (never waiting for the step in flight): int64, int32
        ids_t, positions_t, slots_t, state_t, logits_t, chunks_t = to_device_many(
            [ids, positions, slots, state_slots, [c - 1 for c in cu[1:]], chunks], torch.int64, device
        )
        cu_t, seq_lens_t, tables_t = to_device_many([cu, seq_lens, tables], torch.int32, device)
        return ForwardBatch(
            input_ids=ids_t,
            positions=positions_t,
            cu_seqlens=cu_t,
            seq_lens=seq_lens_t,
            block_tables=tables_t.view(len(block_tables), width),
            slot_mapping=slots_t,
            state_slots=state_t,
            logits_indices=logits_t,
            is_decode=is_decode,
            max_query_len=max(len(t) for t in token_ids),
            gdn_chunks=None if is_decode else chunks_t.view(-1, 2),
        )
