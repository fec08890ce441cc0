"""The operator's logic without a cluster: planning (conditions and reasons for missing models, sha256
mismatches, unknown runtimes, good specs; ownerReferences), the reference index that decides which
InferenceServices are re-rendered, readiness from observed workload and pod status dicts, pruning,
and whole reconciliations (apply, prune, status) over an in-memory API server."""

from __future__ import annotations

import copy
import hashlib
from datetime import datetime, timezone
from typing import Any

import pytest

from kvfleet.control.api import InferenceServiceStatus
from kvfleet.control.api.common import API_VERSION
from kvfleet.control.operator import ClusterError, OperatorConfig, model_status, reconcile_service
from kvfleet.control.reconcile import (
    MANAGED_KINDS,
    build_catalog,
    build_index,
    dependents,
    plan_service,
    references_of,
    service_status,
    stale_objects,
)
from kvfleet.control.render import RenderOptions
from kvfleet.control.status import Observed, job_condition, workload_readiness
from tests.control import specs

NS = "llm"
UID = "6f1c2e4a-9b7d-4c3e-8a21-0d5e7f9b1c23"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
T1 = datetime(2026, 1, 2, tzinfo=timezone.utc)


def _svc(name: str = "chat", mode: str = "Standard", runtime: str | None = "kvfleet", **kw: Any) -> dict[str, Any]:
    body = specs.service(name, mode, runtime, uid=UID, **kw)
    body["metadata"].update(namespace=NS, generation=2)
    return body


def _models(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for doc in (specs.GGUF_MODEL, specs.HF_MODEL, *extra):
        d = copy.deepcopy(doc)
        if d["kind"] not in ("ClusterBaseModel", "ClusterServingRuntime"):
            d["metadata"].setdefault("namespace", NS)
        out.append(d)
    return out


def _plan(body: dict[str, Any], *objects: dict[str, Any], options: RenderOptions = RenderOptions()):
    catalog, invalid = build_catalog(_models(*objects))
    return plan_service(body, catalog, options, invalid)


def _cond(status: dict[str, Any], type: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type)


# --------------------------------------------------------------------------- planning

def test_good_spec_renders_with_owner_references_and_resolved_conditions():
    plan = _plan(_svc())
    assert plan.error is None and plan.manifests
    assert plan.conditions["ModelReady"].status == "True" and plan.conditions["ModelReady"].reason == "ModelResolved"
    assert "BaseModel/smollm2" in plan.conditions["ModelReady"].message
    rr = plan.conditions["RuntimeResolved"]
    assert (rr.status, rr.reason) == ("True", "RuntimeResolved")
    assert "ClusterServingRuntime/kvfleet (named)" in rr.message
    for m in plan.manifests:
        owners = m["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": API_VERSION, "kind": "InferenceService", "name": "chat", "uid": UID,
                           "controller": True, "blockOwnerDeletion": True}], m["kind"]
        assert m["metadata"]["namespace"] == NS
    assert {(m["apiVersion"], m["kind"]) for m in plan.manifests} <= set(MANAGED_KINDS)


def test_auto_selected_runtime_is_named_in_the_condition():
    plan = _plan(_svc(runtime=None, model="smollm2"))
    assert "ClusterServingRuntime/kvfleet (auto-selected)" in plan.conditions["RuntimeResolved"].message


def test_service_without_uid_gets_no_owner_references_and_prunes_nothing():
    body = _svc()
    del body["metadata"]["uid"]
    plan = _plan(body)
    assert all("ownerReferences" not in m["metadata"] for m in plan.manifests)
    assert stale_objects(plan.manifests, [], "chat", None) == []


def test_missing_model():
    plan = _plan(_svc(model="nope"))
    assert plan.manifests == []
    mr, rr = plan.conditions["ModelReady"], plan.conditions["RuntimeResolved"]
    assert (mr.status, mr.reason) == ("False", "ModelNotFound") and "'nope'" in mr.message
    assert (rr.status, rr.reason) == ("Unknown", "ModelNotResolved")
    status = service_status(plan, now=T0)
    ready = _cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ModelNotFound")
    assert ready["message"].startswith("ModelReady: ")
    assert _cond(status, "EngineReady")["reason"] == "NotReconciled"
    assert "url" not in status and status["observedGeneration"] == 2


def test_invalid_model_object_is_reported_as_invalid_not_missing():
    bad = {"apiVersion": API_VERSION, "kind": "BaseModel", "metadata": {"name": "broken", "namespace": NS},
           "spec": {"source": "hf://org/model#weights.bin", "format": "gguf"}}
    plan = _plan(_svc(model="broken"), bad)
    mr = plan.conditions["ModelReady"]
    assert (mr.status, mr.reason) == ("False", "ModelInvalid") and ".gguf" in mr.message


