"""Render an InferenceService and its references into Kubernetes manifests (pure functions; the
operator applies them, ``kvfleet render`` prints them like ``helm template``).

Per service, in apply order:

- router ServiceAccount, Role and RoleBinding (pod discovery);
- model storage: PVC and download Job (``modelStorage.type: PersistentVolumeClaim``);
- per pool: a Service and a Deployment (Standard, Serverless, each P/D pool) or a
  LeaderWorkerSet (MultiNode), with the model download or verification as initContainers,
  ``/health`` probes, a preStop drain and ``maxUnavailable: 0`` rolling updates;
- the router Deployment and the entry Service (``http://NAME.NAMESPACE.svc``);
- a PodDisruptionBudget per pool and for the router;
- autoscaling: a KEDA ScaledObject per autoscaled pool on ``vllm:num_requests_waiting`` (or an
  HPA with ``keda=False``), and a CPU HPA for an autoscaled router;
- with a Gateway: an InferencePool and an HTTPRoute.

Engine pools carry Kueue's queue-name and priority-class labels when a queue is given, and every
object an ownerReference to the InferenceService when its uid is known.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvfleet.control.api.builtin_runtimes import KVFLEET_IMAGE
from kvfleet.control.api.catalog import Catalog
from kvfleet.control.api.components import GatewaySpec
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.inference_service import InferenceService
from kvfleet.control.k8s import gateway, router, scaling, storage, workloads
from kvfleet.control.k8s.names import pool_name, router_name
from kvfleet.control.resolve import ResolvedService, resolve
from kvfleet.control.yamlio import dump_all

DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class RenderOptions:
    """Settings of a rendering that are not part of the InferenceService.

    Attributes:
        gateway: Gateway name; overrides (or supplies) ``spec.gateway.name``.
        keda: KEDA ScaledObjects (True) or HPAs (False) for autoscaled pools.
        kueue_queue: Kueue LocalQueue; overrides ``spec.kueue.queueName``.
        kueue_priority: Kueue WorkloadPriorityClass; overrides ``spec.kueue.priorityClass``.
        image: engine image override (a pool's own ``image`` still wins).
        router_image: router image (default: kvfleet's image).
        downloader_image: image of the download / verify steps (default: kvfleet's image).
        prometheus_url: Prometheus for KEDA triggers unless the spec names one.
    """

    gateway: str | None = None
    keda: bool = True
    kueue_queue: str | None = None
    kueue_priority: str | None = None
    image: str | None = None
    router_image: str | None = None
    downloader_image: str | None = None
    prometheus_url: str = DEFAULT_PROMETHEUS_URL


def _gateway(rs: ResolvedService, options: RenderOptions) -> GatewaySpec | None:
    gw = rs.service.spec.gateway
    if options.gateway:
        return gw.model_copy(update={"name": options.gateway}) if gw else GatewaySpec(name=options.gateway)
    return gw


def render(rs: ResolvedService, options: RenderOptions = RenderOptions()) -> list[dict[str, Any]]:
    """The Kubernetes manifests of a resolved InferenceService (plain dicts, apply order).

    Raises:
        SpecError: a combination the cluster cannot run (e.g. Serverless without KEDA), or an
            engine arg the runtime has no flag for.
    """
    try:
        return _render(rs, options)
    except SpecError as e:
        raise e.with_resource(rs.service.ref) from None


def _render(rs: ResolvedService, options: RenderOptions) -> list[dict[str, Any]]:
    spec = rs.service.spec
    tools_image = options.downloader_image or KVFLEET_IMAGE
    plan = storage.plan_storage(rs, tools_image)
    kueue = spec.kueue
    queue = options.kueue_queue or (kueue.queue_name if kueue else None)
    priority = options.kueue_priority or (kueue.priority_class if kueue else None)
    kueue_labels = workloads.kueue_labels(queue, priority)

    out: list[dict[str, Any]] = []
    if rs.router.enabled:
        out += router.rbac(rs)
    out += plan.objects
    for pool in rs.pools:
        out.append(workloads.pool_service(rs, pool))
        if rs.mode == "MultiNode":
            out.append(workloads.leader_worker_set(rs, pool, plan, options.image, kueue_labels))
        else:
            out.append(workloads.deployment(rs, pool, plan, options.image, kueue_labels))
    if rs.router.enabled:
        out.append(router.router_deployment(rs, options.router_image or KVFLEET_IMAGE))
    out.append(router.entry_service(rs))
    for pool in rs.pools:
        out.append(workloads.disruption_budget(rs, pool_name(rs, pool.role), pool.role))
    if rs.router.enabled:
        out.append(workloads.disruption_budget(rs, router_name(rs), "router"))
    for pool in rs.pools:
        if not pool.autoscaled:
            continue
        if options.keda:
            out.append(scaling.scaled_object(rs, pool, options.prometheus_url))
        else:
            out.append(scaling.hpa(rs, pool))
    r = rs.router
    if r.enabled and r.max_replicas and r.max_replicas > r.min_replicas:
        out.append(scaling.router_hpa(rs))
    gw = _gateway(rs, options)
    if gw is not None:
        out.append(gateway.inference_pool(rs, gw))
        out.append(gateway.http_route(rs, gw))
    return copy.deepcopy(out)  # no shared sub-objects between manifests


def render_service(service: InferenceService, catalog: Catalog, options: RenderOptions = RenderOptions(), *,
                   verify: bool = False) -> list[dict[str, Any]]:
    """Resolve ``service`` in ``catalog`` and render it (see :func:`render`).

    Raises:
        SpecError: a reference or combination that does not resolve or render.
    """
    return render(resolve(service, catalog, verify=verify), options)


def render_catalog(catalog: Catalog, options: RenderOptions = RenderOptions(), *,
                   verify: bool = False) -> list[dict[str, Any]]:
    """The manifests of every InferenceService in ``catalog``, in namespace/name order.

    Raises:
        SpecError: no InferenceService, or one that does not resolve or render.
    """
    services = catalog.inference_services()
    if not services:
        raise SpecError("kind", "no InferenceService among the documents")
    return [m for svc in services for m in render_service(svc, catalog, options, verify=verify)]


def to_yaml(manifests: Iterable[dict[str, Any]]) -> str:
    """Multi-document YAML (``---`` separated, keys in insertion order, no anchors)."""
    return dump_all(manifests)
