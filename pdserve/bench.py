"""`pdserve bench`: offline throughput at the full Qwen3.6-35B-A3B shape with random weights.

Each run: `c` prompts of `--prompt-len` random tokens, `--output-len` tokens each (ignore_eos),
all submitted at once; reports output tok/s, mean TTFT and mean TPOT, and draws a bar chart in
the terminal. Results go to a JSON file for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench_chart import chart_svg

# The text config of Qwen3.6-35B-A3B (what `config.json["text_config"]` holds).
QWEN36_35B_A3B = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the full shape, dummy weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument(
        "--chart", default=None, help="write an SVG bar chart (vs vLLM and the roofline) here"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def bench_one(llm, concurrency: int, prompt_len: int, output_len: int) -> dict:
    from pdserve import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(concurrency)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    first, done = {}, {}
    for i in range(concurrency):
        prompt = torch.randint(0, 200_000, (prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, params, request_id=f"b{i}")
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - start
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    total = time.perf_counter() - start
    ttft = sum(first.values()) / concurrency
    tpot = sum((done[r] - first[r]) / (output_len - 1) for r in done) / concurrency
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "seconds": total,
        "output_tok_s": concurrency * output_len / total,
        "ttft_ms": 1000 * ttft,
        "tpot_ms": 1000 * tpot,
    }


def draw(results: list[dict]) -> str:
    peak = max(r["output_tok_s"] for r in results) or 1.0
    lines = []
    for r in results:
        bar = "█" * max(1, round(40 * r["output_tok_s"] / peak))
        lines.append(
            f"c={r['concurrency']:<3} {bar:<40} {r['output_tok_s']:8.1f} tok/s"
            f"  TTFT {r['ttft_ms']:8.1f} ms  TPOT {r['tpot_ms']:7.1f} ms"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pdserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        load_format = "auto"
        if model is None:
            Path(tmp, "config.json").write_text(json.dumps(QWEN36_35B_A3B))
            model, load_format = tmp, "dummy"
        max_c = max(args.concurrency)
        llm = LLM(
            model,
            device=args.device,
            load_format=load_format,
            max_num_seqs=max_c,
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_batched_tokens=max(8192, args.prompt_len),
            enforce_eager=args.enforce_eager,
        )
        bench_one(llm, min(4, max_c), args.prompt_len, 8)  # warm-up: kernel compilation and autotuning
        results = []
        for c in args.concurrency:
            bench_one(llm, c, args.prompt_len, 4)  # this batch shape's kernels compiled first
            results.append(bench_one(llm, c, args.prompt_len, args.output_len))
            print(draw(results[-1:]), flush=True)
    print("\n" + draw(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.chart:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        title = f"Qwen3.6-35B-A3B shape, {args.prompt_len} -> {args.output_len} tokens, {device}"
        Path(args.chart).write_text(chart_svg(results, title))
    return 0
