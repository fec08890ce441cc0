"""Router units: every scorer, the weighted picker, the hash ring, the prefix index and
hasher, metric parsing, discovery parsing (no network)."""

from __future__ import annotations

import random

import pytest

from kvfleet.router.discovery import (
    FileDiscovery,
    StaticDiscovery,
    normalize_url,
    parse_endpoints_file,
    urls_from_endpoint_slices,
    urls_from_pods,
)
from kvfleet.router.endpoint import Endpoint, EngineLoad, parse_engine_load
from kvfleet.router.picker import EndpointPicker, parse_weighted
from kvfleet.router.prefix_index import PrefixIndex, PromptHasher, chat_text
from kvfleet.router.scorers import (
    PROFILES,
    InFlightScorer,
    KVUsageScorer,
    PrefixCacheScorer,
    QueueScorer,
    RoundRobinScorer,
    RoutingContext,
    SessionAffinityScorer,
    build_scorer,
)


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(f"http://10.0.0.{i}:8000") for i in range(n)]


def ctx(prompt: str = "", session: str | None = None) -> RoutingContext:
    return RoutingContext("/v1/completions", {"prompt": prompt}, {"x-session-id": session} if session else {})


def test_queue_kv_and_inflight_scorers() -> None:
    e = eps(3)
    e[0].load, e[1].load, e[2].load = EngineLoad(waiting=0), EngineLoad(waiting=4), EngineLoad(waiting=2)
    assert QueueScorer().score(ctx(), e) == [1.0, 0.0, 0.5]
    e[0].load.kv_usage, e[1].load.kv_usage = 0.25, 1.5  # clamped to [0, 1]; unknown = 0
    assert KVUsageScorer().score(ctx(), e) == [0.75, 0.0, 1.0]
    e[0].in_flight, e[1].in_flight, e[2].in_flight = 3, 3, 3
    assert InFlightScorer().score(ctx(), e) == [1.0, 1.0, 1.0]  # all equal -> all best
    e[2].in_flight = 1
    assert InFlightScorer().score(ctx(), e) == [0.0, 0.0, 1.0]


def test_round_robin_cycles_in_url_order() -> None:
    e = eps(3)
    rr = RoundRobinScorer()
    picks = [rr.score(ctx(), list(reversed(e))).index(1.0) for _ in range(6)]
    assert [list(reversed(e))[i].url for i in picks] == [x.url for x in e] * 2


def test_session_ring_is_sticky_and_moves_about_one_nth() -> None:
    s = SessionAffinityScorer("X-Session-ID")
    e = eps(4)
    assert s.score(ctx(), e) == [0.0] * 4  # no header: neutral
    sessions = [f"user-{i}" for i in range(2000)]
    owners = {k: s.owner(k, [x.url for x in e]) for k in sessions}
    assert all(s.score(ctx(session=k), e)[[x.url for x in e].index(owners[k])] == 1.0 for k in sessions[:20])
    counts = {u: list(owners.values()).count(u) for u in set(owners.values())}
    assert len(counts) == 4 and min(counts.values()) > 2000 / 4 * 0.6
    # one endpoint leaves: only its sessions move
    left = e[1].url
    after = {k: s.owner(k, [x.url for x in e if x.url != left]) for k in sessions}
    moved = [k for k in sessions if after[k] != owners[k]]
    assert all(owners[k] == left for k in moved)
    assert len(moved) == counts[left]
    # one joins: about 1/5 of sessions move, all to the new one
    new = "http://10.0.0.9:8000"
    joined = {k: s.owner(k, [x.url for x in e] + [new]) for k in sessions}
    moved = [k for k in sessions if joined[k] != owners[k]]
    assert all(joined[k] == new for k in moved) and 0.1 < len(moved) / 2000 < 0.3


def test_prefix_hasher_chains_and_cuts_full_blocks() -> None:
    h = PromptHasher(block_size=4)
    a = h.block_hashes({"prompt": "abcdefghij"})
    b = h.block_hashes({"prompt": "abcdefghXY"})
    c = h.block_hashes({"prompt": "zzzzefgh"})
    assert len(a) == 2 and a[0] == b[0] and a[1] == b[1]  # the last partial block is not hashed
    assert c[1] != a[1]  # same block content, different parent
    assert h.block_hashes({"prompt": "abc"}) == []
    assert h.block_hashes({"prompt": [1, 2, 3, 4, 5]}) != []  # token ids
    assert h.block_hashes({"prompt": ["abcdefgh", "other"]}) == a[:2]  # first of several prompts
    assert h.block_hashes({"nothing": 1}) == [] and h.block_hashes({"prompt": 5}) == []
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert chat_text(msgs) == "system: You are terse.\nuser: hi"
    assert h.block_hashes({"messages": msgs}) == h.block_hashes({"prompt": chat_text(msgs)})
    with pytest.raises(ValueError):
        PromptHasher(0)


