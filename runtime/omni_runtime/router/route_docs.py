"""What a route declares for the OpenAPI document that FastAPI cannot see for itself: the
body a handler reads raw (so that the limits hold while it streams in), named by its
schema, which ``router.openapi`` adds; and an event stream's events."""

from __future__ import annotations

from typing import Any

_REF = "#/components/schemas/{model}"


def ref(model: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=model)}


def request_body(contents: dict[str, str]) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a body FastAPI does not read: by media type, the
    name of its schema (added to the document by ``openapi_document``)."""
    return {
        "requestBody": {
            "required": True,
            "content": {media: {"schema": ref(name)} for media, name in contents.items()},
        }
    }


def json_request(model: str) -> dict[str, Any]:
    return request_body({"application/json": model})


def form_request(form: str) -> dict[str, Any]:
    return request_body({"multipart/form-data": form})


def event_stream(model: str, what: str) -> dict[str, Any]:
    """The ``text/event-stream`` content of a streamed answer, for a route's ``responses=``:
    OpenAPI 3.1 reads an event stream's schema as that of each event, here a ``model`` (or
    an error object if the request fails after the stream started) or ``[DONE]``; ``what``
    says what the events are."""
    ref = {"$ref": f"#/components/schemas/{model}"}
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    return {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "description": f"With stream: true, {what}, an error object if the request "
                    "fails after the stream started, then [DONE].",
                    "anyOf": [
                        {"const": "[DONE]"},
                        {
                            "type": "string",
                            "contentMediaType": "application/json",
                            "contentSchema": {"anyOf": [ref, error]},
                        },
                    ],
                }
            },
        }
    }
