"""Shapes shared by every kvfleet resource: the pydantic base, object metadata, conditions,
resource requirements and the validated scalar types (names, quantities, sha256).

Field names are camelCase on the wire (Kubernetes API conventions) and snake_case in Python;
both spellings are accepted when parsing. Unknown fields are rejected, so a typo in a spec is an
error that names it instead of a silently ignored setting.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from kvfleet.control.api.quantity import QUANTITY_PATTERN, parse_quantity

#: API group and version of every kvfleet resource.
GROUP = "kvfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
#: Kubernetes ``metav1.Condition`` reason format.
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
PROMETHEUS_NAME = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"


class KubeModel(BaseModel):
    """Base of every kvfleet API shape: camelCase aliases, unknown fields forbidden, attribute
    docstrings as field descriptions (they become the CRD's ``kubectl explain`` text)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True, validate_default=False)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, ``None`` fields left out, JSON-compatible values."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- scalar types

def _pattern(pattern: str, what: str, max_len: int | None = None):
    rx = re.compile(pattern)

    def check(v: str) -> str:
        if max_len is not None and len(v) > max_len:
            raise ValueError(f"must be at most {max_len} characters, got {len(v)} ({v!r})")
        if not rx.match(v):
            raise ValueError(f"must be {what}, got {v!r}")
        return v

    return check


def _coerce_quantity(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return str(v)
    return v


def _check_quantity(v: str) -> str:
    parse_quantity(v)
    return v


#: A Kubernetes quantity (``500m``, ``2Gi``); ints are accepted and kept as strings.
Quantity = Annotated[str, BeforeValidator(_coerce_quantity), AfterValidator(_check_quantity),
                     WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}],
                                     "pattern": QUANTITY_PATTERN, "x-kubernetes-int-or-string": True})]
#: lowercase hex sha256.
Sha256 = Annotated[str, Field(json_schema_extra={"pattern": SHA256_PATTERN}),
                   AfterValidator(_pattern(SHA256_PATTERN, "64 lowercase hex digits (a sha256)"))]
#: a resource name usable as a label value: DNS-1123 subdomain, at most 63 characters.
ResourceName = Annotated[str, Field(json_schema_extra={"maxLength": 63, "pattern": DNS1123_SUBDOMAIN}),
                         AfterValidator(_pattern(DNS1123_SUBDOMAIN, "a DNS-1123 name (lowercase a-z, 0-9, '-', "
                                                 "'.')", 63))]
#: a Prometheus metric name (``vllm:num_requests_waiting``).
MetricName = Annotated[str, Field(json_schema_extra={"pattern": PROMETHEUS_NAME}),
                       AfterValidator(_pattern(PROMETHEUS_NAME, "a Prometheus metric name"))]


# --------------------------------------------------------------------------- metadata

class ObjectMeta(KubeModel):
    """Kubernetes object metadata (the fields kvfleet reads; any others are kept as they are)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    """Object name."""
    namespace: str | None = None
    """Namespace of namespaced kinds; filled from the reader's default when omitted."""
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    """Set by the API server; rendered objects get an ownerReference only when it is known."""
    generation: int | None = None
    resource_version: str | None = None


class Condition(KubeModel):
    """A status condition in the shape of Kubernetes' ``metav1.Condition``."""

    type: str = Field(min_length=1, max_length=316)
    """Condition type, e.g. ``Ready``."""
    status: Literal["True", "False", "Unknown"]
    reason: str | None = Field(default=None, max_length=1024, pattern=REASON_PATTERN)
    """One CamelCase word saying why (``ModelNotFound``, ``MinimumReplicasAvailable``)."""
    message: str | None = Field(default=None, max_length=32768)
    """Human-readable details."""
    last_transition_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """When ``status`` last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The ``metadata.generation`` the condition was computed from."""


#: list-map markers for ``status.conditions`` (one entry per type, merged by type on apply).
CONDITIONS_SCHEMA = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


def set_condition(conditions: list[Condition], type: str, status: Literal["True", "False", "Unknown"],
                  reason: str, message: str = "", generation: int | None = None,
                  now: datetime | None = None) -> list[Condition]:
    """Return ``conditions`` with the condition ``type`` set (added or replaced, order kept).

    ``lastTransitionTime`` changes only when ``status`` changes, as Kubernetes controllers do.

    Raises:
        ValueError: ``reason`` is not one CamelCase word.
    """
    if not re.match(REASON_PATTERN, reason):
        raise ValueError(f"condition reason must match {REASON_PATTERN}, got {reason!r}")
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type == type:
            found = True
            when = c.last_transition_time if c.status == status and c.last_transition_time else stamp
            out.append(Condition(type=type, status=status, reason=reason, message=message or None,
                                 last_transition_time=when, observed_generation=generation))
        else:
            out.append(c)
    if not found:
        out.append(Condition(type=type, status=status, reason=reason, message=message or None,
                             last_transition_time=stamp, observed_generation=generation))
    return out


def get_condition(conditions: list[Condition], type: str) -> Condition | None:
    """The condition of ``type``, or ``None``."""
    return next((c for c in conditions if c.type == type), None)


# --------------------------------------------------------------------------- pod-level shapes

class ResourceRequirements(KubeModel):
    """Container resource requests and limits, as in a Kubernetes container spec
    (``cpu``, ``memory``, ``nvidia.com/gpu`` ...)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class EnvVar(KubeModel):
    """An environment variable with a literal value."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str = ""


class Toleration(KubeModel):
    """A pod toleration (Kubernetes ``core/v1`` Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ResourceMixin:
    """Helpers shared by the top-level resource classes (``apiVersion``/``kind``/``metadata``)."""

    KIND: ClassVar[str]
    PLURAL: ClassVar[str]
    NAMESPACED: ClassVar[bool]
    metadata: ObjectMeta

    @property
    def ref(self) -> str:
        """``Kind/name`` or ``Kind/namespace/name``, for messages."""
        ns = self.metadata.namespace if self.NAMESPACED else None
        return f"{self.KIND}/{ns}/{self.metadata.name}" if ns else f"{self.KIND}/{self.metadata.name}"
