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
from kvfleet.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager, kv_cache_groups
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.detokenizer import IncrementalDetokenizer
from kvfleet.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.engine.stats import FinishedRequestStats, StepStats
from kvfleet.errors import InvalidRequestError, QueueFullError, RequestTooLongError
from kvfleet.sampling_params import SamplingParams

logger = logging.getLogger("kvfleet.engine")

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _quantized(loaded: Any, method: str) -> Any:
    """A copy of ``loaded`` (which the caller may share, e.g. tests) with its model quantized by
    ``method`` (:mod:`kvfleet.model.layers.quantization`)."""
    import copy
    import time

    from kvfleet.model.layers.quantization import quantize_model

    t0 = time.monotonic()
    model = copy.deepcopy(loaded.model)
    n = quantize_model(model, method)
    logger.info("quantization %s: %d layers in %.1fs", method, n, time.monotonic() - t0)
    return dataclasses.replace(loaded, model=model)


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
class _BeamState:
    """Beam-search state of a request group: one child :class:`Request` per beam slot."""

    width: int
    max_tokens: int
    scores: list[float] = field(default_factory=list)  # running beams' cumulative logprobs
    token_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # finished hypotheses, best first: (normalized score, cumulative logprob, tokens, logprobs, reason, last token)
    finished: list[tuple[float, float, list[int], list[TokenLogprob], str, int]] = field(default_factory=list)
    pending: dict[int, Any] = field(default_factory=dict)  # slot -> SampleResult of this step
    improvable: bool = True
    started: bool = False

    def __post_init__(self) -> None:
        self.scores = [0.0] * self.width
        self.token_logprobs = [[] for _ in range(self.width)]