def test_unknown_runtime_lists_the_known_ones():
    plan = _plan(_svc(runtime="tgi"))
    rr = plan.conditions["RuntimeResolved"]
    assert (rr.status, rr.reason) == ("False", "RuntimeNotFound")
    assert "kvfleet" in rr.message and "vllm" in rr.message
    assert plan.conditions["ModelReady"].status == "True"
    assert plan.manifests == []


def test_runtime_that_cannot_serve_the_mode():
    plan = _plan(_svc(mode="MultiNode", runtime="kvfleet"))
    rr = plan.conditions["RuntimeResolved"]
    assert (rr.status, rr.reason) == ("False", "RuntimeUnsupported") and "MultiNode" in rr.message


def test_engine_arg_without_flag_and_render_time_errors():
    plan = _plan(_svc(args={"tensorParallelSize": 2}))
    assert plan.conditions["RuntimeResolved"].reason == "EngineArgsInvalid"
    assert "tensorParallelSize" in plan.conditions["RuntimeResolved"].message
    plan = _plan(_svc(mode="Serverless"), options=RenderOptions(keda=False))
    rr = plan.conditions["RuntimeResolved"]
    assert (rr.status, rr.reason) == ("False", "InvalidSpec") and "KEDA" in rr.message
    assert plan.conditions["ModelReady"].reason == "ModelResolved" and plan.manifests == []


def test_model_with_failed_verification_blocks_rendering():
    model = _models()[0]
    model["metadata"]["generation"] = 4
    model["status"] = {"observedGeneration": 4, "conditions": [
        {"type": "Verified", "status": "False", "reason": "Sha256Mismatch", "message": "spec.sha256: got 00"}]}
    catalog, _ = build_catalog([model, *_models()[1:]])
    plan = plan_service(_svc(), catalog)
    mr = plan.conditions["ModelReady"]
    assert (mr.status, mr.reason) == ("False", "Sha256Mismatch") and "BaseModel/llm/smollm2" in mr.message
    assert plan.manifests == [] and plan.conditions["RuntimeResolved"].status == "True"
    # a verdict about an older generation of the model does not block
    model["status"]["observedGeneration"] = 3
    catalog, _ = build_catalog([model, *_models()[1:]])
    assert plan_service(_svc(), catalog).manifests


# --------------------------------------------------------------------------- model status

def _file_model(path, sha: str | None) -> dict[str, Any]:
    spec = {"source": f"file://{path}", "format": "gguf"}
    if sha:
        spec["sha256"] = sha
    return {"apiVersion": API_VERSION, "kind": "BaseModel",
            "metadata": {"name": "local", "namespace": NS, "generation": 1}, "spec": spec}


