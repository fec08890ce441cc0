"""The operator against a real kube-apiserver + etcd started by the tests (tests/control/apiserver.py):
install kvfleet's CRDs and the upstream ones the renderer uses, run ``kvfleet operator`` as a process,
and check what the API server shows: the rendered objects applied with their controlling
ownerReference, status conditions written, a re-render when the BaseModel changes, and pruning.

There is no controller-manager: Deployments get no pods (EngineReady stays False) and deleting the
InferenceService leaves its objects (their ownerReference names it: a cluster's garbage collector
would delete them). An API server too old to serve some rendered kind (``policy/v1``
PodDisruptionBudget before Kubernetes 1.21) must be reported in the status, naming it, and then the
operator prunes nothing; the pruning is checked through :func:`kvfleet.control.operator.prune` there.

Skipped, saying why, without the etcd and kube-apiserver binaries (``KUBEBUILDER_ASSETS``,
``/usr/local/kubebuilder/bin`` or ``PATH``; ``setup-envtest use`` downloads them). Slow: the
API server takes 10-30 s to start.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from kvfleet.control.api.common import API_VERSION
from kvfleet.control.api.crds import generate
from kvfleet.control.operator import ClusterError, KubeCluster, load_catalog, prune
from kvfleet.control.reconcile import plan_service
from kvfleet.control.render import RenderOptions
from tests.control.apiserver import LocalAPIServer, find_binaries
from tests.control.conftest import SHARED_CRDS, UPSTREAM, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "standard-smollm2.yaml"
CRD_API = "apiextensions.k8s.io/v1"


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory) -> LocalAPIServer:
    """A running etcd + kube-apiserver (session-scoped)."""
    pytest.importorskip("cryptography")
    found = find_binaries()
    if found is None:
        pytest.skip("no etcd and kube-apiserver binaries (set KUBEBUILDER_ASSETS to a folder holding both, "
                    "e.g. from setup-envtest)")
    server = LocalAPIServer(tmp_path_factory.mktemp("apiserver"), *found)
    server.start()
    yield server
    server.stop()


def _established(crd: dict) -> bool:
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd.get("status") or {}).get("conditions") or [])


def _without(node, drop):
    """``node`` (a CRD) without the mapping entries ``drop(key, value)`` selects, at any depth."""
    if isinstance(node, dict):
        return {k: _without(v, drop) for k, v in node.items() if not drop(k, v)}
    if isinstance(node, list):
        return [_without(v, drop) for v in node]
    return node


def _schemaless(crd: dict) -> dict:
    out = copy.deepcopy(crd)
    for v in out["spec"]["versions"]:
        v["schema"] = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    return out


@pytest.fixture(scope="session")
def kube(apiserver: LocalAPIServer) -> KubeCluster:
    """The API server with kvfleet's CRDs and the upstream CRDs (KEDA, Gateway API, InferencePool,
    LeaderWorkerSet) installed and established."""
    cluster = KubeCluster(apiserver.api_client(), field_manager="kvfleet-test")
    missing = [f for f in UPSTREAM if not (SHARED_CRDS / f).is_file()]
    if missing:
        pytest.skip(f"upstream CRDs missing from {SHARED_CRDS}: {missing}")
    ours = list(generate().values())
    upstream = [yaml.safe_load((SHARED_CRDS / f).read_text()) for f in UPSTREAM]
    for crd in ours + upstream:
        if _minor(apiserver) < 25:  # CEL rules (x-kubernetes-validations) need 1.25+; older servers refuse the field
            crd = _without(crd, lambda k, v: k == "x-kubernetes-validations")
        try:
            cluster.apply(crd)
        except ClusterError as e:
            # Kubernetes 1.20 refuses every string `default: ""` (it reads the default as null); later
            # servers accept it, and upstream CRDs use it. Only there: drop those defaults and retry;
            # an upstream CRD that still does not fit is installed schemaless (no controller reads it
            # here: it only has to store the rendered objects).
            if 'default: Invalid value: "null"' not in e.message:
                raise
            try:
                cluster.apply(_without(crd, lambda k, v: k == "default" and v == ""))
            except ClusterError:
                if crd["spec"]["group"] == "kvfleet.io":
                    raise
                cluster.apply(_schemaless(crd))
    crds = ours + upstream
    for crd in crds:
        name = crd["metadata"]["name"]
        wait_for(f"CRD {name} to be established", lambda n=name: _established(cluster.get(CRD_API,
                                                                                         "CustomResourceDefinition",
                                                                                         n, None)))
    cluster.dyn.resources.invalidate_cache()
    assert cluster.serves(API_VERSION, "InferenceService") and cluster.serves("keda.sh/v1alpha1", "ScaledObject")
    return cluster


@pytest.fixture
def namespace(kube: KubeCluster):
    ns = f"kvfleet-{uuid.uuid4().hex[:8]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    kube.delete("v1", "Namespace", ns, None)


def _example(namespace: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = namespace
    return docs


def test_crds_are_accepted_and_served(kube: KubeCluster):
    for kind in ("InferenceService", "BaseModel", "ClusterBaseModel", "ServingRuntime", "ClusterServingRuntime",
                 "FineTunedWeight"):
        assert kube.serves(API_VERSION, kind), kind
    for api_version, kind in (("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
                              ("gateway.networking.k8s.io/v1", "HTTPRoute"),
                              ("inference.networking.k8s.io/v1", "InferencePool")):
        assert kube.serves(api_version, kind), kind


def test_the_api_server_validates_our_schemas(kube: KubeCluster, namespace: str):
    """The CRDs' OpenAPI schemas are enforced by the server itself (types and enums, not only by kvfleet)."""
    bad = {"apiVersion": API_VERSION, "kind": "BaseModel", "metadata": {"name": "bad", "namespace": namespace},
           "spec": {"source": "file:///m.gguf", "format": "not-a-format"}}
    with pytest.raises(ClusterError) as e:
        kube.apply(bad)
    assert e.value.reason == "Invalid" and "spec.format" in e.value.message


