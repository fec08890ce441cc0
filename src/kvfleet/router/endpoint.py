"""What the router knows about one engine replica, and how it reads it from ``/metrics``.

The router knows engines only through HTTP: their OpenAI API, ``/health`` and the Prometheus
text of ``/metrics``. Load signals are read under vLLM's names and SGLang's, so any
vLLM- or SGLang-compatible server can sit behind the router.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: Prometheus metric families (without ``_total``) read as each load signal, first found wins.
WAITING_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
#: KV cache usage as a fraction in [0, 1]: vLLM v1, vLLM v0 (GPU name), SGLang (token usage).
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


@dataclass
class EngineLoad:
    """Load signals scraped from one ``/metrics`` page (None = not exported).

    Attributes:
        waiting: requests queued in the engine (``vllm:num_requests_waiting``).
        running: requests in the running batch (``vllm:num_requests_running``).
        kv_usage: KV cache usage in [0, 1] (``vllm:kv_cache_usage_perc``).
        scraped_at: ``time.monotonic()`` of the scrape, seconds.
    """

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    scraped_at: float = 0.0


def parse_engine_load(text: str, now: float | None = None) -> EngineLoad:
    """Read the load signals from Prometheus exposition text; samples of one family with
    several label sets (vLLM labels by model and engine) are summed, KV usage is averaged.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    values: dict[str, list[float]] = {}
    wanted = set(WAITING_METRICS + RUNNING_METRICS + KV_USAGE_METRICS)
    for fam in text_string_to_metric_families(text):
        if fam.name in wanted:
            values.setdefault(fam.name, []).extend(s.value for s in fam.samples if s.name == fam.name)

    def first(names: tuple[str, ...], mean: bool = False) -> float | None:
        for n in names:
            if values.get(n):
                v = values[n]
                return sum(v) / len(v) if mean else sum(v)
        return None

    return EngineLoad(first(WAITING_METRICS), first(RUNNING_METRICS), first(KV_USAGE_METRICS, mean=True),
                      time.monotonic() if now is None else now)


@dataclass
class Endpoint:
    """One engine replica as the router sees it.

    Attributes:
        url: base URL, e.g. ``http://10.0.0.7:8000`` (no trailing slash).
        healthy: False while ejected after failed health checks or requests.
        in_flight: requests the router has sent and not finished (its own count).
        load: the last scraped :class:`EngineLoad`.
        consecutive_failures: failed health checks or requests since the last success.
        ejected_until: ``time.monotonic()`` before which the endpoint is not probed again.
        requests_total, errors_total: routed requests and failed ones (router metrics).
    """

    url: str
    healthy: bool = True
    in_flight: int = 0
    load: EngineLoad = field(default_factory=EngineLoad)
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    requests_total: int = 0
    errors_total: int = 0

    @property
    def queue_depth(self) -> float:
        """Requests waiting in the engine (0 when it does not export the metric)."""
        return self.load.waiting or 0.0

    @property
    def kv_usage(self) -> float:
        """KV cache usage in [0, 1] (0 when unknown)."""
        return min(1.0, max(0.0, self.load.kv_usage or 0.0))
