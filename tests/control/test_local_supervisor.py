"""The supervisor's state machine, tick by tick, with fake processes, fake HTTP and a fake clock
(no sleeping): restart with exponential back-off, liveness and start timeouts, draining before
SIGTERM on scale-down, scale from zero on a held request and back to zero when idle."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
from pathlib import Path

import pytest

from kvfleet.control.api import Catalog
from kvfleet.control.local import Supervisor, SupervisorOptions, plan_fleet, restart_delay
from kvfleet.control.resolve import resolve
from tests.control.specs import service


class FakeProc:
    """A process that exits when told to (crash) or on SIGTERM / SIGKILL."""

    next_pid = 5000

    def __init__(self, argv: list[str]) -> None:
        FakeProc.next_pid += 1
        self.pid = FakeProc.next_pid
        self.argv = argv
        self.returncode: int | None = None
        self.signals: list[int] = []
        self.ignore_term = False

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL or not self.ignore_term:
            self.returncode = -sig

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class World:
    """Fake processes and their HTTP answers, keyed by port."""

    def __init__(self) -> None:
        self.now = 0.0
        self.procs: dict[int, FakeProc] = {}
        self.healthy: dict[int, bool] = {}
        self.load: dict[int, tuple[int, int]] = {}  # port -> (running, waiting)
        self.default_healthy = True
        self.router_port: int | None = None
        self.queued = 0
        self.requests: dict[str, int] = {}
        self.spawned: list[FakeProc] = []

    def spawn(self, argv: list[str], env: dict[str, str], log: Path) -> FakeProc:
        p = FakeProc(argv)
        port = int(argv[argv.index("--port") + 1])
        self.procs[port] = p
        self.healthy.setdefault(port, self.default_healthy)
        if "router" in argv:
            self.router_port = port
        self.spawned.append(p)
        return p

    async def http_get(self, url: str, timeout: float) -> tuple[int, str]:
        port = int(url.split(":")[2].split("/")[0])
        p = self.procs.get(port)
        if p is None or p.returncode is not None:
            raise ConnectionError("connection refused")
        if port == self.router_port:
            lines = [f"kvfleet_router_queued_requests {self.queued}"]
            lines += [f'kvfleet_router_requests_total{{endpoint="{u}"}} {n}' for u, n in self.requests.items()]
            return 200, "\n".join(lines) + "\n"
        if url.endswith("/health"):
            return (200, "ok") if self.healthy[port] else (503, "no")
        running, waiting = self.load.get(port, (0, 0))
        return 200, (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                     f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
                     f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.25\n')


def _plan(tmp_path: Path, mode: str = "Standard", low: int = 2, high: int = 2, **spec):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    model = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "smollm2"},
             "spec": {"source": f"file://{f}", "format": "gguf", "architecture": "LlamaForCausalLM",
                      "sha256": hashlib.sha256(b"GGUF").hexdigest()}}
    svc = service("chat", mode, "kvfleet", args={}, **spec)
    if "engine" in svc["spec"]:
        svc["spec"]["engine"].update(minReplicas=low, maxReplicas=high, terminationGracePeriodSeconds=30)
    catalog = Catalog.from_documents([model, svc])
    return plan_fleet(resolve(catalog.inference_services()[0], catalog), scale_down_window_s=0)


def _supervisor(tmp_path: Path, world: World, plan, **opts) -> Supervisor:
    options = SupervisorOptions(**{"backoff_base_s": 1.0, "backoff_max_s": 8.0, "crash_reset_s": 60.0,
                                   "drain_min_s": 2.0, "health_interval_s": 2.0, **opts})
    sup = Supervisor(plan, tmp_path / "fleet", port=18999, options=options, spawn=world.spawn,
                     http_get=world.http_get, clock=lambda: world.now)
    asyncio.run(sup.start())
    return sup


def step(sup: Supervisor, world: World, dt: float = 0.5) -> None:
    world.now += dt
    asyncio.run(sup.tick())


def endpoints(sup: Supervisor) -> list[str]:
    text = sup.endpoints_file.read_text()
    return [ln[2:] for ln in text.splitlines() if ln.startswith("- ")]


def states(sup: Supervisor) -> list[str]:
    return [r.state for r in sorted(sup.replicas, key=lambda r: r.index)]


def test_restart_delay_doubles_up_to_the_cap():
    assert [restart_delay(n, 1.0, 8.0) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


def test_start_crash_backoff_restart(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path))
    assert states(sup) == ["starting", "starting"] and endpoints(sup) == []
    step(sup, world)
    assert states(sup) == ["ready", "ready"] and sup.router.state == "ready" and sup.ready
    assert len(endpoints(sup)) == 2
    state = json.loads((tmp_path / "fleet" / "state.json").read_text())
    assert state["ready"] and [r["state"] for r in state["pools"][0]["replicas"]] == ["ready", "ready"]

    r0 = sup.replicas[0]
    old_url, old_pid = r0.url, r0.pid
    world.procs[r0.port].returncode = -9  # kill -9
    step(sup, world)
    assert r0.state == "backoff" and r0.restarts == 1 and endpoints(sup) == [sup.replicas[1].url]
    assert f"(pid {old_pid}) exited with signal SIGKILL; restart in 1 s" in sup.events[-1]["message"]
    step(sup, world)  # 0.5 s later: still waiting
    assert r0.state == "backoff"
    step(sup, world)  # 1 s: restarted (a new process on a new port)
    assert r0.state == "starting" and r0.pid != old_pid
    step(sup, world)
    assert r0.state == "ready" and old_url not in endpoints(sup) and r0.url in endpoints(sup)

    world.procs[r0.port].returncode = 1  # crashes again soon: the back-off doubles
    step(sup, world)
    assert r0.state == "backoff" and "exit status 1; restart in 2 s" in sup.events[-1]["message"]
    step(sup, world, 1.0)
    assert r0.state == "backoff"
    step(sup, world, 1.0)
    step(sup, world)
    assert r0.state == "ready"
    step(sup, world, 61)  # ready for over crash_reset_s: the next crash starts a new loop
    world.procs[r0.port].returncode = -9
    step(sup, world)
    assert "restart in 1 s" in sup.events[-1]["message"] and r0.restarts == 3


def test_router_crash_is_restarted_on_its_port(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path, low=1, high=1))
    step(sup, world)
    world.procs[18999].returncode = -9
    step(sup, world)
    assert sup.router.state == "backoff"
    step(sup, world, 1.0)
    assert sup.router.state == "starting" and world.procs[18999].returncode is None
    step(sup, world)
    assert sup.router.state == "ready"


def test_liveness_and_start_timeouts_kill_and_restart(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path, low=1, high=1), start_timeout_s=10,
                      health_failure_threshold=3)
    step(sup, world)
    r = sup.replicas[0]
    assert r.state == "ready"
    proc = world.procs[r.port]
    world.healthy[r.port] = False  # hangs: answers nothing useful
    for _ in range(2):
        step(sup, world, 2.0)
        assert r.state == "ready"
    step(sup, world, 2.0)  # third failed check in a row
    assert proc.signals == [signal.SIGKILL] and r.state == "backoff"
    assert "failed 3 health checks in a row; killed" in sup.events[-1]["message"]

    world.default_healthy = False  # the restarted process never becomes healthy
    step(sup, world, 1.0)
    assert r.state == "starting"
    step(sup, world, 10.5)
    assert r.state == "backoff" and "not healthy within 10 s; killed" in sup.events[-1]["message"]


def test_scale_down_drains_before_sigterm(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path, low=1, high=3, autoscaling={"target": 2}))
    step(sup, world)
    assert states(sup) == ["ready"]
    first = sup.replicas[0]
    world.load[first.port] = (2, 6)  # 6 waiting / target 2 -> 3 replicas
    step(sup, world)
    assert states(sup) == ["ready", "starting", "starting"] and sup.desired["engine"] == 3
    step(sup, world)
    assert states(sup) == ["ready"] * 3 and len(endpoints(sup)) == 3

    busy, idle = sup.replicas[1], sup.replicas[2]
    world.load[first.port] = (0, 0)
    world.load[busy.port] = (1, 0)  # still running one request when demand ends
    world.load[idle.port] = (0, 0)
    step(sup, world)  # recommendation 1: two replicas drain (window 0), the least loaded first
    assert sup.desired["engine"] == 1
    draining = [r for r in sup.replicas if r.state == "draining"]
    assert sorted(r.index for r in draining) == [0, 2]  # the busy one stays
    assert endpoints(sup) == [busy.url]  # out of the router's list at once ...
    assert world.procs[first.port].signals == [] and world.procs[idle.port].signals == []
    step(sup, world, 1.0)  # ... but no SIGTERM before the router has re-read the file
    assert world.procs[idle.port].signals == []
    step(sup, world, 1.0)
    assert world.procs[idle.port].signals == [signal.SIGTERM] and world.procs[first.port].signals == [signal.SIGTERM]
    step(sup, world)
    assert states(sup) == ["ready"] and sup.replicas[0] is busy
    assert sum("drained after" in e["message"] for e in sup.events) == 2


def _two_then_drain(tmp_path: Path, world: World) -> tuple[Supervisor, object, object]:
    """A pool scaled to 2 by a queue, then back to 1: returns (supervisor, draining, staying)."""
    sup = _supervisor(tmp_path, world, _plan(tmp_path, low=1, high=2, autoscaling={"target": 1}))
    step(sup, world)
    a = sup.replicas[0]
    world.load[a.port] = (1, 3)  # 3 waiting / target 1 -> 2 (the maximum)
    step(sup, world)
    step(sup, world)
    b = sup.replicas[1]
    assert states(sup) == ["ready", "ready"]
    world.load[a.port], world.load[b.port] = (0, 0), (1, 0)  # nothing waits: 1 replica is enough
    step(sup, world)
    assert a.state == "draining" and b.state == "ready"  # the idle one goes
    return sup, a, b


def test_drain_waits_for_running_requests(tmp_path):
    world = World()
    sup, a, b = _two_then_drain(tmp_path, world)
    world.load[a.port] = (2, 0)  # requests already on it keep running
    step(sup, world, 3.0)
    assert a.state == "draining" and world.procs[a.port].signals == []
    step(sup, world, 10.0)
    assert world.procs[a.port].signals == []  # 13 s < terminationGracePeriodSeconds (30)
    world.load[a.port] = (0, 0)  # finished
    step(sup, world)
    assert world.procs[a.port].signals == [signal.SIGTERM] and a.state == "stopping"
    step(sup, world)
    assert sup.replicas == [b]


def test_drain_is_bounded_by_the_grace_period(tmp_path):
    world = World()
    sup, a, _ = _two_then_drain(tmp_path, world)
    world.load[a.port] = (3, 0)  # never finishes
    step(sup, world, 29.0)
    assert world.procs[a.port].signals == []
    step(sup, world, 1.5)
    assert world.procs[a.port].signals == [signal.SIGTERM]
    assert "still busy after 30 s of draining" in sup.events[-1]["message"]


def test_stop_timeout_escalates_to_sigkill(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path, low=1, high=2, autoscaling={"target": 1}),
                      stop_timeout_s=5)
    step(sup, world)
    world.load[sup.replicas[0].port] = (0, 2)
    step(sup, world)
    step(sup, world)
    world.load[sup.replicas[0].port] = (0, 0)
    for r in sup.replicas:
        world.procs[r.port].ignore_term = True
    step(sup, world)
    victim = next(r for r in sup.replicas if r.state == "draining")
    step(sup, world, 2.0)
    assert victim.state == "stopping" and world.procs[victim.port].signals == [signal.SIGTERM]
    step(sup, world, 5.0)
    assert world.procs[victim.port].signals == [signal.SIGTERM, signal.SIGKILL]
    step(sup, world)
    assert victim not in sup.replicas


def test_scale_from_zero_on_held_request_and_back_to_zero(tmp_path):
    world = World()
    plan = _plan(tmp_path, "Serverless", low=0, high=2, autoscaling={"target": 4, "idleTimeoutSeconds": 10})
    sup = _supervisor(tmp_path, world, plan)
    assert sup.replicas == []
    step(sup, world)
    assert sup.ready and sup.replicas == []  # the router alone
    step(sup, world, 30)
    assert sup.replicas == []  # idle at zero
    world.queued = 1  # a request arrives; the router holds it
    step(sup, world)
    assert states(sup) == ["starting"] and "activation" in sup.events[-2]["message"]
    step(sup, world)  # healthy: in the endpoints file, the router sends the held request
    assert states(sup) == ["ready"] and len(endpoints(sup)) == 1
    world.queued = 0
    r = sup.replicas[0]
    world.load[r.port] = (1, 0)
    world.requests[r.url] = 1
    step(sup, world, 5)
    world.load[r.port] = (0, 0)
    step(sup, world, 5)  # 5 s idle: stays
    assert states(sup) == ["ready"]
    step(sup, world, 5)  # 10 s idle: scale to zero, by draining
    assert states(sup) == ["draining"] and endpoints(sup) == []
    assert "scale to zero" in [e for e in sup.events if "scale" in e["message"]][-1]["message"]
    step(sup, world, 2)
    step(sup, world)
    assert sup.replicas == []
    world.queued = 2  # and again
    step(sup, world)
    assert states(sup) == ["starting"]


def test_pd_pools_are_supervised_separately(tmp_path):
    world = World()
    plan = _plan(tmp_path, "PrefillDecodeDisaggregated")
    sup = _supervisor(tmp_path, world, plan)
    step(sup, world)
    roles = sorted((r.role, r.state) for r in sup.replicas)
    assert roles == [("decode", "ready"), ("decode", "ready"), ("prefill", "ready")]  # prefill 1..3, decode 2..2
    urls = {r.role: set() for r in sup.replicas}
    for r in sup.replicas:
        urls[r.role].add(r.url)
    assert set(endpoints(sup)) == urls["decode"]  # the router's decode pool
    prefill = [ln[2:] for ln in sup.prefill_endpoints_file.read_text().splitlines() if ln.startswith("- ")]
    assert set(prefill) == urls["prefill"]  # and its prefill pool
    argv = sup.router.argv
    assert argv[argv.index("--prefill-endpoints-file") + 1] == str(sup.prefill_endpoints_file)
    assert sup.snapshot()["prefill_endpoints_file"] == str(sup.prefill_endpoints_file)


def test_shutdown_stops_everything_and_removes_the_state(tmp_path):
    world = World()
    sup = _supervisor(tmp_path, world, _plan(tmp_path))
    step(sup, world)
    procs = list(world.spawned)
    asyncio.run(sup.shutdown())
    assert all(p.signals[:1] == [signal.SIGTERM] for p in procs)
    assert not (tmp_path / "fleet" / "state.json").exists()


@pytest.mark.parametrize("code,text", [(-9, "signal SIGKILL"), (3, "exit status 3"), (None, "no exit status")])
def test_describe_exit(code, text):
    from kvfleet.control.local import describe_exit

    assert describe_exit(code) == text
