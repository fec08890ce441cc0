"""The parts of an ``InferenceService`` spec: engine pools, the router, autoscaling, gateway,
model storage and Kueue settings.

The pool shape (min/max replicas, resources, engine args) follows OME's engine / decoder
components and KServe's predictor; engine-arg names follow vLLM's flags (``maxNumSeqs`` is
``--max-num-seqs``) and are translated per engine by the ServingRuntime's ``engineArgFlags``.
Multi-node pools are LeaderWorkerSet groups (``size`` as in LWS); autoscaling is a KEDA
Prometheus trigger on ``vllm:num_requests_waiting`` by default; the gateway is a Gateway API
HTTPRoute to an InferencePool (Gateway API Inference Extension).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvfleet.control.api.common import EnvVar, KubeModel, MetricName, Quantity, ResourceRequirements, Toleration
from kvfleet.control.api.errors import field_error

DeploymentMode = Literal["Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless"]
DEPLOYMENT_MODES: tuple[str, ...] = ("Standard", "PrefillDecodeDisaggregated", "MultiNode", "Serverless")


class EngineArgs(KubeModel):
    """Engine settings, named after vLLM's flags; each runtime maps them to its engine's flags
    (``spec.engineArgFlags``). A setting the runtime has no flag for is an error."""

    max_num_seqs: int | None = Field(default=None, ge=1)
    """Most requests running in one engine step (vLLM ``--max-num-seqs``, SGLang
    ``--max-running-requests``)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Token budget per engine step, in tokens."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest sequence (prompt + output), in tokens; at most the model's ``contextLength``."""
    block_size: int | None = Field(default=None, ge=1)
    """Tokens per KV cache block (SGLang: page size)."""
    kv_cache_memory: Quantity | None = None
    """Bytes of KV cache (e.g. ``2Gi``); passed to the engine as a byte count."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Fraction of GPU memory the engine may use (vLLM), or its static fraction (SGLang)."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of shared prompt prefixes (SGLang's radix cache)."""
    enable_chunked_prefill: bool | None = None
    """Split long prompts into chunks that share steps with decodes."""
    dtype: str | None = Field(default=None, pattern=r"^[a-z0-9_]+$")
    """Compute dtype: ``auto``, ``float32``, ``bfloat16``, ``float16``."""
    kv_cache_dtype: str | None = Field(default=None, pattern=r"^[a-z0-9_]+$")
    """KV cache storage dtype: ``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``."""
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    """GPUs one model copy is split over by tensor parallelism."""
    pipeline_parallel_size: int | None = Field(default=None, ge=1)
    """Pipeline stages (vLLM), typically one per node of a multi-node replica."""
    extra_args: list[str] = Field(default_factory=list)
    """Further engine flags, passed verbatim after the mapped ones."""


#: the camelCase names of :class:`EngineArgs` that runtimes map to flags (all but ``extraArgs``).
ENGINE_ARG_NAMES: tuple[str, ...] = tuple(f.alias or n for n, f in EngineArgs.model_fields.items()
                                          if n != "extra_args")
#: names the control plane sets itself when fineTunedWeights are given.
LORA_ARG_NAMES: tuple[str, ...] = ("enableLora", "loraModules", "maxLoraRank")


class MultiNodeSpec(KubeModel):
    """One replica spread over several pods: a LeaderWorkerSet group of ``size`` pods."""

    size: int = Field(ge=2)
    """Pods per replica, leader included (LWS ``leaderWorkerTemplate.size``)."""


#: CEL rule of the CRD (the API server checks it too; pydantic checks it with a message).
POOL_CEL = [{"rule": "!has(self.minReplicas) || !has(self.maxReplicas) || self.maxReplicas >= self.minReplicas",
             "message": "maxReplicas must be >= minReplicas"}]


