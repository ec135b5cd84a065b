"""Qwen3-Omni's thinker and talker as vLLM architectures (StepStateModel, step_state.py).

The thinker is vLLM's own ``Qwen3OmniMoeThinkerForConditionalGeneration`` that also says,
for each token it reads, the two rows Qwen3-Omni's talker is built from: the token's input
embedding (its audio or image features where it is a placeholder) and the output of the
thinker's layer ``accept_hidden_layer``. It says them only for requests that ask
(``HIDDEN_ROWS`` in their extra args), as ``[tokens, 2 * hidden]``, embedding first.

The talker is Qwen3-Omni's talker: a MoE decoder over codec tokens (vLLM's Qwen3-MoE, its
embedding table the codec's), its codec head, and the code predictor that turns each
sampled codec token into the 15 residual codes of its frame. Its prompt is made from the
thinker's rows (``TalkerInputs``), not from token ids: the stage sends dummy ids to place
it. At every step after the first its input is the sum of the embeddings of the previous
frame's 16 codes plus the thinker's next text row, which is why it keeps state per request.
Each step it says the frame its input token completed: ``[1, 16]`` codes, as code2wav
takes them. This is transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``'s
hand-off and talker loop, computed per request instead of per batch of equal requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

from omni_runtime.engine.models import HIDDEN_ROWS, STEP_HAND_OFFS
from omni_runtime.engine.models.step_state import StepRequest
from omni_runtime.engine.stage.stage_core_types import InvalidStageRequestError

# A talker request's extra args key: its TalkerInputs, msgpack-encoded.
TALKER_INPUTS = "omni_talker_inputs"


class TalkerInputs(msgspec.Struct, array_like=True, frozen=True):
    """What the talker's prompt is made from: the thinker's rows for its prompt and all its
    answer but the last token (as it read them), raw, and the prompt's token ids."""

    rows: bytes
    rows_shape: tuple[int, int]
    rows_dtype: str
    prompt_token_ids: list[int]
    # The voice: its codec token (the talker config's speaker_id).
    speaker: int
    # Sample the residual codes (as transformers' code predictor does when the talker
    # samples) or take the likeliest (greedy).
    sample: bool = False

    def array(self) -> np.ndarray:
        return np.frombuffer(self.rows, dtype=self.rows_dtype).reshape(self.rows_shape)


def talker_prompt_length(prompt_token_ids: Sequence[int] | np.ndarray, config: Any) -> int:
    """How many positions the talker's prompt takes for a thinker prompt (``config``: the
    checkpoint's whole Qwen3OmniMoeConfig): its user tokens, then 9 of the assistant's."""
    return int(user_mask(prompt_token_ids, config).sum()) + ASSISTANT_PREFIX


def talker_inputs_issue(
    rows_shape: Sequence[int], prompt_token_ids: Sequence[int] | np.ndarray, config: Any
) -> str | None:
    """What makes a talker's inputs unusable (None: nothing). Checked before a request
    reaches the engine: an error inside a model's step fails every request of the engine.
    ``config``: the talker's (talker_config below)."""
    if len(rows_shape) != 2 or rows_shape[1] != 2 * config.thinker_hidden_size:
        return (
            f"the thinker's rows are {list(rows_shape)}; the talker reads "
            f"[tokens, {2 * config.thinker_hidden_size}] (its thinker_hidden_size, twice)"
        )
    prompt = np.asarray(prompt_token_ids, dtype=np.int64)
    if prompt.ndim != 1 or len(prompt) < 2 or rows_shape[0] < len(prompt):
        return (
            f"the thinker's prompt has {prompt.size} token(s) and its rows {rows_shape[0]}: "
            "a row for every prompt token is needed"
        )
    opens = (prompt[:-1] == config.im_start_token_id) & (prompt[1:] == config.assistant_token_id)
    if not opens.any():
        return "the thinker's prompt opens no assistant turn (<|im_start|>assistant)"
    return None


# What a talker request reads, under the names the thinker hands them off by: the
# thinker's rows, and its prompt's token ids (where the talker finds the user's turns).
THINKER_ROWS = STEP_HAND_OFFS["OmniQwen3OmniThinker"].said
THINKER_PROMPT = str(STEP_HAND_OFFS["OmniQwen3OmniThinker"].prompt)
# additional_information's key of the voice's codec token, from the stage server (which
# reads the request's ``voice``) to the engine core (which builds the prompt).
SPEAKER = "speaker"


