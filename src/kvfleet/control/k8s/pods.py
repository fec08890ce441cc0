"""Engine pod templates: the engine container (command from the runtime template), probes on
``/health``, a preStop pause to drain, resources, volumes and init containers.

Probes: a startup probe gives model loading up to 30 minutes; after it, readiness (5 s period)
takes a replica out of Services and routers quickly and liveness (15 s period, 4 failures)
restarts a hung engine. The preStop ``sleep`` action (Kubernetes >= 1.30) keeps a stopping
replica serving for ``drainSeconds`` while endpoints update, then SIGTERM lets the engine finish
in-flight requests within ``terminationGracePeriodSeconds``.
"""

from __future__ import annotations

import copy
from typing import Any

from kvfleet.control.api.quantity import parse_quantity
from kvfleet.control.engine_args import Adapter, engine_command
from kvfleet.control.k8s.names import LABEL_LLMD_ROLE, LABEL_SERVING, labels
from kvfleet.control.k8s.storage import StoragePlan
from kvfleet.control.resolve import ResolvedPool, ResolvedService

GPU = "nvidia.com/gpu"
STARTUP_FAILURES = 180  # x 10 s = 30 minutes to load a model


def _raise_to(target: dict[str, str], key: str, value: str) -> None:
    if key not in target or parse_quantity(target[key]) < parse_quantity(value):
        target[key] = value


def engine_resources(rs: ResolvedService, pool: ResolvedPool) -> dict[str, Any]:
    """The pool's resources, else the runtime's defaults raised to the model's hints
    (memory request, GPU limit)."""
    if pool.spec.resources is not None:
        return pool.spec.resources.to_dict()
    base = rs.runtime.spec.resources.to_dict() if rs.runtime.spec.resources else {}
    out = {"requests": dict(base.get("requests", {})), "limits": dict(base.get("limits", {}))}
    hints = rs.model.spec.resources
    if hints is not None:
        if hints.memory:
            _raise_to(out["requests"], "memory", hints.memory)
            if "memory" in out["limits"]:
                _raise_to(out["limits"], "memory", hints.memory)
        if hints.gpus:
            _raise_to(out["limits"], GPU, str(hints.gpus))
    return {k: v for k, v in out.items() if v}


def _probe(port: str, path: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def engine_container(rs: ResolvedService, pool: ResolvedPool, role: str, plan: StoragePlan,
                     image: str | None) -> dict[str, Any]:
    """The engine container of one pool pod; ``role`` is ``engine``, ``prefill``, ``decode``,
    ``leader`` or ``worker`` (workers serve no HTTP, so they get no port or probes).

    Raises:
        SpecError: an engine arg the runtime has no flag for.
    """
    rt = rs.runtime.spec
    cmd = engine_command(rt, model_path=plan.model_path, served_model_name=rs.served_model_name,
                         engine_args=pool.spec.engine_args, role=role,
                         adapters=[Adapter(n, p, r) for n, p, r in plan.adapter_paths],
                         group_size=pool.group_size, field=f"{pool.field}.engineArgs",
                         runtime_name=f"runtime {rs.runtime.metadata.name!r}")
    c: dict[str, Any] = {"name": "engine", "image": pool.spec.image or image or rt.image, "command": cmd.command}
    if cmd.args:
        c["args"] = cmd.args
    env = [e.to_dict() for e in (*rt.env, *pool.spec.env)]
    if env:
        c["env"] = env
    res = engine_resources(rs, pool)
    if res:
        c["resources"] = res
    mounts = copy.deepcopy(plan.mounts)
    if rt.shared_memory:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if mounts:
        c["volumeMounts"] = mounts
    if role != "worker":
        c["ports"] = [{"name": "http", "containerPort": rt.port, "protocol": "TCP"}]
        c["startupProbe"] = _probe("http", rt.health_path, 10, STARTUP_FAILURES)
        c["readinessProbe"] = _probe("http", rt.health_path, 5, 3)
        c["livenessProbe"] = _probe("http", rt.health_path, 15, 4, timeout=5)
    if pool.spec.drain_seconds > 0:
        c["lifecycle"] = {"preStop": {"sleep": {"seconds": pool.spec.drain_seconds}}}
    return c


def pod_labels(rs: ResolvedService, pool: ResolvedPool, serving: bool) -> dict[str, str]:
    """Labels of a pool's pods."""
    out = labels(rs, pool.role)
    if serving:
        out[LABEL_SERVING] = "true"
    if pool.role in ("prefill", "decode"):
        out[LABEL_LLMD_ROLE] = pool.role
    return out


def engine_pod_template(rs: ResolvedService, pool: ResolvedPool, role: str, plan: StoragePlan,
                        image: str | None) -> dict[str, Any]:
    """A ``PodTemplateSpec`` for ``pool`` in ``role`` (see :func:`engine_container`)."""
    rt = rs.runtime.spec
    serving = role != "worker"
    meta: dict[str, Any] = {"labels": pod_labels(rs, pool, serving)}
    if serving:
        meta["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(rt.port),
                               "prometheus.io/path": rt.metrics_path}
    volumes = copy.deepcopy(plan.volumes)
    if rt.shared_memory:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": rt.shared_memory}})
    spec: dict[str, Any] = {
        "enableServiceLinks": False,  # Service env vars (e.g. VLLM_PORT from a Service named vllm) confuse engines
        "terminationGracePeriodSeconds": pool.spec.termination_grace_period_seconds,
        "containers": [engine_container(rs, pool, role, plan, image)],
    }
    if plan.init_containers:
        spec["initContainers"] = copy.deepcopy(plan.init_containers)
    if volumes:
        spec["volumes"] = volumes
    if pool.spec.node_selector:
        spec["nodeSelector"] = dict(pool.spec.node_selector)
    if pool.spec.tolerations:
        spec["tolerations"] = [t.to_dict() for t in pool.spec.tolerations]
    return {"metadata": meta, "spec": spec}
