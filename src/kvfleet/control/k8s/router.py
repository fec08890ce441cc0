"""The router component: ``kvfleet router`` discovering engine pods by label through the
Kubernetes API (its ServiceAccount may list and watch pods and EndpointSlices), the entry
Service named after the InferenceService, and their PodDisruptionBudget.

For prefill/decode disaggregation the router gets the prefill pool as ``--k8s-prefill-selector
LABELS`` and the decode pool as ``--k8s-decode-selector LABELS``: it sends each request's prefill to
a prefill pod, then the request to a decode pod with ``kv_transfer_params`` naming the prefill pod
(:mod:`kvfleet.router.pd`).
"""

from __future__ import annotations

from typing import Any

from kvfleet.control.k8s.gateway import ROUTER_SERVICE_PORT
from kvfleet.control.k8s.names import entry_service_name, object_meta, router_name, selector_labels, selector_string
from kvfleet.control.k8s.workloads import serving_selector
from kvfleet.control.resolve import ResolvedService

ROUTER_PORT = 8000
DEFAULT_ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
#: the router flags naming the prefill and decode pools in P/D mode.
PREFILL_SELECTOR_FLAG = "--k8s-prefill-selector"
DECODE_SELECTOR_FLAG = "--k8s-decode-selector"


def router_args(rs: ResolvedService) -> list[str]:
    """``kvfleet router`` arguments (after ``kvfleet router``)."""
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--k8s-namespace", rs.namespace,
            "--k8s-port", str(rs.runtime.spec.port)]
    if rs.mode == "PrefillDecodeDisaggregated":
        args += [PREFILL_SELECTOR_FLAG, selector_string(serving_selector(rs, "prefill")),
                 DECODE_SELECTOR_FLAG, selector_string(serving_selector(rs, "decode"))]
    else:
        args += ["--k8s-selector", selector_string(serving_selector(rs, "engine"))]
    r = rs.router
    if r.scorers:
        for name, weight in r.scorers.items():
            args += ["--scorer", f"{name}:{weight:g}"]
    elif r.policy:
        args += ["--policy", r.policy]
    return args + list(r.extra_args)


def rbac(rs: ResolvedService) -> list[dict[str, Any]]:
    """ServiceAccount, Role (pods and EndpointSlices: get/list/watch) and RoleBinding of the router."""
    name = router_name(rs)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(rs, name, "router")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": object_meta(rs, name, "router"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": object_meta(rs, name, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": rs.namespace}]},
    ]


def router_deployment(rs: ResolvedService, image: str) -> dict[str, Any]:
    """The router Deployment. Its probes use ``/metrics`` (the router's ``/health`` is 503 while no
    engine is healthy, which must not restart the router or hide it while a pool scales from zero)."""
    r = rs.router
    probe = {"httpGet": {"path": "/metrics", "port": "http"}, "timeoutSeconds": 3}
    container = {
        "name": "router", "image": r.image or image, "command": ["kvfleet", "router"], "args": router_args(rs),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": r.resources.to_dict() if r.resources else DEFAULT_ROUTER_RESOURCES,
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4},
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
    }
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(rs, "router")},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "revisionHistoryLimit": 5,
        "template": {"metadata": {"labels": object_meta(rs, "x", "router")["labels"],
                                  "annotations": {"prometheus.io/scrape": "true",
                                                  "prometheus.io/port": str(ROUTER_PORT),
                                                  "prometheus.io/path": "/metrics"}},
                     "spec": {"serviceAccountName": router_name(rs), "enableServiceLinks": False,
                              "terminationGracePeriodSeconds": 60, "containers": [container]}},
    }
    if not (r.max_replicas and r.max_replicas > r.min_replicas):
        spec = {"replicas": r.min_replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(rs, router_name(rs), "router"),
            "spec": spec}


def entry_service(rs: ResolvedService) -> dict[str, Any]:
    """The Service clients use (port 80): the router, or the engine pool when the router is off."""
    selector = selector_labels(rs, "router") if rs.router.enabled else serving_selector(rs, "engine")
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(rs, entry_service_name(rs), "entry"),
            "spec": {"type": "ClusterIP", "selector": selector,
                     "ports": [{"name": "http", "port": ROUTER_SERVICE_PORT, "targetPort": "http",
                                "protocol": "TCP"}]}}
