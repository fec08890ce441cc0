"""``FineTunedWeight``: a LoRA adapter of a base model (OME's FineTunedWeight).

An InferenceService lists adapters by name in ``spec.fineTunedWeights``; the engine serves each
under its own model name next to the base model (vLLM ``--lora-modules name=path``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from kvfleet.control.api.basemodel import BaseModelStatus, SourceURI
from kvfleet.control.api.common import API_VERSION, KubeModel, ObjectMeta, ResourceMixin, ResourceName, Sha256


class ModelRef(KubeModel):
    """A reference to a BaseModel or ClusterBaseModel."""

    name: ResourceName
    kind: Literal["BaseModel", "ClusterBaseModel"] | None = None
    """``BaseModel`` (same namespace) or ``ClusterBaseModel``; when omitted, a BaseModel of that
    name in the namespace, else the ClusterBaseModel."""


class FineTunedWeightSpec(KubeModel):
    """A LoRA adapter."""

    source: SourceURI
    """Where the adapter folder is (same schemes as a BaseModel's source)."""
    base_model: ModelRef
    """The model the adapter was trained on."""
    rank: int = Field(ge=1, le=1024)
    """LoRA rank r (engines size their adapter slots by the largest rank)."""
    format: Literal["safetensors"] = "safetensors"
    """Adapter format: a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``)."""
    sha256: Sha256 | None = None
    """Fingerprint of the adapter folder (see BaseModel ``sha256``)."""
    credentials_secret: str | None = Field(default=None, max_length=253)
    """Secret whose keys become environment variables of the download step."""


class FineTunedWeight(KubeModel, ResourceMixin):
    """A LoRA adapter in one namespace (OME's ``FineTunedWeight``)."""

    KIND: ClassVar[str] = "FineTunedWeight"
    PLURAL: ClassVar[str] = "finetunedweights"
    NAMESPACED: ClassVar[bool] = True

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["FineTunedWeight"] = "FineTunedWeight"
    metadata: ObjectMeta
    spec: FineTunedWeightSpec
    status: BaseModelStatus | None = None
