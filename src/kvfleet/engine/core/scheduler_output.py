"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (the runner reads sampling params and output tokens from it).
        start_pos: position of the first new token (= ``num_computed_tokens`` before the step).
        num_new_tokens: tokens to compute this step (a prefill chunk, or 1 for a decode).
        block_table: the request's block ids (covers at least ``start_pos + num_new_tokens`` slots).
        needs_sample: True when this step computes the last known token, so a new token is
            sampled from its logits (False for a prefill chunk that stops short of the end).
        block_tables: the block table of every KV cache group when the model has several
            (:mod:`kvfleet.engine.core.hybrid_kv_cache_manager`; ``block_table`` is then the first
            group's); empty for a single group.
    """

    request: Request
    start_pos: int
    num_new_tokens: int
    block_table: list[int]
    needs_sample: bool
    block_tables: list[list[int]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """Token ids fed to the model this step, ``len == num_new_tokens``."""
        return self.request.tokens_slice(self.start_pos, self.start_pos + self.num_new_tokens)


@dataclass
class SchedulerOutput:
    """A step's plan.

    Attributes:
        scheduled: requests to run, in batch order (running requests first, then new ones).
        preempted: requests preempted (by recompute) while building this plan.
        num_batched_tokens: sum of ``num_new_tokens``.
        swap_out: ``(device_block, host_block)`` pairs to copy from the KV pool to the host swap
            pool before this step's forward (swap preemption).
        swap_in: ``(host_block, device_block)`` pairs to copy back from the host swap pool.
        block_copies: ``(src_block, dst_block)`` pairs to copy inside the KV pool (copy-on-write,
            partial-block prefix reuse). The runner applies ``swap_out``, then ``swap_in``, then
            ``block_copies``, all before the forward.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
