"""The ClusterServingRuntimes that ship with kvfleet (as OME ships runtimes): ``kvfleet``,
``vllm`` and ``sglang``.

They are used when a document set names no runtime of its own; a ServingRuntime or
ClusterServingRuntime of the same name in the documents replaces the built-in one. Flags follow
each engine's CLI: ``kvfleet serve`` (this repository), ``vllm serve`` (vLLM's EngineArgs:
``--kv-cache-memory-bytes``, ``--kv-transfer-config`` with the NIXL connector as llm-d uses it,
Ray for multi-node as in LWS's vLLM example) and ``python3 -m sglang.launch_server``
(``--max-running-requests``, ``--mem-fraction-static``, ``--disaggregation-mode``, ``--nnodes``
/ ``--node-rank`` / ``--dist-init-addr`` for multi-node).
"""

from __future__ import annotations

from typing import Any

from kvfleet import __version__
from kvfleet.control.api.runtime import ClusterServingRuntime

#: kvfleet's own image (engine, router and model downloader).
KVFLEET_IMAGE = f"ghcr.io/kvfleet/kvfleet:{__version__}"
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.3"

#: architectures kvfleet's engine implements (kvfleet.model.config.SUPPORTED_ARCHITECTURES).
KVFLEET_ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"]


def _flag(name: str) -> dict[str, str]:
    return {"flag": name}


def _switch(on: list[str], off: list[str]) -> dict[str, list[str]]:
    return {"ifTrue": on, "ifFalse": off}


_SERVE_ARGS = ["{modelPath}", "--host", "0.0.0.0", "--port", "{port}", "--served-model-name", "{servedModelName}"]