def test_model_status_checks_sha256_of_local_weights(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights" * 100)
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    st = model_status(_file_model(f, good), now=T0)
    assert (_cond(st, "Verified")["status"], _cond(st, "Verified")["reason"]) == ("True", "Sha256Matched")
    assert _cond(st, "Ready")["reason"] == "Available" and st["sizeBytes"] == 700 and st["observedGeneration"] == 1

    body = _file_model(f, "0" * 64)
    st = model_status(body, now=T0)
    v = _cond(st, "Verified")
    assert (v["status"], v["reason"]) == ("False", "Sha256Mismatch") and good in v["message"]
    assert _cond(st, "Ready")["status"] == "False"
    # the status written by the operator blocks every service using the model
    body["status"] = st
    catalog, _ = build_catalog([body])
    plan = plan_service(_svc(model="local"), catalog)
    assert plan.conditions["ModelReady"].reason == "Sha256Mismatch" and plan.manifests == []

    # unchanged verdict keeps its transition time; a changed one moves it
    body["status"] = model_status(body, now=T0)
    again = model_status(body, now=T1)
    assert _cond(again, "Verified")["lastTransitionTime"] == _cond(body["status"], "Verified")["lastTransitionTime"]
    body["spec"]["sha256"] = good
    fixed = model_status(body, now=T1)
    assert _cond(fixed, "Verified")["status"] == "True"
    assert _cond(fixed, "Verified")["lastTransitionTime"] == "2026-01-02T00:00:00Z"


def test_model_status_of_weights_elsewhere(tmp_path):
    hf = copy.deepcopy(specs.HF_MODEL)
    st = model_status(hf, now=T0)
    assert _cond(st, "Verified")["reason"] == "NoSha256" and _cond(st, "Ready")["reason"] == "RemoteSource"
    hf["spec"]["sha256"] = "a" * 64
    assert _cond(model_status(hf, now=T0), "Verified")["reason"] == "VerifiedOnDownload"
    missing = _file_model(tmp_path / "absent.gguf", "a" * 64)  # a hostPath on the nodes, not here
    assert _cond(model_status(missing, now=T0), "Verified")["status"] == "Unknown"
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    st = model_status(_file_model(f, "0" * 64), verify=False, now=T0)
    assert _cond(st, "Verified")["reason"] == "NotChecked"


# --------------------------------------------------------------------------- reference index

def _ref_services() -> list[dict[str, Any]]:
    named = _svc("named", runtime="vllm", model="qwen")
    auto = _svc("auto", runtime=None, model="smollm2")
    other_ns = _svc("elsewhere", runtime=None, model="smollm2")
    other_ns["metadata"]["namespace"] = "team-b"
    cluster_model = _svc("cm", runtime="sglang", model="shared")
    cluster_model["spec"]["model"]["kind"] = "ClusterBaseModel"
    adapters = _svc("lora", runtime="kvfleet", model="smollm2", fineTunedWeights=["sql", "chat"])
    local_rt = _svc("local-rt", model="qwen")
    local_rt["spec"]["runtime"] = {"name": "my-vllm", "kind": "ServingRuntime"}
    return [named, auto, other_ns, cluster_model, adapters, local_rt]


def test_references_of_a_service():
    named, auto, _, cm, lora, local_rt = _ref_services()
    assert references_of(named) == {("BaseModel", NS, "qwen"), ("ClusterBaseModel", "", "qwen"),
                                    ("ServingRuntime", NS, "vllm"), ("ClusterServingRuntime", "", "vllm")}
    assert references_of(auto) == {("BaseModel", NS, "smollm2"), ("ClusterBaseModel", "", "smollm2"),
                                   ("ServingRuntime", NS, "*"), ("ClusterServingRuntime", "", "*")}
    assert ("BaseModel", NS, "shared") not in references_of(cm)
    assert {("FineTunedWeight", NS, "sql"), ("FineTunedWeight", NS, "chat")} <= references_of(lora)
    assert ("ClusterServingRuntime", "", "my-vllm") not in references_of(local_rt)
    # a spec the renderer rejects is indexed from its raw fields all the same
    broken = {"metadata": {"name": "x", "namespace": NS}, "spec": {"model": {"name": "m"}, "engine": "junk"}}
    assert ("BaseModel", NS, "m") in references_of(broken)


def test_which_services_are_rerendered():
    index = build_index(_ref_services())
    assert dependents(index, "BaseModel", NS, "smollm2") == [(NS, "auto"), (NS, "lora")]
    assert dependents(index, "BaseModel", "team-b", "smollm2") == [("team-b", "elsewhere")]
    # a ClusterBaseModel reaches services in every namespace that do not pin BaseModel
    assert dependents(index, "ClusterBaseModel", None, "smollm2") == [(NS, "auto"), (NS, "lora"),
                                                                      ("team-b", "elsewhere")]
    assert dependents(index, "ClusterBaseModel", None, "shared") == [(NS, "cm")]
    assert dependents(index, "BaseModel", NS, "shared") == []
    # any runtime change may change an auto-selection
    assert dependents(index, "ClusterServingRuntime", None, "vllm") == [(NS, "auto"), (NS, "named"),
                                                                        ("team-b", "elsewhere")]
    assert dependents(index, "ServingRuntime", NS, "my-vllm") == [(NS, "auto"), (NS, "local-rt")]
    assert dependents(index, "ServingRuntime", "team-b", "anything") == [("team-b", "elsewhere")]
    assert dependents(index, "FineTunedWeight", NS, "sql") == [(NS, "lora")]
    assert dependents(index, "FineTunedWeight", NS, "unused") == []
    with pytest.raises(ValueError, match="not a referenced kind"):
        dependents(index, "Deployment", NS, "x")


# --------------------------------------------------------------------------- readiness

def _deploy(replicas: int | None, ready: int, generation: int = 3, observed: int = 3,
            conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec = {} if replicas is None else {"replicas": replicas}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "generation": generation},
            "spec": spec, "status": {"observedGeneration": observed, "readyReplicas": ready,
                                     "conditions": conditions or []}}


