"""The host side of a prefill pass at the full Qwen3.6-35B-A3B shape, on a machine without a GPU:
`python -m pdserve.ops.bench_host 1x270@266 8x270@266 --two-pieces`.

Each argument `PxL[@S]` is a pass of P fresh prompts of L tokens, each saving a checkpoint after S
(a chat prompt's resume point). The model runs on torch's meta device with `Tensor.is_cuda`
answering true for it, so every op takes its CUDA path, and Triton's launches are counted and
skipped: what is left is pdserve's op wrappers and torch's dispatch, a floor of the host time a
pass costs on the GPU machine (where Triton's launcher and the driver come on top). Its GDN
layers scan as the engine plans them (`MidPassSaves`, CUDA's limits), and with `--two-pieces`
also as they did before one recurrent scan saved on its way (split at the save point). Only
passes whose GDN layers scan recurrently (prompts of at most 512 tokens, 2,048 in all): fla's
chunked scan reads the host copy of its lengths, which the meta device has not. Runs in a
process of its own: it changes `torch.Tensor.is_cuda` for the process.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench import QWEN36_35B_A3B
from pdserve.config import ModelConfig
from pdserve.model import mid_pass_saves
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.mid_pass_saves import MidPassSaves
from pdserve.model.qwen3_5_moe import Qwen3MoeHybrid

LAUNCHES: collections.Counter = collections.Counter()


def _meta_as_cuda() -> None:
    """Every meta tensor takes the CUDA paths; a Triton launch is counted, not run."""
    import triton.runtime.jit as jit

    torch.Tensor.is_cuda = property(lambda self: self.device.type in ("meta", "cuda"))
    jit.JITFunction.run = lambda self, *args, **kwargs: LAUNCHES.update([self.fn.__name__])


def _on_meta(obj: object) -> None:
    """Move every tensor field of a dataclass (slots) to the meta device, in place."""
    for name in obj.__slots__:
        value = getattr(obj, name)
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to("meta"))


def meta_pass(
    cfg: ModelConfig, prompts: int, length: int, save: int | None, two_pieces: bool
) -> ForwardBatch:
    """A pass of `prompts` fresh prompts on the meta device, with the engine's GDN scan plan."""
    tables, slots = [list(range(length // 16 + 1))] * prompts, list(range(prompts))
    batch = ForwardBatch.build([[1] * length] * prompts, [0] * prompts, tables, slots, 16, "cpu")
    saves = [[(save, prompts + i)] if save else [] for i in range(prompts)]
    history = cfg.linear_conv_kernel_dim - 1
    limit = mid_pass_saves.RECURRENT_MAX
    mid_pass_saves.RECURRENT_MAX = 1 if two_pieces else mid_pass_saves.RECURRENT_MAX_CUDA
    try:
        batch.saves = MidPassSaves.build([length] * prompts, slots, saves, history, "cpu")
    finally:
        mid_pass_saves.RECURRENT_MAX = limit
    if batch.saves is None:
        raise ValueError(f"{prompts}x{length}: fla's chunked scan, which cannot run on the meta device")
    _on_meta(batch)
    _on_meta(batch.saves)
    for piece in batch.saves.pieces:
        _on_meta(piece)
        cap = mid_pass_saves.RECURRENT_MAX_CUDA  # as planned on CUDA: short pieces recurrent
        piece.recurrent = piece.recurrent or (two_pieces and length <= cap)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("passes", nargs="+", help="PxL[@S]: P prompts of L tokens, saving after S")
    parser.add_argument("--two-pieces", action="store_true", help="also the plan split at the save points")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    _meta_as_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(QWEN36_35B_A3B))
        cfg = ModelConfig.from_pretrained(tmp)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Qwen3MoeHybrid(cfg, max_positions=8192)
        kv = torch.empty(10, 2, 1024, 16, cfg.num_key_value_heads, cfg.head_dim)
        conv = torch.empty(30, 64, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1)
        shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        recurrent = torch.empty(30, 64, *shape, dtype=torch.float32)
    model.bind_pools(kv, conv, recurrent)
    for spec in args.passes:
        size, _, save = spec.partition("@")
        prompts, length = (int(x) for x in size.split("x"))
        for two in (True, False) if args.two_pieces and save else (False,):
            batch = meta_pass(cfg, prompts, length, int(save) if save else None, two)
            with torch.inference_mode():
                model(batch)
                LAUNCHES.clear()
                start = time.perf_counter()
                for _ in range(args.runs):
                    model(batch)
            host_ms = (time.perf_counter() - start) / args.runs * 1e3
            plan = f"{' (two pieces)' if two else ''}: {len(batch.saves.pieces)} scan piece(s)"
            print(f"{spec}{plan}, host {host_ms:.1f} ms, "
                  f"{sum(LAUNCHES.values()) // args.runs} Triton launches", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
