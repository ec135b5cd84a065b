"""vLLM's POST /tokenize and /detokenize, outside /v1 as vLLM serves them (its benchmark
client aligns its prompts with them): token ids of a prompt (or a conversation through the
chat template) and back, by the pipeline's first stage's tokenizer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool

from omni_runtime.router.body import Body, Integer
from omni_runtime.router.errors import POST_ERRORS, RequestError, error_responses
from omni_runtime.router.json_body import parse_body, read_json
from omni_runtime.router.limits import RouterLimits, check_common
from omni_runtime.router.messages import ChatMessage, ImagePart, flatten_messages
from omni_runtime.router.orchestrator import PipelineError
from omni_runtime.router.responses import JSONBody
from omni_runtime.router.route_docs import json_request
from omni_runtime.router.served import DETOKENIZE, TOKENIZE
from omni_runtime.router.serving import OpenAIServing
from omni_runtime.router.stage_replica_pool import NoLiveReplicaError

# A tokenize call is milliseconds of a stage server's time; one far past that has lost its
# replica (which the pool notices on its own).
_TOKENIZER_TIMEOUT_S = 30.0


class TokenizeRequest(Body):
    """POST /tokenize (vLLM's): a prompt's token ids, or a conversation's through the chat
    template, as the pipeline's first stage computes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    # vLLM's default; a conversation is tokenized as the first stage renders a chat request.
    add_generation_prompt: Literal[True] = True

    def stage_kwargs(self, limits: RouterLimits) -> dict[str, Any]:
        """The first stage's tokenize call for this request; RequestError when it is not
        exactly one of prompt and messages, or over the prompt limit."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if self.prompt is not None:
            check_common(limits, len(self.prompt), 1, None, prompt_param="prompt")
            return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}
        assert self.messages is not None
        if any(
            not isinstance(m.content, str) and any(isinstance(p, ImagePart) for p in m.content)
            for m in self.messages
        ):
            raise RequestError(400, "messages: /tokenize takes text only", "messages")
        messages, _ = flatten_messages(self.messages, limits, 0)
        check_common(limits, sum(len(m["content"]) for m in messages), 1, None)
        return {"messages": messages}


class DetokenizeRequest(Body):
    """POST /detokenize (vLLM's): token ids as text."""

    model: str | None = None
    tokens: list[Annotated[Integer, Field(ge=0, le=2**31 - 1)]]

    def stage_kwargs(self, limits: RouterLimits) -> dict[str, Any]:
        # Each token is at least a character of text: the prompt limit bounds them too.
        if len(self.tokens) > limits.max_prompt_chars:
            raise RequestError(
                400, f"tokens: at most {limits.max_prompt_chars} (got {len(self.tokens)})", "tokens"
            )
        return {"tokens": self.tokens}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None


class DetokenizeResponse(BaseModel):
    prompt: str


def routes(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()
    suffix = " (vLLM's API; the pipeline's first stage's tokenizer)"

    @router.post(
        TOKENIZE,
        summary="Token ids of a prompt, or of a conversation through the chat template" + suffix,
        operation_id="tokenize",
        response_model=TokenizeResponse,
        response_description="Token ids of a prompt, or of a conversation through the chat "
        "template.",
        responses=error_responses(*POST_ERRORS),
        openapi_extra=json_request("TokenizeRequest"),
        include_in_schema=serving.served.serves(TOKENIZE),
    )
    async def tokenize(request: Request) -> Response:
        body = parse_body(TokenizeRequest, await read_json(request, serving.limits))
        serving.served.require(TOKENIZE)
        serving.pick_adapters(body.model, body)
        answer = await _tokenizer_call(serving, TOKENIZE, body.stage_kwargs(serving.limits))
        tokens = answer["tokens"]
        return JSONBody(
            {
                "count": len(tokens),
                "max_model_len": answer["max_model_len"],
                "tokens": tokens,
                "token_strs": None,
            }
        )

    @router.post(
        DETOKENIZE,
        summary="Token ids as text" + suffix,
        operation_id="detokenize",
        response_model=DetokenizeResponse,
        response_description="Token ids as text.",
        responses=error_responses(*POST_ERRORS),
        openapi_extra=json_request("DetokenizeRequest"),
        include_in_schema=serving.served.serves(DETOKENIZE),
    )
    async def detokenize(request: Request) -> Response:
        body = parse_body(DetokenizeRequest, await read_json(request, serving.limits))
        serving.served.require(DETOKENIZE)
        serving.pick_adapters(body.model, body)
        answer = await _tokenizer_call(serving, DETOKENIZE, body.stage_kwargs(serving.limits))
        return JSONBody({"prompt": answer["prompt"]})

    return router


async def _tokenizer_call(
    serving: OpenAIServing, path: str, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The utility method of ``path`` on a replica of the first stage, which tokenizes the
    caller's text; its refusal as a 400 naming the field."""
    method = path.removeprefix("/")
    pool = serving.pools[serving.orchestrator.first_stage.stage_id]
    try:
        answer: dict[str, Any] = await pool.call_utility(
            method, kwargs, timeout=_TOKENIZER_TIMEOUT_S
        )
    except NoLiveReplicaError as e:
        raise PipelineError(503, str(e), kind="service_unavailable") from None
    except TimeoutError:
        raise PipelineError(
            504, f"{method} did not answer within {_TOKENIZER_TIMEOUT_S:g} s", kind="timeout"
        ) from None
    if "error" in answer:
        raise RequestError(400, answer["error"], answer.get("param"))
    return answer
