"""Routed-expert MoE: `fused_moe` checks its inputs and runs the CUDA kernels of
`pdserve.ops.cuda_moe` on a CUDA device (imported on first use), the reference loop below elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """Sum over each token's top-k experts of `weight * down(silu(gate(x)) * up(x))`.

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I];
    topk_weights: [T, K] (x's dtype); topk_ids: [T, K] int64. Returns [T, H]; with reduce=False the
    K weighted expert rows of each token, [T, K, H] in x's dtype, unsummed (the caller sums them in
    fp32, as `pdserve.ops.add_rms_norm` does).
    """
    _check_experts(x, w13, w2)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError("topk_ids and topk_weights must both be [T, K]")
    if x.is_cuda:
        from pdserve.ops.cuda_moe import fused_moe as fused_moe_cuda

        return fused_moe_cuda(x, w13, w2, topk_weights, topk_ids, reduce)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, reduce)


def routed_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_experts: int,
    top_k: int,
    reduce: bool = True,
) -> torch.Tensor:
    """`pdserve.ops.route_topk` of router_logits, then `fused_moe` over the chosen experts: with
    logits [T, E + 1] the shared expert is expert E of w13 / w2 ([E + 1, ...]), gated by its sigmoid.
    The logits may come as fp32 split-K partial sums [T, S, E (+ 1)] (`pdserve.ops.linear.router_logits`),
    added as a product in x's dtype would be. On CUDA a decode step's routing and row layout may be
    one launch."""
    from pdserve import ops

    num_columns = router_logits.shape[-1]
    if router_logits.dim() not in (2, 3) or router_logits.shape[0] != x.shape[0]:
        raise ValueError(f"routed_moe: router_logits {tuple(router_logits.shape)} for x {tuple(x.shape)}")
    if num_columns not in (num_experts, num_experts + 1) or not 0 < top_k <= num_experts:
        raise ValueError(f"routed_moe: logits of {num_columns} for {num_experts} experts and top_k={top_k}")
    if w13.shape[0] != num_columns:
        raise ValueError(f"routed_moe: {w13.shape[0]} experts' weights for logits of {num_columns}")
    _check_experts(x, w13, w2)
    if x.is_cuda:
        from pdserve.ops.cuda_moe import routed_experts

        return routed_experts(x, router_logits, w13, w2, num_experts, top_k, reduce)
    if router_logits.dim() == 3:
        router_logits = router_logits.sum(dim=1).to(x.dtype)
    weights, ids = ops.route_topk(router_logits, num_experts, top_k)
    return fused_moe_reference(x, w13, w2, weights, ids, reduce)  # checked above


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_moe wants x [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    if w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or 2 * w2.shape[2] != w13.shape[1]:
        raise ValueError(
            f"fused_moe shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    reduce: bool = True,
) -> torch.Tensor:
    """The reference of `fused_moe`: a loop over experts in plain torch (one host sync for the counts)."""
    num_tokens, top_k = topk_ids.shape
    per_pair = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    weight_of = topk_weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        gate, up = F.linear(x[pairs // top_k], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weight_of[start : start + count, None]
        per_pair[pairs] = y.to(x.dtype)
        start += count
    per_pair = per_pair.view(num_tokens, top_k, -1)
    return per_pair.sum(dim=1, dtype=torch.float32).to(x.dtype) if reduce else per_pair
