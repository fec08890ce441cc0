"""Many simulated engines in one process and one event loop.

Each engine is independent (its own :class:`~kvfleet.sim.engine.SimEngine`: scheduler, KV pool,
metrics registry; its own FastAPI app and ``uvicorn.Server`` on its own port), but all share one
asyncio loop, so 64 or 200 of them fit on a 2-core machine: an idle simulated engine costs a few
timers, a busy one a few Python calls per step and per HTTP chunk.

- :class:`SimFleet` (async): ``async with SimFleet(n) as fleet: fleet.urls`` on the caller's loop.
- :class:`SimFleetThread` (sync): the same on a background thread with its own loop, for code
  (tests, benchmarks) that is not async: ``with SimFleetThread(n) as fleet: fleet.urls``.

uvicorn's servers normally each install SIGINT / SIGTERM handlers; with many servers on one
loop only the last would see the signal. Here no server touches signals: the owner of the loop
(``kvfleet sim-engine``) installs one handler that stops the whole fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from types import TracebackType

import uvicorn

from kvfleet.sim.app import create_sim_app
from kvfleet.sim.engine import SimEngine, SimEngineConfig

logger = logging.getLogger(__name__)

#: seconds a stopping server waits for open connections before cancelling them.
GRACEFUL_SHUTDOWN_S = 3


class _SimServer(uvicorn.Server):
    """A ``uvicorn.Server`` that installs no signal handlers (the fleet handles signals once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the name in uvicorn releases before capture_signals
        pass


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """Bind ``count`` TCP sockets on ``host``: ports ``port .. port + count - 1``, or ``count`` free
    ports chosen by the OS when ``port`` is 0.

    Raises:
        ValueError: ``count < 1`` or ports past 65535.
        OSError: a port cannot be bound (in use, no permission); the message names it. Sockets
            already bound are closed.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if port and port + count - 1 > 65535:
        raise ValueError(f"ports {port}..{port + count - 1} go past 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[socket.socket] = []
    try:
        for i in range(count):
            p = port + i if port else 0
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, p))
            except OSError as e:
                raise OSError(e.errno, f"cannot bind {host}:{p}: {e.strerror}") from None
            sock.setblocking(False)
    except BaseException:
        for s in out:
            s.close()
        raise
    return out


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"http://{shown}:{port}"


class SimFleet:
    """``num_engines`` simulated engines served on the running event loop (async context manager).

    Args:
        num_engines: how many engines (each its own port).
        config: the :class:`SimEngineConfig` every engine gets (default: defaults).
        host: interface to bind.
        port: first port (engine ``i`` listens on ``port + i``); 0 = free ports chosen by the OS.
        uvicorn_log_level: level of uvicorn's own loggers (``warning`` keeps 64 servers quiet).

    Attributes:
        engines: the :class:`SimEngine` objects, in port order (named ``sim-0``, ``sim-1``, ...).
        urls: their base URLs (``http://host:port``, no ``/v1``), filled by :meth:`start`.
        ports: their ports.
    """

    def __init__(self, num_engines: int = 1, config: SimEngineConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, uvicorn_log_level: str = "warning") -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.config = config or SimEngineConfig()
        self.host = host
        self.port = port
        self.uvicorn_log_level = uvicorn_log_level
        self.engines: list[SimEngine] = []
        self.urls: list[str] = []
        self.ports: list[int] = []
        self._servers: list[_SimServer] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> list[str]:
        """Bind every port, start every engine and server; returns the base URLs once all accept
        connections.

        Raises:
            OSError: a port cannot be bound (nothing is left running).
            RuntimeError: a server failed to start (the others are stopped).
        """
        sockets = bind_sockets(self.host, self.port, self.num_engines)
        self.ports = [s.getsockname()[1] for s in sockets]
        self.urls = [_url(self.host, p) for p in self.ports]
        for i, sock in enumerate(sockets):
            engine = SimEngine(self.config, name=f"sim-{i}")
            engine.start()
            self.engines.append(engine)
            cfg = uvicorn.Config(create_sim_app(engine), log_config=None, log_level=self.uvicorn_log_level,
                                 access_log=False, lifespan="off", ws="none",
                                 timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
            server = _SimServer(cfg)
            self._servers.append(server)
            self._tasks.append(asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                                      name=f"kvfleet-sim-server-{i}"))
        while not all(s.started for s in self._servers):
            failed = [t for t in self._tasks if t.done()]
            if failed:
                await self.stop()
                exc = failed[0].exception() if not failed[0].cancelled() else None
                raise RuntimeError(f"a simulated engine's HTTP server failed to start: {exc!r}")
            await asyncio.sleep(0.01)
        logger.info("%d simulated engine(s) (kvfleet simulator, no model loaded) serving at %s", self.num_engines,
                    self.urls[0] if self.num_engines == 1 else f"{self.urls[0]} .. {self.urls[-1]}")
        return self.urls

    async def stop(self) -> None:
        """Stop accepting connections, end in-flight requests (``finish_reason = "abort"``), stop
        the engines and wait for the servers to finish. Idempotent."""
        for s in self._servers:
            s.should_exit = True
        await asyncio.gather(*(e.close() for e in self.engines))
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def force_exit(self) -> None:
        """Make stopping servers drop open connections at once (a second Ctrl-C)."""
        for s in self._servers:
            s.should_exit = s.force_exit = True

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class SimFleetThread:
    """A :class:`SimFleet` on a background thread with its own event loop (sync context manager).

    Args and attributes: as :class:`SimFleet` (``engines``, ``urls``, ``ports``). Read engine
    state from other threads only for diagnostics (it changes under you); use HTTP
    (``/metrics``) to observe an engine, or :meth:`call` to run a function on the loop.
    """

    def __init__(self, num_engines: int = 1, config: SimEngineConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, uvicorn_log_level: str = "warning") -> None:
        self.fleet = SimFleet(num_engines, config, host, port, uvicorn_log_level)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    @property
    def ports(self) -> list[int]:
        return self.fleet.ports

    @property
    def engines(self) -> list[SimEngine]:
        return self.fleet.engines

    def start(self, timeout: float = 30.0) -> list[str]:
        """Start the loop thread and the fleet; returns the base URLs.

        Raises:
            OSError, RuntimeError: from :meth:`SimFleet.start`.
            TimeoutError: not started within ``timeout`` seconds.
        """
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="kvfleet-sim-fleet", daemon=True)
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self.fleet.start(), loop).result(timeout)
        except BaseException:
            self._shutdown_loop()
            raise

    def call(self, fn, *args, timeout: float = 10.0):  # noqa: ANN001, ANN201 - any callable
        """Run ``fn(*args)`` on the fleet's loop thread and return its result."""
        assert self._loop is not None

        async def run():  # noqa: ANN202
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the fleet and the loop thread. Idempotent."""
        if self._loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self.fleet.stop(), self._loop).result(timeout)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> SimFleetThread:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
