"""kvfleet's typed resources (group ``kvfleet.io``, version ``v1alpha1``).

``BaseModel`` / ``ClusterBaseModel`` (weights, after OME), ``ServingRuntime`` /
``ClusterServingRuntime`` (how to run an engine, after KServe/OME), ``FineTunedWeight`` (LoRA
adapters, after OME) and ``InferenceService`` (what to serve and how, after KServe/OME with llm-d's
P/D pools). CRDs are generated from these models by :func:`kvfleet.control.api.crds.generate`.
"""

from kvfleet.control.api.basemodel import (
    MODEL_CONDITIONS,
    BaseModel,
    BaseModelSpec,
    BaseModelStatus,
    ClusterBaseModel,
    ModelResources,
)
from kvfleet.control.api.builtin_runtimes import KVFLEET_IMAGE, builtin_runtimes
from kvfleet.control.api.catalog import KINDS, Catalog, Resource, load_documents, parse_resource
from kvfleet.control.api.common import (
    API_VERSION,
    GROUP,
    VERSION,
    Condition,
    ObjectMeta,
    ResourceRequirements,
    get_condition,
    set_condition,
)
from kvfleet.control.api.components import (
    DEPLOYMENT_MODES,
    AutoscalingSpec,
    DeploymentMode,
    EngineArgs,
    GatewaySpec,
    KueueSpec,
    ModelStorageSpec,
    MultiNodeSpec,
    PoolSpec,
    RouterSpec,
)
from kvfleet.control.api.errors import SpecError
from kvfleet.control.api.finetuned import FineTunedWeight, FineTunedWeightSpec, ModelRef
from kvfleet.control.api.inference_service import (
    SERVICE_CONDITIONS,
    ComponentStatus,
    InferenceService,
    InferenceServiceSpec,
    InferenceServiceStatus,
    RuntimeRef,
)
from kvfleet.control.api.runtime import ClusterServingRuntime, ServingRuntime, ServingRuntimeSpec
from kvfleet.control.api.source import ModelSource, fingerprint, packaged_source

__all__ = [
    "API_VERSION", "GROUP", "VERSION", "KINDS", "DEPLOYMENT_MODES", "MODEL_CONDITIONS", "SERVICE_CONDITIONS",
    "KVFLEET_IMAGE",
    "AutoscalingSpec", "BaseModel", "BaseModelSpec", "BaseModelStatus", "Catalog", "ClusterBaseModel",
    "ClusterServingRuntime", "ComponentStatus", "Condition", "DeploymentMode", "EngineArgs", "FineTunedWeight",
    "FineTunedWeightSpec", "GatewaySpec", "InferenceService", "InferenceServiceSpec", "InferenceServiceStatus",
    "KueueSpec", "ModelRef", "ModelResources", "ModelSource", "ModelStorageSpec", "MultiNodeSpec", "ObjectMeta",
    "PoolSpec", "Resource", "ResourceRequirements", "RouterSpec", "RuntimeRef", "ServingRuntime",
    "ServingRuntimeSpec", "SpecError", "builtin_runtimes", "fingerprint", "get_condition", "load_documents",
    "packaged_source", "parse_resource", "set_condition",
]
