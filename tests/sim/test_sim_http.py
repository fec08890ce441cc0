"""Simulated engines over real HTTP (in-process fleet on a background loop), with the openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.sim.engine import SimEngineConfig
from kvfleet.sim.fleet import SimFleetThread
from kvfleet.sim.latency import LatencyModel

MODEL = "sim-model"
# 2 ms + 20 us per prefill token + 0.2 ms per decode: fast, yet a prefix hit is visibly cheaper.
LAT = LatencyModel(base_s=0.002, prefill_s_per_token=2e-5, decode_s_per_seq=2e-4, kv_read_s_per_token=1e-7)


@pytest.fixture(scope="module")
def fleet():
    with SimFleetThread(2, SimEngineConfig(model_name=MODEL, latency=LAT)) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    """``{name{labels}: value}`` of an engine's /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_fleet_serves_independent_engines(fleet):
    assert len(set(fleet.ports)) == 2
    for i, url in enumerate(fleet.urls):
        r = httpx.get(url + "/health")
        assert r.status_code == 200 and r.headers["x-kvfleet-sim-engine"] == f"sim-{i}"
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["owned_by"], m["max_model_len"]) for m in models] == [(MODEL, "kvfleet-simulator", 8192)]


def test_completion_non_stream(client):
    r = client.completions.create(model=MODEL, prompt="abcd" * 10, max_tokens=6)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 6
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (10, 6, 16)
    assert u.prompt_tokens_details.cached_tokens == 0
    # token-id prompts are accepted too
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 2


def test_chat_non_stream_and_default_length(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    # "system: be brief\nuser: hello there\nassistant: " = 46 characters = 12 tokens
    assert r.usage.prompt_tokens == 12
    r = client.chat.completions.create(model=MODEL, messages=msgs)  # no max_tokens: simulated EOS
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 256


def test_streams_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="stream me " * 8, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 5 and all(t.startswith(" ") for t in texts)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 20

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(content) == 3 and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 3
    # without include_usage: no usage chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_ends_with_done(fleet):
    body = {"model": MODEL, "prompt": "raw sse", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", fleet.urls[0] + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


def test_prefix_cache_hit_is_reported_in_usage_and_metrics(fleet):
    url = fleet.urls[1]  # the other engine: its counters are ours alone
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = metrics(url)
    prompt = "A long document that many requests share, followed by a question. " * 12  # 792 chars
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 198
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 192  # 12 full blocks of 16
    after = metrics(url)
    assert after["vllm:prefix_cache_queries_total{}"] - before.get("vllm:prefix_cache_queries_total{}", 0) == 396
    assert after["vllm:prefix_cache_hits_total{}"] - before.get("vllm:prefix_cache_hits_total{}", 0) == 192
    assert after["vllm:prompt_tokens_total{}"] - before.get("vllm:prompt_tokens_total{}", 0) == 396
    assert after["vllm:generation_tokens_total{}"] - before.get("vllm:generation_tokens_total{}", 0) == 4
    ok = "vllm:request_success_total{finished_reason=length}"
    assert after[ok] - before.get(ok, 0) == 2
    assert after["vllm:time_to_first_token_seconds_count{}"] - before.get(
        "vllm:time_to_first_token_seconds_count{}", 0) == 2


def test_metrics_parse_with_gauges(fleet):
    m = metrics(fleet.urls[0])
    for name in ("vllm:num_requests_running{}", "vllm:num_requests_waiting{}", "vllm:kv_cache_usage_perc{}",
                 "vllm:prefix_cache_queries_total{}", "vllm:prefix_cache_hits_total{}", "vllm:prompt_tokens_total{}",
                 "vllm:generation_tokens_total{}", "vllm:time_to_first_token_seconds_count{}",
                 "vllm:request_success_total{finished_reason=stop}"):
        assert name in m, name
    assert m["vllm:num_requests_running{}"] == 0 and m["vllm:kv_cache_usage_perc{}"] == 0
    assert m["vllm:cache_config_info{block_size=16,num_gpu_blocks=2912}"] == 1


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 9000}, "max_tokens"),
    ({"prompt": "x" * 40000}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 10**7]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "model": "other"}, "model"),
    ({}, "prompt"),
])
def test_bad_completion_requests_get_400(fleet, body, param):
    r = httpx.post(fleet.urls[0] + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_chat_requests_get_400(fleet):
    url = fleet.urls[0] + "/v1/chat/completions"
    for body in ({"messages": []}, {"messages": [{"content": "no role"}]}, {"messages": "hi"},
                 {"messages": [{"role": "user", "content": "x"}], "n": 3},
                 {"messages": [{"role": "user", "content": "x"}], "logprobs": True}):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(fleet.urls[0] + "/v1/nothing").status_code == 404


def test_gauges_follow_load_and_disconnects_abort():
    """With 2 sequence slots and 6 long requests in flight, /metrics shows 2 running and the rest
    waiting; when the clients go away the requests are aborted and the gauges fall to 0."""
    cfg = SimEngineConfig(model_name=MODEL, max_num_seqs=2, latency=LatencyModel(0.005, 0.0, 0.0))
    with SimFleetThread(1, cfg) as f:
        url = f.urls[0]

        async def load() -> tuple[float, float, int]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                body = {"model": MODEL, "prompt": "long running request", "max_tokens": 5000, "stream": True}

                release = asyncio.Event()

                async def one(i: int) -> int:
                    n = 0
                    req = {**body, "prompt": f"{i} {body['prompt']}"}
                    async with c.stream("POST", "/v1/completions", json=req) as r:
                        async for line in r.aiter_lines():
                            n += line.startswith("data: {")
                            if n >= 3:
                                await release.wait()
                                break  # closing the stream disconnects the client
                    return n

                readers = [asyncio.create_task(one(i)) for i in range(2)]  # the two that will run
                await asyncio.sleep(0)
                waiting = [asyncio.create_task(c.post("/v1/completions", json={**body, "stream": False,
                                                                               "prompt": f"w{i}"}))
                           for i in range(4)]
                seen = (0.0, 0.0)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    m = metrics(url)
                    seen = (m["vllm:num_requests_running{}"], m["vllm:num_requests_waiting{}"])
                    if seen == (2, 4):
                        break
                    await asyncio.sleep(0.05)
                release.set()
                for t in waiting:
                    t.cancel()
                got = sum(await asyncio.gather(*readers))
                await asyncio.gather(*waiting, return_exceptions=True)
                return seen[0], seen[1], got

        running, waiting, got = asyncio.run(load())
        assert (running, waiting) == (2, 4) and got == 6
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = metrics(url)
            if (m["vllm:num_requests_running{}"], m["vllm:num_requests_waiting{}"]) == (0, 0):
                break
            time.sleep(0.1)
        assert (m["vllm:num_requests_running{}"], m["vllm:num_requests_waiting{}"]) == (0, 0)
        assert m["vllm:request_success_total{finished_reason=abort}"] == 6
        engine = f.engines[0]
        assert f.call(lambda: engine.kv_cache_manager.num_free_blocks) == engine.num_blocks
