"""The API's one error shape, OpenAI's: ``{"error": {"message", "type", "param", "code"}}``
with a 4xx/5xx status; the refusal every check raises (``RequestError``), its answer, and
what each status means, which the routes declare for the OpenAPI document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.responses import JSONBody


class RequestError(Exception):
    """A request refused before it reached a stage: status, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong, naming the field and the limit.")
    type: str = Field(
        description="invalid_request_error (4xx), rate_limit_exceeded (429), "
        "service_unavailable (503), timeout (504), server_error (500)."
    )
    param: str | None = Field(description="The request field at fault, when one is.")
    code: int | None = Field(description="The HTTP status.")


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's."""

    error: ErrorDetail


def error_body(
    status: int, message: str, *, kind: str | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(error: RequestError | PipelineError) -> JSONBody:
    """The OpenAI-shaped answer to a refused or failed request."""
    headers = None
    kind = None
    if isinstance(error, PipelineError):
        kind = error.kind
        if error.retry_after is not None:
            headers = {"Retry-After": str(max(1, round(error.retry_after)))}
    return JSONBody(
        error_body(error.status, error.message, kind=kind, param=error.param),
        status_code=error.status,
        headers=headers,
    )


# Why each error status is answered; the statuses a route declares are those its handler
# (and the layers around it) can return.
_MEANINGS: dict[int, str] = {
    400: "The body breaks a rule (the message names the field and the rule), is not "
    "valid JSON or form data, nests too deep, is over a RouterLimits limit, or a stage "
    "refused a parameter.",
    401: "Missing or wrong API key (when the router requires one).",
    404: "The model named is not served here (the model, or one of its LoRA adapters), or "
    "(videos) no such job.",
    409: "The video job is not completed: its content does not exist yet.",
    413: "The body, or an input image, is over its size limit.",
    415: "The Content-Type is not the one the path takes.",
    429: "The router or a stage replica is at its concurrency limit: retry after the "
    "Retry-After header's seconds.",
    500: "A stage failed on the request.",
    503: "No pipeline revision has a live replica of every stage, or (videos) the job store "
    "cannot be reached.",
    504: "The request did not finish within the router's timeout.",
}
# What a POST that runs a request through the stages can answer.
POST_ERRORS = (400, 401, 404, 413, 415, 429, 500, 503, 504)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI's ``responses=`` for ``statuses``: each an ErrorResponse, with its meaning
    (and a 429's Retry-After header). JSON whatever the route's own answer is (FastAPI
    would give a ``model`` the route's media type), so the schema is named, not given."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        response: dict[str, Any] = {
            "description": _MEANINGS[status],
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            },
        }
        if status == 429:
            response["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            }
        responses[status] = response
    return responses
