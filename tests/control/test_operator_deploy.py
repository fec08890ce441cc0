"""``deploy/operator.yaml``: valid against the Kubernetes OpenAPI schema, RBAC exactly the operator's
needs (least privilege, and enough to grant the routers' Roles), a Deployment that runs
``kvfleet operator`` standalone; and the kinds the operator prunes cover everything the renderer
emits."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from kvfleet.control.api import KVFLEET_IMAGE, Catalog
from kvfleet.control.operator import MANAGED_PLURALS, required_permissions
from kvfleet.control.reconcile import MANAGED_KINDS
from kvfleet.control.render import RenderOptions, render_catalog, render_service
from tests.control import specs

REPO = Path(__file__).resolve().parents[2]
OPERATOR_YAML = REPO / "deploy" / "operator.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(OPERATOR_YAML.read_text()) if d}


def _expand(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_operator_yaml_validates(docs, validator):
    assert set(docs) == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"}
    for d in docs.values():
        validator.validate(d)


def test_rbac_is_exactly_what_the_operator_uses(docs):
    rules = docs["ClusterRole"]["rules"]
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
    granted = _expand(rules)
    needed = required_permissions()
    assert needed - granted == set(), "missing"
    assert granted - needed == set(), "granted but unused"
    # nothing that reads secrets, execs into pods or changes cluster-wide RBAC
    assert not {r for _, r, _ in granted} & {"secrets", "pods/exec", "clusterroles", "clusterrolebindings",
                                             "namespaces", "nodes"}


def test_operator_can_grant_the_router_role(docs):
    """Kubernetes RBAC refuses to create a Role granting more than its creator holds."""
    granted = _expand(docs["ClusterRole"]["rules"])
    catalog = Catalog.from_yaml((REPO / "examples" / "standard-smollm2.yaml").read_text(), "llm")
    role = next(m for m in render_catalog(catalog) if m["kind"] == "Role")
    assert _expand(role["rules"]) <= granted


def test_binding_and_deployment(docs):
    sa = docs["ServiceAccount"]["metadata"]
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": docs["ClusterRole"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
    dep = docs["Deployment"]
    assert dep["metadata"]["namespace"] == sa["namespace"] == docs["Namespace"]["metadata"]["name"]
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}  # standalone: never two at once
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == sa["name"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    assert c["image"] == KVFLEET_IMAGE
    assert c["command"] == ["kvfleet", "operator"]
    from kvfleet.cli import build_parser

    args = build_parser().parse_args(["operator", *c["args"]])
    port = next(p for p in c["ports"] if p["name"] == c["livenessProbe"]["httpGet"]["port"])
    liveness = urlparse(args.liveness)
    assert liveness.port == port["containerPort"] and liveness.path == c["livenessProbe"]["httpGet"]["path"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}  # discovery cache, kopf's temp files


def test_pruned_kinds_cover_every_rendered_kind():
    """The operator prunes by listing MANAGED_KINDS; a kind the renderer emits outside it would never
    be pruned (and would have no RBAC)."""
    seen: set[tuple[str, str]] = set()
    for mode, runtime in specs.VALID:
        catalog = specs.catalog(specs.service("svc", mode, runtime))
        svc = catalog.inference_services()[0]
        for opts in (RenderOptions(gateway="gw"), RenderOptions(keda=False) if mode != "Serverless" else None):
            if opts is not None:
                seen |= {(m["apiVersion"], m["kind"]) for m in render_service(svc, catalog, opts)}
    pvc = specs.catalog(specs.service("svc", "Standard", "vllm", modelStorage={"type": "PersistentVolumeClaim"},
                                      router={"minReplicas": 1, "maxReplicas": 2}))
    seen |= {(m["apiVersion"], m["kind"]) for m in render_catalog(pvc)}
    assert seen == set(MANAGED_KINDS)
    assert set(MANAGED_PLURALS) == {k for _, k in MANAGED_KINDS}
