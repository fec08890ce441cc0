"""Attention with attention sinks over a paged KV cache (StreamingLLM: Xiao et al. 2024,
"Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

A query at absolute position ``q`` attends to the ``S`` first tokens of its sequence (the
*attention sinks*) and to the ``N`` most recent tokens including itself (the *window*)::

    attend(q, j)  <=>  j <= q  and  (j < S  or  j > q - N)

Everything else was (or may have been) evicted: the KV cache manager frees every block that
holds no sink position and lies wholly before ``num_computed - N + 1``; its block-table entry
becomes ``-1`` and is read as block 0 here, always masked.

Positions within the cache (StreamingLLM, section 3.2): the paper re-assigns rotary positions by
the token's place *in the cache*, not in the text: the sinks sit at cache positions ``0 .. S-1``
and the window right after them. For a query at absolute position ``q`` let
``c = S + N - 1`` and ``Delta_q = max(0, q - c)``:

- no eviction yet (``q <= c``): cache positions equal absolute positions, ``Delta_q = 0``;
- otherwise the window keys ``j = q-N+1 .. q`` sit at cache positions ``S .. c`` (key ``j`` at
  ``j - Delta_q``) and the query, the newest entry, at ``c = q - Delta_q``; the sinks stay at
  ``0 .. S-1``.

RoPE scores depend only on the difference of the two positions. Keys are cached rotated at their
*absolute* positions, so window keys already have the StreamingLLM distance ``q - j`` to a query
rotated at ``q``. For a sink ``j < S`` StreamingLLM's distance is ``c - j = (q - Delta_q) - j``:
the query must look as if it sat at ``q - Delta_q``. Rotation by ``-Delta_q`` of the rotated
query gives exactly that (``R(-Delta) R(q) = R(q - Delta)``), so here every query row has two
versions: the normal one scores the window keys, the back-rotated one scores the sink keys, and
one softmax runs over both score sets. Keys are never re-rotated, so no cached key changes when
the window slides, and the result equals attention computed from scratch with the re-assigned
cache positions (tested to 1e-5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvfleet.model.layers.kv_cache import LayerKV, gather_blocks, write_slots
from kvfleet.model.layers.rotary import RotaryEmbedding

#: Key position given to padding key slots: larger than any query position, so always masked.
_PAD_POS = 2**62


@dataclass
class StreamingGroup:
    """``B`` sequences with ``n`` consecutive query rows each, attended in one batched call
    (all decodes of a step form one group with ``n = 1``; each prefill chunk is a group with
    ``B = 1``).

    Attributes:
        row_start, row_end: the group's rows ``[row_start, row_end)`` in the flat batch, sequence
            ``b``'s query ``i`` at row ``row_start + b * n + i``.
        num_seqs: ``B``.
        num_queries: ``n``.
        block_ids: int64 ``[B * K / block_size]`` KV blocks gathered per sequence (padding reads
            block 0): first the ``ceil(S / block_size)`` sink blocks, then the window's blocks.
        mask: bool ``[B, 1, 1, n, K]``, True = attend (causal, sinks or window, real keys only).
        sink: bool ``[B, 1, 1, 1, Ks]`` over the first ``Ks = ceil(S / block_size) * block_size``
            keys: True where the key is a sink (``j < S``) and is scored by the back-rotated query.
    """

    row_start: int
    row_end: int
    num_seqs: int
    num_queries: int
    block_ids: torch.Tensor
    mask: torch.Tensor
    sink: torch.Tensor


@dataclass
class StreamingMetadata:
    """Per-step inputs of :func:`streaming_attention`, shared by every layer.

    Attributes:
        sink_tokens: ``S``, attention-sink tokens (>= 0).
        window: ``N``, recent tokens attended, the query included (>= 1).
        cos_back, sin_back: ``[T, 1, head_dim]`` in the compute dtype: rotation of each query
            row by ``-Delta_q`` (``Delta_q = max(0, q - (S + N - 1))``), for
            :meth:`RotaryEmbedding.apply`.
        groups: the step's :class:`StreamingGroup` s, covering every row once.
    """

    sink_tokens: int
    window: int
    cos_back: torch.Tensor
    sin_back: torch.Tensor
    groups: list[StreamingGroup] = field(default_factory=list)


def sink_delta(positions: torch.Tensor, sink_tokens: int, window: int) -> torch.Tensor:
    """``Delta_q = max(0, q - (S + N - 1))`` for int64 ``positions`` ``[T]``: how far each query's
    absolute position lies past its StreamingLLM cache position (int64 ``[T]``)."""
    return (positions - (sink_tokens + window - 1)).clamp_min(0)


def _seq_blocks(q_first: int, q_last: int, table: Sequence[int], block_size: int, sink_tokens: int,
                window: int, what: str) -> tuple[list[int], list[int]]:
    """Block-table indices to gather for queries ``q_first .. q_last`` of one sequence: the sink
    blocks (``-1`` = padding, when the sequence does not reach them yet) and the window blocks.

    Raises:
        ValueError: a needed block is missing from the table or was freed (-1).
    """
    nsb = -(-sink_tokens // block_size)
    last_blk = q_last // block_size
    if last_blk >= len(table):
        raise ValueError(f"{what}: block table too short for position {q_last}")
    sink_idx = [b if b <= last_blk else -1 for b in range(nsb)]
    lo = max(nsb, max(0, q_first - window + 1) // block_size)
    win_idx = list(range(lo, last_blk + 1))
    for b in sink_idx + win_idx:
        if b >= 0 and table[b] < 0:
            raise ValueError(f"{what}: block {b} is needed for attention (sinks or window) but was freed (-1)")
    return sink_idx, win_idx


def _group(row_start: int, seqs: list[tuple[int, int, Sequence[int], str]], block_size: int, sink_tokens: int,
           window: int) -> StreamingGroup:
    """One group from ``(start_pos, n, block_table, name)`` per sequence (all with the same ``n``)."""
    n = seqs[0][1]
    bs = block_size
    nsb = -(-sink_tokens // bs)
    parts = [_seq_blocks(start, start + n - 1, table, bs, sink_tokens, window, name)
             for start, _, table, name in seqs]
    nwin = max(len(w) for _, w in parts)
    idx = torch.tensor([s + w + [-1] * (nwin - len(w)) for s, w in parts], dtype=torch.long)  # [B, nb]
    tables = [list(t) for _, _, t, _ in seqs]
    ids = torch.tensor([[tables[b][i] if i >= 0 else 0 for i in row] for b, row in enumerate(idx.tolist())],
                       dtype=torch.long).clamp_min_(0)
    B, nb = idx.shape
    offs = torch.arange(bs, dtype=torch.long)
    kpos = torch.where((idx >= 0)[:, :, None], idx[:, :, None] * bs + offs, _PAD_POS).reshape(B, nb * bs)
    qpos = torch.tensor([start for start, _, _, _ in seqs], dtype=torch.long)[:, None] + torch.arange(n)
    kp = kpos[:, None, :]  # [B, 1, K]
    qp = qpos[:, :, None]  # [B, n, 1]
    mask = (kp <= qp) & ((kp < sink_tokens) | (kp > qp - window))
    sink = kpos[:, : nsb * bs] < sink_tokens
    return StreamingGroup(row_start, row_start + len(seqs) * n, len(seqs), n, ids.reshape(-1),
                          mask[:, None, None], sink[:, None, None, None])


def build_streaming_metadata(positions: torch.Tensor, decodes: Sequence[tuple[int, Sequence[int], str]],
                             prefills: Sequence[tuple[int, int, int, Sequence[int], str]], block_size: int,
                             sink_tokens: int, window: int, rotary: RotaryEmbedding) -> StreamingMetadata:
    """Build a step's :class:`StreamingMetadata`.

    Args:
        positions: int64 ``[T]`` absolute position of every row of the flat batch.
        decodes: ``(position, block_table, name)`` of each decode, in row order (rows
            ``0 .. len(decodes)-1``); ``name`` (the request id) is used in errors.
        prefills: ``(row_start, start_pos, num_tokens, block_table, name)`` of each prefill
            chunk, whose rows are ``row_start .. row_start + num_tokens - 1``.
        block_size: tokens per KV block.
        sink_tokens: ``S`` (>= 0); window: ``N`` (>= 1).
        rotary: the model's rotary embedding (its tables give the back-rotation).

    Raises:
        ValueError: ``S < 0`` or ``N < 1``; a block table too short, or a needed block freed (-1).
    """
    if sink_tokens < 0 or window < 1:
        raise ValueError(f"need sink_tokens >= 0 and window >= 1, got {sink_tokens}, {window}")
    cos, sin = rotary.cos_sin(sink_delta(positions, sink_tokens, window))
    meta = StreamingMetadata(sink_tokens, window, cos, -sin)
    if decodes:
        meta.groups.append(_group(0, [(p, 1, t, name) for p, t, name in decodes], block_size, sink_tokens, window))
    for row_start, start, n, table, name in prefills:
        meta.groups.append(_group(row_start, [(start, n, table, name)], block_size, sink_tokens, window))
    return meta


def streaming_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: LayerKV, v_cache: LayerKV,
                        slot_mapping: torch.Tensor, meta: StreamingMetadata) -> torch.Tensor:
    """Write the new K/V into the paged cache, then attend each query to its sequence's sinks and
    window (StreamingLLM, see the module docstring for the positions).

    Args:
        q: ``[T, num_heads, head_dim]`` queries rotated at their absolute positions.
        k, v: ``[T, num_kv_heads, head_dim]`` new keys (rotated at absolute positions) and values.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools (plain or fp8),
            updated in place.
        slot_mapping: int64 ``[T]`` cache slot of each new token.
        meta: the step's :class:`StreamingMetadata`.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype; scale ``1/sqrt(head_dim)``, softmax in float32.
        Grouped-query attention: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.
    """
    write_slots(k_cache, slot_mapping, k)
    write_slots(v_cache, slot_mapping, v)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    scale = 1.0 / math.sqrt(D)
    q_back = RotaryEmbedding.apply(q, meta.cos_back, meta.sin_back)
    out = torch.empty_like(q)
    for g in meta.groups:
        B, n = g.num_seqs, g.num_queries

        def heads(x: torch.Tensor, B: int = B, n: int = n) -> torch.Tensor:  # -> [B, KVH, G, n, D]
            return x.view(B, n, KVH, G, D).permute(0, 2, 3, 1, 4)

        qg, qb = heads(q[g.row_start:g.row_end]), heads(q_back[g.row_start:g.row_end])
        kg = gather_blocks(k_cache, g.block_ids, q.dtype).view(B, -1, KVH, D).permute(0, 2, 1, 3).unsqueeze(2)
        vg = gather_blocks(v_cache, g.block_ids, q.dtype).view(B, -1, KVH, D).permute(0, 2, 1, 3).unsqueeze(2)
        scores = torch.matmul(qg, kg.transpose(-1, -2)).float() * scale  # [B, KVH, G, n, K]
        ks = g.sink.shape[-1]
        if ks:
            s_sink = torch.matmul(qb, kg[..., :ks, :].transpose(-1, -2)).float() * scale
            scores[..., :ks] = torch.where(g.sink, s_sink, scores[..., :ks])
        scores.masked_fill_(~g.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        og = torch.matmul(probs, vg)  # [B, KVH, G, n, D]
        out[g.row_start:g.row_end] = og.permute(0, 3, 1, 2, 4).reshape(B * n, H, D)
    return out
