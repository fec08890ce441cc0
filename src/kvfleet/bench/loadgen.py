"""Load generator: streams requests to an OpenAI-compatible server and times every chunk.

Works against any server speaking the OpenAI API with Server-Sent Events (kvfleet, vLLM,
llama.cpp's ``llama-server``, ``transformers serve``, a router). Each request is sent with
``stream: true`` and ``stream_options: {"include_usage": true}``; its timeline (send, every chunk
with text, end of stream) becomes a :class:`~kvfleet.bench.metrics.RequestResult`. Token counts
come from the usage object of the final chunk when the server sends one, else from the number
of text chunks.

Arrivals follow vLLM's ``benchmark_serving``: a gamma process with rate ``request_rate`` (req/s)
and shape ``burstiness`` (1 = Poisson; < 1 burstier; > 1 more regular); ``inf`` sends everything
at once; ``max_concurrency`` caps requests in flight (a closed loop when the rate is ``inf``).
Multi-turn conversations arrive as units; each turn is sent when the previous reply is complete.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from kvfleet.bench.datasets import BenchRequest, Conversation
from kvfleet.bench.metrics import RequestResult

__all__ = ["ENDPOINTS", "EndpointConfig", "ServerNotReadyError", "arrival_intervals", "parse_sse_data",
           "run_workload", "send_request", "wait_until_ready"]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class ServerNotReadyError(RuntimeError):
    """The server did not answer ``/v1/models`` (or ``/health``) in time, or its process exited."""


@dataclass
class EndpointConfig:
    """Where and how requests are sent.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (no ``/v1``).
        endpoint: ``/v1/completions`` (sends ``prompt``) or ``/v1/chat/completions`` (sends ``messages``).
        model: the ``model`` field of each request.
        api_key: sent as ``Authorization: Bearer``; None sends none.
        ignore_eos: ask for exactly ``max_tokens`` tokens (vLLM/kvfleet/llama.cpp extension).
        temperature: sampling temperature (0 = greedy).
        request_timeout_s: per-request timeout, seconds.
        extra_body: more JSON fields merged into every request.
    """

    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    @property
    def chat(self) -> bool:
        """True for ``/v1/chat/completions``."""
        return self.endpoint == "/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        """HTTP headers of every request."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        """The JSON body for ``req``."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = req.messages
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def arrival_intervals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gaps between ``n`` arrivals, seconds: gamma(shape=burstiness, scale=1/(rate*burstiness)).

    The mean gap is ``1 / request_rate`` whatever the burstiness; ``burstiness == 1`` is a Poisson
    process. ``request_rate == inf`` gives all zeros.

    Raises:
        ValueError: ``request_rate`` or ``burstiness`` not positive, or ``n`` negative.
    """
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 req/s (or inf), got {request_rate!r}")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness!r}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


def parse_sse_data(line: str) -> dict[str, Any] | str | None:
    """One SSE line → the decoded JSON object, ``"[DONE]"``, or None (blank, comment, other field).

    Raises:
        ValueError: a ``data:`` line whose payload is not JSON.
    """
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        raise ValueError(f"stream chunk is not JSON: {data[:120]!r}") from None
    return obj if isinstance(obj, dict) else None


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    parts = []
    for c in choices:
        if not isinstance(c, dict):
            continue
        if "delta" in c and isinstance(c["delta"], dict):
            parts.append(c["delta"].get("content") or "")
        else:
            parts.append(c.get("text") or "")
    return "".join(parts)


async def send_request(client: httpx.AsyncClient, cfg: EndpointConfig, req: BenchRequest) -> RequestResult:
    """Send one streamed request and time it; never raises for server or network errors
    (they are recorded in ``RequestResult.error``)."""
    res = RequestResult(prompt_tokens=req.prompt_len, tag=req.tag)
    text_parts: list[str] = []
    n_chunks = 0
    usage = None
    start = time.perf_counter()
    res.start = start
    last = start
    try:
        async with client.stream("POST", cfg.base_url + cfg.endpoint, json=cfg.payload(req),
                                 headers=cfg.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                res.latency = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                obj = parse_sse_data(line)
                if obj is None:
                    continue
                if obj == "[DONE]":
                    break
                assert isinstance(obj, dict)
                if "error" in obj:
                    err = obj["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    res.latency = time.perf_counter() - start
                    return res
                if obj.get("usage"):
                    usage = obj["usage"]
                text = _chunk_text(obj)
                if text:
                    now = time.perf_counter()
                    if n_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_chunks += 1
                    text_parts.append(text)
    except (httpx.HTTPError, ValueError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - start
        return res
    res.latency = time.perf_counter() - start
    res.generated_text = "".join(text_parts)
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        res.usage_reported = True
        res.output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            res.prompt_tokens = usage["prompt_tokens"]
    else:
        res.output_tokens = n_chunks
    if n_chunks == 0:
        res.error = "the stream ended without generated text"
        return res
    res.success = True
    return res


async def run_workload(cfg: EndpointConfig, work: list[BenchRequest] | list[Conversation], *,
                       request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                       seed: int = 0, progress: bool = True,
                       desc: str = "requests") -> tuple[list[RequestResult], float]:
    """Send ``work`` with the arrival process and concurrency cap; wait for every response.

    Args:
        cfg: endpoint settings.
        work: requests, or conversations (each arrives as one unit and sends its turns in order;
            conversations need the chat endpoint).
        request_rate: arrivals per second (``inf``: all at once).
        burstiness: gamma shape of the gaps (1 = Poisson).
        max_concurrency: most requests in flight (None: no cap).
        seed: seed of the arrival gaps.
        progress: show a tqdm bar of finished requests.
        desc: the bar's label.

    Returns:
        (results in completion order, wall time in seconds from the first send to the last response).

    Raises:
        ValueError: conversations with the completions endpoint, a bad rate, burstiness or cap.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    convs = bool(work) and isinstance(work[0], Conversation)
    total = sum(c.num_turns for c in work) if convs else len(work)  # type: ignore[union-attr]
    gaps = arrival_intervals(len(work), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False)

    limits = httpx.Limits(max_connections=max_concurrency or max(total, 1), max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, cfg, req)
            else:
                async with sem:
                    r = await send_request(client, cfg, req)
            results.append(r)
            if bar is not None:
                bar.update(1)
            return r

        async def conversation(conv: Conversation) -> None:
            while conv.turns_done < conv.num_turns:
                r = await one(conv.next_request())
                if not r.success:  # the rest of the conversation cannot be sent
                    for _ in range(conv.num_turns - conv.turns_done - 1):
                        results.append(RequestResult(error=f"skipped after a failed turn: {r.error}",
                                                     tag=f"conv{conv.conv_id}"))
                        if bar is not None:
                            bar.update(1)
                    return
                conv.record_reply(r.generated_text)

        tasks = []
        t0 = time.perf_counter()
        due = t0
        for item, gap in zip(work, gaps):
            due += gap
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            coro = conversation(item) if convs else one(item)  # type: ignore[arg-type]
            tasks.append(asyncio.create_task(coro))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return results, duration


async def wait_until_ready(base_url: str, timeout_s: float = 300.0, proc: Any = None, api_key: str | None = None,
                           poll_s: float = 0.5) -> float:
    """Poll ``GET /v1/models`` (then ``/health``) until one answers 200; returns seconds waited.

    Args:
        base_url: server root (``http://host:port``).
        timeout_s: give up after this many seconds.
        proc: the server's ``subprocess.Popen``; its exit ends the wait early.
        api_key: bearer key for ``/v1/models``.
        poll_s: seconds between polls.

    Raises:
        ServerNotReadyError: timeout, or ``proc`` exited.
    """
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServerNotReadyError(f"server process exited with status {proc.returncode} before it was ready")
            for path in ("/v1/models", "/health"):
                try:
                    r = await client.get(base + path, headers=headers)
                    if r.status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
            if time.perf_counter() - t0 > timeout_s:
                raise ServerNotReadyError(f"{base} did not answer /v1/models or /health within {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)
