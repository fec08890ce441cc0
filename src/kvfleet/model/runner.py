"""Model runner: owns the paged KV cache, turns a :class:`SchedulerOutput` into batch tensors,
runs the forward pass and samples (vLLM's ``ModelRunner`` / nano-vllm's ``model_runner``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.request import Request
from kvfleet.model.config import ModelConfig
from kvfleet.model.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan
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
        dtype: KV cache dtype (normally the model's dtype).
        sampler: callable ``(logits float32 [N, vocab], requests) -> list[SampleResult]``; None =
            :class:`kvfleet.model.sampler.Sampler` (imported on first use).

    Attributes:
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        ValueError: ``block_size`` or ``num_blocks`` < 1.
    """

    def __init__(self, loaded: LoadedModel, block_size: int, num_blocks: int, dtype: torch.dtype = torch.float32,
                 sampler: SamplerFn | None = None) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        self.loaded = loaded
        self.model = loaded.model
        self.config: ModelConfig = loaded.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self._sampler = sampler
        c = self.config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(c.num_hidden_layers)
        ]

    @staticmethod
    def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V:
        ``2 * layers * block_size * kv_heads * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim
                * itemsize)

    @property
    def sampler(self) -> SamplerFn:
        """The sampler in use (the default :class:`Sampler` is created on first access)."""
        if self._sampler is None:
            from kvfleet.model.sampler import Sampler

            self._sampler = Sampler()
        return self._sampler

    # ------------------------------------------------------------------ batch building
    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, sched: SchedulerOutput) -> _Batch:
        bs = self.block_size
        window = self.config.sliding_window
        # Decodes sorted by context length, so that each decode group pads little.
        decodes = sorted((s for s in sched.scheduled if s.num_new_tokens == 1), key=lambda s: s.start_pos)
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: dict[int, int] = {}  # id(ScheduledRequest) -> its last row in the flat batch
        for s in decodes:
            p = s.start_pos
            if len(s.block_table) * bs <= p:
                raise ValueError(f"request {s.request.request_id}: block table too short for position {p}")
            rows[id(s)] = len(ids)
            ids.append(s.request.token_at(p))
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        spans: list[PrefillSpan] = []
        for s in prefills:
            start, n = s.start_pos, s.num_new_tokens
            end = start + n
            if len(s.block_table) * bs < end:
                raise ValueError(f"request {s.request.request_id}: block table too short for {end} tokens")
            q0 = len(ids)
            ids.extend(s.token_ids)
            pos.extend(range(start, end))
            slots.extend(self._slots(s.block_table, start, end))
            rows[id(s)] = q0 + n - 1
            bt = torch.tensor(s.block_table[: (end + bs - 1) // bs], dtype=torch.long) if start > 0 else None
            mask = None
            if start > 0 or window is not None:
                qpos = torch.arange(start, end)[:, None]
                kpos = torch.arange(end)[None, :]
                mask = kpos <= qpos
                if window is not None:
                    mask &= kpos > qpos - window
            spans.append(PrefillSpan(q0, q0 + n, start, bt, mask))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), prefills=spans)
        meta.num_decodes = len(decodes)
        for g0, g1 in _decode_groups([s.start_pos + 1 for s in decodes]):
            meta.decode_groups.append(self._decode_group(decodes[g0:g1], g0))
        sample = [s for s in decodes + prefills if s.needs_sample]
        return _Batch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            meta=meta,
            sample_rows=[rows[id(s)] for s in sample],
            sample_reqs=sample,
        )

    def _decode_group(self, decodes: list[ScheduledRequest], row_start: int) -> DecodeGroup:
        bs = self.block_size
        window = self.config.sliding_window
        ctx_lens = [s.start_pos + 1 for s in decodes]
        max_ctx = max(ctx_lens)
        nb = (max_ctx + bs - 1) // bs
        tables = torch.tensor(
            [s.block_table[:nb] + [0] * (nb - min(nb, len(s.block_table))) for s in decodes], dtype=torch.long)
        group = DecodeGroup(row_start, row_start + len(decodes), tables)
        if window is None and all(c == max_ctx for c in ctx_lens):
            group.ctx_len = max_ctx
        else:
            lens = torch.tensor(ctx_lens, dtype=torch.long)[:, None]
            kpos = torch.arange(nb * bs)[None, :]
            mask = kpos < lens
            if window is not None:
                mask &= kpos > lens - 1 - window
            group.mask = mask[:, None, None, :]
        return group

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
        sampler once for all of them. Never mutates the requests.

        Returns:
            ``{request_id: SampleResult}`` for the sampled requests.

        Raises:
            ValueError: a block table is too short for the positions it must hold.
        """
        logits, reqs = self._forward_logits(sched)
        if logits is None:
            return {}
        results = self.sampler(logits, [s.request for s in reqs])
        return {s.request.request_id: r for s, r in zip(reqs, results, strict=True)}

    @torch.inference_mode()
    def compute_logits(self, sched: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Same forward as :meth:`execute` (the cache is written) but returns the float32
        ``[vocab]`` last-position logits of each ``needs_sample`` request instead of sampling."""
        logits, reqs = self._forward_logits(sched)
        if logits is None:
            return {}
        return {s.request.request_id: logits[i] for i, s in enumerate(reqs)}


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
