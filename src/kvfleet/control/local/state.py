"""Where a local fleet keeps its state, so that ``kvfleet status`` and ``kvfleet down`` (separate
invocations) find it: one folder per fleet, ``<cache>/fleet/<name>/`` by default (``<cache>`` is
``$KVFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvfleet``, else ``~/.cache/kvfleet``), holding

- ``state.json``: written by the supervisor (atomically) whenever something changes and every
  few seconds: supervisor pid, router URL / pid, every replica's pool, state, pid, port, restarts
  and log, recent events; removed when the fleet stops;
- ``endpoints.yaml``: the ready replicas' URLs, which the router watches (the decode pool of a
  PrefillDecodeDisaggregated fleet, whose prefill pool is in ``prefill-endpoints.yaml``);
- ``spec.yaml``: the documents the fleet was started from;
- ``logs/``: the supervisor's, the router's and each replica's output (appended across restarts).

Also the process helpers the supervisor and ``kvfleet down`` share.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
ENDPOINTS_FILE = "endpoints.yaml"
PREFILL_ENDPOINTS_FILE = "prefill-endpoints.yaml"
SPEC_FILE = "spec.yaml"
LOG_DIR = "logs"


class FleetError(RuntimeError):
    """A local-fleet operation that cannot proceed (already running, no such fleet, port in use)."""


def fleets_root() -> Path:
    """``<cache>/fleet``: the default parent of fleet folders."""
    from kvfleet.model.registry import cache_dir

    return cache_dir() / "fleet"


def fleet_dir(name: str, state_dir: str | os.PathLike | None = None) -> Path:
    """The folder of fleet ``name``: ``state_dir`` when given, else ``fleets_root() / name``."""
    return Path(state_dir) if state_dir else fleets_root() / name


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename (readers never
    see half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_state(folder: Path) -> dict[str, Any] | None:
    """The fleet's ``state.json``, or ``None`` when there is none (or it is unreadable)."""
    try:
        data = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def list_fleets(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(name, folder)`` of every fleet folder with a ``state.json`` under ``root``, by name."""
    root = root or fleets_root()
    if not root.is_dir():
        return []
    return sorted((p.name, p) for p in root.iterdir() if (p / STATE_FILE).is_file())


def pid_alive(pid: int | None) -> bool:
    """True when a process ``pid`` exists (and is not a zombie, where ``/proc`` tells)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


def cmdline(pid: int) -> list[str] | None:
    """The command line of ``pid`` from ``/proc`` (``None`` where unavailable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def is_recorded_process(pid: int | None, argv: list[str] | None) -> bool:
    """True when ``pid`` is alive and (where ``/proc`` tells) still runs ``argv``: a pid from a
    state file is only signalled while it is the process that was started (pids get reused)."""
    if not pid_alive(pid):
        return False
    actual = cmdline(pid)  # type: ignore[arg-type]
    return actual is None or not argv or actual == list(argv)


def stop_pids(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """SIGTERM each pid, wait up to ``timeout_s`` seconds for all to exit, then SIGKILL the rest.

    Returns:
        The pids that had to be killed.
    """
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    killed = [p for p in pids if pid_alive(p)]
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return killed


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bound to port 0, then closed)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`FleetError` when ``host:port`` cannot be bound now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise FleetError(f"cannot listen on {host}:{port} ({e.strerror}); give another --port") from None
