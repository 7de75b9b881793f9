"""Loading weights: stream safetensors, map checkpoint names onto the model's (fused) parameters,
check that every parameter was filled; or build random "dummy" weights on the device."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pdserve.config import ModelConfig

IGNORED_PREFIXES = ("mtp.", "model.mtp.", "visual.", "model.visual.")
Slicer = Callable[[torch.Tensor, re.Match], torch.Tensor]


def _rows(piece: int, sizes: Callable[[ModelConfig], list[int]]) -> Callable[[ModelConfig], Slicer]:
    """A slicer for row block `piece` of a parameter fused from blocks of `sizes(cfg)` rows."""

    def make(cfg: ModelConfig) -> Slicer:
        s = sizes(cfg)
        start = sum(s[:piece])
        return lambda p, m: p[start : start + s[piece]]

    return make


def _whole(cfg: ModelConfig) -> Slicer:
    return lambda p, m: p


def _expert_rows(piece: int) -> Callable[[ModelConfig], Slicer]:
    def make(cfg: ModelConfig) -> Slicer:
        i = cfg.moe_intermediate_size
        return lambda p, m: p[int(m["e"]), piece * i : (piece + 1) * i]

    return make


def _expert(cfg: ModelConfig) -> Slicer:
    return lambda p, m: p[int(m["e"])]


def _gdn(cfg: ModelConfig) -> list[int]:
    return [cfg.gdn_conv_dim, cfg.gdn_value_dim, cfg.linear_num_value_heads, cfg.linear_num_value_heads]


def _attn(cfg: ModelConfig) -> list[int]:
    q = cfg.num_attention_heads * cfg.head_dim * 2
    kv = cfg.num_key_value_heads * cfg.head_dim
    return [q, kv, kv]


def _shared(cfg: ModelConfig) -> list[int]:
    return [cfg.shared_expert_intermediate_size] * 2


def _conv(cfg: ModelConfig) -> Slicer:
    return lambda p, m: p.unsqueeze(1)  # checkpoint stores [C, 1, W]


_L = r"model\.layers\.(?P<l>\d+)\."
# (checkpoint-name pattern, model parameter (format string on the match), slicer factory)
RULES: list[tuple[re.Pattern, str, Callable[[ModelConfig], Slicer]]] = [
    (re.compile(p), target, slicer)
    for p, target, slicer in [
        (r"model\.embed_tokens\.weight", "model.embed_tokens.weight", _whole),
        (r"model\.norm\.weight", "model.norm.weight", _whole),
        (r"lm_head\.weight", "lm_head.weight", _whole),
        (
            _L + r"(?P<n>input_layernorm|post_attention_layernorm)\.weight",
            "model.layers.{l}.{n}.weight",
            _whole,
        ),
        (_L + r"linear_attn\.in_proj_qkv\.weight", "model.layers.{l}.linear_attn.in_proj", _rows(0, _gdn)),
        (_L + r"linear_attn\.in_proj_z\.weight", "model.layers.{l}.linear_attn.in_proj", _rows(1, _gdn)),
        (_L + r"linear_attn\.in_proj_b\.weight", "model.layers.{l}.linear_attn.in_proj", _rows(2, _gdn)),
        (_L + r"linear_attn\.in_proj_a\.weight", "model.layers.{l}.linear_attn.in_proj", _rows(3, _gdn)),
        (_L + r"linear_attn\.conv1d\.weight", "model.layers.{l}.linear_attn.conv1d_weight", _conv),
        (_L + r"linear_attn\.(?P<n>dt_bias|A_log)", "model.layers.{l}.linear_attn.{n}", _whole),
        (_L + r"linear_attn\.norm\.weight", "model.layers.{l}.linear_attn.norm.weight", _whole),
        (_L + r"linear_attn\.out_proj\.weight", "model.layers.{l}.linear_attn.out_proj", _whole),
        (_L + r"self_attn\.q_proj\.weight", "model.layers.{l}.self_attn.qkv_proj", _rows(0, _attn)),
        (_L + r"self_attn\.k_proj\.weight", "model.layers.{l}.self_attn.qkv_proj", _rows(1, _attn)),
        (_L + r"self_attn\.v_proj\.weight", "model.layers.{l}.self_attn.qkv_proj", _rows(2, _attn)),
        (_L + r"self_attn\.o_proj\.weight", "model.layers.{l}.self_attn.o_proj", _whole),
        (_L + r"self_attn\.(?P<n>q_norm|k_norm)\.weight", "model.layers.{l}.self_attn.{n}.weight", _whole),
        (_L + r"mlp\.gate\.weight", "model.layers.{l}.mlp.gate", _whole),
        (_L + r"mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight", "model.layers.{l}.mlp.w13", _expert_rows(0)),
        (_L + r"mlp\.experts\.(?P<e>\d+)\.up_proj\.weight", "model.layers.{l}.mlp.w13", _expert_rows(1)),
        (_L + r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight", "model.layers.{l}.mlp.w2", _expert),
        (_L + r"mlp\.experts\.gate_up_proj", "model.layers.{l}.mlp.w13", _whole),
        (_L + r"mlp\.experts\.down_proj", "model.layers.{l}.mlp.w2", _whole),
        (
            _L + r"mlp\.shared_expert\.gate_proj\.weight",
            "model.layers.{l}.mlp.shared_gate_up",
            _rows(0, _shared),
        ),
        (
            _L + r"mlp\.shared_expert\.up_proj\.weight",
            "model.layers.{l}.mlp.shared_gate_up",
            _rows(1, _shared),
        ),
        (_L + r"mlp\.shared_expert\.down_proj\.weight", "model.layers.{l}.mlp.shared_down", _whole),
        (_L + r"mlp\.shared_expert_gate\.weight", "model.layers.{l}.mlp.shared_expert_gate", _whole),
    ]
]


def normalize_name(name: str) -> str | None:
    """The text-model name of a checkpoint tensor, or None for tensors pdserve ignores."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    if name.startswith(IGNORED_PREFIXES):
        return None
    return name


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint index names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"cannot read checkpoint file {path.name}: {e}") from e
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name} from {path.name}: {e}") from e
                yield name, tensor


