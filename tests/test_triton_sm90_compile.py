"""pdserve's Triton kernels build for the H200 (sm90) on a machine without a GPU.

The interpreter checks (tests/test_triton_interpreted.py) run a kernel's semantics on the CPU, one
thread, without compiling it; a kernel can pass them and still fail to compile for the GPU (a
shape the compiler rejects, a dtype mismatch, too much shared memory). Triton compiles for a given
target without a device: here to PTX and a cubin for sm90, with the constexprs and warps the engine
uses (divisibility hints aside: the runtime's builds may vectorise loads these do not).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.ops import (  # noqa: E402
    cuda_conv,
    cuda_gdn,
    cuda_gdn_decode,
    cuda_gdn_recurrent,
    cuda_layers,
    cuda_moe,
    cuda_norms,
    cuda_prefill_attention,
    cuda_route,
    cuda_route_align,
    cuda_skinny,
)

ROUTES = {"logits_ptr": "*bf16", "weights_ptr": "*bf16", "ids_ptr": "*i64"}
ROUTE_K = {"TOP_K": 8, "OUT_K": 9, "HAS_SHARED": True, "E_PAD": 256, "K_PAD": 16}
ALIGN = {"ids_ptr": "*i64", "pair_of_row_ptr": "*i64", "scratch_ptr": "*i32"}
MOE_ARGS = "N K stride_am stride_we stride_wn stride_cm top_k num_blocks".split()
MOE = {"a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "pair_ptr": "*i64", "ids_ptr": "*i64",
       "weight_ptr": "*bf16", **dict.fromkeys(MOE_ARGS, "i32")}  # fmt: skip


def moe_tile(num_pairs: int, num_experts: int) -> dict:
    """The MoE GEMM's tile constexprs the engine picks for a pass (its warps and stages aside)."""
    tile = cuda_moe._block_config(num_pairs, num_experts)
    return {k: v for k, v in tile.items() if not k.startswith("num_")}


