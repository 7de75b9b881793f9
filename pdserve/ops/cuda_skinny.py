"""A decode-sized linear layer, whole or as split-K partial sums: `skinny_linear(x, w, splits)`.

At 4-32 tokens a decode step's dense GEMMs read a weight of 17-50 MB for a handful of rows:
cuBLAS runs them at 40-68% of the H200's bandwidth (bench_step, session 13/14: in_proj 14.5 us
for a 10.5 us read, out_proj split-K 7.2 us + a 1.7 us reduce for a 3.5 us read). Here each program
streams a [BLOCK_N, K / splits] slab of the weight once for all rows and writes its fp32 partial
sums; the caller adds the `splits` partials (the next `add_rms_norm` already sums the MoE's rows in
fp32 the same way), so there is no reduce launch. `pdserve.ops.linear` uses it up to
`SKINNY_UP_TO` tokens: 0 (cuBLAS everywhere) until `python -m pdserve.ops.bench_skinny` and
`bench_step --skinny-up-to` have timed it on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_split, stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Columns pid_n * BLOCK_N.. of split pid_s: out[:, pid_s, cols] = x[:, ks] @ w[cols, ks]^T (fp32
    inside, stored in out's dtype)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_s * k_split, tl.minimum((pid_s + 1) * k_split, K), BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a_mask, w_mask = mask_m[:, None] & mask_k[None, :], mask_n[:, None] & mask_k[None, :]
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=a_mask, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    out = out_ptr + offs_m[:, None] * stride_om + pid_s * stride_os + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: int,
    block_n: int = 64,
    block_k: int = 128,
    warps: int = 4,
) -> torch.Tensor:
    """x [M, K] (M <= 64), weight [N, K] (last dims contiguous) -> with one split, x @ weight^T
    [M, N] in x's dtype (F.linear's result up to summation order); with more, the fp32 partial sums
    [M, splits, N] (their sum over dim 1 is x @ weight^T)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > 64 or weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1 or splits < 1:
        shapes = f"x {tuple(x.shape)} (at most 64 rows), weight {tuple(weight.shape)}, {splits} splits"
        raise ValueError(f"skinny_linear: {shapes}, last dims contiguous")
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    if splits == 1:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
        stride_om, stride_os = out.stride(0), 0
    else:
        out = torch.empty(num_rows, splits, n, dtype=torch.float32, device=x.device)
        stride_om, stride_os = out.stride(0), out.stride(1)
    if num_rows == 0:
        return out
    _skinny_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, out, num_rows, n, k, k_split, x.stride(0), weight.stride(0), stride_om, stride_os,
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip
    return out