class TalkerPrompt:
    """How a talker's requests are made (engine.models.INPUT_PROMPTS): the stage server
    takes its voice out of the params, the engine core checks what the thinker handed it
    and makes the prompt, sampling within the codec."""

    inputs = (THINKER_ROWS, THINKER_PROMPT)

    def __init__(self, config: Any) -> None:
        # The talker's HF config (talker_config below).
        self.config = config

    def speaker(self, voice: str) -> int | None:
        """The codec token of ``voice`` (any case); None for a voice it does not know."""
        speaker = self.config.speaker_id.get(voice.lower())
        return int(speaker) if speaker is not None else None

    def take_params(self, params: dict[str, Any], default_voice: str) -> dict[str, Any]:
        """What of ``params`` the talker reads (taken out): ``voice``, as its codec token.
        InvalidStageRequestError naming the voices it knows for one it does not."""
        voice = params.pop("voice", default_voice)
        speaker = self.speaker(voice) if isinstance(voice, str) else None
        if speaker is None:
            known = ", ".join(self.config.speaker_id)
            raise InvalidStageRequestError(
                f"params.voice: unknown voice {voice!r} (voices: {known})", "voice"
            )
        return {SPEAKER: speaker}

    def issue(self, inputs: Mapping[str, torch.Tensor]) -> str | None:
        """What makes the thinker's hand-off unusable here; None: nothing."""
        rows, prompt = inputs[THINKER_ROWS], inputs[THINKER_PROMPT]
        if prompt.is_floating_point() or prompt.is_complex():
            return f"the thinker's prompt ids are {prompt.dtype}, not integers"
        return talker_inputs_issue(tuple(rows.shape), prompt.numpy(), self.config)

    def prepare(
        self, inputs: Mapping[str, torch.Tensor], information: Mapping[str, Any], sampling: Any
    ) -> list[int]:
        """The placeholder ids of the request's prompt; ``sampling`` (its SamplingParams)
        made to sample as transformers' generate samples the talker, the inputs in its
        extra args. Every id from vocab - 1024 on (the codec's specials and voices) is
        suppressed but the end of speech: what remains is exactly code2wav's codebook."""
        config = self.config
        rows = inputs[THINKER_ROWS]
        if rows.dtype == torch.bfloat16:
            # numpy has no bf16: carried as float32 (exact), the talker casts back.
            rows = rows.float()
        array = rows.contiguous().numpy()
        prompt_token_ids = [int(token) for token in inputs[THINKER_PROMPT].tolist()]
        vocab = config.text_config.vocab_size
        sampling.allowed_token_ids = [*range(vocab - 1024), config.codec_eos_token_id]
        sampling.stop_token_ids = [config.codec_eos_token_id]
        # The checkpoint's generation_config.json is the thinker's: its end-of-text ids would
        # join the talker's stops, and where one of them is also a code (a small codebook's)
        # the answer would end mid-sentence. The codec's end alone ends speech.
        sampling.ignore_eos = True
        sampling.detokenize = False
        talker_inputs = TalkerInputs(
            array.tobytes(),
            (array.shape[0], array.shape[1]),
            array.dtype.str,
            prompt_token_ids,
            int(information[SPEAKER]),
            sample=sampling.temperature > 0,
        )
        sampling.extra_args = {TALKER_INPUTS: msgspec.msgpack.encode(talker_inputs)}
        return [config.codec_pad_id] * talker_prompt_length(prompt_token_ids, config)


# The talker's prompt after the user's tokens: the assistant's first 3 text rows, 4 pads,
# bos and the first answer token, under codec rows nothink, think bos/eos, voice, pad, bos.
ASSISTANT_PREFIX = 9


def user_mask(prompt_token_ids: Sequence[int] | np.ndarray, config: Any) -> np.ndarray:
    """Which prompt tokens the talker reads: those of user turns, from a turn's
    <|im_start|> to the next one (the role is the token after <|im_start|>)."""
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    length = len(ids)
    positions = np.arange(length)
    starts = np.where(ids == config.im_start_token_id, positions, -1)
    previous = np.maximum.accumulate(starts).clip(min=0)
    roles = ids[np.minimum(previous + 1, length - 1)]
    mask: np.ndarray = roles == config.user_token_id
    return mask


