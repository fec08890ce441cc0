"""Status of an InferenceService from what the cluster reports (pure functions over plain dicts).

The operator observes the workloads it applied (Deployments, LeaderWorkerSets, the download Job)
and their pods, and turns them into the conditions ``ModelReady``, ``RuntimeResolved``,
``EngineReady``, ``RouterReady`` and ``Ready`` (Kubernetes ``metav1.Condition`` shape, each with a
one-word reason and a message), ``components`` (replicas per component) and
``observedGeneration``, the way KServe and OME report an InferenceService. Nothing here talks to
an API server, so every reason is tested from status dicts.

Readiness of a pool: the controller has observed the workload's generation and at least
``max(1, minReplicas)`` replicas (groups, for a LeaderWorkerSet) are ready, capped at the
desired count; a Serverless pool scaled to zero is ready (``ScaledToZero``). When a pool is not
ready the reason comes from its pods where one says why (``ImagePullBackOff``,
``CrashLoopBackOff``, ``Unschedulable``, ``Initializing``), else ``ReplicasNotReady``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from kvfleet.control.api.common import Condition, get_condition, set_condition
from kvfleet.control.api.inference_service import SERVICE_CONDITIONS

Status = Literal["True", "False", "Unknown"]

#: container waiting reasons that explain a pool that does not become ready.
POD_WAITING_REASONS = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CrashLoopBackOff",
                       "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
#: init containers that fetch or check the weights (see :mod:`kvfleet.control.k8s.storage`).
DOWNLOAD_CONTAINERS = {"model-download": "DownloadFailed", "model-verify": "VerificationFailed"}


@dataclass(frozen=True)
class ConditionState:
    """A condition before it is stamped: ``status``, a CamelCase ``reason`` and a ``message``."""

    status: Status
    reason: str
    message: str = ""


@dataclass(frozen=True)
class ComponentReadiness:
    """Readiness of one component's workload.

    Attributes:
        component: ``engine``, ``prefill``, ``decode`` or ``router``.
        kind, name: the workload (``Deployment`` or ``LeaderWorkerSet``).
        replicas: desired replicas (groups for a LeaderWorkerSet); 0 when not observed.
        ready_replicas: ready replicas (groups).
        ready: whether the component serves.
        reason, message: why (``MinimumReplicasAvailable``, ``ScaledToZero``, ``WorkloadNotFound``,
            ``RolloutInProgress``, ``ProgressDeadlineExceeded``, ``ReplicasNotReady`` or a pod
            reason such as ``CrashLoopBackOff``).
    """

    component: str
    kind: str
    name: str
    replicas: int
    ready_replicas: int
    ready: bool
    reason: str
    message: str


@dataclass
class Observed:
    """What the operator read back from the cluster for one InferenceService.

    Attributes:
        objects: live objects by ``(kind, name)`` (workloads and Jobs; missing ones absent).
        pods: the service's pods (label ``kvfleet.io/inference-service=NAME``).
    """

    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """The live object, or ``None``."""
        return self.objects.get((kind, name))


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", "?"))


def pods_of(pods: Iterable[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    """The pods whose labels include every ``selector`` entry, by name."""
    out = [p for p in pods if all(_labels(p).get(k) == v for k, v in selector.items())]
    return sorted(out, key=_name)


def pod_problem(pods: Iterable[dict[str, Any]]) -> tuple[str, str] | None:
    """``(reason, message)`` of the first pod that says why it is not ready, or ``None``.

    Looks at, in order: a container (init or main) waiting for one of
    :data:`POD_WAITING_REASONS`; a pod that cannot be scheduled (``PodScheduled`` False,
    reason ``Unschedulable``); an init container still running (``Initializing``, e.g. the model
    download). Pods are dicts in the Kubernetes ``core/v1`` Pod shape.
    """
    pods = list(pods)
    for pod in pods:
        status = pod.get("status") or {}
        for cs in (*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in POD_WAITING_REASONS:
                reason = "ImagePullBackOff" if reason == "ErrImagePull" else reason
                detail = waiting.get("message") or ""
                return reason, f"pod {_name(pod)}: container {cs.get('name')}: {reason}" + (
                    f": {detail}" if detail else "")
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return "Unschedulable", f"pod {_name(pod)}: {c.get('message') or 'cannot be scheduled'}"
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if "running" in (cs.get("state") or {}):
                return "Initializing", f"pod {_name(pod)}: init container {cs.get('name')} is running"
    return None


def download_problem(pods: Iterable[dict[str, Any]]) -> tuple[str, str] | None:
    """``(reason, message)`` when a pod's ``model-download`` / ``model-verify`` init container
    failed (``DownloadFailed`` / ``VerificationFailed``; a sha256 mismatch exits non-zero), else
    ``None``."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            reason = DOWNLOAD_CONTAINERS.get(cs.get("name", ""))
            if reason is None:
                continue
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                term = state.get("terminated") or {}
                if term and term.get("exitCode", 0) != 0:
                    detail = term.get("message") or term.get("reason") or ""
                    return reason, (f"pod {_name(pod)}: {cs['name']} exited with code {term['exitCode']}"
                                    + (f": {detail}" if detail else ""))
    return None


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