KERNELS = {
    "moe_gate_up_prefill": (
        cuda_moe._moe_gemm_kernel,
        MOE,
        {"GATE_UP": True, **moe_tile(1 << 20, 256), "IEEE": False},
        8,
    ),
    **{
        f"moe_{'gate_up' if gate_up else 'down'}_prefill_tiers{tiers}": (
            cuda_moe._moe_gemm_kernel,
            MOE,
            {"GATE_UP": gate_up, **moe_tile(1 << 20, 256), "TIERS": tiers, "IEEE": False},
            8,
        )
        for gate_up in (True, False)
        for tiers in (1, 2)
    },
    "moe_down_decode": (
        cuda_moe._moe_gemm_kernel,
        MOE,
        {"GATE_UP": False, **moe_tile(36, 257), "IEEE": False},
        4,
    ),
    **{
        f"route_topk_splits{splits}": (
            cuda_route._route_topk_kernel,
            {**ROUTES, "logits_ptr": "*bf16" if splits == 1 else "*fp32",
             **dict.fromkeys(["stride_lt", "stride_ls", "E", "SHARED_ID"], "i32")},
            {**ROUTE_K, "SPLITS": splits},
            2,
        )
        for splits in (1, 4)
    },
    "route_align": (
        cuda_route_align._route_align_kernel,
        {**ROUTES, "pair_of_row_ptr": "*i64", "scratch_ptr": "*i32", "stride_lt": "i32", "stride_ls": "i32",
         "num_tokens": "i32", "num_rows": "i32", "E": "i32", "num_aligned": "i32"},
        {**ROUTE_K, "T_PAD": 32, "BLOCK_M": 16, "P_PAD": 512, "A_PAD": 512, "FILL": 1024, "SPLITS": 4},
        8,
    ),
    "align_pairs": (
        cuda_route._align_pairs_kernel,
        {**ALIGN, "num_pairs": "i32", "num_rows": "i32", "E": "i32"},
        {"BLOCK_M": 64, "P_PAD": 8192, "E_PAD": 512, "FILL": 1024},
        8,
    ),
    "chunk_scatter": (
        cuda_route._chunk_scatter_kernel,
        {"ids_ptr": "*i64", "counts_ptr": "*i32", "pair_of_row_ptr": "*i64", "scratch_ptr": "*i32",
         "num_pairs": "i32", "num_chunks": "i32", "E": "i32"},
        {"BLOCK_M": 128, "CHUNK": cuda_route.align_chunk(1 << 20), "E_PAD": 512, "ROWS": 16},
        8,
    ),
    "chunk_counts": (
        cuda_route._chunk_counts_kernel,
        {"ids_ptr": "*i64", "counts_ptr": "*i32", "pair_of_row_ptr": "*i64", "num_pairs": "i32",
         "num_rows": "i32", "E": "i32"},
        {"CHUNK": cuda_route.align_chunk(1 << 20), "E_PAD": 512, "FILL": 1024},
        8,
    ),
    "gdn_gates": (
        cuda_layers._gdn_gates_kernel,
        {"a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*fp32", "dt_bias_ptr": "*bf16", "g_ptr": "*fp32",
         "beta_ptr": "*bf16", "stride_at": "i32", "stride_bt": "i32", "T": "i32", "HV": "i32"},
        {"BT": 64, "BH": 32},
        4,
    ),
    "gated_rms_norm": (
        cuda_norms._gated_rms_norm_kernel,
        {"x_ptr": "*bf16", "z_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
         **dict.fromkeys(["stride_xt", "stride_xh", "stride_zt", "stride_zh", "num_rows", "H", "D"], "i32"),
         "eps": "fp32"},
        {"ROWS": 16, "BLOCK": 128},
        4,
    ),
    "gdn_step": (
        cuda_gdn._gdn_step_kernel,
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
         "state_ptr": "*fp32", "slot_ptr": "*i64", "o_ptr": "*bf16",
         **{f"stride_{x}": "i32" for x in "qb qh kb kh vb vh gb betab ss sh ob oh".split()},
         "scale": "fp32", "eps": "fp32"},
        {"HV": 32, "GROUP": 2, "DK": 128, "DV": 128, "BK": 128, "BV": 64},
        4,
    ),
    **{
        f"gdn_segments{'_saving' if saves else ''}{'_prefetch' if prefetch else ''}": (
            cuda_gdn_recurrent._gdn_segments_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
             "state_ptr": "*fp32", "slot_ptr": "*i64", "cu_ptr": "*i32", "o_ptr": "*bf16",
             "save_at_ptr": "*i32" if saves else "*i64", "save_to_ptr": "*i64",
             **{f"stride_{x}": "i32" for x in "qt qh kt kh vt vh gt betat ss sh ot oh".split()},
             "scale": "fp32", "eps": "fp32"},
            {"HV": 32, "GROUP": 2, "DK": 128, "DV": 128, "BK": 128, "BV": 32, "SAVES": saves,
             "PREFETCH": prefetch},
            4,
        )
        for saves in (False, True)
        for prefetch in (False, True)
    },
    **{
        f"conv_history{'_saving' if save else ''}": (
            cuda_conv._conv_history_kernel,
            {"x_ptr": "*bf16", "pool_ptr": "*bf16", "slot_ptr": "*i64", "cu_ptr": "*i32",
             "save_at_ptr": "*i32" if save else "*i64", "save_to_ptr": "*i64",
             **dict.fromkeys(["C", "stride_xt", "stride_ps"], "i32")},
            {"HIST": 3, "H_PAD": 4, "BC": 256, "SAVE": save},
            4,
        )
        for save in (False, True)
    },
    "prefill_gqa_persistent": (
        cuda_prefill_attention._prefill_gqa_kernel,
        {**dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "o_ptr"], "*bf16"), "table_ptr": "*i32",
         "seq_lens_ptr": "*i32", "cu_q_ptr": "*i32",
         **dict.fromkeys("stride_qt stride_qh stride_kp stride_ks stride_kh stride_table stride_ot "
                         "stride_oh".split(), "i32"),
         "qk_scale": "fp32", "num_tiles": "i32", "tiles_per_seq": "i32", "num_seqs": "i32"},
        {"PERSISTENT": True, "GROUP": 8, "TOKENS": 16, "D": 256, "PAGE": 16, "BLOCK_M": 128, "BLOCK_N": 64,
         "IEEE": False},
        8,
    ),
    "skinny": (
        cuda_skinny._skinny_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32",
         **dict.fromkeys("M N K k_split stride_xm stride_wn stride_om stride_os".split(), "i32")},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "IEEE": False},
        4,
    ),
    "gates_step_norm": (
        cuda_gdn_decode._gates_step_norm_kernel,
        {"m_ptr": "*bf16", "z_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "a_log_ptr": "*fp32",
         "dt_bias_ptr": "*bf16", "state_ptr": "*fp32", "slot_ptr": "*i64", "norm_w_ptr": "*bf16",
         "out_ptr": "*bf16", **dict.fromkeys(["stride_mb", "stride_zb", "stride_zh", "stride_ab", "stride_bb",
         "stride_ss", "stride_sh", "key_dim"], "i32"), "scale": "fp32", "l2_eps": "fp32", "norm_eps": "fp32"},
        {"HV": 32, "GROUP": 2, "DK": 128, "DV": 128, "BK": 128, "BV": 128, "V_SPLIT": 1},
        8,
    ),
}  # fmt: skip
# the router's split-K partials (`pdserve.ops.linear.router_logits`): 16 columns a program
_kernel, _args, _tile, _warps = KERNELS["skinny"]
KERNELS["skinny_router"] = (_kernel, _args, {**_tile, "BLOCK_N": 16}, _warps)
# the same program with its state tile in 4 blocks of 32 value columns (a bench_step variant)
_kernel, _args, _tile, _ = KERNELS["gates_step_norm"]
KERNELS["gates_step_norm_split4"] = (_kernel, _args, {**_tile, "BV": 32, "V_SPLIT": 4}, 4)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_sm90(name: str) -> None:
    kernel, signature, constexprs, num_warps = KERNELS[name]
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    assert list(signature) == kernel.arg_names, "the signature above lags the kernel's arguments"
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},  # as the engine launches it
    )
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
