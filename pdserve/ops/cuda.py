"""The CUDA implementation of the ops: the same seven functions as `pdserve.ops.reference`.

`pdserve.ops.dispatch.implementation` returns this module for tensors on a CUDA device. It needs Triton
(shipped with CUDA builds of torch) and, for the GDN prefill, flash-linear-attention (`fla-core`),
imported on first use. Every decode-path op here is sync-free, so a decode step can be captured
in a CUDA graph.

| op | implementation |
|---|---|
| `gdn_chunk_prefill` | fla `chunk_gated_delta_rule` (varlen, grouped value heads, l2norm in kernel) |
| `gdn_recurrent_step` | Triton: the fp32 state updated in place in the pool |
| `gdn_recurrent_prefill` | Triton: the same step looped over each sequence's tokens, one launch |
| `causal_conv1d_prefill` | vectorised torch over the packed tokens |
| `causal_conv1d_step` | Triton: history shifted in place |
| `store_kv` | `index_copy_` into the flat page slots |
| `paged_attention` | Triton: split-KV decode over the pages; GQA-tiled causal flash prefill over the pages |

The per-layer ops (norms, rotary + KV store, gates, router) are `pdserve.ops.cuda_layers`; the MoE
is `pdserve.ops.cuda_moe`.
"""

from __future__ import annotations

from pdserve.ops.cuda_attention import paged_attention, store_kv
from pdserve.ops.cuda_conv import causal_conv1d_prefill, causal_conv1d_step
from pdserve.ops.cuda_gdn import gdn_chunk_prefill, gdn_recurrent_step
from pdserve.ops.cuda_gdn_recurrent import gdn_recurrent_prefill

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_step",
    "gdn_chunk_prefill",
    "gdn_recurrent_prefill",
    "gdn_recurrent_step",
    "paged_attention",
    "store_kv",
]
