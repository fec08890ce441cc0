"""The router's prefill/decode split over HTTP with real engines (SmolLM2, in-process `kvfleet serve`
apps on their own ports): the `openai` client's streamed and non-streamed chat and text completions
through the P/D router equal a single engine's greedy output; the decode engine's metrics show the
imported KV blocks and its prefix-cache hit, the prefill engine's the exported blocks and the
one-token request it served. Also: the decode-only fallback when no prefill endpoint is healthy (and
the ``error`` alternative), a decode engine that cannot reach its prefill engine, bad
``kv_transfer_params`` and export requests (HTTP 400), the router's P/D flags, and (slow) `kvfleet up
-f examples/pd-smollm2.yaml` serving a chat request through the split."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.conftest import make_engine

from kvfleet.bench.compare import free_port

MODEL = "smollm2-135m-instruct"
BS = 16
REPO = Path(__file__).resolve().parents[2]
STORY = ("Write two sentences about a lighthouse keeper who climbs the spiral stairs every evening at dusk, "
         "carrying a can of oil and a cloth for the great lens, while ships pass the rocky headland.")


class Served:
    """A uvicorn server on a background thread, for an app (a context manager)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def engine_app(loaded, **kw):
    from kvfleet.engine.async_engine import AsyncLLM
    from kvfleet.server.app import create_app

    llm = AsyncLLM(engine=make_engine(loaded, **{"num_kv_blocks": 64, "block_size": BS, **kw}))
    llm.start()
    return llm, create_app(llm, served_model_names=[MODEL])


def pd_router_app(prefill_urls: list[str], decode_urls: list[str], fallback: str = "decode"):
    from kvfleet.router.app import RouterConfig, create_router_app
    from kvfleet.router.discovery import StaticDiscovery
    from kvfleet.router.pd import PDConfig
    from kvfleet.router.picker import EndpointPicker
    from kvfleet.router.scorers import PROFILES, build_scorer

    def picker():
        return EndpointPicker([(build_scorer(n), w) for n, w in PROFILES["default"].items()])

    return create_router_app(StaticDiscovery(decode_urls), picker(), RouterConfig(max_retries=1),
                             {"health_interval_s": 0.3, "scrape_interval_s": 0.1},
                             prefill=(StaticDiscovery(prefill_urls), picker()), pd=PDConfig(fallback=fallback))


def samples(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def value(url: str, name: str, **labels: str) -> float:
    return samples(url).get((name, tuple(sorted(labels.items()))), 0.0)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, content: str, stream: bool = False, **extra) -> tuple[str, object]:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0)
    if not stream:
        r = client(url).chat.completions.create(**kw, extra_body=extra or None)
        return r.choices[0].message.content, r
    chunks = client(url).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra or None)
    text, usage = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
        usage = c.usage or usage
    return text, usage


@pytest.fixture(scope="module")
def fleet(smollm2_loaded):
    """A prefill engine, a decode engine and the P/D router in front of them."""
    pre_llm, pre_app = engine_app(smollm2_loaded)
    dec_llm, dec_app = engine_app(smollm2_loaded)
    with Served(pre_app) as pre, Served(dec_app) as dec, Served(pd_router_app([pre.url], [dec.url])) as router:
        yield {"prefill": pre.url, "decode": dec.url, "router": router.url, "dec_llm": dec_llm, "pre_llm": pre_llm}
    pre_llm.shutdown()
    dec_llm.shutdown()


def usable_tokens(fleet, content: str) -> int:
    ids = fleet["dec_llm"].apply_chat_template([{"role": "user", "content": content}])
    return (len(ids) - 1) // BS * BS