class OmniQwen3OmniThinker(Qwen3OmniMoeThinkerForConditionalGeneration):  # type: ignore[misc]
    """vLLM's Qwen3-Omni thinker that also says each token's talker rows (see above)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        accept = vllm_config.model_config.hf_config.talker_config.accept_hidden_layer
        # vLLM's own auxiliary-hidden-state hook (EAGLE 3's): layer 0 is the input
        # embeddings, layer k the output of the k-th decoder layer, residual added.
        self.language_model.model.aux_hidden_state_layers = (0, accept)
        self._steps: Sequence[StepRequest] = ()
        self._rows: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward(*args, **kwargs)
        if isinstance(output, tuple):
            hidden, (embeds, accepted) = output
            self._rows = torch.cat((embeds, accepted), dim=-1)
            return hidden
        return output

    def begin_step(self, requests: Sequence[StepRequest]) -> None:
        self._steps = requests
        self._rows = None

    def end_step(self) -> list[torch.Tensor | None]:
        said: list[torch.Tensor | None] = []
        start = 0
        for request in self._steps:
            end = start + request.num_tokens
            if request.extra.get(HIDDEN_ROWS) and self._rows is not None:
                said.append(self._rows[start:end].clone())
            else:
                said.append(None)
            start = end
        self._steps, self._rows = (), None
        return said

    def finish(self, request_ids: Iterable[str]) -> None:
        pass


class _ResizeMLP(nn.Module):  # type: ignore[misc]
    """The talker's projection of a thinker row to its own width."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_fc2(self.act_fn(self.linear_fc1(x)))
        return out


@dataclass
class _Talking:
    """One request's state: every input row so far (so a request vLLM preempts and
    recomputes gets the same inputs again), the thinker's text rows still to speak, and
    the last position's hidden state (the code predictor's first input)."""

    inputs: torch.Tensor
    trailing: torch.Tensor
    prompt_length: int
    sample: bool
    last_hidden: torch.Tensor | None = None


