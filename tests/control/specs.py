"""Spec builders for the control-plane tests: one InferenceService per (mode, runtime) with its model."""

from __future__ import annotations

import copy
from typing import Any

from kvfleet.control.api import Catalog
from kvfleet.control.api.source import packaged_source

SMOLLM2_URI, SMOLLM2_SHA = packaged_source("smollm2-135m-instruct")

GGUF_MODEL: dict[str, Any] = {
    "apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "smollm2"},
    "spec": {"source": SMOLLM2_URI, "format": "gguf", "sha256": SMOLLM2_SHA, "architecture": "LlamaForCausalLM",
             "parameterCount": "135M", "contextLength": 8192, "quantization": "Q4_1", "license": "apache-2.0"},
}
HF_MODEL: dict[str, Any] = {
    "apiVersion": "kvfleet.io/v1alpha1", "kind": "BaseModel", "metadata": {"name": "qwen"},
    "spec": {"source": "hf://Qwen/Qwen2.5-7B-Instruct@main", "format": "safetensors",
             "architecture": "Qwen2ForCausalLM", "contextLength": 32768, "credentialsSecret": "hf-token",
             "resources": {"memory": "24Gi", "gpus": 2}},
}

MODES = ("Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless")
RUNTIMES = ("kvfleet", "vllm", "sglang")
#: every (mode, runtime) pair a built-in runtime supports.
VALID = [(m, r) for m in MODES for r in RUNTIMES if not (m == "MultiNode" and r == "kvfleet")]

#: engine args each built-in runtime has flags for (and what the tests expect on its command line).
ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "kvfleet": {"maxNumSeqs": 16, "maxNumBatchedTokens": 1024, "maxModelLen": 4096, "blockSize": 32,
                "kvCacheMemory": "512Mi", "enablePrefixCaching": False, "enableChunkedPrefill": True,
                "dtype": "float32", "extraArgs": ["--seed", "7"]},
    "vllm": {"maxNumSeqs": 128, "maxModelLen": 8192, "kvCacheMemory": "8Gi", "gpuMemoryUtilization": 0.85,
             "enablePrefixCaching": True, "tensorParallelSize": 2, "extraArgs": ["--enforce-eager"]},
    "sglang": {"maxNumSeqs": 64, "maxModelLen": 8192, "gpuMemoryUtilization": 0.8, "enablePrefixCaching": False,
               "tensorParallelSize": 2, "blockSize": 1},
}


def service(name: str, mode: str, runtime: str | None, *, uid: str | None = "0c1b9a54-5d2e-4b4e-9a51-3f2d1c0e7a11",
            args: dict[str, Any] | None = None, model: str | None = None, **spec: Any) -> dict[str, Any]:
    """An InferenceService document for ``mode`` on ``runtime`` (``None``: auto-select)."""
    engine_args = copy.deepcopy(args if args is not None else ENGINE_ARGS.get(runtime or "", {}))
    pool = {"minReplicas": 1, "maxReplicas": 3, "engineArgs": engine_args}
    body: dict[str, Any] = {"model": {"name": model or ("smollm2" if runtime == "kvfleet" else "qwen")},
                            "deploymentMode": mode}
    if runtime:
        body["runtime"] = {"name": runtime}
    if mode == "PrefillDecodeDisaggregated":
        body["prefill"] = copy.deepcopy(pool)
        body["decode"] = {**copy.deepcopy(pool), "minReplicas": 2, "maxReplicas": 2}
    elif mode == "MultiNode":
        body["engine"] = {**pool, "multiNode": {"size": 2}}
    elif mode == "Serverless":
        body["engine"] = {**pool, "minReplicas": 0}
    else:
        body["engine"] = pool
    body.update(spec)
    meta: dict[str, Any] = {"name": name}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceService", "metadata": meta, "spec": body}


def catalog(*docs: dict[str, Any], namespace: str = "llm") -> Catalog:
    """A catalog of both models plus ``docs``."""
    return Catalog.from_documents([copy.deepcopy(GGUF_MODEL), copy.deepcopy(HF_MODEL), *docs], namespace)
