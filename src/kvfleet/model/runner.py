"""Model runner: owns the paged KV cache, turns a :class:`SchedulerOutput` into batch tensors,
runs the forward pass and samples (vLLM's ``ModelRunner`` / nano-vllm's ``model_runner``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.engine.core.hybrid_kv_cache_manager import KVCacheGroupSpec
from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.request import Request
from kvfleet.model.config import ModelConfig
from kvfleet.model.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from kvfleet.model.layers.kv_cache import LayerKV, allocate_kv_pool, block_storage, kv_storage_dtype
from kvfleet.model.layers.rotary import RotaryEmbedding
from kvfleet.model.layers.streaming import build_streaming_metadata
from kvfleet.model.loader import LoadedModel

SamplerFn = Callable[[torch.Tensor, list[Request]], list[SampleResult]]


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    sample_reqs: list[ScheduledRequest]


class ModelRunner:
    """Runs model steps over a paged KV cache.

    Args:
        loaded: a :class:`~kvfleet.model.loader.LoadedModel`.
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (ids ``0 .. num_blocks-1``).
        dtype: compute dtype (the model's), also the KV dtype when ``kv_cache_dtype == "auto"``.
        sampler: callable ``(logits float32 [N, vocab], requests) -> list[SampleResult]``; None =
            :class:`kvfleet.model.sampler.Sampler` (imported on first use).
        kv_cache_dtype: ``"auto"`` (= ``dtype``), ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (vLLM's
            ``--kv-cache-dtype``; fp8 with a per-tensor scale, see
            :mod:`kvfleet.model.layers.kv_cache`).
        streaming: ``(sink_tokens, window)`` = ``(S, N)`` for StreamingLLM attention sinks (Xiao
            et al. 2024; ``--kv-eviction streaming``): every query attends to the first ``S``
            tokens and the last ``N`` (itself included), with the sinks scored as if they sat
            just before the window (:mod:`kvfleet.model.layers.streaming`); None = normal
            attention. Only for models without sliding-window layers and with one rotary table.
        kv_cache_groups: the model's KV cache groups when its layers have different windows
            (:func:`~kvfleet.engine.core.hybrid_kv_cache_manager.kv_cache_groups`; Gemma 3). A
            block id is then a page of ``group_size`` layers: the runner keeps ``group_size``
            physical ``(k, v)`` buffers, layer ``i`` of every group uses buffer ``i``, and each
            scheduled request brings one block table per group (``block_tables``). None or one
            group = one block table for all layers.

    Attributes:
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads,
            head_dim]``: plain tensors in ``dtype`` for ``auto``, else
            :class:`~kvfleet.model.layers.kv_cache.FP8KVCache` pools. With KV cache groups,
            layers at the same position of different groups share (alias) one buffer.
        swap_caches: per layer ``(k, v)`` host (CPU) tensors ``[num_host_blocks, block_size,
            num_kv_heads, head_dim]`` in the KV storage dtype, once :meth:`allocate_swap_space`
            ran (aliased like ``kv_caches``).
        layer_group: each layer's KV cache group index (all 0 without groups).
        num_host_blocks: blocks in the host swap pool (0 before :meth:`allocate_swap_space`).

    Raises:
        ValueError: ``block_size`` or ``num_blocks`` < 1, an unknown ``kv_cache_dtype``, or a bad
            ``streaming`` (not two ints, ``S < 0``, ``N < 1``, a sliding-window model, or a model
            without a single rotary embedding), or ``kv_cache_groups`` that do not cover every
            layer once with its own window.
    """

    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int, dtype: torch.dtype = torch.float32,
                 sampler: SamplerFn | None = None, kv_cache_dtype: str = "auto",
                 streaming: tuple[int, int] | None = None,
                 kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        kv_storage_dtype(kv_cache_dtype, dtype)  # validates the name
        self.loaded = loaded
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self._sampler = sampler
        self.kv_cache_dtype = kv_cache_dtype
        c = self.config
        layout = (block_size, c.num_key_value_heads, c.head_dim)
        # buffer of each layer: its position in its KV cache group (one group: its own index)
        self.kv_groups: list[KVCacheGroupSpec] | None = None
        self.layer_group = [0] * c.num_hidden_layers
        self._layer_buffer = list(range(c.num_hidden_layers))
        if kv_cache_groups is not None and len(kv_cache_groups) > 1:
            self._set_groups(kv_cache_groups)
        buffers = [(allocate_kv_pool(num_blocks, *layout, kv_cache_dtype, dtype),
                    allocate_kv_pool(num_blocks, *layout, kv_cache_dtype, dtype))
                   for _ in range(max(self._layer_buffer) + 1)]
        self.kv_caches: list[tuple[LayerKV, LayerKV]] = [buffers[i] for i in self._layer_buffer]
        # one layer per physical buffer, for block copies and swaps
        self._buffer_layers = [self._layer_buffer.index(i) for i in range(len(buffers))]
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_host_blocks = 0
        self.streaming: tuple[int, int] | None = None
        if streaming is not None:
            self.streaming = self._check_streaming(streaming)

    def _set_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        windows = self.config.layer_windows()
        seen = sorted(layer for g in groups for layer in g.layers)
        if seen != list(range(self.config.num_hidden_layers)):
            raise ValueError(f"kv_cache_groups must cover every layer once, got layers {seen}")
        for gi, g in enumerate(groups):
            if any(windows[layer] != g.sliding_window for layer in g.layers):
                raise ValueError(f"KV cache group {gi} mixes windows: {[windows[la] for la in g.layers]}")
            for pos, layer in enumerate(g.layers):
                self.layer_group[layer] = gi
                self._layer_buffer[layer] = pos
        self.kv_groups = list(groups)

    @staticmethod
    def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                                 kv_cache_dtype: str = "auto", num_layers: int | None = None) -> int:
        """Bytes one block takes over ``num_layers`` layers (default: all; with KV cache groups,
        the page size in layers), K and V:
        ``2 * layers * block_size * kv_heads * head_dim * itemsize``, where ``itemsize`` is that of
        the KV storage dtype (``dtype`` for ``auto``, 1 byte for fp8). fp8 scales are per tensor
        (two floats per layer for the whole pool), so no per-block scale bytes are added: the same
        memory holds 4x the blocks of fp32 and 2x those of bf16.

        Raises:
            ValueError: unknown ``kv_cache_dtype``.
        """
        itemsize = torch.empty((), dtype=kv_storage_dtype(kv_cache_dtype, dtype)).element_size()
        layers = config.num_hidden_layers if num_layers is None else num_layers
        return 2 * layers * block_size * config.num_key_value_heads * config.head_dim * itemsize

    @staticmethod
    def swap_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto", num_layers: int | None = None) -> int:
        """Bytes one host swap block takes (the same layout as a KV block, so the same as
        :meth:`kv_cache_bytes_per_block`); ``--swap-space`` bytes // this = ``num_host_blocks``."""
        return ModelRunner.kv_cache_bytes_per_block(config, block_size, dtype, kv_cache_dtype, num_layers)

    @property
    def sampler(self) -> SamplerFn:
        """The sampler in use (the default :class:`Sampler` is created on first access)."""
        if self._sampler is None:
            from kvfleet.model.sampler import Sampler

            self._sampler = Sampler()
        return self._sampler

    # ------------------------------------------------------------------ block operations
    def allocate_swap_space(self, num_host_blocks: int) -> None:
        """Create (or replace) the host swap pool: per layer ``(k, v)`` CPU tensors
        ``[num_host_blocks, block_size, num_kv_heads, head_dim]`` in the KV storage dtype (pinned
        when the KV pool is on a CUDA device, for asynchronous copies). Host block ids are
        ``0 .. num_host_blocks-1``; ``0`` frees the pool. Swap preemption as in vLLM (Kwon et al.
        2023, "PagedAttention", section 4.5).

        Raises:
            ValueError: ``num_host_blocks`` < 0.
        """
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        self.swap_caches = []
        self.num_host_blocks = num_host_blocks
        if num_host_blocks == 0:
            return
        host = []
        for layer in self._buffer_layers:
            pair = []
            for dev in (block_storage(c) for c in self.kv_caches[layer]):
                pin = dev.device.type == "cuda"
                pair.append(torch.zeros((num_host_blocks, *dev.shape[1:]), dtype=dev.dtype, device="cpu",
                                        pin_memory=pin))
            host.append((pair[0], pair[1]))
        self.swap_caches = [host[i] for i in self._layer_buffer]

    @staticmethod
    def _check_pairs(pairs: list[tuple[int, int]], n_src: int, n_dst: int, what: str,
                     src_name: str, dst_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        src: list[int] = []
        dst: list[int] = []
        for pair in pairs:
            try:
                a, b = pair
            except (TypeError, ValueError):
                raise ValueError(f"{what}: expected ({src_name}, {dst_name}) pairs, got {pair!r}") from None
            for x, n, name in ((a, n_src, src_name), (b, n_dst, dst_name)):
                if isinstance(x, bool) or not isinstance(x, int):
                    raise ValueError(f"{what}: {name} must be an int, got {x!r}")
                if not 0 <= x < n:
                    raise ValueError(f"{what}: {name} {x} out of range [0, {n})")
            src.append(a)
            dst.append(b)
        if len(set(dst)) != len(dst):
            raise ValueError(f"{what}: duplicate {dst_name} in {pairs!r}")
        return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    def _swap_checked(self, pairs: list[tuple[int, int]], out: bool) -> tuple[torch.Tensor, torch.Tensor]:
        what = "swap_out" if out else "swap_in"
        if pairs and not self.num_host_blocks:
            raise ValueError(f"{what}: no host swap pool (call allocate_swap_space first)")
        if out:
            return self._check_pairs(pairs, self.num_blocks, self.num_host_blocks, what, "device block", "host block")
        return self._check_pairs(pairs, self.num_host_blocks, self.num_blocks, what, "host block", "device block")

    def _copy(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        # index_select materialises every source block before any write, so a block that is both a
        # source and a destination in one call is read with its old content.
        blocks = src_pool.index_select(0, src.to(src_pool.device))
        dst_pool.index_copy_(0, dst.to(dst_pool.device), blocks.to(dst_pool.device))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device KV blocks to host swap blocks, all layers, K and V (raw bytes; fp8 scales
        are per tensor and shared by both pools, so they need no copy).

        Args:
            pairs: ``(device_block, host_block)`` pairs.

        Raises:
            ValueError: no swap pool, an id out of range or not an int, or a host block named twice.
        """
        src, dst = self._swap_checked(pairs, out=True)
        if pairs:
            for layer in self._buffer_layers:
                (k, v), (hk, hv) = self.kv_caches[layer], self.swap_caches[layer]
                self._copy(block_storage(k), hk, src, dst)
                self._copy(block_storage(v), hv, src, dst)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host swap blocks back into device KV blocks, all layers, K and V.

        Args:
            pairs: ``(host_block, device_block)`` pairs.

        Raises:
            ValueError: no swap pool, an id out of range or not an int, or a device block named twice.
        """
        src, dst = self._swap_checked(pairs, out=False)
        if pairs:
            for layer in self._buffer_layers:
                (k, v), (hk, hv) = self.kv_caches[layer], self.swap_caches[layer]
                self._copy(hk, block_storage(k), src, dst)
                self._copy(hv, block_storage(v), src, dst)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks inside the pool, all layers, K and V (copy-on-write of a shared, partially
        filled block, PagedAttention section 4.4; partial-block prefix reuse). All sources are read
        before any destination is written.

        Args:
            pairs: ``(src_block, dst_block)`` pairs.

        Raises:
            ValueError: an id out of range or not an int, or a destination named twice.
        """
        src, dst = self._check_pairs(pairs, self.num_blocks, self.num_blocks, "block_copies", "src block", "dst block")
        if pairs:
            for layer in self._buffer_layers:
                k, v = self.kv_caches[layer]
                self._copy(block_storage(k), block_storage(k), src, dst)
                self._copy(block_storage(v), block_storage(v), src, dst)

    def apply_block_ops(self, sched: SchedulerOutput) -> None:
        """Apply a step's ``swap_out``, then ``swap_in``, then ``block_copies``. Every list is
        validated before anything is copied, so a bad id leaves the pools untouched.

        Raises:
            ValueError: as :meth:`swap_out`, :meth:`swap_in`, :meth:`copy_blocks`.
        """
        if not (sched.swap_out or sched.swap_in or sched.block_copies):
            return
        self._swap_checked(sched.swap_out, out=True)
        self._swap_checked(sched.swap_in, out=False)
        self._check_pairs(sched.block_copies, self.num_blocks, self.num_blocks, "block_copies", "src block",
                          "dst block")
        self.swap_out(sched.swap_out)
        self.swap_in(sched.swap_in)
        self.copy_blocks(sched.block_copies)

    # ------------------------------------------------------------------ batch building
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _windows(self) -> tuple[int | None, list[int | None]]:
        """The step's default window (``config.sliding_window``) and the model's other distinct
        layer windows (Gemma 3: the global layers' None), for which masks are built once a step."""
        default = self.config.sliding_window
        return default, [w for w in dict.fromkeys(self.config.layer_windows()) if w != default]

    @staticmethod
    def _prefill_mask(start: int, end: int, window: int | None) -> torch.Tensor | None:
        """bool ``[end - start, end]`` (True = attend) for queries at ``start .. end-1``: causal,
        and within ``window`` tokens when one is given; None for a plain causal prefill from 0."""
        if start == 0 and window is None:
            return None
        qpos = torch.arange(start, end)[:, None]
        kpos = torch.arange(end)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        return mask

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        if self.streaming is not None:
            return self._prepare_streaming(sched)
        # Decodes sorted by context length, so that each decode group pads little.
        decodes = sorted((s for s in sched.scheduled if s.num_new_tokens == 1), key=lambda s: s.start_pos)
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        rows: dict[int, int] = {}  # id(ScheduledRequest) -> its last row in the flat batch
        for s in decodes:
            rows[id(s)] = len(ids)
            ids.append(s.request.token_at(s.start_pos))
            pos.append(s.start_pos)
        for s in prefills:
            q0 = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, s.start_pos + s.num_new_tokens))
            rows[id(s)] = q0 + s.num_new_tokens - 1
        if self.kv_groups is None:
            meta = self._build_meta(decodes, prefills, lambda s: s.block_table, *self._windows())
        else:
            for s in sched.scheduled:
                if len(s.block_tables) != len(self.kv_groups):
                    raise ValueError(f"request {s.request.request_id}: {len(s.block_tables)} block tables for "
                                     f"{len(self.kv_groups)} KV cache groups")
            metas = [self._build_meta(decodes, prefills, lambda s, g=g: s.block_tables[g], spec.sliding_window, [])
                     for g, spec in enumerate(self.kv_groups)]
            meta = metas[0]
            meta.kv_groups = metas
            meta.layer_groups = self.layer_group
        sample = [s for s in decodes + prefills if s.needs_sample]
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            meta=meta,
            sample_rows=[rows[id(s)] for s in sample],
            sample_reqs=sample,
        )

    def _build_meta(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest],
                    table_of: Callable[[ScheduledRequest], list[int]], window: int | None,
                    other_windows: list[int | None]) -> AttentionMetadata:
        """Attention metadata over the block tables ``table_of(s)`` (one KV cache group), with
        masks for ``window`` (the default) and ``other_windows``. Rows: decodes, then prefills."""
        bs = self.block_size
        slots: list[int] = []
        for s in decodes:
            p, table = s.start_pos, table_of(s)
            if len(table) * bs <= p:
                raise ValueError(f"request {s.request.request_id}: block table too short for position {p}")
            if table[p // bs] < 0:
                raise ValueError(f"request {s.request.request_id}: no block (-1) for new position {p}")
            slots.append(table[p // bs] * bs + p % bs)
        spans: list[PrefillSpan] = []
        q0 = len(decodes)
        for s in prefills:
            start, n, table = s.start_pos, s.num_new_tokens, table_of(s)
            end = start + n
            if len(table) * bs < end:
                raise ValueError(f"request {s.request.request_id}: block table too short for {end} tokens")
            if min(table[start // bs:(end - 1) // bs + 1]) < 0:
                raise ValueError(f"request {s.request.request_id}: no block (-1) for new positions {start}..{end - 1}")
            slots.extend(self._slots(table, start, end))
            # -1 marks a block freed because it lies wholly outside the window: always masked, so
            # it may point at block 0.
            bt = (torch.tensor(table[: (end + bs - 1) // bs], dtype=torch.long).clamp_min_(0)
                  if start > 0 else None)
            span = PrefillSpan(q0, q0 + n, start, bt, self._prefill_mask(start, end, window))
            for w in other_windows:
                span.window_masks[w] = self._prefill_mask(start, end, w)
            spans.append(span)
            q0 += n
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), prefills=spans,
                                 sliding_window=window)
        meta.num_decodes = len(decodes)
        for g0, g1 in _decode_groups([s.start_pos + 1 for s in decodes]):
            meta.decode_groups.append(self._decode_group(decodes[g0:g1], g0, table_of, window, other_windows))
        return meta

    def _decode_group(self, decodes: list[ScheduledRequest], row_start: int,
                      table_of: Callable[[ScheduledRequest], list[int]], window: int | None,
                      other_windows: list[int | None]) -> DecodeGroup:
        bs = self.block_size
        ctx_lens = [s.start_pos + 1 for s in decodes]
        max_ctx = max(ctx_lens)
        nb = (max_ctx + bs - 1) // bs
        # -1 entries (blocks freed outside the window) -> block 0: those keys are always masked.
        tables = torch.tensor(
            [table_of(s)[:nb] + [0] * (nb - min(nb, len(table_of(s)))) for s in decodes],
            dtype=torch.long).clamp_min_(0)
        group = DecodeGroup(row_start, row_start + len(decodes), tables)
        equal = all(c == max_ctx for c in ctx_lens)
        if equal:
            group.ctx_len = max_ctx
        lens = torch.tensor(ctx_lens, dtype=torch.long)[:, None]
        kpos = torch.arange(nb * bs)[None, :]

        def mask_for(w: int | None) -> torch.Tensor | None:
            if w is None and equal:
                return None  # fast path: keys sliced to ctx_len
            mask = kpos < lens
            if w is not None:
                mask &= kpos > lens - 1 - w
            return mask[:, None, None, :]

        group.mask = mask_for(window)
        for w in other_windows:
            group.window_masks[w] = mask_for(w)
        return group

    def _check_streaming(self, streaming: tuple[int, int]) -> tuple[int, int]:
        try:
            sinks, window = streaming
        except (TypeError, ValueError):
            raise ValueError(f"streaming must be a (sink_tokens, window) pair, got {streaming!r}") from None
        for name, x, lo in (("sink_tokens", sinks, 0), ("streaming window", window, 1)):
            if isinstance(x, bool) or not isinstance(x, int) or x < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
        if any(w is not None for w in self.config.layer_windows()):
            raise ValueError("StreamingLLM attention sinks are not supported for models with sliding-window layers")
        if not isinstance(getattr(self.model, "rotary", None), RotaryEmbedding):
            raise ValueError(f"StreamingLLM attention sinks need a model with one rotary embedding "
                             f"(the llama family); {type(self.model).__name__} has none")
        return sinks, window

    def _prepare_streaming(self, sched: SchedulerOutput) -> _Batch:
        """:meth:`_prepare` for StreamingLLM: the same flat batch (decodes first, then prefill
        chunks), attention metadata from :func:`build_streaming_metadata` (sinks + window; only
        those blocks are gathered, so a step's work is bounded however long the sequence)."""
        assert self.streaming is not None
        bs = self.block_size
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: dict[int, int] = {}
        dec_in: list[tuple[int, list[int], str]] = []
        pre_in: list[tuple[int, int, int, list[int], str]] = []
        for s in decodes + prefills:
            start, n = s.start_pos, s.num_new_tokens
            end = start + n
            rid = s.request.request_id
            if len(s.block_table) * bs < end:
                raise ValueError(f"request {rid}: block table too short for {end} tokens")
            if min(s.block_table[start // bs:(end - 1) // bs + 1]) < 0:
                raise ValueError(f"request {rid}: no block (-1) for new positions {start}..{end - 1}")
            if n == 1:
                dec_in.append((start, s.block_table, rid))
            else:
                pre_in.append((len(ids), start, n, s.block_table, rid))
            ids.extend(s.token_ids)
            pos.extend(range(start, end))
            slots.extend(self._slots(s.block_table, start, end))
            rows[id(s)] = len(ids) - 1
        positions = torch.tensor(pos, dtype=torch.long)
        sinks, window = self.streaming
        rotary = self.model.rotary
        smeta = build_streaming_metadata(positions, dec_in, pre_in, bs, sinks, window, rotary)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), num_decodes=len(decodes),
                                 streaming=smeta)
        sample = [s for s in decodes + prefills if s.needs_sample]
        return _Batch(input_ids=torch.tensor(ids, dtype=torch.long), positions=positions, meta=meta,
                      sample_rows=[rows[id(s)] for s in sample], sample_reqs=sample)

    # ------------------------------------------------------------------ steps
    def _forward_logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        if sched.is_empty:
            return None, []
        batch = self._prepare(sched)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_rows:
            return None, []
        idx = torch.tensor(batch.sample_rows, dtype=torch.long)
        return self.model.compute_logits(hidden[idx]), batch.sample_reqs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step and sample.

        For every scheduled request, feeds ``token_ids`` at positions ``start_pos ..
        start_pos + num_new_tokens - 1``, writes their K/V into the cache through
        ``block_table``, attends over positions ``0 .. start_pos + num_new_tokens - 1``, and for
        the ``needs_sample`` ones computes logits only at their last position and calls the
        sampler once for all of them. Never mutates the requests. Before the forward, applies the
        step's block operations (:meth:`apply_block_ops`: ``swap_out``, ``swap_in``,
        ``block_copies``), also in a step that schedules no request.

        Returns:
            ``{request_id: SampleResult}`` for the sampled requests.

        Raises:
            ValueError: a block table is too short for the positions it must hold, or a bad block
                operation (nothing is copied then).
        """
        self.apply_block_ops(sched)
        logits, reqs = self._forward_logits(sched)
        if logits is None:
            return {}
        results = self.sampler(logits, [s.request for s in reqs])
        return {s.request.request_id: r for s, r in zip(reqs, results, strict=True)}

    @torch.inference_mode()
    def compute_logits(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Same forward as :meth:`execute` (the cache is written) but returns the float32
        ``[vocab]`` last-position logits of each ``needs_sample`` request instead of sampling
        (block operations are applied first, as in :meth:`execute`)."""
        self.apply_block_ops(sched)
        logits, reqs = self._forward_logits(sched)
        if logits is None:
            return {}
        return {s.request.request_id: logits[i] for i, s in enumerate(reqs)}

    @torch.inference_mode()
    def compute_token_logits(self, scheduled: ScheduledRequest) -> torch.Tensor:
        """Forward one request's ``num_new_tokens`` tokens (writing their K/V like any step) and
        return the float32 ``[num_new_tokens, vocab]`` logits at *every* new position: row ``i``
        predicts the token at ``start_pos + i + 1``. For teacher-forced scoring (prompt logprobs,
        KV-dtype drift measurements); ``needs_sample`` is ignored.

        Raises:
            ValueError: the block table is too short.
        """
        s = ScheduledRequest(scheduled.request, scheduled.start_pos, scheduled.num_new_tokens,
                             scheduled.block_table, False, scheduled.block_tables)
        batch = self._prepare(SchedulerOutput(scheduled=[s]))
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden)


def _decode_groups(ctx_lens: list[int], max_groups: int = 4, min_size: int = 4) -> list[tuple[int, int]]:
    """Split ascending context lengths into at most ``max_groups`` contiguous ``[start, end)``
    ranges, starting a new range when a length exceeds 1.5x the range's first one (and the
    range has ``min_size`` members): fewer padded keys per SDPA call, few calls."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ctx_lens)):
        if (ctx_lens[i] > 1.5 * ctx_lens[start] and i - start >= min_size
                and len(groups) < max_groups - 1):
            groups.append((start, i))
            start = i
    if ctx_lens:
        groups.append((start, len(ctx_lens)))
    return groups