def _pod(name: str, component: str = "engine", *, waiting: str | None = None, init_running: bool = False,
         unschedulable: bool = False, init_exit: int | None = None, init_name: str = "model-download"
         ) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": []}
    if waiting:
        status["containerStatuses"] = [{"name": "engine", "state": {"waiting": {"reason": waiting,
                                                                                 "message": "back-off"}}}]
    if init_running:
        status["initContainerStatuses"] = [{"name": init_name, "state": {"running": {}}}]
    if init_exit is not None:
        status["initContainerStatuses"] = [{"name": init_name, "state": {"waiting": {"reason": "PodInitializing"}},
                                            "lastState": {"terminated": {"exitCode": init_exit,
                                                                         "reason": "Error"}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    return {"metadata": {"name": name, "labels": {"kvfleet.io/inference-service": "chat",
                                                  "kvfleet.io/component": component}}, "status": status}


@pytest.mark.parametrize("live,min_replicas,pods,ready,reason", [
    (None, 1, [], False, "WorkloadNotFound"),
    (_deploy(1, 1), 1, [], True, "MinimumReplicasAvailable"),
    (_deploy(4, 2), 1, [], True, "MinimumReplicasAvailable"),        # autoscaler scaled up, floor is ready
    (_deploy(4, 1), 2, [], False, "ReplicasNotReady"),
    (_deploy(None, 1), 1, [], True, "MinimumReplicasAvailable"),     # replicas defaulted by the API server
    (_deploy(1, 1, generation=4, observed=3), 1, [], False, "RolloutInProgress"),
    (_deploy(0, 0), 0, [], True, "ScaledToZero"),
    (_deploy(0, 0), 1, [], False, "NoReplicas"),
    (_deploy(1, 0), 1, [_pod("p", waiting="ImagePullBackOff")], False, "ImagePullBackOff"),
    (_deploy(1, 0), 1, [_pod("p", waiting="ErrImagePull")], False, "ImagePullBackOff"),
    (_deploy(1, 0), 1, [_pod("p", waiting="CrashLoopBackOff")], False, "CrashLoopBackOff"),
    (_deploy(1, 0), 1, [_pod("p", unschedulable=True)], False, "Unschedulable"),
    (_deploy(1, 0), 1, [_pod("p", init_running=True)], False, "Initializing"),
    (_deploy(1, 0), 1, [_pod("p", waiting="ContainerCreating")], False, "ReplicasNotReady"),
    (_deploy(2, 0, conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                "message": "ReplicaSet has timed out progressing."}]),
     1, [], False, "ProgressDeadlineExceeded"),
])
def test_workload_readiness(live, min_replicas, pods, ready, reason):
    r = workload_readiness("engine", "Deployment", "chat-engine", live, min_replicas, pods)
    assert (r.ready, r.reason) == (ready, reason), r.message
    assert "chat-engine" in r.message


def test_leader_worker_set_readiness_counts_groups():
    lws = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
           "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1}}
    r = workload_readiness("engine", "LeaderWorkerSet", "chat-engine", lws, 1)
    assert r.ready and r.replicas == 2 and r.ready_replicas == 1 and "1/2 groups" in r.message
    unschedulable = workload_readiness("engine", "LeaderWorkerSet", "x", {**lws, "status": {"observedGeneration": 1}},
                                       1, [_pod("x-0", unschedulable=True)])
    assert unschedulable.reason == "Unschedulable" and "nvidia.com/gpu" in unschedulable.message


def test_download_job_condition():
    assert job_condition(None, "j").reason == "Downloading"
    done = job_condition({"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}, "j")
    assert (done.status, done.reason) == ("True", "Downloaded")
    failed = job_condition({"status": {"failed": 7, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "too many"}]}}, "j")
    assert (failed.status, failed.reason) == ("False", "DownloadFailed") and "BackoffLimitExceeded" in failed.message
    running = job_condition({"status": {"active": 1, "failed": 2}}, "j")
    assert (running.status, running.reason) == ("False", "Downloading") and "2 failed" in running.message


def _observed(plan, ready: dict[str, int], pods: list[dict[str, Any]] = (),
              desired: dict[str, int] | None = None) -> Observed:
    """Live workloads of ``plan`` with ``ready[component]`` ready replicas; an autoscaled workload
    (no rendered ``replicas``) has ``desired[component]`` (default 1), as its autoscaler set it."""
    obs = Observed(pods=list(pods))
    for m in plan.manifests:
        if m["kind"] in ("Deployment", "LeaderWorkerSet"):
            role = m["metadata"]["labels"]["kvfleet.io/component"]
            replicas = m["spec"].get("replicas", (desired or {}).get(role, 1))
            obs.objects[(m["kind"], m["metadata"]["name"])] = {
                "metadata": {"name": m["metadata"]["name"], "generation": 1}, "spec": {"replicas": replicas},
                "status": {"observedGeneration": 1, "readyReplicas": ready.get(role, 0)}}
    return obs


def test_status_of_a_ready_service(validator):
    plan = _plan(_svc())
    status = service_status(plan, _observed(plan, {"engine": 1, "router": 1}), now=T0)
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "ModelReady": ("True", "ModelResolved"), "RuntimeResolved": ("True", "RuntimeResolved"),
        "EngineReady": ("True", "MinimumReplicasAvailable"), "RouterReady": ("True", "MinimumReplicasAvailable"),
        "Ready": ("True", "Ready")}
    assert [c["type"] for c in status["conditions"]] == ["ModelReady", "RuntimeResolved", "EngineReady",
                                                         "RouterReady", "Ready"]
    assert status["url"] == f"http://chat.{NS}.svc.cluster.local" and status["deploymentMode"] == "Standard"
    assert status["runtime"] == "ClusterServingRuntime/kvfleet"
    assert status["components"] == {"engine": {"replicas": 1, "readyReplicas": 1},
                                    "router": {"replicas": 1, "readyReplicas": 1}}
    assert all(c["observedGeneration"] == 2 and c["lastTransitionTime"] == "2026-01-01T00:00:00Z"
               for c in status["conditions"])
    InferenceServiceStatus.model_validate(status)
    body = {**_svc(), "status": status}
    body["metadata"] = {"name": "chat", "namespace": NS}
    validator.validate(body)  # the status fits the CRD's schema


