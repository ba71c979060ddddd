"""Field errors of a 422, rendered as the API server's ``field.Error`` renders them: the
tests compare the emulator's messages with a real server's byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from k8s.go import go_quote, go_value


@dataclass(frozen=True)
class Cause:
    """One field error of a 422, as the API server words it (``message`` is its body)."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class _Omit:
    """The server's ``OmitValueType``: an error that names no value."""


OMIT: Final = _Omit()
_WORDS = {
    "FieldValueNotFound": "Not found",
    "FieldValueRequired": "Required value",
    "FieldValueDuplicate": "Duplicate value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value",
    "FieldValueForbidden": "Forbidden",
    "FieldValueTooLong": "Too long",
    "FieldValueTooMany": "Too many",
    "InternalError": "Internal error",
    "FieldValueTypeInvalid": "Invalid value",
}
_NO_VALUE = ("FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong", "InternalError")


def field_error(reason: str, path: str, value: Any = OMIT, detail: str = "") -> Cause:
    """A field error rendered like the server's ``field.Error``; an empty path is ``<nil>``."""
    body = _WORDS[reason]
    if reason not in _NO_VALUE and value is not OMIT:
        body += f": {go_value(value)}"
    if detail:
        body += f": {detail}"
    return Cause(path or "<nil>", body, reason)


def invalid(path: str, value: Any, detail: str) -> Cause:
    return field_error("FieldValueInvalid", path, value, detail)


def required(path: str, detail: str = "") -> Cause:
    return field_error("FieldValueRequired", path, detail=detail)


def required_or_invalid(path: str, value: Any, detail: str) -> Cause:
    """``Required`` when ``value`` is empty, else ``Invalid`` with it."""
    return invalid(path, value, detail) if value else required(path, detail)


def forbidden(path: str, detail: str) -> Cause:
    return field_error("FieldValueForbidden", path, detail=detail)


def not_supported(path: str, value: Any, supported: list[str]) -> Cause:
    detail = "supported values: " + ", ".join(go_quote(s) for s in supported) if supported else ""
    return field_error("FieldValueNotSupported", path, value, detail)


def child(path: str, name: str) -> str:
    """``field.Path.Child``: a dotted name (the empty path is the server's nil path)."""
    return f"{path}.{name}" if path else name


def key(path: str, name: str) -> str:
    """``field.Path.Key``: a map key or a property name in brackets."""
    return f"{path}[{name}]"


def invalid_raw(path: str, shown: str, detail: str) -> Cause:
    """An ``Invalid value`` whose value is already rendered (a Go struct, as JSON)."""
    return Cause(path, f"Invalid value: {shown}: {detail}")