def test_prefix_hasher_with_a_tokenizer(hf_tokenizer) -> None:
    h = PromptHasher(block_size=4, tokenizer=hf_tokenizer)
    assert h.unit == "tokens"
    text = "The quick brown fox jumps over the lazy dog again and again"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert len(h.block_hashes({"prompt": text})) == len(ids) // 4
    chat = h.units({"messages": [{"role": "user", "content": "hello"}]})
    assert isinstance(chat, list) and len(chat) > 3  # the chat template's tokens


def test_prefix_index_is_bounded_lru() -> None:
    idx = PrefixIndex(capacity=3)
    hs = [bytes([i]) * 8 for i in range(5)]
    idx.add("a", hs[:3])
    assert idx.match("a", hs) == 3 and idx.match("b", hs) == 0
    idx.add("a", hs[3:4])  # evicts the least recently routed (hs[0])
    assert idx.size("a") == 3 and idx.match("a", hs) == 0 and idx.match("a", hs[1:]) == 3
    idx.remove("a")
    assert idx.size("a") == 0
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_prefix_scorer_learns_where_prompts_went() -> None:
    s = PrefixCacheScorer(PromptHasher(4), PrefixIndex(100))
    e = eps(2)
    system = "S" * 40
    c1 = ctx(system + " question one")
    assert s.score(c1, e) == [0.0, 0.0]
    s.on_pick(c1, e[1])
    c2 = ctx(system + " question two")
    sc = s.score(c2, e)
    assert sc[0] == 0.0 and 0.7 < sc[1] < 1.0  # the system prompt's 10 blocks of 13
    s.on_remove(e[1].url)
    assert s.score(ctx(system + " question two"), e) == [0.0, 0.0]


def test_picker_weights_ties_and_default_profile() -> None:
    e = eps(3)
    e[0].load = EngineLoad(waiting=5, kv_usage=0.9)
    prefix = PrefixCacheScorer(PromptHasher(4), PrefixIndex(100))
    picker = EndpointPicker([(prefix, 3.0), (QueueScorer(), 2.0), (KVUsageScorer(), 2.0)], rng=random.Random(0))
    prompt = "P" * 64 + " tail"
    prefix.on_pick(ctx(prompt), e[0])
    d = picker.pick(ctx(prompt), e)
    # e0 (prefix hit, loaded): 1 * 3 + queue 0 * 2 + (1 - 0.9) * 2 = 3.2 < e1 / e2 (no hit, idle): 0 + 2 + 2 = 4
    assert d.endpoint.url in (e[1].url, e[2].url) and d.totals[e[0].url] == pytest.approx(3.2)
    assert d.totals[e[1].url] == pytest.approx(4.0)
    prefix.index.remove(d.endpoint.url)  # forget that pick: only e0 has seen the prompt
    e[0].load = EngineLoad(waiting=0, kv_usage=0.1)  # e0 idle now: 3 + 2 + 1.8 = 6.8 > 4
    d = picker.pick(ctx(prompt), e)
    assert d.endpoint is e[0] and d.scores["prefix"][e[0].url] == 1.0
    # ties are broken at random over the tied endpoints
    rr_free = EndpointPicker([(QueueScorer(), 1.0)], rng=random.Random(1))
    seen = {rr_free.pick(ctx(), eps(3)).endpoint.url for _ in range(60)}
    assert len(seen) == 3
    with pytest.raises(ValueError):
        picker.pick(ctx(), [])
    with pytest.raises(ValueError):
        EndpointPicker([])
    assert PROFILES["default"] == {"prefix": 3.0, "queue": 2.0, "kv-usage": 2.0}


def test_parse_weighted_and_build_scorer() -> None:
    assert parse_weighted("prefix:3") == ("prefix", 3.0) and parse_weighted("queue") == ("queue", 1.0)
    for bad in (":3", "prefix:x", "prefix:-1", "prefix:inf", "prefix:nan"):
        with pytest.raises(ValueError):
            parse_weighted(bad)
    assert build_scorer("session", session_header="X-User").header == "x-user"
    with pytest.raises(ValueError, match="unknown scorer"):
        build_scorer("nope")


VLLM_METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""
SGLANG_METRICS = """# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 4.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.25
"""


def test_parse_engine_load_vllm_and_sglang_names() -> None:
    v = parse_engine_load(VLLM_METRICS, now=1.0)
    assert (v.waiting, v.running, v.kv_usage, v.scraped_at) == (5.0, 7.0, 0.5, 1.0)
    s = parse_engine_load(SGLANG_METRICS)
    assert (s.waiting, s.running, s.kv_usage) == (4.0, 1.0, 0.25)
    assert parse_engine_load("# nothing\n").waiting is None


