"""Owns the model and its memory pools on one device; turns a scheduled batch into logits."""

from __future__ import annotations

import logging

import torch

from pdserve.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.prefill_graphs import PrefillGraphs, graphable
from pdserve.engine.prompt_logprobs import plan_prompt_rows, score_prompt_rows
from pdserve.engine.run_ahead import TokenPatch, apply_patch
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.memory import GdnStatePool, KvPagePool
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.mid_pass_saves import MidPassSaves
from pdserve.model.qwen3_5_moe import Qwen3MoeHybrid
from pdserve.ops.long_attention import takes_split
from pdserve.pinned import to_device
from pdserve.weights import init_dummy_weights, load_weights

logger = logging.getLogger(__name__)
CPU_KV_BUDGET_BYTES = 256 << 20
ACTIVATION_RESERVE_BYTES = 4 << 30  # a prefill pass's activations (and, later, CUDA graphs)
GIB = 1 << 30


class MemoryPlanError(ValueError):
    """The configuration cannot fit on the device; the message is one line naming the numbers."""


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        cfg = config.model_config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)  # parameters are born in the model dtype, on the device
        try:
            with torch.device(self.device):
                model = Qwen3MoeHybrid(cfg, max_positions=config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        model.rotary.to(dtype=torch.float32)  # the cos/sin tables stay fp32, like the reference
        if config.load_format == "dummy":
            init_dummy_weights(model, config.dummy_weight_seed)
        else:
            load_weights(model, config.model, cfg)
        self.model = model.eval()
        # a prefill-only engine never decodes: no decode graphs; a decode-only one no prefill graphs
        on_gpu = self.device.type == "cuda" and not config.enforce_eager
        use_graphs = on_gpu and config.role != "prefill"
        use_prefill_graphs = on_gpu and config.role != "decode" and config.prefill_graphs
        self.reserved = 1 if use_graphs or use_prefill_graphs else 0  # for the graphs' padding rows
        self.state_pool = GdnStatePool(
            cfg,
            config.num_state_slots + self.reserved,
            config.dtype,
            config.recurrent_state_dtype,
            self.device,
        )
        self.kv_pool = KvPagePool(cfg, self._num_kv_pages(), config.page_size, config.dtype, self.device)
        self.model.bind_pools(self.kv_pool.kv, self.state_pool.conv, self.state_pool.recurrent)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        max_pages = self.kv_pool.pages_for(config.max_model_len)
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_pool, self.state_pool, config.max_num_seqs, max_pages
            )
            self.graphs.capture()
        if use_prefill_graphs:  # the decode graphs' padding page and slot, or their own
            pad_page, pad_slot = (
                (self.graphs.pad_page, self.graphs.pad_slot)
                if self.graphs is not None
                else (self.kv_pool.allocate(1)[0], self.state_pool.allocate())
            )
            self.prefill_graphs = PrefillGraphs(self.model, pad_page, pad_slot, config.page_size, max_pages)
            self.prefill_graphs.capture()

    def _num_kv_pages(self) -> int:
        c = self.config
        per_page = KvPagePool.bytes_per_page(c.model_config, c.page_size, c.dtype)
        if c.num_kv_pages is not None:
            floor = self._fit_max_model_len(c.num_kv_pages)
            if c.num_kv_pages < floor:
                raise ValueError(f"num_kv_pages {c.num_kv_pages} cannot hold max_model_len {c.max_model_len}")
            return c.num_kv_pages + self.reserved
        if self.device.type == "cuda":
            # like vLLM: this instance may fill `gpu_memory_utilization` of the whole device,
            # counting what is already in use (weights, state pool, other processes)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * c.gpu_memory_utilization - (total - free) - ACTIVATION_RESERVE_BYTES
            pages = int(budget // per_page) - self.reserved
            floor = self._fit_max_model_len(pages)
            if pages < floor:
                raise MemoryPlanError(self._plan_line(budget, total, free, floor * per_page))
        else:
            available = CPU_KV_BUDGET_BYTES // per_page
            floor = self._fit_max_model_len(available)
            pages = min(c.max_num_seqs * floor, available)
            if pages < floor:
                raise ValueError(
                    f"{pages} KV pages cannot hold one sequence of max_model_len {c.max_model_len}"
                )
        pages += self.reserved
        logger.info(
            "memory: weights %.1f GiB, GDN states %.1f GiB (%d slots), KV %.1f GiB = %d tokens: "
            "%d requests of max_model_len %d at once, up to %d shorter ones",
            self._weight_bytes() / GIB,
            self.state_pool.nbytes / GIB,
            c.num_state_slots,
            pages * per_page / GIB,
            pages * c.page_size,
            min(pages // floor, c.num_state_slots),
            c.max_model_len,
            c.num_state_slots,
        )
        return pages

    def _fit_max_model_len(self, pages: int) -> int:
        """Pages one request of max_model_len needs (all of them must always fit). A max_model_len
        that was not given (the model's max_position_embeddings) is lowered to the longest
        request `pages` KV pages hold, and said (vLLM's default); a given one is kept."""
        c = self.config
        if c.fit_max_model_len and 0 < pages * c.page_size < c.max_model_len:
            logger.warning(
                "max_model_len %d: the KV pool holds %d pages of %d tokens, less than the model's "
                "max_position_embeddings %d (--max-model-len sets it; more memory raises it)",
                pages * c.page_size,
                pages,
                c.page_size,
                c.max_model_len,
            )
            c.max_model_len = pages * c.page_size
        return -(-c.max_model_len // c.page_size)

    def _weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def _plan_line(self, budget: float, total: int, free: int, one_sequence: int) -> str:
        c = self.config
        # the state slots: one a running sequence, and with the prefix cache one a checkpoint
        slots = "--max-num-seqs" + (" or --num-prefix-checkpoints" if c.enable_prefix_caching else "")
        return (
            f"the model does not fit: weights {self._weight_bytes() / GIB:.1f} GiB + GDN states "
            f"{self.state_pool.nbytes / GIB:.1f} GiB ({c.num_state_slots} slots) + activations "
            f"{ACTIVATION_RESERVE_BYTES / GIB:.0f} GiB leave {budget / GIB:.1f} GiB for KV pages, and one "
            f"sequence of max_model_len {c.max_model_len} needs {one_sequence / GIB:.2f} GiB "
            f"(this instance may use {c.gpu_memory_utilization:.2f} of {total / GIB:.1f} GiB, "
            f"{(total - free) / GIB:.1f} GiB already in use): lower {slots} or --max-model-len, "
            "raise --gpu-memory-utilization, or run one engine per GPU"
        )

    def build_batch(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None) -> ForwardBatch:
        """The pass's tensors on the device (copied on the current stream), its checkpoints'
        plan, and the in-flight step's tokens patched into its input."""
        batch = ForwardBatch.build(
            token_ids=[
                s.seq.token_ids(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens)
                for s in scheduled
            ],
            start_positions=[s.seq.num_computed_tokens for s in scheduled],
            block_tables=[s.seq.block_table for s in scheduled],
            state_slots=[s.seq.state_slot for s in scheduled],
            page_size=self.config.page_size,
            device=self.device,
        )
        if len(scheduled) == 1:  # a long prompt's chunk alone in its pass: attention in parts?
            seq, new = scheduled[0].seq, scheduled[0].num_new_tokens
            if takes_split(new, seq.num_computed_tokens, self.config.long_attention_from):
                batch.long_context = seq.num_computed_tokens
        if not batch.is_decode:  # checkpoints the pass crosses; the plan of its GDN scan
            offsets = [
                [(p.position - s.seq.num_computed_tokens, p.checkpoint) for p in s.saves] for s in scheduled
            ]
            batch.saves = MidPassSaves.build(
                [s.num_new_tokens for s in scheduled],
                [s.seq.state_slot for s in scheduled],
                offsets,
                self.config.model_config.linear_conv_kernel_dim - 1,
                self.device,
            )
        apply_patch(batch.input_ids, patch)  # tokens of the step in flight, read on the device
        return batch

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], patch: TokenPatch | None = None) -> torch.Tensor:
        """Run one packed pass; returns fp32 logits [num sampling sequences, vocab]. Sequences
        asking for prompt logprobs get this pass's entries appended (pdserve.engine.prompt_logprobs)."""
        batch = self.build_batch(scheduled, patch)
        prompt_rows = plan_prompt_rows(scheduled)
        if self.graphs is not None and not prompt_rows and batch.saves is None and self.graphs.fits(batch):
            return self.graphs.replay(batch)
        if self.prefill_graphs is not None and not prompt_rows and graphable(batch):
            hidden = self.prefill_graphs.run(batch)
        else:
            hidden = self.model(batch)
        if prompt_rows:
            score_prompt_rows(hidden, prompt_rows, self.model.compute_logits)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        index = batch.logits_indices[to_device(rows, torch.int64, self.device)]
        return self.model.compute_logits(hidden[index])
