"""Gateway exposure (Gateway API + Gateway API Inference Extension): an InferencePool
(``inference.networking.k8s.io/v1``) of the serving pods and an HTTPRoute
(``gateway.networking.k8s.io/v1``) from the named Gateway.

With ``gateway.endpointPicker`` the route's backend is the InferencePool, whose endpoint picker
(an ext-proc service such as llm-d's inference scheduler) chooses a pod per request; without
one the route's backend is kvfleet's router Service, and the InferencePool still describes the
pods for GIE-aware tooling.
"""

from __future__ import annotations

from typing import Any

from kvfleet.control.api.components import GatewaySpec
from kvfleet.control.k8s.names import LABEL_SERVICE, LABEL_SERVING, entry_service_name, object_meta
from kvfleet.control.resolve import ResolvedService

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
HTTPROUTE_API = "gateway.networking.k8s.io/v1"
ROUTER_SERVICE_PORT = 80


def inference_pool(rs: ResolvedService, gw: GatewaySpec) -> dict[str, Any]:
    """The InferencePool of every serving engine pod of ``rs`` (prefill and decode pods alike)."""
    spec: dict[str, Any] = {"selector": {"matchLabels": {LABEL_SERVICE: rs.name, LABEL_SERVING: "true"}},
                            "targetPorts": [{"number": rs.runtime.spec.port}]}
    if gw.endpoint_picker is not None:
        ep = gw.endpoint_picker
        spec["endpointPickerRef"] = {"kind": "Service", "name": ep.name, "port": {"number": ep.port},
                                     "failureMode": ep.failure_mode}
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": object_meta(rs, rs.name, "inference-pool"), "spec": spec}


def http_route(rs: ResolvedService, gw: GatewaySpec) -> dict[str, Any]:
    """An HTTPRoute from the Gateway to the InferencePool (with a picker) or the router Service."""
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw.name}
    if gw.namespace:
        parent["namespace"] = gw.namespace
    if gw.section_name:
        parent["sectionName"] = gw.section_name
    if gw.endpoint_picker is not None:
        backend: dict[str, Any] = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": rs.name}
    else:
        backend = {"group": "", "kind": "Service", "name": entry_service_name(rs), "port": ROUTER_SERVICE_PORT}
    rule: dict[str, Any] = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [backend]}
    if gw.request_timeout:
        rule["timeouts"] = {"request": gw.request_timeout}
    spec: dict[str, Any] = {"parentRefs": [parent], "rules": [rule]}
    if gw.hostnames:
        spec["hostnames"] = list(gw.hostnames)
    return {"apiVersion": HTTPROUTE_API, "kind": "HTTPRoute", "metadata": object_meta(rs, rs.name, "route"),
            "spec": spec}
