"""`pdserve check`: packed prefill must equal each prompt alone, and chunked prefill the whole.

Prefills a set of prompts together (one packed pass), each alone, and chunked under a small
token budget, holding each request's memory (as the prefill service does for a transfer) so
the final GDN conv/recurrent states and KV pages can be read back; prints the largest relative
difference of the logits and of every state, and fails above the tolerance. Then the prefix
cache's checkpoints (the pack check): the same prompts, each ending with a generation prompt
whose start is a resume point, prefilled packed and one at a time with the cache on; every
checkpoint (its resume point mid-prompt, its end) must hold the same state either way. Run it
on a GPU after changing a kernel.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.prefix_index import CacheEntry
from pdserve.sampling.params import SamplingParams
from pdserve.sampling.sampler import SamplerOutput

STATE_KEYS = ("logits", "conv", "recurrent", "kv")
CHECKPOINT_KEYS = ("conv", "recurrent")
RESUME_SUFFIX_LEN = 8  # the pack check's generation prompt: a resume point 8 tokens before each end


@dataclass(slots=True)
class PrefillState:
    """What one prompt's prefill left behind: its first-token logits and its final states."""

    logits: torch.Tensor  # [vocab]
    conv: torch.Tensor  # [num_gdn_layers, conv_dim, kernel - 1]
    recurrent: torch.Tensor  # [num_gdn_layers, Hv, Dk, Dv]
    kv: torch.Tensor  # [num_attn_layers, 2, num_tokens, Hkv, D]
    passes: int  # forward passes the whole set took


def prefill_states(engine: LLMEngine, prompts: list[list[int]], token_budget: int) -> list[PrefillState]:
    """Prefill `prompts` together under `token_budget` tokens a pass; each one's logits and states."""
    saved_budget = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = token_budget
    seqs = []
    for p in prompts:
        seq = engine.make_sequence(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        seq.handoff = True  # held after its first token, memory kept
        engine.enqueue(seq)
        seqs.append(seq)
    logits, passes = {}, 0
    try:
        while engine.has_unfinished():
            scheduled = engine.scheduler.schedule()
            rows = engine.runner.execute(scheduled)
            sampling = [s.seq for s in scheduled if s.samples]
            for seq, row in zip(sampling, rows, strict=True):
                logits[seq.request_id] = _copy(row)
            for s in scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens
                engine.scheduler.reached_checkpoint(s)  # as the engine's step does
            engine.postprocess(sampling, SamplerOutput(token_ids=rows.argmax(dim=-1)))
            passes += 1
    finally:
        engine.scheduler.max_num_batched_tokens = saved_budget
    kv, states = engine.runner.kv_pool, engine.runner.state_pool
    results = []
    for seq in seqs:
        pages = torch.tensor(seq.block_table, device=kv.kv.device)
        results.append(
            PrefillState(
                logits=logits[seq.request_id],
                conv=_copy(states.conv[:, seq.state_slot]),
                recurrent=_copy(states.recurrent[:, seq.state_slot]),
                kv=_copy(kv.kv[:, :, pages].flatten(2, 3)[:, :, : seq.num_prompt_tokens]),
                passes=passes,
            )
        )
        engine.abort(seq.request_id)
    return results


def _copy(x: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy that outlives the pool slot it came from."""
    return x.to("cpu", torch.float32, copy=True)


def relative_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    """Max |x - y| over the largest magnitude of `y` (at least 1)."""
    return (x - y).abs().max().item() / max(1.0, y.abs().max().item())


def relative_differences(a: PrefillState, b: PrefillState) -> dict[str, float]:
    """`relative_difference` of each tensor of two prefills."""
    return {key: relative_difference(getattr(a, key), getattr(b, key)) for key in STATE_KEYS}


@dataclass(slots=True)
class Checkpoint:
    """A prefix-cache entry's GDN state, read back from its checkpoint slot."""

    kind: str
    num_tokens: int
    conv: torch.Tensor  # [num_gdn_layers, conv_dim, kernel - 1]
    recurrent: torch.Tensor  # [num_gdn_layers, Hv, Dk, Dv]


def checkpoint_states(
    engine: LLMEngine, prompts: list[list[int]], resume_suffix: tuple[int, ...], packed: bool
) -> dict[bytes, Checkpoint]:
    """Prefill `prompts` (each ending with `resume_suffix`, taken as a generation prompt: a
    resume point) with the prefix cache on, all at once (`packed`) or one at a time, from an
    empty cache; every checkpoint the cache then holds, by entry key."""
    cache = engine.prefix_cache
    if cache is None:
        raise ValueError("the checkpoint pack check needs the prefix cache on")
    cache.clear()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with cache.using_resume_suffixes([resume_suffix]):
        try:
            for batch in [prompts] if packed else [[p] for p in prompts]:
                for p in batch:
                    engine.add_request(p, params)
                while engine.has_unfinished():
                    engine.step()
            found = {e.key: read_checkpoint(engine, e) for e in cache.entries.values()}
        finally:
            cache.clear()
    return found


def read_checkpoint(engine: LLMEngine, entry: CacheEntry) -> Checkpoint:
    if entry.tier != "gpu":
        raise ValueError(f"checkpoint of {entry.num_tokens} tokens went to the host tier: use fewer prompts")
    states = engine.runner.state_pool
    conv, recurrent = states.conv[:, entry.checkpoint], states.recurrent[:, entry.checkpoint]
    return Checkpoint(entry.kind, entry.num_tokens, _copy(conv), _copy(recurrent))


def checkpoint_differences(
    packed: dict[bytes, Checkpoint], alone: dict[bytes, Checkpoint]
) -> dict[str, float]:
    """The largest relative difference of each state over checkpoints both runs took; a
    checkpoint that only one run took is a ValueError (packing moved where the cache saved)."""
    if packed.keys() != alone.keys():
        only = sorted(
            (c.kind, c.num_tokens)
            for k, c in {**packed, **alone}.items()
            if k not in packed.keys() & alone.keys()
        )
        raise ValueError(f"packed and alone took different checkpoints (kind, tokens): {only}")
    out = dict.fromkeys(CHECKPOINT_KEYS, 0.0)
    for key, a in alone.items():
        for name in CHECKPOINT_KEYS:
            out[name] = max(out[name], relative_difference(getattr(packed[key], name), getattr(a, name)))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 7, 63, 64, 65, 200])
    parser.add_argument("--chunk", type=int, default=24, help="token budget of the chunked run")
    parser.add_argument("--tolerance", type=float, default=1e-4)


