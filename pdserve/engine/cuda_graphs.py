"""CUDA graphs for decode steps: one graph per batch size, captured largest first into one pool.

A decode batch of `n` sequences replays the graph of the smallest captured size >= n; its
inputs are copied into the graph's static buffers and the padding rows point at a KV page and
a state slot reserved for them, so they never touch a real request's memory.
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from pdserve.memory import GdnStatePool, KvPagePool
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.qwen3_5_moe import Qwen3MoeHybrid

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (nano-vllm's choice)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen3MoeHybrid,
        kv_pool: KvPagePool,
        state_pool: GdnStatePool,
        max_num_seqs: int,
        max_pages: int,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.pad_page = kv_pool.allocate(1)[0]
        self.pad_slot = state_pool.allocate()
        self.max_pages = max_pages
        self.pad_flat_slot = self.pad_page * kv_pool.page_size
        device = kv_pool.kv.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_pages), self.pad_page, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), self.pad_flat_slot, dtype=torch.int64, device=device)
        self.state_slots = torch.full((n,), self.pad_slot, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            cu_seqlens=self.cu_seqlens[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            state_slots=self.state_slots[:n],
            logits_indices=self.cu_seqlens[1 : n + 1].to(torch.int64) - 1,
            is_decode=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        for n in tqdm(list(reversed(self.sizes)), desc="capturing decode graphs", unit="graph", leave=False):
            batch = self.batch(n)
            for _ in range(2):  # warm up (Triton autotuning, allocator) outside the graph
                self.model.compute_logits(self.model(batch))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[n] = self.model.compute_logits(self.model(batch))
            self.pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode
            and batch.num_seqs <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.max_pages
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch, by graph replay."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.state_slots[:n].copy_(batch.state_slots)
        # rows n..size are padding: they read and write only the reserved page and slot
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size].fill_(self.pad_page)
        self.slot_mapping[n:size].fill_(self.pad_flat_slot)
        self.state_slots[n:size].fill_(self.pad_slot)
        self.graphs[size].replay()
        return self.logits[size][:n]
