"""The CUDA model against the CPU reference at the full Qwen3.6-35B-A3B width (4 layers: 3 GDN, 1
attention; random weights): `python -m pdserve.ops.check_full_shape`.

One packed prefill of odd lengths, then two decode steps of 5 sequences over random earlier context
(random K/V pages and GDN states), through (a) the CPU reference ops in fp32, (b) the CUDA ops in
fp32, (c) the CUDA ops in bf16, all from the same weights and states. Prints each CUDA run's logits
error relative to (a). Decode in fp32 involves no tf32 and should agree to rounding; the prefill's
GDN is fla's chunked kernel, whose fp32 dots run in tf32.
"""

from __future__ import annotations

import argparse

import torch

from pdserve.bench import QWEN36_35B_A3B
from pdserve.config import ModelConfig
from pdserve.memory import GdnStatePool, KvPagePool
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.qwen3_5_moe import Qwen3MoeHybrid
from pdserve.weights import init_dummy_weights

PAGE, PAGES, SLOTS, CONTEXT = 16, 256, 12, 300


def build(cfg: ModelConfig, device: str, dtype: torch.dtype) -> tuple:
    """(model, KV pool, GDN state pool) on `device` in `dtype`, the pools bound to the model."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeHybrid(cfg, max_positions=2048)
    finally:
        torch.set_default_dtype(default)
    model.rotary.to(dtype=torch.float32)
    kv = KvPagePool(cfg, PAGES, PAGE, dtype, device)
    states = GdnStatePool(cfg, SLOTS, dtype, torch.float32, device)
    model.bind_pools(kv.kv, states.conv, states.recurrent)
    return model.eval(), kv, states


def copy_into(dst: tuple, src: tuple) -> None:
    """Weights and pool contents of src into dst (cast to dst's dtype and device)."""
    with torch.no_grad():
        mine = dict(dst[0].named_parameters())
        for name, p in src[0].named_parameters():
            mine[name].copy_(p)
        dst[1].kv.copy_(src[1].kv)
        dst[2].conv.copy_(src[2].conv)
        dst[2].recurrent.copy_(src[2].recurrent)


@torch.inference_mode()
def run(model: Qwen3MoeHybrid, device: str) -> list[torch.Tensor]:
    """Logits of a packed prefill (3 prompts) and two decode steps of 5 sequences."""
    gen = torch.Generator().manual_seed(3)
    lengths, tables, slots = [1, 37, 300], [[0], [1, 2, 3], list(range(4, 24))], [0, 1, 2]
    prompts = [torch.randint(0, 200_000, (n,), generator=gen).tolist() for n in lengths]
    batch = ForwardBatch.build(prompts, [0, 0, 0], tables, slots, PAGE, device)
    out = [model.compute_logits(model(batch)[batch.logits_indices]).float().cpu()]
    # decode over random earlier context: pages 30.. and slots 4..8 hold random K/V and states
    tables = [list(range(30 + 20 * i, 50 + 20 * i)) for i in range(5)]
    for step in range(2):
        tokens = [[int(t)] for t in torch.randint(0, 200_000, (5,), generator=gen)]
        batch = ForwardBatch.build(tokens, [CONTEXT + step] * 5, tables, list(range(4, 9)), PAGE, device)
        out.append(model.compute_logits(model(batch)).float().cpu())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="pdserve")
    args = parser.parse_args()
    cfg = ModelConfig.from_dict(dict(QWEN36_35B_A3B, num_hidden_layers=4))
    gpu32 = build(cfg, "cuda", torch.float32)
    init_dummy_weights(gpu32[0], 0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    gpu32[1].kv.normal_(0.0, 1.0, generator=gen)
    gpu32[2].conv.normal_(0.0, 1.0, generator=gen)
    gpu32[2].recurrent.normal_(0.0, 0.05, generator=gen)
    cpu32 = build(cfg, "cpu", torch.float32)
    copy_into(cpu32, gpu32)
    want = run(cpu32[0], "cpu")
    del cpu32
    results = {"cuda fp32": run(gpu32[0], "cuda")}
    gpu16 = build(cfg, "cuda", torch.bfloat16)
    copy_into(gpu16, gpu32)
    del gpu32
    results["cuda bf16"] = run(gpu16[0], "cuda")
    for name, got in results.items():
        errs = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]
        top1 = [(g.argmax(-1) == w.argmax(-1)).float().mean().item() for g, w in zip(got, want, strict=True)]
        print(f"[{args.tag}] {name} vs CPU fp32 reference: logits rel err prefill {errs[0]:.2e}, "
              f"decode {errs[1]:.2e} / {errs[2]:.2e}; top-1 agreement {top1}")  # fmt: skip


if __name__ == "__main__":
    main()