@dataclass
class _Group:
    """A user request: its prompt and its n choices (or its beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)
    beam: _BeamState | None = None

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
        if loaded is None:
            self.loaded = load_model(config.model, dtype=dtype, quantization=config.quantization)
        elif config.quantization != "none":
            self.loaded = _quantized(loaded, config.quantization)
        else:
            self.loaded = loaded
        mc = self.loaded.config
        self.model_config = mc
        self.tokenizer = self.loaded.tokenizer
        self.model_name = config.served_model_name or (
            config.model if "/" not in config.model and not config.model.endswith(".gguf") else self.loaded.name
        )
        cc = config.cache
        self.block_size = cc.block_size
        # Layers of different windows (Gemma 3) get KV cache groups with their own block tables
        # over one pool of pages (hybrid_kv_cache_manager); a block is then a page of group_size layers.
        self.kv_cache_groups = kv_cache_groups(mc.layer_windows())
        page_layers = max(len(g.layers) for g in self.kv_cache_groups)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(mc, cc.block_size, dtype, cc.kv_cache_dtype,
                                                               num_layers=page_layers)
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
        hybrid = len(self.kv_cache_groups) > 1
        window = self.kv_cache_groups[0].sliding_window
        self.streaming = cc.kv_eviction == "streaming"
        sinks = 0
        if self.streaming:
            if window is not None or hybrid:
                raise ValueError("--kv-eviction streaming is not supported for models with a sliding window")
            if cc.enable_prefix_caching and cc.prefix_cache == "radix":
                raise ValueError("--kv-eviction streaming does not support --prefix-cache radix; use hash")
            window, sinks = cc.streaming_window, cc.sink_tokens
        self.num_host_blocks = cc.swap_space_bytes // bytes_per_block if cc.swap_space_bytes else 0
        self.kv_cache_manager: KVCacheManager | HybridKVCacheManager
        if hybrid:
            self.kv_cache_manager = HybridKVCacheManager(
                num_blocks, cc.block_size, [g.sliding_window for g in self.kv_cache_groups],
                enable_prefix_caching=cc.enable_prefix_caching, num_host_blocks=self.num_host_blocks,
                prefix_cache=cc.prefix_cache, max_step_tokens=sc.max_num_batched_tokens)
            if sc.max_model_len is None:  # the longest request the pool holds (global layers grow, local do not)
                self.max_model_len = min(model_len, self.kv_cache_manager.capacity_tokens)
        else:
            self.kv_cache_manager = KVCacheManager(num_blocks, cc.block_size,
                                                   enable_prefix_caching=cc.enable_prefix_caching,
                                                   sliding_window=window, num_host_blocks=self.num_host_blocks,
                                                   prefix_cache=cc.prefix_cache, sink_tokens=sinks)
        # The waiting-queue bound is applied per user request (all n choices together) here,
        # not per choice in the scheduler, so a request with n > bound is not refused forever.
        self.max_waiting_requests = sc.max_waiting_requests
        # With StreamingLLM eviction a sequence may grow past max_model_len (memory stays bounded).
        self.scheduler = Scheduler(dataclasses.replace(sc, max_waiting_requests=None), self.kv_cache_manager,
                                   2**62 if self.streaming else self.max_model_len)
        from kvfleet.model.sampler import Sampler

        self.runner = ModelRunner(self.loaded, cc.block_size, num_blocks, dtype=dtype,
                                  sampler=Sampler(seed=config.seed), kv_cache_dtype=cc.kv_cache_dtype,
                                  kv_cache_groups=self.kv_cache_groups,
                                  **({"streaming": (cc.sink_tokens, cc.streaming_window)} if self.streaming else {}))
        if self.num_host_blocks:
            self.runner.allocate_swap_space(self.num_host_blocks)
        self._kv_counters = (0, 0, 0)  # prefix-cache queries, hits, cow copies at the last step
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
            "KV cache: %d blocks x %d tokens = %d tokens, %s (%s per block, kv dtype %s)",
            num_blocks, cc.block_size, pool_tokens, _human_bytes(num_blocks * bytes_per_block),
            _human_bytes(bytes_per_block),
            config.dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype,
        )
        if hybrid:
            logger.info(
                "KV cache groups (a block is a page of %d layers): %s", page_layers,
                ", ".join(f"{'full' if g.sliding_window is None else f'window {g.sliding_window}'} "
                          f"layers {list(g.layers)}" for g in self.kv_cache_groups),
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
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> _Group:
        """Tokenize and validate a request and build its n choices, without queueing it.

        Safe to call from another thread than :meth:`step` (touches no scheduler state).
        Choices 1..n-1 (and the beams of a beam search) share choice 0's prompt blocks by ref
        count (copy-on-write) instead of computing the prompt again.

        Args:
            cache_salt: prefix-cache namespace (vLLM's ``cache_salt``): only requests with the
                same salt share cached blocks.

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
        if self.streaming:  # StreamingLLM: no length limit beyond the pool's bounded footprint
            max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
            if max_tokens < 1:
                raise RequestTooLongError(
                    f"the prompt is {n_prompt} tokens; with --kv-eviction streaming set max_tokens explicitly "
                    f"to generate past max_model_len ({self.max_model_len})", param="max_tokens")
        elif params.max_tokens is None:
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
        if not self.kv_cache_manager.can_ever_fit(n_prompt + max_tokens, self.scheduler.config.max_num_batched_tokens):
            raise RequestTooLongError(
                f"the request needs up to {n_prompt + max_tokens} tokens of KV cache, more than the whole pool "
                f"({self.num_blocks} blocks x {self.block_size} = {self.num_blocks * self.block_size} tokens)",
                param="max_tokens",
            )
        if params.use_beam_search:
            # The beams advance in lockstep: all of them must be able to run (and hold KV) at once.
            width = params.best_of or params.n
            max_seqs = self.scheduler.config.max_num_seqs
            if width > max_seqs:
                raise InvalidRequestError(
                    f"beam width {width} (best_of) exceeds --max-num-seqs {max_seqs}: the beams run together",
                    param="best_of")
            need = width * self.kv_cache_manager.max_blocks_held(n_prompt + max_tokens,
                                                                self.scheduler.config.max_num_batched_tokens)
            if need > self.num_blocks:
                raise RequestTooLongError(
                    f"beam search with {width} beams over up to {n_prompt + max_tokens} tokens may need {need} KV "
                    f"blocks at once, more than the pool's {self.num_blocks}", param="max_tokens")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        group = _Group(request_id, text, ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        beam = params.use_beam_search
        width = (params.best_of or params.n) if beam else params.n
        if beam:
            group.beam = _BeamState(width=width, max_tokens=max_tokens)
        for i in range(width):
            child_params = params
            if width > 1 or beam:
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = (params.seed + i) % 2**64  # stays a valid torch seed
                if beam:  # each beam needs the top 2 * width log-probabilities of its next token
                    child_params.temperature = 0.0
                    child_params.logprobs = 2 * width
            child_id = request_id if width == 1 and not beam else f"{request_id}-{i}"
            req = Request(child_id, ids, child_params, eos_token_id=self.eos_token_id,
                          max_tokens=max_tokens, arrival_time=now)
            req.cache_salt = cache_salt
            if i > 0:
                req.fork_of = group.choices[0].request
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
        arrival_time: float | None = None, cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request (see :meth:`prepare_request` and :meth:`add_prepared`)."""
        self.add_prepared(self.prepare_request(request_id, prompt, params or SamplingParams(), arrival_time,
                                               cache_salt))

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

    # P/D disaggregation: blocks imported for a request (kvfleet.engine.kv_transfer) stay pinned
    # until it is first scheduled, so that other requests' allocations cannot evict them meanwhile.
    _kv_pins: dict[str, list[Request]] | None = None

    def pin_imported_kv(self, request_id: str, placeholder: Request) -> None:
        """Keep the blocks ``placeholder`` holds in the KV cache manager (an import, see
        :func:`kvfleet.engine.kv_transfer.import_kv`) until request ``request_id`` is first
        scheduled, finishes, or turns out not to exist at the next step; then free them (they
        stay in the prefix cache). Call from the engine thread."""
        if self._kv_pins is None:
            self._kv_pins = {}
        self._kv_pins.setdefault(request_id, []).append(placeholder)

    def _release_kv_pins(self) -> None:
        assert self._kv_pins is not None
        for rid in list(self._kv_pins):
            group = self._groups.get(rid)
            if group is not None and not group.finished and group.choices[0].request.num_computed_tokens == 0:
                continue  # still waiting for its first step
            for placeholder in self._kv_pins.pop(rid):
                self.kv_cache_manager.free(placeholder)

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
        sched_ = self.scheduler
        swaps = (sched_.num_swap_outs, sched_.num_swap_ins)
        sched = sched_.schedule()
        if self._kv_pins:
            self._release_kv_pins()
        stats.num_preemptions = len(sched.preempted)
        stats.num_swap_outs = sched_.num_swap_outs - swaps[0]
        stats.num_swap_ins = sched_.num_swap_ins - swaps[1]
        changed: dict[str, list[CompletionOutput]] = {}
        beam_groups: dict[str, _Group] = {}
        if sched.is_empty and (sched.swap_out or sched.swap_in or sched.block_copies):
            self.runner.execute(sched)  # block moves only (e.g. the last running request swapped out)
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
                if group.beam is not None:
                    group.beam.pending[choice.index] = res
                    beam_groups[group.request_id] = group
                    continue
                self._append_token(choice, res, now, stats)
                changed.setdefault(group.request_id, []).append(self._choice_output(choice, now, stats))
        beam_done = []
        for group in beam_groups.values():
            if self._beam_advance(group, now, stats):
                beam_done.append(group)
        outputs = [self._group_output(self._groups[rid], chs) for rid, chs in changed.items()]
        outputs.extend(self._beam_output(g) for g in beam_done)
        kv = self.kv_cache_manager
        q0, h0, c0 = self._kv_counters
        self._kv_counters = (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.num_cow_copies)
        stats.prefix_cache_queries = kv.prefix_cache_queries - q0
        stats.prefix_cache_hits = kv.prefix_cache_hits - h0
        stats.num_cow_copies = kv.num_cow_copies - c0
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
        stats.record_token(req, now)
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
        if status is None and (req.num_output_tokens >= req.max_tokens
                               or (req.num_tokens >= self.max_model_len and not self.streaming)):
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
            num_cached_tokens=max(0, group.choices[0].request.num_cached_tokens),
        )

    # ------------------------------------------------------------------ beam search

    def _beam_advance(self, group: _Group, now: float, stats: StepStats) -> bool:
        """One beam-search step for ``group`` once every live beam has its next-token
        log-probabilities; returns True when the search is over (all beams finished).

        Follows Hugging Face transformers' ``_beam_search`` (itself the classic beam search with
        length penalty, Wu et al. 2016): candidates are the top ``2 * width`` of
        ``beam score + log p(token)`` over all beams; the top ``width`` candidates that end in
        EOS / a stop token (or reach ``max_tokens``) become finished hypotheses scored by
        ``sum logprob / generated_len ** length_penalty``; the best ``width`` others continue.
        Continuing beams fork the KV blocks of the beam they extend (copy-on-write).
        """
        bs = group.beam
        assert bs is not None
        reqs = [c.request for c in group.choices]
        if len(bs.pending) < len(reqs) or any(
                r.num_computed_tokens != r.num_tokens or r.swapped_out for r in reqs):
            return False  # some beam is not there yet (e.g. preempted and recomputing)
        params = group.params
        width = bs.width
        gen_len = reqs[0].num_output_tokens + 1  # generated length including the new token
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        blocked = gen_len <= params.min_tokens  # EOS / stop tokens are not allowed yet
        cands: list[tuple[float, int, int, float, list[tuple[int, float]]]] = []
        # All beams hold the same prompt at first: expand beam 0 only (transformers starts the
        # other beams at score -1e9 for the same reason).
        for slot in range(width if bs.started else 1):
            res = bs.pending[slot]
            top = res.logprob.top if res.logprob is not None else []
            for tok, lp in top:
                if blocked and tok in stop_ids:
                    continue
                cands.append((bs.scores[slot] + lp, slot, tok, lp, top))
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * width]
        at_max = gen_len >= bs.max_tokens or len(group.prompt_token_ids) + gen_len >= self.max_model_len
        hits = [at_max or c[2] in stop_ids for c in cands]
        running = [c for c, h in zip(cands, hits) if not h][:width]
        may_add = bs.improvable and not (params.early_stopping is True and len(bs.finished) >= width)
        if may_add:
            for c, h in zip(cands[:width], hits[:width]):
                if h:
                    score, slot, tok, lp, top = c
                    tokens = reqs[slot].output_token_ids + [tok]
                    lps = bs.token_logprobs[slot] + [TokenLogprob(tok, lp, top[: params.logprobs or 0])]
                    reason = "length" if tok not in stop_ids else "stop"
                    bs.finished.append((score / gen_len ** params.length_penalty, score, tokens, lps, reason, tok))
            bs.finished.sort(key=lambda f: -f[0])
            del bs.finished[width:]
        if running and len(bs.finished) >= width:
            best_len = gen_len
            if params.early_stopping == "never" and params.length_penalty > 0:
                best_len = bs.max_tokens
            best_possible = running[0][0] / best_len ** params.length_penalty
            if not best_possible > min(f[0] for f in bs.finished):
                bs.improvable = False
        done = (not bs.improvable or (params.early_stopping is True and len(bs.finished) >= width)
                or all(hits) or not running)
        bs.pending.clear()
        bs.started = True
        if done:
            for c in group.choices:
                self.scheduler.finish_request(c.request, RequestStatus.FINISHED_STOPPED)
                c.request.first_token_time = c.request.first_token_time or now
            return True
        # Continue: beam j extends running[j]'s source beam with its token.
        num_tokens = reqs[0].num_tokens
        snapshot = [(list(r.output_token_ids), list(bs.token_logprobs[i])) for i, r in enumerate(reqs)]
        moves = [(reqs[j], reqs[c[1]]) for j, c in enumerate(running)]
        self.kv_cache_manager.reassign(moves, num_tokens)
        new_scores = []
        for j, (score, slot, tok, lp, top) in enumerate(running):
            r = reqs[j]
            toks, lps = snapshot[slot]
            r.output_token_ids = toks + [tok]
            bs.token_logprobs[j] = lps + [TokenLogprob(tok, lp, top[: params.logprobs or 0])]
            r.num_computed_tokens = num_tokens
            new_scores.append(score)
            if r.first_token_time is None:
                r.first_token_time = now
                stats.time_to_first_tokens.append(now - r.arrival_time)
                stats.num_prompt_tokens += r.num_prompt_tokens if j == 0 else 0
        # Fewer continuations than beams (only possible with tiny vocabularies): retire the rest.
        for j in range(len(running), width):
            self.scheduler.finish_request(reqs[j], RequestStatus.FINISHED_STOPPED)
        bs.scores = new_scores + [float("-inf")] * (width - len(running))
        stats.num_generation_tokens += len(running)
        return False

    def _beam_output(self, group: _Group) -> RequestOutput:
        """The final output of a finished beam search: the ``n`` best hypotheses, best first."""
        bs = group.beam
        assert bs is not None
        params = group.params
        now = time.monotonic()
        outs = []
        for i, (_norm, cum, tokens, lps, reason, last) in enumerate(bs.finished[: params.n]):
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=tokens, delta_text=text, delta_token_ids=list(tokens),
                logprobs=lps if params.logprobs is not None else None,
                delta_logprobs=lps if params.logprobs is not None else None,
                cumulative_logprob=cum, finish_reason=reason,
                stop_reason=last if reason == "stop" and last != self.eos_token_id else None,
            ))
        req0 = group.choices[0].request
        for c in group.choices:
            c.stats_done = True
        self._abort_stats.finished.append(FinishedRequestStats(
            finish_reason=outs[0].finish_reason if outs else "stop", e2e_latency=now - req0.arrival_time,
            queue_time=(req0.first_scheduled_time - req0.arrival_time) if req0.first_scheduled_time else 0.0,
            num_prompt_tokens=req0.num_prompt_tokens,
            num_generation_tokens=sum(len(o.token_ids) for o in outs)))
        self._groups.pop(group.request_id, None)
        for c in group.choices:
            self._child_to_group.pop(c.request.request_id, None)
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outs, finished=True,
                             num_cached_tokens=max(0, req0.num_cached_tokens))
