"""``kvfleet up`` with the example specs and real engines (``kvfleet serve`` on SmolLM2-135M-Instruct;
slow: each replica loads the model in 10-30 s on a 2-core machine).

- ``examples/standard-smollm2.yaml``: a real chat request through the router; a burst scales the
  pool to 2 replicas; one is killed with SIGKILL under load, with no failed request that had not
  started, and restarted; after the burst the pool drains back to 1.
- ``examples/serverless-smollm2.yaml``: no engine runs; the first request is held by the router
  while a replica starts and is then answered; idle, the pool goes back to zero.

The examples are run with a smaller KV cache and one torch thread per replica (the machine has
two cores), a target of 2 waiting requests per replica and a short scale-down window / idle
timeout, so the test sees the policy act within minutes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.control.test_local_fleet import Load, client, running_fleet

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def example(name: str, **autoscaling: Any) -> list[dict[str, Any]]:
    """The example's documents, with a small KV cache, one thread per replica and ``autoscaling``."""
    docs = list(yaml.safe_load_all((REPO / "examples" / name).read_text()))
    svc = next(d for d in docs if d["kind"] == "InferenceService")
    args = svc["spec"]["engine"].setdefault("engineArgs", {})
    args.update(kvCacheMemory="64Mi", maxModelLen=1024, extraArgs=["--num-threads", "1"])
    svc["spec"].setdefault("autoscaling", {}).update(autoscaling)
    return docs


def ready_count(fleet, st) -> int:
    return sum(r["state"] == "ready" for r in fleet.replicas(st).values())


def test_standard_example_chat_burst_kill9_restart_and_scale_down(tmp_path):
    docs = example("standard-smollm2.yaml", target=2)
    svc = docs[-1]
    svc["spec"]["engine"].update(minReplicas=1, maxReplicas=2)
    svc["spec"]["engine"]["engineArgs"]["maxNumSeqs"] = 2  # so that a burst queues
    with running_fleet(tmp_path, docs, "--scale-down-window", "10", timeout=300) as fleet:
        out = client(fleet.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20,
            temperature=0)
        assert "Paris" in out.choices[0].message.content

        load = Load(fleet.url, workers=8, max_tokens=16, model=MODEL)
        try:
            fleet.wait("a second replica under the burst", lambda s: ready_count(fleet, s) == 2, timeout=300)
            load.wait_ok(load.ok + 4, timeout=180)
            victim = fleet.replicas()["engine-0"]
            os.kill(victim["pid"], signal.SIGKILL)
            fleet.wait("engine-0 restarted", lambda s: (r := fleet.replicas(s)["engine-0"])["restarts"] == 1
                       and r["state"] == "ready" and r["pid"] != victim["pid"], timeout=300)
            load.wait_ok(load.ok + 4, timeout=180)
        finally:
            load.stop()
        assert load.ok > 8 and load.failed_before_start == [], load.failed_before_start
        t0 = time.monotonic()
        fleet.wait("back to one replica", lambda s: [r["state"] for r in fleet.replicas(s).values()] == ["ready"],
                   timeout=180)
        events = fleet.events()
        assert any("scale engine pool 1 -> 2 replicas" in e for e in events)
        assert any(f"engine-0 (pid {victim['pid']}) exited with signal SIGKILL; restart in 1 s" in e for e in events)
        assert any("draining" in e for e in events) and any("drained after" in e for e in events)
        assert time.monotonic() - t0 < 180


def test_serverless_example_scales_from_zero_on_the_first_request(tmp_path):
    docs = example("serverless-smollm2.yaml", idleTimeoutSeconds=5)
    with running_fleet(tmp_path, docs, timeout=120) as fleet:
        assert fleet.replicas() == {}
        t0 = time.monotonic()
        out = client(fleet.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20,
            temperature=0)  # held by the router while the replica loads the model
        held = time.monotonic() - t0
        assert "Paris" in out.choices[0].message.content
        events = fleet.events()
        assert any("activation: demand 1 with no replica" in e for e in events)
        started = next(e for e in events if "engine-0 ready" in e)
        print(f"first request answered after {held:.1f} s ({started})")
        fleet.wait("scale to zero", lambda s: fleet.replicas(s) == {}, timeout=120)
