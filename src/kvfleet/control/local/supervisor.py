"""The local fleet's supervisor: runs a :class:`~kvfleet.control.local.plan.FleetPlan` as processes
and keeps it running.

Every tick (0.5 s by default) it

1. reaps exited processes: an engine or router that exits on its own is a crash and is restarted
   after an exponential back-off (``base * 2**(crashes - 1)``, capped; the count resets once a
   replica has stayed ready for ``crash_reset_s``), as Kubernetes does with CrashLoopBackOff;
2. probes: ``/health`` of starting replicas (ready at the first 200; killed and restarted when
   not ready within ``start_timeout_s``) and, every ``health_interval_s``, of ready ones (killed
   and restarted after ``health_failure_threshold`` failures in a row: a liveness probe);
   ``/metrics`` of ready and draining replicas and of the router;
3. autoscales each pool with :func:`kvfleet.control.autoscale.decide` (the policy the KEDA
   rendering encodes) on the pool's total of the autoscaling metric plus the requests the router
   holds; a pool at zero starts a replica when the router holds a request (scale from zero);
4. scales down by draining: the replica leaves the endpoints file first, and gets SIGTERM only
   once the router has re-read the file (``drain_min_s``) and the engine reports no running or
   waiting request (or after the pool's ``terminationGracePeriodSeconds``); SIGKILL after
   ``stop_timeout_s`` more;
5. writes the ready replicas' URLs to the endpoints file the router watches (a P/D fleet: the
   decode replicas there, the prefill replicas to the prefill endpoints file), and the fleet's
   ``state.json`` for ``kvfleet status`` / ``kvfleet down``.

Process creation and HTTP are injectable (``spawn``, ``http_get``, ``clock``), so the state
machine is tested with fakes, tick by tick, as well as with real processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvfleet.control.autoscale import AutoscaleState, Observation, decide
from kvfleet.control.local.plan import FleetPlan, PoolPlan
from kvfleet.control.local.probe import EngineSample, RouterSample, parse_engine_sample, parse_router_sample
from kvfleet.control.local.state import (
    ENDPOINTS_FILE,
    LOG_DIR,
    PREFILL_ENDPOINTS_FILE,
    STATE_FILE,
    cmdline,
    free_port,
    write_json_atomic,
    write_text_atomic,
)

logger = logging.getLogger("kvfleet.fleet")

#: ``spawn(argv, env, log_path)`` -> a ``subprocess.Popen``-like object (``pid``, ``poll()``,
#: ``wait(timeout)``, ``send_signal(sig)``, ``kill()``).
Spawner = Callable[[list[str], dict[str, str], Path], Any]
#: ``await http_get(url, timeout_s)`` -> ``(status, text)``; raises on connection errors.
HttpGet = Callable[[str, float], Awaitable[tuple[int, str]]]


@dataclass
class SupervisorOptions:
    """Timing of the supervisor (all seconds).

    Attributes:
        tick_s: interval of the supervision loop.
        health_interval_s: interval of ``/health`` checks of ready replicas.
        probe_timeout_s: timeout of one probe or scrape.
        health_failure_threshold: failed health checks in a row after which a replica is
            killed and restarted.
        start_timeout_s: most time a replica may take to answer ``/health``.
        backoff_base_s, backoff_max_s: restart back-off ``base * 2**(crashes - 1)``, at most max.
        crash_reset_s: a replica ready this long has its crash count reset.
        drain_min_s: least time between taking a replica out of the endpoints file and SIGTERM
            (the router re-reads the file every second).
        stop_timeout_s: SIGTERM to SIGKILL.
        hold_s: how long the router holds requests while no replica is ready.
        state_interval_s: ``state.json`` is rewritten at least this often (a heartbeat).
    """

    tick_s: float = 0.5
    health_interval_s: float = 2.0
    probe_timeout_s: float = 5.0
    health_failure_threshold: int = 3
    start_timeout_s: float = 300.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_reset_s: float = 60.0
    drain_min_s: float = 2.0
    stop_timeout_s: float = 15.0
    hold_s: float = 120.0
    state_interval_s: float = 2.0


def restart_delay(crashes: int, base_s: float, max_s: float) -> float:
    """Back-off before restart number ``crashes`` (>= 1) of a crash loop: ``base_s * 2**(crashes - 1)``
    seconds, at most ``max_s`` (Kubernetes' CrashLoopBackOff shape)."""
    return min(max_s, base_s * 2 ** max(0, crashes - 1))


def describe_exit(code: int | None) -> str:
    """``exit status 1`` / ``signal SIGKILL`` for a ``Popen.returncode``."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def popen_spawner(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``argv`` in its own session (so a terminal's Ctrl-C reaches only the supervisor),
    stdout and stderr appended to ``log_path``.

    Raises:
        OSError: the executable cannot be started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, close_fds=True)


@dataclass
class Replica:
    """One supervised process: an engine replica (``role`` = its pool) or the router (``role`` =
    ``router``).

    Attributes:
        role, index: pool and slot (the name is ``ROLE-INDEX``).
        state: ``starting``, ``ready``, ``draining``, ``stopping`` or ``backoff`` (waiting to restart).
        proc: the process (``None`` in ``backoff``).
        port: its HTTP port.
        argv: its command line.
        restarts: restarts after crashes, since the fleet started.
        crashes: crashes in the current crash loop (sets the back-off).
        sample: the last ``/metrics`` scrape (engines).
    """

    role: str
    index: int
    log: Path
    state: str = "starting"
    proc: Any = None
    port: int | None = None
    argv: list[str] = field(default_factory=list)
    restarts: int = 0
    crashes: int = 0
    spawned_at: float = 0.0
    ready_at: float | None = None
    restart_at: float | None = None
    drain_started: float | None = None
    stop_deadline: float | None = None
    killed: bool = False
    health_failures: int = 0
    last_health: float = -1e18
    health_ok: bool | None = None
    sample: EngineSample | None = None
    sample_tick: int = -1
    last_exit: str | None = None

    @property
    def name(self) -> str:
        """``engine-0``, ``decode-1``, ``router-0``."""
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process id, or ``None``."""
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    """Runs and supervises a local fleet (see the module docstring).

    Args:
        plan: what to run.
        folder: the fleet's state folder (``state.json``, ``endpoints.yaml``, ``logs/``).
        port: the router's port (the fleet's address).
        host: the router's bind address.
        options: timing.
        spawn: process starter (default :func:`popen_spawner`).
        http_get: HTTP GET (default: an ``httpx.AsyncClient``, created by :meth:`run`).
        clock: monotonic clock, seconds.
        meta: extra fields for ``state.json`` (spec file, namespace ...).
    """

    def __init__(self, plan: FleetPlan, folder: Path, *, port: int, host: str = "127.0.0.1",
                 options: SupervisorOptions | None = None, spawn: Spawner | None = None,
                 http_get: HttpGet | None = None, clock: Callable[[], float] = time.monotonic,
                 meta: dict[str, Any] | None = None) -> None:
        self.plan = plan
        self.folder = Path(folder)
        self.port, self.host = port, host
        self.options = options or SupervisorOptions()
        self.spawn = spawn or popen_spawner
        self.http_get = http_get
        self.clock = clock
        self.meta = dict(meta or {})
        self.pools: dict[str, PoolPlan] = {p.role: p for p in plan.pools}
        self.replicas: list[Replica] = []
        self.router = Replica("router", 0, self.folder / LOG_DIR / "router.log", port=port)
        self.router_sample: RouterSample | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self.desired: dict[str, int] = {p.role: p.min_replicas for p in plan.pools}
        self._scale_state: dict[str, AutoscaleState] = {p.role: AutoscaleState() for p in plan.pools}
        self._prev_requests: dict[str, float] = {}
        self._prev_rejected = 0.0
        self._tick_no = 0
        self._endpoints_text: dict[Path, str] = {}
        self._last_state: tuple[str, float] | None = None
        self._was_ready = False
        self.endpoints_file = self.folder / ENDPOINTS_FILE
        self.prefill_endpoints_file = self.folder / PREFILL_ENDPOINTS_FILE if plan.pd else None
        self._self_argv = cmdline(os.getpid())  # lets `kvfleet down` check the pid is still this process

    # ------------------------------------------------------------------ helpers
    def event(self, msg: str, level: int = logging.INFO) -> None:
        """Record ``msg`` in the event list (``state.json``) and the log."""
        self.events.append({"time": time.time(), "message": msg})
        logger.log(level, "%s: %s", self.plan.name, msg)

    def pool_replicas(self, role: str) -> list[Replica]:
        """The replicas of pool ``role`` (every state)."""
        return [r for r in self.replicas if r.role == role]

    @staticmethod
    def counted(replicas: list[Replica]) -> list[Replica]:
        """Those that count towards the pool's size: starting, ready or waiting to restart."""
        return [r for r in replicas if r.state in ("starting", "ready", "backoff")]

    @property
    def ready(self) -> bool:
        """True when the router is up and every pool has at least ``minReplicas`` ready replicas."""
        return self.router.state == "ready" and all(
            sum(r.state == "ready" for r in self.pool_replicas(p.role)) >= p.min_replicas for p in self.plan.pools)

    @property
    def url(self) -> str:
        """The fleet's address (the router)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def _spawn(self, r: Replica, now: float) -> None:
        if r.role == "router":
            argv = self.plan.router_argv(endpoints_file=self.endpoints_file, port=self.port, host=self.host,
                                         hold_s=self.options.hold_s,
                                         prefill_endpoints_file=self.prefill_endpoints_file)
            env = dict(os.environ)
        else:
            pool = self.pools[r.role]
            r.port = free_port()
            argv = pool.argv(r.port)
            env = {**os.environ, **pool.env}
        env["PYTHONUNBUFFERED"] = "1"
        r.argv, r.spawned_at, r.ready_at, r.health_failures, r.killed = argv, now, None, 0, False
        r.sample, r.health_ok, r.restart_at, r.last_health = None, None, None, -1e18
        try:
            r.proc = self.spawn(argv, env, r.log)
        except OSError as e:
            r.proc = None
            self._crashed(r, now, f"could not start: {e}")
            return
        r.state = "starting"
        self.event(f"{r.name} starting (pid {r.pid}" + (f", port {r.port})" if r.role != "router" else ")"))

    def _crashed(self, r: Replica, now: float, why: str) -> None:
        if r.ready_at is not None and now - r.ready_at >= self.options.crash_reset_s:
            r.crashes = 0
        r.crashes += 1
        r.restarts += 1
        delay = restart_delay(r.crashes, self.options.backoff_base_s, self.options.backoff_max_s)
        r.state, r.restart_at, r.ready_at, r.sample, r.proc = "backoff", now + delay, None, None, None
        self.event(f"{r.name} {why}; restart in {delay:g} s (crash {r.crashes} in a row)", logging.WARNING)

    def _kill(self, r: Replica) -> None:
        if r.proc is None:
            return
        try:
            r.proc.kill()
            r.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _signal(self, r: Replica, sig: int) -> None:
        if r.proc is not None:
            try:
                r.proc.send_signal(sig)
            except OSError:
                pass

    # ------------------------------------------------------------------ HTTP
    async def _get(self, url: str) -> tuple[int, str] | None:
        assert self.http_get is not None
        try:
            return await self.http_get(url, self.options.probe_timeout_s)
        except Exception:  # connection refused, timeouts, broken responses: the probe failed
            return None

    async def _probe_health(self, r: Replica) -> None:
        res = await self._get(r.url + self.pools[r.role].health_path)
        r.health_ok = res is not None and res[0] == 200

    async def _probe_metrics(self, r: Replica) -> None:
        pool = self.pools[r.role]
        res = await self._get(r.url + pool.metrics_path)
        if res is None or res[0] != 200:
            return
        try:
            r.sample = parse_engine_sample(res[1], pool.autoscale.metric)
        except ValueError:
            return
        r.sample_tick = self._tick_no

    async def _probe_router(self) -> None:
        res = await self._get(self.url + "/metrics")
        ok = res is not None and res[0] == 200
        self.router.health_ok = ok
        if ok:
            try:
                self.router_sample = parse_router_sample(res[1])  # type: ignore[index]
            except ValueError:
                pass

    async def _probe_all(self, now: float) -> None:
        jobs = []
        for r in self.replicas:
            r.health_ok = None
            if r.proc is None:
                continue
            if r.state == "starting":
                jobs.append(self._probe_health(r))
            elif r.state == "ready":
                jobs.append(self._probe_metrics(r))
                if now - r.last_health >= self.options.health_interval_s:
                    r.last_health = now
                    jobs.append(self._probe_health(r))
            elif r.state == "draining":
                jobs.append(self._probe_metrics(r))
        self.router.health_ok = None
        if self.router.proc is not None and self.router.state in ("starting", "ready"):
            jobs.append(self._probe_router())
        await asyncio.gather(*jobs)

    # ------------------------------------------------------------------ the loop
    async def start(self) -> None:
        """Write an empty endpoints file, start the router and each pool's ``minReplicas``."""
        (self.folder / LOG_DIR).mkdir(parents=True, exist_ok=True)
        self._write_endpoints([], [])
        now = self.clock()
        self.event(f"starting {self.plan.rs.mode} fleet {self.plan.name!r}: model {self.plan.model_path}, "
                   + ", ".join(f"{p.role} pool {p.min_replicas}..{p.max_replicas} replicas" for p in self.plan.pools))
        for note in self.plan.notes:
            self.event(note, logging.WARNING)
        self._spawn(self.router, now)
        for p in self.plan.pools:
            for _ in range(p.min_replicas):
                self._add(p.role, now)
        self._save_state(now, force=True)

    def _add(self, role: str, now: float) -> Replica:
        used = {r.index for r in self.pool_replicas(role)}
        index = next(i for i in range(len(used) + 1) if i not in used)
        r = Replica(role, index, self.folder / LOG_DIR / f"{role}-{index}.log")
        self.replicas.append(r)
        self._spawn(r, now)
        return r

    async def tick(self) -> None:
        """One round: reap, probe, advance states, autoscale, restart, write files."""
        self._tick_no += 1
        now = self.clock()
        self._reap(now)
        await self._probe_all(now)
        self._advance(now)
        self._autoscale(now)
        for r in [*self.replicas, self.router]:
            if r.state == "backoff" and r.restart_at is not None and now >= r.restart_at:
                self._spawn(r, now)
        ready = [r for r in self.replicas if r.state == "ready"]
        self._write_endpoints([r.url for r in ready if r.role != "prefill" or not self.plan.pd],
                              [r.url for r in ready if r.role == "prefill" and self.plan.pd])
        if self.ready and not self._was_ready:
            self.event(f"ready: {self.url}/v1 (" + ", ".join(
                f"{sum(r.state == 'ready' for r in self.pool_replicas(p.role))} {p.role}" for p in self.plan.pools)
                + " replicas ready)")
        self._was_ready = self.ready
        self._save_state(now)

    def _reap(self, now: float) -> None:
        for r in [*self.replicas, self.router]:
            if r.proc is None:
                continue
            code = r.proc.poll()
            if code is None:
                continue
            pid, r.last_exit = r.pid, describe_exit(code)
            if r.state in ("stopping", "draining"):
                r.proc = None
                if r in self.replicas:
                    self.replicas.remove(r)
                self.event(f"{r.name} (pid {pid}) stopped ({r.last_exit})")
            else:
                what = "was killed by the supervisor" if r.killed else f"exited with {r.last_exit}"
                self._crashed(r, now, f"(pid {pid}) {what}")

    def _advance(self, now: float) -> None:
        o = self.options
        for r in list(self.replicas):
            if r.proc is None:
                continue
            if r.state == "starting":
                if r.health_ok:
                    r.state, r.ready_at, r.last_health = "ready", now, now
                    self.event(f"{r.name} ready at {r.url} after {now - r.spawned_at:.1f} s")
                elif now - r.spawned_at > o.start_timeout_s:
                    r.killed = True
                    self._kill(r)
                    self._crashed(r, now, f"not healthy within {o.start_timeout_s:g} s; killed")
            elif r.state == "ready":
                if r.health_ok is False:
                    r.health_failures += 1
                    if r.health_failures >= o.health_failure_threshold:
                        r.killed = True
                        self._kill(r)
                        self._crashed(r, now, f"failed {r.health_failures} health checks in a row; killed")
                elif r.health_ok:
                    r.health_failures = 0
            elif r.state == "draining":
                waited = now - (r.drain_started or now)
                in_flight = (self.router_sample.in_flight.get(r.url, 0.0) if self.router_sample else 0.0)
                idle = (r.sample is not None and r.sample_tick == self._tick_no and r.sample.running == 0
                        and r.sample.waiting == 0 and in_flight == 0)
                limit = self.pools[r.role].drain_timeout_s
                if (waited >= o.drain_min_s and idle) or waited >= limit:
                    self.event(f"{r.name} drained after {waited:.1f} s; stopping" if idle and waited < limit else
                               f"{r.name} still busy after {limit:g} s of draining; stopping")
                    self._signal(r, signal.SIGTERM)
                    r.state, r.stop_deadline = "stopping", now + o.stop_timeout_s
            elif r.state == "stopping" and r.stop_deadline is not None and now >= r.stop_deadline and not r.killed:
                r.killed = True
                self.event(f"{r.name} did not stop within {o.stop_timeout_s:g} s; SIGKILL", logging.WARNING)
                self._signal(r, signal.SIGKILL)
        rt = self.router
        if rt.proc is not None and rt.state == "starting" and rt.health_ok:
            rt.state, rt.ready_at = "ready", now
            self.event(f"router ready at {self.url}")
        elif rt.proc is not None and rt.state == "starting" and now - rt.spawned_at > o.start_timeout_s:
            rt.killed = True
            self._kill(rt)
            self._crashed(rt, now, f"not answering within {o.start_timeout_s:g} s; killed")

    # ------------------------------------------------------------------ autoscaling
    def _observe(self, role: str, now: float) -> Observation:
        reps = self.pool_replicas(role)
        counted = self.counted(reps)
        rs = self.router_sample or RouterSample()
        urls = {r.url for r in reps if r.port}
        serving = [r for r in reps if r.state in ("ready", "draining") and r.sample is not None]
        metric = sum(r.sample.metric for r in serving if r.state == "ready")  # type: ignore[union-attr]
        routed = sum(max(0.0, rs.requests.get(u, 0.0) - self._prev_requests.get(u, 0.0)) for u in urls)
        busy = (any(r.sample.running + r.sample.waiting > 0 for r in serving)  # type: ignore[union-attr]
                or any(rs.in_flight.get(u, 0.0) > 0 for u in urls) or routed > 0
                or rs.rejected > self._prev_rejected)
        return Observation(now=now, replicas=len(counted), metric_total=metric, queued=rs.queued, busy=busy)

    def _autoscale(self, now: float) -> None:
        for p in self.plan.pools:
            counted = self.counted(self.pool_replicas(p.role))
            if p.pool.autoscaled:
                d = decide(p.autoscale, self._scale_state[p.role], self._observe(p.role, now))
                self._scale_state[p.role] = d.state
                desired, reason = d.desired, d.reason
            else:
                desired, reason = p.min_replicas, "fixed size"
            self.desired[p.role] = desired
            if desired != len(counted):
                self._scale(p.role, counted, desired, reason, now)
        rs = self.router_sample
        if rs is not None:
            self._prev_requests, self._prev_rejected = dict(rs.requests), rs.rejected

    def _scale(self, role: str, counted: list[Replica], desired: int, reason: str, now: float) -> None:
        self.event(f"scale {role} pool {len(counted)} -> {desired} replicas: {reason}")
        if desired > len(counted):
            for _ in range(desired - len(counted)):
                self._add(role, now)
            return
        order = {"backoff": 0, "starting": 1, "ready": 2}

        def load(r: Replica) -> float:
            return (r.sample.running + r.sample.waiting) if r.sample else 0.0

        victims = sorted(counted, key=lambda r: (order[r.state], load(r), -r.index))[:len(counted) - desired]
        for r in victims:
            if r.state == "backoff":
                self.replicas.remove(r)
                self.event(f"{r.name} removed (was waiting to restart)")
            elif r.state == "starting":
                self._signal(r, signal.SIGTERM)
                r.state, r.stop_deadline = "stopping", now + self.options.stop_timeout_s
            else:
                r.state, r.drain_started = "draining", now
                self.event(f"{r.name} draining: out of the endpoints file, stops when idle")

    # ------------------------------------------------------------------ files
    def _write_endpoints(self, urls: list[str], prefill_urls: list[str]) -> None:
        """Write the router's endpoints file(s): ``urls`` (the decode pool of a P/D fleet) and,
        for a P/D fleet, ``prefill_urls`` to the prefill endpoints file."""
        files = [(self.endpoints_file, urls)]
        if self.prefill_endpoints_file is not None:
            files.append((self.prefill_endpoints_file, prefill_urls))
        for path, group in files:
            text = "".join(f"- {u}\n" for u in sorted(group)) or "[]\n"
            if text != self._endpoints_text.get(path):
                write_text_atomic(path, text)
                self._endpoints_text[path] = text

    def snapshot(self) -> dict[str, Any]:
        """The fleet's state as ``state.json`` holds it."""

        def rep(r: Replica) -> dict[str, Any]:
            return {"name": r.name, "index": r.index, "state": r.state, "pid": r.pid, "port": r.port,
                    "url": r.url if r.port else None, "restarts": r.restarts, "last_exit": r.last_exit,
                    "log": str(r.log), "argv": r.argv}

        return {
            **self.meta,
            "name": self.plan.name, "mode": self.plan.rs.mode, "model": self.plan.rs.served_model_name,
            "model_path": str(self.plan.model_path), "url": self.url, "ready": self.ready,
            "supervisor": {"pid": os.getpid(), "argv": self._self_argv},
            "router": {**rep(self.router), "url": self.url},
            "endpoints_file": str(self.endpoints_file), "notes": list(self.plan.notes),
            **({"prefill_endpoints_file": str(self.prefill_endpoints_file)} if self.prefill_endpoints_file else {}),
            "pools": [{"role": p.role, "min_replicas": p.min_replicas, "max_replicas": p.max_replicas,
                       "desired": self.desired[p.role], "metric": p.autoscale.metric, "target": p.autoscale.target,
                       "health_path": p.health_path, "metrics_path": p.metrics_path,
                       "replicas": [rep(r) for r in sorted(self.pool_replicas(p.role), key=lambda r: r.index)]}
                      for p in self.plan.pools],
            "events": list(self.events)[-50:],
        }

    def _save_state(self, now: float, force: bool = False) -> None:
        snap = self.snapshot()
        key = repr(snap)
        if force or self._last_state is None or key != self._last_state[0] or \
                now - self._last_state[1] >= self.options.state_interval_s:
            write_json_atomic(self.folder / STATE_FILE, {**snap, "updated_at": time.time()})
            self._last_state = (key, now)

    # ------------------------------------------------------------------ run / stop
    async def run(self, stop: asyncio.Event) -> None:
        """Start the fleet and supervise it until ``stop`` is set, then stop everything."""
        client = None
        if self.http_get is None:
            client = httpx.AsyncClient(trust_env=False)

            async def get(url: str, timeout: float) -> tuple[int, str]:
                r = await client.get(url, timeout=timeout)
                return r.status_code, r.text

            self.http_get = get
        try:
            await self.start()
            while not stop.is_set():
                try:
                    await self.tick()
                except Exception:  # keep supervising: one bad round must not orphan the fleet
                    logger.exception("supervisor tick failed")
                try:
                    await asyncio.wait_for(stop.wait(), self.options.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.shutdown()
            if client is not None:
                await client.aclose()

    async def shutdown(self) -> None:
        """SIGTERM the router and every replica, SIGKILL those still running after
        ``stop_timeout_s``, and remove ``state.json``."""
        self.event("stopping the fleet")
        procs = [r for r in [self.router, *self.replicas] if r.proc is not None]
        for r in procs:
            self._signal(r, signal.SIGTERM)
        deadline = time.monotonic() + self.options.stop_timeout_s
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in procs):
            await asyncio.sleep(0.1)
        for r in procs:
            if r.proc.poll() is None:
                self.event(f"{r.name} did not stop within {self.options.stop_timeout_s:g} s; SIGKILL",
                           logging.WARNING)
                self._kill(r)
        for r in procs:
            r.proc = None
        try:
            (self.folder / STATE_FILE).unlink()
        except FileNotFoundError:
            pass
        self.event("stopped")