def test_chat_through_the_split_equals_a_single_engine(fleet):
    pre, dec, router = fleet["prefill"], fleet["decode"], fleet["router"]
    before_p, before_d, before_r = samples(pre), samples(dec), samples(router)
    text, resp = chat(router, STORY)
    # the reference: the decode engine alone, computing the prompt itself (another cache namespace)
    ref, _ = chat(dec, STORY, cache_salt="reference")
    assert text == ref and len(text) > 4
    usable = usable_tokens(fleet, STORY)
    assert usable >= 3 * BS
    assert resp.usage.prompt_tokens_details.cached_tokens == usable  # the imported prefix was a cache hit
    after_p, after_d, after_r = samples(pre), samples(dec), samples(router)

    def delta(a, b, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return a.get(key, 0.0) - b.get(key, 0.0)

    # the prefill engine served a one-token request and exported the prompt's blocks
    assert delta(after_p, before_p, "vllm:generation_tokens_total") == 1
    assert delta(after_p, before_p, "vllm:request_success_total", finished_reason="length") == 1
    assert delta(after_p, before_p, "kvfleet:kv_exported_blocks_total") == usable // BS
    # the decode engine imported them (no fallback) and generated the answer; the reference
    # request added its own prompt tokens to the prefix-cache queries but no hit
    assert delta(after_d, before_d, "kvfleet:kv_imported_blocks_total") == usable // BS
    assert delta(after_d, before_d, "kvfleet:kv_imported_bytes_total") == usable * 2 * 30 * 3 * 64 * 4
    assert delta(after_d, before_d, "kvfleet:kv_import_requests_total") == 1
    assert delta(after_d, before_d, "kvfleet:kv_transfer_fallbacks_total", reason="prefix_missing") == 0
    assert delta(after_d, before_d, "vllm:prefix_cache_hits_total") == usable
    assert delta(after_d, before_d, "kvfleet:kv_transfer_seconds_count", direction="import") == 1
    assert delta(after_r, before_r, "kvfleet_router_pd_requests_total", outcome="disaggregated") == 1
    assert delta(after_r, before_r, "kvfleet_router_pd_prefill_seconds_count") == 1
    assert delta(after_r, before_r, "kvfleet_router_requests_total", endpoint=pre) == 1
    assert delta(after_r, before_r, "kvfleet_router_requests_total", endpoint=dec) == 1

    # streamed, another prompt (nothing cached on the decode engine yet)
    story2 = STORY.replace("lighthouse keeper", "baker").replace("great lens", "old oven")
    before_d = samples(dec)
    text2, usage2 = chat(router, story2, stream=True)
    ref2, _ = chat(dec, story2, stream=True, cache_salt="reference")
    assert text2 == ref2 and text2 != text
    assert usage2.prompt_tokens_details.cached_tokens == usable_tokens(fleet, story2)
    # blocks the decode engine held already (the chat template's shared start) are not sent again
    ids1, ids2 = (fleet["dec_llm"].apply_chat_template([{"role": "user", "content": c}]) for c in (STORY, story2))
    shared = next(k for k in range(len(ids2) // BS + 1) if ids1[k * BS:(k + 1) * BS] != ids2[k * BS:(k + 1) * BS])
    assert shared >= 1
    assert delta(samples(dec), before_d, "kvfleet:kv_imported_blocks_total") == \
        usable_tokens(fleet, story2) // BS - shared
    for llm in (fleet["dec_llm"], fleet["pre_llm"]):  # no block leaked on either side (pins released)
        deadline = time.monotonic() + 10
        while llm.get_stats()["num_free_blocks"] != llm.num_blocks:
            assert time.monotonic() < deadline, llm.get_stats()
            time.sleep(0.05)


def test_text_completions_through_the_split(fleet):
    router, dec = fleet["router"], fleet["decode"]
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 2
    before = value(dec, "kvfleet:kv_imported_blocks_total")
    out = client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ref = client(dec).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"cache_salt": "reference"})
    assert out.choices[0].text == ref.choices[0].text
    assert value(dec, "kvfleet:kv_imported_blocks_total") > before
    # the router keeps the client's request id header etc.; bad requests come back as the prefill's 400
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(router).completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)


