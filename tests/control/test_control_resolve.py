"""Resolution against references: runtime selection, cross-resource checks, sha256 verification."""

from __future__ import annotations

import copy

import pytest

from kvfleet.control.api import SpecError, fingerprint, parse_resource
from kvfleet.control.resolve import resolve, verify_source
from tests.control.specs import GGUF_MODEL, HF_MODEL, catalog, service


def _resolve(doc, *extra, verify=False):
    cat = catalog(doc, *extra)
    return resolve(cat.inference_services()[0], cat, verify=verify)


def _err(doc, *extra, verify=False) -> SpecError:
    with pytest.raises(SpecError) as e:
        _resolve(doc, *extra, verify=verify)
    return e.value


def test_runtime_auto_selection_by_format_architecture_and_mode():
    gguf = _resolve(service("a", "Standard", None, model="smollm2"))
    assert gguf.runtime.metadata.name == "kvfleet"  # GGUF Llama: kvfleet has the highest priority
    st = _resolve(service("b", "Standard", None, model="qwen"))
    assert st.runtime.metadata.name == "vllm"  # safetensors: vllm (2) over kvfleet and sglang (1)
    mn = _resolve(service("c", "MultiNode", None, model="smollm2", args={}))
    assert mn.runtime.metadata.name == "vllm"  # kvfleet cannot do MultiNode
    assert mn.runtime_ref == "ClusterServingRuntime/vllm" and mn.pools[0].group_size == 2


def test_unknown_runtime_names_the_field_and_lists_known_ones():
    e = _err(service("svc", "Standard", "tgi"))
    assert e.field == "spec.runtime.name" and "tgi" in e.message
    assert "kvfleet, sglang, vllm" in e.message and e.resource == "InferenceService/llm/svc"


def test_multinode_with_a_runtime_that_cannot_do_it():
    e = _err(service("svc", "MultiNode", "kvfleet"))
    assert e.field == "spec.deploymentMode" and "does not support MultiNode" in e.message
    doc = service("svc", "MultiNode", "kvfleet")
    del doc["spec"]["deploymentMode"]  # derived from spec.engine.multiNode
    assert _err(doc).field == "spec.engine.multiNode"


def test_runtime_that_does_not_serve_the_format_or_architecture():
    other = copy.deepcopy(HF_MODEL)
    other["metadata"]["name"] = "pythia"
    other["spec"]["architecture"] = "GPTNeoXForCausalLM"
    e = _err(service("svc", "Standard", "kvfleet", model="pythia", args={}), other)
    assert e.field == "spec.runtime.name" and "GPTNeoXForCausalLM" in e.message


def test_missing_model_names_the_field():
    e = _err(service("svc", "Standard", "vllm", model="nope"))
    assert e.field == "spec.model.name" and "nope" in e.message


def test_engine_arg_without_a_flag_in_the_runtime():
    e = _err(service("svc", "Standard", "sglang", args={"kvCacheMemory": "4Gi"}))
    assert e.field == "spec.engine.engineArgs.kvCacheMemory" and "sglang" in e.message
    e = _err(service("svc", "PrefillDecodeDisaggregated", "kvfleet", args={"gpuMemoryUtilization": 0.5}))
    assert e.field == "spec.prefill.engineArgs.gpuMemoryUtilization"


def test_max_model_len_above_context_length():
    e = _err(service("svc", "Standard", "kvfleet", args={"maxModelLen": 9000}))
    assert e.field == "spec.engine.engineArgs.maxModelLen" and "8192" in e.message


def test_router_policy_and_scorers_are_checked_against_the_router():
    assert _err(service("s", "Standard", "vllm", router={"policy": "fastest"})).field == "spec.router.policy"
    e = _err(service("s", "Standard", "vllm", router={"scorers": {"prefix": 2, "latency": 1}}))
    assert e.field == "spec.router.scorers.latency"


def _adapter(name="sql", base="qwen"):
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "FineTunedWeight", "metadata": {"name": name},
            "spec": {"source": "s3://bucket/adapters/sql", "baseModel": {"name": base}, "rank": 16}}


def test_adapters_resolve_and_are_checked():
    rs = _resolve(service("svc", "Standard", "vllm", fineTunedWeights=["sql"]), _adapter())
    assert [a.metadata.name for a in rs.adapters] == ["sql"]
    e = _err(service("svc", "Standard", "vllm", fineTunedWeights=["sql", "missing"]), _adapter())
    assert e.field == "spec.fineTunedWeights[1]"
    e = _err(service("svc", "Standard", "vllm", fineTunedWeights=["sql"]), _adapter(base="smollm2"))
    assert e.field == "spec.fineTunedWeights[0]" and "base model 'smollm2'" in e.message
    e = _err(service("svc", "Standard", "kvfleet", fineTunedWeights=["sql"]), _adapter(base="smollm2"))
    assert e.field == "spec.fineTunedWeights[0]" and "cannot serve LoRA" in e.message


def test_pool_defaults():
    doc = service("svc", "Serverless", "vllm")
    doc["spec"]["engine"] = {"maxReplicas": 2}
    pool = _resolve(doc).pools[0]
    assert (pool.min_replicas, pool.max_replicas, pool.autoscaled) == (0, 2, True)
    doc = service("svc", "Standard", "vllm")
    doc["spec"]["engine"] = {"minReplicas": 2}
    pool = _resolve(doc).pools[0]
    assert (pool.min_replicas, pool.max_replicas, pool.autoscaled) == (2, 2, False)


def _file_model(path, sha):
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "local"},
            "spec": {"source": f"file://{path}", "format": "gguf", "sha256": sha, "architecture": "LlamaForCausalLM"}}


def test_sha256_mismatch_is_an_error_naming_the_model_field(tmp_path):
    f = tmp_path / "tiny.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    good = fingerprint(f)
    doc = service("svc", "Standard", "kvfleet", model="local", args={})
    rs = _resolve(doc, _file_model(f, good), verify=True)
    assert rs.model.metadata.name == "local"
    e = _err(doc, _file_model(f, "0" * 64), verify=True)
    assert e.field == "spec.sha256" and e.resource == "BaseModel/llm/local" and good in e.message
    _resolve(doc, _file_model(f, "0" * 64), verify=False)  # without verify the content is not read
    f.unlink()
    assert _err(doc, _file_model(f, good), verify=True).field == "spec.source"


def test_installed_packaged_model_verifies(smollm2_path):
    model = parse_resource(copy.deepcopy(GGUF_MODEL))
    assert verify_source(model) == smollm2_path
    bad = copy.deepcopy(GGUF_MODEL)
    bad["spec"]["sha256"] = "1" * 64
    with pytest.raises(SpecError) as e:
        verify_source(parse_resource(bad))
    assert e.value.field == "spec.sha256"
    assert verify_source(parse_resource(copy.deepcopy(HF_MODEL))) is None  # remote: nothing to check here