class OmniQwen3OmniTalker(nn.Module):  # type: ignore[misc]
    """Qwen3-Omni's talker (see the module's docstring); its hf_config is the checkpoint's
    ``talker_config`` (``talker_config`` below, through CONFIG_FIXES)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
        )

        config = vllm_config.model_config.hf_config
        text = config.text_config
        self.config = config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=f"{prefix}model")
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = _ResizeMLP(
            config.thinker_hidden_size, text.intermediate_size, text.hidden_size
        )
        self.hidden_projection = _ResizeMLP(
            config.thinker_hidden_size, text.intermediate_size, text.hidden_size
        )
        self.code_predictor = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(
            config.code_predictor_config
        )
        # The thinker's embeddings of tts bos, eos and pad: the only thinker rows the
        # talker reads that no hand-off carries (filled by load_weights).
        self.register_buffer(
            "thinker_special_embeds",
            torch.zeros(3, config.thinker_hidden_size),
            persistent=False,
        )
        self._specials: torch.Tensor | None = None
        self._talking: dict[str, _Talking] = {}
        self._steps: Sequence[StepRequest] = ()
        self._said: list[torch.Tensor | None] = []

    # --- vLLM's model interface -------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model.embed_tokens(input_ids)
        return out

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert input_ids is not None
        if self._steps:
            inputs_embeds = self._step_inputs(input_ids)
        else:  # warm-up and profiling: nobody's tokens
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden: torch.Tensor = self.model(None, positions, None, inputs_embeds)
        start = 0
        for request in self._steps:
            start += request.num_tokens
            self._talking[request.request_id].last_hidden = hidden[start - 1]
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.codec_head(hidden_states)
        return out

    def begin_step(self, requests: Sequence[StepRequest]) -> None:
        self._steps = requests
        self._said = [None] * len(requests)
        for request in requests:
            if request.request_id not in self._talking:
                self._talking[request.request_id] = self._start(request.extra)

    def end_step(self) -> list[torch.Tensor | None]:
        said = self._said
        self._steps, self._said = (), []
        return said

    def finish(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._talking.pop(request_id, None)

    # --- The talker's inputs ----------------------------------------------------------

    def _start(self, extra: Mapping[str, Any]) -> _Talking:
        """The request's prompt rows and text rows, from the thinker's (transformers'
        ``_get_talker_user_parts`` and ``_get_talker_assistant_parts``)."""
        raw = extra.get(TALKER_INPUTS)
        if raw is None:
            raise ValueError(f"a talker request needs its {TALKER_INPUTS!r}")
        inputs = msgspec.msgpack.decode(raw, type=TalkerInputs)
        config = self.config
        device, dtype = self.codec_head.weight.device, self.codec_head.weight.dtype
        rows = torch.from_numpy(inputs.array().copy()).to(device=device, dtype=dtype)
        width = rows.shape[1] // 2
        embeds, accepted = rows[:, :width], rows[:, width:]
        prompt = np.asarray(inputs.prompt_token_ids, dtype=np.int64)

        # Projected as transformers does, all the prompt's rows at once (a row's value can
        # depend on what else is in its matrix product), then the user's taken.
        placeholders = torch.from_numpy(
            np.isin(prompt, [config.audio_token_id, config.image_token_id, config.video_token_id])
        ).to(device)
        projected = torch.empty(
            len(prompt), self.config.text_config.hidden_size, device=device, dtype=dtype
        )
        if bool(placeholders.any()):
            projected[placeholders] = self.hidden_projection(accepted[: len(prompt)][placeholders])
        projected[~placeholders] = self.text_projection(embeds[: len(prompt)][~placeholders])
        user = projected[torch.from_numpy(np.flatnonzero(user_mask(prompt, config))).to(device)]
        # The thinker's <|im_start|>assistant\n: the last such pair of the prompt.
        starts = np.flatnonzero(
            (prompt[:-1] == config.im_start_token_id) & (prompt[1:] == config.assistant_token_id)
        )
        if len(starts) == 0:
            raise ValueError("the thinker's prompt opens no assistant turn")
        assistant = self.text_projection(embeds[int(starts[-1]) :])
        bos, eos, pad = self._special_rows().unbind(0)
        text_rows = torch.cat((assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]), dim=0)
        codec = self.embed_input_ids(
            torch.tensor(
                [
                    config.codec_nothink_id,
                    config.codec_think_bos_id,
                    config.codec_think_eos_id,
                    inputs.speaker,
                    config.codec_pad_id,
                    config.codec_bos_id,
                ],
                device=device,
            )
        )
        codec_rows = torch.cat((torch.zeros(3, codec.shape[1], device=device, dtype=dtype), codec))
        prefix = torch.cat((user, text_rows + codec_rows[: len(text_rows)]), dim=0)
        trailing = torch.cat((assistant[4:], eos[None]), dim=0)
        return _Talking(prefix, trailing, len(prefix), inputs.sample)

    def _special_rows(self) -> torch.Tensor:
        """tts bos, eos and pad as the talker reads them (the same for every request)."""
        if self._specials is None:
            self._specials = self.text_projection(self.thinker_special_embeds)
        return self._specials

    def _step_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's input rows: a position already made (prompt, or recomputed after a
        preemption) is read back; a new one is built from the code it follows."""
        rows: list[torch.Tensor] = []
        # (row index, the request's index in the step, its state, its input token)
        new: list[tuple[int, int, _Talking, int]] = []
        start = 0
        for index, request in enumerate(self._steps):
            talking = self._talking[request.request_id]
            for offset in range(request.num_tokens):
                position = request.num_computed + offset
                if position < len(talking.inputs):
                    rows.append(talking.inputs[position])
                else:
                    new.append((len(rows), index, talking, int(input_ids[start + offset])))
                    rows.append(talking.inputs[0])  # replaced by _new_rows
            start += request.num_tokens
        if new:
            self._new_rows(rows, new)
        return torch.stack(rows)

    def _new_rows(
        self, rows: list[torch.Tensor], new: list[tuple[int, int, _Talking, int]]
    ) -> None:
        device = self.codec_head.weight.device
        codes0 = torch.tensor([token for *_, token in new], device=device)
        last = torch.stack([_last_hidden(talking) for _, _, talking, _ in new])
        sample = any(talking.sample for _, _, talking, _ in new)
        residual, embeds = self._residual_codes(last, codes0, sample)
        frames = torch.cat((codes0[:, None], residual), dim=1)
        pad = self._special_rows()[2]
        for i, (row, index, talking, _) in enumerate(new):
            # One text row per step while the answer lasts, then pads.
            step = len(talking.inputs) - talking.prompt_length
            text = talking.trailing[step] if step < len(talking.trailing) else pad
            value = embeds[i] + text
            rows[row] = value
            talking.inputs = torch.cat((talking.inputs, value[None]), dim=0)
            self._said[index] = frames[i : i + 1].clone()

    @torch.inference_mode()  # type: ignore[untyped-decorator]
    def _residual_codes(
        self, last_hidden: torch.Tensor, codes0: torch.Tensor, sample: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The 15 residual codes of each frame whose first code is ``codes0``, and the sum of
        the frame's 16 code embeddings (the talker's next input, before its text row)."""
        from transformers import DynamicCache

        predictor = self.code_predictor
        first = self.embed_input_ids(codes0)
        cache = DynamicCache(config=predictor.config)
        out = predictor(
            inputs_embeds=torch.stack((last_hidden, first), dim=1),
            past_key_values=cache,
            use_cache=True,
        )
        groups = self.config.num_code_groups
        codes: list[torch.Tensor] = []
        embeds = [first[:, None]]
        code = _pick(out.logits[:, -1], sample)
        codes.append(code)
        for step in range(1, groups - 1):
            out = predictor(
                input_ids=code[:, None],
                past_key_values=cache,
                use_cache=True,
                generation_steps=step,
            )
            embeds.append(predictor.get_input_embeddings()[step - 1](code)[:, None])
            code = _pick(out.logits[:, -1], sample)
            codes.append(code)
        embeds.append(predictor.get_input_embeddings()[groups - 2](code)[:, None])
        total = torch.cat(embeds, dim=1).sum(1)
        return torch.stack(codes, dim=1), total

    # --- Weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        decoder: list[tuple[str, torch.Tensor]] = []
        special: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name == "thinker.model.embed_tokens.weight":
                special["embed"] = tensor
                continue
            if not name.startswith("talker."):
                continue
            name = name.removeprefix("talker.")
            if name.startswith("model."):
                inner = name.removeprefix("model.").replace("codec_embedding.", "embed_tokens.")
                decoder.append((inner, tensor))
                continue
            if name in own:
                with torch.no_grad():
                    own[name].copy_(tensor)
                loaded.add(name)
        loaded |= {f"model.{name}" for name in self.model.load_weights(decoder)}
        embed = special.get("embed")
        if embed is None:
            raise ValueError("the checkpoint holds no thinker.model.embed_tokens.weight")
        ids = [
            self.config.tts_bos_token_id,
            self.config.tts_eos_token_id,
            self.config.tts_pad_token_id,
        ]
        with torch.no_grad():
            self.thinker_special_embeds.copy_(embed[ids])
        self._specials = None
        return loaded


def _last_hidden(talking: _Talking) -> torch.Tensor:
    if talking.last_hidden is None:
        raise RuntimeError("a talker step before its prompt was read")
    return talking.last_hidden


def _pick(logits: torch.Tensor, sample: bool) -> torch.Tensor:
    if not sample:
        return logits.argmax(dim=-1)
    # transformers' code predictor when the talker samples: top-k 50, then top-p 0.8.
    top, index = logits.float().topk(min(50, logits.shape[-1]), dim=-1)
    probs = top.softmax(dim=-1)
    keep = probs.cumsum(dim=-1) - probs < 0.8
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1)
    return index.gather(-1, choice)[:, 0]


def talker_config(config: Any) -> Any:
    """The config a talker engine reads (CONFIG_FIXES): the checkpoint's talker config,
    which knows the ids of the whole model, its M-RoPE declaration dropped (every position
    the talker reads is a text or audio one, whose three M-RoPE indices are equal: plain
    RoPE at the same base)."""
    talker = getattr(config, "talker_config", None)
    if talker is None:  # vLLM asks first of a bare config, for its model type
        return config
    talker.architectures = config.architectures
    for name in (
        "im_start_token_id",
        "im_end_token_id",
        "tts_pad_token_id",
        "tts_bos_token_id",
        "tts_eos_token_id",
        "system_token_id",
        "user_token_id",
        "assistant_token_id",
    ):
        setattr(talker, name, getattr(config, name))
    text = talker.text_config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    for key in ("mrope_section", "interleaved", "mrope_interleaved"):
        rope.pop(key, None)
    text.rope_parameters = rope
    return talker
