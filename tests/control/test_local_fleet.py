"""``kvfleet up`` / ``status`` / ``down`` end to end with real processes: the supervisor (``kvfleet
up`` in the foreground), the router, and simulated engines (``kvfleet sim-engine`` run through a
ServingRuntime document, so the fleet starts in seconds): chat requests through the router, a
replica killed with SIGKILL under load without a failed request that had not started, restarts
with back-off, scale up under a burst and down (draining) after it, scale from zero on the first
request and back to zero when idle."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from kvfleet.cli import main
from kvfleet.control.fleet_cli import stop_fleet
from kvfleet.control.local.state import free_port, pid_alive, read_state

pytestmark = pytest.mark.timeout(300)


def sim_runtime(time_scale: float = 0.3) -> dict[str, Any]:
    """A ServingRuntime whose engine is ``kvfleet sim-engine``."""
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "ServingRuntime", "metadata": {"name": "sim"},
            "spec": {"engine": "kvfleet", "image": "example.com/sim:dev", "command": ["kvfleet", "sim-engine"],
                     "args": ["--port", "{port}", "--model", "{servedModelName}", "--time-scale", str(time_scale),
                              "--log-level", "warning"],
                     "supportedModelFormats": [{"name": "gguf"}],
                     "supportedDeploymentModes": ["Standard", "PrefillDecodeDisaggregated", "Serverless"],
                     "engineArgFlags": {"maxNumSeqs": {"flag": "--max-num-seqs"}}}}


def sim_docs(tmp_path: Path, name: str, time_scale: float = 0.3, **spec: Any) -> list[dict[str, Any]]:
    """A tiny file:// model, the sim runtime, and InferenceService ``name`` with ``spec``."""
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 64)
    model = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "tiny"},
             "spec": {"source": f"file://{f}", "format": "gguf", "architecture": "LlamaForCausalLM",
                      "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}}
    svc = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
           "spec": {"model": {"name": "tiny"}, "runtime": {"name": "sim"}, **spec}}
    return [sim_runtime(time_scale), model, svc]


class Fleet:
    """A running ``kvfleet up`` subprocess and its state folder."""

    def __init__(self, proc: subprocess.Popen, folder: Path, port: int, log: Path) -> None:
        self.proc, self.folder, self.port, self.log = proc, folder, port, log
        self.url = f"http://127.0.0.1:{port}"

    def state(self) -> dict[str, Any]:
        return read_state(self.folder) or {}

    def replicas(self, st: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        st = st if st is not None else self.state()
        return {r["name"]: r for p in st.get("pools", []) for r in p["replicas"]}

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"kvfleet up exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            st = self.state()
            if st and pred(st):
                return st
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}; state: {json.dumps(self.state())[-3000:]}\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def events(self) -> list[str]:
        return [e["message"] for e in self.state().get("events", [])]

    def pids(self) -> list[int]:
        st = self.state()
        return [r["pid"] for r in [st.get("router", {}), *self.replicas(st).values()] if r.get("pid")]


@contextlib.contextmanager
def running_fleet(tmp_path: Path, docs: list[dict[str, Any]], *extra: str, timeout: float = 120) -> Iterator[Fleet]:
    """``kvfleet up`` (foreground, as a user runs it) until ready; stopped and cleaned up after."""
    spec = tmp_path / "fleet.yaml"
    spec.write_text(yaml.safe_dump_all(docs))
    folder, port, log = tmp_path / "state", free_port(), tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet", "up", "-f", str(spec), "--state-dir", str(folder),
                                 "--port", str(port), *extra], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    fleet = Fleet(proc, folder, port, log)
    seen: set[int] = set()
    try:
        fleet.wait("the fleet to be ready", lambda s: s.get("ready"), timeout)
        yield fleet
    finally:
        seen.update(fleet.pids())
        if proc.poll() is None and read_state(folder) is not None:
            stop_fleet(folder, timeout_s=30)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for pid in seen:  # never leave processes behind, even when a test failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,
                         http_client=httpx.Client(trust_env=False))


