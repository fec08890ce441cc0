"""What ``kvfleet up`` will run for a resolved InferenceService: per pool, the engine command line
of one replica (from the runtime's template through :func:`~kvfleet.control.engine_args.engine_command`,
the same function the Kubernetes rendering uses), its environment and autoscaling policy; and
the router's command line.

Local adjustments to the runtime's template: ``kvfleet ...`` runs as ``python -m kvfleet ...``
with this interpreter (no need for the console script on ``PATH``), engines bind ``127.0.0.1``
(the template's ``--host 0.0.0.0`` is for pods), and each replica gets a free port.

PrefillDecodeDisaggregated runs as on Kubernetes: a prefill pool, a decode pool, and the router
in P/D mode (``--prefill-endpoints-file`` for the prefill pool, ``--endpoints-file`` for the
decode pool), which sends each request's prefill to a prefill replica and the request to a decode
replica that pulls the prompt's KV from it (:mod:`kvfleet.router.pd`,
:mod:`kvfleet.engine.kv_transfer`).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.control.api.errors import SpecError
from kvfleet.control.autoscale import AutoscaleConfig
from kvfleet.control.engine_args import Adapter, engine_command
from kvfleet.control.local.models import local_model_path
from kvfleet.control.resolve import ResolvedPool, ResolvedService


def local_argv(argv: list[str]) -> list[str]:
    """Adapt a container command line to a local process: ``kvfleet`` -> ``python -m kvfleet``
    (this interpreter), and a ``--host`` value -> ``127.0.0.1``."""
    out = list(argv)
    if out and out[0] == "kvfleet":
        out[:1] = [sys.executable, "-m", "kvfleet"]
    for i, a in enumerate(out[:-1]):
        if a == "--host":
            out[i + 1] = "127.0.0.1"
    return out


@dataclass(frozen=True)
class PoolPlan:
    """One engine pool as local processes.

    Attributes:
        role: ``engine``, ``prefill`` or ``decode``.
        pool: the resolved pool (bounds, spec).
        autoscale: the pool's autoscaling policy.
        argv_template: the replica command line with ``{port}`` where the port goes.
        env: extra environment of each replica (runtime's, then the pool's).
        health_path, metrics_path: the runtime's HTTP paths.
        drain_timeout_s: most seconds a replica being scaled away may take to finish its
            requests before SIGTERM (the pool's ``terminationGracePeriodSeconds``).
    """

    role: str
    pool: ResolvedPool
    autoscale: AutoscaleConfig
    argv_template: tuple[str, ...]
    env: dict[str, str]
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    drain_timeout_s: float = 120.0

    @property
    def min_replicas(self) -> int:
        """Fewest replicas."""
        return self.pool.min_replicas

    @property
    def max_replicas(self) -> int:
        """Most replicas."""
        return self.pool.max_replicas

    def argv(self, port: int) -> list[str]:
        """The command line of a replica listening on ``port``."""
        return [a.replace("{port}", str(port)) for a in self.argv_template]


@dataclass(frozen=True)
class FleetPlan:
    """A resolved InferenceService as local processes.

    Attributes:
        rs: the resolved service.
        model_path: the verified weights on this machine.
        pools: the engine pools (``engine``; or ``prefill`` then ``decode``).
        router_flags: ``kvfleet router`` flags from ``spec.router`` (policy or scorers, extra args).
        notes: lines ``kvfleet up`` logs at start (what runs differently from Kubernetes).
    """

    rs: ResolvedService
    model_path: Path
    pools: tuple[PoolPlan, ...]
    router_flags: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        """The InferenceService's name."""
        return self.rs.name

    @property
    def pd(self) -> bool:
        """True for a PrefillDecodeDisaggregated fleet (the router splits prefill and decode)."""
        return self.rs.mode == "PrefillDecodeDisaggregated"

    def router_argv(self, *, endpoints_file: Path, port: int, host: str = "127.0.0.1",
                    hold_s: float = 120.0, prefill_endpoints_file: Path | None = None) -> list[str]:
        """``kvfleet router`` reading ``endpoints_file`` (the decode pool of a P/D fleet, whose
        prefill pool is in ``prefill_endpoints_file``: the router then splits each request),
        holding requests up to ``hold_s`` seconds while no replica is ready (scale from zero,
        restarts).

        Raises:
            ValueError: a P/D fleet without ``prefill_endpoints_file``, or one given to another.
        """
        if self.pd != (prefill_endpoints_file is not None):
            raise ValueError("prefill_endpoints_file is required for, and only for, a PrefillDecodeDisaggregated fleet")
        pd = ["--prefill-endpoints-file", str(prefill_endpoints_file)] if prefill_endpoints_file is not None else []
        return [sys.executable, "-m", "kvfleet", "router", "--endpoints-file", str(endpoints_file), *pd,
                "--host", host, "--port", str(port), "--hold-when-empty", f"{hold_s:g}",
                "--queue-timeout", f"{max(hold_s, 30.0):g}", *self.router_flags]


def _router_flags(rs: ResolvedService) -> tuple[str, ...]:
    r = rs.router
    flags: list[str] = []
    if r.policy:
        flags += ["--policy", r.policy]
    for name, w in (r.scorers or {}).items():
        flags += ["--scorer", f"{name}:{w:g}"]
    return (*flags, *r.extra_args)


def _check_executable(argv: list[str], rs: ResolvedService) -> None:
    exe = argv[0]
    if os.path.isabs(exe) and os.access(exe, os.X_OK):
        return
    if shutil.which(exe) is None:
        raise SpecError("spec.runtime", f"runtime {rs.runtime.metadata.name!r} runs {exe!r}, which is not "
                                        "installed on this machine (the local fleet runs engines as processes; "
                                        "install it, or use the kvfleet runtime)", rs.service.ref)


def plan_fleet(rs: ResolvedService, *, cache: Path | None = None, verify: bool = True,
               scale_down_window_s: float | None = None) -> FleetPlan:
    """Plan the local processes of ``rs``: locate (or fetch) and verify the model and adapters,
    build each pool's replica command line, and the router's flags.

    Args:
        rs: the resolved service (:func:`kvfleet.control.resolve.resolve`).
        cache: kvfleet's cache folder for fetched models (default: ``kvfleet.model.registry.cache_dir()``).
        verify: check sha256 fingerprints.
        scale_down_window_s: override of the scale-down stabilization window (default: the
            rendering's, :data:`kvfleet.control.autoscale.SCALE_DOWN_WINDOW_S`).

    Raises:
        SpecError: MultiNode (needs Kubernetes), a source the local fleet cannot use, a sha256
            mismatch, a runtime whose executable is not installed, or an engine arg the runtime
            has no flag for.
    """
    if rs.mode == "MultiNode":
        raise SpecError("spec.engine.multiNode", "MultiNode needs Kubernetes (LeaderWorkerSet): one replica spans "
                                                 "several pods; use kvfleet render or the operator",
                        rs.service.ref)
    model_path = local_model_path(rs.model, cache, verify=verify)
    adapters = [Adapter(a.metadata.name, str(local_model_path(a, cache, verify=verify)), a.spec.rank)
                for a in rs.adapters]
    rt = rs.runtime
    env = {e.name: e.value for e in rt.spec.env}
    overrides = {} if scale_down_window_s is None else {"scale_down_window_s": float(scale_down_window_s)}
    notes: list[str] = []
    pools = []
    for pool in rs.pools:
        try:
            cmd = engine_command(rt.spec, model_path=str(model_path), served_model_name=rs.served_model_name,
                                 engine_args=pool.spec.engine_args, role=pool.role, adapters=adapters,
                                 port="{port}",  # type: ignore[arg-type]  # filled in per replica
                                 field=f"{pool.field}.engineArgs",
                                 runtime_name=f"runtime {rt.metadata.name!r}")
        except SpecError as e:
            raise e.with_resource(rs.service.ref) from None
        argv = local_argv(cmd.argv)
        _check_executable(argv, rs)
        pools.append(PoolPlan(
            role=pool.role, pool=pool, autoscale=AutoscaleConfig.for_pool(rs, pool, **overrides),
            argv_template=tuple(argv), env={**env, **{e.name: e.value for e in pool.spec.env}},
            health_path=rt.spec.health_path, metrics_path=rt.spec.metrics_path,
            drain_timeout_s=float(pool.spec.termination_grace_period_seconds)))
    if not rs.router.enabled:
        notes.append("spec.router.enabled is false, but the local fleet always runs its router (one address "
                     "for the replicas, requests held during restarts and scale from zero)")
    if rs.router.max_replicas and rs.router.max_replicas > 1 or rs.router.min_replicas > 1:
        notes.append("the local fleet runs one router process (spec.router replicas are for Kubernetes)")
    if rs.service.spec.autoscaling.query:
        notes.append("spec.autoscaling.query is PromQL for KEDA; the local fleet scales on the metric "
                     f"{pools[0].autoscale.metric} scraped from the engines")
    return FleetPlan(rs=rs, model_path=model_path, pools=tuple(pools), router_flags=_router_flags(rs),
                     notes=tuple(notes))
