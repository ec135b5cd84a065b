"""StageLLMRequestBuilder: a caller's prompt and sampling params -> a StageLLMCoreRequest.

What vLLM's front end (its InputProcessor) does before a request reaches an engine core,
for the one stage the builder is made for: tokenize (chat messages through the model's
chat template), check the prompt against the model's limits, merge the pipeline's default
sampling params under the request's own, validate them, and fill in what the core relies
on (max_tokens, the end-of-sequence tokens). A generate stage gets SamplingParams; an
encode stage (output: hidden_states) gets the pooling params that return each prompt
token's hidden state. A request the builder refuses raises InvalidLLMRequestError, whose
``error`` names the offending field (``param``) and says what is wrong in a message that
starts with it, e.g. ``params.temperature: ...``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from transformers import AutoTokenizer
from vllm import PoolingParams, SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError

from omni_runtime.engine.stage.stage_core_types import StageError, StageLLMCoreRequest

# The sampling parameters an engine core honours by itself. Others are front-end work that
# a stage does not do (n > 1 fans out into several requests, stop strings need the
# detokenizer, logprobs and structured output need more plumbing) or vLLM internals.
SAMPLING_PARAM_NAMES = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "skip_special_tokens",
    "detokenize",
)
# Per-token hidden states after the final norm, as the model computes them: no
# normalisation (the pooler's default activation would L2-normalise each row).
HIDDEN_STATES_POOLING = PoolingParams(task="token_embed", use_activation=False)


class InvalidLLMRequestError(ValueError):
    """A request the stage refuses; the message starts with the offending field, which
    ``param`` names (a sampling parameter by its own name)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    @property
    def error(self) -> StageError:
        return StageError.bad_request(str(self), self.param)


