"""``kvfleet router``: an OpenAI-compatible HTTP proxy in front of engine replicas.

Per request: parse the body, filter the endpoints (healthy, not saturated, not already tried),
let the :class:`~kvfleet.router.picker.EndpointPicker` choose, and forward the request with
``httpx``. Streamed responses are passed through chunk by chunk as they arrive. A request that
fails before its first byte (connection error, 5xx, a stream that breaks before any data) is
retried on another endpoint, at most ``max_retries`` times, and the failed endpoint is ejected.
Without a healthy endpoint the router answers 503 with ``Retry-After``; when every healthy
endpoint is saturated, requests wait in a bounded queue and get 429 when it is full or they
time out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.router.discovery import Discovery
from kvfleet.router.endpoint import Endpoint
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.picker import EndpointPicker
from kvfleet.router.pool import EndpointPool
from kvfleet.router.scorers import RoutingContext

logger = logging.getLogger(__name__)

#: request headers passed on to the engine (others, like Host and Content-Length, are not).
FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "x-session-id", "traceparent")


@dataclass
class RouterConfig:
    """Router behaviour.

    Attributes:
        policy: the profile name reported in metrics and logs.
        max_retries: re-sends to other endpoints of a request that failed before its first byte.
        max_inflight_per_endpoint: requests in flight through the router after which an endpoint
            counts as saturated.
        saturation_queue_depth, saturation_kv_usage: an endpoint whose scraped waiting queue is
            at least the depth *and* KV usage at least the fraction is saturated too (llm-d's
            saturation detector; None disables).
        max_queued_requests: requests that may wait for a non-saturated endpoint (then 429).
        queue_timeout_s: how long a request waits in that queue before a 429.
        request_timeout_s: read timeout towards the engine (seconds between bytes).
        retry_after_s: the ``Retry-After`` of a 503 without healthy endpoints.
        session_header: header forwarded for session affinity (case-insensitive).
        hold_when_empty_s: with no healthy endpoint at all, hold a request this long (in the
            bounded queue, counted in ``kvfleet_router_queued_requests``) for one to appear,
            instead of answering 503 at once: scale from zero, where an autoscaler starts a
            replica when requests queue (0 = off). A request whose endpoint failed before the
            first byte is held the same way (and may go to that endpoint again once it is
            healthy: restarted), so a one-replica fleet survives a crash of its replica.
    """

    policy: str = "default"
    max_retries: int = 2
    max_inflight_per_endpoint: int = 256
    saturation_queue_depth: float | None = 64
    saturation_kv_usage: float | None = 0.95
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    retry_after_s: int = 1
    hold_when_empty_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def error_response(status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body ``{"error": {message, type, param, code}}``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status, headers=headers)


def parse_json_body(raw: bytes) -> dict[str, Any] | Response:
    """The request body as a JSON object, or the OpenAI-style 400 response to send instead."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return error_response(400, f"request body is not valid JSON: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object", "invalid_request_error")
    return body


