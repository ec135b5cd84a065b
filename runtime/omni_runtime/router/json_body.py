"""JSON request bodies: read within the size limit, decoded (orjson) within the nesting
limit, and validated as a model; each refusal a 4xx naming the first bad field."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from omni_runtime.config.loader import nesting_depth
from omni_runtime.router.body import Body
from omni_runtime.router.errors import RequestError
from omni_runtime.router.limits import RouterLimits, body_too_large
from omni_runtime.router.request_fields import unknown_field


async def read_json(request: Request, limits: RouterLimits) -> Any:
    """The request's JSON body, read with the size limit; RequestError if it is not."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(
            415, f"Content-Type must be application/json (got {content_type or 'none'!r})"
        )
    check_declared_length(request, limits)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise body_too_large(limits)
        chunks.append(chunk)
    return decode_json(b"".join(chunks), limits)


def check_declared_length(request: Request, limits: RouterLimits) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise body_too_large(limits)


def decode_json(raw: bytes, limits: RouterLimits) -> Any:
    """A request body's JSON; RequestError if it is not JSON or nests too deep.

    orjson stops at 1024 levels by itself, so the depth walk below never meets more, and
    neither recursion nor the input's size can take the router down.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):
            raise RequestError(400, _too_deep(limits)) from None
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if nesting_depth(body, limits.max_json_nesting) > limits.max_json_nesting:
        raise RequestError(400, _too_deep(limits))
    return body


def _too_deep(limits: RouterLimits) -> str:
    return f"the body nests deeper than {limits.max_json_nesting} levels of arrays and objects"


def parse_body(model: type[Body], body: Any) -> Any:
    """Validate ``body`` as ``model``; RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(_integral_as_int(body))
    except ValidationError as e:
        raise first_error(e, model) from None


def _integral_as_int(value: Any) -> Any:
    """``value`` with each float that is a whole number as an int: JSON (and JSON Schema's
    "integer") makes no difference between 280.0 and 280, which clients that compute a size
    send either way. Past 2**53 a float stands for no one integer, and stays a float."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_as_int(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_as_int(item) for item in value]
    return value


def first_error(error: ValidationError, model: type[BaseModel]) -> RequestError:
    first = error.errors(include_url=False)[0]
    path = _path(first["loc"])
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
        return RequestError(400, f"{path}: {unknown_field(path, model)}", param=path)
    return RequestError(400, f"{path}: {_describe(first)}", param=path)


def _path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("text", "image_url") and path.endswith("]"):
            # The discriminated union's branch name is not a field the caller wrote.
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or "body"


def _describe(error: Any) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (not part of this API)"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return f"{error['msg']} (got {error.get('input')!r})"
    return f"{error['msg']} (got {_short(error.get('input'))})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
