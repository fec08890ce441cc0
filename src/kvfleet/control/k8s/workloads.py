"""Pool workloads: a Deployment per single-pod pool, a LeaderWorkerSet (LWS, kubernetes-sigs/lws)
per multi-node pool, their Services and PodDisruptionBudgets.

Rolling updates never take a serving replica down before its replacement is ready
(``maxUnavailable: 0``, ``maxSurge: 1``). An autoscaled workload leaves ``replicas`` unset so the
autoscaler owns it.
"""

from __future__ import annotations

from typing import Any

from kvfleet.control.k8s.names import (
    KUEUE_PRIORITY,
    KUEUE_QUEUE,
    LABEL_SERVING,
    object_meta,
    pool_name,
    pool_service_name,
    selector_labels,
)
from kvfleet.control.k8s.pods import engine_pod_template
from kvfleet.control.k8s.storage import StoragePlan
from kvfleet.control.resolve import ResolvedPool, ResolvedService

LWS_API = "leaderworkerset.x-k8s.io/v1"


def kueue_labels(queue: str | None, priority: str | None) -> dict[str, str]:
    """Kueue's queue-name and priority-class labels (empty without a queue)."""
    if not queue:
        return {}
    out = {KUEUE_QUEUE: queue}
    if priority:
        out[KUEUE_PRIORITY] = priority
    return out


def deployment(rs: ResolvedService, pool: ResolvedPool, plan: StoragePlan, image: str | None,
               kueue: dict[str, str]) -> dict[str, Any]:
    """An ``apps/v1`` Deployment of a single-pod pool."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(rs, pool.role)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 5,
        "template": engine_pod_template(rs, pool, pool.role, plan, image),
    }
    if not pool.autoscaled:
        spec = {"replicas": pool.min_replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": object_meta(rs, pool_name(rs, pool.role), pool.role, extra_labels=kueue), "spec": spec}


def leader_worker_set(rs: ResolvedService, pool: ResolvedPool, plan: StoragePlan, image: str | None,
                      kueue: dict[str, str]) -> dict[str, Any]:
    """A LeaderWorkerSet: each replica a group of ``multiNode.size`` pods (leader + workers); a
    failing pod restarts its whole group (``RecreateGroupOnPodRestart``)."""
    spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {"type": "RollingUpdate",
                            "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
        "leaderWorkerTemplate": {
            "size": pool.group_size,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": engine_pod_template(rs, pool, "leader", plan, image),
            "workerTemplate": engine_pod_template(rs, pool, "worker", plan, image),
        },
    }
    if not pool.autoscaled:
        spec = {"replicas": pool.min_replicas, **spec}
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
            "metadata": object_meta(rs, pool_name(rs, pool.role), pool.role, extra_labels=kueue), "spec": spec}


def serving_selector(rs: ResolvedService, role: str) -> dict[str, str]:
    """Labels of a pool's serving pods (Deployment replicas, LWS leaders)."""
    return {**selector_labels(rs, role), LABEL_SERVING: "true"}


def pool_service(rs: ResolvedService, pool: ResolvedPool) -> dict[str, Any]:
    """A ClusterIP Service in front of a pool's serving pods."""
    port = rs.runtime.spec.port
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(rs, pool_service_name(rs, pool.role), pool.role),
            "spec": {"type": "ClusterIP", "selector": serving_selector(rs, pool.role),
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def disruption_budget(rs: ResolvedService, name: str, component: str) -> dict[str, Any]:
    """A ``policy/v1`` PodDisruptionBudget: voluntary evictions take one pod at a time."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(rs, name, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(rs, component)}}}
