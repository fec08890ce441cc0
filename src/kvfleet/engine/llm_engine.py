"""The synchronous engine: schedule -> run the model -> sample -> detokenize -> outputs.

One :meth:`LLMEngine.step` is one iteration of continuous batching (Orca, Yu et al. 2022):
the scheduler picks prefill chunks and decodes within the token budget, the model runner
computes them over the paged KV cache (PagedAttention, Kwon et al. 2023) and samples, and
the engine appends tokens, checks stop conditions, and frees the blocks of finished requests.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.config import EngineConfig
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.engine.stats import FinishedRequestStats, StepStats
from kvfleet.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from kvfleet.sampling_params import SamplingParams
from kvfleet.utils import cdiv

logger = logging.getLogger("kvfleet.engine")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


@dataclass
class _Choice:
    """Engine-side state of one choice (one child :class:`Request`) of a request group."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float | None
    stats_done: bool = False
    num_sent: int = 0


@dataclass
class _Group:
    """A user request: its prompt and its n choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.choices)


class LLMEngine:
    """Offline engine over one model.

    Args:
        config: :class:`~kvfleet.config.EngineConfig`.
        loaded: an already loaded model (tests reuse one); loaded from ``config.model`` when None.

    Attributes:
        tokenizer: the transformers tokenizer of the model.
        num_blocks, block_size: KV pool size in blocks and tokens per block.
        max_model_len: longest sequence (prompt + output) in tokens.

    Raises:
        FileNotFoundError, ValueError: the model cannot be loaded, or the KV pool is too small
            for a single block.
    """

    def __init__(self, config: EngineConfig | None = None, loaded: Any = None) -> None:
        import torch

        from kvfleet.model.loader import load_model
        from kvfleet.model.runner import ModelRunner

        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, _DTYPES[config.dtype])
        self.loaded = loaded if loaded is not None else load_model(config.model, dtype=dtype)
        mc = self.loaded.config
        self.model_config = mc
        self.tokenizer = self.loaded.tokenizer
        self.model_name = config.served_model_name or (
            config.model if "/" not in config.model and not config.model.endswith(".gguf") else self.loaded.name
        )
        cc = config.cache
        self.block_size = cc.block_size
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(mc, cc.block_size, dtype)
        num_blocks = cc.num_kv_blocks or cc.kv_cache_memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"--kv-cache-memory {cc.kv_cache_memory_bytes} bytes is below one KV block "
                f"({bytes_per_block} bytes at block size {cc.block_size})"
            )
        self.num_blocks = num_blocks
        pool_tokens = num_blocks * cc.block_size
        model_len = mc.max_position_embeddings
        sc = config.scheduler
        if sc.max_model_len is not None:
            if sc.max_model_len > model_len:
                raise ValueError(
                    f"--max-model-len {sc.max_model_len} exceeds the model's context length {model_len}"
                )
            self.max_model_len = sc.max_model_len
        else:
            self.max_model_len = min(model_len, pool_tokens)
        self.eos_token_id = mc.eos_token_id if mc.eos_token_id is not None else self.tokenizer.eos_token_id
        self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size)
        # The waiting-queue bound is applied per user request (all n choices together) here,
        # not per choice in the scheduler, so a request with n > bound is not refused forever.
        self.max_waiting_requests = sc.max_waiting_requests
        self.scheduler = Scheduler(dataclasses.replace(sc, max_waiting_requests=None), self.kv_cache_manager,
                                   self.max_model_len)
        from kvfleet.model.sampler import Sampler

        self.runner = ModelRunner(self.loaded, cc.block_size, num_blocks, dtype=dtype,
                                  sampler=Sampler(seed=config.seed))
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, tuple[_Group, _Choice]] = {}
        self._stat_loggers: list[Callable[[StepStats], None]] = []
        self._abort_stats = StepStats()  # finished-request stats of aborts, flushed by the next step
        self._max_token_chars: int | None = None
        logger.info(
            "model %s (%s, %s, sha256 %s): %d layers, vocab %d, max_model_len %d",
            self.model_name, self.loaded.path, self.loaded.format, self.loaded.sha256,
            mc.num_hidden_layers, mc.vocab_size, self.max_model_len,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %s (%s per block, dtype %s)",
            num_blocks, cc.block_size, pool_tokens, _human_bytes(num_blocks * bytes_per_block),
            _human_bytes(bytes_per_block), config.dtype,
        )

    # ------------------------------------------------------------------ requests

    def add_stat_logger(self, fn: Callable[[StepStats], None]) -> None:
        """Call ``fn(StepStats)`` after every step (from the thread that runs :meth:`step`)."""
        self._stat_loggers.append(fn)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Render chat ``messages`` with the model's chat template and tokenize the result.

        Message ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts.

        Raises:
            InvalidRequestError: malformed messages or a template error.
        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        norm = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise InvalidRequestError(
                            f"messages[{i}].content: only text parts are supported by this model", "messages"
                        )
                    parts.append(p["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts", "messages")
            norm.append({**m, "content": content})
        self._check_text_length(sum(len(m["content"]) for m in norm), "messages")
        template = self.loaded.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError(f"model {self.model_name} has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                norm, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=template, **kwargs
            )
        except Exception as e:  # jinja2 errors, raise_exception() in templates
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError, UnicodeError) as e:  # e.g. lone surrogates
            raise InvalidRequestError(f"the messages cannot be tokenized: {e}", param="messages") from e

    def _check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit ``max_model_len`` tokens whatever its
        tokenization (no token decodes to more than ``max_token_chars`` characters): tokenizing
        megabytes would take seconds for a certain rejection."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._max_token_chars = max(
                (len(self.tokenizer.convert_tokens_to_string([t])) for t in vocab if t is not None), default=1)
        if num_chars > self.max_model_len * max(self._max_token_chars, 1):
            raise RequestTooLongError(
                f"the {param} is {num_chars} characters, more than this model's maximum context length of "
                f"{self.max_model_len} tokens can hold", param=param)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            self._check_text_length(len(prompt), "prompt")
            try:
                return prompt, list(self.tokenizer.encode(prompt))
            except (TypeError, ValueError, UnicodeError) as e:  # e.g. lone surrogates
                raise InvalidRequestError(f"the prompt cannot be tokenized: {e}", param="prompt") from e
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError("prompt must be a non-empty string or list of token ids", param="prompt")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t!r} is not in [0, {vocab})", param="prompt")
        return None, list(prompt)

    def prepare_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> _Group:
        """Tokenize and validate a request and build its n choices, without queueing it.

        Safe to call from another thread than :meth:`step` (touches no scheduler state).

        Raises:
            InvalidRequestError: empty prompt, token id outside the vocabulary, duplicate id.
            RequestTooLongError: prompt + max_tokens over ``max_model_len``, or more KV blocks
                than the whole pool.
        """
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: a SamplingParams may have been changed after it was built
        text, ids = self._tokenize(prompt)
        n_prompt = len(ids)
        if params.max_tokens is None:
            if n_prompt >= self.max_model_len:
                raise RequestTooLongError(
                    f"the prompt is {n_prompt} tokens, but this model's maximum context length is "
                    f"{self.max_model_len} tokens (no room to generate)", param="prompt"
                )
            max_tokens = self.max_model_len - n_prompt
        else:
            max_tokens = params.max_tokens
            if n_prompt >= self.max_model_len:
                raise RequestTooLongError(
                    f"the prompt is {n_prompt} tokens, but this model's maximum context length is "
                    f"{self.max_model_len} tokens", param="prompt"
                )
            if n_prompt + max_tokens > self.max_model_len:
                raise RequestTooLongError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                    f"asks for {n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} max_tokens)",
                    param="max_tokens",
                )
        if cdiv(n_prompt + max_tokens, self.block_size) > self.num_blocks:
            raise RequestTooLongError(
                f"the request needs up to {n_prompt + max_tokens} tokens of KV cache, more than the whole pool "
                f"({self.num_blocks} blocks x {self.block_size} = {self.num_blocks * self.block_size} tokens)",
                param="max_tokens",
            )
        group = _Group(request_id, text, ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = (params.seed + i) % 2**64  # stays a valid torch seed
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(child_id, ids, child_params, eos_token_id=self.eos_token_id,
                          max_tokens=max_tokens, arrival_time=now)
            detok = IncrementalDetokenizer(self.tokenizer, ids, child_params)
            want_lp = params.logprobs is not None
            group.choices.append(_Choice(i, req, detok, [] if want_lp else None, 0.0 if want_lp else None))
        return group

    def add_prepared(self, group: _Group) -> None:
        """Queue a prepared request's choices (all or none).

        Raises:
            QueueFullError, RequestTooLongError: from the scheduler's admission control.
            InvalidRequestError: the request id is already in use.
        """
        if group.request_id in self._groups:
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        self.check_queue_bound(len(group.choices))
        added: list[Request] = []
        try:
            for c in group.choices:
                self.scheduler.add_request(c.request)
                added.append(c.request)
        except Exception:
            for r in added:
                self.scheduler.finish_request(r, RequestStatus.FINISHED_ABORTED)
            raise
        self._groups[group.request_id] = group
        for c in group.choices:
            self._child_to_group[c.request.request_id] = (group, c)

    def check_queue_bound(self, num_new: int, num_pending: int = 0) -> None:
        """Raise :class:`QueueFullError` when ``num_new`` more waiting choices would exceed
        ``--max-waiting-requests`` (an empty queue always takes one request, whatever its n)."""
        bound = self.max_waiting_requests
        waiting = self.scheduler.num_waiting + num_pending
        if bound is not None and waiting > 0 and waiting + num_new > bound:
            raise QueueFullError(
                f"the waiting queue is full ({waiting} waiting, --max-waiting-requests {bound}); retry later"
            )

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request (see :meth:`prepare_request` and :meth:`add_prepared`)."""
        self.add_prepared(self.prepare_request(request_id, prompt, params or SamplingParams(), arrival_time))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its choices) and free its KV blocks. Idempotent.

        Returns:
            a final :class:`RequestOutput` (finish_reason ``abort`` on unfinished choices), or
            None when the id is unknown or already finished.
        """
        group = self._groups.get(request_id)
        if group is None:
            return None
        changed = []
        now = time.monotonic()
        for c in group.choices:
            if not c.request.is_finished:
                self.scheduler.finish_request(c.request, RequestStatus.FINISHED_ABORTED)
                changed.append(self._choice_output(c, now, stats=self._abort_stats))
        return self._group_output(group, changed)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_stats(self) -> dict[str, Any]:
        """Queue sizes and KV pool state (used by ``/metrics`` and routers)."""
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "block_size": self.block_size,
        }

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration.

        Returns:
            one :class:`RequestOutput` per request that changed, holding only its changed
            choices (with deltas); ``finished`` is True on a request's last output.
        """
        stats = StepStats(finished=self._abort_stats.finished)
        self._abort_stats = StepStats()
        sched = self.scheduler.schedule()
        stats.num_preemptions = len(sched.preempted)
        changed: dict[str, list[CompletionOutput]] = {}
        if not sched.is_empty:
            try:
                results = self.runner.execute(sched)
            except Exception:
                logger.exception("model step failed; failing the %d requests in it", len(sched.scheduled))
                now = time.monotonic()
                for s in sched.scheduled:
                    entry = self._child_to_group.get(s.request.request_id)
                    if entry is None:
                        continue
                    self.scheduler.finish_request(s.request, RequestStatus.FINISHED_ERROR)
                    changed.setdefault(entry[0].request_id, []).append(self._choice_output(entry[1], now, stats))
                results = {}
            now = time.monotonic()
            for s in sched.scheduled:
                req = s.request
                res = results.get(req.request_id)
                if not s.needs_sample or res is None or req.is_finished:
                    continue
                group, choice = self._child_to_group[req.request_id]
                self._append_token(choice, res, now, stats)
                changed.setdefault(group.request_id, []).append(self._choice_output(choice, now, stats))
        outputs = [self._group_output(self._groups[rid], chs) for rid, chs in changed.items()]
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_cache_usage = self.kv_cache_manager.usage
        for fn in self._stat_loggers:
            try:
                fn(stats)
            except Exception:
                logger.exception("stat logger failed")
        return outputs

    def _append_token(self, choice: _Choice, res: Any, now: float, stats: StepStats) -> None:
        req = choice.request
        token = res.token_id
        req.append_output_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
            stats.time_to_first_tokens.append(now - req.arrival_time)
            stats.num_prompt_tokens += req.num_prompt_tokens
        elif req.last_token_time is not None:
            stats.inter_token_latencies.append(now - req.last_token_time)
        req.last_token_time = now
        stats.num_generation_tokens += 1
        if choice.logprobs is not None and res.logprob is not None:
            choice.logprobs.append(res.logprob)
            choice.cumulative_logprob = (choice.cumulative_logprob or 0.0) + res.logprob.logprob
        params = req.sampling_params
        status: RequestStatus | None = None
        if token == req.eos_token_id and not params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token
        else:
            stop_str = choice.detokenizer.add_tokens([token])
            if stop_str is not None:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop_str
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_request(req, status)

    def _choice_output(self, choice: _Choice, now: float, stats: StepStats | None) -> CompletionOutput:
        req = choice.request
        finished = req.is_finished
        delta_text = choice.detokenizer.get_delta(finished=finished)
        n_sent = choice.num_sent
        delta_ids = req.output_token_ids[n_sent:]
        choice.num_sent = req.num_output_tokens
        delta_lp = choice.logprobs[n_sent:] if choice.logprobs is not None else None
        if finished and stats is not None and not choice.stats_done:
            choice.stats_done = True
            stats.finished.append(FinishedRequestStats(
                finish_reason=req.status.finish_reason or "abort",
                e2e_latency=now - req.arrival_time,
                queue_time=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else 0.0,
                num_prompt_tokens=req.num_prompt_tokens,
                num_generation_tokens=req.num_output_tokens,
            ))
        return CompletionOutput(
            index=choice.index,
            text=choice.detokenizer.output_text,
            token_ids=list(req.output_token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=list(choice.logprobs) if choice.logprobs is not None else None,
            delta_logprobs=delta_lp,
            cumulative_logprob=choice.cumulative_logprob,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason,
        )

    def _group_output(self, group: _Group, changed: list[CompletionOutput]) -> RequestOutput:
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for c in group.choices:
                self._child_to_group.pop(c.request.request_id, None)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=changed,
            finished=finished,
        )
