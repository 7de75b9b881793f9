"""RMSNorms on CUDA, one Triton launch each: the zero-centred norm with the residual add folded in
(and the MoE's per-expert rows summed on the way), the GDN's gated norm, and the l2 norm of its
prefill's q and k.

Semantics are those of `pdserve.ops.layer_ops`; fp32 inside, one rounding per stored tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    parts_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_pt, stride_pp, stride_rt, stride_ot, stride_rot, D, eps,
    NUM_PARTS: tl.constexpr, SUM_ROUNDS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row t: x = sum of NUM_PARTS rows (rounded to the activation dtype when SUM_ROUNDS);
    with a residual, x = round(residual + x) is stored as the new residual; out = x / rms(x) * (1 + w)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(NUM_PARTS):
        x += tl.load(parts_ptr + t * stride_pt + p * stride_pp + offs, mask=mask, other=0.0).to(tl.float32)
    if SUM_ROUNDS:
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + t * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_rot + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (x * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)


def _row_launch(dim: int) -> dict[str, int]:
    block = triton.next_power_of_2(dim)
    return dict(BLOCK=block, num_warps=max(1, min(8, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] (rows contiguous) -> [T, D] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _add_rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, out, x.stride(0), 0, 0, out.stride(0), 0, x.shape[1], eps,
        NUM_PARTS=1, SUM_ROUNDS=False, HAS_RESIDUAL=False, **_row_launch(x.shape[1]),
    )  # fmt: skip
    return out


def add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [T, D] or [T, P, D]; residual [T, D] -> (normed, new residual), both [T, D] in residual's
    dtype; one read of every part and of the residual, one write of each output."""
    parts3 = parts if parts.dim() == 3 else parts[:, None]
    if parts3.stride(-1) != 1:
        parts3 = parts3.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    num_tokens, dim = residual.shape
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    new_residual = torch.empty_like(out)
    if num_tokens == 0:
        return out, new_residual
    _add_rms_norm_kernel[(num_tokens,)](
        parts3, residual, weight, out, new_residual,
        parts3.stride(0), parts3.stride(1), residual.stride(0), out.stride(0), new_residual.stride(0),
        dim, eps,
        NUM_PARTS=parts3.shape[1], SUM_ROUNDS=parts3.shape[1] > 1 or parts3.dtype != residual.dtype,
        HAS_RESIDUAL=True, **_row_launch(dim),
    )  # fmt: skip
    return out, new_residual


@triton.jit
def _head_rows(stride_t, stride_h, num_rows, H, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS (token, head) rows of D: (their offsets in a [T, H, D] tensor of the
    given strides, their offsets in a contiguous [T * H, D] one, the mask of both)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = (rows // H).to(tl.int64)
    h = (rows % H).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < D)[None, :]
    return (
        (t * stride_t + h * stride_h)[:, None] + offs[None, :],
        (rows.to(tl.int64) * D)[:, None] + offs[None, :],
        mask,
    )


def _head_rows_launch(num_rows: int, dim: int) -> tuple[tuple[int], dict[str, int]]:
    """The grid and launch settings of a `_head_rows` kernel: up to 16 rows a program, 4 warps."""
    block = triton.next_power_of_2(dim)
    rows = max(1, min(16, 2048 // block))
    return (triton.cdiv(num_rows, rows),), dict(ROWS=rows, BLOCK=block, num_warps=4)


@triton.jit(do_not_specialize=["num_rows"])  # one build for every pass size
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    stride_xt, stride_xh, stride_zt, stride_zh, num_rows, H, D, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """ROWS (token, head) rows of D: out = round(w * round(x / rms(x))) * silu(z), rounded where
    transformers' gated norm rounds; out is [T * H, D] contiguous."""
    src, dst, mask = _head_rows(stride_xt, stride_xh, num_rows, H, D, ROWS, BLOCK)
    x = tl.load(x_ptr + src, mask=mask, other=0.0)
    w_offs = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + w_offs, mask=w_offs < D, other=0.0).to(tl.float32)
    z_src = _head_rows(stride_zt, stride_zh, num_rows, H, D, ROWS, BLOCK)[0]
    z = tl.load(z_ptr + z_src, mask=mask, other=0.0)
    tl.store(out_ptr + dst, gated_norm_values(x, z, w, D, eps).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_norm_values(x, z, w, D, eps):
    """Over x's last axis (D values, padding zero): round(w * round(x / rms(x))) * silu(z), fp32,
    rounded to x's dtype where transformers' gated norm rounds; x, z as stored, w fp32."""
    xf = x.to(tl.float32)
    return gated_norm_scaled(x, z, w, tl.rsqrt(tl.sum(xf * xf, axis=-1, keep_dims=True) / D + eps))


@triton.jit
def gated_norm_scaled(x, z, w, rstd):
    """`gated_norm_values` with 1 / rms(x) given (a row normed a block at a time)."""
    xf = x.to(tl.float32)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    scaled = (w * normed).to(x.dtype).to(tl.float32)
    zf = z.to(tl.float32)
    return scaled * (zf * tl.sigmoid(zf))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [T, H, D] (last dim contiguous, any row/head strides); weight [D] -> [T, H * D]."""
    x, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate))
    num_tokens, num_heads, dim = x.shape
    out = torch.empty(num_tokens, num_heads * dim, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    grid, meta = _head_rows_launch(num_rows, dim)
    _gated_rms_norm_kernel[grid](
        x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
        num_rows, num_heads, dim, eps, **meta,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _l2_normalize_kernel(
    x_ptr, out_ptr, stride_xt, stride_xh, num_rows, H, D, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """ROWS (token, head) rows of D: out = x / sqrt(sum(x^2) + eps) in fp32, rounded once; out is
    [T * H, D] contiguous. fla's l2norm_fwd, without its autotuner."""
    src, dst, mask = _head_rows(stride_xt, stride_xh, num_rows, H, D, ROWS, BLOCK)
    x = tl.load(x_ptr + src, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(xf * xf, axis=1) + eps)
    tl.store(out_ptr + dst, (xf * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def l2_normalize(x: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous, any row/head strides) -> [T, H, D] contiguous in `dtype`,
    each row over its norm. One launch and one config for every T: fla's own l2norm autotunes 25
    configs for each new bucket of T * H // 65,536 (7.5 s of a step under traffic on the H200)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, dim = x.shape
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    grid, meta = _head_rows_launch(num_rows, dim)
    _l2_normalize_kernel[grid](x, out, x.stride(0), x.stride(1), num_rows, num_heads, dim, eps, **meta)
    return out
