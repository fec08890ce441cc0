"""Prefill/decode (P/D) split routing: each request's prefill on one pool, its decode on another.

Disaggregated serving (DistServe, Zhong et al. 2024; Splitwise, Patel et al. 2024), routed the way
llm-d's P/D profile and vLLM's disaggregation proxy do it:

1. pick a prefill endpoint (the prefill pool's picker: prefix-aware scoring as usual) and send it
   the request with ``max_tokens: 1``, ``stream: false`` (and ``n: 1``, no beam search, no
   logprobs, no ``min_tokens``) and ``kv_transfer_params: {"do_remote_decode": true}``; the
   engine computes the prompt and keeps its KV in its prefix cache;
2. send the original request (streamed or not) to a decode endpoint with ``kv_transfer_params``:
   those the prefill engine answered with (vLLM's NIXL connector puts its block ids there),
   ``do_remote_prefill: true`` and ``remote_url`` = the prefill endpoint's URL; a kvfleet decode
   engine pulls the prompt's KV from there (:mod:`kvfleet.engine.kv_transfer`) and computes
   only the rest. The decode response is passed through.

A prefill answer of 4xx (an invalid request) goes back to the client as it is. When the prefill
step cannot be served (no healthy prefill endpoint: ``no_prefill_endpoint``; every prefill
endpoint saturated and the queue full or timed out: ``prefill_busy``; every endpoint tried
failed: ``prefill_failed``), the request is by default sent whole to a decode endpoint, which
computes the prompt itself (``fallback="decode"``, counted in
``kvfleet_router_pd_fallbacks_total{reason}``); ``fallback="error"`` answers the prefill step's
error instead. The prefill step queues and holds like any routed request (``--hold-when-empty``
holds it while the prefill pool has no healthy endpoint: scale from zero), and each step counts
one routing decision.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response

from kvfleet.router.app import FORWARD_HEADERS, Router, RouterConfig, parse_json_body
from kvfleet.router.discovery import Discovery
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.picker import EndpointPicker
from kvfleet.router.pool import EndpointPool
from kvfleet.router.scorers import RoutingContext

#: ``--pd-fallback`` values.
PD_FALLBACKS = ("decode", "error")

#: request fields dropped from the prefill step (they only shape the generated tokens).
_PREFILL_DROP = ("stream_options", "max_completion_tokens", "min_tokens", "best_of", "logprobs", "top_logprobs")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request body sent to the prefill endpoint: one non-streamed token of one choice, no
    beam search or logprobs, with ``kv_transfer_params: {"do_remote_decode": true}``."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if out.get("use_beam_search"):
        out["use_beam_search"] = False
    return out


def decode_params(prefill_response: bytes, prefill_url: str) -> dict[str, Any]:
    """The decode request's ``kv_transfer_params``: the prefill answer's own (if any), with
    ``do_remote_prefill: true``, ``do_remote_decode: false`` and ``remote_url`` (the prefill
    endpoint's URL unless the answer named one)."""
    try:
        given = json.loads(prefill_response).get("kv_transfer_params")
    except (ValueError, AttributeError):
        given = None
    params = dict(given) if isinstance(given, dict) else {}
    params.update(do_remote_prefill=True, do_remote_decode=False)
    if not isinstance(params.get("remote_url"), str):
        params["remote_url"] = prefill_url
    return params


class SharedGaugePool(EndpointPool):
    """An :class:`EndpointPool` whose ``kvfleet_router_endpoints`` / ``_healthy_endpoints``
    gauges count the endpoints of every pool in ``group`` (the prefill and decode pools of one
    router share one set of metrics).

    Args:
        group: the list of pools sharing the gauges; this pool appends itself.
        *args, **kwargs: as :class:`EndpointPool`.
    """

    def __init__(self, group: list[EndpointPool], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        group.append(self)

    def _update_gauges(self) -> None:
        self.metrics.endpoints.set(sum(len(p.endpoints) for p in self.group))
        self.metrics.healthy.set(sum(e.healthy for p in self.group for e in p.endpoints.values()))


@dataclass(frozen=True)
class PDConfig:
    """P/D split behaviour.

    Attributes:
        fallback: ``decode`` (send the request whole to a decode endpoint when the prefill step
            cannot be served) or ``error`` (answer the prefill step's error).
    """

    fallback: str = "decode"

    def __post_init__(self) -> None:
        if self.fallback not in PD_FALLBACKS:
            raise ValueError(f"P/D fallback must be one of {', '.join(PD_FALLBACKS)}, got {self.fallback!r}")


class PDRouter(Router):
    """A :class:`Router` whose requests go through a prefill endpoint, then a decode endpoint.

    Args:
        decode_pool, decode_picker: the decode pool (the router's own :attr:`pool`, which also
            answers ``/v1/models``) and its picker.
        prefill_pool, prefill_picker: the prefill pool and its picker.
        config: behaviour knobs shared by both steps (retries, saturation, queue, holding).
        client: the HTTP client.
        pd: :class:`PDConfig`.
    """

    def __init__(self, decode_pool: EndpointPool, decode_picker: EndpointPicker, prefill_pool: EndpointPool,
                 prefill_picker: EndpointPicker, config: RouterConfig, client: httpx.AsyncClient,
                 pd: PDConfig | None = None) -> None:
        super().__init__(decode_pool, decode_picker, config, client)
        self.prefill_pool = prefill_pool
        self.prefill_picker = prefill_picker
        self.pd = pd or PDConfig()
        prefill_pool.on_remove.append(prefill_picker.remove_endpoint)

    def health_info(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while a decode endpoint is (a request can then be served, by fallback if no
        prefill endpoint is healthy); reports both pools' healthy endpoints."""
        ok, info = super().health_info()
        return ok, {**info, "healthy_prefill_endpoints": len(self.prefill_pool.healthy())}

    async def forward(self, path: str, raw: bytes, headers: dict[str, str]) -> Response:
        """Route one POST request through the prefill step, then the decode step."""
        t0 = time.perf_counter()
        body = parse_json_body(raw)
        if isinstance(body, Response):
            return body
        fwd = {k: v.encode("latin-1", "replace") for k, v in headers.items() if k in FORWARD_HEADERS}
        stream = body.get("stream") is True
        pbody = prefill_body(body)
        pctx = RoutingContext(path, pbody, headers)
        tp = time.perf_counter()
        presp = await self.route(pctx, json.dumps(pbody).encode(), fwd, False, None, self.prefill_pool,
                                 self.prefill_picker)
        self.metrics.pd_prefill_seconds.observe(time.perf_counter() - tp)
        status = presp.status_code
        prefill_url = pctx.cache.get("endpoint")
        if status == 200 and prefill_url:
            body = {**body, "kv_transfer_params": decode_params(bytes(presp.body), prefill_url)}
            raw = json.dumps(body).encode()
            self.metrics.pd_requests.labels("disaggregated").inc()
        elif status < 500 and status != 429:  # the engine refused the request itself (4xx)
            return presp
        else:
            if self.pd.fallback == "error":
                return presp
            reason = {503: "no_prefill_endpoint", 429: "prefill_busy"}.get(status, "prefill_failed")
            self.metrics.pd_fallbacks.labels(reason).inc()
            self.metrics.pd_requests.labels("fallback").inc()
        return await self.route(RoutingContext(path, body, headers), raw, fwd, stream, t0)


def pd_pools(decode: Discovery, prefill: Discovery, client: httpx.AsyncClient, metrics: RouterMetrics,
             **pool_options: Any) -> tuple[EndpointPool, EndpointPool]:
    """``(decode_pool, prefill_pool)`` sharing ``metrics`` (endpoint gauges count both)."""
    group: list[EndpointPool] = []
    return (SharedGaugePool(group, decode, client, metrics, **pool_options),
            SharedGaugePool(group, prefill, client, metrics, **pool_options))
