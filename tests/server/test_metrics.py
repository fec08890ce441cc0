"""ServerMetrics: vLLM names, types, labels and bucket edges, fed by StepStats (no model)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvfleet.engine.stats import FinishedRequestStats, StepStats
from kvfleet.server.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    build_1_2_5_buckets,
)


def _families(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def _value(m: ServerMetrics, sample_name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((sample_name, labels))


def test_names_types_and_info_gauge():
    m = ServerMetrics("tiny", max_model_len=100, block_size=16, num_blocks=321)
    fams = _families(m)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, typ in expected.items():
        assert name in fams, name
        assert fams[name].type == typ, name
    text = m.render().decode()
    assert 'vllm:prompt_tokens_total{model_name="tiny"} 0.0' in text
    assert _value(m, "vllm:cache_config_info", block_size="16", num_gpu_blocks="321") == 1.0
    for reason in ("stop", "length", "abort"):
        assert _value(m, "vllm:request_success_total", model_name="tiny", finished_reason=reason) == 0.0


def test_bucket_edges_are_vllms():
    m = ServerMetrics("tiny")

    def edges(name: str) -> list[float]:
        fam = _families(m)[name]
        return [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]

    assert edges("vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert TTFT_BUCKETS[:3] == [0.001, 0.005, 0.01] and TTFT_BUCKETS[-1] == 2560.0
    assert edges("vllm:inter_token_latency_seconds") == ITL_BUCKETS
    assert edges("vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS
    assert edges("vllm:request_queue_time_seconds") == REQUEST_LATENCY_BUCKETS
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_record_step_stats():
    m = ServerMetrics("tiny", max_model_len=64)
    m.record(StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_prompt_tokens=10,
                       num_generation_tokens=3, num_preemptions=1, time_to_first_tokens=[0.003, 0.2],
                       inter_token_latencies=[0.02]))
    m.record(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_generation_tokens=2,
                       finished=[FinishedRequestStats("stop", 1.2, 0.1, 10, 4),
                                 FinishedRequestStats("length", 0.4, 0.0, 5, 16)]))
    lab = {"model_name": "tiny"}
    assert _value(m, "vllm:num_requests_running", **lab) == 0
    assert _value(m, "vllm:kv_cache_usage_perc", **lab) == 0
    assert _value(m, "vllm:prompt_tokens_total", **lab) == 10
    assert _value(m, "vllm:generation_tokens_total", **lab) == 5
    assert _value(m, "vllm:num_preemptions_total", **lab) == 1
    assert _value(m, "vllm:request_success_total", finished_reason="stop", **lab) == 1
    assert _value(m, "vllm:request_success_total", finished_reason="length", **lab) == 1
    assert _value(m, "vllm:time_to_first_token_seconds_count", **lab) == 2
    assert _value(m, "vllm:time_to_first_token_seconds_bucket", le="0.005", **lab) == 1
    assert _value(m, "vllm:time_to_first_token_seconds_bucket", le="0.25", **lab) == 2
    assert _value(m, "vllm:inter_token_latency_seconds_sum", **lab) == 0.02
    assert _value(m, "vllm:e2e_request_latency_seconds_count", **lab) == 2
    assert abs(_value(m, "vllm:e2e_request_latency_seconds_sum", **lab) - 1.6) < 1e-9
    assert _value(m, "vllm:request_queue_time_seconds_bucket", le="0.3", **lab) == 2
    assert _value(m, "vllm:request_generation_tokens_sum", **lab) == 20


def test_separate_registries():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.record(StepStats(num_generation_tokens=7))
    assert _value(a, "vllm:generation_tokens_total", model_name="a") == 7
    assert _value(b, "vllm:generation_tokens_total", model_name="b") == 0
