"""``InferenceService``: one declarative serving deployment (KServe's / OME's InferenceService,
with llm-d's prefill/decode pools and router).

It names a model, optionally a runtime (else one is picked from the model's format and
architecture), LoRA adapters, and the pools that serve it. ``deploymentMode`` is derived when
omitted and checked when given:

- ``PrefillDecodeDisaggregated`` -- ``spec.prefill`` and ``spec.decode`` pools (llm-d P/D);
- ``MultiNode`` -- ``spec.engine.multiNode.size`` >= 2 (each replica a LeaderWorkerSet group);
- ``Serverless`` -- ``spec.engine.minReplicas`` 0: scale to zero after ``idleTimeoutSeconds``;
- ``Standard`` -- otherwise: a Deployment of single-pod replicas.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kvfleet.control.api.common import (
    API_VERSION,
    CONDITIONS_SCHEMA,
    Condition,
    KubeModel,
    ObjectMeta,
    ResourceMixin,
    ResourceName,
)
from kvfleet.control.api.components import (
    AutoscalingSpec,
    DeploymentMode,
    GatewaySpec,
    KueueSpec,
    ModelStorageSpec,
    PoolSpec,
    RouterSpec,
)
from kvfleet.control.api.errors import field_error
from kvfleet.control.api.finetuned import ModelRef

#: longest InferenceService name: derived names (``NAME-model-download``, LWS pod and
#: StatefulSet names with their hash suffixes) must stay within Kubernetes' 63-character limits.
MAX_SERVICE_NAME = 40
SERVICE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class RuntimeRef(KubeModel):
    """A reference to a ServingRuntime or ClusterServingRuntime."""

    name: ResourceName
    kind: Literal["ServingRuntime", "ClusterServingRuntime"] | None = None
    """When omitted: a ServingRuntime of that name in the namespace, else the ClusterServingRuntime."""


class InferenceServiceSpec(KubeModel):
    """What to serve and how."""

    model: ModelRef
    """The base model."""
    runtime: RuntimeRef | None = None
    """The runtime; when omitted, the auto-selectable runtime of highest priority that serves the
    model's format and architecture in the deployment mode."""
    fine_tuned_weights: list[ResourceName] = Field(default_factory=list)
    """Names of FineTunedWeights (LoRA adapters) served beside the base model."""
    deployment_mode: DeploymentMode | None = None
    """Standard, PrefillDecodeDisaggregated, MultiNode or Serverless (derived when omitted)."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """Model name clients send (default: the model's name)."""
    engine: PoolSpec | None = None
    """The engine pool (all modes but PrefillDecodeDisaggregated)."""
    prefill: PoolSpec | None = None
    """Prefill pool (PrefillDecodeDisaggregated)."""
    decode: PoolSpec | None = None
    """Decode pool (PrefillDecodeDisaggregated)."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    gateway: GatewaySpec | None = None
    model_storage: ModelStorageSpec = Field(default_factory=ModelStorageSpec)
    kueue: KueueSpec | None = None

    def effective_mode(self) -> DeploymentMode:
        """``deploymentMode``, or the mode the pools imply when it is omitted."""
        if self.deployment_mode is not None:
            return self.deployment_mode
        if self.prefill is not None or self.decode is not None:
            return "PrefillDecodeDisaggregated"
        if self.engine is not None and self.engine.multi_node is not None:
            return "MultiNode"
        if self.engine is not None and self.engine.min_replicas == 0:
            return "Serverless"
        return "Standard"

    @model_validator(mode="after")
    def _mode(self) -> InferenceServiceSpec:
        mode = self.effective_mode()
        if mode == "PrefillDecodeDisaggregated":
            for role in ("prefill", "decode"):
                if getattr(self, role) is None:
                    raise field_error(role, f"required with PrefillDecodeDisaggregated (a {role} pool)")
            if self.engine is not None:
                raise field_error("engine", "not used with PrefillDecodeDisaggregated; give prefill and decode pools")
            if not self.router.enabled:
                raise field_error("router.enabled", "PrefillDecodeDisaggregated needs the router")
            for role in ("prefill", "decode"):
                pool: PoolSpec = getattr(self, role)
                if pool.multi_node is not None:
                    raise field_error(f"{role}.multiNode", "multi-node prefill/decode pools are not supported")
                if pool.min_replicas == 0:
                    raise field_error(f"{role}.minReplicas", "must be >= 1 (scale to zero is the Serverless mode)")
            return self
        for role in ("prefill", "decode"):
            if getattr(self, role) is not None:
                raise field_error(role, f"only used with PrefillDecodeDisaggregated, not {mode}")
        engine = self.engine or PoolSpec()
        if mode == "MultiNode":
            if engine.multi_node is None:
                raise field_error("engine.multiNode.size", "required (>= 2) with MultiNode")
            if engine.min_replicas == 0:
                raise field_error("engine.minReplicas", "must be >= 1 with MultiNode")
        elif engine.multi_node is not None:
            raise field_error("engine.multiNode", f"only used with MultiNode, not {mode}")
        if mode == "Serverless":
            if engine.min_replicas not in (None, 0):
                raise field_error("engine.minReplicas", f"must be 0 with Serverless, got {engine.min_replicas}")
            if not self.router.enabled:
                raise field_error("router.enabled", "Serverless needs the router (it receives requests while "
                                                    "no engine runs)")
        if mode == "Standard" and engine.min_replicas == 0:
            raise field_error("engine.minReplicas", "must be >= 1 with Standard (Serverless scales to zero)")
        return self


class ComponentStatus(KubeModel):
    """Replicas of one component (``engine``, ``prefill``, ``decode``, ``router``)."""

    replicas: int = Field(default=0, ge=0)
    ready_replicas: int = Field(default=0, ge=0)


class InferenceServiceStatus(KubeModel):
    """Observed state, written by the operator (or the local supervisor)."""

    observed_generation: int | None = Field(default=None, ge=0)
    url: str | None = None
    """Where clients send requests."""
    deployment_mode: DeploymentMode | None = None
    runtime: str | None = None
    """The runtime in use (``kind/name``)."""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=CONDITIONS_SCHEMA)
    """ModelReady, RuntimeResolved, EngineReady, RouterReady and Ready, each with a reason."""
    components: dict[str, ComponentStatus] = Field(default_factory=dict)
    """Replicas per component."""


#: Condition types of an InferenceService, in the order they are established.
SERVICE_CONDITIONS = ("ModelReady", "RuntimeResolved", "EngineReady", "RouterReady", "Ready")


class InferenceService(KubeModel, ResourceMixin):
    """A model served by engine pools behind a router (KServe / OME ``InferenceService``)."""

    KIND: ClassVar[str] = "InferenceService"
    PLURAL: ClassVar[str] = "inferenceservices"
    NAMESPACED: ClassVar[bool] = True

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None

    @model_validator(mode="after")
    def _name(self) -> InferenceService:
        import re

        name = self.metadata.name
        if len(name) > MAX_SERVICE_NAME or not re.match(SERVICE_NAME_PATTERN, name):
            raise field_error("metadata.name", f"must be a DNS-1035 label (lowercase letter first, then a-z, 0-9, "
                                               f"'-') of at most {MAX_SERVICE_NAME} characters, got {name!r}")
        return self
