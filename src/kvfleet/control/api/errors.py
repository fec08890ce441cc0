"""Spec errors that name the offending field (``spec.engine.maxReplicas: must be >= minReplicas``).

Every validation failure of the control plane, whether pydantic's own (types, bounds, patterns,
unknown fields) or a cross-resource check (an unknown runtime, a sha256 that does not match), is
reported as one :class:`SpecError` whose message starts with the field path, the way
``kubectl apply`` reports API-server validation errors.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

#: pydantic error type used by :func:`field_error`; its context carries the sub-field name.
FIELD_ERROR = "kvfleet_field"


class SpecError(ValueError):
    """A resource failed validation.

    Attributes:
        field: dotted path of the offending field (``spec.engine.maxReplicas``,
            ``spec.fineTunedWeights[0]``); empty when the whole document is at fault.
        message: what is wrong, without the field path.
        resource: ``Kind/name`` (or ``Kind/namespace/name``) of the resource, when known.
    """

    def __init__(self, field: str, message: str, resource: str | None = None) -> None:
        self.field, self.message, self.resource = field, message, resource
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.field}: " if self.field else ""
        who = f"{self.resource}: " if self.resource else ""
        return f"{who}{where}{self.message}"

    def with_resource(self, resource: str) -> SpecError:
        """A copy naming ``resource`` (kept when one is already set)."""
        return SpecError(self.field, self.message, self.resource or resource)


def field_error(field: str, message: str) -> PydanticCustomError:
    """An error to raise from a pydantic model validator that blames one of the model's fields.

    ``raise field_error("maxReplicas", "must be >= minReplicas (2), got 1")`` inside the validator
    of ``spec.engine`` is reported as ``spec.engine.maxReplicas: must be >= minReplicas (2), got 1``.
    ``field`` may be dotted (``multiNode.size``).
    """
    return PydanticCustomError(FIELD_ERROR, "{message}", {"field": field, "message": message})


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "tagged-union")):  # pydantic-internal loc parts
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required"
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg


def spec_error_from_validation(exc: ValidationError, prefix: str = "", resource: str | None = None,
                               max_errors: int = 3) -> SpecError:
    """Turn a pydantic :class:`~pydantic.ValidationError` into one :class:`SpecError`.

    The first error's field becomes :attr:`SpecError.field`; up to ``max_errors`` errors are joined
    with ``"; "`` into a one-line message (each further one with its own field path).

    Args:
        exc: the validation error.
        prefix: path of the validated object inside the document (e.g. ``spec``), prepended.
        resource: ``Kind/name`` for the message.
    """
    parts: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        path = _loc_to_path(tuple(err["loc"]))
        if err["type"] == FIELD_ERROR:
            sub = err["ctx"]["field"]
            path = f"{path}.{sub}" if path else sub
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        parts.append((path, _message(err)))
    if not parts:  # pragma: no cover - pydantic always reports at least one error
        return SpecError(prefix, str(exc), resource)
    field, message = parts[0]
    extra = [f"{p}: {m}" if p else m for p, m in parts[1:max_errors]]
    if len(parts) > max_errors:
        extra.append(f"and {len(parts) - max_errors} more")
    return SpecError(field, "; ".join([message, *extra]), resource)
