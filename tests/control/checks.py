"""Hand checks of rendered manifests for rules the OpenAPI schemas do not carry: the API server's
semantic validation (names, labels, selectors, volume and port references) and the CEL rules
(``x-kubernetes-validations``) of the upstream CRDs that matter for what kvfleet renders."""

from __future__ import annotations

import re
from typing import Any

DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def pod_templates(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Pod templates inside a workload manifest."""
    kind = m["kind"]
    if kind in ("Deployment", "Job"):
        return [m["spec"]["template"]]
    if kind == "LeaderWorkerSet":
        t = m["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"], t["workerTemplate"]]
    return []


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Label-selector match."""
    return all(labels.get(k) == v for k, v in selector.items())


def _check_labels(where: str, labels: dict[str, str]) -> None:
    for k, v in labels.items():
        prefix, _, name = k.rpartition("/")
        assert not prefix or (len(prefix) <= 253 and DNS1123_SUBDOMAIN.match(prefix)), f"{where}: label key {k}"
        assert len(name) <= 63 and LABEL_NAME.match(name), f"{where}: label key {k}"
        assert isinstance(v, str) and len(v) <= 63 and LABEL_VALUE.match(v), f"{where}: label {k}={v!r}"


def _check_pod(where: str, tpl: dict[str, Any]) -> None:
    _check_labels(where, tpl["metadata"]["labels"])
    spec = tpl["spec"]
    volumes = {v["name"] for v in spec.get("volumes", [])}
    assert len(volumes) == len(spec.get("volumes", [])), f"{where}: duplicate volume names"
    containers = spec.get("initContainers", []) + spec["containers"]
    names = [c["name"] for c in containers]
    assert len(set(names)) == len(names), f"{where}: duplicate container names {names}"
    for c in containers:
        assert DNS1123_LABEL.match(c["name"]) and len(c["name"]) <= 63, f"{where}: container {c['name']}"
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{where}: {c['name']} mounts unknown volume {mount['name']}"
        ports = {p["name"] for p in c.get("ports", [])}
        assert all(len(p) <= 15 and DNS1123_LABEL.match(p) for p in ports), f"{where}: port names {ports}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if isinstance(port, str):
                assert port in ports, f"{where}: {probe} uses undeclared port {port}"
        for e in c.get("env", []):
            assert re.match(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", e["name"]), f"{where}: env {e['name']}"


def check_manifests(manifests: list[dict[str, Any]], namespace: str) -> None:
    """Assert the semantic and CEL rules over one rendering (see the module docstring).

    Raises:
        AssertionError: naming the manifest and the rule.
    """
    seen: set[tuple[str, str]] = set()
    templates = [(m, t) for m in manifests for t in pod_templates(m)]
    workloads = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    for m in manifests:
        kind, meta = m["kind"], m["metadata"]
        name, where = meta["name"], f"{m['kind']}/{meta['name']}"
        assert (kind, name) not in seen, f"duplicate {where}"
        seen.add((kind, name))
        assert meta["namespace"] == namespace, where
        assert len(name) <= 63 and DNS1123_SUBDOMAIN.match(name), f"{where}: name"
        _check_labels(where, meta.get("labels", {}))
        owners = meta.get("ownerReferences", [])
        assert sum(1 for o in owners if o.get("controller")) <= 1, where
        for tpl in pod_templates(m):
            _check_pod(where, tpl)
        spec = m.get("spec", {})
        if kind == "Deployment":
            assert matches(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]), where
            assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}, where
        if kind == "LeaderWorkerSet":
            ru = spec["rolloutStrategy"]["rollingUpdateConfiguration"]
            assert ru["maxUnavailable"] == 0 and ru["maxSurge"] >= 1, where  # LWS webhook: not both zero
            assert spec["leaderWorkerTemplate"]["size"] >= 1, where
        if kind == "Service":
            assert DNS1035_LABEL.match(name), f"{where}: Service names are DNS-1035 labels"
            sel = spec["selector"]
            assert any(matches(sel, t["metadata"]["labels"]) for _, t in templates), f"{where}: selects no pods"
        if kind == "PodDisruptionBudget":
            sel = spec["selector"]["matchLabels"]
            assert any(matches(sel, t["metadata"]["labels"]) for _, t in templates), f"{where}: selects no pods"
        if kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            ref = spec["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) in workloads, f"{where}: scales a missing {ref}"
        if kind == "ScaledObject":  # CEL: minReplicaCount <= maxReplicaCount (default 100)
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), where
            assert all(isinstance(v, str) for t in spec["triggers"] for v in t["metadata"].values()), where
        if kind == "HorizontalPodAutoscaler":
            assert 1 <= spec["minReplicas"] <= spec["maxReplicas"], where
        if kind == "InferencePool":
            numbers = [p["number"] for p in spec["targetPorts"]]
            assert len(set(numbers)) == len(numbers), f"{where}: CEL port number must be unique"
            ep = spec.get("endpointPickerRef")
            if ep is not None:  # CEL: port is required when kind is 'Service' or unspecified
                assert ep.get("kind", "Service") != "Service" or "port" in ep, where
            sel = spec["selector"]["matchLabels"]
            assert any(matches(sel, t["metadata"]["labels"]) for _, t in templates), f"{where}: selects no pods"
        if kind == "HTTPRoute":
            parents = [(p.get("namespace"), p["name"], p.get("sectionName")) for p in spec["parentRefs"]]
            assert len(set(parents)) == len(parents), f"{where}: CEL parentRefs must be unique"
            for rule in spec["rules"]:
                for match in rule.get("matches", []):
                    path = match.get("path", {})
                    if path.get("type") in ("Exact", "PathPrefix"):  # CEL: absolute path
                        assert path["value"].startswith("/"), where
                for b in rule["backendRefs"]:
                    if b.get("group", "") == "" and b.get("kind", "Service") == "Service":
                        assert "port" in b, f"{where}: CEL Must have port for Service reference"
                timeouts = rule.get("timeouts", {})
                assert "backendRequest" not in timeouts or "request" in timeouts, where