def _match_rule(slicers: list, name: str) -> tuple[re.Match, str, Slicer] | None:
    for pattern, target, slicer in slicers:
        match = pattern.fullmatch(name)
        if match:
            return match, target, slicer
    return None


def load_weights(model: torch.nn.Module, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Fill every parameter of `model` from the checkpoint; raise ValueError naming any tensor
    that is missing, unexpected, or of the wrong shape."""
    params = dict(model.named_parameters())
    filled = {name: 0 for name in params}
    slicers = [(pattern, target, make(cfg)) for pattern, target, make in RULES]
    unexpected = []
    files = checkpoint_files(model_dir)
    with torch.no_grad():
        for raw_name, tensor in tqdm(
            iter_checkpoint(files), desc="loading weights", unit="tensor", leave=False
        ):
            name = normalize_name(raw_name)
            if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue  # tied: the output projection is the embedding (a saved copy is not read)
            rule = _match_rule(slicers, name)
            if rule is None:
                unexpected.append(raw_name)
                continue
            match, target, slicer = rule
            param_name = target.format(**match.groupdict())
            if param_name not in params:
                unexpected.append(raw_name)
                continue
            dest = slicer(params[param_name].data, match)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {raw_name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[param_name] += tensor.numel()
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint: {', '.join(sorted(unexpected)[:20])}")
    incomplete = [n for n, count in filled.items() if count != params[n].numel()]
    if incomplete:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(incomplete[:20])}")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right scale, generated on the parameters' device (for benchmarks)."""
    with torch.no_grad():
        params = list(model.named_parameters())
        gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
        for name, p in tqdm(params, desc="dummy weights", unit="tensor", leave=False):
            if name.endswith("A_log"):
                p.uniform_(math.log(1.0), math.log(16.0), generator=gen)
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
