"""The decode kernels' switches that a `pdserve.ops.bench_step` run or variant sets, and the
variants' comparisons: their logits against the first variant's, and their step times measured in
interleaved rounds.

A variant's graphs are captured with its switches (they are read at capture), so the variants'
graphs can live side by side and be timed in turn. Timed one after another, in one call, the first
variant ran fastest in both orders (H100, session 34: plain 5.61 then router 5.77 ms; router 5.57
then plain 5.85): `interleaved_times` rotates which variant goes first each round and keeps each
one's median, so a switch worth 1-2% of a step can be told from the drift.
"""

from __future__ import annotations

import statistics

import torch

from pdserve.engine.cuda_graphs import DecodeGraphs


def set_switches(
    route_align_up_to: int | None,
    gdn_fused_max_batch: int | None,
    gdn_v_split: int | None = None,
    gdn_warps: int | None = None,
) -> None:
    """Override the decode kernels' measured switches (only those given: an older checkout lacks them)."""
    if route_align_up_to is not None:
        from pdserve.ops import cuda_moe, cuda_route_align

        if not 0 <= route_align_up_to <= cuda_route_align.ROUTE_ALIGN_TOKENS:
            raise ValueError(f"--route-align-up-to: 0 to {cuda_route_align.ROUTE_ALIGN_TOKENS}")
        cuda_moe.ROUTE_ALIGN_UP_TO = route_align_up_to
    if gdn_fused_max_batch is not None:
        from pdserve.ops import gdn_decode

        gdn_decode.FUSED_MAX_BATCH = gdn_fused_max_batch
    if gdn_v_split is not None or gdn_warps is not None:
        from pdserve.ops import cuda_gdn_decode

        cuda_gdn_decode.V_SPLIT = gdn_v_split or cuda_gdn_decode.V_SPLIT
        cuda_gdn_decode.NUM_WARPS = gdn_warps or cuda_gdn_decode.NUM_WARPS


def set_skinny(up_to: int | None, splits: int | None, router_up_to: int | None = None) -> None:
    """Override `pdserve.ops.linear`'s switches (only those given)."""
    from pdserve.ops import linear

    linear.SKINNY_UP_TO = linear.SKINNY_UP_TO if up_to is None else up_to
    linear.SKINNY_SPLITS = linear.SKINNY_SPLITS if splits is None else splits
    linear.ROUTER_UP_TO = linear.ROUTER_UP_TO if router_up_to is None else router_up_to


VARIANT_KEYS = {
    "route": "route_align_up_to",
    "gdn": "gdn_fused_max_batch",
    "gsplit": "gdn_v_split",
    "gwarps": "gdn_warps",
    "skinny": "up_to",
    "splits": "splits",
    "router": "router_up_to",
}


def parse_variant(spec: str) -> tuple[str, dict[str, int]]:
    """'name:route=32,skinny=16' -> ('name', {'route_align_up_to': 32, 'up_to': 16})."""
    name, _, body = spec.partition(":")
    values = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS or not value.isdigit():
            raise ValueError(f"--variants {spec!r}: expected key=int with keys {sorted(VARIANT_KEYS)}")
        values[VARIANT_KEYS[key]] = int(value)
    return name, values


def current_switches() -> dict[str, int]:
    from pdserve.ops import cuda_gdn_decode, cuda_moe, gdn_decode, linear

    return {
        "route_align_up_to": cuda_moe.ROUTE_ALIGN_UP_TO,
        "gdn_fused_max_batch": gdn_decode.FUSED_MAX_BATCH,
        "gdn_v_split": cuda_gdn_decode.V_SPLIT,
        "gdn_warps": cuda_gdn_decode.NUM_WARPS,
        "up_to": linear.SKINNY_UP_TO,
        "splits": linear.SKINNY_SPLITS,
        "router_up_to": linear.ROUTER_UP_TO,
    }


def apply_variant(base: dict[str, int], values: dict[str, int]) -> None:
    """The run's switches (`base`) with the variant's own values over them."""
    merged = base | values
    set_switches(
        merged["route_align_up_to"], merged["gdn_fused_max_batch"], merged["gdn_v_split"], merged["gdn_warps"]
    )
    set_skinny(merged["up_to"], merged["splits"], merged["router_up_to"])


def compare_logits(logits: dict, tags: list[str], sizes: list[int]) -> None:
    """Each variant's logits against the first's: relative L2 error and greedy-token agreement."""
    base = tags[0]
    for tag in tags[1:]:
        for c in sizes:
            a, b = logits[tag, c], logits[base, c]
            rel = ((a - b).norm() / b.norm()).item()
            same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            print(f"[{tag} vs {base}] c={c}: logits rel. error {rel:.2e}, same greedy token {same:.0%}")


def interleaved_times(
    graphs: dict[str, DecodeGraphs], sizes: list[int], rounds: int, steps: int = 20
) -> list[dict]:
    """Each variant's GPU ms a step at each size (CUDA events around `steps` back-to-back replays),
    in `rounds` rounds, the variants in a rotated order each round; prints each one's median and its
    difference from the first variant's, and returns them with every round's time."""
    tags = list(graphs)
    times: dict[tuple[str, int], list[float]] = {(tag, c): [] for tag in tags for c in sizes}
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(rounds):
        for tag in tags[r % len(tags) :] + tags[: r % len(tags)]:
            for c in sizes:
                graph = graphs[tag].graphs[c]
                graph.replay()
                begin.record()
                for _ in range(steps):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                times[tag, c].append(begin.elapsed_time(end) / steps)
    rows = []
    for c in sizes:
        first = statistics.median(times[tags[0], c])
        for tag in tags:
            median, spread = statistics.median(times[tag, c]), max(times[tag, c]) - min(times[tag, c])
            print(f"[interleaved, {rounds} rounds] c={c} {tag}: GPU {median:.3f} ms/step "
                  f"(spread {spread:.3f}), {100 * (median / first - 1):+.1f}% vs {tags[0]}")  # fmt: skip
            rows.append(
                {"tag": tag, "concurrency": c, "interleaved_gpu_ms": median, "rounds_ms": times[tag, c]}
            )
    return rows