class _Rejected(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


class Router:
    """The routing core, independent of the HTTP framework (the FastAPI app wraps it).

    Args:
        pool: the endpoint pool (started by :meth:`start`).
        picker: the endpoint picker.
        config: behaviour knobs.
        client: the HTTP client towards the engines (the pool's).
    """

    def __init__(self, pool: EndpointPool, picker: EndpointPicker, config: RouterConfig,
                 client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.picker = picker
        self.config = config
        self.client = client
        self.metrics = pool.metrics
        self._queued = 0
        self._released = asyncio.Event()  # set whenever a request ends (wakes queued requests)
        pool.on_remove.append(picker.remove_endpoint)

    # ------------------------------------------------------------------ choosing
    def saturated(self, ep: Endpoint) -> bool:
        """True when ``ep`` should get no new request now."""
        c = self.config
        if ep.in_flight >= c.max_inflight_per_endpoint:
            return True
        if c.saturation_queue_depth is None or c.saturation_kv_usage is None:
            return False
        return ep.queue_depth >= c.saturation_queue_depth and ep.kv_usage >= c.saturation_kv_usage

    async def choose(self, ctx: RoutingContext, exclude: set[str], pool: EndpointPool | None = None,
                     picker: EndpointPicker | None = None) -> Endpoint:
        """Pick an endpoint for ``ctx``, waiting in the bounded queue while all are saturated.
        ``pool`` and ``picker`` default to the router's own (P/D routing passes the prefill pool's).

        Raises:
            _Rejected: no healthy endpoint (503; with ``hold_when_empty_s`` only after holding
                that long: scale from zero), or the queue is full or timed out (429).
        """
        pool = pool or self.pool
        picker = picker or self.picker
        start = time.monotonic()
        deadline = start + self.config.queue_timeout_s
        hold_until = start + self.config.hold_when_empty_s
        queued = False
        try:
            while True:
                healthy = [e for e in pool.healthy() if e.url not in exclude]
                if not healthy and self.config.hold_when_empty_s > 0:
                    # an endpoint that failed this request was ejected; healthy again means restarted
                    healthy = pool.healthy()
                holding = not healthy and time.monotonic() < hold_until
                if not healthy and not holding:
                    self.metrics.rejected.labels("no_endpoint").inc()
                    raise _Rejected(error_response(
                        503, "no healthy engine endpoint is available; retry later", "service_unavailable_error",
                        "no_healthy_endpoint", headers={"Retry-After": str(self.config.retry_after_s)}))
                candidates = [e for e in healthy if not self.saturated(e)]
                if candidates:  # (none while holding for an endpoint to appear)
                    decision = picker.pick(ctx, candidates)
                    self.metrics.decisions.labels(self.config.policy).inc()
                    return decision.endpoint
                if not queued:
                    if self._queued >= self.config.max_queued_requests:
                        self.metrics.rejected.labels("queue_full").inc()
                        raise _Rejected(error_response(
                            429, "every engine endpoint is saturated and the router's queue is full",
                            "rate_limit_error", "queue_full", headers={"Retry-After": str(self.config.retry_after_s)}))
                    queued = True
                    self._queued += 1
                    self.metrics.queued.set(self._queued)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.metrics.rejected.labels("queue_timeout").inc()
                    raise _Rejected(error_response(
                        429, f"every engine endpoint stayed saturated for {self.config.queue_timeout_s:g} s",
                        "rate_limit_error", "queue_timeout", headers={"Retry-After": str(self.config.retry_after_s)}))
                self._released.clear()  # woken when a request ends; re-checked at least every 0.2 s
                try:
                    await asyncio.wait_for(self._released.wait(), timeout=min(left, 0.2))
                except asyncio.TimeoutError:
                    pass
        finally:
            if queued:
                self._queued -= 1
                self.metrics.queued.set(self._queued)

    def _release(self, ep: Endpoint) -> None:
        ep.in_flight -= 1
        self.metrics.in_flight.labels(ep.url).set(ep.in_flight)
        self._released.set()

    # ------------------------------------------------------------------ forwarding
    async def forward(self, path: str, raw: bytes, headers: dict[str, str]) -> Response:
        """Route and forward one POST request; returns the response to send to the client."""
        t0 = time.perf_counter()
        body = parse_json_body(raw)
        if isinstance(body, Response):
            return body
        ctx = RoutingContext(path, body, headers)
        # header values as the client sent their bytes (Starlette decodes them as latin-1)
        fwd = {k: v.encode("latin-1", "replace") for k, v in headers.items() if k in FORWARD_HEADERS}
        return await self.route(ctx, raw, fwd, body.get("stream") is True, t0)

    async def route(self, ctx: RoutingContext, raw: bytes, fwd: dict[str, bytes], stream: bool, t0: float | None,
                    pool: EndpointPool | None = None, picker: EndpointPicker | None = None) -> Response:
        """Choose an endpoint of ``pool`` (default: the router's) for ``ctx`` and send it ``raw``,
        retrying elsewhere on failures before the first byte. The endpoint that answered is left
        in ``ctx.cache["endpoint"]`` (its URL). ``t0`` is the request's arrival
        (``time.perf_counter()``) for the TTFT histogram; None does not observe it."""
        path = ctx.path
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self.config.max_retries + 1):
            try:
                ep = await self.choose(ctx, tried, pool, picker)
            except _Rejected as r:
                if tried and r.response.status_code == 503:  # every endpoint we tried failed
                    return error_response(502, f"every engine endpoint tried failed; last error: {last_error}",
                                          "bad_gateway_error", "upstream_failed")
                return r.response
            tried.add(ep.url)
            if attempt:
                self.metrics.retries.inc()
            ep.in_flight += 1
            ep.requests_total += 1
            self.metrics.requests.labels(ep.url).inc()
            self.metrics.in_flight.labels(ep.url).set(ep.in_flight)
            result = await self._send(ep, path, raw, fwd, stream, t0)
            if isinstance(result, str):  # failed before the first byte: eject, retry elsewhere
                last_error = result
                ep.errors_total += 1
                self.metrics.errors.labels(ep.url).inc()
                (pool or self.pool).report_failure(ep, result)
                self._release(ep)
                continue
            ctx.cache["endpoint"] = ep.url
            return result
        return error_response(502, f"every engine endpoint tried failed; last error: {last_error}",
                              "bad_gateway_error", "upstream_failed")

    async def _send(self, ep: Endpoint, path: str, raw: bytes, headers: dict[str, bytes], stream: bool,
                    t0: float | None) -> Response | str:
        """Send to ``ep``. Returns the response for the client, or a string saying why it failed
        before its first byte (then nothing was sent to the client and ``ep`` is still counted
        in flight)."""
        timeout = httpx.Timeout(10.0, read=self.config.request_timeout_s)
        resp = None
        for attempt in range(2):
            try:
                req = self.client.build_request("POST", ep.url + path, content=raw, headers=headers, timeout=timeout)
                resp = await self.client.send(req, stream=True)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as e:
                # a kept-alive connection the server closed meanwhile: one more try on a new one
                if attempt:
                    return f"{type(e).__name__}: {e}"
            except httpx.HTTPError as e:
                return f"{type(e).__name__}: {e}"
        assert resp is not None
        if resp.status_code >= 500:
            text = (await resp.aread())[:300].decode(errors="replace")
            await resp.aclose()
            return f"HTTP {resp.status_code}: {text}"
        chunks = resp.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.HTTPError as e:
            await resp.aclose()
            return f"stream broke before the first byte: {type(e).__name__}: {e}"
        if t0 is not None:
            self.metrics.ttft.observe(time.perf_counter() - t0)
        media = resp.headers.get("content-type", "application/json")
        if not stream or resp.status_code != 200:
            try:
                rest = b"".join([c async for c in chunks])
            except httpx.HTTPError as e:  # nothing reached the client yet: retry elsewhere
                await resp.aclose()
                return f"response broke: {type(e).__name__}: {e}"
            await resp.aclose()
            self._release(ep)
            return Response(first + rest, status_code=resp.status_code, media_type=media)

        async def passthrough() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                async for c in chunks:
                    yield c
            except httpx.HTTPError as e:  # the client sees a truncated stream; count the error
                self._failed_after_first_byte(ep, e)
                return
            finally:  # also when the client disconnects (the generator is closed)
                self._release(ep)
                await resp.aclose()

        return StreamingResponse(passthrough(), status_code=resp.status_code, media_type=media,
                                 headers={"Cache-Control": "no-cache"})

    def _failed_after_first_byte(self, ep: Endpoint, e: BaseException) -> None:
        ep.errors_total += 1
        self.metrics.errors.labels(ep.url).inc()
        self.pool.report_failure(ep, f"response broke after the first byte: {type(e).__name__}: {e}")

    def health_info(self) -> tuple[bool, dict[str, Any]]:
        """``(healthy, details)`` for ``GET /health``: healthy while an endpoint is."""
        n = len(self.pool.healthy())
        return n > 0, {"healthy_endpoints": n}

    async def models(self) -> Response:
        """``GET /v1/models`` of the first healthy endpoint that answers (the replicas serve the
        same model)."""
        for ep in self.pool.healthy():
            try:
                r = await self.client.get(ep.url + "/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return Response(r.content, media_type="application/json")
        return error_response(503, "no healthy engine endpoint is available; retry later", "service_unavailable_error",
                              "no_healthy_endpoint", headers={"Retry-After": str(self.config.retry_after_s)})


def create_router_app(discovery: Discovery, picker: EndpointPicker, config: RouterConfig | None = None,
                      pool_options: dict[str, Any] | None = None,
                      prefill: tuple[Discovery, EndpointPicker] | None = None, pd: Any = None) -> FastAPI:
    """The router's FastAPI app: ``POST /v1/chat/completions``, ``POST /v1/completions``,
    ``GET /v1/models``, ``GET /health`` (200 while an endpoint is healthy, else 503) and
    ``GET /metrics`` (the router's own metrics). The endpoint pool starts with the app.

    Args:
        discovery: the endpoint source (the decode pool with a P/D split).
        picker: the endpoint picker (scorers and weights).
        config: behaviour knobs (default :class:`RouterConfig`).
        pool_options: keyword arguments of :class:`EndpointPool` (intervals, back-off).
        prefill: the prefill pool's source and picker: every request then goes through a
            prefill endpoint before its decode endpoint (:class:`kvfleet.router.pd.PDRouter`).
        pd: :class:`kvfleet.router.pd.PDConfig` of the P/D split (default fallback ``decode``).
    """
    config = config or RouterConfig()
    state: dict[str, Router] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Idle connections are dropped after 2 s, before servers drop them (uvicorn: 5 s), so a
        # request is not sent on a connection the server is closing.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=2.0)
        async with httpx.AsyncClient(limits=limits) as client:
            pools: list[EndpointPool]
            if prefill is None:
                pool = EndpointPool(discovery, client, RouterMetrics(), **(pool_options or {}))
                router: Router = Router(pool, picker, config, client)
                pools = [pool]
            else:
                from kvfleet.router.pd import PDRouter, pd_pools

                pool, prefill_pool = pd_pools(discovery, prefill[0], client, RouterMetrics(), **(pool_options or {}))
                router = PDRouter(pool, picker, prefill_pool, prefill[1], config, client, pd)
                pools = [pool, prefill_pool]
            state["router"] = router
            app.state.router = router
            for p in pools:
                await p.start()
            if prefill is None:
                logger.info("router: %d endpoints (%s), policy %s", len(pool.endpoints), discovery.describe(),
                            config.policy)
            else:
                logger.info("router (P/D split): %d prefill endpoints (%s), %d decode endpoints (%s), policy %s",
                            len(pools[1].endpoints), prefill[0].describe(), len(pool.endpoints),
                            discovery.describe(), config.policy)
            try:
                yield
            finally:
                for p in pools:
                    await p.stop()

    app = FastAPI(title="kvfleet router", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return error_response(exc.status_code, f"{exc.detail}: {req.method} {req.url.path}", type_)

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected router error")
        return error_response(500, f"router error: {type(exc).__name__}: {exc}", "internal_server_error")

    def _headers(request: Request) -> dict[str, str]:
        return {k.lower(): v for k, v in request.headers.items()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await state["router"].forward("/v1/chat/completions", await request.body(), _headers(request))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await state["router"].forward("/v1/completions", await request.body(), _headers(request))

    @app.get("/v1/models", response_model=None)
    async def models() -> Response:
        return await state["router"].models()

    @app.get("/health", response_model=None)
    async def health() -> Response:
        ok, info = state["router"].health_info()
        if ok:
            return JSONResponse({"status": "ok", **info})
        return error_response(503, "no healthy engine endpoint", "service_unavailable_error", "no_healthy_endpoint",
                              headers={"Retry-After": str(config.retry_after_s)})

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        body, ctype = state["router"].metrics.render()
        return Response(body, media_type=ctype)

    return app