def workload_readiness(component: str, kind: str, name: str, live: dict[str, Any] | None, min_replicas: int,
                       pods: Iterable[dict[str, Any]] = ()) -> ComponentReadiness:
    """Readiness of a Deployment or LeaderWorkerSet from its live object (see the module docstring).

    Args:
        component: ``engine``, ``prefill``, ``decode`` or ``router``.
        kind: ``Deployment`` or ``LeaderWorkerSet`` (their ``status`` fields ``replicas``,
            ``readyReplicas``, ``observedGeneration`` and ``conditions`` are read).
        name: the workload's name.
        live: the object as the API server returns it, or ``None`` when it does not exist.
        min_replicas: the pool's ``minReplicas`` (0 for a Serverless pool).
        pods: the component's pods, to explain a pool that is not ready.
    """
    what = f"{kind} {name}"
    if live is None:
        return ComponentReadiness(component, kind, name, 0, 0, False, "WorkloadNotFound", f"{what} does not exist")
    spec, status = live.get("spec") or {}, live.get("status") or {}
    desired = _int(spec.get("replicas")) if "replicas" in spec else 1
    ready = _int(status.get("readyReplicas"))
    generation = (live.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    unit = "groups" if kind == "LeaderWorkerSet" else "replicas"

    def result(ok: bool, reason: str, message: str) -> ComponentReadiness:
        return ComponentReadiness(component, kind, name, desired, ready, ok, reason, message)

    for c in status.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("status") == "False" and \
                c.get("reason") == "ProgressDeadlineExceeded":
            return result(False, "ProgressDeadlineExceeded", f"{what}: {c.get('message') or 'rollout stalled'}")
    if desired == 0:
        if min_replicas == 0:
            return result(True, "ScaledToZero", f"{what} is scaled to zero; the first request scales it up")
        return result(False, "NoReplicas", f"{what} has 0 desired {unit} (minReplicas {min_replicas})")
    need = min(desired, max(1, min_replicas))
    if ready >= need and (generation is None or (observed is not None and observed >= generation)):
        return result(True, "MinimumReplicasAvailable", f"{what}: {ready}/{desired} {unit} ready")
    if ready >= need:
        return result(False, "RolloutInProgress", f"{what}: generation {generation} not yet observed by its "
                                                  f"controller (observed {observed})")
    problem = pod_problem(pods)
    if problem is not None:
        return result(False, problem[0], f"{what}: {ready}/{desired} {unit} ready; {problem[1]}")
    return result(False, "ReplicasNotReady", f"{what}: {ready}/{desired} {unit} ready (need {need})")


def job_condition(job: dict[str, Any] | None, name: str) -> ConditionState:
    """``ModelReady`` from the PVC download Job (``batch/v1`` status ``conditions`` /
    ``succeeded``): ``Downloaded``, ``DownloadFailed``, or ``Downloading`` (False) while it runs
    or before it exists."""
    if job is None:
        return ConditionState("False", "Downloading", f"Job {name} not created yet")
    status = job.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return ConditionState("True", "Downloaded", f"Job {name} downloaded and verified the weights")
        if c.get("type") == "Failed":
            return ConditionState("False", "DownloadFailed",
                                  f"Job {name} failed: {c.get('reason') or ''} {c.get('message') or ''}".rstrip())
    if _int(status.get("succeeded")) >= 1:
        return ConditionState("True", "Downloaded", f"Job {name} downloaded and verified the weights")
    return ConditionState("False", "Downloading", f"Job {name} is downloading the weights "
                                                  f"({_int(status.get('failed'))} failed attempts)")


def combine(readiness: list[ComponentReadiness]) -> ConditionState:
    """One condition over several pools: True when all are ready (``ScaledToZero`` when all are
    at zero), else the first unready pool's reason, with every pool in the message."""
    if not readiness:
        return ConditionState("Unknown", "NotObserved", "no workload to observe")
    message = "; ".join(f"{r.component}: {r.message}" for r in readiness)
    bad = [r for r in readiness if not r.ready]
    if bad:
        return ConditionState("False", bad[0].reason, message)
    if all(r.reason == "ScaledToZero" for r in readiness):
        return ConditionState("True", "ScaledToZero", message)
    return ConditionState("True", "MinimumReplicasAvailable", message)


def ready_condition(states: dict[str, ConditionState]) -> ConditionState:
    """``Ready``: True when ModelReady, RuntimeResolved, EngineReady and RouterReady all are;
    otherwise False with the reason and message of the first that is not (in
    :data:`SERVICE_CONDITIONS` order)."""
    for t in SERVICE_CONDITIONS[:-1]:
        s = states.get(t)
        if s is None:
            return ConditionState("Unknown", "NotObserved", f"{t} not computed")
        if s.status != "True":
            return ConditionState("False", s.reason, f"{t}: {s.message}" if s.message else t)
    return ConditionState("True", "Ready", "every component is ready")


def stamp(previous: list[dict[str, Any]], states: dict[str, ConditionState], generation: int | None,
          now: datetime | None = None) -> list[dict[str, Any]]:
    """The ``status.conditions`` list: ``states`` applied over the ``previous`` conditions (wire
    dicts) with :func:`~kvfleet.control.api.common.set_condition`, so ``lastTransitionTime``
    moves only when a status changes. Types in :data:`SERVICE_CONDITIONS` come first, in order.

    Raises:
        ValueError: a reason that is not one CamelCase word.
    """
    conds = [Condition.model_validate(c) for c in previous if isinstance(c, dict) and "type" in c]
    for t, s in states.items():
        conds = set_condition(conds, t, s.status, s.reason, s.message, generation, now)
    order = {t: i for i, t in enumerate(SERVICE_CONDITIONS)}
    conds.sort(key=lambda c: order.get(c.type, len(order)))
    return [c.to_dict() for c in conds]


def condition_of(status: dict[str, Any] | None, type: str) -> Condition | None:
    """The condition ``type`` of a wire ``status`` dict, or ``None``."""
    conds = [Condition.model_validate(c) for c in (status or {}).get("conditions") or [] if isinstance(c, dict)]
    return get_condition(conds, type)
