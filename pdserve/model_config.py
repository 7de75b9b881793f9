"""`ModelConfig`: the shape of a Qwen3.5/3.6-MoE hybrid model, read from a checkpoint's `config.json`
(the multimodal wrapper with a `text_config`, or a text-only config).

Plain Python, no torch: the router reads the model's limits from it (docs/deploy.md: the router
image has no torch). `pdserve.config` re-exports it beside `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_conv_kernel_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Qwen3.5/3.6-MoE hybrid model (text part only)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_conv_kernel_dim: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_moe_text"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise ValueError(f"unknown layer type(s) {bad} in layer_types")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok exceeds num_experts")

    # ---- derived shapes (the memory pools are sized from these without building the model)
    @property
    def attn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v projections side by side."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def conv_state_shape(self) -> tuple[int, int]:
        """Per request and GDN layer: the last (kernel - 1) conv inputs of every channel."""
        return (self.gdn_conv_dim, self.linear_conv_kernel_dim - 1)

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """Per request and GDN layer: [value heads, key dim, value dim]."""
        return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)

    def kv_page_shape(self, page_size: int) -> tuple[int, int, int]:
        return (page_size, self.num_key_value_heads, self.head_dim)

    def identity(self) -> str:
        """A stable id of the model's shape: its type plus a hash of every field."""
        raw = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return f"{self.model_type}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}"

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type is None:
            raise ValueError("config.json has no model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; pdserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        outer_eos = raw.get("eos_token_id")
        # transformers ties the wrapper's lm_head by the wrapper's own flag (default false); its
        # text_config's flag (saved as false) does not count; a text-only config says for itself
        tie = raw.get("tie_word_embeddings", False)
        if model_type == "qwen3_5_moe":
            if "text_config" not in raw:
                raise ValueError("config.json of model_type qwen3_5_moe has no text_config")
            raw = {**raw["text_config"], "tie_word_embeddings": tie}
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing required field(s): {', '.join(missing)}")
        n = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = raw.get("full_attention_interval", 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
            ]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
        eos = raw.get("eos_token_id", outer_eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            **{k: raw[k] for k in _REQUIRED},
            layer_types=tuple(layer_types),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=raw.get("max_position_embeddings", 262_144),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            model_type="qwen3_5_moe_text",
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)
