"""What the supervisor and ``kvfleet status`` read from engines' and the router's ``/metrics``
(Prometheus text): load, KV cache usage and prefix-cache hit rate of an engine (vLLM's metric
names, SGLang's where they differ), and the router's held requests and per-endpoint traffic."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: families read as each engine signal, the first one present wins.
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
#: kvfleet's P/D KV transfer counters (kvfleet.server.metrics)
_KV_EXPORTED = ("kvfleet:kv_exported_blocks",)
_KV_IMPORTED = ("kvfleet:kv_imported_blocks",)
_KV_FALLBACKS = ("kvfleet:kv_transfer_fallbacks",)


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """family name (without ``_total``) -> [(labels, value)] of its main samples.

    Raises:
        ValueError: not Prometheus text.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        main = {fam.name, fam.name + "_total"}
        out[fam.name] = [(dict(s.labels), s.value) for s in fam.samples if s.name in main]
    return out


def _sum(fams: dict[str, list[tuple[dict[str, str], float]]], names: tuple[str, ...]) -> float | None:
    for n in names:
        if fams.get(n):
            return sum(v for _, v in fams[n])
    return None


@dataclass(frozen=True)
class EngineSample:
    """One scrape of an engine's ``/metrics``.

    Attributes:
        waiting: requests waiting (``vllm:num_requests_waiting``), 0 if not exported.
        running: requests running (``vllm:num_requests_running``), 0 if not exported.
        kv_usage: KV cache usage, fraction in [0, 1] (mean over label sets), or ``None``.
        prefix_queries, prefix_hits: prefix-cache queried and hit tokens since the engine
            started (counters), or ``None``.
        metric: the autoscaling metric's total (the family asked for), 0 if not exported.
        kv_exported_blocks, kv_imported_blocks, kv_transfer_fallbacks: P/D KV transfer counters
            of a kvfleet engine since it started (blocks sent to decode engines, blocks received
            from prefill engines, imports that left part of a prompt to compute), or ``None``.
    """

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    metric: float = 0.0
    kv_exported_blocks: float | None = None
    kv_imported_blocks: float | None = None
    kv_transfer_fallbacks: float | None = None

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate (hit / queried tokens), or ``None`` before any query."""
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


def parse_engine_sample(text: str, metric: str = "vllm:num_requests_waiting") -> EngineSample:
    """Read an :class:`EngineSample` from an engine's ``/metrics`` text.

    Args:
        text: Prometheus exposition text.
        metric: the autoscaling metric family (``_total`` may be omitted for counters).

    Raises:
        ValueError: not Prometheus text.
    """
    fams = _families(text)
    kv = None
    for n in _KV:
        if fams.get(n):
            kv = sum(v for _, v in fams[n]) / len(fams[n])
            break
    name = metric[:-len("_total")] if metric.endswith("_total") else metric
    return EngineSample(waiting=_sum(fams, _WAITING) or 0.0, running=_sum(fams, _RUNNING) or 0.0, kv_usage=kv,
                        prefix_queries=_sum(fams, _QUERIES), prefix_hits=_sum(fams, _HITS),
                        metric=_sum(fams, (name,)) or 0.0, kv_exported_blocks=_sum(fams, _KV_EXPORTED),
                        kv_imported_blocks=_sum(fams, _KV_IMPORTED), kv_transfer_fallbacks=_sum(fams, _KV_FALLBACKS))


@dataclass(frozen=True)
class RouterSample:
    """One scrape of ``kvfleet router``'s ``/metrics``.

    Attributes:
        queued: requests the router holds (``kvfleet_router_queued_requests``): no endpoint yet
            (``--hold-when-empty``) or all saturated.
        in_flight: endpoint URL -> requests in flight (``kvfleet_router_in_flight``).
        requests: endpoint URL -> requests sent (``kvfleet_router_requests_total``).
        rejected: requests the router answered itself (``kvfleet_router_rejected_total``, all reasons).
    """

    queued: float = 0.0
    in_flight: dict[str, float] = field(default_factory=dict)
    requests: dict[str, float] = field(default_factory=dict)
    rejected: float = 0.0


def parse_router_sample(text: str) -> RouterSample:
    """Read a :class:`RouterSample` from the router's ``/metrics`` text.

    Raises:
        ValueError: not Prometheus text.
    """
    fams = _families(text)

    def by_endpoint(name: str) -> dict[str, float]:
        return {lab.get("endpoint", ""): v for lab, v in fams.get(name, [])}

    return RouterSample(queued=_sum(fams, ("kvfleet_router_queued_requests",)) or 0.0,
                        in_flight=by_endpoint("kvfleet_router_in_flight"),
                        requests=by_endpoint("kvfleet_router_requests"),
                        rejected=_sum(fams, ("kvfleet_router_rejected",)) or 0.0)