class StageLLMRequestBuilder:
    """Builds the requests of one LLM stage, from its VllmConfig and default params."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        default_sampling_params: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_config = vllm_config.model_config
        self.encodes = self.model_config.runner_type == "pooling"
        self.default_sampling_params = dict(default_sampling_params or {})
        if self.encodes and self.default_sampling_params:
            name = next(iter(self.default_sampling_params))
            raise InvalidLLMRequestError(
                f"defaultSamplingParams.{name}: a hidden-states stage does not sample", name
            )
        _check_names(self.default_sampling_params, "defaultSamplingParams")
        _convert_sampling_params(self.default_sampling_params, "defaultSamplingParams")
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_config.tokenizer,
            revision=self.model_config.tokenizer_revision,
            trust_remote_code=self.model_config.trust_remote_code,
        )
        self._generation_config = self.model_config.try_get_generation_config()

    @property
    def max_prompt_len(self) -> int:
        # Read each time: the engine may fit max_model_len to its KV cache at startup, and
        # the client updates the config from the engine's ready message.
        max_model_len: int = self.model_config.max_model_len
        return max_model_len if self.encodes else max_model_len - 1

    def build(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: Mapping[str, Any] | None = None,
        additional_information: dict[str, Any] | None = None,
    ) -> StageLLMCoreRequest:
        """The request for one prompt: give exactly one of ``prompt`` (text),
        ``messages`` (chat, through the chat template) or ``prompt_token_ids``."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidLLMRequestError("request_id: a non-empty string is required", "request_id")
        token_ids, field_name = self._tokenize(prompt, messages, prompt_token_ids)
        if len(token_ids) > self.max_prompt_len:
            raise InvalidLLMRequestError(
                f"{field_name}: {len(token_ids)} tokens, but this stage takes at most "
                f"{self.max_prompt_len} (max_model_len {self.model_config.max_model_len})",
                field_name,
            )
        if additional_information is not None:
            try:
                msgspec.msgpack.encode(additional_information)
            except (TypeError, msgspec.EncodeError) as e:
                raise InvalidLLMRequestError(
                    f"additional_information: plain data only (str, numbers, lists, maps): {e}",
                    "additional_information",
                ) from None
        sampling_params, pooling_params = self._params(dict(params or {}), len(token_ids))
        return StageLLMCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            mm_features=None,
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            additional_information=additional_information,
        )

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of generated token ids, as the tokenizer that made the prompt reads it."""
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def _tokenize(
        self,
        prompt: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        prompt_token_ids: Sequence[int] | None,
    ) -> tuple[list[int], str]:
        given = [
            name
            for name, value in (
                ("prompt", prompt),
                ("messages", messages),
                ("prompt_token_ids", prompt_token_ids),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidLLMRequestError(
                "prompt: give exactly one of prompt, messages, prompt_token_ids "
                f"(got {', '.join(given) or 'none'})",
                "prompt",
            )
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidLLMRequestError(
                    f"prompt: expected text, got {type(prompt).__name__}", "prompt"
                )
            if not prompt:
                raise InvalidLLMRequestError("prompt: empty", "prompt")
            return list(self.tokenizer(prompt)["input_ids"]), "prompt"
        if messages is not None:
            return self._apply_chat_template(messages), "messages"
        assert prompt_token_ids is not None
        token_ids = list(prompt_token_ids)
        if not token_ids:
            raise InvalidLLMRequestError("prompt_token_ids: empty", "prompt_token_ids")
        vocab_size = self.model_config.get_vocab_size()
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
            raise InvalidLLMRequestError(
                f"prompt_token_ids: token ids must be integers in [0, {vocab_size})",
                "prompt_token_ids",
            )
        return token_ids, "prompt_token_ids"

    def _apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if not messages:
            raise InvalidLLMRequestError("messages: empty", "messages")
        for index, message in enumerate(messages):
            if not (
                isinstance(message, Mapping)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise InvalidLLMRequestError(
                    f"messages[{index}]: expected {{'role': str, 'content': str}}", "messages"
                )
        if self.tokenizer.chat_template is None:
            raise InvalidLLMRequestError(
                "messages: this model has no chat template; send prompt", "messages"
            )
        # A generate stage answers as the assistant; an encode stage encodes the
        # conversation as it stands.
        text = self.tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tokenize=False,
            add_generation_prompt=not self.encodes,
        )
        # The template writes the special tokens itself.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _params(
        self, params: dict[str, Any], prompt_len: int
    ) -> tuple[SamplingParams | None, PoolingParams | None]:
        if self.encodes:
            if params:
                name = next(iter(params))
                raise InvalidLLMRequestError(
                    f"params.{name}: this stage returns hidden states and takes no sampling "
                    "parameters",
                    name,
                )
            pooling_params = HIDDEN_STATES_POOLING.clone()
            pooling_params.verify(self.model_config)
            return None, pooling_params
        # The request's own params alone first, so that an error names what the caller sent.
        _check_names(params, "params")
        _convert_sampling_params(params, "params")
        sampling_params = _convert_sampling_params(
            {**self.default_sampling_params, **params}, "params"
        )
        if sampling_params.max_tokens is None:
            # As vLLM's front end does: up to the end of the context.
            sampling_params.max_tokens = self.model_config.max_model_len - prompt_len
        # The core stops at the tokenizer's end-of-sequence token and the generation
        # config's, which the front end puts on the params.
        sampling_params.update_from_generation_config(
            self._generation_config, self.tokenizer.eos_token_id
        )
        try:
            sampling_params.verify(self.model_config, None, None, None)
        except VLLMValidationError as e:
            raise _invalid_from_vllm(e, "params") from None
        return sampling_params, None


def _check_names(params: Mapping[str, Any], where: str) -> None:
    for name in params:
        if name not in SAMPLING_PARAM_NAMES:
            raise InvalidLLMRequestError(
                f"{where}.{name}: unknown sampling parameter "
                f"(allowed: {', '.join(SAMPLING_PARAM_NAMES)})",
                name,
            )


def _convert_sampling_params(params: Mapping[str, Any], where: str) -> SamplingParams:
    try:
        sampling_params: SamplingParams = msgspec.convert(dict(params), SamplingParams)
    except VLLMValidationError as e:
        raise _invalid_from_vllm(e, where) from None
    except msgspec.ValidationError as e:
        # msgspec gives the path only in its text: "Expected `int | null`, got `str` - at
        # `$.max_tokens`" -> "params.max_tokens: ...", param max_tokens.
        located = re.fullmatch(r"(.*) - at `\$\.(.*)`", str(e))
        if located:
            name = located[2]
            raise InvalidLLMRequestError(f"{where}.{name}: {located[1]}", name) from None
        raise InvalidLLMRequestError(f"{where}: {e}") from None
    return sampling_params


def _invalid_from_vllm(error: VLLMValidationError, where: str) -> InvalidLLMRequestError:
    # vLLM names the parameter apart from its message (which repeats it, with the value).
    message = str(error.args[0]) if error.args else str(error)
    if error.parameter is not None:
        return InvalidLLMRequestError(f"{where}.{error.parameter}: {message}", error.parameter)
    return InvalidLLMRequestError(f"{where}: {message}")