def test_prefill_engine_answers_kv_transfer_params_and_exports(fleet):
    from kvfleet.engine import kv_transfer as kvt

    pre = fleet["prefill"]
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(pre + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                              "remote_engine": "kvfleet", "remote_block_size": BS}
    ids = httpx.post(pre + "/tokenize", json={"prompt": STORY}, timeout=30).json()["tokens"]
    layout = kvt.kv_layout(fleet["dec_llm"].engine)
    r = httpx.post(pre + kvt.EXPORT_PATH, json={"token_ids": ids, "start_block": 1, "layout": layout.to_json()})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    blocks = kvt.decode_kv(r.content, layout)
    assert (blocks.start_block, blocks.num_blocks) == (1, (len(ids) - 1) // BS - 1)
    assert blocks.block_hashes == kvt.chain_hashes(ids, BS, (len(ids) - 1) // BS)[1:]
    # refused with HTTP 400 and a clear message
    bad_layout = {**layout.to_json(), "block_size": 32}
    for payload, needle in (({"token_ids": ids, "layout": bad_layout}, "block size differs: 16 on the prefill"),
                            ({"token_ids": [10**7]}, "token ids out of range"),
                            ({"token_ids": []}, "token_ids"),
                            ({"token_ids": ids, "start_block": -1}, "start_block"),
                            ({"token_ids": "abc"}, "token_ids")):
        r = httpx.post(pre + kvt.EXPORT_PATH, json=payload)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (payload, r.text)


def test_decode_engine_without_its_prefill_engine_computes_the_prompt(fleet):
    dec = fleet["decode"]
    content = STORY.replace("lighthouse keeper", "gardener")
    before = value(dec, "kvfleet:kv_transfer_fallbacks_total", reason="fetch_failed")
    dead = f"http://127.0.0.1:{free_port()}"
    text, resp = chat(dec, content, kv_transfer_params={"do_remote_prefill": True, "remote_url": dead})
    ref, _ = chat(dec, content, cache_salt="reference")
    # only what the decode engine had cached itself (the chat template's start), nothing imported
    assert text == ref and resp.usage.prompt_tokens_details.cached_tokens <= BS
    assert value(dec, "kvfleet:kv_transfer_fallbacks_total", reason="fetch_failed") == before + 1
    # an engine that is not a kvfleet engine (here: the router, 404) is refused just as clearly
    text, _ = chat(dec, content + " Now.", kv_transfer_params={"do_remote_prefill": True,
                                                              "remote_url": fleet["router"]})
    assert text
    assert value(dec, "kvfleet:kv_transfer_fallbacks_total", reason="incompatible") >= 1
    for params in ({"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_url": "ftp://x"}):
        with pytest.raises(openai.BadRequestError, match="remote_url"):
            chat(dec, content, kv_transfer_params=params)
    r = httpx.post(dec + "/v1/completions", json={"model": MODEL, "prompt": "x", "kv_transfer_params": [1]})
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_no_healthy_prefill_endpoint_falls_back_to_decode_or_errors(fleet):
    dec = fleet["decode"]
    dead = f"http://127.0.0.1:{free_port()}"
    content = STORY.replace("lighthouse keeper", "sailor")
    with Served(pd_router_app([dead], [dec])) as router:
        text, _ = chat(router.url, content)
        ref, _ = chat(dec, content, cache_salt="reference")
        assert text == ref
        assert value(router.url, "kvfleet_router_pd_fallbacks_total", reason="no_prefill_endpoint") == 1
        assert value(router.url, "kvfleet_router_pd_requests_total", outcome="fallback") == 1
        health = httpx.get(router.url + "/health").json()
        assert (health["healthy_endpoints"], health["healthy_prefill_endpoints"]) == (1, 0)
        assert value(router.url, "kvfleet_router_endpoints") == 2  # both pools counted
    with Served(pd_router_app([dead], [dec], fallback="error")) as router:
        r = httpx.post(router.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_endpoint"


# ---------------------------------------------------------------------------- no engines


def test_prefill_and_decode_bodies():
    from kvfleet.router.pd import decode_params, prefill_body

    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}, "n": 3,
            "max_completion_tokens": 50, "min_tokens": 5, "logprobs": True, "top_logprobs": 2,
            "use_beam_search": True, "best_of": 4, "temperature": 0.5}
    assert prefill_body(body) == {"model": "m", "messages": [], "stream": False, "n": 1, "max_tokens": 1,
                                  "use_beam_search": False, "temperature": 0.5,
                                  "kv_transfer_params": {"do_remote_decode": True}}
    assert body["n"] == 3  # not changed in place
    assert decode_params(b'{"id": "x"}', "http://p:1") == {"do_remote_prefill": True, "do_remote_decode": False,
                                                           "remote_url": "http://p:1"}
    # vLLM's NIXL answer is passed on (its block ids, engine id, host and port)
    vllm = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e",
                                   "remote_host": "10.0.0.1", "remote_port": 5600}}
    assert decode_params(json.dumps(vllm).encode(), "http://p:1") == {
        **vllm["kv_transfer_params"], "do_remote_decode": False, "remote_url": "http://p:1"}


