"""StageLLMRequestBuilder: a caller's prompt and sampling params -> a StageLLMCoreRequest.

vLLM's own front end does the work, for the one stage the builder is made for: its
renderer tokenizes (chat messages through the model's chat template) and checks the
prompt's length and token ids; its InputProcessor validates the sampling params, fills in
what the core relies on (max_tokens, the end-of-sequence tokens) and builds the engine-core
request. The builder adds what a stage has beyond vLLM: the parameters a caller may send
(SAMPLING_PARAM_NAMES), the merge of the pipeline's defaultSamplingParams under the
request's own, and errors that name the caller's field. A generate stage gets
SamplingParams; an encode stage (output: hidden_states) gets the pooling params that
return each prompt token's hidden state. A request the builder refuses raises
InvalidLLMRequestError, whose ``error`` names the offending field (``param``) and says what
is wrong in a message that starts with it, e.g. ``params.temperature: ...``.

The encoder stage of a model family (``omni_runtime.families``) renders a prompt as the family's
pipeline does before its text encoder sees it: its template (or its tokenizer's chat
template), its truncation, and for an edit the input images, resized as the pipeline resizes
them, through vLLM's multimodal processor.

The stages of a family that speaks (Qwen3-Omni) differ again: its thinker reads chat
messages whose parts are text and audio (the samples come apart, decoded by the router),
and a request that will be spoken asks it for its rows (``speak``); its talker's requests
are made from what the thinker handed it, not from text: the builder checks their params
and names their inputs (``build_with_inputs``), and the engine core, which fetches the
arrays, finishes them (``StageLLMInputs``, stage_llm_inputs.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
from vllm import PoolingParams, SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.renderers import renderer_from_config
from vllm.renderers.params import ChatParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.input_processor import InputProcessor

from omni_runtime.engine.models import (
    HIDDEN_ROWS,
    STEP_HAND_OFFS,
    THINK_TOKENS,
    StepHandOff,
    input_prompt,
)
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    InvalidStageRequestError,
    StageLLMCoreRequest,
)
from omni_runtime.families import EncoderRecipe, SpeechStage, prompt_image_size

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


class InvalidLLMRequestError(InvalidStageRequestError):
    """A request the LLM stage refuses before it reaches the core."""


class StageLLMRequestBuilder:
    """Builds the requests of one LLM stage, from its VllmConfig and default params."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        default_sampling_params: Mapping[str, Any] | None = None,
        encoder: EncoderRecipe | None = None,
        think_tokens: int | None = None,
        speech: SpeechStage | None = None,
    ) -> None:
        """``think_tokens``: an encoder in think mode (its family's), the most tokens of its
        plans; ``speech``: the stage is the thinker or the talker of a family that speaks."""
        self.model_config = vllm_config.model_config
        # Set where the engine serves LoRA adapters.
        self.lora_config = vllm_config.lora_config
        self.encoder = encoder
        self.speech = speech
        self.think_tokens = think_tokens
        self.encodes = self.model_config.runner_type == "pooling"
        self.default_sampling_params = dict(default_sampling_params or {})
        if self.encodes and self.default_sampling_params:
            name = next(iter(self.default_sampling_params))
            raise InvalidLLMRequestError(
                f"defaultSamplingParams.{name}: a hidden-states stage does not sample", name
            )
        _check_names(self.default_sampling_params, "defaultSamplingParams")
        _convert_sampling_params(self.default_sampling_params, "defaultSamplingParams")
        # The renderer reads max_model_len once, which the engine may fit to its KV cache
        # at startup: build this once the cores are up (the client does, on first use).
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        # A talker reads and writes codec tokens: it has no tokenizer.
        self.tokenizer: Any = (
            None if self.model_config.skip_tokenizer_init else self.renderer.get_tokenizer()
        )
        # How the stage's architecture makes a request of what an upstream stage handed off
        # (a talker's of the thinker's rows); None: its requests are text.
        architecture = self.model_config.architectures[0]
        self.input_prompt: Any = input_prompt(architecture, self.model_config.hf_config)
        # What the stage hands off of what its model says per step; None: it says nothing.
        self.step_hand_off: StepHandOff | None = STEP_HAND_OFFS.get(architecture)
        # The task this stage's runner was configured for (stage_llm_engine_config): what
        # its requests ask of the core, which checks them against what it serves.
        self._tasks = ("token_embed",) if self.encodes else ("generate",)

    def build(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: Mapping[str, Any] | None = None,
        additional_information: dict[str, Any] | None = None,
        images: Sequence[np.ndarray] = (),
        audios: Sequence[np.ndarray] = (),
        lora_request: LoRARequest | None = None,
        hand_off: bool = False,
    ) -> StageLLMCoreRequest:
        """The request for one prompt: give exactly one of ``prompt`` (text),
        ``messages`` (chat, through the chat template) or ``prompt_token_ids``; ``images``
        (uint8 RGB each) only to a family's encoder that takes them, ``audios`` (float32
        mono samples) only to a thinker that hears, placed by the messages' input_audio
        parts; ``lora_request``: the LoRA adapter to generate with, loaded into the
        engine already (StageLLMCoreClientBase.load_adapter_async)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidLLMRequestError("request_id: a non-empty string is required", "request_id")
        if lora_request is not None and self.lora_config is None:
            raise InvalidLLMRequestError(
                f"model: this stage's engine serves no LoRA adapters (adapter "
                f"{lora_request.lora_name!r})",
                "model",
            )
        params = dict(params or {})
        thinks = False
        speaks = False
        if self.speech is not None and self.speech.role == "thinker":
            # Its rows are asked for only where a later stage reads them (a spoken answer).
            speaks = hand_off
            engine_input, field_name = self._render_heard(prompt, messages, audios, images)
        elif audios:
            raise InvalidLLMRequestError(
                "input_audio: this LLM stage takes no audio", "input_audio"
            )
        elif self.encoder is not None:
            image_kwargs: dict[str, Any] = {}
            if self.encoder.context_kv:
                image_kwargs = _encoder_dit_params(params, self.encoder.dit_params)
                thinks = self._thinks(params)
            engine_input, field_name = self._render_for_family(
                self.encoder, prompt, messages, prompt_token_ids, images, image_kwargs
            )
        elif images:
            raise InvalidLLMRequestError("image: this LLM stage takes text only", "image")
        else:
            engine_input, field_name = self._render(prompt, messages, prompt_token_ids)
        if additional_information is not None:
            try:
                msgspec.msgpack.encode(additional_information)
            except (TypeError, msgspec.EncodeError) as e:
                raise InvalidLLMRequestError(
                    f"additional_information: plain data only (str, numbers, lists, maps): {e}",
                    "additional_information",
                ) from None
        stage_params = self._params(params)
        if speaks:
            assert isinstance(stage_params, SamplingParams)
            stage_params.extra_args = {**(stage_params.extra_args or {}), HIDDEN_ROWS: True}
        if thinks:
            assert isinstance(stage_params, PoolingParams)
            stage_params.extra_kwargs = {THINK_TOKENS: self.think_tokens}
        try:
            request = self.input_processor.process_inputs(
                request_id, engine_input, stage_params, self._tasks, lora_request=lora_request
            )
        except (VLLMValidationError, ValueError) as e:
            # The renderer checked the prompt but for one thing vLLM leaves to this step: a
            # prompt that fills the context leaves no position for a generated token.
            fills_context = len(engine_input["prompt_token_ids"]) >= self.model_config.max_model_len
            if getattr(e, "parameter", None) is None and fills_context:
                raise InvalidLLMRequestError(f"{field_name}: {e}", field_name) from None
            raise invalid_from_vllm(e, "params") from None
        return StageLLMCoreRequest(
            **{name: getattr(request, name) for name in EngineCoreRequest.__struct_fields__},
            additional_information=additional_information,
        )

    def says(self, request: StageLLMCoreRequest) -> bool:
        """Whether ``request``'s model says something per step that the stage hands off
        (step_hand_off): every request's where the architecture always says (a talker's
        frames), else where the request asked for it as ``build`` made it (a thinker's
        rows, for a request that will be spoken)."""
        hand_off = self.step_hand_off
        if hand_off is None:
            return False
        if hand_off.always:
            return True
        params = request.sampling_params
        return params is not None and bool((params.extra_args or {}).get(HIDDEN_ROWS))

    def build_with_inputs(
        self,
        request_id: str,
        inputs: Mapping[str, HandOff],
        params: Mapping[str, Any] | None = None,
    ) -> StageLLMCoreRequest:
        """The request of a stage whose model reads what an upstream stage handed off, as
        it crosses to the engine core: the hand-offs (``inputs``), the params its model
        reads taken out (a voice), the rest merged over the stage's defaults. Its prompt
        is the core's to make, once it has fetched the arrays (StageLLMInputs)."""
        prompt = self.input_prompt
        for name in inputs:
            if prompt is None or name not in prompt.inputs:
                raise InvalidLLMRequestError(
                    f"inputs.{name}: this stage's model does not read it (an LLM stage "
                    "takes text: prompt or messages)",
                    name,
                )
        if prompt is None:
            raise InvalidLLMRequestError("inputs: required by build_with_inputs", "inputs")
        for name in prompt.inputs:
            if name not in inputs:
                raise InvalidLLMRequestError(
                    f"inputs.{name}: required (an upstream stage's hand-off)", name
                )
        params = dict(params or {})
        # A speaking family names the voice a request gets without one.
        voice = self.speech.recipe.voices[0] if self.speech is not None else ""
        try:
            information = prompt.take_params(params, voice)
        except InvalidStageRequestError as e:
            raise InvalidLLMRequestError(str(e), e.param) from None
        sampling = self._params(params)
        return StageLLMCoreRequest(
            request_id=request_id,
            prompt_token_ids=None,
            mm_features=None,
            sampling_params=sampling,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            additional_information=information,
            inputs=dict(inputs),
        )

    def _render_heard(
        self,
        prompt: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        audios: Sequence[np.ndarray],
        images: Sequence[np.ndarray],
    ) -> tuple[Any, str]:
        """A thinker's input: the chat template over messages whose content is text or a
        list of text, input_audio and image parts, each audio or image part standing for the
        next of ``audios`` or ``images``, which its model's multimodal processor expands and
        encodes."""
        assert self.speech is not None
        assert self.tokenizer is not None
        if messages is None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidLLMRequestError("prompt: give a prompt (text) or messages", "prompt")
            messages = [{"role": "user", "content": prompt}]
        elif prompt is not None:
            raise InvalidLLMRequestError("prompt: give a prompt or messages, not both", "prompt")
        heard = seen = 0
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidLLMRequestError(f"messages[{index}]: expected a role", "messages")
            if isinstance(content, str):
                continue
            if not isinstance(content, list):
                raise InvalidLLMRequestError(
                    f"messages[{index}].content: expected text or a list of parts", "messages"
                )
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "input_audio":
                    heard += 1
                elif kind == "image":
                    seen += 1
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise InvalidLLMRequestError(
                        f"messages[{index}].content: parts are text, input_audio or image",
                        "messages",
                    )
        if heard != len(audios) or seen != len(images):
            raise InvalidLLMRequestError(
                f"messages: {heard} input_audio and {seen} image part(s) for {len(audios)} "
                f"audio and {len(images)} image input(s)",
                "messages",
            )
        text = self.tokenizer.apply_chat_template(
            [dict(message) for message in messages], tokenize=False, add_generation_prompt=True
        )
        engine_prompt: dict[str, Any] = {
            "prompt_token_ids": list(self.tokenizer(text)["input_ids"])
        }
        if audios:
            rate = self.speech.recipe.input_sample_rate
            for audio in audios:
                if audio.ndim != 1 or audio.dtype != np.float32 or not len(audio):
                    raise InvalidLLMRequestError(
                        "input_audio: expected float32 mono samples", "input_audio"
                    )
            engine_prompt["multi_modal_data"] = {"audio": [(audio, rate) for audio in audios]}
        if images:
            pictures = [_rgb_image(image) for image in images]
            engine_prompt.setdefault("multi_modal_data", {})["image"] = pictures
        try:
            (engine_input,) = self.renderer.render_cmpl([engine_prompt])
        except (VLLMValidationError, ValueError) as e:
            raise InvalidLLMRequestError(f"messages: {e}", "messages") from None
        return engine_input, "messages"

    def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """The token ids of ``prompt`` (the tokenizer's, with its special tokens if
        ``add_special_tokens``) or of ``messages`` (through the chat template, exactly as
        a chat request to this stage is rendered): what vLLM's /tokenize answers."""
        if messages is not None:
            engine_input, _ = self._render(None, messages, None)
            return list(engine_input["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise InvalidLLMRequestError("prompt: give a prompt (text) or messages", "prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text (vLLM's /detokenize); InvalidLLMRequestError for an id
        outside the vocabulary."""
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise InvalidLLMRequestError("tokens: token ids must be integers", "tokens")
        try:
            self.renderer.validate_token_ids(list(token_ids), parameter="tokens")
        except (VLLMValidationError, ValueError) as e:
            raise InvalidLLMRequestError(f"tokens: {e}", "tokens") from None
        text: str = self.tokenizer.decode(list(token_ids))
        return text

    def _render(
        self,
        prompt: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        prompt_token_ids: Sequence[int] | None,
    ) -> tuple[Any, str]:
        """vLLM's engine input for the prompt (token ids, arrival time), and the name of
        the field it came from."""
        fields = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids}
        given = {name: value for name, value in fields.items() if value is not None}
        if len(given) != 1:
            raise InvalidLLMRequestError(
                "prompt: give exactly one of prompt, messages, prompt_token_ids "
                f"(got {', '.join(given) or 'none'})",
                "prompt",
            )
        ((field_name, value),) = given.items()
        # What vLLM takes for granted about its input's shape is checked here first.
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidLLMRequestError(
                f"prompt: expected text, got {type(prompt).__name__}", "prompt"
            )
        if not value:
            raise InvalidLLMRequestError(f"{field_name}: empty", field_name)
        if messages is not None:
            for index, message in enumerate(messages):
                if not (
                    isinstance(message, Mapping)
                    and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)
                ):
                    raise InvalidLLMRequestError(
                        f"messages[{index}]: expected {{'role': str, 'content': str}}",
                        "messages",
                    )
        token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        if token_ids is not None and not all(isinstance(t, int) for t in token_ids):
            raise InvalidLLMRequestError(
                "prompt_token_ids: token ids must be integers", "prompt_token_ids"
            )
        try:
            if messages is not None:
                # A generate stage answers as the assistant; an encode stage encodes the
                # conversation as it stands.
                chat = ChatParams(chat_template_kwargs={"add_generation_prompt": not self.encodes})
                _, (engine_input,) = self.renderer.render_chat(
                    [[dict(message) for message in messages]], chat
                )
            elif token_ids is not None:
                self.renderer.validate_token_ids(token_ids)
                (engine_input,) = self.renderer.render_cmpl([{"prompt_token_ids": token_ids}])
            else:
                (engine_input,) = self.renderer.render_cmpl([{"prompt": prompt}])
        except (VLLMValidationError, ValueError) as e:
            raise InvalidLLMRequestError(f"{field_name}: {e}", field_name) from None
        return engine_input, field_name

    def _render_for_family(
        self,
        encoder: EncoderRecipe,
        prompt: str | None,
        messages: Sequence[Mapping[str, str]] | None,
        prompt_token_ids: Sequence[int] | None,
        images: Sequence[np.ndarray],
        image_kwargs: Mapping[str, Any],
    ) -> tuple[Any, str]:
        if messages is not None or prompt_token_ids is not None or not isinstance(prompt, str):
            raise InvalidLLMRequestError(
                "prompt: this encoder stage takes the prompt as text (it applies its model "
                "family's template)",
                "prompt",
            )
        if len(images) > 1 and encoder.image_prompt is None:
            raise InvalidLLMRequestError(
                f"image: this encoder reads one input image with the prompt (got {len(images)})",
                "image",
            )
        if encoder.template is not None:
            text = encoder.template_text(prompt, len(images))
        else:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                **dict(encoder.chat_template_kwargs),
            )
        truncate = encoder.max_length is not None
        token_ids = list(
            self.tokenizer(text, truncation=truncate, max_length=encoder.max_length)["input_ids"]
        )
        if len(token_ids) <= encoder.drop_prefix:
            # The template's own rows are dropped; nothing of the prompt would be left.
            raise InvalidLLMRequestError(
                f"prompt: the template gives {len(token_ids)} tokens, no more than the "
                f"{encoder.drop_prefix} it drops (a tokenizer that does not fit the family)",
                "prompt",
            )
        engine_prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        if encoder.context_kv:
            self._refuse_reserved_tokens(token_ids)
            # A context (BAGEL's): in think mode its system prompt, then the input image
            # (its spans where the placeholder is, made by the architecture's multimodal
            # processor: omni_runtime.engine.models), then the prompt.
            context: list[int] = []
            if self.think_tokens is not None and encoder.think_system_prompt is not None:
                context += self.framed_prompt_ids(encoder.think_system_prompt)
            if images:
                assert encoder.image_placeholder is not None
                context.append(self.tokenizer.convert_tokens_to_ids(encoder.image_placeholder))
                engine_prompt["multi_modal_data"] = {"image": _rgb_image(images[0])}
                engine_prompt["mm_processor_kwargs"] = dict(image_kwargs)
            engine_prompt["prompt_token_ids"] = [*context, *token_ids]
        elif encoder.image_area is not None:
            if not images:
                raise InvalidLLMRequestError(
                    "image: required: this encoder reads the input image with the prompt",
                    "image",
                )
            area = encoder.image_area
            pictures = [_prompt_image(image, area) for image in images]
            # One image as itself, as the single-image family has always sent it.
            engine_prompt["multi_modal_data"] = {
                "image": pictures if len(pictures) > 1 else pictures[0]
            }
        elif images:
            raise InvalidLLMRequestError("image: this encoder stage takes text only", "image")
        try:
            (engine_input,) = self.renderer.render_cmpl([engine_prompt])
        except (VLLMValidationError, ValueError) as e:
            raise InvalidLLMRequestError(f"prompt: {e}", "prompt") from None
        return engine_input, "prompt"

    def framed_prompt_ids(self, text: str) -> list[int]:
        """A text as a context encoder frames it in its context (the recipe's template)."""
        assert self.encoder is not None
        assert self.encoder.template is not None
        return list(self.tokenizer(self.encoder.template.format(text))["input_ids"])

    def _thinks(self, params: dict[str, Any]) -> bool:
        """Whether an encoder's request writes a plan: in think mode, unless its params say
        ``think: false`` (BAGEL's image-dropped companion, which holds the prompt alone)."""
        think = params.pop("think", None)
        if think is None:
            return self.think_tokens is not None
        if not isinstance(think, bool):
            raise InvalidLLMRequestError(
                f"params.think: expected true or false, got {think!r}", "think"
            )
        if think and self.think_tokens is None:
            raise InvalidLLMRequestError(
                "params.think: this encoder's stage is not in think mode (its think option)",
                "think",
            )
        return think

    def _refuse_reserved_tokens(self, token_ids: Sequence[int]) -> None:
        assert self.encoder is not None
        for marker in self.encoder.reserved_tokens:
            if self.tokenizer.convert_tokens_to_ids(marker) in token_ids:
                raise InvalidLLMRequestError(
                    f"prompt: contains {marker}, which stands for an image in this encoder's "
                    "context (send the image as an image)",
                    "prompt",
                )

    def _params(self, params: dict[str, Any]) -> SamplingParams | PoolingParams:
        if self.encodes:
            if params:
                name = next(iter(params))
                raise InvalidLLMRequestError(
                    f"params.{name}: this stage returns hidden states and takes no sampling "
                    "parameters",
                    name,
                )
            # vLLM's checks may fill in fields of the params they verify.
            return HIDDEN_STATES_POOLING.clone()
        # The request's own params alone first, so that an error names what the caller sent.
        _check_names(params, "params")
        _convert_sampling_params(params, "params")
        return _convert_sampling_params({**self.default_sampling_params, **params}, "params")


def _prompt_image(image: np.ndarray, area: int) -> Any:
    """An input image as an edit pipeline gives it to its text encoder: resized to about
    ``area`` pixels, as diffusers' VaeImageProcessor resizes (Lanczos)."""
    from PIL import Image

    picture = _rgb_image(image)
    size = prompt_image_size(picture.width, picture.height, area)
    return picture.resize(size, resample=Image.Resampling.LANCZOS)


def _rgb_image(image: np.ndarray) -> Any:
    from PIL import Image

    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise InvalidLLMRequestError(
            f"image: expected uint8 RGB [height, width, 3], got {image.dtype} {list(image.shape)}",
            "image",
        )
    return Image.fromarray(image, mode="RGB")


def _encoder_dit_params(params: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """What a context encoder takes of a request's DiT params (its recipe's ``dit_params``),
    taken out of ``params`` for its multimodal processor. Only ``seed`` is known so far
    (BAGEL's input image's VAE sample is the seed's first draw, as the DiT's generator
    expects)."""
    kwargs: dict[str, Any] = {}
    seed = params.pop("seed", None) if "seed" in names else None
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise InvalidLLMRequestError(
                f"params.seed: expected an integer in [0, 2^63), got {seed!r}", "seed"
            )
        kwargs["seed"] = seed
    return kwargs


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
        raise invalid_from_vllm(e, where) from None
    except msgspec.ValidationError as e:
        raise InvalidLLMRequestError.from_validation(e, where) from None
    return sampling_params


def invalid_from_vllm(error: Exception, where: str) -> InvalidLLMRequestError:
    # vLLM names the parameter apart from its message (which repeats it, with the value),
    # where it knows which one.
    message = str(error.args[0]) if error.args else str(error)
    parameter = getattr(error, "parameter", None)
    if parameter is not None:
        return InvalidLLMRequestError(f"{where}.{parameter}: {message}", parameter)
    return InvalidLLMRequestError(f"{where}: {message}")
