"""End to end: a real ``python -m kvfleet serve`` process with the real SmolLM2 model, driven by
the real ``openai`` client (and raw httpx where the client would hide the wire format).

One server (module-scoped) serves every test: a small KV pool, ``--max-num-seqs 2`` and
``--max-waiting-requests 2`` so the overload test can fill the waiting queue.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 96
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Base URL of a running server; the process is killed after the module."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "kvfleet", "serve", MODEL, "--port", str(port), "--api-key", API_KEY,
           "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
           "--max-waiting-requests", "2", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _metrics(server: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _metric(server: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return _metrics(server)[key]


# ------------------------------------------------------------------------------------ basics


def test_health_models_and_auth(server, client):
    assert httpx.get(server + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(server + "/v1/models", headers=_auth()).json()
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN

    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 401
    r = httpx.post(server + "/v1/completions", json={"prompt": "x"})  # no key, and a valid body
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server + "/v1/completions", content=b"{not json")  # 401 wins over the bad body
    assert r.status_code == 401
    # /health and /metrics stay open
    assert httpx.get(server + "/metrics").status_code == 200


def test_chat_non_streaming_and_streaming_agree(server, client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("length", "stop")
    tok = httpx.post(server + "/tokenize", json={"messages": MESSAGES}).json()
    assert full.usage.prompt_tokens == tok["count"]
    assert 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_streaming_matches_and_sse_wire_format(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    # raw SSE: data lines, blank-line separated, ending with [DONE]
    with httpx.stream("POST", server + "/v1/completions", headers=_auth(), timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    pieces = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in pieces) == full.choices[0].text
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"
    # the same prompt given as token ids gives the same greedy text
    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == full.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_n2_and_seed_reproducibility(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, n=2, seed=11,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 10
    assert all(c.finish_reason == "length" for c in r.choices)

    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1234)
    assert a.choices[0].text == b.choices[0].text
    chat_a = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7)
    chat_b = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7)
    assert chat_a.choices[0].message.content == chat_b.choices[0].message.content


def test_chat_n2_streaming(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=1.0,
                                                 n=2, seed=5, stream=True, stream_options={"include_usage": True}))
    roles = {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1}
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert 2 <= chunks[-1].usage.completion_tokens <= 8


# ------------------------------------------------------------------------------------ logprobs


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == c.message.content
    for t in content:
        assert t.logprob <= 0
        assert t.bytes == list(t.token.encode("utf-8"))
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
    no_lp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert no_lp.choices[0].logprobs is None


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.text
    for tok, off, val, top in zip(lp.tokens, lp.text_offset, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert c.text[off:].startswith(tok)
        assert val <= 0
        assert 1 <= len(top) <= 3 and tok in top
        assert max(top.values()) == pytest.approx(val, abs=1e-4)  # greedy picks the argmax


# ------------------------------------------------------------------------------------ stop strings


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    r2 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=stop,
                                   extra_body={"include_stop_str_in_output": True})
    assert r2.choices[0].text == cut + stop
    # streamed: the stop string never leaks into a chunk
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------ bad input


BAD_CHAT = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 0}, "n must be"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"model": "no-such-model"}, "no-such-model"),
    ({"max_tokens": 100_000}, "maximum context length"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": "two"}, "n"),
    ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": 3, "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"stop": 5}, "stop"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**64)}, "seed"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
]


@pytest.mark.parametrize("override, needle", BAD_CHAT, ids=[str(b[0]) for b in BAD_CHAT])
def test_bad_chat_requests_are_400(client, override, needle):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **override}
    model, messages = kw.pop("model"), kw.pop("messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, extra_body=kw)
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and err.get("type") == "invalid_request_error", err
    assert needle in err["message"], err


BAD_COMPLETION = [
    ({"prompt": ["one", "two"]}, "batched prompts"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**7]}, "10000000"),
    ({"prompt": "word " * (MAX_MODEL_LEN + 50)}, "maximum context length"),
    ({"logprobs": 50}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": "x" * 5_000_000}, "characters"),
]


@pytest.mark.parametrize("override, needle", BAD_COMPLETION, ids=[str(b[0])[:40] for b in BAD_COMPLETION])
def test_bad_completion_requests_are_400(client, override, needle):
    kw = {"prompt": PROMPT, "max_tokens": 2, **override}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=kw.pop("prompt"), extra_body=kw)
    assert needle in e.value.body["message"], e.value.body


@pytest.mark.parametrize("payload, needle", [
    (b"{this is not json", "invalid JSON"),
    (b'{"model": "x"}', "messages: Field required"),
    (b"[1, 2]", "Input should be a valid dictionary"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}' % MODEL.encode(),
     "tokenized"),
])
def test_malformed_bodies_are_400(server, payload, needle):
    r = httpx.post(server + "/v1/chat/completions", content=payload,
                   headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"]


def test_unknown_route_is_openai_shaped_404(server):
    r = httpx.get(server + "/v1/nope", headers=_auth())
    assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------ tokenize, metrics


def test_tokenize_detokenize_roundtrip(server):
    text = "Hello, paged attention! Ünïcödé ✓"
    t = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) > 3 and t["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert back["prompt"] == text
    r = httpx.post(server + "/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(server + "/tokenize", json={})
    assert r.status_code == 400


def test_metrics_after_requests(server, client):
    before = _metric(server, "vllm:generation_tokens_total")
    ok_before = _metric(server, "vllm:request_success_total", finished_reason="length")
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    m = _metrics(server)
    lab = (("model_name", MODEL),)
    assert m[("vllm:generation_tokens_total", lab)] >= before + 3
    assert m[("vllm:prompt_tokens_total", lab)] > 0
    key = ("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert m[key] >= ok_before + 1
    assert m[("vllm:time_to_first_token_seconds_count", lab)] >= 1
    assert m[("vllm:inter_token_latency_seconds_count", lab)] >= 2
    assert m[("vllm:e2e_request_latency_seconds_count", lab)] >= 1
    assert ("vllm:request_queue_time_seconds_count", lab) in m
    assert ("vllm:time_to_first_token_seconds_bucket", (("le", "0.001"), ("model_name", MODEL))) in m
    assert ("vllm:num_preemptions_total", lab) in m
    assert m[("vllm:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", str(NUM_BLOCKS))))] == 1
    assert m[("vllm:num_requests_running", lab)] == 0
    assert m[("vllm:num_requests_waiting", lab)] == 0


# ------------------------------------------------------------------------------------ disconnect, overload


def _wait_idle(server: str, timeout: float = 20.0) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = _metric(server, "vllm:num_requests_running")
        usage = _metric(server, "vllm:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            return running, usage
        time.sleep(0.2)


def test_client_disconnect_mid_stream_frees_blocks(server):
    aborts_before = _metric(server, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server + "/v1/completions", json=body,
                                                 headers=_auth()) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
                if n == 3:
                    break
        # mid-generation: the request holds KV blocks right now
        m = _metrics(server)
        lab = (("model_name", MODEL),)
        assert m[("vllm:kv_cache_usage_perc", lab)] > 0, {k: v for k, v in m.items() if k[0].startswith("vllm:num")}
    # connection closed without reading the rest
    assert _wait_idle(server) == (0, 0)
    deadline = time.monotonic() + 10
    while _metric(server, "vllm:request_success_total", finished_reason="abort") < aborts_before + 1:
        assert time.monotonic() < deadline, "abort was not counted"
        time.sleep(0.2)


def test_queue_full_is_503_with_retry_after(server):
    """--max-num-seqs 2 and --max-waiting-requests 2: of 7 simultaneous long requests, some must
    be turned away with 503 + Retry-After while the admitted ones complete."""
    results: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(7)

    def one() -> None:
        start.wait()
        r = httpx.post(server + "/v1/completions", headers=_auth(), timeout=120,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    codes = sorted(r.status_code for r in results)
    assert len(codes) == 7
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 2 and codes.count(503) >= 1, codes
    for r in results:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    assert _wait_idle(server) == (0, 0)


def test_seeded_request_next_to_an_unseeded_one_both_succeed(client):
    """A seeded request never disturbs the batch it shares (max seed, n=2: child seeds wrap)."""
    import concurrent.futures as cf

    def run(extra):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                      extra_body={"ignore_eos": True, **extra})
        return [c.finish_reason for c in r.choices]

    # this server runs 2 sequences at most and queues 2: one seeded and one unseeded request together
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(run, {"seed": 2**64 - 1})
        b = ex.submit(run, {})
        assert a.result() == ["length"] and b.result() == ["length"]
    assert run({"seed": 2**64 - 1, "n": 2}) == ["length", "length"]  # child seeds wrap around 2**64


# ------------------------------------------------------------------------------------ KV cache features


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    prompt = "A long shared instruction for caching tests. " * 6 + "Answer:"
    q0 = _metric(server, "vllm:prefix_cache_queries_total")
    h0 = _metric(server, "vllm:prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert (n - 1) // 16 * 16 == cached > 0  # every full block but the one holding the last token
    assert second.choices[0].text == first.choices[0].text
    assert _metric(server, "vllm:prefix_cache_queries_total") - q0 == 2 * n
    assert _metric(server, "vllm:prefix_cache_hits_total") - h0 == cached
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "tenant-a"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another namespace
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=2, temperature=0)
    chat2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details is not None
    assert chat2.usage.prompt_tokens_details.cached_tokens > 0


def test_beam_search_over_http(server, client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=0,
                                     extra_body={"use_beam_search": True, "best_of": 2})
    assert len(resp.choices) == 2 and all(c.text for c in resp.choices)
    assert resp.choices[0].text != resp.choices[1].text
    assert 2 <= resp.usage.completion_tokens <= 12
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    for body, param in (({"stream": True}, "stream"), ({"temperature": 1.0}, "temperature"),
                        ({"best_of": 1}, "best_of"), ({"best_of": 40}, "best_of"),
                        ({"best_of": 3}, "best_of")):  # 3 beams > --max-num-seqs 2: they could never run together
        r = httpx.post(server + "/v1/completions", headers=_auth(), timeout=30,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 0,
                             "use_beam_search": True, "best_of": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    r = httpx.post(server + "/v1/completions", headers=_auth(), timeout=30,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
