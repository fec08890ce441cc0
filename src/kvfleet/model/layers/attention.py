"""Attention over a paged KV cache (Kwon et al. 2023, "PagedAttention", vLLM), in plain torch.

The KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``pos`` of a sequence lives in slot
``block_table[pos // block_size] * block_size + pos % block_size`` of the flattened cache.

A step's tokens are one flat batch (no padding) ordered as: first the decode sequences (one
query token each), then the prefill / chunked-prefill sequences. Decodes are attended in one
batched ``scaled_dot_product_attention`` call over their K/V gathered through a padded block
table; prefills one sequence at a time with a causal mask offset by ``start_pos``.

Sliding-window attention (Mistral; Gemma 3's interleaved local / global layers): the runner builds
the masks once per step for every distinct window of the model's layers, and each layer passes
its own window to :func:`paged_attention`, which picks the matching masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvfleet.model.layers.kv_cache import LayerKV, gather_blocks, write_slots
from kvfleet.model.layers.streaming import StreamingMetadata, streaming_attention

#: ``paged_attention(sliding_window=STEP_WINDOW)``: use the step's default window
#: (``AttentionMetadata.sliding_window``). Not a valid window itself (windows are >= 1).
STEP_WINDOW = 0


def _missing_window(window: int | None) -> ValueError:
    return ValueError(f"no attention mask was built for window {window!r} in this step's metadata")


@dataclass
class PrefillSpan:
    """One prefill (or prefill chunk) in the flat batch.

    Attributes:
        q_start, q_end: its token rows ``[q_start, q_end)`` in the flat batch.
        start_pos: absolute position of its first new token (tokens before it are in the cache).
        block_table: int64 ``[num_blocks_needed]`` block ids covering ``start_pos + n`` positions;
            only read when ``start_pos > 0``.
        mask: bool ``[n, start_pos + n]`` (True = attend) for the step's default window
            (``AttentionMetadata.sliding_window``), or None for a plain causal prefill from
            position 0 without a window (``is_causal`` is used instead).
        window_masks: the same for the model's other windows, keyed by window in tokens (None =
            full causal attention).
    """

    q_start: int
    q_end: int
    start_pos: int
    block_table: torch.Tensor | None
    mask: torch.Tensor | None
    window_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask_for(self, window: int | None, default_window: int | None) -> torch.Tensor | None:
        """The mask for a layer with attention window ``window`` (None = full causal).

        Raises:
            ValueError: no mask was built for that window.
        """
        if window == default_window:
            return self.mask
        if window not in self.window_masks:
            raise _missing_window(window)
        return self.window_masks[window]


@dataclass
class DecodeGroup:
    """Decode sequences (one query token each) attended together in one SDPA call.

    Attributes:
        row_start, row_end: their query rows ``[row_start, row_end)`` in the flat batch.
        block_tables: int64 ``[B, max_blocks]`` padded block tables (padding points at block 0
            and is masked).
        mask: bool ``[B, 1, 1, max_blocks * block_size]`` (True = attend) for the step's default
            window, or None on the fast path (equal context lengths, no window), where keys are
            sliced to ``ctx_len``.
        ctx_len: for the fast path, the common context length in tokens.
        window_masks: the same as ``mask`` for the model's other windows, keyed by window in
            tokens (None = full causal attention; its value is None on the fast path).
    """

    row_start: int
    row_end: int
    block_tables: torch.Tensor
    mask: torch.Tensor | None = None
    ctx_len: int = 0
    window_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask_for(self, window: int | None, default_window: int | None) -> torch.Tensor | None:
        """The mask for a layer with attention window ``window`` (None = full causal); None means
        the fast path (slice keys to ``ctx_len``).

        Raises:
            ValueError: no mask was built for that window.
        """
        if window == default_window:
            return self.mask
        if window not in self.window_masks:
            raise _missing_window(window)
        return self.window_masks[window]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Attributes:
        slot_mapping: int64 ``[T]``, cache slot of each new token.
        num_decodes: decode sequences; their query tokens are rows ``[0, num_decodes)``.
        decode_groups: the decodes split into groups of similar context length, so the padded
            K/V gather of each group stays close to its real context (less copying on CPU).
        prefills: the prefill spans after the decodes.
        sliding_window: the default window (tokens; None = full causal) that the ``mask`` fields
            of the spans and groups were built for; masks of other windows are in their
            ``window_masks``.
        streaming: StreamingLLM attention-sink metadata (:mod:`kvfleet.model.layers.streaming`);
            when set, :func:`paged_attention` attends through it and the other fields but
            ``slot_mapping`` are unused.
        kv_groups: with KV cache groups (Gemma 3's local / global layers,
            :mod:`kvfleet.engine.core.hybrid_kv_cache_manager`), one metadata per group, built
            over that group's block tables (this object is group 0's); empty otherwise.
        layer_groups: each layer's group index into ``kv_groups``.
    """

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: int | None = None
    streaming: StreamingMetadata | None = None
    kv_groups: list[AttentionMetadata] = field(default_factory=list)
    layer_groups: list[int] = field(default_factory=list)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with: its KV cache group's, or this one."""
        return self.kv_groups[self.layer_groups[layer]] if self.kv_groups else self


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into the caches at ``slot_mapping`` (int64 ``[T]``).

    The caches are plain tensors or fp8 :class:`~kvfleet.model.layers.kv_cache.FP8KVCache` pools.
    Returns ``(k, v)`` as the cache now holds them, in ``k``'s dtype: the inputs themselves for a
    model-dtype cache, the dequantized fp8 values otherwise, so that attention over the new tokens
    sees the same values as later steps that read them back (results do not depend on chunking).
    """
    return write_slots(k_cache, slot_mapping, k), write_slots(v_cache, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata,
                    sliding_window: int | None = STEP_WINDOW) -> torch.Tensor:
    """Write the new K/V into the paged cache, then attend every query over its sequence's context.

    Args:
        q: ``[T, num_heads, head_dim]`` rotated queries.
        k, v: ``[T, num_kv_heads, head_dim]`` rotated keys and values of the new tokens.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, updated in place.
        meta: the step's :class:`AttentionMetadata`.
        sliding_window: this layer's attention window in tokens (a query at position ``i`` sees
            keys ``j`` with ``i - window < j <= i``; Beltagy et al. 2020, Mistral 2023), None for
            full causal attention, or :data:`STEP_WINDOW` (default) for the step's default window
            ``meta.sliding_window`` (models whose layers all share one window need not pass it).

    Returns:
        ``[T, num_heads, head_dim]`` attention output (scale ``1/sqrt(head_dim)``), q's dtype.
        Grouped-query attention: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: the metadata holds no masks for ``sliding_window``.
    """
    if meta.streaming is not None:  # StreamingLLM attention sinks (kvfleet.model.layers.streaming)
        return streaming_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.streaming)
    window = meta.sliding_window if sliding_window == STEP_WINDOW else sliding_window
    k, v = write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
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
        kd = gather_blocks(k_cache, bt, q.dtype).view(B, -1, KVH, D)
        vd = gather_blocks(v_cache, bt, q.dtype).view(B, -1, KVH, D)
        dmask = g.mask_for(window, meta.sliding_window)
        if dmask is None:
            kd = kd[:, :g.ctx_len]
            vd = vd[:, :g.ctx_len]
        kd = kd.transpose(1, 2).to(q.dtype)
        vd = vd.transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dmask)
        out[g.row_start:g.row_end] = od.reshape(B, H, D)
    for p in meta.prefills:
        n = p.q_end - p.q_start
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.start_pos == 0:
            kp = k[p.q_start:p.q_end]
            vp = v[p.q_start:p.q_end]
        else:
            ctx = p.start_pos + n
            kp = gather_blocks(k_cache, p.block_table, q.dtype).view(-1, KVH, D)[:ctx]
            vp = gather_blocks(v_cache, p.block_table, q.dtype).view(-1, KVH, D)[:ctx]
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        if G > 1:
            kp = kp.repeat_interleave(G, dim=1)
            vp = vp.repeat_interleave(G, dim=1)
        pmask = p.mask_for(window, meta.sliding_window)
        if pmask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=pmask)
        out[p.q_start:p.q_end] = op[0].transpose(0, 1)
    return out