_KVFLEET: dict[str, Any] = {
    "engine": "kvfleet",
    "image": KVFLEET_IMAGE,
    "command": ["kvfleet", "serve"],
    "args": _SERVE_ARGS,
    "supportedModelFormats": [
        {"name": "gguf", "architectures": KVFLEET_ARCHITECTURES, "priority": 3},
        {"name": "safetensors", "architectures": KVFLEET_ARCHITECTURES, "priority": 1},
    ],
    # MultiNode: kvfleet's engine runs in one process. P/D: prefill and decode pools run the same
    # `kvfleet serve`; the router does the split and decode engines pull the prompt's KV from the
    # prefill engine named in the request's kv_transfer_params (kvfleet.engine.kv_transfer).
    "supportedDeploymentModes": ["Standard", "PrefillDecodeDisaggregated", "Serverless"],
    "engineArgFlags": {
        "maxNumSeqs": _flag("--max-num-seqs"),
        "maxNumBatchedTokens": _flag("--max-num-batched-tokens"),
        "maxModelLen": _flag("--max-model-len"),
        "blockSize": _flag("--block-size"),
        "kvCacheMemory": _flag("--kv-cache-memory"),
        "enablePrefixCaching": _switch(["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
        "enableChunkedPrefill": _switch(["--enable-chunked-prefill"], ["--no-enable-chunked-prefill"]),
        "dtype": _flag("--dtype"),
        "kvCacheDtype": _flag("--kv-cache-dtype"),
    },
    "prefillDecode": {"prefillArgs": [], "decodeArgs": []},
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
}

_NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
_VLLM: dict[str, Any] = {
    "engine": "vllm",
    "image": VLLM_IMAGE,
    "command": ["vllm", "serve"],
    "args": _SERVE_ARGS,
    "supportedModelFormats": [{"name": "safetensors", "priority": 2}, {"name": "gguf", "priority": 1}],
    "supportedDeploymentModes": ["Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless"],
    "engineArgFlags": {
        "maxNumSeqs": _flag("--max-num-seqs"),
        "maxNumBatchedTokens": _flag("--max-num-batched-tokens"),
        "maxModelLen": _flag("--max-model-len"),
        "blockSize": _flag("--block-size"),
        "kvCacheMemory": _flag("--kv-cache-memory-bytes"),
        "gpuMemoryUtilization": _flag("--gpu-memory-utilization"),
        "enablePrefixCaching": _switch(["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
        "enableChunkedPrefill": _switch(["--enable-chunked-prefill"], ["--no-enable-chunked-prefill"]),
        "dtype": _flag("--dtype"),
        "kvCacheDtype": _flag("--kv-cache-dtype"),
        "tensorParallelSize": _flag("--tensor-parallel-size"),
        "pipelineParallelSize": _flag("--pipeline-parallel-size"),
        "enableLora": _switch(["--enable-lora"], []),
        "loraModules": _flag("--lora-modules"),
        "maxLoraRank": _flag("--max-lora-rank"),
    },
    "prefillDecode": {"prefillArgs": ["--kv-transfer-config", _NIXL], "decodeArgs": ["--kv-transfer-config", _NIXL]},
    "multiNode": {
        "leaderCommand": ["sh", "-c", "ray start --head --port=6379 && exec {engineCommand}"],
        "leaderArgs": ["--distributed-executor-backend", "ray", "--pipeline-parallel-size", "{groupSize}"],
        "workerCommand": ["sh", "-c", "exec ray start --address=$LWS_LEADER_ADDRESS:6379 --block"],
    },
    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}},
    "sharedMemory": "2Gi",
}

_SGLANG: dict[str, Any] = {
    "engine": "sglang",
    "image": SGLANG_IMAGE,
    "command": ["python3", "-m", "sglang.launch_server"],
    "args": ["--model-path", "{modelPath}", "--host", "0.0.0.0", "--port", "{port}",
             "--served-model-name", "{servedModelName}", "--enable-metrics"],
    "supportedModelFormats": [{"name": "safetensors", "priority": 1},
                              {"name": "gguf", "priority": 0, "autoSelect": False}],
    "supportedDeploymentModes": ["Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless"],
    "engineArgFlags": {
        "maxNumSeqs": _flag("--max-running-requests"),
        "maxNumBatchedTokens": _flag("--chunked-prefill-size"),
        "maxModelLen": _flag("--context-length"),
        "blockSize": _flag("--page-size"),
        "gpuMemoryUtilization": _flag("--mem-fraction-static"),
        "enablePrefixCaching": _switch([], ["--disable-radix-cache"]),
        "enableChunkedPrefill": _switch([], ["--chunked-prefill-size", "-1"]),
        "dtype": _flag("--dtype"),
        "kvCacheDtype": _flag("--kv-cache-dtype"),
        "tensorParallelSize": _flag("--tp-size"),
        "pipelineParallelSize": _flag("--pp-size"),
        "loraModules": _flag("--lora-paths"),
        "maxLoraRank": _flag("--max-lora-rank"),
    },
    "prefillDecode": {"prefillArgs": ["--disaggregation-mode", "prefill"],
                      "decodeArgs": ["--disaggregation-mode", "decode"]},
    "multiNode": {
        "leaderArgs": ["--nnodes", "{groupSize}", "--node-rank", "0",
                       "--dist-init-addr", "$(LWS_LEADER_ADDRESS):20000"],
        "workerArgs": ["--nnodes", "{groupSize}", "--node-rank", "$(LWS_WORKER_INDEX)",
                       "--dist-init-addr", "$(LWS_LEADER_ADDRESS):20000"],
    },
    "metricNames": {
        "vllm:num_requests_waiting": "sglang:num_queue_reqs",
        "vllm:num_requests_running": "sglang:num_running_reqs",
        "vllm:kv_cache_usage_perc": "sglang:token_usage",
        "vllm:time_to_first_token_seconds": "sglang:time_to_first_token_seconds",
        "vllm:prompt_tokens_total": "sglang:prompt_tokens_total",
        "vllm:generation_tokens_total": "sglang:generation_tokens_total",
    },
    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}},
    "sharedMemory": "2Gi",
}


def builtin_runtimes() -> dict[str, ClusterServingRuntime]:
    """Fresh copies of the built-in ClusterServingRuntimes, by name (``kvfleet``, ``vllm``, ``sglang``)."""
    out = {}
    for spec in (_KVFLEET, _VLLM, _SGLANG):
        name = spec["engine"]
        out[name] = ClusterServingRuntime.model_validate(
            {"metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "kvfleet"}}, "spec": spec})
    return out
