"""The router in front of 3 real engine replicas (SmolLM2, `kvfleet serve` subprocesses), the
router itself as a `kvfleet router` subprocess and, for other policies, in-process: streamed
output identical to a replica's, session stickiness, prefix affinity, a replica killed with
SIGKILL mid-run without failures for requests not yet started, and its return to the pool."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from tests.router.conftest import InProcessRouter, router_counts

from kvfleet.bench.compare import free_port, stop_engine
from kvfleet.bench.loadgen import ServerNotReadyError, wait_until_ready

MODEL = "smollm2-135m-instruct"
pytestmark = pytest.mark.timeout(900)


def start_replica(port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvfleet", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
         "--kv-cache-memory", "48MiB", "--max-model-len", "1024", "--num-threads", "1", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, log_path, timeout: float = 600) -> None:
    try:
        asyncio.run(wait_until_ready(url, timeout_s=timeout, proc=proc))
    except ServerNotReadyError as e:
        pytest.fail(f"{url} did not start: {e}\n{open(log_path).read()[-2000:]}")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    ports = [free_port() for _ in range(3)]
    logs = [open(d / f"r{i}.log", "wb") for i in range(3)]
    procs = [start_replica(p, f) for p, f in zip(ports, logs, strict=True)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    state = {"procs": procs, "urls": urls, "ports": ports, "logs": logs, "dir": d}
    try:
        for i, u in enumerate(urls):
            wait_ready(u, procs[i], d / f"r{i}.log")
        yield state
    finally:
        for p in state["procs"]:
            stop_engine(p)
        for f in logs:
            f.close()


@pytest.fixture(scope="module")
def router_url(replicas, tmp_path_factory):
    """`kvfleet router` as a subprocess, round-robin, fast health checks."""
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "router", "--endpoints", ",".join(replicas["urls"]), "--port", str(port),
             "--policy", "round-robin", "--health-interval", "0.3", "--max-retries", "2", "--log-level", "info"],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log, timeout=120)
    yield url
    stop_engine(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def stream_text(url: str, prompt: str, max_tokens: int = 12) -> tuple[str, int]:
    chunks = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    n = 0
    for c in chunks:
        if c.choices:
            text += c.choices[0].text
            n += 1
        if c.usage:
            usage = c.usage
    assert usage is not None and n >= 2
    return text, usage.completion_tokens


def test_streamed_output_equals_a_replica_and_models(replicas, router_url) -> None:
    prompt = "The three primary colors are"
    direct = stream_text(replicas["urls"][0], prompt)
    assert stream_text(router_url, prompt) == direct
    chat = client(router_url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    ref = client(replicas["urls"][1]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == ref.choices[0].message.content
    assert [m.id for m in client(router_url).models.list()] == [MODEL]
    # engine errors pass through unchanged (400 from the replica)
    with pytest.raises(openai.BadRequestError):
        client(router_url).completions.create(model=MODEL, prompt="x", max_tokens=-1)
    r = httpx.post(router_url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_session_stickiness_and_prefix_affinity(replicas) -> None:
    urls = replicas["urls"]
    with InProcessRouter(urls, "session") as r:
        c = client(r.url)
        for user in ("alice", "bob", "carol", "dave"):
            before = router_counts(r.url)
            for _ in range(3):
                c.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_headers={"x-session-id": user})
            after = router_counts(r.url)
            grew = {u: after.get(u, 0) - before.get(u, 0) for u in after}
            assert sorted(grew.values())[-1] == 3 and sum(grew.values()) == 3  # all three on one replica
    system = ("You are the support assistant of a small bakery. Answer in one short sentence, politely, "
              "and never invent opening hours or prices. ") * 4
    with InProcessRouter(urls, "prefix") as r:
        c = client(r.url)
        cached = []
        for q in ("Do you sell bread?", "Is there cake?", "Can I order online?"):
            out = c.completions.create(model=MODEL, prompt=system + q, max_tokens=1)
            cached.append(out.usage.prompt_tokens_details.cached_tokens if out.usage.prompt_tokens_details else 0)
        counts = router_counts(r.url)
        assert sorted(counts.values()) == [3]  # every request to the same replica
        assert cached[1] > 48 and cached[2] > 48  # and it reused the system prompt's KV blocks


def test_killed_replica_is_ejected_without_client_failures_and_comes_back(replicas, router_url) -> None:
    victim = 2
    vurl = replicas["urls"][victim]
    c = client(router_url)

    def one(i: int) -> str:
        return c.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = [pool.submit(one, i) for i in range(6)]
        assert all(isinstance(f.result(), str) for f in first)
        os.killpg(replicas["procs"][victim].pid, signal.SIGKILL)  # SIGKILL the replica and its process group
        replicas["procs"][victim].wait(10)
        later = [pool.submit(one, i) for i in range(12)]  # none started before the kill: none may fail
        assert all(isinstance(f.result(), str) for f in later)
    # ejected: the router says so in its metrics
    text = httpx.get(router_url + "/metrics").text
    assert "kvfleet_router_healthy_endpoints 2.0" in text
    assert httpx.get(router_url + "/health").status_code == 200
    # the replica comes back on the same port and rejoins the pool
    log = open(replicas["dir"] / "r2-restart.log", "wb")
    replicas["logs"].append(log)
    replicas["procs"][victim] = start_replica(replicas["ports"][victim], log)
    wait_ready(vurl, replicas["procs"][victim], replicas["dir"] / "r2-restart.log")
    deadline = time.monotonic() + 120
    while "kvfleet_router_healthy_endpoints 3.0" not in httpx.get(router_url + "/metrics").text:
        assert time.monotonic() < deadline, "the restarted replica did not rejoin"
        time.sleep(0.5)
    before = router_counts(router_url).get(vurl, 0)
    for i in range(3):  # round-robin: one of three lands on it
        one(i)
    assert router_counts(router_url).get(vurl, 0) >= before + 1
