"""``ServingRuntime`` and ``ClusterServingRuntime``: how to run one engine (kvfleet, vLLM, SGLang).

The shape follows OME's / KServe's ServingRuntime: an image, the model formats and architectures
it serves (with ``autoSelect`` and ``priority`` for picking a runtime when an InferenceService
names none), the deployment modes it supports and default resources. The command line is a small
template:

- ``command`` + ``args``, where ``{modelPath}``, ``{port}``, ``{servedModelName}`` and
  ``{groupSize}`` are replaced (any other text, braces included, passes through unchanged);
- ``engineArgFlags`` maps each common engine arg (``maxNumSeqs``, ``kvCacheMemory`` ...) to this
  engine's flag: ``{flag: --max-num-seqs}`` emits ``--max-num-seqs VALUE`` (a list value emits the
  flag once followed by every item; a quantity is passed as a byte count), and booleans emit
  ``ifTrue`` / ``ifFalse``; a setting without an entry is rejected;
- ``prefillDecode.prefillArgs`` / ``decodeArgs`` are appended for disaggregated pools;
- ``multiNode`` gives the leader's and workers' commands of a LeaderWorkerSet group
  (``{engineCommand}`` in ``leaderCommand`` is the whole engine command line, shell-quoted).

``metricNames`` maps vLLM metric names to this engine's, so autoscaling on
``vllm:num_requests_waiting`` queries ``sglang:num_queue_reqs`` for SGLang.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kvfleet.control.api.basemodel import ModelFormat
from kvfleet.control.api.common import (
    API_VERSION,
    EnvVar,
    KubeModel,
    MetricName,
    ObjectMeta,
    Quantity,
    ResourceMixin,
    ResourceRequirements,
)
from kvfleet.control.api.components import ENGINE_ARG_NAMES, LORA_ARG_NAMES, DeploymentMode
from kvfleet.control.api.errors import field_error

EngineName = Literal["kvfleet", "vllm", "sglang"]
#: placeholders of ``args``, ``prefillDecode``, ``multiNode`` templates.
PLACEHOLDERS: tuple[str, ...] = ("modelPath", "port", "servedModelName", "groupSize")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(text: str) -> list[str]:
    """The ``{name}`` placeholders in ``text`` (identifiers in braces; JSON text is not one)."""
    return _PLACEHOLDER.findall(text)


class ArgFlag(KubeModel):
    """How one engine arg becomes flags: ``flag`` for a value, ``ifTrue`` / ``ifFalse`` for a switch."""

    flag: str | None = Field(default=None, pattern=r"^-{1,2}[A-Za-z0-9][-A-Za-z0-9_.]*$")
    """Flag followed by the value (``--max-num-seqs 64``)."""
    if_true: list[str] | None = None
    """Flags for ``true`` (may be empty: the engine's default)."""
    if_false: list[str] | None = None
    """Flags for ``false``."""

    @model_validator(mode="after")
    def _one_style(self) -> ArgFlag:
        switch = self.if_true is not None or self.if_false is not None
        if (self.flag is None) == (not switch):
            raise field_error("flag", "give either flag (a valued arg) or ifTrue/ifFalse (a switch)")
        return self


class SupportedModelFormat(KubeModel):
    """A model format this runtime serves (OME's ``supportedModelFormats`` entry)."""

    name: ModelFormat
    architectures: list[str] = Field(default_factory=list)
    """Architectures served in this format (empty: any)."""
    auto_select: bool = True
    """May be picked for an InferenceService that names no runtime."""
    priority: int = Field(default=1, ge=0)
    """Among auto-selectable runtimes, the highest priority wins."""


class PrefillDecodeArgs(KubeModel):
    """Flags that make an engine a prefill or a decode instance (P/D disaggregation)."""

    prefill_args: list[str] = Field(default_factory=list)
    decode_args: list[str] = Field(default_factory=list)


class MultiNodeTemplate(KubeModel):
    """Commands of a LeaderWorkerSet group (LWS sets ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and
    ``LWS_WORKER_INDEX`` in every pod)."""

    leader_command: list[str] | None = None
    """Leader container command; ``{engineCommand}`` is the engine command line. Default: the engine
    command with ``leaderArgs`` appended."""
    leader_args: list[str] = Field(default_factory=list)
    worker_command: list[str] | None = None
    """Worker container command. Default: the engine command with ``workerArgs`` appended."""
    worker_args: list[str] = Field(default_factory=list)


class ServingRuntimeSpec(KubeModel):
    """How to run an engine."""

    engine: EngineName
    """Engine family: ``kvfleet``, ``vllm`` or ``sglang``."""
    image: str = Field(min_length=1)
    """Container image."""
    command: list[str] = Field(min_length=1)
    """Engine executable and fixed leading arguments (``[vllm, serve]``)."""
    args: list[str] = Field(default_factory=list)
    """Argument template; see the module docstring for placeholders."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI API, ``/health`` and ``/metrics``."""
    health_path: str = "/health"
    metrics_path: str = "/metrics"
    supported_model_formats: list[SupportedModelFormat] = Field(min_length=1)
    supported_deployment_modes: list[DeploymentMode] = Field(min_length=1)
    engine_arg_flags: dict[str, ArgFlag] = Field(default_factory=dict)
    """Common engine-arg name -> this engine's flag(s)."""
    prefill_decode: PrefillDecodeArgs | None = None
    multi_node: MultiNodeTemplate | None = None
    metric_names: dict[str, MetricName] = Field(default_factory=dict)
    """vLLM metric name -> this engine's metric name (absent: the same name)."""
    resources: ResourceRequirements | None = None
    """Default container resources."""
    shared_memory: Quantity | None = None
    """Size of a memory-backed ``/dev/shm`` (NCCL and multi-process engines need more than 64Mi)."""
    env: list[EnvVar] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> ServingRuntimeSpec:
        known = ENGINE_ARG_NAMES + LORA_ARG_NAMES
        for name in self.engine_arg_flags:
            if name not in known:
                raise field_error(f"engineArgFlags.{name}", f"unknown engine arg (known: {', '.join(known)})")
        if "MultiNode" in self.supported_deployment_modes and self.multi_node is None:
            raise field_error("multiNode", "required when supportedDeploymentModes lists MultiNode")
        templates: list[tuple[str, str]] = [(f"args[{i}]", a) for i, a in enumerate(self.args)]
        pd = self.prefill_decode
        if pd:
            templates += [(f"prefillDecode.prefillArgs[{i}]", a) for i, a in enumerate(pd.prefill_args)]
            templates += [(f"prefillDecode.decodeArgs[{i}]", a) for i, a in enumerate(pd.decode_args)]
        if self.multi_node:
            mn = self.multi_node
            for name, items in (("leaderArgs", mn.leader_args), ("workerArgs", mn.worker_args),
                                ("workerCommand", mn.worker_command or [])):
                templates += [(f"multiNode.{name}[{i}]", a) for i, a in enumerate(items)]
            for i, a in enumerate(mn.leader_command or []):
                bad = [p for p in placeholders(a) if p not in PLACEHOLDERS and p != "engineCommand"]
                if bad:
                    raise field_error(f"multiNode.leaderCommand[{i}]", f"unknown placeholder {{{bad[0]}}} "
                                      f"(known: engineCommand, {', '.join(PLACEHOLDERS)})")
        for where, text in templates:
            bad = [p for p in placeholders(text) if p not in PLACEHOLDERS]
            if bad:
                raise field_error(where, f"unknown placeholder {{{bad[0]}}} (known: {', '.join(PLACEHOLDERS)})")
        return self

    def supports(self, fmt: str, architecture: str | None) -> SupportedModelFormat | None:
        """The format entry that serves ``fmt`` / ``architecture`` (``None`` architecture matches
        any entry of the format), or ``None``."""
        for entry in self.supported_model_formats:
            if entry.name == fmt and (not entry.architectures or architecture is None
                                      or architecture in entry.architectures):
                return entry
        return None

    def metric(self, vllm_name: str) -> str:
        """This engine's name for the vLLM metric ``vllm_name``."""
        return self.metric_names.get(vllm_name, vllm_name)


class ServingRuntime(KubeModel, ResourceMixin):
    """A runtime usable in one namespace (KServe / OME ``ServingRuntime``)."""

    KIND: ClassVar[str] = "ServingRuntime"
    PLURAL: ClassVar[str] = "servingruntimes"
    NAMESPACED: ClassVar[bool] = True

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["ServingRuntime"] = "ServingRuntime"
    metadata: ObjectMeta
    spec: ServingRuntimeSpec


class ClusterServingRuntime(KubeModel, ResourceMixin):
    """A runtime usable in every namespace (KServe / OME ``ClusterServingRuntime``)."""

    KIND: ClassVar[str] = "ClusterServingRuntime"
    PLURAL: ClassVar[str] = "clusterservingruntimes"
    NAMESPACED: ClassVar[bool] = False

    api_version: Literal["kvfleet.io/v1alpha1"] = API_VERSION
    kind: Literal["ClusterServingRuntime"] = "ClusterServingRuntime"
    metadata: ObjectMeta
    spec: ServingRuntimeSpec


AnyServingRuntime = ServingRuntime | ClusterServingRuntime
