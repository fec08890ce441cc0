"""The router's own Prometheus metrics (one registry per router app)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: TTFT buckets in seconds (vLLM's ``vllm:time_to_first_token_seconds`` range).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class RouterMetrics:
    """Counters and gauges of ``kvfleet router``:

    - ``kvfleet_router_requests_total{endpoint}``: requests sent to an endpoint (retries included);
    - ``kvfleet_router_errors_total{endpoint}``: of those, failed (connection error, 5xx, broken stream);
    - ``kvfleet_router_decisions_total{policy}``: routing decisions per policy (profile) name;
    - ``kvfleet_router_retries_total``: requests re-sent to another endpoint before their first byte;
    - ``kvfleet_router_rejected_total{reason}``: answered by the router itself (``no_endpoint`` 503,
      ``queue_full`` / ``queue_timeout`` 429);
    - ``kvfleet_router_time_to_first_token_seconds``: request arrival to the first response byte;
    - gauges ``kvfleet_router_endpoints``, ``kvfleet_router_healthy_endpoints``,
      ``kvfleet_router_queued_requests`` and ``kvfleet_router_in_flight{endpoint}`` (with a P/D
      split, the endpoint gauges count both pools);
    - P/D split (:mod:`kvfleet.router.pd`): ``kvfleet_router_pd_requests_total{outcome}``
      (``disaggregated``: prefill then decode; ``fallback``: sent whole to a decode endpoint),
      ``kvfleet_router_pd_fallbacks_total{reason}`` (``no_prefill_endpoint``, ``prefill_busy``,
      ``prefill_failed``) and ``kvfleet_router_pd_prefill_seconds`` (the prefill step, from
      choosing a prefill endpoint to its complete answer).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfleet_router_requests", "Requests sent to an endpoint.", ["endpoint"], registry=r)
        self.errors = Counter("kvfleet_router_errors", "Requests to an endpoint that failed.", ["endpoint"], registry=r)
        self.decisions = Counter("kvfleet_router_decisions", "Routing decisions per policy.", ["policy"], registry=r)
        self.retries = Counter("kvfleet_router_retries", "Requests retried on another endpoint.", registry=r)
        self.rejected = Counter("kvfleet_router_rejected", "Requests the router answered itself.", ["reason"],
                                registry=r)
        self.ttft = Histogram("kvfleet_router_time_to_first_token_seconds",
                              "Time from request arrival to the first response byte.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.endpoints = Gauge("kvfleet_router_endpoints", "Known endpoints.", registry=r)
        self.healthy = Gauge("kvfleet_router_healthy_endpoints", "Endpoints that pass health checks.", registry=r)
        self.queued = Gauge("kvfleet_router_queued_requests", "Requests waiting for a non-saturated endpoint.",
                            registry=r)
        self.in_flight = Gauge("kvfleet_router_in_flight", "Requests in flight per endpoint.", ["endpoint"],
                               registry=r)
        self.pd_requests = Counter("kvfleet_router_pd_requests", "P/D split: requests by outcome.", ["outcome"],
                                   registry=r)
        self.pd_fallbacks = Counter("kvfleet_router_pd_fallbacks",
                                    "P/D split: requests sent whole to a decode endpoint because the prefill step "
                                    "could not be served, by reason.", ["reason"], registry=r)
        self.pd_prefill_seconds = Histogram("kvfleet_router_pd_prefill_seconds",
                                            "P/D split: seconds of the prefill step.", buckets=TTFT_BUCKETS,
                                            registry=r)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
