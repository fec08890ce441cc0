"""Load-aware scorers from the engines' scraped ``/metrics`` and the router's own counts."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.router.endpoint import Endpoint
from kvfleet.router.scorers.base import RoutingContext, Scorer, min_max_inverted


class QueueScorer(Scorer):
    """Prefer endpoints with fewer waiting requests (``vllm:num_requests_waiting``), min-max
    normalised over the candidates (llm-d's queue scorer)."""

    name = "queue"

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverted([e.queue_depth for e in endpoints])


class KVUsageScorer(Scorer):
    """Prefer endpoints with more free KV cache: ``1 - vllm:kv_cache_usage_perc`` (llm-d's
    KV-cache utilization scorer); an endpoint that does not export it scores 1."""

    name = "kv-usage"

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in endpoints]


class InFlightScorer(Scorer):
    """Prefer endpoints with fewer requests in flight through this router (no scrape delay),
    min-max normalised over the candidates."""

    name = "in-flight"

    def score(self, ctx: RoutingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverted([float(e.in_flight) for e in endpoints])
