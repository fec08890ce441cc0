"""Reading kvfleet resources from documents, and looking them up by reference.

A :class:`Catalog` is the set of resources a renderer or controller sees: the documents of a
``kvfleet render -f`` file (or the objects an operator watches) plus the built-in
ClusterServingRuntimes. References resolve as in KServe/OME: a namespaced kind in the service's
namespace first, then the cluster-scoped kind of the same name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import ValidationError

from kvfleet.control.api.basemodel import AnyBaseModel, BaseModel, ClusterBaseModel
from kvfleet.control.api.builtin_runtimes import builtin_runtimes
from kvfleet.control.api.common import API_VERSION
from kvfleet.control.api.errors import SpecError, spec_error_from_validation
from kvfleet.control.api.finetuned import FineTunedWeight, ModelRef
from kvfleet.control.api.inference_service import InferenceService, RuntimeRef
from kvfleet.control.api.runtime import AnyServingRuntime, ClusterServingRuntime, ServingRuntime

Resource = BaseModel | ClusterBaseModel | ServingRuntime | ClusterServingRuntime | FineTunedWeight | InferenceService
#: kind -> class of every kvfleet resource.
KINDS: dict[str, type] = {c.KIND: c for c in (BaseModel, ClusterBaseModel, ServingRuntime, ClusterServingRuntime,
                                              FineTunedWeight, InferenceService)}


def parse_resource(data: Any, default_namespace: str = "default") -> Resource:
    """Validate one document into its typed resource.

    Namespaced kinds without ``metadata.namespace`` get ``default_namespace``.

    Raises:
        SpecError: not a mapping, a foreign ``apiVersion``, an unknown ``kind``, or a field that
            fails validation (the message names the field, e.g. ``spec.engine.maxReplicas``).
    """
    if not isinstance(data, dict):
        raise SpecError("", f"expected a mapping (a Kubernetes object), got {type(data).__name__}")
    kind = data.get("kind")
    name = (data.get("metadata") or {}).get("name") if isinstance(data.get("metadata"), dict) else None
    where = f"{kind}/{name}" if kind and name else (str(kind) if kind else None)
    if data.get("apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"expected {API_VERSION}, got {data.get('apiVersion')!r}", where)
    cls = KINDS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise SpecError("kind", f"unknown kind {kind!r} (known: {', '.join(KINDS)})", where)
    try:
        obj = cls.model_validate(data)
    except ValidationError as e:
        raise spec_error_from_validation(e, resource=where) from None
    if cls.NAMESPACED and not obj.metadata.namespace:
        obj.metadata.namespace = default_namespace
    return obj


def load_documents(text: str) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``text``.

    Raises:
        SpecError: the text is not valid YAML.
    """
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError("", f"invalid YAML: {' '.join(str(e).split())}") from None


class Catalog:
    """Resources by kind, namespace and name, with KServe/OME-style reference lookup.

    Args:
        resources: typed resources to add.
        builtin: add the built-in ClusterServingRuntimes (``kvfleet``, ``vllm``, ``sglang``); a
            runtime of the same name among ``resources`` replaces the built-in one.
    """

    def __init__(self, resources: Iterable[Resource] = (), *, builtin: bool = True) -> None:
        self._items: dict[tuple[str, str, str], Resource] = {}
        if builtin:
            for rt in builtin_runtimes().values():
                self.add(rt)
        for r in resources:
            self.add(r)

    @classmethod
    def from_documents(cls, docs: Iterable[Any], default_namespace: str = "default", *,
                       builtin: bool = True) -> Catalog:
        """A catalog of parsed documents (see :func:`parse_resource`).

        Raises:
            SpecError: a document fails validation.
        """
        return cls([parse_resource(d, default_namespace) for d in docs], builtin=builtin)

    @classmethod
    def from_yaml(cls, text: str, default_namespace: str = "default", *, builtin: bool = True) -> Catalog:
        """A catalog of the documents of a (multi-document) YAML text.

        Raises:
            SpecError: invalid YAML or a document that fails validation.
        """
        return cls.from_documents(load_documents(text), default_namespace, builtin=builtin)

    def add(self, resource: Resource) -> None:
        """Add or replace ``resource``."""
        ns = resource.metadata.namespace or "" if resource.NAMESPACED else ""
        self._items[(resource.KIND, ns, resource.metadata.name)] = resource

    def get(self, kind: str, name: str, namespace: str | None = None) -> Resource | None:
        """The resource, or ``None``."""
        return self._items.get((kind, namespace or "" if KINDS[kind].NAMESPACED else "", name))

    def list(self, kind: str, namespace: str | None = None) -> list[Resource]:
        """Resources of ``kind`` (in ``namespace`` when given and the kind is namespaced), by name."""
        out = [r for (k, ns, _), r in self._items.items()
               if k == kind and (namespace is None or not KINDS[kind].NAMESPACED or ns == namespace)]
        return sorted(out, key=lambda r: r.metadata.name)

    def inference_services(self) -> list[InferenceService]:
        """Every InferenceService, by namespace and name."""
        items = [r for r in self._items.values() if isinstance(r, InferenceService)]
        return sorted(items, key=lambda r: (r.metadata.namespace or "", r.metadata.name))

    def model(self, ref: ModelRef, namespace: str) -> AnyBaseModel:
        """The BaseModel (in ``namespace``) or ClusterBaseModel ``ref`` names.

        Raises:
            SpecError: ``spec.model.name`` names no such model.
        """
        kinds = [ref.kind] if ref.kind else ["BaseModel", "ClusterBaseModel"]
        for kind in kinds:
            found = self.get(kind, ref.name, namespace)
            if found is not None:
                return found  # type: ignore[return-value]
        where = " or ".join(f"{k} {ref.name!r}" + (f" in namespace {namespace!r}" if k == "BaseModel" else "")
                            for k in kinds)
        raise SpecError("spec.model.name", f"no {where}")

    def runtime(self, ref: RuntimeRef, namespace: str) -> AnyServingRuntime:
        """The ServingRuntime (in ``namespace``) or ClusterServingRuntime ``ref`` names.

        Raises:
            SpecError: ``spec.runtime.name`` names no such runtime (the message lists the known ones).
        """
        kinds = [ref.kind] if ref.kind else ["ServingRuntime", "ClusterServingRuntime"]
        for kind in kinds:
            found = self.get(kind, ref.name, namespace)
            if found is not None:
                return found  # type: ignore[return-value]
        known = sorted({r.metadata.name for r in self.runtimes(namespace)})
        raise SpecError("spec.runtime.name", f"unknown runtime {ref.name!r} (known: {', '.join(known) or 'none'})")

    def runtimes(self, namespace: str) -> list[AnyServingRuntime]:
        """Runtimes visible from ``namespace``: its ServingRuntimes, then ClusterServingRuntimes not
        shadowed by a ServingRuntime of the same name."""
        local = self.list("ServingRuntime", namespace)
        names = {r.metadata.name for r in local}
        return [*local, *(r for r in self.list("ClusterServingRuntime") if r.metadata.name not in names)]  # type: ignore[misc]

    def fine_tuned_weight(self, name: str, namespace: str, field: str) -> FineTunedWeight:
        """The FineTunedWeight ``name`` in ``namespace``.

        Raises:
            SpecError: none such (blaming ``field``).
        """
        found = self.get("FineTunedWeight", name, namespace)
        if found is None:
            raise SpecError(field, f"no FineTunedWeight {name!r} in namespace {namespace!r}")
        return found  # type: ignore[return-value]
