"""Toxic and proxy descriptions as the HTTP API sees them, plus JSON validation.

Everything here is immutable or pure, so it is safe to use from any thread.
Error messages and status codes mirror Toxiproxy 2.5 (``api.go``,
``toxic_collection.go``): errors are raised as :class:`ApiError` and rendered by
the HTTP layer as ``{"error": "...", "status": N}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ApiError",
    "DIRECTIONS",
    "TOXIC_ATTRIBUTES",
    "ToxicSpec",
    "parse_new_toxic",
    "parse_toxic_update",
    "parse_proxy_fields",
]

DIRECTIONS = ("upstream", "downstream")

#: Attribute names and defaults per toxic type (all integers, as in upstream).
TOXIC_ATTRIBUTES: dict[str, dict[str, int]] = {
    "latency": {"latency": 0, "jitter": 0},  # milliseconds
    "bandwidth": {"rate": 0},  # KB/s with KB = 1000 bytes
    "slicer": {"average_size": 0, "size_variation": 0, "delay": 0},  # bytes, bytes, µs
    "timeout": {"timeout": 0},  # milliseconds, 0 = never close
    "reset_peer": {"timeout": 0},  # milliseconds
    "limit_data": {"bytes": 0},
}


class ApiError(Exception):
    """An API failure with Toxiproxy's message text and HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def to_json(self) -> dict[str, Any]:
        return {"error": self.message, "status": self.status}

    def joined(self, detail: str) -> ApiError:
        """Return ``"<message>: <detail>"`` with the same status (upstream ``joinError``)."""
        return ApiError(f"{self.message}: {detail}", self.status)


ERR_BAD_REQUEST_BODY = ApiError("bad request body", 400)
ERR_MISSING_FIELD = ApiError("missing required field", 400)
ERR_PROXY_NOT_FOUND = ApiError("proxy not found", 404)
ERR_PROXY_EXISTS = ApiError("proxy already exists", 409)
ERR_INVALID_STREAM = ApiError("stream was invalid, can be either upstream or downstream", 400)
ERR_INVALID_TOXIC_TYPE = ApiError("invalid toxic type", 400)
ERR_TOXIC_EXISTS = ApiError("toxic already exists", 409)
ERR_TOXIC_NOT_FOUND = ApiError("toxic not found", 404)


@dataclass(frozen=True)
class ToxicSpec:
    """One configured toxic. Replaced (never mutated) when updated."""

    name: str
    type: str
    stream: str
    toxicity: float
    attributes: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "attributes": dict(self.attributes),
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
        }


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal into an object")
    return body


def _as_int(key: str, value: object) -> int:
    # Go's decoder rejects bools, strings and non-integral numbers for int64 fields.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ERR_BAD_REQUEST_BODY.joined(f"json: cannot unmarshal {value!r} into field {key}")
    if isinstance(value, float) and not value.is_integer():
        raise ERR_BAD_REQUEST_BODY.joined(f"json: cannot unmarshal number {value} into {key}")
    return int(value)


def _as_float(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ERR_BAD_REQUEST_BODY.joined(f"json: cannot unmarshal {value!r} into field {key}")
    return float(value)


def _as_str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ERR_BAD_REQUEST_BODY.joined(f"json: cannot unmarshal {value!r} into field {key}")
    return value


def _merge_attributes(toxic_type: str, base: Mapping[str, int], given: object) -> dict[str, int]:
    merged = dict(base)
    if given is None:
        return merged
    if not isinstance(given, dict):
        raise ERR_BAD_REQUEST_BODY.joined("json: attributes must be an object")
    known = TOXIC_ATTRIBUTES[toxic_type]
    for key, value in given.items():
        if key in known:  # unknown keys are ignored, like Go's json decoder
            merged[key] = _as_int(key, value)
    return merged


def parse_new_toxic(body: object, exists: Any) -> ToxicSpec:
    """Validate a ``POST /proxies/{p}/toxics`` body; ``exists(name)`` checks duplicates."""
    data = _require_object(body)
    stream = _as_str("stream", data.get("stream", "downstream"))
    if stream not in DIRECTIONS:
        raise ERR_INVALID_STREAM
    toxic_type = _as_str("type", data.get("type", ""))
    name = _as_str("name", data.get("name") or "") or f"{toxic_type}_{stream}"
    toxicity = _as_float("toxicity", data.get("toxicity", 1.0))
    if toxic_type not in TOXIC_ATTRIBUTES:
        raise ERR_INVALID_TOXIC_TYPE
    if exists(name):
        raise ERR_TOXIC_EXISTS
    attributes = _merge_attributes(toxic_type, TOXIC_ATTRIBUTES[toxic_type], data.get("attributes"))
    return ToxicSpec(name, toxic_type, stream, toxicity, attributes)


def parse_toxic_update(current: ToxicSpec, body: object) -> ToxicSpec:
    """Apply a ``POST /proxies/{p}/toxics/{t}`` body: only attributes and toxicity change."""
    data = _require_object(body)
    attributes = _merge_attributes(current.type, current.attributes, data.get("attributes"))
    toxicity = current.toxicity
    if "toxicity" in data:
        toxicity = _as_float("toxicity", data["toxicity"])
    return ToxicSpec(current.name, current.type, current.stream, toxicity, attributes)


def parse_proxy_fields(body: object, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Validate proxy create/update fields, starting from ``defaults``."""
    data = _require_object(body)
    result = dict(defaults)
    for key in ("name", "listen", "upstream"):
        if key in data and data[key] is not None:
            result[key] = _as_str(key, data[key])
    if "enabled" in data:
        if not isinstance(data["enabled"], bool):
            raise ERR_BAD_REQUEST_BODY.joined("json: enabled must be a boolean")
        result["enabled"] = data["enabled"]
    return result
