"""What the operator does for one InferenceService, as pure functions over plain dicts.

- :func:`build_catalog` turns the kvfleet objects the operator listed into a
  :class:`~kvfleet.control.api.Catalog` (invalid ones are remembered with their error);
- :func:`plan_service` resolves and renders a service (the manifests to apply, with
  ownerReferences from its uid) or says, as ``ModelReady`` / ``RuntimeResolved`` conditions, why
  it cannot (``ModelNotFound``, ``Sha256Mismatch``, ``RuntimeNotFound`` ...);
- :func:`references_of`, :func:`build_index` and :func:`dependents` map a BaseModel,
  ServingRuntime or FineTunedWeight to the services that must be re-rendered when it changes;
- :func:`stale_objects` picks the objects a service owns that are no longer rendered (pruned);
- :func:`service_status` turns the plan, what was applied and what the cluster reports into the
  ``status`` to write.

The kopf handlers in :mod:`kvfleet.control.operator` only fetch, apply and write what these return.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvfleet.control.api.catalog import KINDS, Catalog, parse_resource
from kvfleet.control.api.common import GROUP
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.inference_service import InferenceService
from kvfleet.control.k8s.names import LABEL_SERVICE, pool_name, router_name, service_url
from kvfleet.control.render import RenderOptions, render
from kvfleet.control.resolve import ResolvedService, resolve
from kvfleet.control.status import (
    ComponentReadiness,
    ConditionState,
    Observed,
    combine,
    condition_of,
    download_problem,
    job_condition,
    pods_of,
    ready_condition,
    stamp,
    workload_readiness,
)

#: ``(kind, namespace or "", name)`` of a referenced object; ``name`` ``"*"`` stands for every
#: object of the kind (a service whose runtime is auto-selected depends on all runtimes).
RefKey = tuple[str, str, str]
#: ``(namespace, name)`` of an InferenceService.
ServiceKey = tuple[str, str]
ANY = "*"

#: kinds an InferenceService refers to (the operator watches them and re-renders dependents).
REFERENCED_KINDS = ("BaseModel", "ClusterBaseModel", "ServingRuntime", "ClusterServingRuntime", "FineTunedWeight")
#: every ``(apiVersion, kind)`` the renderer may emit, in apply order groups; the operator lists
#: these by the service's label to prune what is no longer rendered.
MANAGED_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "PersistentVolumeClaim"), ("batch/v1", "Job"),
    ("v1", "Service"), ("apps/v1", "Deployment"), ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("policy/v1", "PodDisruptionBudget"), ("keda.sh/v1alpha1", "ScaledObject"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"), ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
)
#: status fields of a BaseModel / FineTunedWeight kept when parsing a live object.
_MODEL_STATUS_FIELDS = ("observedGeneration", "conditions", "sizeBytes")


# --------------------------------------------------------------------------- catalog

def _key(kind: str, namespace: str | None, name: str) -> RefKey:
    return (kind, (namespace or "") if KINDS[kind].NAMESPACED else "", name)


def _clean(obj: dict[str, Any]) -> dict[str, Any]:
    """A live object reduced to what the typed resource accepts (status fields we own only)."""
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k in ("apiVersion", "kind", "metadata", "spec")}
    status = obj.get("status")
    if isinstance(status, dict) and obj.get("kind") in ("BaseModel", "ClusterBaseModel", "FineTunedWeight"):
        kept = {k: copy.deepcopy(v) for k, v in status.items() if k in _MODEL_STATUS_FIELDS}
        if kept:
            out["status"] = kept
    return out


def build_catalog(objects: Iterable[dict[str, Any]], *, builtin: bool = True) -> tuple[Catalog, dict[RefKey, str]]:
    """A catalog of live kvfleet objects (BaseModels, runtimes, FineTunedWeights ...).

    Objects that fail validation are left out and returned as ``{ref: message}``, so a service
    that names one is told the object is invalid rather than missing. Built-in runtimes are
    included unless ``builtin`` is False (a cluster's ClusterServingRuntime of the same name wins).
    """
    catalog = Catalog(builtin=builtin)
    invalid: dict[RefKey, str] = {}
    for obj in objects:
        kind = obj.get("kind")
        meta = obj.get("metadata") or {}
        try:
            catalog.add(parse_resource(_clean(obj), meta.get("namespace") or "default"))
        except SpecError as e:
            if kind in KINDS and meta.get("name"):
                invalid[_key(kind, meta.get("namespace"), meta["name"])] = str(e)
    return catalog, invalid


# --------------------------------------------------------------------------- plan

@dataclass
class ServicePlan:
    """A service resolved and rendered, or why not.

    Attributes:
        namespace, name: the InferenceService.
        generation: its ``metadata.generation``.
        resolved: the resolved service, when resolution succeeded.
        manifests: the objects to apply (server-side apply, apply order); empty when the spec does
            not resolve or render (what runs is then left alone).
        conditions: ``ModelReady`` and ``RuntimeResolved`` as far as the spec alone decides them.
        error: the error that stopped resolution or rendering.
    """

    namespace: str
    name: str
    generation: int | None
    resolved: ResolvedService | None = None
    manifests: list[dict[str, Any]] = field(default_factory=list)
    conditions: dict[str, ConditionState] = field(default_factory=dict)
    error: SpecError | None = None


def classify_error(err: SpecError, invalid: Mapping[RefKey, str] | None = None,
                   namespace: str = "default", service: InferenceService | None = None
                   ) -> dict[str, ConditionState]:
    """``ModelReady`` / ``RuntimeResolved`` for a resolution or rendering error.

    Reasons: ``ModelNotFound`` / ``ModelInvalid`` (``spec.model``), ``Sha256Mismatch``
    (a model's or adapter's ``spec.sha256``), ``AdapterInvalid`` (``spec.fineTunedWeights``),
    ``RuntimeNotFound`` / ``RuntimeInvalid`` (an unknown ``spec.runtime.name``),
    ``RuntimeUnsupported`` (a runtime that cannot serve the format, architecture or mode),
    ``NoRuntimeSelected`` (nothing to auto-select), ``EngineArgsInvalid``, ``RouterInvalid`` and
    ``InvalidSpec`` (anything else, e.g. Serverless without KEDA).
    """
    msg, f = str(err), err.field
    invalid = invalid or {}
    model_unknown = ConditionState("Unknown", "ModelNotResolved", "the runtime is chosen once the model resolves")
    if f.startswith("spec.model"):
        bad = None
        if service is not None:
            ref = service.spec.model
            kinds = [ref.kind] if ref.kind else ["BaseModel", "ClusterBaseModel"]
            bad = next((invalid[k] for k in (_key(kd, namespace, ref.name) for kd in kinds) if k in invalid), None)
        if bad is not None:
            return {"ModelReady": ConditionState("False", "ModelInvalid", bad), "RuntimeResolved": model_unknown}
        return {"ModelReady": ConditionState("False", "ModelNotFound", msg), "RuntimeResolved": model_unknown}
    if f == "spec.sha256":
        return {"ModelReady": ConditionState("False", "Sha256Mismatch", msg), "RuntimeResolved": model_unknown}
    if f.startswith("spec.fineTunedWeights"):
        return {"ModelReady": ConditionState("False", "AdapterInvalid", msg),
                "RuntimeResolved": ConditionState("Unknown", "ModelNotResolved", "the adapters do not resolve")}
    model_ok = ConditionState("True", "ModelResolved", "")
    if f == "spec.runtime.name" and "unknown runtime" in err.message:
        reason = "RuntimeNotFound"
        if service is not None and service.spec.runtime is not None:
            ref = service.spec.runtime
            kinds = [ref.kind] if ref.kind else ["ServingRuntime", "ClusterServingRuntime"]
            bad = next((invalid[k] for k in (_key(kd, namespace, ref.name) for kd in kinds) if k in invalid), None)
            if bad is not None:
                reason, msg = "RuntimeInvalid", bad
    elif f == "spec.runtime":
        reason = "NoRuntimeSelected"
    elif "does not serve" in err.message or "does not support" in err.message:
        reason = "RuntimeUnsupported"
    elif ".engineArgs" in f:
        reason = "EngineArgsInvalid"
    elif f.startswith("spec.router"):
        reason = "RouterInvalid"
    else:
        reason = "InvalidSpec"
    return {"ModelReady": model_ok, "RuntimeResolved": ConditionState("False", reason, msg)}


def _verification_failure(obj: Any) -> tuple[str, str] | None:
    """``(reason, message)`` when a model's / adapter's status says its sha256 did not match."""
    status = obj.status
    if status is None:
        return None
    for c in status.conditions:
        if c.type == "Verified" and c.status == "False":
            current = status.observed_generation is None or obj.metadata.generation is None or \
                status.observed_generation == obj.metadata.generation
            if current:
                return c.reason or "VerificationFailed", f"{obj.ref}: {c.message or 'sha256 verification failed'}"
    return None


def plan_service(body: dict[str, Any], catalog: Catalog, options: RenderOptions = RenderOptions(),
                 invalid: Mapping[RefKey, str] | None = None) -> ServicePlan:
    """Resolve and render one InferenceService (a live object dict) against ``catalog``.

    The manifests carry an ownerReference to the service (from ``metadata.uid``), so deleting
    the service deletes them. A BaseModel or FineTunedWeight whose status says its sha256 did not
    match (``Verified`` False, see :func:`kvfleet.control.operator.model_status`) blocks rendering
    with ``ModelReady`` False, reason ``Sha256Mismatch``. Never raises for a bad spec: the
    returned plan's conditions say why.
    """
    meta = body.get("metadata") or {}
    ns = meta.get("namespace") or "default"
    plan = ServicePlan(namespace=ns, name=str(meta.get("name", "")), generation=meta.get("generation"))
    service: InferenceService | None = None
    try:
        parsed = parse_resource(_clean(body), ns)
        if not isinstance(parsed, InferenceService):
            raise SpecError("kind", f"expected an InferenceService, got {parsed.KIND}")
        service = parsed
        rs = resolve(service, catalog)
        plan.resolved = rs
        for obj in (rs.model, *rs.adapters):
            failed = _verification_failure(obj)
            if failed is not None:
                plan.conditions = {"ModelReady": ConditionState("False", *failed),
                                   "RuntimeResolved": ConditionState("True", "RuntimeResolved",
                                                                     runtime_message(rs))}
                plan.error = SpecError("spec.sha256", failed[1], obj.ref)
                return plan
        plan.manifests = render(rs, options)
    except SpecError as e:
        plan.error = e
        plan.conditions = classify_error(e, invalid, ns, service)
        if plan.resolved is not None and plan.conditions["ModelReady"].status == "True":
            plan.conditions["ModelReady"] = ConditionState("True", "ModelResolved", model_message(plan.resolved))
        return plan
    plan.conditions = {"ModelReady": ConditionState("True", "ModelResolved", model_message(rs)),
                       "RuntimeResolved": ConditionState("True", "RuntimeResolved", runtime_message(rs))}
    return plan


def model_message(rs: ResolvedService) -> str:
    """``BaseModel/NAME (gguf, sha256 checked on download)`` for ``ModelReady``."""
    spec = rs.model.spec
    check = "sha256 checked before serving" if spec.sha256 else "no sha256 given"
    adapters = f"; adapters: {', '.join(a.metadata.name for a in rs.adapters)}" if rs.adapters else ""
    return f"{rs.model.KIND}/{rs.model.metadata.name} ({spec.format}, {check}){adapters}"


def runtime_message(rs: ResolvedService) -> str:
    """``ClusterServingRuntime/kvfleet (auto-selected)`` for ``RuntimeResolved``."""
    how = "named" if rs.service.spec.runtime is not None else "auto-selected"
    return f"{rs.runtime_ref} ({how}), {rs.mode}"


# --------------------------------------------------------------------------- reference index

def references_of(body: dict[str, Any]) -> set[RefKey]:
    """The objects an InferenceService (live dict) depends on, as :data:`RefKey` s.

    A model reference without ``kind`` depends on the BaseModel and the ClusterBaseModel of that
    name (either may appear later); an omitted runtime depends on every ServingRuntime of the
    namespace and every ClusterServingRuntime (``"*"``: any may change the auto-selection).
    Works on a spec that does not validate (reads the raw fields), so a broken service is still
    re-rendered when the object it is missing appears.
    """
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    ns = meta.get("namespace") or "default"
    out: set[RefKey] = set()
    model = spec.get("model") or {}
    if isinstance(model, dict) and model.get("name"):
        kinds = [model["kind"]] if model.get("kind") in ("BaseModel", "ClusterBaseModel") else \
            ["BaseModel", "ClusterBaseModel"]
        out |= {_key(k, ns, model["name"]) for k in kinds}
    runtime = spec.get("runtime")
    if isinstance(runtime, dict) and runtime.get("name"):
        kinds = [runtime["kind"]] if runtime.get("kind") in ("ServingRuntime", "ClusterServingRuntime") else \
            ["ServingRuntime", "ClusterServingRuntime"]
        out |= {_key(k, ns, runtime["name"]) for k in kinds}
    else:
        out |= {_key("ServingRuntime", ns, ANY), _key("ClusterServingRuntime", ns, ANY)}
    for name in spec.get("fineTunedWeights") or []:
        if isinstance(name, str):
            out.add(_key("FineTunedWeight", ns, name))
    return out


def build_index(services: Iterable[dict[str, Any]]) -> dict[RefKey, set[ServiceKey]]:
    """Referenced object -> services that depend on it (see :func:`references_of`)."""
    index: dict[RefKey, set[ServiceKey]] = {}
    for body in services:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "default", str(meta.get("name", "")))
        for ref in references_of(body):
            index.setdefault(ref, set()).add(key)
    return index


def lookup_keys(kind: str, namespace: str | None, name: str) -> list[RefKey]:
    """The index keys a change of ``kind``/``namespace``/``name`` touches: its own and the kind's
    wildcard.

    Raises:
        ValueError: ``kind`` is not one of :data:`REFERENCED_KINDS`.
    """
    if kind not in REFERENCED_KINDS:
        raise ValueError(f"not a referenced kind: {kind!r} (known: {', '.join(REFERENCED_KINDS)})")
    return [_key(kind, namespace, name), _key(kind, namespace, ANY)]


def dependents(index: Mapping[RefKey, Iterable[ServiceKey]], kind: str, namespace: str | None,
               name: str) -> list[ServiceKey]:
    """The services (``(namespace, name)``, sorted) to re-render when ``kind``/``name`` changes.

    ``index`` is :func:`build_index`'s dict or the operator's kopf index of the same shape.
    Cluster-scoped kinds are keyed without a namespace, so a ClusterBaseModel or
    ClusterServingRuntime reaches services in every namespace.

    Raises:
        ValueError: ``kind`` is not one of :data:`REFERENCED_KINDS`.
    """
    out: set[ServiceKey] = set()
    for k in lookup_keys(kind, namespace, name):
        out.update(index.get(k, ()))
    return sorted(out)


# --------------------------------------------------------------------------- prune

def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0] if "/" in api_version else ""


def object_id(obj: dict[str, Any]) -> tuple[str, str, str]:
    """``(API group, kind, name)``: an object's identity across API versions."""
    return (_group(str(obj.get("apiVersion", ""))), str(obj.get("kind", "")),
            str((obj.get("metadata") or {}).get("name", "")))


def stale_objects(live: Iterable[dict[str, Any]], rendered: Iterable[dict[str, Any]], service: str,
                  uid: str | None) -> list[dict[str, Any]]:
    """The live objects to delete: labelled ``kvfleet.io/inference-service=SERVICE``, controlled by
    the service (an ownerReference with ``uid``, so objects someone else labelled are never
    touched) and not among ``rendered`` (e.g. the download Job of a previous model, the KEDA
    ScaledObject of a pool that stopped autoscaling)."""
    if not uid:
        return []
    keep = {object_id(m) for m in rendered}
    out = []
    for obj in live:
        meta = obj.get("metadata") or {}
        if (meta.get("labels") or {}).get(LABEL_SERVICE) != service:
            continue
        owners = meta.get("ownerReferences") or []
        if not any(o.get("uid") == uid and o.get("kind") == "InferenceService" and
                   _group(str(o.get("apiVersion", ""))) == GROUP for o in owners):
            continue
        if object_id(obj) not in keep:
            out.append(obj)
    return sorted(out, key=object_id)


# --------------------------------------------------------------------------- status

@dataclass(frozen=True)
class ApplyError:
    """An object that could not be applied.

    Attributes:
        kind, name: the object.
        component: its ``app.kubernetes.io/component`` label (``engine``, ``router`` ...).
        reason: ``CRDNotInstalled`` (the cluster does not serve the kind), ``Forbidden``,
            ``Invalid`` (the API server rejected it) or ``ApplyFailed``.
        message: what the API server said.
        transient: worth retrying (a 5xx, a timeout, a conflict).
    """

    kind: str
    name: str
    component: str
    reason: str
    message: str
    transient: bool = False


@dataclass(frozen=True)
class Workload:
    """A workload whose readiness the status reports: ``component``, ``kind``, ``name`` and the
    replica floor ``min_replicas``."""

    component: str
    kind: str
    name: str
    min_replicas: int


def workloads(rs: ResolvedService) -> list[Workload]:
    """The pool workloads (Deployment or LeaderWorkerSet each) and the router Deployment."""
    kind = "LeaderWorkerSet" if rs.mode == "MultiNode" else "Deployment"
    out = [Workload(p.role, kind, pool_name(rs, p.role), p.min_replicas) for p in rs.pools]
    if rs.router.enabled:
        out.append(Workload("router", "Deployment", router_name(rs), rs.router.min_replicas))
    return out


def download_job(manifests: Iterable[dict[str, Any]]) -> str | None:
    """Name of the rendered model download Job (``modelStorage.type: PersistentVolumeClaim``)."""
    return next((m["metadata"]["name"] for m in manifests if m.get("kind") == "Job"), None)


def _readiness(rs: ResolvedService, observed: Observed) -> list[ComponentReadiness]:
    out = []
    for w in workloads(rs):
        pods = pods_of(observed.pods, {LABEL_SERVICE: rs.name, "kvfleet.io/component": w.component})
        out.append(workload_readiness(w.component, w.kind, w.name, observed.get(w.kind, w.name), w.min_replicas,
                                      pods))
    return out


def _apply_condition(errors: list[ApplyError]) -> ConditionState:
    first = errors[0]
    message = "; ".join(f"{e.kind}/{e.name}: {e.message}" for e in errors[:5])
    if len(errors) > 5:
        message += f"; and {len(errors) - 5} more"
    return ConditionState("False", first.reason, message)


def service_status(plan: ServicePlan, observed: Observed | None = None, apply_errors: Iterable[ApplyError] = (),
                   previous: dict[str, Any] | None = None, now: datetime | None = None) -> dict[str, Any]:
    """The ``status`` of an InferenceService (wire dict, ready for a status-subresource patch).

    Args:
        plan: from :func:`plan_service`.
        observed: the live workloads, Job and pods (``None``: nothing observed yet).
        apply_errors: objects the API server refused.
        previous: the current ``status`` (its conditions keep their ``lastTransitionTime``).
        now: the time stamped on changed conditions (default: now, UTC).

    Returns:
        ``observedGeneration``, ``conditions`` (the five of
        :data:`~kvfleet.control.api.SERVICE_CONDITIONS`), and once resolved ``url``,
        ``deploymentMode``, ``runtime`` and ``components`` (``replicas``/``readyReplicas`` per
        pool and for the router).
    """
    observed = observed or Observed()
    errors = list(apply_errors)
    states = dict(plan.conditions)
    out: dict[str, Any] = {}
    rs = plan.resolved
    if plan.generation is not None:
        out["observedGeneration"] = plan.generation
    if rs is None or not plan.manifests:
        waiting = ConditionState("Unknown", "NotReconciled", "nothing applied: the spec does not resolve "
                                 "(what already runs is left as it is)")
        states.setdefault("ModelReady", waiting)
        states.setdefault("RuntimeResolved", waiting)
        states["EngineReady"] = waiting
        states["RouterReady"] = waiting
    else:
        pods = pods_of(observed.pods, {LABEL_SERVICE: rs.name})
        job = download_job(plan.manifests)
        if job is not None:
            states["ModelReady"] = job_condition(observed.get("Job", job), job)
        else:
            failed = download_problem(pods)
            if failed is not None:
                states["ModelReady"] = ConditionState("False", *failed)
        readiness = _readiness(rs, observed)
        engines = [r for r in readiness if r.component != "router"]
        routers = [r for r in readiness if r.component == "router"]
        engine_errors = [e for e in errors if e.component not in ("router", "entry")]
        router_errors = [e for e in errors if e.component in ("router", "entry")]
        states["EngineReady"] = _apply_condition(engine_errors) if engine_errors else combine(engines)
        if not rs.router.enabled:
            states["RouterReady"] = ConditionState("True", "RouterDisabled", "clients reach the engine Service "
                                                                             "directly")
        else:
            states["RouterReady"] = _apply_condition(router_errors) if router_errors else combine(routers)
        out.update(url=service_url(rs), deploymentMode=rs.mode, runtime=rs.runtime_ref,
                   components={r.component: {"replicas": r.replicas, "readyReplicas": r.ready_replicas}
                               for r in readiness})
    states["Ready"] = ready_condition(states)
    ordered = {t: states[t] for t in ("ModelReady", "RuntimeResolved", "EngineReady", "RouterReady", "Ready")}
    out["conditions"] = stamp((previous or {}).get("conditions") or [], ordered, plan.generation, now)
    return out


def is_ready(status: dict[str, Any]) -> bool:
    """True when ``status`` has ``Ready`` True."""
    c = condition_of(status, "Ready")
    return c is not None and c.status == "True"
