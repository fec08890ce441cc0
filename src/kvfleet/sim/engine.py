"""The simulated engine's core: kvfleet's real scheduler and KV cache manager, stepped by an
asyncio task that sleeps a modelled step time instead of running a model.

Every step, exactly as in :class:`~kvfleet.engine.llm_engine.LLMEngine`: the real
:class:`~kvfleet.engine.core.scheduler.Scheduler` plans the batch (continuous batching, chunked
prefill, preemption) over a real :class:`~kvfleet.engine.core.kv_cache_manager.KVCacheManager`
(paged blocks, prefix caching with the chained-hash index). In place of the forward pass the
task sleeps :meth:`LatencyModel.step_time` of the step's prefill tokens, decode sequences and
KV-cache reads (times ``time_scale``), then every request that needs a sample gets a deterministic fake token
(:meth:`SimTokenizer.generated_token`). A prefix-cache hit therefore really skips prefill work
and shortens the time to first token, and KV-cache usage, queueing and preemption behave as in
the real engine under the same load. This is a *simulator*: no model is loaded, and the text it
generates is meaningless.

Output length: the simulated model never ends an answer by itself when a request sets
``max_tokens``: it generates exactly ``max_tokens`` tokens (``finish_reason = "length"``) whether
or not ``ignore_eos`` is set. A request without ``max_tokens`` ends after ``default_max_tokens``
tokens with ``finish_reason = "stop"`` (as if the model emitted EOS there), or, with
``ignore_eos``, runs to ``max_model_len`` (``"length"``). Stop strings and stop token ids are
accepted and ignored.

Everything runs on the event loop of the caller (no threads), so many engines share one loop.
Metrics (vLLM names, :class:`~kvfleet.server.metrics.ServerMetrics`) measure wall-clock seconds:
with ``time_scale`` 0.1 the latencies they report are 10x shorter than the modelled ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvfleet.config import DEFAULT_MODEL, SchedulerConfig
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler import Scheduler
from kvfleet.engine.core.scheduler_output import SchedulerOutput
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.engine.stats import FinishedRequestStats, StepStats
from kvfleet.errors import EngineDeadError, InvalidRequestError, RequestTooLongError
from kvfleet.sampling_params import SamplingParams
from kvfleet.server.metrics import ServerMetrics
from kvfleet.sim.latency import DEFAULT_LATENCY, LatencyModel, StepWork
from kvfleet.sim.tokenizer import DEFAULT_VOCAB_SIZE, SimTokenizer

logger = logging.getLogger(__name__)

#: KV blocks (of 16 tokens) that ``kvfleet serve``'s default 2 GiB pool holds for SmolLM2-135M
#: in fp32: 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes x 16 tokens = 737,280 bytes a block.
DEFAULT_NUM_KV_BLOCKS = 2 * 2**30 // (2 * 30 * 3 * 64 * 4 * 16)
#: SmolLM2-135M's context length, tokens (the default ``max_model_len`` cap).
DEFAULT_CONTEXT_LEN = 8192


@dataclass
class SimEngineConfig:
    """Settings of one simulated engine (flag names follow ``kvfleet serve`` / vLLM).

    Attributes:
        model_name: the model name served and reported (the simulator loads no weights).
        block_size: tokens per KV block (``--block-size``).
        num_kv_blocks: KV pool size in blocks (``--num-kv-blocks``).
        enable_prefix_caching: reuse cached prompt prefixes (chained block hashes, vLLM-style).
        max_num_seqs: most requests running in one step (``--max-num-seqs``).
        max_num_batched_tokens: token budget of one step (``--max-num-batched-tokens``).
        max_model_len: longest sequence (prompt + output) in tokens; None = ``min(8192, pool tokens)``.
        max_waiting_requests: waiting-queue bound (HTTP 503 above it); None = unbounded.
        default_max_tokens: output tokens of a request that sets no ``max_tokens`` (then it ends
            with ``finish_reason = "stop"``, as if the model emitted EOS).
        latency: the step-latency model (seconds).
        time_scale: factor on every modelled sleep (0.1 runs 10x faster; 0 = no sleeping).
        vocab_size: token ids of the simulated tokenizer are in ``[0, vocab_size)``.

    Raises:
        ValueError: a value out of range.
    """

    model_name: str = DEFAULT_MODEL
    block_size: int = 16
    num_kv_blocks: int = DEFAULT_NUM_KV_BLOCKS
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting_requests: int | None = 1024
    default_max_tokens: int = 256
    latency: LatencyModel = field(default_factory=lambda: DEFAULT_LATENCY)
    time_scale: float = 1.0
    vocab_size: int = DEFAULT_VOCAB_SIZE

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not self.time_scale >= 0 or self.time_scale == float("inf"):
            raise ValueError(f"time_scale must be a finite number >= 0, got {self.time_scale}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")

    @property
    def resolved_max_model_len(self) -> int:
        """``max_model_len``, or ``min(8192, num_kv_blocks * block_size)`` when unset (tokens)."""
        if self.max_model_len is not None:
            return self.max_model_len
        return min(DEFAULT_CONTEXT_LEN, self.num_kv_blocks * self.block_size)


@dataclass
class SimDelta:
    """What one step added to a request.

    Attributes:
        token_ids: the new token ids (one, or none for a final abort).
        text: their text.
        finish_reason: ``length``, ``stop`` or ``abort`` on the request's last delta, else None.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class _State:
    """Engine-side bookkeeping of one request."""

    __slots__ = ("request", "queue", "seed", "limit_status")

    def __init__(self, request: Request, seed: int, limit_status: RequestStatus) -> None:
        self.request = request
        self.queue: asyncio.Queue[SimDelta | BaseException] = asyncio.Queue()
        self.seed = seed
        self.limit_status = limit_status