class Load:
    """Closed-loop clients sending chat requests through the router (half of them streamed),
    recording every outcome and whether a failed stream had started."""

    def __init__(self, url: str, workers: int, max_tokens: int = 8, model: str = "tiny") -> None:
        self.url, self.max_tokens, self.model = url, max_tokens, model
        self.ok = 0
        self.failed_before_start: list[str] = []
        self.failed_after_start: list[str] = []
        self.lock = threading.Lock()
        self.stops = [threading.Event() for _ in range(workers)]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        c = client(self.url)
        n = 0
        while not self.stops[i].is_set():
            n += 1
            started = False
            try:
                msgs = [{"role": "user", "content": f"worker {i} request {n}: tell me a story"}]
                if n % 2:
                    out = c.chat.completions.create(model=self.model, messages=msgs, max_tokens=self.max_tokens)
                    assert out.choices[0].message.content
                else:
                    for _ in c.chat.completions.create(model=self.model, messages=msgs,
                                                       max_tokens=self.max_tokens, stream=True):
                        started = True
                with self.lock:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                with self.lock:
                    (self.failed_after_start if started else self.failed_before_start).append(repr(e))

    def wait_ok(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.ok < n:
            assert time.monotonic() < deadline, f"{self.ok} requests succeeded; failures: {self.failed_before_start}"
            time.sleep(0.1)

    def stop(self, keep: int = 0) -> None:
        for ev in self.stops[keep:]:
            ev.set()
        for t in self.threads[keep:]:
            t.join(120)


def test_pd_fleet_restarts_killed_replicas_with_backoff_status_and_down(tmp_path, capsys):
    docs = sim_docs(tmp_path, "simpd", deploymentMode="PrefillDecodeDisaggregated",
                    prefill={"minReplicas": 1, "maxReplicas": 1}, decode={"minReplicas": 1, "maxReplicas": 1})
    with running_fleet(tmp_path, docs, "--restart-backoff", "0.5") as fleet:
        st = fleet.state()
        assert [p["role"] for p in st["pools"]] == ["prefill", "decode"]
        assert st["prefill_endpoints_file"] and not st["notes"]
        out = client(fleet.url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=5)
        assert out.choices[0].message.content and out.usage.completion_tokens == 5

        load = Load(fleet.url, workers=4)
        try:
            for crash in (1, 2):
                load.wait_ok(load.ok + 6)
                victim = fleet.replicas()["decode-0"]
                os.kill(victim["pid"], signal.SIGKILL)
                fleet.wait(f"decode-0 restarted after crash {crash}", lambda s, c=crash, v=victim: (
                    (r := fleet.replicas(s)["decode-0"])["restarts"] == c and r["state"] == "ready"
                    and r["pid"] != v["pid"]))
            load.wait_ok(load.ok + 6)
        finally:
            load.stop()
        assert load.failed_before_start == []  # every request that had not started succeeded
        events = fleet.events()
        assert any("exited with signal SIGKILL; restart in 0.5 s" in e for e in events)
        assert any("exited with signal SIGKILL; restart in 1 s" in e for e in events)  # doubled: 2nd in a row

        capsys.readouterr()
        assert main(["status", "--state-dir", str(fleet.folder)]) == 0
        text = capsys.readouterr().out
        assert f"fleet simpd (PrefillDecodeDisaggregated, model tiny): {fleet.url}/v1" in text
        rows = {ln.split()[1]: ln.split() for ln in text.splitlines() if ln.startswith(("prefill ", "decode "))}
        assert set(rows) == {"prefill-0", "decode-0"}
        assert rows["decode-0"][2] == "ready" and rows["decode-0"][5] == "ok" and rows["decode-0"][-1] == "2"
        assert main(["status", "--state-dir", str(fleet.folder), "-o", "json"]) == 0
        js = json.loads(capsys.readouterr().out)
        reps = {r["name"]: r for p in js["pools"] for r in p["replicas"]}
        assert js["router"]["health"] == "ok" and js["supervisor"]["alive"]
        assert 0 <= reps["prefill-0"]["kv_usage"] <= 1 and reps["prefill-0"]["hit_rate"] is not None

        pids = fleet.pids()
        assert main(["down", "--state-dir", str(fleet.folder)]) == 0
        assert "fleet simpd stopped" in capsys.readouterr().out
        assert fleet.proc.wait(30) == 0
        assert not any(pid_alive(p) for p in pids) and read_state(fleet.folder) is None
        assert main(["status", "--state-dir", str(fleet.folder)]) == 1


def test_burst_scales_up_then_drains_back_down(tmp_path):
    docs = sim_docs(tmp_path, "simburst", time_scale=0.5,
                    engine={"minReplicas": 1, "maxReplicas": 3, "engineArgs": {"maxNumSeqs": 2}},
                    autoscaling={"target": 2})
    with running_fleet(tmp_path, docs, "--scale-down-window", "2") as fleet:
        load = Load(fleet.url, workers=10, max_tokens=16)  # 2 run, the rest wait on the one replica
        try:
            fleet.wait("scale up to 3", lambda s: sum(r["state"] == "ready" for r in fleet.replicas(s).values()) == 3)
            load.wait_ok(load.ok + 6)
            load.stop(keep=1)  # the burst ends; one client keeps going through the scale-down
            fleet.wait("scale down to 1", lambda s: [r["state"] for r in fleet.replicas(s).values()] == ["ready"])
            load.wait_ok(load.ok + 1)
        finally:
            load.stop()
        assert load.failed_before_start == [] and load.failed_after_start == []
        events = fleet.events()
        assert any("scale engine pool 1 -> 3 replicas" in e for e in events)
        assert any("-> 1 replicas" in e for e in events)
        drains = [e for e in events if "draining" in e]
        stops = [e for e in events if "drained after" in e or "still busy" in e]
        assert len(drains) == 2 and len(stops) == 2
        assert events.index(drains[0]) < events.index(stops[0])


class _Detached:
    """``Popen``-like view of a detached supervisor, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return None if pid_alive(self.pid) else 0


def test_detached_scale_from_zero_on_the_first_request_and_back_to_zero(tmp_path, capsys):
    docs = sim_docs(tmp_path, "simzero", deploymentMode="Serverless", engine={"maxReplicas": 2},
                    autoscaling={"target": 4, "idleTimeoutSeconds": 2})
    spec, folder, port = tmp_path / "zero.yaml", tmp_path / "state", free_port()
    spec.write_text(yaml.safe_dump_all(docs))
    up = ["up", "-f", str(spec), "--state-dir", str(folder), "--port", str(port)]
    assert main([*up, "--detach"]) == 0  # returns once ready: here the router alone
    assert f"fleet simzero is up: http://127.0.0.1:{port}/v1" in capsys.readouterr().out
    st = read_state(folder)
    fleet = Fleet(_Detached(st["supervisor"]["pid"]), folder, port, folder / "logs" / "supervisor.log")
    try:
        assert main(up) == 2  # a second `up` of the same fleet
        assert "fleet 'simzero' is already running" in capsys.readouterr().err
        assert fleet.replicas() == {}
        out = client(fleet.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "wake up"}], max_tokens=4)  # held while one starts
        assert out.choices[0].message.content
        assert sum("activation" in e for e in fleet.events()) == 1
        fleet.wait("scale to zero", lambda s: fleet.replicas(s) == {}, timeout=60)
        assert any("scale to zero" in e for e in fleet.events())
        # (waking again after zero: test_local_supervisor.py::test_scale_from_zero_on_held_request_and_back_to_zero)
    finally:
        pids = fleet.pids()
        assert main(["down", "--state-dir", str(folder)]) == 0
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not pid_alive(st["supervisor"]["pid"])
