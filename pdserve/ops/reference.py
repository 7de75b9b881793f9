"""CPU reference implementations of the ops: plain torch, fp32 inside, written to be read.

The functions here trust their caller (`pdserve.ops`) to have checked shapes and dtypes; the
contract of each op (shapes, state handling) is the docstring of the public function there.
Prefill paths loop over sequences in Python; decode paths are vectorised over the batch.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

_L2NORM_EPS = 1e-6


# ---------------------------------------------------------------- Gated DeltaNet (linear attention)
def _l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _gdn_queries_keys(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> fp32 [..., Hv, Dk]: l2-normalised, q scaled by Dk**-0.5, and each key
    head repeated for the Hv // Hk consecutive value heads it serves."""
    group = num_v_heads // k.shape[-2]
    q = _l2_normalized(q.float()) * q.shape[-1] ** -0.5
    k = _l2_normalized(k.float())
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


def _gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the gated delta rule, head-major: q, k [H, c, Dk], v [H, c, Dv], g, beta [H, c],
    state [H, Dk, Dv] -> (out [H, c, Dv], state after the chunk).

    Token by token the rule is S_i = e^{g_i} S_{i-1} + k_i u_i^T with the written value
    u_i = beta_i (v_i - e^{g_i} S_{i-1}^T k_i), and out_i = S_i^T q_i. With G the cumulative log-decay
    inside the chunk and S0 the state before it, unrolling gives
        u_i + beta_i sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} S0^T k_i),
    a unit lower-triangular system in the u's, solved for the whole chunk at once.
    """
    chunk = q.shape[1]
    log_decay = g.cumsum(dim=-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # e^{G_i - G_j} for j <= i, 0 above the diagonal (masked before exp, so it cannot overflow)
    relative_decay = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    decay_from_start = log_decay.exp()[..., None]
    decay_to_end = (log_decay[:, -1:] - log_decay).exp()[..., None]

    strictly_lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * relative_decay).tril(-1)
    system = strictly_lower + torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * (v - decay_from_start * (k @ state))
    written = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)

    out = decay_from_start * (q @ state) + ((q @ k.transpose(-1, -2)) * relative_decay) @ written
    state = log_decay[:, -1].exp()[:, None, None] * state + (k * decay_to_end).transpose(-1, -2) @ written
    return out, state


def _gated_delta_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token-major fp32: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state
    [H, Dk, Dv] -> (out [L, H, Dv], final state). Chunks start at the sequence's first token."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    for start in range(0, v.shape[1], chunk_size):
        c = slice(start, start + chunk_size)
        out[:, c], state = _gated_delta_chunk(q[:, c], k[:, c], v[:, c], g[:, c], beta[:, c], state)
    return out.transpose(0, 1), state


def _sequence_bounds(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(a > b for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={num_tokens}, got {bounds}")
    return bounds


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    chunk_size: int,
    chunks: torch.Tensor | None = None,  # the CUDA scan's index: the reference needs none
) -> torch.Tensor:
    q, k = _gdn_queries_keys(q, k, v.shape[1])
    values, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(values)
    bounds = _sequence_bounds(cu_seqlens, q.shape[0])
    for n, slot in enumerate(slot_ids.tolist()):
        s = slice(bounds[n], bounds[n + 1])
        state = recurrent_pool[slot].float()
        out[s], state = _gated_delta_sequence(q[s], k[s], values[s], g[s], beta[s], state, chunk_size)
        recurrent_pool[slot] = state
    return out.to(v.dtype)


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    q, k = _gdn_queries_keys(q, k, v.shape[1])
    state = recurrent_pool[slot_ids].float() * g.float().exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)
    written = beta.float()[..., None] * (v.float() - predicted)
    state = state + k[..., :, None] * written[..., None, :]
    out = (q.unsqueeze(-2) @ state).squeeze(-2)
    recurrent_pool.index_copy_(0, slot_ids, state.to(recurrent_pool.dtype))
    return out.to(v.dtype)


def gdn_recurrent_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    recurrent_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gdn_chunk_prefill`'s result computed a token at a time: the sequences' n-th tokens as one
    `gdn_recurrent_step` (n = 0, 1, ...); after step n, the slots of sequences saving after
    n + 1 tokens copied to their checkpoints."""
    bounds = _sequence_bounds(cu_seqlens, q.shape[0])
    saves = []
    if save_at is not None and save_to is not None:
        saves = list(zip(save_at.tolist(), save_to.tolist(), strict=True))
    out = torch.empty_like(v)
    for n in range(max((b - a for a, b in pairwise(bounds)), default=0)):
        live = [i for i in range(len(bounds) - 1) if bounds[i] + n < bounds[i + 1]]
        rows = torch.tensor([bounds[i] + n for i in live], device=q.device)
        slots = slot_ids[torch.tensor(live, device=q.device)]
        out[rows] = gdn_recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], recurrent_pool, slots)
        for i, (at, to) in enumerate(saves):
            if at == n + 1 and i in live:
                recurrent_pool[to] = recurrent_pool[slot_ids[i]]
    return out


