"""Attention over a paged KV cache (Kwon et al. 2023, "PagedAttention", vLLM), in plain torch.

The KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``pos`` of a sequence lives in slot
``block_table[pos // block_size] * block_size + pos % block_size`` of the flattened cache.

A step's tokens are one flat batch (no padding) ordered as: first the decode sequences (one
query token each), then the prefill / chunked-prefill sequences. Decodes are attended in one
batched ``scaled_dot_product_attention`` call over their K/V gathered through a padded block
table; prefills one sequence at a time with a causal mask offset by ``start_pos``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One prefill (or prefill chunk) in the flat batch.

    Attributes:
        q_start, q_end: its token rows ``[q_start, q_end)`` in the flat batch.
        start_pos: absolute position of its first new token (tokens before it are in the cache).
        block_table: int64 ``[num_blocks_needed]`` block ids covering ``start_pos + n`` positions;
            only read when ``start_pos > 0``.
        mask: bool ``[n, start_pos + n]`` (True = attend) or None for a plain causal prefill
            from position 0 without a sliding window (``is_causal`` is used instead).
    """

    q_start: int
    q_end: int
    start_pos: int
    block_table: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decode sequences (one query token each) attended together in one SDPA call.

    Attributes:
        row_start, row_end: their query rows ``[row_start, row_end)`` in the flat batch.
        block_tables: int64 ``[B, max_blocks]`` padded block tables (padding points at block 0
            and is masked).
        mask: bool ``[B, 1, 1, max_blocks * block_size]`` (True = attend), or None on the fast
            path (equal context lengths, no window), where keys are sliced to ``ctx_len``.
        ctx_len: for the fast path, the common context length in tokens.
    """

    row_start: int
    row_end: int
    block_tables: torch.Tensor
    mask: torch.Tensor | None = None
    ctx_len: int = 0


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Attributes:
        slot_mapping: int64 ``[T]``, cache slot of each new token.
        num_decodes: decode sequences; their query tokens are rows ``[0, num_decodes)``.
        decode_groups: the decodes split into groups of similar context length, so the padded
            K/V gather of each group stays close to its real context (less copying on CPU).
        prefills: the prefill spans after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the caches at ``slot_mapping`` (int64 ``[T]``)."""
    kvh, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write the new K/V into the paged cache, then attend every query over its sequence's context.

    Args:
        q: ``[T, num_heads, head_dim]`` rotated queries.
        k, v: ``[T, num_kv_heads, head_dim]`` rotated keys and values of the new tokens.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, updated in place.
        meta: the step's :class:`AttentionMetadata`.

    Returns:
        ``[T, num_heads, head_dim]`` attention output (scale ``1/sqrt(head_dim)``), q's dtype.
        Grouped-query attention: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        B = g.row_end - g.row_start
        # All G query heads of a kv head share the key set, so they act as G "query rows"
        # of one kv head: no K/V repeat is needed.
        qd = q[g.row_start:g.row_end].view(B, KVH, G, D)
        # index_select, not advanced indexing: ``cache[idx]`` is far slower on CPU.
        bt = g.block_tables.reshape(-1)
        kd = k_cache.index_select(0, bt).view(B, -1, KVH, D)
        vd = v_cache.index_select(0, bt).view(B, -1, KVH, D)
        if g.mask is None:
            kd = kd[:, :g.ctx_len]
            vd = vd[:, :g.ctx_len]
        kd = kd.transpose(1, 2).to(q.dtype)
        vd = vd.transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask)
        out[g.row_start:g.row_end] = od.reshape(B, H, D)
    for p in meta.prefills:
        n = p.q_end - p.q_start
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.start_pos == 0:
            kp = k[p.q_start:p.q_end]
            vp = v[p.q_start:p.q_end]
        else:
            ctx = p.start_pos + n
            kp = k_cache.index_select(0, p.block_table).view(-1, KVH, D)[:ctx].to(q.dtype)
            vp = v_cache.index_select(0, p.block_table).view(-1, KVH, D)[:ctx].to(q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        if G > 1:
            kp = kp.repeat_interleave(G, dim=1)
            vp = vp.repeat_interleave(G, dim=1)
        if p.mask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask)
        out[p.q_start:p.q_end] = op[0].transpose(0, 1)
    return out
