"""Pool autoscaling: a KEDA ScaledObject per autoscaled pool with a Prometheus trigger on the
engine's queue (``vllm:num_requests_waiting`` by default, translated per runtime), or a
``autoscaling/v2`` HorizontalPodAutoscaler on the same per-pod metric when KEDA is off (the metric
must then be served by a custom-metrics adapter such as prometheus-adapter).

Serverless pools scale to zero with KEDA: ``minReplicaCount: 0`` and ``cooldownPeriod`` =
``idleTimeoutSeconds``. While no engine runs there is no engine metric, so a second trigger on
the router's request and ``no_endpoint`` rejection rates activates the pool (KServe's activator
role); its huge threshold means it only ever asks for the first replica.
"""

from __future__ import annotations

from typing import Any

from kvfleet.control.api.errors import SpecError
from kvfleet.control.autoscale import SCALE_DOWN_WINDOW_S  # the local supervisor's policy uses it too
from kvfleet.control.k8s.names import object_meta, pool_name, router_name
from kvfleet.control.k8s.workloads import LWS_API
from kvfleet.control.resolve import ResolvedPool, ResolvedService

#: threshold of the activation-only trigger: requests/s per replica it would take to ask for a
#: second replica (never reached), so it only lifts a pool from zero.
ACTIVATION_ONLY_THRESHOLD = "1000000"


def _target(rs: ResolvedService, pool: ResolvedPool) -> dict[str, str]:
    kind = "LeaderWorkerSet" if rs.mode == "MultiNode" else "Deployment"
    return {"apiVersion": LWS_API if kind == "LeaderWorkerSet" else "apps/v1", "kind": kind,
            "name": pool_name(rs, pool.role)}


def _number(v: float) -> str:
    return f"{v:g}"


def engine_metric(rs: ResolvedService) -> str:
    """The runtime's name of the autoscaling metric."""
    return rs.runtime.spec.metric(rs.service.spec.autoscaling.metric)


def default_query(rs: ResolvedService, pool: ResolvedPool) -> str:
    """``sum(METRIC{namespace="NS",pod=~"POOL-.*"})``: the pool's total of the metric."""
    return f'sum({engine_metric(rs)}{{namespace="{rs.namespace}",pod=~"{pool_name(rs, pool.role)}-.*"}})'


def router_activity_query(rs: ResolvedService) -> str:
    """Requests per second reaching the router, answered or rejected for want of an engine."""
    sel = f'namespace="{rs.namespace}",pod=~"{router_name(rs)}-.*"'
    return (f"sum(rate(kvfleet_router_requests_total{{{sel}}}[2m])) + "
            f'sum(rate(kvfleet_router_rejected_total{{{sel},reason="no_endpoint"}}[2m]))')


def scaled_object(rs: ResolvedService, pool: ResolvedPool, prometheus_url: str) -> dict[str, Any]:
    """A KEDA ``keda.sh/v1alpha1`` ScaledObject for ``pool``."""
    auto = rs.service.spec.autoscaling
    server = auto.prometheus_address or prometheus_url
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus", "name": "engine-queue",
        "metadata": {"serverAddress": server, "query": auto.query or default_query(rs, pool),
                     "threshold": _number(auto.target), "activationThreshold": "0"}}]
    serverless = pool.min_replicas == 0
    if serverless:
        triggers.append({"type": "prometheus", "name": "router-activity",
                         "metadata": {"serverAddress": server, "query": router_activity_query(rs),
                                      "threshold": ACTIVATION_ONLY_THRESHOLD, "activationThreshold": "0"}})
    spec: dict[str, Any] = {
        "scaleTargetRef": _target(rs, pool),
        "pollingInterval": auto.polling_interval_seconds,
        "cooldownPeriod": auto.idle_timeout_seconds if serverless else SCALE_DOWN_WINDOW_S,
        "minReplicaCount": pool.min_replicas,
        "maxReplicaCount": pool.max_replicas,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S}}}},
        "triggers": triggers,
    }
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": object_meta(rs, pool_name(rs, pool.role), pool.role), "spec": spec}


def _quantity(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{round(v * 1000)}m"


def hpa(rs: ResolvedService, pool: ResolvedPool) -> dict[str, Any]:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler on the per-pod average of the metric.

    Raises:
        SpecError: the pool must scale to zero (an HPA cannot).
    """
    if pool.min_replicas == 0:
        raise SpecError(f"{pool.field}.minReplicas", "scaling to zero (Serverless) needs KEDA; an HPA keeps "
                                                     "at least one replica")
    auto = rs.service.spec.autoscaling
    spec = {
        "scaleTargetRef": _target(rs, pool),
        "minReplicas": pool.min_replicas,
        "maxReplicas": pool.max_replicas,
        "metrics": [{"type": "Pods", "pods": {"metric": {"name": engine_metric(rs)},
                                              "target": {"type": "AverageValue",
                                                         "averageValue": _quantity(auto.target)}}}],
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S}},
    }
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": object_meta(rs, pool_name(rs, pool.role), pool.role), "spec": spec}


def router_hpa(rs: ResolvedService, cpu_utilization: int = 70) -> dict[str, Any]:
    """An HPA scaling the router Deployment on CPU utilization."""
    r = rs.router
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": object_meta(rs, router_name(rs), "router"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": router_name(rs)},
                     "minReplicas": r.min_replicas, "maxReplicas": r.max_replicas or r.min_replicas,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                         "type": "Utilization", "averageUtilization": cpu_utilization}}}]}}
