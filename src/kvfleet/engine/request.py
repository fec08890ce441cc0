"""Request state machine: WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*.

Pure Python (no torch): the scheduler and KV cache manager work on these objects.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from kvfleet.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` for a finished status (``stop``, ``length``, ``abort``, ``error``)."""
        return self.value if self.finished else None


class Request:
    """One sequence being generated (one choice of an n > 1 request is its own Request).

    Attributes:
        request_id: unique id.
        prompt_token_ids: prompt tokens.
        sampling_params: how to sample.
        eos_token_id: model's end-of-sequence token (None = none).
        max_tokens: resolved output budget in tokens (``sampling_params.max_tokens`` or
            ``max_model_len - len(prompt)``), set by the engine at admission.
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens whose K/V are in the cache (prefill progress; reset to 0
            by recompute preemption).
        status: :class:`RequestStatus`.
        arrival_time: ``time.monotonic()`` at arrival, seconds.
        first_scheduled_time, first_token_time, last_token_time: monotonic seconds or None.
        num_preemptions: how often this request was preempted.
        generator: per-request RNG owned by the sampler (a ``torch.Generator``) or None.
        stop_reason: the stop string or token id that ended it, if any.
        cache_salt: isolates this request's prefix-cache entries (vLLM's ``cache_salt``): blocks
            are only shared between requests with the same salt. None = the shared namespace.
        lora_id: LoRA adapter id (part of the block hash; None = the base model).
        block_hashes: chained hashes of this request's full blocks, in token order (filled by
            the KV cache manager as blocks fill; ``block_hashes[k]`` covers tokens
            ``[0, (k + 1) * block_size)``).
        num_cached_tokens: prompt tokens found in the prefix cache when first scheduled
            (``usage.prompt_tokens_details.cached_tokens``); -1 before it was scheduled.
        fork_of: for choices 1..n-1 of an n > 1 or beam-search request, the choice they share
            prompt blocks with (copy-on-write); None otherwise.
        swapped_out: True while its KV lives in the host swap pool (swap preemption).
        progress_at_swap_in: ``num_tokens`` when it was last swapped in (-1 = never): the
            anti-thrashing guard only swaps out a request again once it has made progress.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 16)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        self.generator: Any = None
        self.stop_reason: str | int | None = None
        self.cache_salt: str | None = None
        self.lora_id: int | None = None
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1
        self.fork_of: Request | None = None
        self.swapped_out = False
        self.progress_at_swap_in = -1

    @property
    def extra_keys(self) -> tuple | None:
        """Extra keys mixed into every block hash: ``(lora_id, cache_salt)``, None when both are unset."""
        if self.lora_id is None and self.cache_salt is None:
            return None
        return (self.lora_id, self.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_max_output(self) -> int:
        """Tokens the request can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
