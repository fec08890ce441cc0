"""The operator against a real Kubernetes API server (KUBECONFIG, ~/.kube/config or in-cluster):
install the CRDs, create the example InferenceService in a fresh namespace, reconcile it (handlers,
then kopf itself for a second service) and check the Deployment appears with its ownerReference and
the status conditions are written. Skipped, saying why, when no API server is reachable; the
logic is covered without one by test_operator.py."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from kvfleet.control.api.common import API_VERSION
from kvfleet.control.api.crds import generate
from kvfleet.control.operator import ClusterError, KubeCluster, OperatorConfig, reconcile_service
from kvfleet.control.render import RenderOptions
from tests.control.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "standard-smollm2.yaml"


def _skip(why: str) -> None:
    pytest.skip(f"no Kubernetes API server reachable: {why}")


@pytest.fixture(scope="module")
def cluster() -> KubeCluster:
    from kubernetes import client, config

    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    if not in_cluster and not any(Path(p).is_file() for p in kubeconfig.split(os.pathsep)):
        _skip("KUBECONFIG is unset (or names no file), there is no ~/.kube/config and this is not a pod")
    try:
        if in_cluster:
            config.load_incluster_config()
        else:
            config.load_kube_config()
        api = client.ApiClient()
    except (config.ConfigException, OSError) as e:
        _skip(f"cannot load the configuration: {e}")
    url = urlparse(api.configuration.host)
    try:  # fail fast on an address nobody answers (the client itself has no connect timeout)
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), 3).close()
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as e:  # connection refused, TLS or auth errors
        _skip(f"{api.configuration.host}: {e}")
    try:
        return KubeCluster(api, field_manager="kvfleet-test")
    except ClusterError as e:
        _skip(str(e))


@pytest.fixture(scope="module")
def namespace(cluster: KubeCluster):
    for crd in generate().values():
        cluster.apply(crd)

    def served() -> bool:
        cluster.dyn.resources.invalidate_cache()
        return cluster.serves(API_VERSION, "InferenceService") and cluster.serves(API_VERSION, "BaseModel")

    wait_for("the kvfleet CRDs to be served", served)
    ns = f"kvfleet-e2e-{uuid.uuid4().hex[:8]}"
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    cluster.delete("v1", "Namespace", ns, None)


def _example(namespace: str, name: str | None = None) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = namespace
        if name and d["kind"] == "InferenceService":
            d["metadata"]["name"] = name
    return docs


def _options(cluster: KubeCluster) -> OperatorConfig:
    return OperatorConfig(render=RenderOptions(keda=cluster.serves("keda.sh/v1alpha1", "ScaledObject")))


def test_reconcile_against_the_api_server(cluster: KubeCluster, namespace: str):
    for d in _example(namespace):
        cluster.apply(d)
    live = cluster.get(API_VERSION, "InferenceService", "smollm2-chat", namespace)
    uid = live["metadata"]["uid"]
    result = reconcile_service(cluster, live, _options(cluster))
    assert result.errors == [], result.errors
    engine = cluster.get("apps/v1", "Deployment", "smollm2-chat-engine", namespace)
    assert engine is not None
    (owner,) = engine["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("InferenceService", "smollm2-chat",
                                                                                 uid, True)
    status = cluster.get(API_VERSION, "InferenceService", "smollm2-chat", namespace)["status"]
    conds = {c["type"]: c for c in status["conditions"]}
    assert set(conds) == {"ModelReady", "RuntimeResolved", "EngineReady", "RouterReady", "Ready"}
    assert conds["ModelReady"]["status"] == "True" and conds["RuntimeResolved"]["status"] == "True"
    assert all(c["reason"] for c in conds.values())
    assert status["url"] == f"http://smollm2-chat.{namespace}.svc.cluster.local"
    # a second round applies the same objects and prunes nothing
    again = reconcile_service(cluster, cluster.get(API_VERSION, "InferenceService", "smollm2-chat", namespace),
                              _options(cluster))
    assert again.errors == [] and again.pruned == []


def test_kopf_operator_reconciles_a_new_service(cluster: KubeCluster, namespace: str):
    kopf = pytest.importorskip("kopf")
    from kopf.testing import KopfRunner

    from kvfleet.control.operator import register

    registry = kopf.OperatorRegistry()
    register(registry, _options(cluster), cluster)
    with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry, timeout=120):
        for d in _example(namespace, "smollm2-kopf"):
            cluster.apply(d)
        deployment = wait_for("the operator to create smollm2-kopf-engine",
                           lambda: cluster.get("apps/v1", "Deployment", "smollm2-kopf-engine", namespace))
        assert deployment["metadata"]["ownerReferences"][0]["name"] == "smollm2-kopf"
        status = wait_for("the operator to write the status",
                       lambda: cluster.get(API_VERSION, "InferenceService", "smollm2-kopf", namespace).get("status"))
        assert {c["type"] for c in status["conditions"]} >= {"ModelReady", "Ready"}
