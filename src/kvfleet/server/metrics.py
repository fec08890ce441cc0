"""Prometheus metrics with vLLM's names, types, labels and histogram buckets.

Dashboards, KEDA triggers and the Gateway API Inference Extension read vLLM's metric names
(``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...), so kvfleet exports the same
ones (names and bucket edges as in vLLM v1's ``PrometheusStatLogger``). Each
:class:`ServerMetrics` owns its own :class:`prometheus_client.CollectorRegistry`, so several
apps can live in one process (tests).

The engine feeds :meth:`ServerMetrics.record` with a :class:`~kvfleet.engine.stats.StepStats`
after every step (``engine.add_stat_logger(metrics.record)``), from the engine thread;
prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet.engine.stats import StepStats

#: vLLM v1 ``vllm:time_to_first_token_seconds`` buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
#: vLLM v1 ``vllm:inter_token_latency_seconds`` buckets (seconds).
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
#: vLLM v1 request latency buckets (e2e, queue time), seconds.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
#: finish reasons pre-created at 0 (like vLLM's ``FinishReason``).
FINISH_REASONS = ("stop", "length", "abort")
#: reasons of ``kvfleet:kv_transfer_fallbacks_total`` (see :class:`kvfleet.engine.kv_transfer.ImportResult`).
KV_FALLBACK_REASONS = ("prefix_missing", "pool_full", "local_evicted", "fetch_failed", "incompatible")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """Buckets 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count histograms)."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out or [1]
            out.append(v)
        exponent += 1


