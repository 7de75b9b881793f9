"""Command-line flags of an engine process, shared by `pdserve up`, `prefill` and `decode`.

Engine flags carry `vllm serve`'s names. Their parser defaults are None, meaning "the
`EngineConfig` default": `EngineConfig` stays the one place defaults live, and `pdserve up`
passes on to its children only what the user set (`engine_argv`).

    add_engine_arguments(parser)   --model --device --dtype --load-format --dummy-weight-seed
                                   --max-num-seqs --max-model-len --max-num-batched-tokens
                                   --gpu-memory-utilization --host --port
    engine_config_from_args(args)  -> EngineConfig

`pdserve.launcher` re-exports both (the services import them from there). vLLM's `--seed` (the
sampling seed of requests that set none) and `--served-model-name` are the router's
(router.api_flags); the random weights of `--load-format dummy` take `--dummy-weight-seed`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.config import EngineConfig

# flag -> (EngineConfig field, type); --model and --device are handled apart
ENGINE_FLAGS: dict[str, tuple[str, type]] = {
    "--dtype": ("dtype", str),
    "--load-format": ("load_format", str),
    "--dummy-weight-seed": ("dummy_weight_seed", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-model-len": ("max_model_len", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--snapshot-pool-mb": ("snapshot_pool_mb", int),
    "--num-prefix-checkpoints": ("num_prefix_checkpoints", int),
    "--background-prefill-tokens": ("background_prefill_tokens", int),
    "--background-prefill-sms": ("background_prefill_sms", int),
    "--background-launch-ms": ("background_launch_ms", float),
    "--long-attention-from": ("long_attention_from", int),
}
# on/off flags (`--x` / `--no-x`; unset: the EngineConfig default) -> EngineConfig field
ENGINE_SWITCHES: dict[str, str] = {
    "--enforce-eager": "enforce_eager",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--prefill-graphs": "prefill_graphs",
    "--express-prefill": "express_prefill",
}
_HELP = {
    "--enforce-eager": "no CUDA graphs for decode",
    "--enable-prefix-caching": "the hybrid prefix cache (on by default): shared KV pages + GDN state "
    "checkpoints; --no-enable-prefix-caching turns it off",
    "--prefill-graphs": "replay small prefill passes (chat turns: up to 512 tokens, 64 sequences, "
    "short chunks) from CUDA graphs captured at start (off until measured served)",
    "--express-prefill": "while a long prompt's chunk runs beside the decode steps, a short prompt's "
    "chunk runs beside it on the background stream, not in the decode step (off until measured on a GPU)",
    "--dtype": "model dtype: auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16",
    "--load-format": "auto (safetensors) or dummy (random weights, for benchmarks)",
    "--dummy-weight-seed": "seed of the random weights of --load-format dummy (default 0)",
    "--max-num-seqs": "most sequences running at once",
    "--max-model-len": "longest prompt + output, in tokens",
    "--max-num-batched-tokens": "most tokens in one engine step",
    "--gpu-memory-utilization": "share of GPU memory the process may use, in (0, 1]",
    "--snapshot-pool-mb": "pinned host memory for prefix-cache entries evicted from the device "
    "(default 4096 on GPU, 16 on CPU; 0: none)",
    "--num-prefix-checkpoints": "GDN state checkpoints the prefix cache keeps on the device, ~61 MiB "
    "each at the full shape (default: 2 x --max-num-seqs on GPU, 32 on CPU)",
    "--background-prefill-tokens": "every prompt chunk of a sequence of at least this many tokens runs "
    "beside the decode steps instead of in them, so short streams keep their ITL (default 32768; 0: never)",
    "--background-prefill-sms": "SMs a background prefill pass may hold on a GPU (default: all but 32; "
    "0: the whole device)",
    "--background-launch-ms": "host time a step may spend launching a background pass's layers "
    "(default 5; each layer of an 8K-token chunk takes 2-6 ms to launch)",
    "--long-attention-from": "a prompt chunk of >= 1,024 tokens, alone in its pass, after at least this "
    "many cached tokens computes its attention in parts: the cached prefix through cuDNN (default 16384; "
    "0: never)",
}


def _dest(flag: str) -> str:
    """The attribute of parsed arguments a flag sets (argparse's: `--max-num-seqs` -> max_num_seqs)."""
    return flag.removeprefix("--").replace("-", "_")


def add_engine_arguments(
    parser: argparse.ArgumentParser, host: str = "0.0.0.0", port: int = 0, model_required: bool = True
) -> None:
    """The engine flags (vllm serve's names; unset ones are None = the EngineConfig default),
    and where the process listens (`--port 0`: any free port)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", required=model_required, default=None, metavar="DIR", help="checkpoint folder"
    )
    group.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    for flag, (_name, kind) in ENGINE_FLAGS.items():
        group.add_argument(flag, dest=_dest(flag), type=kind, default=None, help=_HELP[flag])
    for flag in ENGINE_SWITCHES:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP[flag])
    group.add_argument("--host", default=host, help=f"address to listen on (default {host})")
    group.add_argument("--port", type=int, default=port, help=f"port to listen on (default {port})")


def resolve_device(device: str | None) -> str:
    """`device`, or "cuda" when torch sees a GPU and "cpu" otherwise."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the flags of `add_engine_arguments` (unset flags keep its defaults)."""
    from pdserve.config import EngineConfig

    if args.model is None:
        raise ValueError("--model is required")
    kwargs = {name: getattr(args, _dest(flag)) for flag, (name, _kind) in ENGINE_FLAGS.items()}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    switches = {name: getattr(args, name, None) for name in ENGINE_SWITCHES.values()}
    kwargs.update({name: value for name, value in switches.items() if value is not None})
    return EngineConfig(model=args.model, device=resolve_device(args.device), **kwargs)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags that were set, as command-line arguments (for a child process).
    `--model` and `--device` are left out: the caller passes them resolved."""
    argv: list[str] = []
    for flag in ENGINE_FLAGS:
        if (value := getattr(args, _dest(flag))) is not None:
            argv += [flag, str(value)]
    for flag, name in ENGINE_SWITCHES.items():
        value = getattr(args, name, None)
        if value is not None:
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
    return argv