# ---------------------------------------------------------------- depthwise causal conv1d (+ SiLU)
def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    save_at: torch.Tensor | None = None,
    save_to: torch.Tensor | None = None,
) -> torch.Tensor:
    channels, history_len = conv_pool.shape[1], conv_pool.shape[2]
    kernel = weight.float()[:, None, :]
    out = torch.empty_like(x)
    bounds = _sequence_bounds(cu_seqlens, x.shape[0])
    saves = [0] * len(bounds) if save_at is None else save_at.tolist()
    targets = [] if save_to is None else save_to.tolist()
    for n, slot in enumerate(slot_ids.tolist()):
        s = slice(bounds[n], bounds[n + 1])
        if s.start == s.stop:  # an empty sequence (a padded pass's) leaves its history as it is
            continue
        # history first, so output i sees the W - 1 inputs before token i even across calls
        inputs = torch.cat([conv_pool[slot].float(), x[s].T.float()], dim=1)
        out[s] = F.silu(F.conv1d(inputs[None], kernel, groups=channels)[0]).T
        if 0 < saves[n] <= s.stop - s.start:  # the history after its first save_at tokens
            conv_pool[targets[n]] = inputs[:, saves[n] : saves[n] + history_len]
        conv_pool[slot] = inputs[:, inputs.shape[1] - history_len :]
    return out


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slot_ids: torch.Tensor
) -> torch.Tensor:
    window = torch.cat([conv_pool[slot_ids], x[:, :, None].to(conv_pool.dtype)], dim=-1)
    out = F.silu((window.float() * weight.float()).sum(dim=-1))
    conv_pool.index_copy_(0, slot_ids, window[:, :, 1:])
    return out.to(x.dtype)


# ---------------------------------------------------------------- paged softmax attention
def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    flat = kv_layer.view(2, -1, *kv_layer.shape[-2:])  # [2, P * page_size, Hkv, D], shares storage
    flat[0].index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_layer.dtype))


def _gather_pages(kv_layer: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, P, page_size, Hkv, D] pooled K/V, block_tables [N, pages] -> keys, values
    [N, pages * page_size, Hkv, D] in position order."""
    keys, values = kv_layer[:, block_tables.long()].flatten(2, 3).unbind(0)
    return keys, values


def _gqa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Q, H, D], keys/values [B, L, Hkv, D], visible bool [B, Q, L] -> [B, Q, H, D] in q's dtype.
    Query head h reads kv head h // (H // Hkv); scores and softmax in fp32."""
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    grouped = q.float().reshape(batch, num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqhgd,blhd->bhgql", grouped, keys.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bhgql,blhd->bqhgd", scores.softmax(dim=-1), values.float())
    return out.reshape(batch, num_q, num_heads, head_dim).to(q.dtype)


def _paged_decode(
    q: torch.Tensor, kv_layer: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float
) -> torch.Tensor:
    keys, values = _gather_pages(kv_layer, block_tables)
    positions = torch.arange(keys.shape[1], device=q.device)
    in_context = positions[None, :] < seq_lens[:, None]  # [N, L]
    # past the context a page holds stale data, possibly NaN, and 0 * NaN would leak through the softmax
    values = values.masked_fill(~in_context[:, :, None, None], 0.0)
    return _gqa_attention(q[:, None], keys, values, in_context[:, None], scale)[:, 0]


def _paged_prefill(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    page_size = kv_layer.shape[2]
    bounds = _sequence_bounds(cu_seqlens_q, q.shape[0])
    out = torch.empty_like(q)
    for n, context_len in enumerate(seq_lens.tolist()):
        s = slice(bounds[n], bounds[n + 1])
        num_q = s.stop - s.start
        if num_q > context_len:
            raise ValueError(f"sequence {n} has {num_q} query tokens but seq_lens[{n}]={context_len}")
        num_pages = -(-context_len // page_size)
        if num_pages > block_tables.shape[1]:
            raise ValueError(
                f"seq_lens[{n}]={context_len} needs {num_pages} pages, "
                f"block_tables has {block_tables.shape[1]}"
            )
        keys, values = _gather_pages(kv_layer, block_tables[n : n + 1, :num_pages])
        keys, values = keys[:, :context_len], values[:, :context_len]  # the last page's tail is stale
        q_positions = torch.arange(context_len - num_q, context_len, device=q.device)
        k_positions = torch.arange(context_len, device=q.device)
        visible = k_positions[None, :] <= q_positions[:, None]
        out[s] = _gqa_attention(q[None, s], keys, values, visible[None], scale)[0]
    return out


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,  # the GPU kernel's grid size; the reference needs none
    programs: int | None = None,  # the GPU kernel's SM footprint; likewise
) -> torch.Tensor:
    if q.shape[0] == seq_lens.shape[0]:  # one query token per sequence: decode, no host sync
        return _paged_decode(q, kv_layer, seq_lens, block_tables, scale)
    return _paged_prefill(q, kv_layer, cu_seqlens_q, seq_lens, block_tables, scale)