class ServerMetrics:
    """vLLM-compatible Prometheus metrics of one served model.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        max_model_len: longest sequence in tokens (upper edge of the token-count histograms).
        block_size: tokens per KV block, exported by ``vllm:cache_config_info``.
        num_blocks: KV blocks in the pool, exported as ``num_gpu_blocks`` by ``vllm:cache_config_info``.
        registry: where to register; a fresh :class:`CollectorRegistry` when None.

    Metrics (label ``model_name``): gauges ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (fraction in [0, 1]); counters
    ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
    ``vllm:request_success_total{finished_reason}``, ``vllm:prefix_cache_queries_total`` and
    ``vllm:prefix_cache_hits_total`` (tokens, as in vLLM v1), and kvfleet's own
    ``kvfleet:swap_out_total``, ``kvfleet:swap_in_total`` (requests) and
    ``kvfleet:cow_block_copies_total`` (blocks); for P/D KV transfer (:mod:`kvfleet.engine.kv_transfer`)
    ``kvfleet:kv_exported_blocks_total`` / ``kvfleet:kv_exported_bytes_total`` (prefill side),
    ``kvfleet:kv_imported_blocks_total`` / ``kvfleet:kv_imported_bytes_total`` (decode side),
    ``kvfleet:kv_import_requests_total`` (requests that asked for a remote prefill),
    ``kvfleet:kv_transfer_fallbacks_total{reason}`` (imports that left part of the prompt to
    compute locally) and the histogram ``kvfleet:kv_transfer_seconds{direction}`` (export: in
    the engine thread and serialization; import: fetch and import); histograms (seconds)
    ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
    ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``; token-count
    histograms ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``; info gauge
    ``vllm:cache_config_info{block_size, num_gpu_blocks} = 1``.
    """

    def __init__(self, model_name: str, max_model_len: int = 2048, block_size: int | None = None,
                 num_blocks: int | None = None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        self.num_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                 labels, registry=r).labels(model_name)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                 labels, registry=r).labels(model_name)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    labels, registry=r).labels(model_name)
        # prometheus_client appends _total to counter names.
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r).labels(model_name)
        self.num_preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                       labels, registry=r).labels(model_name)
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            labels, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            labels, registry=r).labels(model_name)
        self.swap_outs = Counter("kvfleet:swap_out", "Requests preempted by swapping their KV to host memory.",
                                 labels, registry=r).labels(model_name)
        self.swap_ins = Counter("kvfleet:swap_in", "Requests whose KV was swapped back from host memory.",
                                labels, registry=r).labels(model_name)
        self.cow_copies = Counter("kvfleet:cow_block_copies", "KV blocks copied on write.",
                                  labels, registry=r).labels(model_name)
        self.kv_exported_blocks = Counter("kvfleet:kv_exported_blocks", "KV blocks exported to decode engines (P/D).",
                                          labels, registry=r).labels(model_name)
        self.kv_exported_bytes = Counter("kvfleet:kv_exported_bytes", "KV bytes exported to decode engines (P/D).",
                                         labels, registry=r).labels(model_name)
        self.kv_imported_blocks = Counter("kvfleet:kv_imported_blocks",
                                          "KV blocks imported from prefill engines (P/D).",
                                          labels, registry=r).labels(model_name)
        self.kv_imported_bytes = Counter("kvfleet:kv_imported_bytes", "KV bytes imported from prefill engines (P/D).",
                                         labels, registry=r).labels(model_name)
        self.kv_import_requests = Counter("kvfleet:kv_import_requests",
                                          "Requests that asked for their prompt's KV from a prefill engine (P/D).",
                                          labels, registry=r).labels(model_name)
        self._kv_fallbacks = Counter("kvfleet:kv_transfer_fallbacks",
                                     "KV imports that left part of the prompt to compute locally, by reason.",
                                     labels + ["reason"], registry=r)
        for reason in KV_FALLBACK_REASONS:
            self._kv_fallbacks.labels(model_name, reason)
        self._kv_seconds = Histogram("kvfleet:kv_transfer_seconds", "Seconds of KV export / import (P/D).",
                                     labels + ["direction"], buckets=TTFT_BUCKETS, registry=r)
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        labels + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)

        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               labels, buckets=token_buckets, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            labels, buckets=token_buckets, registry=r).labels(model_name)

        if block_size is not None and num_blocks is not None:
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         ["block_size", "num_gpu_blocks"], registry=r)
            info.labels(str(block_size), str(num_blocks)).set(1)

    def record(self, stats: StepStats) -> None:
        """Fold one engine step into the metrics (called from the engine thread).

        Args:
            stats: the step's :class:`StepStats` (latencies in seconds, counts in tokens).
        """
        self.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        for counter, v in ((self.prefix_cache_queries, stats.prefix_cache_queries),
                           (self.prefix_cache_hits, stats.prefix_cache_hits), (self.swap_outs, stats.num_swap_outs),
                           (self.swap_ins, stats.num_swap_ins), (self.cow_copies, stats.num_cow_copies)):
            if v:
                counter.inc(v)
        for t in stats.time_to_first_tokens:
            self.ttft.observe(t)
        for t in stats.inter_token_latencies:
            self.itl.observe(t)
        for f in stats.finished:
            self._request_success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queue_time)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)

    def record_kv_export(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        """Count one P/D KV export (prefill side): blocks and bytes sent, seconds taken."""
        self.kv_exported_blocks.inc(num_blocks)
        self.kv_exported_bytes.inc(num_bytes)
        self._kv_seconds.labels(self.model_name, "export").observe(seconds)

    def record_kv_import(self, result: object) -> None:
        """Count one P/D KV import (decode side) from a
        :class:`~kvfleet.engine.kv_transfer.ImportResult` (thread-safe)."""
        self.kv_import_requests.inc()
        self.kv_imported_blocks.inc(getattr(result, "num_imported_blocks", 0))
        self.kv_imported_bytes.inc(getattr(result, "num_bytes", 0))
        self._kv_seconds.labels(self.model_name, "import").observe(getattr(result, "seconds", 0.0))
        reason = getattr(result, "fallback", None)
        if reason:
            self._kv_fallbacks.labels(self.model_name, reason).inc()

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the scheduler-state gauges (requests, and the KV usage fraction in [0, 1])."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
