"""Per-request sampling parameters: the OpenAI fields plus vLLM's extras."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.errors import InvalidRequestError

MAX_LOGPROBS = 20
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass
class SamplingParams:
    """How to pick tokens for one request (semantics follow vLLM's ``SamplingParams``).

    Attributes:
        n: number of completions for the prompt (>= 1).
        temperature: 0 means greedy (argmax); otherwise logits are divided by it (>= 0).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` x the top probability, in [0, 1].
        seed: per-request seed; the same seed gives the same output whatever else is batched.
        presence_penalty, frequency_penalty: OpenAI penalties over generated tokens, in [-2, 2].
        repetition_penalty: CTRL-style penalty (> 0; 1 disables) over prompt and generated tokens.
        max_tokens: most tokens to generate; None = up to ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` are blocked until this many tokens are generated.
        stop: stop strings; the text is cut before them unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: keep generating after EOS.
        logprobs: None = no logprobs; k >= 0 = the sampled token's logprob plus the top k.
        skip_special_tokens: drop special tokens from the detokenized text.
        spaces_between_special_tokens: kept for vLLM compatibility.
        use_beam_search: beam search instead of sampling (vLLM's pre-v1 API; needs
            ``temperature == 0``): ``best_of`` beams (default ``n``, at most 10) are kept, the
            ``n`` best finished hypotheses are returned. Beams share KV blocks copy-on-write.
        best_of: beam width with ``use_beam_search`` (>= n). Without beam search only
            ``best_of == n`` (or None) is accepted.
        length_penalty: beam score = cumulative logprob / generated_length ** length_penalty.
        early_stopping: beam search stop rule (transformers' semantics): True = stop once
            ``best_of`` hypotheses are finished; False = stop when no running beam can beat the
            worst finished one at its current length; ``"never"`` = assume it can grow to
            ``max_tokens``.

    Raises:
        InvalidRequestError: a field is out of range (``param`` names it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                      "stop_token_ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field; raise :class:`InvalidRequestError` naming the first bad one."""

        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if self.n > 128:
            bad("n", f"n must be <= 128, got {self.n}")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", f"top_k must be -1 (disabled) or an integer >= 0, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            bad("seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                bad(name, f"{name} must be in [-2, 2], got {v!r}")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if not isinstance(self.use_beam_search, bool):
            bad("use_beam_search", f"use_beam_search must be a boolean, got {self.use_beam_search!r}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or isinstance(self.best_of, bool) or self.best_of < self.n
        ):
            bad("best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not is_num(self.length_penalty):
            bad("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or (
                isinstance(self.early_stopping, int) and not isinstance(self.early_stopping, bool)):
            bad("early_stopping", f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.use_beam_search:
            width = self.best_of or self.n
            if width > MAX_LOGPROBS // 2:
                bad("best_of", f"beam search supports at most {MAX_LOGPROBS // 2} beams, got {width}")
            if self.temperature != 0:
                bad("temperature", "beam search needs temperature 0")
            if self.stop:
                bad("stop", "stop strings are not supported with beam search; use stop_token_ids")
        elif self.best_of is not None and self.best_of != self.n:
            bad("best_of", "best_of > n is only supported with use_beam_search")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