class PoolSpec(KubeModel):
    """An engine pool: identical replicas of one engine (``engine``, ``prefill`` or ``decode``)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": POOL_CEL})

    min_replicas: int | None = Field(default=None, ge=0)
    """Fewest replicas (default 1; 0 with Serverless)."""
    max_replicas: int | None = Field(default=None, ge=1)
    """Most replicas (default ``minReplicas``, at least 1); above ``minReplicas`` the pool autoscales."""
    resources: ResourceRequirements | None = None
    """Container resources (default: the runtime's, raised to the model's hints)."""
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    """Engine settings (KV cache size, prefix caching, max-num-seqs ...)."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of the engine container."""
    image: str | None = None
    """Container image (default: the runtime's)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    multi_node: MultiNodeSpec | None = None
    """Spread each replica over several pods (MultiNode)."""
    termination_grace_period_seconds: int = Field(default=120, ge=0)
    """Seconds a stopping replica may take to finish its requests."""
    drain_seconds: int = Field(default=10, ge=0)
    """preStop pause, in seconds, so routers stop sending before the engine gets SIGTERM."""

    @model_validator(mode="after")
    def _replicas(self) -> PoolSpec:
        if self.min_replicas is not None and self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise field_error("maxReplicas", f"must be >= minReplicas ({self.min_replicas}), got {self.max_replicas}")
        if self.drain_seconds > self.termination_grace_period_seconds:
            raise field_error("drainSeconds", f"must be <= terminationGracePeriodSeconds "
                                              f"({self.termination_grace_period_seconds}), got {self.drain_seconds}")
        return self


class RouterSpec(KubeModel):
    """The kvfleet router in front of the engine pools (llm-d's endpoint picker: filters, then
    weighted scorers)."""

    enabled: bool = True
    """Deploy the router (required for PrefillDecodeDisaggregated)."""
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int | None = Field(default=None, ge=1)
    """Most router replicas (default ``minReplicas``); above it the router scales on CPU."""
    resources: ResourceRequirements | None = None
    image: str | None = None
    """Container image (default: the kvfleet image)."""
    policy: str | None = None
    """A named routing profile of ``kvfleet router --policy`` (``default``, ``prefix``, ``kv-aware``,
    ``session``, ``round-robin``)."""
    scorers: dict[str, float] | None = None
    """Scorer weights instead of a profile, e.g. ``{prefix: 3, queue: 2, kv-usage: 2}``."""
    extra_args: list[str] = Field(default_factory=list)
    """Further ``kvfleet router`` flags."""

    @model_validator(mode="after")
    def _check(self) -> RouterSpec:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise field_error("maxReplicas", f"must be >= minReplicas ({self.min_replicas}), got {self.max_replicas}")
        if self.policy is not None and self.scorers is not None:
            raise field_error("scorers", "give either policy or scorers, not both")
        for name, w in (self.scorers or {}).items():
            if not w >= 0:
                raise field_error(f"scorers.{name}", f"weight must be >= 0, got {w}")
        return self


class AutoscalingSpec(KubeModel):
    """Autoscaling of every pool whose ``maxReplicas`` exceeds ``minReplicas``: a KEDA
    ScaledObject with a Prometheus trigger (or an HPA on the same metric without KEDA)."""

    metric: MetricName = "vllm:num_requests_waiting"
    """Metric to scale on, by its vLLM name; the runtime's ``metricNames`` translates it."""
    target: float = Field(default=5, gt=0)
    """Target value of ``metric`` per replica (KEDA threshold)."""
    idle_timeout_seconds: int = Field(default=300, ge=0)
    """Scale-to-zero idle timeout (Serverless): seconds without demand before the last replica
    goes (KEDA ``cooldownPeriod``)."""
    polling_interval_seconds: int = Field(default=15, ge=1)
    """How often KEDA queries the metric, in seconds."""
    query: str | None = None
    """A PromQL query replacing the default ``sum(metric{namespace=..., pod=~"pool-.*"})``."""
    prometheus_address: str | None = None
    """Prometheus URL (default: the renderer's, ``http://prometheus-operated.monitoring.svc:9090``)."""


class EndpointPickerRef(KubeModel):
    """An endpoint picker (ext-proc) Service for the InferencePool (Gateway API Inference Extension)."""

    name: str = Field(min_length=1, max_length=253)
    port: int = Field(default=9002, ge=1, le=65535)
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class GatewaySpec(KubeModel):
    """Expose the service through a Gateway API Gateway: an HTTPRoute and an InferencePool."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Gateway."""
    namespace: str | None = None
    """Namespace of the Gateway (default: the service's)."""
    section_name: str | None = None
    """Listener of the Gateway to attach to."""
    hostnames: list[str] = Field(default_factory=list)
    """Host names the route answers for (default: all of the listener's)."""
    request_timeout: str | None = Field(default=None, pattern=r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
    """Gateway API request timeout (``600s``); LLM responses can take minutes."""
    endpoint_picker: EndpointPickerRef | None = None
    """When set, the HTTPRoute targets the InferencePool and this picker chooses endpoints;
    otherwise it targets the kvfleet router's Service."""


class ModelStorageSpec(KubeModel):
    """Where engine pods keep downloaded weights."""

    type: Literal["EmptyDir", "PersistentVolumeClaim"] = "EmptyDir"
    """``EmptyDir``: each pod downloads in an initContainer (KServe's storage initializer);
    ``PersistentVolumeClaim``: one Job downloads to a PVC that pods mount read-only."""
    size: Quantity | None = None
    """Volume size (default: the model's ``resources.storage``, else 20Gi for a PVC)."""
    storage_class_name: str | None = None
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"] = "ReadWriteMany"
    """PVC access mode; ReadWriteMany lets pods on several nodes share it."""


class KueueSpec(KubeModel):
    """Admit the engine pools through Kueue."""

    queue_name: str = Field(min_length=1, max_length=63)
    """LocalQueue (``kueue.x-k8s.io/queue-name`` label)."""
    priority_class: str | None = Field(default=None, max_length=63)
    """WorkloadPriorityClass (``kueue.x-k8s.io/priority-class`` label)."""