def run(args: argparse.Namespace) -> int:
    from pdserve import LLM
    from pdserve.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    llm = LLM(
        model, device=args.device, dtype=args.dtype, max_model_len=max(args.lengths) + 16 + RESUME_SUFFIX_LEN
    )
    vocab = min(llm.engine.model_config.vocab_size, 200_000)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in args.lengths]
    packed = prefill_states(llm.engine, prompts, token_budget=sum(args.lengths))
    chunked = prefill_states(llm.engine, prompts, token_budget=args.chunk)
    worst = 0.0
    print(f"{'prompt':>8} {'check':>18} " + " ".join(f"{k:>10}" for k in STATE_KEYS))
    for prompt, together, in_chunks in zip(prompts, packed, chunked, strict=True):
        (alone,) = prefill_states(llm.engine, [prompt], token_budget=len(prompt))
        for name, got in (("packed vs alone", together), (f"chunked by {args.chunk}", in_chunks)):
            diffs = relative_differences(got, alone)
            worst = max(worst, *diffs.values())
            print(f"{len(prompt):>8} {name:>18} " + " ".join(f"{diffs[k]:>10.2e}" for k in STATE_KEYS))
    if llm.engine.prefix_cache is not None:
        suffix = tuple(torch.randint(0, vocab, (RESUME_SUFFIX_LEN,), generator=gen).tolist())
        with_suffix = [p + list(suffix) for p in prompts]
        alone = checkpoint_states(llm.engine, with_suffix, suffix, packed=False)
        diffs = checkpoint_differences(checkpoint_states(llm.engine, with_suffix, suffix, packed=True), alone)
        worst = max(worst, *diffs.values())
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(c.kind for c in alone.values()).items()))
        print(f"{len(alone)} checkpoints packed vs alone ({kinds}):")
        print(
            f"{'all':>8} {'checkpoints':>18} "
            + " ".join(f"{diffs[k]:>10.2e}" if k in diffs else f"{'-':>10}" for k in STATE_KEYS)
        )
    ok = worst <= args.tolerance
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: largest relative difference {worst:.2e} (tolerance {args.tolerance:.0e})")
    return 0 if ok else 1
