"""Validate rendered manifests offline: built-in Kubernetes kinds against the Kubernetes OpenAPI
schema (the JSON schemas that ``kubernetes-validate`` ships, strict: unknown fields rejected),
custom resources against the ``openAPIV3Schema`` of their CRDs (jsonschema, made strict the same
way: ``additionalProperties: false`` wherever the schema neither lists free-form properties nor
sets ``x-kubernetes-preserve-unknown-fields``; their ``metadata`` against Kubernetes' ObjectMeta).

CEL rules (``x-kubernetes-validations``) are not evaluated; an API server (or envtest) checks
them. Needs the ``test`` extra (``jsonschema``, ``kubernetes-validate``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

DEFAULT_K8S_VERSION = "1.37"
_DEFS_ID = "https://kubernetes.io/api/_definitions.json"


class ManifestError(ValueError):
    """A manifest failed validation.

    Attributes:
        kind, name: the manifest's kind and name.
        path: dotted path of the offending field.
        against: what it was validated against.
    """

    def __init__(self, kind: str, name: str, path: str, message: str, against: str) -> None:
        self.kind, self.name, self.path, self.against = kind, name, path, against
        super().__init__(f"{kind}/{name}: {path or '(root)'}: {message} (against {against})")


def strict_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema (draft 4) of an OpenAPI v3 CRD schema: ``nullable`` as a ``null`` type,
    int-or-string as ``anyOf``, and ``additionalProperties: false`` on closed objects."""
    s = copy.deepcopy(schema)

    def walk(n: Any) -> Any:
        if isinstance(n, list):
            return [walk(x) for x in n]
        if not isinstance(n, dict):
            return n
        out = {k: (walk(v) if k in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not") else v)
               for k, v in n.items() if k != "properties"}
        if "properties" in n:
            out["properties"] = {k: walk(v) for k, v in n["properties"].items()}
            if "additionalProperties" not in n and not n.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        if n.get("x-kubernetes-int-or-string") and "anyOf" not in n:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if n.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        return out

    return walk(s)


class ManifestValidator:
    """Validates manifests by kind (see the module docstring).

    Args:
        crds: CRD manifests, or paths of CRD YAML files / folders of them.
        k8s_version: Kubernetes version of the built-in schemas (``1.37``; kubernetes-validate
            picks the newest it ships that is not newer).

    Raises:
        ValueError: ``k8s_version`` is newer than any kubernetes-validate ships.
    """

    def __init__(self, crds: Iterable[dict[str, Any] | str | Path] = (), k8s_version: str = DEFAULT_K8S_VERSION):
        import importlib_resources
        import kubernetes_validate.utils as kvu

        versions = [v for v in kvu.all_versions() if kvu.major_minor(v) <= kvu.major_minor(k8s_version)]
        if not versions or kvu.major_minor(k8s_version) > kvu.major_minor(kvu.latest_version()):
            raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {k8s_version} "
                             f"(newest: {kvu.latest_version()})")
        self.k8s_version = kvu.major_minor(versions[-1])
        self._dir = importlib_resources.files("kubernetes_validate") / "kubernetes-json-schema" / \
            f"v{versions[-1]}-local-strict"
        self._defs = json.loads((self._dir / "_definitions.json").read_text())
        self._builtin: dict[tuple[str, str], Any] = {}
        self._custom: dict[tuple[str, str], tuple[Any, str]] = {}
        self._meta = self._k8s_validator({"$ref": f"{_DEFS_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"})
        for c in crds:
            if isinstance(c, dict):
                self.add_crd(c)
            else:
                self.add_crd_path(c)

    def _k8s_validator(self, schema: dict[str, Any]) -> Any:
        import jsonschema
        from referencing import Registry, Resource

        registry = Resource.from_contents(self._defs) @ Registry()
        return jsonschema.Draft202012Validator(schema, registry=registry)

    def add_crd_path(self, path: str | Path) -> None:
        """Add the CRDs of a YAML file, or of every ``*.yaml`` in a folder."""
        p = Path(path)
        files = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
        for f in files:
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: megabyte CRDs in a fraction
            for doc in yaml.load_all(f.read_text(), Loader=loader):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    self.add_crd(doc)

    def add_crd(self, crd: dict[str, Any]) -> None:
        """Add every served version of a CRD."""
        import jsonschema

        spec = crd["spec"]
        for v in spec["versions"]:
            schema = strict_openapi(v["schema"]["openAPIV3Schema"])
            schema.get("properties", {}).pop("metadata", None)
            key = (f"{spec['group']}/{v['name']}", spec["names"]["kind"])
            self._custom[key] = (jsonschema.Draft4Validator(schema), f"CRD {crd['metadata']['name']} {v['name']}")

    def knows(self, api_version: str, kind: str) -> bool:
        """True when a schema for ``apiVersion``/``kind`` is available."""
        return (api_version, kind) in self._custom or self._builtin_schema(api_version, kind) is not None

    def _builtin_schema(self, api_version: str, kind: str) -> Any:
        import re

        key = (api_version, kind)
        if key not in self._builtin:
            group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
            f = self._dir / f"{kind.lower()}-{group_version}.json"
            self._builtin[key] = self._k8s_validator(json.loads(f.read_text())) if f.is_file() else None
        return self._builtin[key]

    def validate(self, manifest: dict[str, Any]) -> str:
        """Validate one manifest; returns what it was validated against.

        Raises:
            ManifestError: it does not validate, or no schema is known for its kind.
        """
        import jsonschema

        api, kind = manifest.get("apiVersion", ""), manifest.get("kind", "")
        name = str((manifest.get("metadata") or {}).get("name", "?"))
        checks: list[tuple[Any, Any, str, str]] = []
        if (api, kind) in self._custom:
            validator, against = self._custom[(api, kind)]
            body = {k: v for k, v in manifest.items() if k != "metadata"}
            checks = [(validator, body, against, ""), (self._meta, manifest.get("metadata", {}),
                                                        f"Kubernetes {self.k8s_version} ObjectMeta", "metadata.")]
        else:
            validator = self._builtin_schema(api, kind)
            if validator is None:
                raise ManifestError(kind, name, "", f"no schema for {api} {kind}", "nothing")
            checks = [(validator, manifest, f"Kubernetes {self.k8s_version} OpenAPI", "")]
        for validator, doc, against, prefix in checks:
            err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
            if err is not None:
                path = prefix + ".".join(str(p) for p in err.absolute_path)
                raise ManifestError(kind, name, path.rstrip("."), err.message, against)
        return checks[0][2]
