"""POST /v1/completions: a text prompt continued, without a chat template, for pipelines
whose first stage is an LLM and that answer with text (``stream`` as SSE)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool

from omni_runtime.router.body import Integer, NonEmptyText, Positive
from omni_runtime.router.errors import POST_ERRORS, RequestError, error_responses
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.limits import RouterLimits, check_common
from omni_runtime.router.responses import ChunkWriter, JSONBody, Usage, usage
from omni_runtime.router.route_docs import event_stream, json_request
from omni_runtime.router.sampling import Sampling, StreamOptions
from omni_runtime.router.served import COMPLETIONS
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.stage_requests import PipelineRequest


class CompletionRequest(Sampling):
    """POST /v1/completions: a text prompt continued, without a chat template (pipelines
    whose first stage is an LLM and that answer with text)."""

    model: str | None = None
    # OpenAI's API also takes several prompts, or token ids, in one request; one text
    # prompt per request here (a list of one is taken, as clients send it).
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Unset: 16, OpenAI's and vLLM's default for completions (or the router's limit, if
    # lower).
    max_tokens: Positive | None = None
    n: Positive = 1
    user: str | None = None
    # Accepted as their "off" values, which clients (vLLM's benchmark among them) send.
    echo: StrictBool = False
    logprobs: Annotated[Integer, Field(ge=0)] | None = None
    suffix: str | None = None

    def to_pipeline_request(self, request_id: str, limits: RouterLimits) -> PipelineRequest:
        """The pipeline request this completion asks for; RequestError naming the field
        over a limit or not supported."""
        for name, off in (("echo", False), ("logprobs", None), ("suffix", None)):
            if getattr(self, name) != off:
                raise RequestError(400, f"{name}: not supported by this router", name)
        if self.n != 1:
            raise RequestError(400, f"n: only 1 completion per request (got {self.n})", "n")
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        check_common(limits, len(prompt), self.n, None, prompt_param="prompt")
        return PipelineRequest(
            request_id=request_id,
            prompt=prompt,
            llm_params=self.llm_params(
                self.max_tokens if self.max_tokens is not None else min(16, limits.max_tokens),
                limits,
            ),
            sticky_key=self.user,
            stream=self.stream,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class Completion(BaseModel):
    """A completion; streamed (stream: true), each event is one of these with the new
    text, and the last, with stream_options.include_usage, has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    stream = event_stream("Completion", "one event per new text (a text_completion)")

    @router.post(
        COMPLETIONS,
        summary="Continue a text prompt (no chat template)",
        operation_id="createCompletion",
        response_model=Completion,
        response_description="The completion (or its stream).",
        responses={
            200: {"content": {"text/event-stream": stream}},
            **error_responses(*POST_ERRORS),
        },
        openapi_extra=json_request("CompletionRequest"),
        include_in_schema=serving.served.serves(COMPLETIONS),
    )
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_json(request, serving.limits))
        serving.served.require(COMPLETIONS)
        return await serve_completion(serving, body, request)

    return router


async def serve_completion(
    serving: OpenAIServing, body: CompletionRequest, http: Request
) -> Response:
    adapters = serving.pick_adapters(body.model, body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request = body.to_pipeline_request(request_id, serving.limits)
    request.adapters = adapters
    model = serving.served_model_name
    if body.stream:
        frames = ChunkWriter(request_id, model, "text_completion")
        return await serving.stream_text(request, http, body.include_usage, frames)
    outputs = await serving.run_to_end(request, http)
    final = outputs[-1]
    return JSONBody(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(output.text for output in outputs),
                    "logprobs": None,
                    "finish_reason": final.finish_reason,
                }
            ],
            "usage": usage(final),
        }
    )
