"""Generated CRDs: committed files are current, structural, valid CustomResourceDefinitions, and
accept the documents the pydantic models accept."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.control.api import builtin_runtimes
from kvfleet.control.api.crds import dump, generate
from kvfleet.control.validation import ManifestError
from tests.control.specs import GGUF_MODEL, VALID, service

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "deploy" / "crds"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_committed_crds_equal_the_generated_ones():
    generated = generate()
    committed = {p.name for p in CRD_DIR.glob("*.yaml")}
    assert committed == set(generated), "regenerate: python -m kvfleet.control.api.crds deploy/crds"
    for name, crd in generated.items():
        assert (CRD_DIR / name).read_text() == dump(crd), f"{name} is stale: python -m kvfleet.control.api.crds"


def _assert_structural(node: dict[str, Any], path: str) -> None:
    assert isinstance(node, dict), path
    for bad in ("$ref", "$defs", "definitions", "oneOf", "allOf", "not", "const", "title"):
        assert bad not in node, f"{path}: {bad}"
    if "anyOf" in node:
        assert node.get("x-kubernetes-int-or-string") is True, f"{path}: anyOf outside int-or-string"
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        assert "type" not in node, path
    elif not node.get("x-kubernetes-preserve-unknown-fields"):
        assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), f"{path}: type"
    assert not ("properties" in node and "additionalProperties" in node), path
    if "additionalProperties" in node:
        assert isinstance(node["additionalProperties"], dict), f"{path}: additionalProperties must be a schema"
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node:
            assert isinstance(node[key], bool), f"{path}: {key} must be boolean (OpenAPI 3.0)"
    if "default" in node:
        assert not isinstance(node["default"], (dict, list)) and node["default"] is not None, path
    for name, sub in node.get("properties", {}).items():
        _assert_structural(sub, f"{path}.{name}")
    if "items" in node:
        _assert_structural(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        _assert_structural(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("name", sorted(generate()))
def test_crd_schemas_are_structural(name):
    crd = generate()[name]
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    _assert_structural(schema, name)
    assert schema["properties"]["metadata"] == {"type": "object"}  # only name restrictions are allowed there


@pytest.mark.parametrize("name", sorted(generate()))
def test_crds_validate_as_customresourcedefinitions(name, validator):
    assert "OpenAPI" in validator.validate(generate()[name])


def test_crd_names_columns_and_subresources():
    crds = {c["spec"]["names"]["kind"]: c for c in generate().values()}
    assert set(crds) == {"BaseModel", "ClusterBaseModel", "ServingRuntime", "ClusterServingRuntime",
                         "FineTunedWeight", "InferenceService"}
    for kind, c in crds.items():
        spec = c["spec"]
        assert spec["group"] == "kvfleet.io" and c["metadata"]["name"] == f"{spec['names']['plural']}.kvfleet.io"
        assert spec["scope"] == ("Cluster" if kind.startswith("Cluster") else "Namespaced")
        (v,) = spec["versions"]
        assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
        assert spec["names"]["shortNames"] and "kvfleet" in spec["names"]["categories"]
        assert any(col["name"] == "Age" for col in v["additionalPrinterColumns"])
        has_status = "status" in v["schema"]["openAPIV3Schema"]["properties"]
        assert ("subresources" in v) == has_status
        if has_status:
            assert v["subresources"] == {"status": {}}
            conds = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
            assert conds["x-kubernetes-list-type"] == "map" and conds["x-kubernetes-list-map-keys"] == ["type"]
    assert crds["InferenceService"]["spec"]["names"]["shortNames"] == ["isvc"]
    pool = crds["InferenceService"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["engine"]
    assert "self.maxReplicas >= self.minReplicas" in pool["x-kubernetes-validations"][0]["rule"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate_against_our_crds(path, validator):
    for doc in yaml.safe_load_all(path.read_text()):
        assert validator.validate(doc).startswith("CRD ")


def test_documents_pydantic_accepts_validate_against_the_crds(validator):
    docs = [service(f"s{i}", m, r) for i, (m, r) in enumerate(VALID)]
    docs += [rt.to_dict() for rt in builtin_runtimes().values()]
    docs.append({**copy.deepcopy(GGUF_MODEL), "status": {"observedGeneration": 2, "conditions": [
        {"type": "Ready", "status": "True", "reason": "Downloaded", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
    for doc in docs:
        validator.validate(doc)


def test_the_crd_schema_rejects_what_pydantic_rejects(validator):
    doc = service("svc", "Standard", "vllm")
    doc["spec"]["engine"]["maxReplica"] = 3
    with pytest.raises(ManifestError, match="maxReplica"):
        validator.validate(doc)
    bad = copy.deepcopy(GGUF_MODEL)
    bad["spec"]["sha256"] = "xyz"
    with pytest.raises(ManifestError, match="sha256"):
        validator.validate(bad)
    bad = copy.deepcopy(GGUF_MODEL)
    bad["spec"]["format"] = "onnx"
    with pytest.raises(ManifestError, match="format"):
        validator.validate(bad)
