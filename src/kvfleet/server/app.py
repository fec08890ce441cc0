"""OpenAI-compatible HTTP front end (FastAPI) over :class:`~kvfleet.engine.async_engine.AsyncLLM`.

Endpoints (like vLLM's OpenAI server):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: non-streamed JSON or SSE streams
  (``data: {json}\\n\\n`` chunks ending with ``data: [DONE]``), ``stream_options.include_usage``,
  logprobs in OpenAI's shapes, ``n`` choices.
- ``GET /v1/models``; ``GET /health`` (200 while the engine loop is alive, else 503);
  ``GET /metrics`` (Prometheus text, vLLM metric names); ``POST /tokenize``, ``POST /detokenize``.
- P/D disaggregation (:mod:`kvfleet.engine.kv_transfer`): ``POST /kvfleet/v1/kv/export`` sends the
  KV of a prompt's cached prefix to a decode engine; a completion request whose
  ``kv_transfer_params`` say ``do_remote_prefill`` with a ``remote_url`` pulls its prompt's KV
  from that prefill engine before it is queued (falling back to computing it here); one that says
  ``do_remote_decode`` gets ``kv_transfer_params`` back in its (non-streamed) response.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
requests (including malformed JSON and pydantic type errors, which FastAPI would report as
422), 401 for a missing / wrong API key on ``/v1/*``, 503 + ``Retry-After`` when the waiting
queue is full, 500 when the engine loop died.

A request whose client goes away (mid-stream or while waiting for a non-streamed answer) is
aborted, so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import kvfleet
from kvfleet.engine.outputs import RequestOutput, TokenLogprob
from kvfleet.errors import EngineDeadError, InvalidRequestError, KVFleetError, QueueFullError
from kvfleet.server.metrics import CONTENT_TYPE, ServerMetrics
from kvfleet.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    KVExportRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    random_id,
)

if TYPE_CHECKING:
    from kvfleet.engine.async_engine import AsyncLLM

logger = logging.getLogger(__name__)

#: seconds a client is told to wait after a 503 (``Retry-After``).
RETRY_AFTER_S = 1
#: how often a request's handler checks whether its client went away, seconds.
DISCONNECT_POLL_S = 0.2


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 400, code ``model_not_found``)."""

    code = "model_not_found"


# --------------------------------------------------------------------------- error bodies


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error response ``{"error": {"message", "type", "param", "code"}}``."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """Turn pydantic errors into one readable message and the first offending field."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"invalid JSON body: {ctx.get('error', err.get('msg'))}")
            continue
        # drop the union-member tags pydantic adds ("str", "list[int]", "function-after[...]")
        field = ".".join(x for x in loc if not (x.startswith(("list[", "function")) or x in ("str", "int")))
        if param is None and loc:
            param = loc[0]
        parts.append(f"{field or 'body'}: {err.get('msg')}")
    seen: list[str] = []
    for p in parts:
        if p not in seen:
            seen.append(p)
    return "; ".join(seen) or "invalid request", param


class _APIKeyMiddleware:
    """Pure-ASGI middleware: ``Authorization: Bearer <key>`` required on ``/v1/*``.

    Runs before body parsing, so an unauthenticated request always gets 401.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1") and scope.get("method") != "OPTIONS":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            scheme, _, token = headers.get("authorization", "").partition(" ")
            given = token.strip().encode("latin-1")  # the header's raw bytes
            if scheme.lower() != "bearer" or not secrets.compare_digest(given, self.api_key.encode("utf-8")):
                resp = error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                      "invalid_request_error", None, "invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------- stream plumbing


class _RequestGuard:
    """Async context manager around one engine request.

    While inside, a watcher task polls ``request.is_disconnected()`` and aborts the engine
    request when the client goes away; on exit (normal, error or cancellation) an unfinished
    request is aborted so its KV blocks are freed.
    """

    def __init__(self, stream: Any, request: Request) -> None:
        self.stream = stream
        self.request = request
        self.finished = False
        self._watcher: asyncio.Task | None = None

    async def _watch(self) -> None:
        while not self.finished:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await self.request.is_disconnected():
                logger.info("client disconnected: aborting %s", self.stream.request_id)
                self.abort()
                return

    def abort(self) -> None:
        """Abort the engine request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.stream.abort()

    async def __aenter__(self) -> _RequestGuard:
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self.abort()

    def see(self, out: RequestOutput) -> None:
        if out.finished:
            self.finished = True


class SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its generator and runs ``on_close``.

    Covers the case where sending fails before the generator even started (then its own
    ``finally`` never runs).
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


def sse(payload: str) -> str:
    """One server-sent event: ``data: PAYLOAD`` and a blank line."""
    return f"data: {payload}\n\n"


def _error_payload(exc: BaseException) -> str:
    if isinstance(exc, InvalidRequestError):
        info = ErrorInfo(message=exc.message, type="invalid_request_error", param=exc.param)
    elif isinstance(exc, EngineDeadError):
        info = ErrorInfo(message=f"engine is dead: {exc}", type="internal_server_error", code="engine_dead")
    else:
        info = ErrorInfo(message=f"internal error: {exc}", type="internal_server_error")
    return ErrorResponse(error=info).model_dump_json()


# --------------------------------------------------------------------------- app factory


def install_error_handlers(app: FastAPI, what: str = "server") -> None:
    """Answer every error with an OpenAI-style body: 400 for validation errors and
    :class:`InvalidRequestError`, 503 with ``Retry-After`` for a full queue (``"{what} is
    overloaded"``), 500 for a dead engine or an unexpected exception, and the status of any
    other HTTP exception (404 / 405 name the method and path). Shared by the server and the
    simulated engine."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, exc.message, "invalid_request_error", exc.param, getattr(exc, "code", None))

    @app.exception_handler(QueueFullError)
    async def _on_queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(503, f"{what} is overloaded: {exc}", "service_unavailable_error", None,
                              "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(500, f"engine is dead: {exc}", "internal_server_error", None, "engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {req.method} {req.url.path}"
        return error_response(exc.status_code, message, type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")


def create_app(engine: AsyncLLM, api_key: str | None = None, served_model_names: list[str] | None = None,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """Build the OpenAI-compatible FastAPI app serving ``engine``.

    The engine must be started (``engine.start()``) by the caller; the app neither starts nor
    stops it.

    Args:
        engine: the :class:`~kvfleet.engine.async_engine.AsyncLLM` to serve.
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (else 401).
            ``/health``, ``/metrics``, ``/tokenize`` and ``/detokenize`` stay open.
        served_model_names: names accepted in the ``model`` field (default: ``[engine.model_name]``);
            the first is reported in responses.
        metrics: Prometheus metrics to export; by default a fresh :class:`ServerMetrics` with its
            own registry, registered as the engine's stat logger.

    Returns:
        The FastAPI app (``app.state.engine``, ``app.state.metrics`` hold the pieces).
    """
    names = list(served_model_names or [engine.model_name])
    model_name = names[0]
    tokenizer = engine.tokenizer
    vocab_size = len(tokenizer)
    if metrics is None:
        metrics = ServerMetrics(model_name, max_model_len=engine.max_model_len,
                                block_size=engine.block_size, num_blocks=engine.num_blocks)
        engine.add_stat_logger(metrics.record)

    from kvfleet.engine import kv_transfer as kvt  # torch is loaded with the engine already

    kv_client = kvt.KVTransferClient(engine.engine, on_result=metrics.record_kv_import)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            await kv_client.aclose()

    app = FastAPI(title="kvfleet", version=kvfleet.__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server on kvfleet's paged-KV-cache engine")
    app.state.engine = engine
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    token_text_cache: dict[int, str] = {}

    def token_text(tid: int) -> str:
        s = token_text_cache.get(tid)
        if s is None:
            s = tokenizer.decode([tid], skip_special_tokens=False)
            if len(token_text_cache) < 200_000:
                token_text_cache[tid] = s
        return s

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise ModelNotFoundError(
                f"The model `{name}` does not exist; this server serves {', '.join(repr(n) for n in names)}",
                param="model")

    install_error_handlers(app)

    # ------------------------------------------------------------------ conversions

    def chat_logprobs(lps: list[TokenLogprob], k: int) -> ChatLogprobs:
        content = []
        for lp in lps:
            t = token_text(lp.token_id)
            top = [TopLogprob(token=token_text(tid), logprob=v, bytes=list(token_text(tid).encode("utf-8")))
                   for tid, v in lp.top[:k]]
            content.append(ChatLogprobToken(token=t, logprob=lp.logprob, bytes=list(t.encode("utf-8")),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    def completion_logprobs(lps: list[TokenLogprob], k: int, offset: int) -> tuple[CompletionLogprobs, int]:
        """Legacy logprobs for ``lps``; offsets start at ``offset`` characters. Returns (logprobs, end)."""
        out = CompletionLogprobs()
        for lp in lps:
            t = token_text(lp.token_id)
            out.tokens.append(t)
            out.token_logprobs.append(lp.logprob)
            top: dict[str, float] = {token_text(tid): v for tid, v in lp.top[:k]}
            top.setdefault(t, lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(t)
        return out, offset

    def chat_prompt_ids(messages: list[dict[str, Any]], add_generation_prompt: bool,
                        kwargs: dict[str, Any] | None = None) -> list[int]:
        try:
            return engine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              **(kwargs or {}))
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidRequestError(f"could not apply the chat template: {e}", param="messages") from e

    async def admit(request_id: str, prompt: str | list[int], params: Any, cache_salt: str | None = None,
                    kv_params: dict[str, Any] | None = None) -> Any:
        if not engine.healthy:
            raise EngineDeadError("the engine loop is not running")
        try:
            remote = kvt.remote_prefill_url(kv_params)
        except kvt.KVTransferError as e:
            raise InvalidRequestError(str(e), param="kv_transfer_params") from None
        hook = kv_client.before_admit(remote, cache_salt) if remote is not None else None
        return await engine.add_request_async(request_id, prompt, params, cache_salt=cache_salt, before_admit=hook)

    def prefill_done(kv_params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a prefill engine answers a ``do_remote_decode`` request
        with (vLLM's shape; the router adds this engine's ``remote_url``)."""
        if not isinstance(kv_params, dict) or kv_params.get("do_remote_decode") is not True:
            return None
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine": "kvfleet",
                "remote_block_size": engine.block_size}

    def dump(resp: Any, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        out = resp.model_dump()
        done = prefill_done(kv_params)
        if done is not None:
            out["kv_transfer_params"] = done
        return out

    def usage(n_prompt: int, n_gen: int, n_cached: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=n_cached))

    async def collect(stream: Any, raw: Request, n: int, prefix: str) -> tuple[
            dict[int, list[str]], dict[int, list[TokenLogprob]], dict[int, tuple[str | None, Any]], UsageInfo]:
        """Drain a non-streamed request: per choice its text pieces (starting with ``prefix``),
        logprobs and (finish_reason, stop_reason); plus its token usage."""
        texts: dict[int, list[str]] = {i: [prefix] for i in range(n)}
        lps: dict[int, list[TokenLogprob]] = {i: [] for i in range(n)}
        finish: dict[int, tuple[str | None, Any]] = {}
        n_prompt = n_gen = n_cached = 0
        async with _RequestGuard(stream, raw) as guard:
            async for out in stream:
                guard.see(out)
                n_prompt = len(out.prompt_token_ids)
                n_cached = out.num_cached_tokens
                for c in out.outputs:
                    texts[c.index].append(c.delta_text)
                    n_gen += len(c.delta_token_ids)
                    if c.delta_logprobs:
                        lps[c.index].extend(c.delta_logprobs)
                    if c.finish_reason is not None:
                        finish[c.index] = (c.finish_reason, c.stop_reason)
                if out.finished:
                    break
        return texts, lps, finish, usage(n_prompt, n_gen, n_cached)

    # ------------------------------------------------------------------ chat

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params()
        messages = body.normalized_messages()
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, messages, body.add_generation_prompt is not False,
                                             body.chat_template_kwargs)
        request_id = random_id("chatcmpl")
        stream = await admit(request_id, prompt_ids, params, body.cache_salt, body.kv_transfer_params)
        k = params.logprobs or 0
        want_lp = params.logprobs is not None
        if body.stream:
            guard = _RequestGuard(stream, raw)
            return SSEResponse(chat_stream(body, request_id, stream, guard, params.n, want_lp, k), guard.abort)

        texts, lps, finish, use = await collect(stream, raw, params.n, "")
        choices = [
            ChatCompletionChoice(
                index=i, message=ChatMessage(content="".join(texts[i])),
                logprobs=chat_logprobs(lps[i], k) if want_lp else None,
                finish_reason=finish.get(i, ("abort", None))[0], stop_reason=finish.get(i, (None, None))[1])
            for i in range(params.n)
        ]
        resp = ChatCompletionResponse(id=request_id, model=model_name, choices=choices, usage=use)
        return JSONResponse(dump(resp, body.kv_transfer_params))

    async def sse_events(request_id: str, stream: Any, guard: _RequestGuard, include_usage: bool,
                         chunk: Callable[..., str], opening: list[Any], make_choice: Callable[[Any], Any],
                         want_lp: bool) -> AsyncIterator[str]:
        """The SSE body of a streamed request: ``opening`` choices, then one chunk per changed
        choice (built by ``make_choice``), the usage chunk when asked, and ``[DONE]``. An engine
        error mid-stream becomes an error event."""
        n_prompt = n_gen = n_cached = 0
        try:
            async with guard:
                for choice in opening:
                    yield chunk([choice])
                async for out in stream:
                    guard.see(out)
                    n_prompt = len(out.prompt_token_ids)
                    n_cached = out.num_cached_tokens
                    for c in out.outputs:
                        n_gen += len(c.delta_token_ids)
                        if not (c.delta_text or c.finish_reason or (want_lp and c.delta_logprobs)):
                            continue
                        yield chunk([make_choice(c)])
                    if out.finished:
                        break
            if include_usage:
                yield chunk([], usage(n_prompt, n_gen, n_cached))
        except (KVFleetError, ValueError, RuntimeError) as e:
            logger.exception("stream %s failed", request_id)
            yield sse(_error_payload(e))
        yield sse("[DONE]")

    def chat_stream(body: ChatCompletionRequest, request_id: str, stream: Any, guard: _RequestGuard,
                    n: int, want_lp: bool, k: int) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, model=model_name, choices=choices,
                                                     usage=usage).model_dump_json())

        def make_choice(c: Any) -> ChatCompletionStreamChoice:
            return ChatCompletionStreamChoice(
                index=c.index, delta=DeltaMessage(content=c.delta_text),
                logprobs=chat_logprobs(c.delta_logprobs or [], k) if want_lp else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

        opening = [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                   for i in range(n)]
        return sse_events(request_id, stream, guard, bool(body.include_usage), chunk, opening, make_choice, want_lp)

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params()
        prompt = body.single_prompt()
        request_id = random_id("cmpl")
        stream = await admit(request_id, prompt, params, body.cache_salt, body.kv_transfer_params)
        k = params.logprobs or 0
        want_lp = params.logprobs is not None
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        if body.stream:
            guard = _RequestGuard(stream, raw)
            return SSEResponse(completion_stream(body, request_id, stream, guard, params.n, want_lp, k, echo),
                                guard.abort)

        texts, lps, finish, use = await collect(stream, raw, params.n, echo)
        choices = [
            CompletionChoice(
                index=i, text="".join(texts[i]),
                logprobs=completion_logprobs(lps[i], k, len(echo))[0] if want_lp else None,
                finish_reason=finish.get(i, ("abort", None))[0], stop_reason=finish.get(i, (None, None))[1])
            for i in range(params.n)
        ]
        resp = CompletionResponse(id=request_id, model=model_name, choices=choices, usage=use)
        return JSONResponse(dump(resp, body.kv_transfer_params))

    def completion_stream(body: CompletionRequest, request_id: str, stream: Any, guard: _RequestGuard,
                          n: int, want_lp: bool, k: int, echo: str) -> AsyncIterator[str]:
        offsets = dict.fromkeys(range(n), len(echo))

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionStreamResponse(id=request_id, model=model_name, choices=choices,
                                                 usage=usage).model_dump_json())

        def make_choice(c: Any) -> CompletionChoice:
            lp = None
            if want_lp:
                lp, offsets[c.index] = completion_logprobs(c.delta_logprobs or [], k, offsets[c.index])
            return CompletionChoice(index=c.index, text=c.delta_text, logprobs=lp,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)

        opening = [CompletionChoice(index=i, text=echo) for i in range(n)] if echo else []
        return sse_events(request_id, stream, guard, bool(body.include_usage), chunk, opening, make_choice, want_lp)

    # ------------------------------------------------------------------ models, health, metrics

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=n, root=model_name, max_model_len=engine.max_model_len)
                               for n in names])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvfleet.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # Refresh the scheduler gauges from the engine: an abort with no step after it would
        # otherwise leave them stale.
        try:
            s = engine.get_stats()
            metrics.set_gauges(s["num_running"], s["num_waiting"], s["kv_cache_usage"])
        except Exception:  # noqa: BLE001 - metrics must render even when the engine is dead
            logger.debug("get_stats failed", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ P/D KV export

    @app.post(kvt.EXPORT_PATH, response_model=None)
    async def kv_export(body: KVExportRequest) -> Response:
        bad = [t for t in body.token_ids if not 0 <= t < engine.engine.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range: {bad[:5]}", param="token_ids")
        if len(body.token_ids) > engine.max_model_len:
            raise InvalidRequestError(f"{len(body.token_ids)} token ids, more than max_model_len "
                                      f"{engine.max_model_len}", param="token_ids")
        if body.cache_salt is not None and not body.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
        try:
            if body.layout is not None:
                why = kvt.KVLayout.from_json(body.layout).mismatch(kv_client.layout)
                if why is not None:
                    raise kvt.KVTransferError(f"KV layout mismatch: {why}")
            t0 = time.perf_counter()
            blocks = await engine.run_in_engine(
                lambda eng: kvt.export_kv(eng, body.token_ids, body.cache_salt, body.start_block))
        except kvt.KVTransferError as e:
            raise InvalidRequestError(str(e), param="layout") from None
        data = await asyncio.to_thread(kvt.encode_kv, blocks)
        metrics.record_kv_export(blocks.num_blocks, blocks.nbytes, time.perf_counter() - t0)
        return Response(data, media_type="application/octet-stream",
                        headers={"X-KV-Blocks": str(blocks.num_blocks), "X-KV-Start-Block": str(blocks.start_block)})

    # ------------------------------------------------------------------ tokenize

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            msgs = ChatCompletionRequest(messages=body.messages).normalized_messages()
            ids = await asyncio.to_thread(chat_prompt_ids, msgs, body.add_generation_prompt)
        else:
            try:  # off the event loop: the tokenizer releases the GIL
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
            except (TypeError, ValueError, UnicodeError) as e:
                raise InvalidRequestError(f"the prompt cannot be tokenized: {e}", param="prompt") from e
        ids = [int(t) for t in ids]
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return app
