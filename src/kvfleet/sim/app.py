"""OpenAI-compatible HTTP front end of the simulated engine (FastAPI).

The same API as ``kvfleet serve`` (:mod:`kvfleet.server.app`), served by a
:class:`~kvfleet.sim.engine.SimEngine` instead of a model:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: JSON or SSE (``data: {json}`` chunks
  shaped like OpenAI's, then ``data: [DONE]``), ``stream_options.include_usage``, ``usage`` with
  ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache). Requests are
  parsed and validated by the real server's pydantic models (:mod:`kvfleet.server.protocol`).
- ``GET /v1/models`` (``owned_by: "kvfleet-simulator"``), ``GET /health``, ``GET /metrics``
  (Prometheus text with vLLM's metric names, one registry per app), ``POST /tokenize``.

Not simulated (HTTP 400, ``invalid_request_error``): ``n > 1``, ``best_of > 1``, beam search,
``logprobs`` / ``top_logprobs``, ``echo``. Sampling fields (temperature, top_p, seed, penalties,
stop strings, ...) are validated and then have no effect: the fake text is a fixed function of the
prompt. Every response carries the header ``x-kvfleet-sim-engine`` with the engine's name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvfleet
from kvfleet.errors import EngineDeadError, InvalidRequestError
from kvfleet.server.app import ModelNotFoundError, SSEResponse, install_error_handlers, sse
from kvfleet.server.metrics import CONTENT_TYPE
from kvfleet.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
)
from kvfleet.sim.engine import SimDelta, SimEngine, SimStream

logger = logging.getLogger(__name__)

#: ``owned_by`` of every ``/v1/models`` entry: says this is the simulator.
OWNED_BY = "kvfleet-simulator"
#: response header naming the simulated engine that answered.
ENGINE_HEADER = "x-kvfleet-sim-engine"
#: how often a non-streamed request checks whether its client went away, seconds.
DISCONNECT_POLL_S = 0.5
#: seconds a client is told to wait after a 503.
RETRY_AFTER_S = 1


def _unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Reject what the simulator does not simulate.

    Raises:
        InvalidRequestError: ``n > 1``, ``best_of > 1``, beam search, logprobs or echo.
    """
    if body.n is not None and body.n > 1:
        raise InvalidRequestError("the simulated engine supports only n=1", param="n")
    if body.best_of is not None and body.best_of > 1:
        raise InvalidRequestError("the simulated engine does not support best_of > 1", param="best_of")
    if body.use_beam_search:
        raise InvalidRequestError("the simulated engine does not support beam search", param="use_beam_search")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs is not None:
            raise InvalidRequestError("the simulated engine does not return logprobs", param="logprobs")
    else:
        if body.logprobs is not None:
            raise InvalidRequestError("the simulated engine does not return logprobs", param="logprobs")
        if body.echo:
            raise InvalidRequestError("the simulated engine does not support echo", param="echo")