def test_status_transitions_keep_their_time():
    plan = _plan(_svc())
    first = service_status(plan, _observed(plan, {"engine": 0, "router": 1}), now=T0)
    assert _cond(first, "Ready")["status"] == "False" and _cond(first, "Ready")["reason"] == "ReplicasNotReady"
    second = service_status(plan, _observed(plan, {"engine": 1, "router": 1}), previous=first, now=T1)
    assert _cond(second, "EngineReady")["lastTransitionTime"] == "2026-01-02T00:00:00Z"
    assert _cond(second, "ModelReady")["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_prefill_decode_status_names_every_pool():
    plan = _plan(_svc(mode="PrefillDecodeDisaggregated"))
    status = service_status(plan, _observed(plan, {"prefill": 1, "decode": 0, "router": 1}), now=T0)
    er = _cond(status, "EngineReady")
    assert (er["status"], er["reason"]) == ("False", "ReplicasNotReady")
    assert "prefill:" in er["message"] and "decode:" in er["message"]
    assert set(status["components"]) == {"prefill", "decode", "router"}
    assert status["components"]["decode"] == {"replicas": 2, "readyReplicas": 0}


def test_serverless_at_zero_and_router_disabled():
    plan = _plan(_svc(mode="Serverless"))
    st = service_status(plan, _observed(plan, {"router": 1}, desired={"engine": 0}), now=T0)
    assert _cond(st, "EngineReady")["reason"] == "ScaledToZero" and _cond(st, "Ready")["status"] == "True"
    plan = _plan(_svc(router={"enabled": False}))
    st = service_status(plan, _observed(plan, {"engine": 1}), now=T0)
    assert _cond(st, "RouterReady")["reason"] == "RouterDisabled" and _cond(st, "Ready")["status"] == "True"
    assert "router" not in st["components"]


def test_model_download_failures_reach_model_ready():
    plan = _plan(_svc())  # EmptyDir: the download runs as an initContainer of each engine pod
    pods = [_pod("chat-engine-1", init_exit=1)]
    st = service_status(plan, _observed(plan, {"router": 1}, pods), now=T0)
    mr = _cond(st, "ModelReady")
    assert (mr["status"], mr["reason"]) == ("False", "DownloadFailed") and "exited with code 1" in mr["message"]
    assert _cond(st, "Ready")["reason"] == "DownloadFailed"
    pvc = _plan(_svc(modelStorage={"type": "PersistentVolumeClaim"}))
    job = next(m["metadata"]["name"] for m in pvc.manifests if m["kind"] == "Job")
    obs = _observed(pvc, {"engine": 0, "router": 1})
    assert _cond(service_status(pvc, obs, now=T0), "ModelReady")["reason"] == "Downloading"
    obs.objects[("Job", job)] = {"status": {"succeeded": 1}}
    assert _cond(service_status(pvc, obs, now=T0), "ModelReady")["reason"] == "Downloaded"


# --------------------------------------------------------------------------- prune

def test_stale_objects_only_touches_what_the_service_owns():
    plan = _plan(_svc(modelStorage={"type": "PersistentVolumeClaim"}))
    labels = {"kvfleet.io/inference-service": "chat"}
    owner = [{"apiVersion": API_VERSION, "kind": "InferenceService", "name": "chat", "uid": UID, "controller": True}]
    old_job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": "chat-download-0badc0de", "labels": labels, "ownerReferences": owner}}
    foreign = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": "chat-backup", "labels": labels,
        "ownerReferences": [{**owner[0], "uid": "someone-else"}]}}
    unlabelled = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "ownerReferences": owner}}
    hpa_v1 = {"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler",
              "metadata": {"name": "chat-router", "labels": labels, "ownerReferences": owner}}
    live = [*copy.deepcopy(plan.manifests), old_job, foreign, unlabelled]
    assert stale_objects(live, plan.manifests, "chat", UID) == [old_job]
    # the same object read through another API version is still the rendered one
    no_keda = _plan(_svc(router={"minReplicas": 1, "maxReplicas": 3}), options=RenderOptions(keda=False))
    assert any(m["kind"] == "HorizontalPodAutoscaler" and m["metadata"]["name"] == "chat-router"
               for m in no_keda.manifests)
    assert stale_objects([hpa_v1], no_keda.manifests, "chat", UID) == []
    assert stale_objects([hpa_v1], plan.manifests, "chat", UID) == [hpa_v1]