def test_router_pd_flags(tmp_path):
    from kvfleet.cli import build_parser
    from kvfleet.router.cli import build_discovery, build_prefill_discovery, build_router

    def parse(*a):
        return build_parser().parse_args(["router", *a])

    args = parse("--prefill-endpoints", "http://p:1,p2:2", "--decode-endpoints", "http://d:1")
    assert build_prefill_discovery(args, {}).urls == ["http://p:1", "http://p2:2"]
    assert build_discovery(args, {}).urls == ["http://d:1"]
    app, _, _ = build_router(args)
    assert app.title == "kvfleet router"
    args = parse("--endpoints", "http://d:1", "--prefill-endpoints", "http://p:1")  # plain flags = decode pool
    assert build_discovery(args, {}).urls == ["http://d:1"]
    cfg = {"endpoints": ["http://d:9"], "prefill_endpoints": ["http://p:9"]}
    assert build_prefill_discovery(parse(), cfg).urls == ["http://p:9"]
    assert build_discovery(parse(), cfg).urls == ["http://d:9"]
    assert build_prefill_discovery(parse("--endpoints", "http://d:1"), {}) is None
    for bad, msg in ((["--decode-endpoints", "http://d:1"], "need a prefill pool"),
                     (["--decode-endpoints", "http://d:1", "--endpoints", "http://e:1", "--prefill-endpoints",
                       "http://p:1"], "give the decode pool once"),
                     (["--prefill-endpoints", "http://p:1", "--k8s-prefill-selector", "a=b", "--endpoints", "d:1"],
                      "give one endpoint source"),
                     (["--prefill-endpoints", "http://p:1"], "no endpoints")):
        with pytest.raises(ValueError, match=msg):
            build_router(parse(*bad))
    with pytest.raises(SystemExit):
        parse("--endpoints", "d:1", "--prefill-endpoints", "p:1", "--pd-fallback", "maybe")


# ---------------------------------------------------------------------------- kvfleet up


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kvfleet_up_pd_example_serves_chat_through_the_split(tmp_path):
    port = free_port()
    state = tmp_path / "fleet"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    up = subprocess.run([sys.executable, "-m", "kvfleet", "up", "-f", str(REPO / "examples" / "pd-smollm2.yaml"),
                         "--port", str(port), "--state-dir", str(state), "--detach", "--wait-timeout", "600"],
                        capture_output=True, text=True, env=env, timeout=700)
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        url = f"http://127.0.0.1:{port}"
        text, resp = chat(url, STORY)
        assert text and resp.usage.prompt_tokens_details.cached_tokens >= 3 * BS
        st = json.loads((state / "state.json").read_text())
        reps = {r["name"]: r for p in st["pools"] for r in p["replicas"]}
        assert value(reps["decode-0"]["url"], "kvfleet:kv_imported_blocks_total") >= 3
        assert value(reps["prefill-0"]["url"], "kvfleet:kv_exported_blocks_total") >= 3
        status = subprocess.run([sys.executable, "-m", "kvfleet", "status", "--state-dir", str(state)],
                                capture_output=True, text=True, env=env, timeout=60).stdout
        assert "prefill/decode split" in status and "pool prefill" in status and "pool decode" in status
        lines = {ln.split(":")[0].strip(): ln for ln in status.splitlines() if ln.strip().startswith("pool ")}
        assert "blocks exported" in lines["pool prefill"] and "0 imported" not in lines["pool decode"]
    finally:
        subprocess.run([sys.executable, "-m", "kvfleet", "down", "--state-dir", str(state)], env=env, timeout=120)


def test_status_shows_the_split_and_the_kv_moved():
    from kvfleet.control.local.probe import parse_engine_sample
    from kvfleet.control.local.status import format_status
    from kvfleet.engine.kv_transfer import ImportResult
    from kvfleet.server.metrics import ServerMetrics

    m = ServerMetrics(MODEL)
    m.record_kv_export(5, 1000, 0.01)
    m.record_kv_import(ImportResult(num_imported_blocks=4, num_bytes=800, fallback="prefix_missing"))
    s = parse_engine_sample(m.render().decode())
    assert (s.kv_exported_blocks, s.kv_imported_blocks, s.kv_transfer_fallbacks) == (5, 4, 1)

    def rep(name, **kv):
        return {"name": name, "state": "ready", "pid": 1, "port": 2, "health": "ok", **kv}

    st = {"name": "f", "mode": "PrefillDecodeDisaggregated", "model": MODEL, "url": "http://x",
          "prefill_endpoints_file": "/p.yaml", "router": {}, "supervisor": {},
          "pools": [{"role": "prefill", "min_replicas": 1, "max_replicas": 1, "desired": 1, "metric": "m",
                     "target": 1.0, "replicas": [rep("prefill-0", kv_exported_blocks=5.0)]},
                    {"role": "decode", "min_replicas": 1, "max_replicas": 1, "desired": 1, "metric": "m",
                     "target": 1.0, "replicas": [rep("decode-0", kv_imported_blocks=4.0, kv_transfer_fallbacks=1.0)]}]}
    text = format_status(st)
    assert "prefill/decode split" in text
    assert "KV transfer: 5 blocks exported, 0 imported, 0 fallbacks" in text
    assert "KV transfer: 0 blocks exported, 4 imported, 1 fallbacks" in text
