"""Engine outputs (shapes follow vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob data of one generated token.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability under the model's (unprocessed) distribution.
        top: the ``k`` most likely ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SampleResult:
    """What the runner's sampler returns for one request in a step."""

    token_id: int
    logprob: TokenLogprob | None = None


@dataclass
class CompletionOutput:
    """One choice of a request.

    Attributes:
        index: choice index (0..n-1).
        text: full text so far (stop string removed unless ``include_stop_str_in_output``).
        token_ids: all generated token ids so far.
        delta_text: text new since the previous output of this choice (safe to stream:
            never broken UTF-8, never part of a stop string).
        delta_token_ids: token ids new since the previous output.
        logprobs: per generated token (when requested), all so far.
        delta_logprobs: the logprobs of ``delta_token_ids``.
        finish_reason: ``stop``, ``length``, ``abort`` or None while running.
        stop_reason: the stop string or stop token id that matched, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step.

    Attributes:
        request_id: the caller's request id.
        prompt: prompt text (None when given as token ids).
        prompt_token_ids: prompt tokens.
        outputs: for offline ``generate``: all n choices; for streams: the choices that changed
            in this step (each with its ``index``).
        finished: every choice has finished.
        num_cached_tokens: prompt tokens served from the prefix cache (0 without one).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
