"""``kvfleet up`` / ``kvfleet status`` / ``kvfleet down``: run an InferenceService spec as a local
fleet of processes (see :mod:`kvfleet.control.local`).

``kvfleet up -f service.yaml`` reads the same documents as ``kvfleet render`` (an
InferenceService plus BaseModel / ServingRuntime / FineTunedWeight documents; the built-in
runtimes are always there), checks the model's sha256, starts the router on ``--port`` and the
engine replicas on free ports, and supervises them in the foreground until Ctrl-C or ``kvfleet
down`` (``--detach``: in the background, returning once the fleet is ready). A spec that cannot
run locally exits with status 2 and one line naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvfleet.cli import ExampleHelpFormatter
from kvfleet.control.cli import read_spec_files

UP_EXAMPLES = """examples:
  kvfleet up -f examples/standard-smollm2.yaml                 # foreground; Ctrl-C stops the fleet
  kvfleet up -f examples/standard-smollm2.yaml --detach --port 8080
  kvfleet up -f examples/serverless-smollm2.yaml               # scale to zero: the first request starts a replica
  kvfleet up -f examples/pd-smollm2.yaml                       # prefill/decode pools, KV transfer between them
  kvfleet status
  kvfleet down smollm2-chat
"""


def _quiet_http_logs() -> None:
    """httpx logs every request at INFO: the supervisor's probes would flood the log."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def add_up_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet up``."""
    from kvfleet.cli import non_negative_float, port_number, positive_float

    p = sub.add_parser(
        "up", help="run an InferenceService spec as local processes (engines, router, supervisor)",
        description="Run an InferenceService on this machine: engine replicas (prefill and decode pools for "
                    "PrefillDecodeDisaggregated) as `kvfleet serve` processes (or the runtime's engine), the "
                    "router in front on --port, and a supervisor that restarts crashed replicas with exponential "
                    "back-off, autoscales each pool between minReplicas and maxReplicas on the queue metric "
                    "(the policy the KEDA rendering encodes), drains replicas before stopping them, and scales "
                    "to zero and back (the router holds requests while a replica starts). Runs in the "
                    "foreground until Ctrl-C (or `kvfleet down`); --detach runs it in the background.",
        epilog=UP_EXAMPLES, formatter_class=ExampleHelpFormatter)
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                   help="multi-document YAML of kvfleet.io/v1alpha1 resources ('-' = stdin; repeatable)")
    p.add_argument("--service", default=None, metavar="NAME",
                   help="the InferenceService to run when the documents hold several")
    p.add_argument("-n", "--namespace", default="default", help="namespace of documents that name none")
    p.add_argument("--port", type=port_number, default=8000, help="the router's port (the fleet's address)")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address (engines bind 127.0.0.1)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="the fleet's state folder (default: ~/.cache/kvfleet/fleet/NAME, under $KVFLEET_CACHE_DIR "
                        "when set)")
    p.add_argument("--detach", action="store_true",
                   help="run the supervisor in the background and return once the fleet is ready")
    p.add_argument("--hold-timeout", type=positive_float, default=120.0, metavar="SECONDS",
                   help="how long the router holds a request while no replica is ready (scale from zero, restarts)")
    p.add_argument("--scale-down-window", type=non_negative_float, default=None, metavar="SECONDS",
                   help="scale-down stabilization window (default: 300, as rendered for KEDA / HPA)")
    p.add_argument("--restart-backoff", type=positive_float, default=1.0, metavar="SECONDS",
                   help="first restart delay of a crashed replica; doubles per crash in a row, at most "
                        "--max-restart-backoff")
    p.add_argument("--max-restart-backoff", type=positive_float, default=60.0, metavar="SECONDS",
                   help="longest restart delay")
    p.add_argument("--start-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                   help="a replica not healthy this long after starting is killed and restarted")
    p.add_argument("--wait-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="with --detach: how long to wait for the fleet to be ready")
    p.add_argument("--pvc-root", default=None, metavar="DIR",
                   help="folder standing for PersistentVolumeClaims: pvc://CLAIM/PATH is DIR/CLAIM/PATH (default: "
                        "$KVFLEET_PVC_ROOT, else ~/.cache/kvfleet/pvc)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the sha256 check of the model (default: check)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="the supervisor's logging level")
    p.set_defaults(func=run_up, _parser=p)
    return p


def add_status_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet status``."""
    p = sub.add_parser(
        "status", help="show local fleets: pools, replicas, health, load, KV usage, prefix hit rate",
        description="Show a local fleet started by `kvfleet up` (every fleet when no NAME is given): the router "
                    "URL, each pool's replica bounds and desired size, and per replica its state, pid, port, "
                    "health, running and waiting requests, KV cache usage and prefix-cache hit rate (read live "
                    "from its /health and /metrics), then recent supervisor events.",
        formatter_class=ExampleHelpFormatter)
    p.add_argument("name", nargs="?", default=None, help="the fleet (its InferenceService's name)")
    p.add_argument("--state-dir", default=None, metavar="DIR", help="the fleet's state folder (as given to up)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    p.set_defaults(func=run_status, _parser=p)
    return p


def add_down_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet down``."""
    from kvfleet.cli import positive_float

    p = sub.add_parser(
        "down", help="stop a local fleet (supervisor, router and every replica)",
        description="Stop a local fleet started by `kvfleet up`: its supervisor stops the router and every "
                    "replica (SIGTERM, then SIGKILL after a grace period). Processes left by a supervisor that "
                    "died are stopped too. Logs stay in the state folder.",
        formatter_class=ExampleHelpFormatter)
    p.add_argument("name", nargs="?", default=None,
                   help="the fleet (its InferenceService's name); optional when only one runs")
    p.add_argument("--state-dir", default=None, metavar="DIR", help="the fleet's state folder (as given to up)")
    p.add_argument("--all", action="store_true", help="stop every local fleet")
    p.add_argument("--timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the supervisor to stop everything before killing what is left")
    p.set_defaults(func=run_down, _parser=p)
    return p


# --------------------------------------------------------------------------- up


def _pick_service(catalog: Any, name: str | None) -> Any:
    from kvfleet.control.api import SpecError

    services = catalog.inference_services()
    if not services:
        raise SpecError("kind", "no InferenceService among the documents")
    if name is not None:
        found = [s for s in services if s.metadata.name == name]
        if not found:
            raise SpecError("metadata.name", f"no InferenceService {name!r} (found: "
                                             f"{', '.join(s.metadata.name for s in services)})")
        return found[0]
    if len(services) > 1:
        raise SpecError("", f"the documents hold {len(services)} InferenceServices "
                            f"({', '.join(s.metadata.name for s in services)}); choose one with --service")
    return services[0]


def _clean_stale(folder: Path, state: dict[str, Any]) -> list[int]:
    """Stop processes recorded by a supervisor that is gone; returns their pids."""
    from kvfleet.control.local.state import STATE_FILE, is_recorded_process, stop_pids

    recorded = [state.get("router", {})] + [r for p in state.get("pools", []) for r in p.get("replicas", [])]
    pids = [r["pid"] for r in recorded if r.get("pid") and is_recorded_process(r["pid"], r.get("argv"))]
    stop_pids(pids, timeout_s=10.0)
    try:
        (folder / STATE_FILE).unlink()
    except FileNotFoundError:
        pass
    return pids


def _supervisor_alive(state: dict[str, Any]) -> bool:
    from kvfleet.control.local.state import is_recorded_process

    sup = state.get("supervisor", {})
    return is_recorded_process(sup.get("pid"), sup.get("argv"))


def run_up(args: argparse.Namespace) -> int:
    """Run ``kvfleet up``; returns 0 after a clean stop, 2 with a one-line error on a spec or
    setup problem, 1 when a detached fleet does not become ready."""
    from kvfleet.control.api import Catalog, SpecError
    from kvfleet.control.local.plan import plan_fleet
    from kvfleet.control.local.state import SPEC_FILE, FleetError, check_port_free, fleet_dir, free_port, read_state
    from kvfleet.control.resolve import resolve

    _quiet_http_logs()
    try:
        text = read_spec_files(args.filename)
        catalog = Catalog.from_yaml(text, default_namespace=args.namespace)
        svc = _pick_service(catalog, args.service)
        rs = resolve(svc, catalog)
        if getattr(args, "pvc_root", None):  # read by kvfleet.control.local.models (and a --detach child)
            os.environ["KVFLEET_PVC_ROOT"] = str(Path(args.pvc_root).expanduser().resolve())
        plan = plan_fleet(rs, verify=args.verify, scale_down_window_s=args.scale_down_window)
        folder = fleet_dir(rs.name, args.state_dir).resolve()
        old = read_state(folder)
        if old is not None and _supervisor_alive(old):
            raise FleetError(f"fleet {rs.name!r} is already running (supervisor pid {old['supervisor']['pid']}, "
                             f"{old.get('url')}); stop it with: kvfleet down {rs.name}")
        if args.port == 0:
            args.port = free_port(args.host)
        check_port_free(args.host, args.port)
        if old is not None:
            pids = _clean_stale(folder, old)
            if pids:
                print(f"kvfleet up: stopped {len(pids)} processes left by a previous supervisor of {rs.name!r}",
                      file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SPEC_FILE).write_text(text)
    except (SpecError, FleetError, OSError, UnicodeDecodeError) as e:
        print(f"kvfleet up: error: {e}", file=sys.stderr)
        return 2
    if args.detach:
        return _detach(args, folder, rs.name)
    return _foreground(args, plan, folder)


def _foreground(args: argparse.Namespace, plan: Any, folder: Path) -> int:
    from kvfleet.control.local.state import SPEC_FILE
    from kvfleet.control.local.supervisor import Supervisor, SupervisorOptions

    options = SupervisorOptions(hold_s=args.hold_timeout, backoff_base_s=args.restart_backoff,
                                backoff_max_s=max(args.max_restart_backoff, args.restart_backoff),
                                start_timeout_s=args.start_timeout)
    meta = {"namespace": plan.rs.namespace, "spec_file": str(folder / SPEC_FILE), "state_dir": str(folder),
            "started_at": time.time()}
    sup = Supervisor(plan, folder, port=args.port, host=args.host, options=options, meta=meta)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        await sup.run(stop)

    asyncio.run(main())
    return 0


def _detach(args: argparse.Namespace, folder: Path, name: str) -> int:
    from kvfleet.control.local.state import LOG_DIR, SPEC_FILE, read_state

    argv = [sys.executable, "-m", "kvfleet", "up", "-f", str(folder / SPEC_FILE), "--service", name,
            "-n", args.namespace, "--port", str(args.port), "--host", args.host, "--state-dir", str(folder),
            "--hold-timeout", f"{args.hold_timeout:g}", "--restart-backoff", f"{args.restart_backoff:g}",
            "--max-restart-backoff", f"{args.max_restart_backoff:g}", "--start-timeout", f"{args.start_timeout:g}",
            "--log-level", args.log_level]
    if args.scale_down_window is not None:
        argv += ["--scale-down-window", f"{args.scale_down_window:g}"]
    if not args.verify:
        argv.append("--no-verify")
    log = folder / LOG_DIR / "supervisor.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + args.wait_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            print(f"kvfleet up: the supervisor exited ({proc.returncode}); {log}:\n{tail}", file=sys.stderr)
            return 1
        st = read_state(folder)
        if st is not None and st.get("ready") and st.get("supervisor", {}).get("pid") == proc.pid:
            print(f"fleet {name} is up: {st['url']}/v1  (supervisor pid {proc.pid}; kvfleet status {name}; "
                  f"kvfleet down {name}; logs in {folder / LOG_DIR})")
            return 0
        time.sleep(0.25)
    print(f"kvfleet up: fleet {name} is not ready after {args.wait_timeout:g} s; it keeps starting in the "
          f"background (kvfleet status {name}; logs in {folder / LOG_DIR})", file=sys.stderr)
    return 1


# --------------------------------------------------------------------------- status / down


def _targets(name: str | None, state_dir: str | None) -> list[tuple[str, Path]]:
    from kvfleet.control.local.state import fleet_dir, list_fleets

    if state_dir or name:
        folder = fleet_dir(name or "", state_dir)
        return [(name or folder.name, folder)]
    return list_fleets()


def run_status(args: argparse.Namespace) -> int:
    """Run ``kvfleet status``; 0, or 1 when no fleet is found."""
    from kvfleet.control.local.state import read_state
    from kvfleet.control.local.status import format_status, live_status

    _quiet_http_logs()
    found = []
    for name, folder in _targets(args.name, args.state_dir):
        st = read_state(folder)
        if st is not None:
            found.append(live_status(st))
        elif args.name or args.state_dir:
            print(f"kvfleet status: no local fleet {name!r} is running (no {folder / 'state.json'})", file=sys.stderr)
            return 1
    if not found:
        print("kvfleet status: no local fleet is running", file=sys.stderr)
        return 1
    if args.output == "json":
        sys.stdout.write(json.dumps(found if len(found) > 1 else found[0], indent=2) + "\n")
    else:
        sys.stdout.write("\n\n".join(format_status(s) for s in found) + "\n")
    return 0


def stop_fleet(folder: Path, timeout_s: float = 60.0) -> str:
    """Stop the fleet whose state is in ``folder``: SIGTERM its supervisor and wait for it to stop
    everything; then stop any recorded process still running (a supervisor that died).

    Returns:
        A one-line summary.

    Raises:
        FleetError: no fleet state in ``folder``.
    """
    from kvfleet.control.local.state import FleetError, pid_alive, read_state

    st = read_state(folder)
    if st is None:
        raise FleetError(f"no local fleet is running from {folder}")
    sup = st.get("supervisor", {}).get("pid")
    how = "stopped"
    if _supervisor_alive(st):
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and pid_alive(sup):
            time.sleep(0.1)
        if pid_alive(sup):
            os.kill(sup, signal.SIGKILL)
            how = f"killed (supervisor did not stop within {timeout_s:g} s)"
    else:
        how = "cleaned up (its supervisor was not running)"
    left = _clean_stale(folder, st)
    if left:
        how += f"; {len(left)} leftover processes stopped"
    return f"fleet {st.get('name')} {how}"


def run_down(args: argparse.Namespace) -> int:
    """Run ``kvfleet down``; 0, 1 when no fleet is found, 2 when the choice is ambiguous."""
    from kvfleet.control.local.state import FleetError

    targets = _targets(args.name, args.state_dir)
    if not targets:
        print("kvfleet down: no local fleet is running", file=sys.stderr)
        return 1
    if len(targets) > 1 and not args.all:
        print("kvfleet down: several fleets are running (" + ", ".join(n for n, _ in targets)
              + "); name one or give --all", file=sys.stderr)
        return 2
    status = 0
    for _, folder in targets:
        try:
            print(stop_fleet(folder, args.timeout))
        except FleetError as e:
            print(f"kvfleet down: {e}", file=sys.stderr)
            status = 1
    return status
