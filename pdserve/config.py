"""Engine configuration.

`EngineConfig` is the one config object of an engine process: the model plus memory and
scheduling limits. `ModelConfig` (the model's shape from `config.json`) lives in the torch-free
`pdserve.model_config` and is re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.model_config import SUPPORTED_MODEL_TYPES, ModelConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "EngineConfig", "ModelConfig", "parse_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class EngineConfig:
    """Everything one engine process needs: model, device, memory and scheduling limits."""

    model: str
    device: str = "cpu"
    dtype: str | torch.dtype = "auto"
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights on the device)
    dummy_weight_seed: int = 0  # the random weights of load_format "dummy"
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    num_kv_pages: int | None = None  # None: sized from gpu_memory_utilization (GPU) or max_model_len (CPU)
    # None: max_num_seqs, plus num_prefix_checkpoints with the prefix cache (a checkpoint is a slot)
    num_state_slots: int | None = None
    gpu_memory_utilization: float = 0.9
    recurrent_state_dtype: str | torch.dtype = "float32"
    enforce_eager: bool = False  # True: no CUDA graphs for decode (vLLM's flag)
    # CUDA graphs for small prefill passes too (pdserve.engine.prefill_graphs); off until measured served
    prefill_graphs: bool = False
    enable_prefix_caching: bool = True  # the hybrid prefix cache (docs/prefix-cache.md), as vLLM
    prefix_block_size: int = 64  # tokens per cache block (a multiple of page_size)
    # GDN state checkpoints kept on the device (~61 MiB each at the full shape); None: on a GPU
    # two for every sequence that can run (a prompt's and an answer's: a conversation of each
    # keeps its next turn's start there), 32 on a CPU
    num_prefix_checkpoints: int | None = None
    # the prefix cache's pinned host tier for entries evicted from the device, MiB (0: none);
    # None: 4,096 on a GPU, 16 on a CPU (the same code path, a small pool)
    snapshot_pool_mb: int | None = None
    # a prompt chunk of a sequence of at least this many tokens, in a step that also decodes
    # (or admits short prompts), runs as a background pass beside the decode steps
    # (pdserve.engine.background_pass; 0: never); and the SMs that pass may hold on a GPU
    # (None: all but 32; 0: the whole device)
    background_prefill_tokens: int = 32768
    background_prefill_sms: int | None = None
    # host time a step may spend launching the background pass's layers, ms (hidden behind the
    # step's GPU time: a 4-row decode step beside the pass is ~8-10 ms on the SMs left to it)
    background_launch_ms: float = 5.0
    # while a long prompt's background pass runs, another prompt chunk scheduled beside decode rows
    # runs on the background stream too (the express pass), not in the decode step: off until
    # it has run on a GPU (docs/benchmarks.md, session 28)
    express_prefill: bool = False
    # a one-sequence prompt chunk after at least this many cached tokens computes its attention
    # in parts (pdserve.ops.long_attention: the prefix through cuDNN); 0: never. 16,384: served
    # on the H200 (docs/benchmarks.md, session 28), 262K's TTFT 22.9 -> 20.3 s
    long_attention_from: int = 16384
    # what the engine serves: "prefill" captures no decode graphs (it never decodes), "decode"
    # (its prefix cache holds finished generations, for a prefill instance to pull), "both"
    # (offline, or one engine on one GPU)
    role: str = "both"
    model_config: ModelConfig = field(init=False)
    # max_model_len was not given: the memory plan may lower it to the longest request that fits
    fit_max_model_len: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.model_config = ModelConfig.from_pretrained(self.model)
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be 'both', 'prefill' or 'decode', got {self.role!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype == "auto":
            self.dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        self.dtype = parse_dtype(self.dtype)
        self.recurrent_state_dtype = parse_dtype(self.recurrent_state_dtype)
        if self.max_model_len is None:  # the model's, lowered to what fits by the memory plan
            self.max_model_len = self.model_config.max_position_embeddings
            self.fit_max_model_len = True
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.background_prefill_tokens < 0 or (self.background_prefill_sms or 0) < 0:
            raise ValueError("background_prefill_tokens and background_prefill_sms must be >= 0")
        if self.long_attention_from < 0:
            raise ValueError("long_attention_from must be >= 0")
        if self.background_launch_ms <= 0:
            raise ValueError("background_launch_ms must be positive")
        if self.snapshot_pool_mb is None:
            self.snapshot_pool_mb = 4096 if self.device.startswith("cuda") else 16
        if self.snapshot_pool_mb < 0:
            raise ValueError("snapshot_pool_mb must be >= 0")
        if not self.enable_prefix_caching:
            self.snapshot_pool_mb = 0
        if self.num_prefix_checkpoints is None:
            self.num_prefix_checkpoints = 2 * self.max_num_seqs if self.device.startswith("cuda") else 32
        if self.num_prefix_checkpoints <= 0:
            raise ValueError("num_prefix_checkpoints must be positive")
        if self.num_state_slots is None:
            extra = self.num_prefix_checkpoints if self.enable_prefix_caching else 0
            self.num_state_slots = self.max_num_seqs + extra