class SimStream:
    """The outputs of one request of a :class:`SimEngine`: iterate with ``async for`` to get its
    :class:`SimDelta` values; the last one has a ``finish_reason``.

    Attributes:
        request_id: the request's id.
        num_prompt_tokens: prompt length in tokens.
    """

    def __init__(self, engine: SimEngine, state: _State) -> None:
        self._engine = engine
        self._state = state
        self.request_id = state.request.request_id
        self.num_prompt_tokens = state.request.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until the request was scheduled)."""
        return max(0, self._state.request.num_cached_tokens)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return self._state.request.num_output_tokens

    def abort(self) -> None:
        """Abort the request (frees its KV blocks); idempotent, a no-op once it finished."""
        self._engine.abort(self.request_id)

    def __aiter__(self) -> AsyncIterator[SimDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SimDelta]:
        """Yields deltas until the one with a finish reason.

        Raises:
            EngineDeadError: the engine loop died or was closed under the request.
        """
        while True:
            item = await self._state.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


def step_work(sched: SchedulerOutput) -> StepWork:
    """The work of a planned step, for the latency model.

    A scheduled request is a decode when it computes exactly one token past its prompt (its
    previous generated token); everything else (prompt chunks, and the recompute of a preempted
    request's prompt and output) counts as prefill tokens. Every request that starts past position
    0 reads its context from the KV cache: ``start_pos + num_new_tokens`` tokens.

    Returns:
        The step's :class:`~kvfleet.sim.latency.StepWork`.
    """
    prefill = decode = kv_read = 0
    for s in sched.scheduled:
        if s.num_new_tokens == 1 and s.start_pos >= s.request.num_prompt_tokens:
            decode += 1
        else:
            prefill += s.num_new_tokens
        if s.start_pos > 0:
            kv_read += s.start_pos + s.num_new_tokens
    return StepWork(prefill, decode, kv_read)


class SimEngine:
    """A simulated LLM engine (see the module docstring): real scheduling and KV bookkeeping,
    modelled step latency, fake tokens.

    Use from inside a running event loop: :meth:`start` the step task, :meth:`add_request` to get
    a :class:`SimStream`, :meth:`close` at the end.

    Args:
        config: the engine's :class:`SimEngineConfig`.
        name: a label for logs and the ``x-kvfleet-sim-engine`` response header.

    Attributes:
        config, tokenizer (:class:`SimTokenizer`), scheduler, kv_cache_manager, metrics
        (:class:`ServerMetrics`, fed every step), max_model_len (tokens), block_size, num_blocks.
        num_steps: steps run; total_work: their summed :class:`StepWork`; total_modelled_s: their
            summed modelled time in seconds (before ``time_scale``).
    """

    def __init__(self, config: SimEngineConfig | None = None, name: str = "sim-0") -> None:
        self.config = config = config or SimEngineConfig()
        self.name = name
        self.model_name = config.model_name
        self.tokenizer = SimTokenizer(config.vocab_size)
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks
        self.max_model_len = config.resolved_max_model_len
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size,
                                               enable_prefix_caching=config.enable_prefix_caching,
                                               prefix_cache="hash")
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len, max_waiting_requests=config.max_waiting_requests),
            self.kv_cache_manager, self.max_model_len)
        self.metrics = ServerMetrics(config.model_name, max_model_len=self.max_model_len,
                                     block_size=config.block_size, num_blocks=config.num_kv_blocks)
        self._requests: dict[str, _State] = {}
        self._finished_stats: list[FinishedRequestStats] = []  # aborts between steps
        self._kv_counters = (0, 0)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False
        #: cumulative work and modelled time of all steps (for tests, logs and benchmarks).
        self.num_steps = 0
        self.total_work = StepWork()
        self.total_modelled_s = 0.0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the step task on the running event loop.

        Raises:
            RuntimeError: no running loop, or already started.
        """
        if self._task is not None:
            raise RuntimeError(f"simulated engine {self.name} already started")
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"kvfleet-sim-{self.name}")

    async def close(self) -> None:
        """Stop the step task and end every unfinished request with ``finish_reason = "abort"``."""
        self._closed = True
        for rid in list(self._requests):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already logged by the loop
                pass

    @property
    def healthy(self) -> bool:
        """True while the step task runs (started, not closed, not crashed)."""
        return self._task is not None and not self._task.done() and self._dead is None and not self._closed

    # ------------------------------------------------------------------ prompts

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a completion prompt (text, or token ids checked against the vocabulary).

        Raises:
            InvalidRequestError: an empty prompt or a token id outside ``[0, vocab_size)``.
            RequestTooLongError: more tokens than ``max_model_len`` (text is measured before it
                is tokenized).
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"{param} must not be empty", param=param)
            self._check_len(self.tokenizer.num_tokens(prompt), param)
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise InvalidRequestError(f"{param} must be a non-empty string or list of token ids", param=param)
        v = self.tokenizer.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < v:
                raise InvalidRequestError(f"prompt token id {t!r} is not in [0, {v})", param=param)
        self._check_len(len(prompt), param)
        return list(prompt)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of chat messages rendered by :meth:`SimTokenizer.render_chat` (content
        already flattened to strings).

        Raises:
            RequestTooLongError: the rendered conversation is longer than ``max_model_len`` tokens.
        """
        text = self.tokenizer.render_chat(messages, add_generation_prompt)
        self._check_len(self.tokenizer.num_tokens(text), "messages")
        return self.tokenizer.encode(text)

    def _check_len(self, n: int, param: str) -> None:
        if n >= self.max_model_len:
            raise RequestTooLongError(
                f"the prompt is {n} tokens, but this simulated model's maximum context length is "
                f"{self.max_model_len} tokens (no room to generate)", param=param)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int | None = None,
                    ignore_eos: bool = False, cache_salt: str | None = None) -> SimStream:
        """Queue a request and return its :class:`SimStream`.

        Args:
            request_id: unique among unfinished requests.
            prompt_token_ids: the prompt (from :meth:`tokenize_prompt` / :meth:`chat_prompt_ids`).
            max_tokens: output tokens to generate (exactly, ``finish_reason = "length"``); None =
                ``default_max_tokens`` (``"stop"``) or, with ``ignore_eos``, up to ``max_model_len``.
            ignore_eos: see ``max_tokens``.
            cache_salt: prefix-cache namespace (vLLM's ``cache_salt``).

        Raises:
            EngineDeadError: the engine is not running.
            InvalidRequestError: empty prompt, ``max_tokens < 1``, duplicate id.
            RequestTooLongError: prompt + max_tokens over ``max_model_len`` or the whole pool.
            QueueFullError: ``max_waiting_requests`` requests are waiting.
        """
        if not self.healthy:
            raise EngineDeadError(f"simulated engine {self.name} is not running")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        n_prompt = len(prompt_token_ids)
        self._check_len(n_prompt, "prompt")
        room = self.max_model_len - n_prompt
        limit_status = RequestStatus.FINISHED_LENGTH
        if max_tokens is None:
            if ignore_eos:
                max_tokens = room
            else:
                max_tokens = min(self.config.default_max_tokens, room)
                if max_tokens == self.config.default_max_tokens:
                    limit_status = RequestStatus.FINISHED_STOPPED
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
        elif max_tokens > room:
            raise RequestTooLongError(
                f"this simulated model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} max_tokens)",
                param="max_tokens")
        req = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                      eos_token_id=None, max_tokens=max_tokens)
        req.cache_salt = cache_salt
        self.scheduler.add_request(req)  # admission control: too long for the pool, queue full
        state = _State(req, self.tokenizer.prompt_seed(prompt_token_ids), limit_status)
        self._requests[request_id] = state
        assert self._wake is not None
        self._wake.set()
        return SimStream(self, state)

    def abort(self, request_id: str) -> None:
        """Abort an unfinished request: free its blocks, end its stream with ``"abort"``. Idempotent."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        req = state.request
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self._finished_stats.append(self._finish_stats(req, time.monotonic()))
        state.queue.put_nowait(SimDelta([], "", "abort"))
        if self._wake is not None:
            self._wake.set()  # an idle loop publishes the abort's stats

    def get_stats(self) -> dict[str, Any]:
        """Queue sizes and KV pool state, like :meth:`LLMEngine.get_stats`."""
        kv = self.kv_cache_manager
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_cache_usage": kv.usage, "num_blocks": self.num_blocks, "num_free_blocks": kv.num_free_blocks,
                "block_size": self.block_size}

    def refresh_gauges(self) -> None:
        """Set the metrics' running / waiting / KV-usage gauges from the scheduler now."""
        self.metrics.set_gauges(self.scheduler.num_running, self.scheduler.num_waiting,
                                self.kv_cache_manager.usage)

    # ------------------------------------------------------------------ step loop

    @staticmethod
    def _finish_stats(req: Request, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(
            finish_reason=req.status.finish_reason or "abort", e2e_latency=now - req.arrival_time,
            queue_time=(req.first_scheduled_time - req.arrival_time) if req.first_scheduled_time else 0.0,
            num_prompt_tokens=req.num_prompt_tokens, num_generation_tokens=req.num_output_tokens)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        try:
            while True:
                if not self.scheduler.has_unfinished():
                    if self._finished_stats:
                        self._publish(StepStats())
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                t0 = loop.time()
                sched = self.scheduler.schedule()
                work = step_work(sched)
                modelled = self.config.latency.step_time(work)
                self.total_modelled_s += modelled
                t = self.total_work
                self.total_work = StepWork(t.prefill_tokens + work.prefill_tokens, t.decode_seqs + work.decode_seqs,
                                           t.kv_read_tokens + work.kv_read_tokens)
                delay = modelled * self.config.time_scale
                if sched.is_empty:  # nothing could be scheduled: do not spin
                    delay = max(delay, 0.001)
                await asyncio.sleep(max(0.0, t0 + delay - loop.time()))
                self._finish_step(sched)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("simulated engine %s: step loop failed", self.name)
            self._dead = e
            for rid, state in list(self._requests.items()):
                self._requests.pop(rid, None)
                state.queue.put_nowait(EngineDeadError(f"simulated engine {self.name} failed: {e}"))
            raise

    def _finish_step(self, sched: SchedulerOutput) -> None:
        """After the modelled sleep: give every request that needs one its fake token, finish
        those at their limit, publish the step's stats."""
        self.num_steps += 1
        now = time.monotonic()
        stats = StepStats(num_preemptions=len(sched.preempted))
        for s in sched.scheduled:
            req = s.request
            if not s.needs_sample or req.is_finished:
                continue  # a prefill chunk short of the prompt's end, or aborted during the sleep
            state = self._requests[req.request_id]
            token_id, text = self.tokenizer.generated_token(state.seed, req.num_output_tokens)
            req.append_output_token(token_id)
            stats.record_token(req, now)
            finish = None
            if req.num_output_tokens >= req.max_tokens:
                self.scheduler.finish_request(req, state.limit_status)
                del self._requests[req.request_id]
                stats.finished.append(self._finish_stats(req, now))
                finish = req.status.finish_reason
            state.queue.put_nowait(SimDelta([token_id], text, finish))
        self._publish(stats)

    def _publish(self, stats: StepStats) -> None:
        stats.finished.extend(self._finished_stats)
        self._finished_stats = []
        kv = self.kv_cache_manager
        q0, h0 = self._kv_counters
        self._kv_counters = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        stats.prefix_cache_queries = kv.prefix_cache_queries - q0
        stats.prefix_cache_hits = kv.prefix_cache_hits - h0
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_cache_usage = kv.usage
        self.metrics.record(stats)
