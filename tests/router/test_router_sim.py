"""The router over simulated engines (`kvfleet.sim`, real HTTP, in-process): streaming passed
through as it is produced, retries and ejection, 503 / 429, prefix affinity with real prefix-cache
hits, file discovery, router metrics, the CLI."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import openai
import pytest
from tests.router.conftest import InProcessRouter, prom_samples, router_counts

from kvfleet.bench.compare import free_port
from kvfleet.cli import main
from kvfleet.router.discovery import FileDiscovery
from kvfleet.sim.engine import SimEngineConfig
from kvfleet.sim.fleet import SimFleetThread
from kvfleet.sim.latency import LatencyModel

#: a slow simulated engine (50 ms a step), so that a 40-token stream takes about 2 s
SLOW = SimEngineConfig(latency=LatencyModel(base_s=0.05, prefill_s_per_token=0.0, decode_s_per_seq=0.0))

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet():
    with SimFleetThread(3, SimEngineConfig(time_scale=0.05)) as f:
        yield f


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_stream_passes_through_chunk_by_chunk(fleet) -> None:
    with SimFleetThread(1, SLOW) as one, InProcessRouter(one.urls, "round-robin") as r:
        model = oai(one.urls[0]).models.list().data[0].id
        stream = oai(r.url).completions.create(model=model, prompt="hello there", max_tokens=40, stream=True)
        first = next(iter(stream))
        assert first.choices  # the first token arrived ...
        running = prom_samples(one.urls[0], "vllm:num_requests_running")
        assert sum(running.values()) == 1  # ... while the engine is still generating the rest
        rest = list(stream)
        assert sum(1 for c in rest if c.choices and c.choices[0].text) >= 30
        direct = oai(one.urls[0]).completions.create(model=model, prompt="hello there", max_tokens=40)
        assert first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices) == direct.choices[0].text


def test_dead_endpoint_is_retried_ejected_and_reported(fleet) -> None:
    victim = SimFleetThread(1, SimEngineConfig(time_scale=0.05))
    victim.start()
    dead = victim.urls[0]
    with InProcessRouter([dead, *fleet.urls], "round-robin", pool={"health_interval_s": 60}) as r:
        c = oai(r.url)
        model = c.models.list().data[0].id
        assert r.router.pool.endpoints[dead].healthy
        victim.stop()  # the endpoint dies after the router found it healthy
        for _ in range(6):  # the request sent to the dead endpoint is retried elsewhere
            assert c.completions.create(model=model, prompt="x y z", max_tokens=2).choices[0].text
        counts = router_counts(r.url)
        assert counts[dead] == 1 and sum(counts.values()) == 7
        assert prom_samples(r.url, "kvfleet_router_retries")[()] == 1
        assert prom_samples(r.url, "kvfleet_router_errors")[(dead,)] == 1
        assert prom_samples(r.url, "kvfleet_router_healthy_endpoints")[()] == 3
        assert r.router.pool.endpoints[dead].healthy is False


def test_503_with_retry_after_when_nothing_is_healthy() -> None:
    with InProcessRouter([dead_url(), dead_url()], "round-robin") as r:
        resp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert resp.status_code in (502, 503)
        assert resp.json()["error"]["code"] in ("no_healthy_endpoint", "upstream_failed")
        resp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"  # both ejected by now
        assert httpx.get(r.url + "/health").status_code == 503
        assert httpx.get(r.url + "/v1/models").status_code == 503


def test_429_when_every_endpoint_is_saturated(fleet) -> None:
    with SimFleetThread(1, SLOW) as one, InProcessRouter(
            one.urls, "round-robin",
            config={"max_inflight_per_endpoint": 1, "max_queued_requests": 1, "queue_timeout_s": 0.5}) as r:
        body = {"model": oai(one.urls[0]).models.list().data[0].id, "prompt": "long job", "max_tokens": 60}
        results: list[int] = []
        started = threading.Event()

        def long() -> None:
            started.set()
            results.append(httpx.post(r.url + "/v1/completions", json=body, timeout=60).status_code)

        t = threading.Thread(target=long)
        t.start()
        started.wait()
        while r.router.pool.endpoints[one.urls[0]].in_flight < 1:
            pass
        with concurrent.futures.ThreadPoolExecutor(2) as ex:  # one waits in the queue, one finds it full
            f = [ex.submit(httpx.post, r.url + "/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
                 for _ in range(2)]
            statuses = sorted(x.result().status_code for x in f)
        t.join()
        assert results == [200] and statuses == [429, 429]
        rejected = prom_samples(r.url, "kvfleet_router_rejected")
        assert rejected[("queue_full",)] == 1 and rejected[("queue_timeout",)] == 1


def test_prefix_policy_keeps_a_tenant_on_one_engine_and_hits_its_cache(fleet) -> None:
    system = "You are a careful assistant for the tenant Acme. " * 40
    with InProcessRouter(fleet.urls, "default") as r:
        c = oai(r.url)
        model = c.models.list().data[0].id
        cached = []
        for q in range(5):
            out = c.completions.create(model=model, prompt=system + f"Question number {q}?", max_tokens=2)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        counts = router_counts(r.url)
        assert max(counts.values()) == 5  # the whole tenant on one engine
        assert cached[0] == 0 and min(cached[1:]) >= 0.8 * out.usage.prompt_tokens
        decisions = prom_samples(r.url, "kvfleet_router_decisions")
        assert decisions[("default",)] == 5


def test_file_discovery_adds_and_removes_endpoints(fleet, tmp_path) -> None:
    f = tmp_path / "endpoints.yaml"
    f.write_text(f"- {fleet.urls[0]}\n")
    with InProcessRouter(FileDiscovery(f), "round-robin", pool={"discovery_interval_s": 0.1}) as r:
        assert set(r.router.pool.endpoints) == {fleet.urls[0]}
        f.write_text("endpoints:\n" + "".join(f"  - {u}\n" for u in fleet.urls))
        import time

        deadline = time.monotonic() + 10
        while len(r.router.pool.endpoints) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        f.write_text(f"- {fleet.urls[2]}\n")
        while set(r.router.pool.endpoints) != {fleet.urls[2]}:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_bad_requests_get_openai_errors(fleet) -> None:
    with InProcessRouter(fleet.urls, "round-robin") as r:
        for raw in (b"{oops", b"[1, 2]", "\udcff".encode("utf-8", "surrogatepass")):
            resp = httpx.post(r.url + "/v1/chat/completions", content=raw)
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -3})
        assert resp.status_code == 400 and "error" in resp.json()  # the engine's own 400, passed through
        model = oai(fleet.urls[0]).models.list().data[0].id
        # header bytes that are not ASCII are passed on as they came (no 500 in the router)
        resp = httpx.post(r.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                          headers={"Authorization": "Bearer ключ".encode(), "x-session-id": "ü".encode()})
        assert resp.status_code == 200
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
            resp = httpx.request(method, r.url + path)
            assert resp.status_code == status and resp.json()["error"]["type"] == "invalid_request_error"


def test_cli_errors_are_one_line(capsys, tmp_path) -> None:
    assert main(["router"]) == 2
    assert "no endpoints" in capsys.readouterr().err
    assert main(["router", "--endpoints", "ftp://x"]) == 2
    assert "http(s)" in capsys.readouterr().err
    assert main(["router", "--endpoints", "a:1", "--scorer", "bogus:1"]) == 2
    assert "unknown scorer" in capsys.readouterr().err
    bad = tmp_path / "c.yaml"
    bad.write_text("colour: blue\n")
    assert main(["router", "--endpoints", "a:1", "--config", str(bad)]) == 2
    assert "unknown keys" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--endpoints", "a:1", "--max-retries", "-1"])


def test_kubernetes_discovery_against_a_real_api_server() -> None:
    """Lists pods through a real API server when one is configured (KUBECONFIG or in-cluster)."""
    import asyncio

    from kubernetes.config import ConfigException

    from kvfleet.router.discovery import KubernetesDiscovery

    try:
        d = KubernetesDiscovery("app.kubernetes.io/name=kvfleet-router-test-none", namespace="default")
    except ConfigException as e:
        pytest.skip(f"no Kubernetes API server configured (KUBECONFIG or in-cluster): {e}")
    try:
        urls = asyncio.run(d.list_endpoints())
    except Exception as e:  # configured but unreachable
        pytest.skip(f"Kubernetes API server not reachable: {type(e).__name__}: {e}")
    assert urls == []  # nothing carries that label


def test_hold_when_empty_serves_the_first_request_once_an_endpoint_appears(fleet, tmp_path) -> None:
    """Scale from zero: with no endpoint at all the request waits in the router's queue, and is
    served when an endpoint appears (here: written into the watched endpoints file)."""
    import time

    f = tmp_path / "endpoints.yaml"
    f.write_text("[]\n")
    with InProcessRouter(FileDiscovery(f), "round-robin", config={"hold_when_empty_s": 20.0},
                         pool={"discovery_interval_s": 0.1}) as r:
        model = oai(fleet.urls[0]).models.list().data[0].id
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(httpx.post(
            r.url + "/v1/completions", json={"model": model, "prompt": "wake up", "max_tokens": 2}, timeout=60)))
        t.start()
        deadline = time.monotonic() + 10
        while prom_samples(r.url, "kvfleet_router_queued_requests").get((), 0) < 1:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.05)
        assert t.is_alive()
        f.write_text(f"- {fleet.urls[0]}\n")
        t.join(30)
        assert out and out[0].status_code == 200
    with InProcessRouter([dead_url()], "round-robin", config={"hold_when_empty_s": 0.3}) as r:
        resp = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 503  # held 0.3 s, then the usual answer


def test_client_disconnect_mid_stream_aborts_at_the_engine() -> None:
    import time

    with SimFleetThread(1, SLOW) as one, InProcessRouter(one.urls, "round-robin") as r:
        model = oai(one.urls[0]).models.list().data[0].id
        with httpx.stream("POST", r.url + "/v1/completions",
                          json={"model": model, "prompt": "hi", "max_tokens": 200, "stream": True}) as resp:
            chunks = resp.iter_raw()
            next(chunks)
            next(chunks)  # then the client goes away
        deadline = time.monotonic() + 10
        while prom_samples(one.urls[0], "vllm:request_success").get(("abort", model), 0) < 1:
            assert time.monotonic() < deadline, "the engine did not see the abort"
            time.sleep(0.05)
        assert r.router.pool.endpoints[one.urls[0]].in_flight == 0
        assert sum(prom_samples(one.urls[0], "vllm:num_requests_running").values()) == 0


def test_hold_when_empty_also_holds_a_retry_until_a_replica_is_back(tmp_path) -> None:
    """One replica dies under a request: the request is held (not a 502) until the supervisor's
    replacement appears, here a new engine written into the watched endpoints file."""
    import time

    victim = SimFleetThread(1, SimEngineConfig(time_scale=0.05))
    victim.start()
    f = tmp_path / "endpoints.yaml"
    f.write_text(f"- {victim.urls[0]}\n")
    with SimFleetThread(1, SimEngineConfig(time_scale=0.05)) as spare, InProcessRouter(
            FileDiscovery(f), "round-robin", config={"hold_when_empty_s": 20.0},
            pool={"discovery_interval_s": 0.1, "health_interval_s": 60}) as r:
        model = oai(spare.urls[0]).models.list().data[0].id
        victim.stop()
        out: list[httpx.Response] = []
        t = threading.Thread(target=lambda: out.append(httpx.post(
            r.url + "/v1/completions", json={"model": model, "prompt": "still there?", "max_tokens": 2}, timeout=60)))
        t.start()
        deadline = time.monotonic() + 10
        while prom_samples(r.url, "kvfleet_router_queued_requests").get((), 0) < 1:
            assert time.monotonic() < deadline, "the failed request was not held"
            time.sleep(0.05)
        f.write_text(f"- {spare.urls[0]}\n")
        t.join(30)
        assert out and out[0].status_code == 200
        assert prom_samples(r.url, "kvfleet_router_retries")[()] == 1