def _operator(apiserver: LocalAPIServer, namespace: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": str(apiserver.kubeconfig), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvfleet", "operator", "--namespace", namespace,
                                 "--liveness", "", "--resync-seconds", "600", "--no-verify-sources"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def _conditions(kube: KubeCluster, ns: str, name: str) -> dict[str, dict]:
    live = kube.get(API_VERSION, "InferenceService", name, ns) or {}
    return {c["type"]: c for c in (live.get("status") or {}).get("conditions") or []}


def _minor(apiserver: LocalAPIServer) -> int:
    return int(re.match(r"v1\.(\d+)", apiserver.version).group(1))


def test_kvfleet_operator_reconciles_rerenders_and_prunes(apiserver: LocalAPIServer, kube: KubeCluster,
                                                          namespace: str, tmp_path: Path):
    ns = namespace
    # what the rendered manifests need: policy/v1 PodDisruptionBudget (1.21+) and the preStop sleep
    # action of the Deployments' containers (1.30+); an older server refuses them and the operator
    # must say so in the status
    pdb_served = kube.serves("policy/v1", "PodDisruptionBudget")
    deployments_fit = _minor(apiserver) >= 30
    proc = _operator(apiserver, ns, tmp_path / "operator.log")
    try:
        for d in _example(ns):
            kube.apply(d)
        uid = kube.get(API_VERSION, "InferenceService", "smollm2-chat", ns)["metadata"]["uid"]
        # 1. the rendered objects are applied, each controlled by the service
        wanted = [("Service", "v1", "smollm2-chat"), ("Service", "v1", "smollm2-chat-engine"),
                  ("ServiceAccount", "v1", "smollm2-chat-router"),
                  ("ScaledObject", "keda.sh/v1alpha1", "smollm2-chat-engine")]
        if deployments_fit:
            wanted += [("Deployment", "apps/v1", "smollm2-chat-engine"),
                       ("Deployment", "apps/v1", "smollm2-chat-router")]
        for kind, api, name in wanted:
            live = wait_for(f"the operator to apply {kind}/{name}", lambda a=api, k=kind, n=name: kube.get(a, k, n, ns),
                         timeout=90)
            (owner,) = live["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "InferenceService", "smollm2-chat", uid, True), (kind, name)
            assert live["metadata"]["labels"]["kvfleet.io/inference-service"] == "smollm2-chat"
            managers = {m["manager"] for m in live["metadata"].get("managedFields") or []}
            assert "kvfleet-operator" in managers  # server-side apply under the operator's field manager
        # 2. the status: conditions with reasons, written through the status subresource
        conds = wait_for("the status conditions", lambda: (c := _conditions(kube, ns, "smollm2-chat"))
                      and {"ModelReady", "RuntimeResolved", "EngineReady", "RouterReady", "Ready"} <= set(c) and c)
        assert conds["ModelReady"]["status"] == "True" and conds["RuntimeResolved"]["status"] == "True"
        assert conds["EngineReady"]["status"] == "False" and conds["Ready"]["status"] == "False"  # no pods here
        assert all(c["reason"] and c["message"] for c in conds.values())
        if not deployments_fit:  # the server's refusal, with the field it refused, is in the status
            assert conds["EngineReady"]["reason"] == "ApplyFailed", conds["EngineReady"]
            assert "preStop.sleep" in conds["EngineReady"]["message"]
        elif not pdb_served:
            assert "PodDisruptionBudget" in " ".join(c["message"] for c in conds.values()), conds
        status = kube.get(API_VERSION, "InferenceService", "smollm2-chat", ns)["status"]
        assert status["url"] == f"http://smollm2-chat.{ns}.svc.cluster.local"
        # 3. a change of the BaseModel re-renders the services using it
        model = next(d for d in _example(ns) if d["kind"] == "BaseModel")
        kube.delete(API_VERSION, "BaseModel", model["metadata"]["name"], ns)
        wait_for("ModelReady=False after the BaseModel is deleted",
              lambda: _conditions(kube, ns, "smollm2-chat")["ModelReady"]["status"] == "False", timeout=90)
        assert _conditions(kube, ns, "smollm2-chat")["ModelReady"]["reason"] == "ModelNotFound"
        new_sha = "ab" * 32  # a new pin: the engine pods' download step checks it
        model["spec"]["sha256"] = new_sha
        kube.apply(model)
        wait_for("ModelReady=True once the BaseModel is back",
              lambda: _conditions(kube, ns, "smollm2-chat")["ModelReady"]["status"] == "True", timeout=90)
        if deployments_fit:
            wait_for("the engine Deployment to be re-rendered with the new sha256",
                  lambda: new_sha in str(kube.get("apps/v1", "Deployment", "smollm2-chat-engine", ns)), timeout=90)
        # 4. pruning: without autoscaling the ScaledObject is no longer rendered
        svc = next(d for d in _example(ns) if d["kind"] == "InferenceService")
        svc["spec"]["engine"]["maxReplicas"] = svc["spec"]["engine"]["minReplicas"] = 1
        svc["spec"].pop("autoscaling", None)
        kube.apply(svc)
        if deployments_fit and pdb_served:  # the operator prunes after a clean apply
            wait_for("the operator to prune the ScaledObject",
                  lambda: kube.get("keda.sh/v1alpha1", "ScaledObject", "smollm2-chat-engine", ns) is None, timeout=90)
        else:  # it prunes nothing after a refused apply: prune the plan directly against the server
            live = kube.get(API_VERSION, "InferenceService", "smollm2-chat", ns)
            catalog, invalid = load_catalog(kube, ns)
            plan = plan_service(live, catalog, RenderOptions(), invalid)
            assert plan.manifests and not any(m["kind"] == "ScaledObject" for m in plan.manifests)
            assert kube.get("keda.sh/v1alpha1", "ScaledObject", "smollm2-chat-engine", ns) is not None
            assert prune(kube, plan, uid) == ["ScaledObject/smollm2-chat-engine"]
            assert kube.get("keda.sh/v1alpha1", "ScaledObject", "smollm2-chat-engine", ns) is None
            assert kube.get("v1", "Service", "smollm2-chat-engine", ns) is not None  # still rendered
        # an object with the service's label that the service does not own is never pruned
        ports = kube.get("v1", "Service", "smollm2-chat", ns)["spec"]["ports"]
        kube.apply({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "not-ours", "namespace": ns,
                                 "labels": {"kvfleet.io/inference-service": "smollm2-chat"}},
                    "spec": {"ports": [{"name": p["name"], "port": p["port"], "protocol": "TCP"} for p in ports],
                             "selector": {"app": "x"}}})
        catalog, invalid = load_catalog(kube, ns)
        plan = plan_service(kube.get(API_VERSION, "InferenceService", "smollm2-chat", ns), catalog,
                            RenderOptions(), invalid)
        assert plan.manifests and prune(kube, plan, uid) == []
        assert kube.get("v1", "Service", "not-ours", ns) is not None
        # 5. deleting the service: no garbage collector here; its objects name it as their controller
        kube.delete(API_VERSION, "InferenceService", "smollm2-chat", ns)
        wait_for("the InferenceService to be gone", lambda: kube.get(API_VERSION, "InferenceService", "smollm2-chat",
                                                                  ns) is None)
        left = kube.get("v1", "Service", "smollm2-chat", ns)
        assert left["metadata"]["ownerReferences"][0]["uid"] == uid
        assert proc.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