# --------------------------------------------------------------------------- reconcile over an in-memory API

def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


class MemoryCluster:
    """An in-memory API server for the operator's :class:`ClusterAPI`: server-side apply creates or
    replaces what the manager sends (status kept, generation bumped on a spec change), lists filter
    by ``k=v`` label selectors, kinds outside ``served`` are not served (CRD not installed)."""

    def __init__(self, served: set[tuple[str, str]] | None = None) -> None:
        kvfleet = {(API_VERSION, k) for k in ("InferenceService", "BaseModel", "ClusterBaseModel", "ServingRuntime",
                                              "ClusterServingRuntime", "FineTunedWeight")}
        self.served = served if served is not None else {*MANAGED_KINDS, *kvfleet, ("v1", "Pod")}
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.applied: list[str] = []
        self.deleted: list[str] = []
        self.uids = 0

    def _check(self, api_version: str, kind: str) -> None:
        if (api_version, kind) not in self.served:
            raise ClusterError("CRDNotInstalled", f"the cluster does not serve {api_version} {kind}")

    def _key(self, api_version: str, kind: str, name: str, namespace: str | None):
        return (_group(api_version), kind, namespace or "", name)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.uids += 1
        obj = copy.deepcopy(obj)
        obj["metadata"].update(uid=f"uid-{self.uids}", generation=1)
        self.objects[self._key(obj["apiVersion"], obj["kind"], obj["metadata"]["name"],
                               obj["metadata"].get("namespace"))] = obj
        return obj

    def serves(self, api_version: str, kind: str) -> bool:
        return (api_version, kind) in self.served

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self._check(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        key = self._key(manifest["apiVersion"], manifest["kind"], meta["name"], meta.get("namespace"))
        self.applied.append(f"{manifest['kind']}/{meta['name']}")
        old = self.objects.get(key)
        if old is None:
            return self.create(manifest)
        new = copy.deepcopy(manifest)
        new["metadata"].update(uid=old["metadata"]["uid"], generation=old["metadata"]["generation"] +
                               (old.get("spec") != manifest.get("spec")))
        if "status" in old:
            new["status"] = old["status"]
        self.objects[key] = new
        return new

    def get(self, api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        self._check(api_version, kind)
        obj = self.objects.get(self._key(api_version, kind, name, namespace))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        self._check(api_version, kind)
        want = dict(p.split("=", 1) for p in label_selector.split(",")) if label_selector else {}
        out = []
        for (g, k, ns, _), obj in sorted(self.objects.items()):
            labels = obj["metadata"].get("labels") or {}
            if (g, k) == (_group(api_version), kind) and (namespace is None or ns == namespace) and \
                    all(labels.get(a) == b for a, b in want.items()):
                out.append(copy.deepcopy(obj))
        return out

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None) -> None:
        self._check(api_version, kind)
        self.deleted.append(f"{kind}/{name}")
        self.objects.pop(self._key(api_version, kind, name, namespace), None)

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None,
                     status: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[self._key(api_version, kind, name, namespace)]
        obj["status"] = copy.deepcopy(status)
        return copy.deepcopy(obj)

    def mark_ready(self, namespace: str) -> None:
        for (_, kind, ns, _), obj in self.objects.items():
            if kind in ("Deployment", "LeaderWorkerSet") and ns == namespace:
                obj["status"] = {"observedGeneration": obj["metadata"]["generation"],
                                 "readyReplicas": obj["spec"].get("replicas", 1)}
                obj["spec"].setdefault("replicas", 1)


def _cluster_with(*docs: dict[str, Any], served: set[tuple[str, str]] | None = None):
    cluster = MemoryCluster(served)
    for d in _models(*docs):
        cluster.create(d)
    return cluster


def _live_service(cluster: MemoryCluster, body: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"].pop("uid", None)
    live = cluster.create(body)
    return copy.deepcopy(live)


def test_reconcile_applies_writes_status_and_prunes_old_download_jobs():
    cluster = _cluster_with()
    live = _live_service(cluster, _svc(modelStorage={"type": "PersistentVolumeClaim"}))
    uid = live["metadata"]["uid"]
    result = reconcile_service(cluster, live, now=T0)
    assert not result.errors and result.pruned == []
    assert result.applied == [f"{m['kind']}/{m['metadata']['name']}" for m in result.plan.manifests]
    engine = cluster.get("apps/v1", "Deployment", "chat-engine", NS)
    assert engine["metadata"]["ownerReferences"][0]["uid"] == uid
    stored = cluster.get(API_VERSION, "InferenceService", "chat", NS)["status"]
    assert stored == result.status and _cond(stored, "EngineReady")["reason"] == "ReplicasNotReady"
    assert _cond(stored, "ModelReady")["reason"] == "Downloading"
    old_job = next(m for m in result.plan.manifests if m["kind"] == "Job")["metadata"]["name"]

    # the BaseModel changes: the service is re-rendered with a new download Job, the old one pruned
    model = cluster.get(API_VERSION, "BaseModel", "smollm2", NS)
    model["spec"]["sha256"] = "b" * 64
    cluster.apply(model)
    cluster.mark_ready(NS)
    live = cluster.get(API_VERSION, "InferenceService", "chat", NS)
    result = reconcile_service(cluster, live, now=T1)
    new_job = next(m for m in result.plan.manifests if m["kind"] == "Job")["metadata"]["name"]
    assert new_job != old_job and result.pruned == [f"Job/{old_job}"]
    assert cluster.get("batch/v1", "Job", old_job, NS) is None
    assert cluster.get("batch/v1", "Job", new_job, NS) is not None
    status = cluster.get(API_VERSION, "InferenceService", "chat", NS)["status"]
    # the pod template changed (new wait-for-model markers): the old replica serves during the rollout
    assert _cond(status, "EngineReady")["reason"] == "RolloutInProgress"
    assert _cond(status, "ModelReady")["reason"] == "Downloading"  # the new Job has not finished
    cluster.mark_ready(NS)
    result = reconcile_service(cluster, cluster.get(API_VERSION, "InferenceService", "chat", NS), apply=False)
    assert _cond(result.status, "EngineReady")["status"] == "True"
    assert _cond(result.status, "Ready")["reason"] == "Downloading"


def test_reconcile_reports_missing_crds_and_does_not_prune():
    served = {k for k in MemoryCluster().served if k[1] != "ScaledObject"}
    cluster = _cluster_with(served=served)
    live = _live_service(cluster, _svc())
    result = reconcile_service(cluster, live, OperatorConfig(), now=T0)
    assert [(e.kind, e.reason) for e in result.errors] == [("ScaledObject", "CRDNotInstalled")]
    assert "--no-keda" in result.errors[0].message and not result.transient
    er = _cond(result.status, "EngineReady")
    assert (er["status"], er["reason"]) == ("False", "CRDNotInstalled")
    assert _cond(result.status, "RouterReady")["reason"] == "ReplicasNotReady"
    assert cluster.get("apps/v1", "Deployment", "chat-engine", NS) is not None  # the rest was applied
    # with HPAs instead, everything applies
    result = reconcile_service(cluster, cluster.get(API_VERSION, "InferenceService", "chat", NS),
                               OperatorConfig(render=RenderOptions(keda=False)), now=T0)
    assert not result.errors and cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", "chat-engine", NS)


def test_reconcile_of_a_broken_spec_leaves_running_objects_alone():
    cluster = _cluster_with()
    live = _live_service(cluster, _svc())
    reconcile_service(cluster, live, now=T0)
    before = dict(cluster.objects)
    live = cluster.get(API_VERSION, "InferenceService", "chat", NS)
    live["spec"]["model"]["name"] = "gone"
    cluster.apply(live)
    result = reconcile_service(cluster, cluster.get(API_VERSION, "InferenceService", "chat", NS), now=T1)
    assert result.applied == [] and result.pruned == [] and cluster.deleted == []
    assert {k for k in cluster.objects} == {k for k in before}
    assert _cond(result.status, "Ready")["reason"] == "ModelNotFound"
    assert result.status["observedGeneration"] == 2


def test_status_only_refresh_applies_nothing():
    cluster = _cluster_with()
    live = _live_service(cluster, _svc())
    reconcile_service(cluster, live, now=T0)
    cluster.mark_ready(NS)
    cluster.applied.clear()
    live = cluster.get(API_VERSION, "InferenceService", "chat", NS)
    applied_generation = live["status"]["observedGeneration"]
    live["metadata"]["generation"] = applied_generation + 1  # a spec change the update handler has not handled
    result = reconcile_service(cluster, live, apply=False, now=T1)
    assert cluster.applied == [] and _cond(result.status, "Ready")["status"] == "True"
    assert result.status["observedGeneration"] == applied_generation


# --------------------------------------------------------------------------- kopf handlers

def test_kopf_handlers_rerender_dependents_and_write_model_status(tmp_path):
    kopf = pytest.importorskip("kopf")
    from kvfleet.control.operator import register

    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    model = _file_model(f, "0" * 64)
    model["metadata"]["name"] = "smollm2"
    cluster = MemoryCluster()
    cluster.create(model)
    for d in _models()[1:]:
        cluster.create(d)
    a = _live_service(cluster, _svc("a", runtime="kvfleet"))
    b = _live_service(cluster, _svc("b", runtime="vllm", model="qwen"))
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig(), cluster)

    changing = registry._changing.get_all_handlers()
    ids = {str(h.id) for h in changing}
    assert {"reconcile_inference_service", "changed.basemodels", "updated.clusterservingruntimes",
            "resumed.basemodels"} <= ids
    plurals = {h.selector.plural for h in changing}
    assert plurals == {"inferenceservices", "basemodels", "clusterbasemodels", "servingruntimes",
                       "clusterservingruntimes", "finetunedweights"}
    watching = {str(h.id): h for h in registry._watching.get_all_handlers()}
    assert {h.selector.plural for h in watching.values()} == {
        "deployments", "jobs", "leaderworkersets",  # owned workloads: status refresh
        "basemodels", "clusterbasemodels", "servingruntimes", "clusterservingruntimes", "finetunedweights"}
    # handlers get the index as a keyword argument named after its id
    assert [(h.selector.plural, str(h.id)) for h in registry._indexing.get_all_handlers()] == [
        ("inferenceservices", "kvfleet_references")]
    assert [h.selector.plural for h in registry._spawning.get_all_handlers()] == ["inferenceservices"]

    index = build_index([a, b])
    changed = next(h for h in changing if str(h.id) == "changed.basemodels")
    changed.fn(body=cluster.get(API_VERSION, "BaseModel", "smollm2", NS), name="smollm2", namespace=NS,
               kvfleet_references=index)
    verified = _cond(cluster.get(API_VERSION, "BaseModel", "smollm2", NS)["status"], "Verified")
    assert verified["reason"] == "Sha256Mismatch"
    status_a = cluster.get(API_VERSION, "InferenceService", "a", NS).get("status")
    assert _cond(status_a, "ModelReady")["reason"] == "Sha256Mismatch"  # re-rendered, and blocked
    assert "status" not in cluster.get(API_VERSION, "InferenceService", "b", NS)  # not a dependent

    reconcile = next(h for h in changing if str(h.id) == "reconcile_inference_service")
    reconcile.fn(body=cluster.get(API_VERSION, "InferenceService", "b", NS))
    assert cluster.get("apps/v1", "Deployment", "b-engine", NS) is not None

    workload = watching["workload_status.deployments"]
    cluster.mark_ready(NS)
    workload.fn(body=cluster.get("apps/v1", "Deployment", "b-engine", NS), namespace=NS, type="MODIFIED")
    assert _cond(cluster.get(API_VERSION, "InferenceService", "b", NS)["status"], "EngineReady")["status"] == "True"

    # deleting the model re-renders its dependents, which now say why they cannot run
    removed = watching["removed.basemodels"]
    cluster.delete(API_VERSION, "BaseModel", "qwen", NS)
    removed.fn(name="qwen", namespace=NS, kvfleet_references=index, type="MODIFIED")  # not a deletion
    assert _cond(cluster.get(API_VERSION, "InferenceService", "b", NS)["status"], "ModelReady")["status"] == "True"
    removed.fn(name="qwen", namespace=NS, kvfleet_references=index, type="DELETED")
    mr = _cond(cluster.get(API_VERSION, "InferenceService", "b", NS)["status"], "ModelReady")
    assert (mr["status"], mr["reason"]) == ("False", "ModelNotFound")
    assert cluster.get("apps/v1", "Deployment", "b-engine", NS) is not None  # what runs keeps running


def test_transient_api_errors_become_kopf_retries():
    kopf = pytest.importorskip("kopf")
    from kvfleet.control.operator import register

    class Flaky(MemoryCluster):
        def apply(self, manifest):
            raise ClusterError("ApiError", "503 Service Unavailable", 503, transient=True)

    cluster = Flaky()
    for d in _models():
        cluster.create(d)
    live = _live_service(cluster, _svc())
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig(), cluster)
    handler = next(h for h in registry._changing.get_all_handlers() if str(h.id) == "reconcile_inference_service")
    with pytest.raises(kopf.TemporaryError):
        handler.fn(body=live)
    er = _cond(cluster.get(API_VERSION, "InferenceService", "chat", NS)["status"], "EngineReady")
    assert (er["status"], er["reason"]) == ("False", "ApplyFailed") and "503" in er["message"]


def test_operator_cli_flags():
    from kvfleet.cli import build_parser
    from kvfleet.control.operator import config_from_args

    args = build_parser().parse_args(["operator", "-n", "llm", "-n", "team-b", "--no-keda", "--gateway", "gw",
                                      "--resync-seconds", "60", "--no-verify-sources"])
    cfg = config_from_args(args)
    assert cfg.namespaces == ("llm", "team-b") and cfg.render.keda is False and cfg.render.gateway == "gw"
    assert cfg.resync_seconds == 60 and cfg.verify_sources is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--resync-seconds", "0"])
