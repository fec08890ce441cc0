"""Names, labels, selectors and owner references of the objects rendered for an InferenceService.

Labels follow the Kubernetes recommended ``app.kubernetes.io/*`` set plus kvfleet's own:
``kvfleet.io/inference-service`` and ``kvfleet.io/component`` select a pool's pods,
``kvfleet.io/serving: "true"`` marks pods that answer the OpenAI API (Deployment replicas and
LeaderWorkerSet leaders), and prefill/decode pods also carry llm-d's ``llm-d.ai/role``.
"""

from __future__ import annotations

from typing import Any

from kvfleet import __version__
from kvfleet.control.api.common import API_VERSION
from kvfleet.control.resolve import ResolvedService

LABEL_SERVICE = "kvfleet.io/inference-service"
LABEL_COMPONENT = "kvfleet.io/component"
LABEL_SERVING = "kvfleet.io/serving"
LABEL_MODEL = "kvfleet.io/model"
LABEL_RUNTIME = "kvfleet.io/runtime"
LABEL_LLMD_ROLE = "llm-d.ai/role"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"


def pool_name(rs: ResolvedService, role: str) -> str:
    """Workload name of a pool (``NAME-engine``, ``NAME-prefill``, ``NAME-decode``)."""
    return f"{rs.name}-{role}"


def pool_service_name(rs: ResolvedService, role: str) -> str:
    """Service of a pool; a LeaderWorkerSet already owns a headless Service of its own name, so
    the leaders' Service is ``NAME-engine-leader``."""
    return f"{rs.name}-{role}-leader" if rs.mode == "MultiNode" else f"{rs.name}-{role}"


def router_name(rs: ResolvedService) -> str:
    """Router Deployment / ServiceAccount name."""
    return f"{rs.name}-router"


def entry_service_name(rs: ResolvedService) -> str:
    """The Service clients use: the InferenceService's own name."""
    return rs.name


def service_url(rs: ResolvedService) -> str:
    """In-cluster URL of the entry Service (for ``status.url``)."""
    return f"http://{entry_service_name(rs)}.{rs.namespace}.svc.cluster.local"


def selector_labels(rs: ResolvedService, component: str) -> dict[str, str]:
    """Immutable selector of a component's pods."""
    return {LABEL_SERVICE: rs.name, LABEL_COMPONENT: component}


def labels(rs: ResolvedService, component: str) -> dict[str, str]:
    """Labels of every object (and pod) of ``component``."""
    return {
        "app.kubernetes.io/name": "kvfleet",
        "app.kubernetes.io/instance": rs.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "kvfleet",
        "app.kubernetes.io/version": __version__,
        LABEL_MODEL: rs.model.metadata.name,
        LABEL_RUNTIME: rs.runtime.metadata.name,
        **selector_labels(rs, component),
    }


def owner_references(rs: ResolvedService) -> list[dict[str, Any]]:
    """The InferenceService as controller owner, when its ``metadata.uid`` is known (an owner
    reference with a wrong uid would make the garbage collector delete the object)."""
    uid = rs.service.metadata.uid
    if not uid:
        return []
    return [{"apiVersion": API_VERSION, "kind": "InferenceService", "name": rs.name, "uid": uid,
             "controller": True, "blockOwnerDeletion": True}]


def object_meta(rs: ResolvedService, name: str, component: str, *, extra_labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of a rendered namespaced object."""
    meta: dict[str, Any] = {"name": name, "namespace": rs.namespace,
                            "labels": {**labels(rs, component), **(extra_labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    owners = owner_references(rs)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def selector_string(match: dict[str, str]) -> str:
    """``k=v,k2=v2`` label selector of a match-labels map."""
    return ",".join(f"{k}={v}" for k, v in match.items())
