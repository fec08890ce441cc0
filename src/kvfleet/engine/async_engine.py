"""Asynchronous front of the engine for the server: a background engine thread and
per-request async streams.

The engine loop runs in its own thread (torch releases the GIL inside its kernels), so the
HTTP event loop keeps accepting, tokenizing and streaming while the forward pass runs. Requests
and aborts reach the loop through a thread-safe inbox; outputs come back to each request's
asyncio queue through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kvfleet.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.stats import StepStats
from kvfleet.errors import EngineDeadError, InvalidRequestError
from kvfleet.sampling_params import SamplingParams

logger = logging.getLogger("kvfleet.engine")

_STOP = object()
_T = TypeVar("_T")
#: hook run after tokenization, before queueing: ``(request_id, prompt_token_ids)`` -> a callable
#: the engine thread runs right before it queues the request (or None).
BeforeAdmit = Callable[[str, list[int]], Awaitable[Callable[[LLMEngine], Any] | None]]


class RequestStream:
    """Async iterator over one request's :class:`RequestOutput` s (choices that changed in a
    step, with deltas). Ends after the output with ``finished=True``.

    Raises (from ``__anext__``):
        QueueFullError / KVFleetError: admission failed in the engine thread.
        EngineDeadError: the engine loop died.
    """

    def __init__(self, request_id: str, engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    # called from the engine thread
    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # event loop closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is _STOP:
            self.finished = True
            raise StopAsyncIteration
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request and free its KV blocks (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    """The engine behind the HTTP server.

    Args:
        config: engine configuration; the model is loaded here (seconds).
        engine: an existing :class:`LLMEngine` to wrap instead (tests).
    """

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(config or EngineConfig())
        self.engine_config = self.engine.config
        self.model_name: str = self.engine.model_name
        self.tokenizer = self.engine.tokenizer
        self.max_model_len: int = self.engine.max_model_len
        self.block_size: int = self.engine.block_size
        self.num_blocks: int = self.engine.num_blocks
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.healthy = True
        self._stats: dict[str, Any] = self.engine.get_stats()
        self.engine.add_stat_logger(self._remember_stats)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvfleet-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread; pending streams end with :class:`EngineDeadError`."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ------------------------------------------------------------ API
    def add_stat_logger(self, fn: Callable[[StepStats], None]) -> None:
        """Call ``fn(StepStats)`` from the engine thread after every step."""
        self.engine.add_stat_logger(fn)

    def get_stats(self) -> dict[str, Any]:
        """Latest queue sizes and KV pool state (a snapshot taken after the last step)."""
        return dict(self._stats)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """See :meth:`LLMEngine.apply_chat_template`."""
        return self.engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> RequestStream:
        """Validate and submit a request; must be called from a running event loop.

        Raises:
            InvalidRequestError, RequestTooLongError: bad input (validated here, synchronously).
            QueueFullError: the waiting queue is over ``--max-waiting-requests``.
            EngineDeadError: the engine loop died.
        """
        if not self.healthy:
            raise EngineDeadError("the engine loop has died; restart the server")
        return self._submit(self.engine.prepare_request(request_id, prompt, params, cache_salt=cache_salt), params)

    async def add_request_async(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        before_admit: BeforeAdmit | None = None,
    ) -> RequestStream:
        """:meth:`add_request` with tokenization in a worker thread, so a long prompt never stalls
        the event loop (the tokenizer releases the GIL). Same errors.

        Args:
            before_admit: awaited with ``(request_id, prompt_token_ids)`` once the request is
                validated; a callable it returns runs in the engine thread right before the
                request is queued, in the same inbox item (no step in between). P/D
                disaggregation fetches the prompt's KV here and imports it there
                (:class:`kvfleet.engine.kv_transfer.KVTransferClient`). An exception in that
                callable is logged and the request is queued anyway.
        """
        if not self.healthy:
            raise EngineDeadError("the engine loop has died; restart the server")
        group = await asyncio.to_thread(self.engine.prepare_request, request_id, prompt, params, None, cache_salt)
        pre = await before_admit(group.request_id, list(group.prompt_token_ids)) if before_admit else None
        return self._submit(group, params, pre)

    async def run_in_engine(self, fn: Callable[[LLMEngine], _T]) -> _T:
        """Run ``fn(engine)`` in the engine thread between two steps (never during a forward pass)
        and return its result; an exception it raises is raised here. For work that reads or
        writes the KV pool, such as P/D KV export (:func:`kvfleet.engine.kv_transfer.export_kv`).

        Raises:
            EngineDeadError: the engine loop is dead or stops before running ``fn``.
        """
        if not self.healthy:
            raise EngineDeadError("the engine loop has died; restart the server")
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        self._wake.set()
        if self._stop.is_set() or not self.healthy:
            self._fail_pending_calls(EngineDeadError("the engine was shut down"))
        return await asyncio.wrap_future(fut)

    def _submit(self, group: Any, params: SamplingParams, pre: Callable[[LLMEngine], Any] | None = None
                ) -> RequestStream:
        request_id = group.request_id
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            # num_waiting is read racily from the engine thread: a near-exact check here, the exact
            # one in LLMEngine.add_prepared (whose QueueFullError then ends the stream).
            self.engine.check_queue_bound(len(group.choices), num_pending=self._pending_adds)
            stream = RequestStream(request_id, self, loop)
            self._streams[request_id] = stream
            self._pending_adds += len(group.choices)
        self._inbox.put(("add", (group, pre)))
        self._wake.set()
        return stream

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request`, then yield its outputs; aborts the request if the consumer
        stops early (break, cancellation, client disconnect)."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (idempotent); its blocks are freed by the engine thread."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------ engine thread
    def _remember_stats(self, stats: StepStats) -> None:
        self._stats = {
            **self._stats,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_free_blocks": self.engine.kv_cache_manager.num_free_blocks,
        }

    def _drain_inbox(self) -> bool:
        did = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return did
            did = True
            if kind == "call":
                fn, fut = payload
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            elif kind == "add":
                payload, pre = payload
                rid = payload.request_id
                with self._lock:
                    self._pending_adds -= len(payload.choices)
                    stream = self._streams.get(rid)
                if pre is not None and stream is not None and not stream.finished:
                    try:
                        pre(self.engine)
                    except Exception:
                        logger.exception("pre-admission hook of %s failed; queueing it anyway", rid)
                try:
                    self.engine.add_prepared(payload)
                except Exception as e:  # admission failed after the fast checks (e.g. a race)
                    self._finish_stream(rid, e)
                    continue
                if stream is None or stream.finished:  # aborted before it was queued
                    self.engine.abort_request(rid)
            elif kind == "abort":
                out = self.engine.abort_request(payload)
                self._finish_stream(payload, out if out is not None else _STOP)

    def _fail_pending_calls(self, err: BaseException) -> None:
        """Fail the ``run_in_engine`` calls still in the inbox (the loop is gone); other items
        are kept (their streams get the engine's own error)."""
        keep = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                if payload[1].set_running_or_notify_cancel():
                    payload[1].set_exception(err)
            else:
                keep.append((kind, payload))
        for item in keep:
            self._inbox.put(item)

    def _finish_stream(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(item)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                did = self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    if did:
                        self.engine.step()  # flush stats (gauges, aborted requests)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    if out.finished:
                        self._finish_stream(out.request_id, out)
                    else:
                        with self._lock:
                            stream = self._streams.get(out.request_id)
                        if stream is not None:
                            stream._put(out)
        except Exception as e:
            logger.exception("engine loop died")
            self.healthy = False
            err = EngineDeadError(f"engine loop died: {e!r}")
            self._fail_pending_calls(err)
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                s._put(err)
            return
        self._fail_pending_calls(EngineDeadError("the engine was shut down"))
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            s._put(EngineDeadError("the engine was shut down"))
