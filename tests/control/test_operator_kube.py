""":class:`KubeCluster` on the wire: the kubernetes client's DynamicClient against a small local HTTP
server that answers API discovery and records every request, so the requests the operator makes
(server-side apply, status merge patches, label-selected lists, background deletes) are checked
without a cluster: method, path, query, content type and body."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from kvfleet.control.api.common import API_VERSION
from kvfleet.control.operator import ClusterError, KubeCluster

RESOURCES = {
    "/api/v1": ("v1", [("pods", "Pod", True), ("namespaces", "Namespace", False)]),
    "/apis/apps/v1": ("apps/v1", [("deployments", "Deployment", True)]),
    "/apis/kvfleet.io/v1alpha1": ("kvfleet.io/v1alpha1", [("inferenceservices", "InferenceService", True),
                                                           ("inferenceservices/status", "InferenceService", True),
                                                           ("clusterbasemodels", "ClusterBaseModel", False)]),
}


class Recorder(BaseHTTPRequestHandler):
    """Answers discovery; records other requests in ``server.requests`` and answers from
    ``server.replies[(method, path)] = (status, body)`` (default: 200 echoing the request body, with a
    ``kind``, as the API server returns the patched object)."""

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if self.command == "GET" and url.path == "/version":
            return self._send(200, {"major": "1", "minor": "37", "gitVersion": "v1.37.0"})
        if self.command == "GET" and url.path == "/apis":
            groups = [{"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                       "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                      for gv, _ in RESOURCES.values() if "/" in gv]
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        if self.command == "GET" and url.path in RESOURCES:
            gv, res = RESOURCES[url.path]
            return self._send(200, {"kind": "APIResourceList", "groupVersion": gv, "resources": [
                {"name": n, "singularName": n.rstrip("s"), "namespaced": ns, "kind": k,
                 "verbs": ["get", "list", "watch", "create", "patch", "delete"]} for n, k, ns in res]})
        body = json.loads(raw) if raw else None
        self.server.requests.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                                     "content_type": self.headers.get("Content-Type"), "body": body})
        status, reply = self.server.replies.get((self.command, url.path),
                                                (200, {"apiVersion": "v1", "kind": "Status", **(body or {})}))
        self._send(status, reply)

    do_GET = do_PATCH = do_DELETE = do_POST = _handle


@pytest.fixture
def api(tmp_path):
    from kubernetes import client

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.requests, server.replies = [], {}
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    cluster = KubeCluster(client.ApiClient(cfg), cache_file=str(tmp_path / "discovery.json"))
    yield cluster, server
    server.shutdown()
    server.server_close()
    thread.join()


DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-engine", "namespace": "llm", "labels": {"a": "b"}},
              "spec": {"replicas": 1}}


def test_server_side_apply(api):
    cluster, server = api
    server.replies[("PATCH", "/apis/apps/v1/namespaces/llm/deployments/chat-engine")] = (
        200, {**DEPLOYMENT, "metadata": {**DEPLOYMENT["metadata"], "uid": "u1"}})
    live = cluster.apply(DEPLOYMENT)
    assert live["metadata"]["uid"] == "u1"
    (req,) = server.requests
    assert req["method"] == "PATCH" and req["path"] == "/apis/apps/v1/namespaces/llm/deployments/chat-engine"
    assert req["content_type"] == "application/apply-patch+yaml"
    # kubernetes-client 36 sends "True", 37 "true"; the API server reads either
    assert req["query"]["fieldManager"] == ["kvfleet-operator"]
    assert [v.lower() for v in req["query"]["force"]] == ["true"] and set(req["query"]) == {"fieldManager", "force"}
    assert req["body"] == DEPLOYMENT


def test_status_patch_list_get_delete(api):
    cluster, server = api
    cluster.patch_status(API_VERSION, "InferenceService", "chat", "llm", {"url": "http://x"})
    server.replies[("GET", "/api/v1/namespaces/llm/pods")] = (200, {"kind": "PodList", "apiVersion": "v1",
                                                                    "items": [{"metadata": {"name": "p"}}]})
    pods = cluster.list("v1", "Pod", "llm", "kvfleet.io/inference-service=chat")
    server.replies[("GET", "/apis/apps/v1/namespaces/llm/deployments/gone")] = (
        404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
              "message": "deployments.apps \"gone\" not found"})
    missing = cluster.get("apps/v1", "Deployment", "gone", "llm")
    cluster.delete("apps/v1", "Deployment", "chat-engine", "llm")
    cluster.list(API_VERSION, "ClusterBaseModel", None)
    status, lst, get, delete, cluster_list = server.requests
    assert status["method"] == "PATCH"
    assert status["path"] == "/apis/kvfleet.io/v1alpha1/namespaces/llm/inferenceservices/chat/status"
    assert status["content_type"] == "application/merge-patch+json"
    assert status["body"] == {"status": {"url": "http://x"}}
    assert lst["query"] == {"labelSelector": ["kvfleet.io/inference-service=chat"]}
    assert pods == [{"metadata": {"name": "p"}, "apiVersion": "v1", "kind": "Pod"}]  # list items get their kind
    assert missing is None and get["method"] == "GET"
    assert delete["method"] == "DELETE" and delete["query"] == {"propagationPolicy": ["Background"]}
    assert cluster_list["path"] == "/apis/kvfleet.io/v1alpha1/clusterbasemodels"


def test_errors_are_typed(api):
    cluster, server = api
    assert cluster.serves("apps/v1", "Deployment") and not cluster.serves("keda.sh/v1alpha1", "ScaledObject")
    with pytest.raises(ClusterError) as e:
        cluster.apply({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x",
                                                                                            "namespace": "llm"}})
    assert e.value.reason == "CRDNotInstalled" and not e.value.transient
    path = "/apis/apps/v1/namespaces/llm/deployments/chat-engine"
    server.replies[("PATCH", path)] = (422, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                             "reason": "Invalid", "code": 422,
                                             "message": "Deployment.apps \"chat-engine\" is invalid: spec.x"})
    with pytest.raises(ClusterError) as e:
        cluster.apply(DEPLOYMENT)
    assert e.value.reason == "Invalid" and e.value.status == 422 and not e.value.transient
    assert "is invalid: spec.x" in e.value.message
    server.replies[("PATCH", path)] = (503, {"kind": "Status", "code": 503, "message": "etcd leader changed"})
    with pytest.raises(ClusterError) as e:
        cluster.apply(DEPLOYMENT)
    assert e.value.transient and e.value.status == 503
    server.replies[("DELETE", path)] = (404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": "gone"})
    cluster.delete("apps/v1", "Deployment", "chat-engine", "llm")  # already gone is fine
