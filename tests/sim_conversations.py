"""Issue 9's conversation workload on the tiny model, offline, to watch the prefix cache's
bookkeeping (not its speed): `python -m tests.sim_conversations MODEL_DIR --checkpoints 40
--host-entries 40`. C conversations of T turns as AIPerf sends them, scaled to the tiny model's
4,096 positions (a 1,024-word system prompt, 64-word messages, 64 output tokens), each turn one
packed `generate` of every conversation's prompt rendered by the router's chat template (which
drops earlier reasoning). Per turn: the cached share of the prompts, hits by source, checkpoints
saved, entries evicted and moved to the host tier. `--checkpoints` device checkpoints (40 fit an
80 GB H100 at the full shape, 128 are the H200's default) and a host tier of about
`--host-entries` entries of 2,048 tokens (the 4,096 MB default holds ~40 at the full shape).
"""

from __future__ import annotations

import argparse
import random

from pdserve import LLM, SamplingParams
from pdserve.engine.resume_points import resume_suffix
from pdserve.memory.host_tier import HostTier
from router.chat_template import render_chat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--checkpoints", type=int, default=40)
    parser.add_argument("--host-entries", type=int, default=40)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    llm = LLM(
        args.model, device="cpu", dtype="float32", max_model_len=4096, max_num_seqs=args.conversations,
        num_prefix_checkpoints=args.checkpoints, max_num_batched_tokens=8192, snapshot_pool_mb=0,
    )  # fmt: skip
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    cache, runner = engine.prefix_cache, engine.runner
    cache.configure_host_tier(args.host_entries * HostTier.entry_bytes(runner.kv_pool, runner.state_pool))
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "theta", "kappa", "sigma", "tau", "rho"]
    text = lambda n: " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(n // 2))  # noqa: E731
    system = {"role": "system", "content": text(1024)}
    conversations = [[system, {"role": "user", "content": text(64)}] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    host = cache.host.num_checkpoints if cache.host else 0
    print(f"{args.checkpoints} device checkpoints, {host} on the host")
    with cache.using_resume_suffixes([resume_suffix(tokenizer)]):
        for turn in range(args.turns):
            before = cache.stats.report()
            prompts = [tokenizer.encode(render_chat(tokenizer, c, True, None, None)) for c in conversations]
            outs = llm.generate(prompts, params)
            after = cache.stats.report()
            hits = {k: n - before["hit_requests"][k] for k, n in after["hit_requests"].items()}
            cached = sum(o.num_cached_tokens for o in outs) / sum(map(len, prompts))
            moved = {k: after[k] - before[k] for k in ("saved", "evicted", "demoted")}
            print(f"turn {turn + 1}: cached {cached:.1%}, hits {hits}, saved {moved['saved']}, "
                  f"evicted {moved['evicted']}, to host {moved['demoted']}")  # fmt: skip
            for c, o in zip(conversations, outs, strict=True):
                c += [
                    {"role": "assistant", "content": tokenizer.decode(o.token_ids)},
                    {"role": "user", "content": text(64)},
                ]


if __name__ == "__main__":
    main()