class _EngineHeader:
    """Pure-ASGI middleware adding ``x-kvfleet-sim-engine: <name>`` to every HTTP response (so a
    router test can tell which engine answered)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self._header = (ENGINE_HEADER.encode(), name.encode("latin-1", "replace"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _usage(stream: SimStream) -> UsageInfo:
    n_prompt, n_gen = stream.num_prompt_tokens, stream.num_output_tokens
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=stream.num_cached_tokens))


async def _collect(stream: SimStream, raw: Request) -> tuple[str, str]:
    """Drain a non-streamed request: ``(text, finish_reason)``. Aborts it if the client goes away.

    Raises:
        EngineDeadError: the engine died under the request.
    """

    async def drain() -> tuple[str, str]:
        parts: list[str] = []
        finish = "abort"
        async for d in stream:
            parts.append(d.text)
            if d.finish_reason is not None:
                finish = d.finish_reason
        return "".join(parts), finish

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                logger.debug("client disconnected: aborting %s", stream.request_id)
                stream.abort()
    finally:
        if not task.done():
            task.cancel()
        stream.abort()


def create_sim_app(engine: SimEngine) -> FastAPI:
    """Build the OpenAI-compatible app of a simulated engine (see the module docstring).

    The engine must be started (:meth:`SimEngine.start`) on the loop that serves the app; the app
    neither starts nor stops it.

    Args:
        engine: the :class:`SimEngine` to serve; its ``metrics`` are exported at ``/metrics``.

    Returns:
        The FastAPI app (``app.state.engine`` holds the engine).
    """
    model_name = engine.model_name
    app = FastAPI(title="kvfleet simulated engine", version=kvfleet.__version__,
                  description="OpenAI-compatible API of kvfleet's SIMULATED engine (real scheduler and KV "
                              "cache manager, modelled step latency, fake tokens; no model is loaded)")
    app.state.engine = engine
    app.add_middleware(_EngineHeader, name=engine.name)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist; this simulated engine serves "
                                     f"{model_name!r}", param="model")

    install_error_handlers(app, "simulated engine")

    # ------------------------------------------------------------------ generation

    async def sse_body(stream: SimStream, include_usage: bool, opening: list[str],
                       chunk: Callable[[SimDelta], str], usage_chunk: Callable[[UsageInfo], str]) -> AsyncIterator[str]:
        try:
            for o in opening:
                yield o
            async for d in stream:
                yield chunk(d)
            if include_usage:
                yield usage_chunk(_usage(stream))
        except EngineDeadError as e:
            info = ErrorInfo(message=f"engine is dead: {e}", type="internal_server_error", code="engine_dead")
            yield sse(ErrorResponse(error=info).model_dump_json())
        finally:
            stream.abort()
        yield sse("[DONE]")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params()  # validates every field like the real server
        _unsupported(body)
        ids = engine.chat_prompt_ids(body.normalized_messages(), body.add_generation_prompt is not False)
        request_id = random_id("chatcmpl")
        stream = engine.add_request(request_id, ids, params.max_tokens, bool(body.ignore_eos), body.cache_salt)
        if body.stream:
            def chunk(d: SimDelta) -> str:
                choice = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content=d.text or None),
                                                    finish_reason=d.finish_reason)
                return sse(ChatCompletionStreamResponse(id=request_id, model=model_name,
                                                         choices=[choice]).model_dump_json())

            def usage_chunk(u: UsageInfo) -> str:
                return sse(ChatCompletionStreamResponse(id=request_id, model=model_name, choices=[],
                                                         usage=u).model_dump_json())

            first = ChatCompletionStreamResponse(id=request_id, model=model_name, choices=[
                ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
            body_iter = sse_body(stream, body.include_usage, [sse(first.model_dump_json())], chunk, usage_chunk)
            return SSEResponse(body_iter, stream.abort)
        text, finish = await _collect(stream, raw)
        resp = ChatCompletionResponse(id=request_id, model=model_name, usage=_usage(stream), choices=[
            ChatCompletionChoice(index=0, message=ChatMessage(content=text), finish_reason=finish)])
        return JSONResponse(resp.model_dump())

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = body.to_sampling_params()
        _unsupported(body)
        ids = engine.tokenize_prompt(body.single_prompt())
        request_id = random_id("cmpl")
        stream = engine.add_request(request_id, ids, params.max_tokens, bool(body.ignore_eos), body.cache_salt)
        if body.stream:
            def chunk(d: SimDelta) -> str:
                choice = CompletionChoice(index=0, text=d.text, finish_reason=d.finish_reason)
                return sse(CompletionStreamResponse(id=request_id, model=model_name,
                                                     choices=[choice]).model_dump_json())

            def usage_chunk(u: UsageInfo) -> str:
                return sse(CompletionStreamResponse(id=request_id, model=model_name, choices=[],
                                                     usage=u).model_dump_json())

            return SSEResponse(sse_body(stream, body.include_usage, [], chunk, usage_chunk), stream.abort)
        text, finish = await _collect(stream, raw)
        resp = CompletionResponse(id=request_id, model=model_name, usage=_usage(stream), choices=[
            CompletionChoice(index=0, text=text, finish_reason=finish)])
        return JSONResponse(resp.model_dump())

    # ------------------------------------------------------------------ models, health, metrics

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=model_name, owned_by=OWNED_BY,
                                         max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvfleet.__version__, "engine": "kvfleet-simulator"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        engine.refresh_gauges()
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            msgs = ChatCompletionRequest(messages=body.messages).normalized_messages()
            ids = engine.chat_prompt_ids(msgs, body.add_generation_prompt)
        else:
            ids = engine.tokenize_prompt(body.prompt or "")
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    return app
