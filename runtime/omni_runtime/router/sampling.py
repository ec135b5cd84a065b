"""What an LLM stage samples with, as OpenAI's API and vLLM's server name it: the fields
chat completions and completions share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictBool

from omni_runtime.router.body import Body, Integer, Number, Seed
from omni_runtime.router.errors import RequestError
from omni_runtime.router.limits import RouterLimits


class StreamOptions(Body):
    include_usage: StrictBool = False


class Sampling(Body):
    """An LLM stage's sampling fields, as OpenAI's API and vLLM's server (its extensions:
    top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
    skip_special_tokens) name them. The router checks their types and ranges; the stage
    checks the rest with vLLM's own SamplingParams, and a refusal names the field."""

    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    # vLLM takes -1 and 0 for no top-k, and refuses less; a JSON integer past 64 bits
    # parses as a float, so the bound says where integers end.
    top_k: Annotated[Integer, Field(ge=-1, le=2**63 - 1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    min_tokens: Annotated[Integer, Field(ge=0, le=2**31 - 1)] | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Annotated[Integer, Field(ge=0, le=2**31 - 1)]] | None = None
    skip_special_tokens: StrictBool | None = None
    seed: Seed | None = None

    def llm_params(self, max_tokens: int | None, limits: RouterLimits) -> dict[str, Any]:
        """The sampling params given, by the stage's names; RequestError past a limit."""
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise RequestError(
                400, f"max_tokens: at most {limits.max_tokens} (got {max_tokens})", "max_tokens"
            )
        most = max_tokens if max_tokens is not None else limits.max_tokens
        if self.min_tokens is not None and self.min_tokens > most:
            raise RequestError(
                400,
                f"min_tokens: at most max_tokens ({most}; got {self.min_tokens})",
                "min_tokens",
            )
        params = {
            name: getattr(self, name) for name in _LLM_PARAMS if getattr(self, name) is not None
        }
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        return params


# The body fields that are an LLM stage's sampling params, by the same name.
_LLM_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "seed",
)