def test_discovery_parsing(tmp_path) -> None:
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for bad in ("ftp://x", "http://", "http://h:99999"):
        with pytest.raises(ValueError):
            normalize_url(bad)
    assert parse_endpoints_file("- http://a:1\n- b:2\n") == ["http://a:1", "http://b:2"]
    assert parse_endpoints_file('{"endpoints": [{"url": "http://a:1"}]}') == ["http://a:1"]
    assert parse_endpoints_file("http://a:1  # first\nhttp://b:2\n\n") == ["http://a:1", "http://b:2"]
    assert parse_endpoints_file("") == []
    for bad in ("{endpoints: 3}", "- [1, 2]", "- {url: 5}", ": : :"):
        with pytest.raises(ValueError):
            parse_endpoints_file(bad)
    assert StaticDiscovery(["a:1", "http://a:1/"]).urls == ["http://a:1"]


def test_file_discovery_follows_changes_and_keeps_last_good(tmp_path) -> None:
    import asyncio
    import os

    f = tmp_path / "eps.yaml"
    f.write_text("- http://a:1\n")
    d = FileDiscovery(f)
    assert asyncio.run(d.list_endpoints()) == ["http://a:1"]
    f.write_text("- http://a:1\n- http://b:2\n")
    os.utime(f, (1, 12345))
    assert asyncio.run(d.list_endpoints()) == ["http://a:1", "http://b:2"]
    f.write_text("- [broken\n")
    os.utime(f, (1, 23456))
    assert asyncio.run(d.list_endpoints()) == ["http://a:1", "http://b:2"] and "endpoints file" in d.last_error
    with pytest.raises(ValueError):
        FileDiscovery(tmp_path / "missing.yaml")


def test_kubernetes_object_conversion() -> None:
    from kubernetes import client as k

    def pod(ip, phase="Running", ready="True", deleting=False):
        gone = "2026-01-01T00:00:00Z" if deleting else None
        return k.V1Pod(metadata=k.V1ObjectMeta(name="p", deletion_timestamp=gone),
                       status=k.V1PodStatus(phase=phase, pod_ip=ip,
                                            conditions=[k.V1PodCondition(type="Ready", status=ready)]))

    pods = [pod("10.1.0.1"), pod("10.1.0.2", ready="False"), pod("10.1.0.3", phase="Pending"),
            pod("10.1.0.4", deleting=True), pod(None), pod("fd00::5")]
    assert urls_from_pods(pods, 8000) == ["http://10.1.0.1:8000", "http://[fd00::5]:8000"]
    endpoints = [k.V1Endpoint(addresses=[f"10.2.0.{i}"], conditions=k.V1EndpointConditions(ready=r))
                 for i, r in ((1, True), (2, False))] + [k.V1Endpoint(addresses=["10.2.0.3"])]
    sl = k.V1EndpointSlice(address_type="IPv4", ports=[k.DiscoveryV1EndpointPort(name="http", port=9000)],
                           endpoints=endpoints)
    assert urls_from_endpoint_slices([sl], 8000) == ["http://10.2.0.1:9000", "http://10.2.0.3:9000"]


def test_load_bound_filter_keeps_endpoints_within_factor_of_mean() -> None:
    from kvfleet.router.filters import LoadBoundFilter

    f = LoadBoundFilter(2.0)
    e = eps(4)
    assert f.filter(ctx(), e) == e  # idle: bound max(1, ceil(2 * 1 / 4)) = 1, everyone has room
    e[0].in_flight = 1
    assert f.filter(ctx(), e) == e[1:]  # bound ceil(2 * 2 / 4) = 1: the busy one is out
    e[1].in_flight, e[2].in_flight = 1, 1
    assert f.filter(ctx(), e) == e  # bound ceil(2 * 4 / 4) = 2: all have room again
    e[0].in_flight = 5
    assert f.filter(ctx(), e) == e[1:]
    assert f.filter(ctx(), []) == []
    for bad in (1.0, 0.5, float("inf")):
        with pytest.raises(ValueError):
            LoadBoundFilter(bad)
    # with a prefix scorer: the tenant's favourite is skipped while it is over the bound
    s = PrefixCacheScorer(PromptHasher(4), PrefixIndex(100))
    picker = EndpointPicker([(s, 1.0)], rng=random.Random(0), filters=[f])
    p = ctx("T" * 40)
    e = eps(3)
    s.on_pick(p, e[0])
    assert picker.pick(p, e).endpoint is e[0]
    e[0].in_flight = 2
    assert picker.pick(p, e).endpoint is not e[0]
