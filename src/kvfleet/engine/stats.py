"""Per-step statistics the engine hands to stat loggers (e.g. Prometheus metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfleet.engine.request import Request


@dataclass
class FinishedRequestStats:
    """One finished request (one choice).

    Attributes:
        finish_reason: ``stop``, ``length``, ``abort`` or ``error``.
        e2e_latency: arrival -> finish, seconds.
        queue_time: arrival -> first scheduled, seconds (0 if never scheduled).
        num_prompt_tokens, num_generation_tokens: token counts.
    """

    finish_reason: str
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class StepStats:
    """What happened in one engine step.

    Attributes:
        num_running, num_waiting: queue sizes after the step.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_prompt_tokens: prompt tokens of requests that got their first token this step
            (counted once per request, like vLLM's ``prompt_tokens_total``).
        num_generation_tokens: tokens generated this step.
        num_preemptions: requests preempted this step.
        time_to_first_tokens: TTFT of each request whose first token came this step, seconds.
        inter_token_latencies: time since each request's previous token, seconds.
        finished: requests that finished this step.
        prefix_cache_queries: prompt tokens looked up in the prefix cache this step (tokens).
        prefix_cache_hits: of those, tokens served from the cache (tokens).
        num_swap_outs, num_swap_ins: requests swapped to / back from the host swap pool.
        num_cow_copies: KV blocks copied on write this step.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_cow_copies: int = 0

    def record_token(self, request: Request, now: float) -> None:
        """Account one token just appended to ``request`` at ``now`` (``time.monotonic()``
        seconds): its TTFT and prompt tokens when it is the first, else its inter-token latency;
        updates the request's first / last token times."""
        if request.first_token_time is None:
            request.first_token_time = now
            self.time_to_first_tokens.append(now - request.arrival_time)
            self.num_prompt_tokens += request.num_prompt_tokens
        elif request.last_token_time is not None:
            self.inter_token_latencies.append(now - request.last_token_time)
        request.last_token_time = now
        self.num_generation_tokens += 1
