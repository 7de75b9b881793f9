"""The routed-expert grouped GEMMs of a prefill pass with the weights read by the Hopper's tensor
memory accelerator (TMA): a candidate for `pdserve.ops.cuda_moe`'s compute-bound passes, where the
pointer-load kernel runs at 34-39% of bf16 peak (docs/benchmarks.md, sessions 11 and 20).

Same semantics and row layout as `cuda_moe._moe_gemm_kernel` (padded rows by expert, a block's
expert read off its first pair, the grouped launch order); what differs is how tiles reach shared
memory:
  - the expert weights through a TMA descriptor over the stack viewed as 2-D ([E * rows, K]): one
    bulk copy a tile, no per-thread address arithmetic, and the copies run ahead of the tensor
    cores by `num_stages`;
  - the rows: the down GEMM's (the intermediate, already by padded row) through a descriptor too;
    the gate/up GEMM's either gathered by pointer loads from x (`a_tma=False`) or first gathered
    into a padded-row copy of x that a descriptor then reads (`a_tma=True`: one more pass over
    the rows, ~T x 8 x 4 KiB);
  - `wide`: gate and up tiles of one column block in one [2, BLOCK_N, BLOCK_K] copy and one dot
    (the stack viewed as [E * 2, I, H]), else two copies and two dots.
Measured (`python -m pdserve.ops.bench_moe_tiles --tma 8192 4 32`, H100, session 27): at 8,192
tokens the best variant (rows by pointer, one wide dot, 3 stages) took 1,292 us against the pointer
kernel's 1,329 (-2.8%, 319 TFLOP/s: the pointer kernel is already pipelined, cp.async in 3
stages, at the runtime's divisibility); the padded-row copy of x costs more than it saves
(1,491 us); at 4 tokens every TMA tile is slower (164-366 us against 100), at 32 level. So it
stays off (`cuda_moe.TMA_FROM_PAIRS` = 0): the grouped GEMM's loss is elsewhere (its tiles' padding
rows, the down GEMM's short K), not in how tiles reach shared memory. Triton's interpreter runs it
on the CPU (tests/triton_interpreted.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@dataclass(frozen=True)
class TmaOptions:
    a_tma: bool = False  # gate/up: rows gathered into a padded copy read by TMA (else pointer loads)
    wide: bool = False  # gate/up: one [2, BLOCK_N, BLOCK_K] weight copy and one dot a step


@triton.jit
def _block_coords(pid, num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: GROUP_M row blocks across every column block
    before the next GROUP_M (0: every row block of a column block first), as cuda_moe's kernel."""
    num_n = tl.cdiv(N, BLOCK_N)
    if GROUP_M == 0:
        return pid % num_blocks, pid // num_blocks
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    in_group = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + pid % (GROUP_M * num_n) % in_group, pid % (GROUP_M * num_n) // in_group


@triton.jit(do_not_specialize=["num_blocks"])
def _gate_up_tma_kernel(
    x_ptr, a_desc, w_desc, w3_desc, c_ptr, pair_ptr, ids_ptr,
    N, K, stride_xm, stride_cm, top_k, num_blocks,
    A_TMA: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[row, n] = silu(x_row . W_gate[n]) * (x_row . W_up[n]) for one block of padded rows (one
    expert's) x BLOCK_N columns; rows of padding are computed on zeros and not stored."""
    pid_m, pid_n = _block_coords(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    first = tl.load(pair_ptr + pid_m * BLOCK_M)
    if first < 0:
        return
    expert = tl.load(ids_ptr + first).to(tl.int32)  # TMA coordinates are 32-bit
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + offs_p)
    valid = pairs >= 0
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tl.where(valid, pairs // top_k, 0).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    gate_row = expert * 2 * N + pid_n * BLOCK_N
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k + k0 < K)[None, :], other=0.0)
            a_ptrs += BLOCK_K
        if WIDE:  # planes 2e (gate) and 2e + 1 (up) of the stack viewed as [E * 2, N, K]
            w = w3_desc.load([expert * 2, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc)
        else:
            acc_g = tl.dot(a, w_desc.load([gate_row, k0]).T, acc_g)
            acc_u = tl.dot(a, w_desc.load([gate_row + N, k0]).T, acc_u)
    if WIDE:
        acc_g, acc_u = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
    # round gate and up to the activation dtype first, as the unfused F.linear calls do
    gate = acc_g.to(c_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(c_ptr.dtype.element_ty).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_p.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["num_blocks"])
def _down_tma_kernel(
    a_desc, w_desc, c_ptr, pair_ptr, ids_ptr, weight_ptr, N, K, stride_cm, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[pair, n] = weight[pair] * (h_row . W_down[n]) for one block of padded rows x BLOCK_N
    columns, stored by pair."""
    pid_m, pid_n = _block_coords(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    first = tl.load(pair_ptr + pid_m * BLOCK_M)
    if first < 0:
        return
    expert = tl.load(ids_ptr + first).to(tl.int32)
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + offs_p)
    valid = pairs >= 0
    w_row = expert * N + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([w_row, k0]).T, acc)
    out = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_rows = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n < N)[None, :])  # fmt: skip


def tma_gemms(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    pair_of_row: torch.Tensor,
    cfg: dict[str, int],
    cfg_down: dict[str, int],
    options: TmaOptions,
) -> torch.Tensor:
    """Both grouped GEMMs over the aligned rows (`cuda_moe.fused_moe_triton`'s inputs, contiguous;
    `weights` flat): the weighted down rows of each pair, [T * K, H]."""
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w2.shape[0], w2.shape[2], ids.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if inter % bn or hidden % cfg_down["BLOCK_N"]:
        raise ValueError(f"tma_gemms: widths {inter}, {hidden} are not multiples of the tiles' BLOCK_N")
    rows, num_blocks = pair_of_row.shape[0], pair_of_row.shape[0] // bm
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    w_desc = TensorDescriptor.from_tensor(w13.view(num_experts * 2 * inter, hidden), [bn, bk])
    a_desc = w_desc  # unread unless a_tma: then the rows of x each padded row reads (padding: row 0)
    if options.a_tma:
        a_desc = TensorDescriptor.from_tensor(x.index_select(0, pair_of_row.clamp(min=0) // top_k), [bm, bk])
    w3_desc = TensorDescriptor.from_tensor(w13.view(num_experts * 2, inter, hidden), [2, bn, bk])
    hidden_act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    _gate_up_tma_kernel[(num_blocks * (inter // bn),)](
        x, a_desc, w_desc, w3_desc, hidden_act, pair_of_row, ids,
        inter, hidden, x.stride(0), hidden_act.stride(0), top_k, num_blocks,
        A_TMA=options.a_tma, WIDE=options.wide, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"], **launch,
    )  # fmt: skip
    bn_down, bk_down = cfg_down["BLOCK_N"], cfg_down["BLOCK_K"]
    h_desc = TensorDescriptor.from_tensor(hidden_act, [bm, bk_down])
    w2_desc = TensorDescriptor.from_tensor(w2.view(num_experts * hidden, inter), [bn_down, bk_down])
    per_pair = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _down_tma_kernel[(num_blocks * (hidden // bn_down),)](
        h_desc, w2_desc, per_pair, pair_of_row, ids, weights, hidden, inter, per_pair.stride(0), num_blocks,
        BLOCK_M=bm, BLOCK_N=bn_down, BLOCK_K=bk_down, GROUP_M=cfg_down["GROUP_M"],
        num_warps=cfg_down["num_warps"], num_stages=cfg_down["num_stages"],
    )  # fmt: skip
    return per_pair
