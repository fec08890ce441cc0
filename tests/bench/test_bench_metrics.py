"""Serving metrics on known synthetic timelines, goodput, percentiles, arrivals and SSE parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvfleet.bench.loadgen import EndpointConfig, arrival_intervals, parse_sse_data
from kvfleet.bench.metrics import RequestResult, compute_metrics, parse_goodput, parse_percentiles


def _req(ttft: float, latency: float, out: int, prompt: int = 10, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(success=True, ttft=ttft, latency=latency, output_tokens=out, prompt_tokens=prompt,
                         itl=itl or [], usage_reported=True)


def test_known_timelines_give_known_percentiles_and_throughput():
    # TTFT 100, 200, 300, 400 ms; each request 11 output tokens, decode 1.0 s -> TPOT 100 ms.
    reqs = [_req(t, t + 1.0, 11, itl=[0.1] * 10) for t in (0.1, 0.2, 0.3, 0.4)]
    m = compute_metrics(reqs, duration_s=2.0)
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    # linear interpolation: index 0.9 * 3 = 2.7 -> 300 + 0.7 * 100
    assert m["p90_ttft_ms"] == pytest.approx(370.0)
    assert m["p99_ttft_ms"] == pytest.approx(397.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["p99_tpot_ms"] == pytest.approx(100.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0)
    assert m["p50_e2el_ms"] == pytest.approx(1250.0)
    assert m["request_throughput_req_s"] == pytest.approx(2.0)
    assert m["output_throughput_tok_s"] == pytest.approx(44 / 2.0)
    assert m["total_throughput_tok_s"] == pytest.approx((44 + 40) / 2.0)
    assert m["goodput_req_s"] is None


def test_goodput_counts_requests_meeting_every_slo():
    reqs = [
        _req(0.1, 1.1, 11),    # ttft 100, tpot 100 -> good
        _req(0.2, 0.7, 11),    # ttft 200, tpot 50 -> good
        _req(0.6, 1.1, 11),    # ttft 600 -> misses ttft
        _req(0.1, 3.1, 11),    # tpot 300 -> misses tpot
        _req(0.1, 0.1, 1),     # one token: no TPOT, passes a TPOT SLO
    ]
    m = compute_metrics(reqs, duration_s=5.0, goodput_slos={"ttft": 500, "tpot": 150})
    assert m["goodput_req_s"] == pytest.approx(3 / 5.0)
    m = compute_metrics(reqs, duration_s=5.0, goodput_slos={"e2el": 1000})
    assert m["goodput_req_s"] == pytest.approx(2 / 5.0)  # 0.7 s and 0.1 s


def test_failed_requests_are_excluded_and_errors_listed():
    reqs = [_req(0.1, 1.1, 11), RequestResult(error="HTTP 503: busy"), RequestResult(error="HTTP 503: busy"),
            RequestResult(error="ReadTimeout: x")]
    m = compute_metrics(reqs, duration_s=1.0, goodput_slos={"ttft": 1000})
    assert m["completed"] == 1 and m["failed"] == 3
    assert m["errors"] == ["HTTP 503: busy", "ReadTimeout: x"]
    assert m["goodput_req_s"] == pytest.approx(1.0)
    assert m["total_output_tokens"] == 11


def test_no_successful_request_gives_none_stats():
    m = compute_metrics([RequestResult(error="boom")], duration_s=1.0)
    assert m["completed"] == 0 and m["p50_ttft_ms"] is None and m["mean_tpot_ms"] is None
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], duration_s=0.0)


def test_tpot_definition():
    r = _req(0.5, 2.5, 5)
    assert r.tpot == pytest.approx(0.5)
    assert _req(0.5, 0.5, 1).tpot is None
    assert RequestResult(ttft=0.1, latency=1.0, output_tokens=5).tpot is None  # failed


def test_custom_percentiles():
    reqs = [_req(t / 10, t / 10 + 1, 3) for t in range(1, 11)]
    m = compute_metrics(reqs, 1.0, percentiles=(25.0, 99.9))
    assert m["p25_ttft_ms"] == pytest.approx(float(np.percentile(np.arange(1, 11) * 100.0, 25)))
    assert "p99_9_ttft_ms" in m


@pytest.mark.parametrize("bad,match", [
    (["ttft"], "KEY:MILLISECONDS"), (["foo:3"], "not one of"), (["ttft:abc"], "not a number"),
    (["ttft:-1"], "positive"), (["ttft:1", "ttft:2"], "twice"),
])
def test_parse_goodput_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_goodput(bad)


def test_parse_goodput_and_percentiles():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_arrivals_poisson_gamma_and_inf():
    assert arrival_intervals(5, math.inf) == [0.0] * 5
    a = arrival_intervals(4000, 4.0, 1.0, seed=1)
    assert a == arrival_intervals(4000, 4.0, 1.0, seed=1)  # seeded
    assert a != arrival_intervals(4000, 4.0, 1.0, seed=2)
    assert np.mean(a) == pytest.approx(0.25, rel=0.05)
    # coefficient of variation^2 of gamma gaps = 1 / shape
    assert np.var(a) / np.mean(a) ** 2 == pytest.approx(1.0, rel=0.1)
    b = arrival_intervals(4000, 4.0, 0.25, seed=1)
    assert np.mean(b) == pytest.approx(0.25, rel=0.1)
    assert np.var(b) / np.mean(b) ** 2 == pytest.approx(4.0, rel=0.15)
    for args in ((3, 0.0), (3, -1.0), (3, 1.0, 0.0), (-1, 1.0)):
        with pytest.raises(ValueError):
            arrival_intervals(*args)


def test_parse_sse_data():
    assert parse_sse_data('data: {"choices": []}') == {"choices": []}
    assert parse_sse_data("data: [DONE]") == "[DONE]"
    assert parse_sse_data("") is None and parse_sse_data(": keep-alive") is None
    assert parse_sse_data("event: x") is None
    with pytest.raises(ValueError, match="not JSON"):
        parse_sse_data("data: {broken")


def test_endpoint_config_payloads_and_errors():
    from kvfleet.bench.datasets import BenchRequest

    req = BenchRequest(prompt="hi", messages=[{"role": "user", "content": "hi"}], prompt_len=1, output_len=7)
    c = EndpointConfig("http://127.0.0.1:9/v1/", model="m")
    assert c.base_url == "http://127.0.0.1:9"
    body = c.payload(req)
    assert body["prompt"] == "hi" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    chat = EndpointConfig("http://x", endpoint="/v1/chat/completions", ignore_eos=False).payload(req)
    assert chat["messages"] == req.messages and "prompt" not in chat and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="endpoint"):
        EndpointConfig("http://x", endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="http"):
        EndpointConfig("localhost:8000")
