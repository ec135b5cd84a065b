"""The tiny Qwen3-Omni (``omni_runtime.tiny_models.qwen3_omni``): the references that the
stages serving it (thinker, talker, code2wav) must equal, all greedy.

transformers' ``Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`` is
the reference for the whole model: the thinker's text tokens, the talker's codes (16 code
groups per frame, as code2wav takes them) and the waveform. vLLM's CPU build serves the
thinker of the same checkpoint (it registers the class as its
``Qwen3OmniMoeThinkerForConditionalGeneration``): its greedy tokens must be transformers',
for a text prompt and for one with audio input. vLLM runs in a child process (this file
run as a script), as in test_tiny_family_encoders.py.

What the reference pins down besides the weights: the thinker stops at the config's
``im_end_token_id`` (``generate``'s own default is the real model's id, 151645, which is
out of this vocabulary), the talker decodes greedily with repetition penalty 1.05 and
every codec id from ``vocab_size - 1024`` on suppressed but its EOS, and the code
predictor decodes greedily (its generation config).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from serving import run_vllm_child

from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR
from omni_runtime.tiny_models.qwen3_omni import (
    ADDED_TOKENS,
    AUDIO_SAMPLE_RATE,
    BPE_SIZE,
    CODEBOOK_SIZE,
    NUM_CODE_GROUPS,
    SAMPLES_PER_CODE,
    SPEAKERS,
)

pytestmark = pytest.mark.integration
# Qwen3OmniMoeProcessor cannot load without it (its video processor), as the real
# checkpoint's cannot; scripts/setup.sh installs it.
pytest.importorskip("torchvision", reason="Qwen3OmniMoeProcessor needs torchvision")

PROMPT = "draw a red cat under the moon"
THINKER_TOKENS = 16
TALKER_TOKENS = 16
REPETITION_PENALTY = 1.05
MAX_MODEL_LEN = 2048


def sine(frequency: float, seconds: float = 0.5) -> np.ndarray:
    """A tone at the processor's sampling rate, as float32 samples in [-0.5, 0.5]."""
    t = np.arange(int(seconds * AUDIO_SAMPLE_RATE)) / AUDIO_SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def user_turn(audio: bool) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": PROMPT}]
    if audio:
        # As the router would hand on an OpenAI ``input_audio`` part: the samples go to
        # the processor, the part only places them.
        content.insert(0, {"type": "input_audio"})
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / QWEN3_OMNI_SUBDIR


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Any:
    from transformers import Qwen3OmniMoeProcessor

    return Qwen3OmniMoeProcessor.from_pretrained(checkpoint, local_files_only=True)


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Any:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32, local_files_only=True
    )
    return loaded.eval()


def prompt_text(processor: Any, audio: bool) -> str:
    text: str = processor.apply_chat_template(
        user_turn(audio), tokenize=False, add_generation_prompt=True
    )
    return text


def model_inputs(processor: Any, audio: np.ndarray | None = None) -> Any:
    text = prompt_text(processor, audio is not None)
    if audio is None:
        return processor(text=text, return_tensors="pt")
    return processor(text=text, audio=[audio], return_tensors="pt")


def think(model: Any, inputs: Any) -> list[int]:
    """The thinker's greedy answer alone (``return_audio=False``): its new token ids."""
    with torch.no_grad():
        sequences = model.generate(
            **inputs,
            return_audio=False,
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            thinker_eos_token_id=model.config.im_end_token_id,
        )
    new: list[int] = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return new


def speak(model: Any, inputs: Any, speaker: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The whole model, greedy: the thinker's new token ids, the waveform, and the codes
    the talker handed code2wav (``[1, code groups, frames]``, seen on their way in)."""
    codes: list[torch.Tensor] = []
    hook = model.code2wav.register_forward_pre_hook(
        lambda _module, args: codes.append(args[0].clone())
    )
    try:
        with torch.no_grad():
            sequences, waveform = model.generate(
                **inputs,
                return_audio=True,
                speaker=speaker,
                thinker_max_new_tokens=THINKER_TOKENS,
                thinker_do_sample=False,
                thinker_eos_token_id=model.config.im_end_token_id,
                talker_max_new_tokens=TALKER_TOKENS,
                talker_do_sample=False,
                talker_repetition_penalty=REPETITION_PENALTY,
            )
    finally:
        hook.remove()
    # One chunk: code2wav decodes up to 300 frames at once.
    assert len(codes) == 1
    new: list[int] = sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return new, waveform, codes[0]


@pytest.fixture(scope="module")
def text_reference(model: Any, processor: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    return speak(model, model_inputs(processor), "Ethan")


# --- The checkpoint --------------------------------------------------------------------


def test_checkpoint_is_laid_out_as_the_real_one(checkpoint: Path) -> None:
    from safetensors import safe_open

    names = {path.name for path in checkpoint.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "processor_config.json",
    } <= names
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_omni_moe"
    with safe_open(checkpoint / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    # The real checkpoint's names: one tensor per expert, all three parts in one file.
    for key in (
        "thinker.model.layers.0.mlp.experts.3.gate_proj.weight",
        "thinker.audio_tower.conv2d1.weight",
        "thinker.visual.patch_embed.proj.weight",
        "talker.model.layers.1.mlp.experts.0.down_proj.weight",
        "talker.model.layers.0.mlp.shared_expert.up_proj.weight",
        f"talker.code_predictor.model.codec_embedding.{NUM_CODE_GROUPS - 2}.weight",
        "code2wav.code_embedding.weight",
    ):
        assert key in keys, key
    # Tens of MB at most: the image bakes it with the other tiny models.
    assert (checkpoint / "model.safetensors").stat().st_size < 40_000_000


def test_every_token_id_of_the_config_is_the_tokenizers(checkpoint: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    thinker, talker = config.thinker_config, config.talker_config
    expected = [
        (config, "im_start_token_id", "<|im_start|>"),
        (config, "im_end_token_id", "<|im_end|>"),
        (config, "tts_pad_token_id", "<tts_pad>"),
        (config, "tts_bos_token_id", "<tts_text_bos>"),
        (config, "tts_eos_token_id", "<tts_text_eod>"),
        (config, "system_token_id", "system"),
        (config, "user_token_id", "user"),
        (config, "assistant_token_id", "assistant"),
        (thinker, "user_token_id", "user"),
        (thinker, "audio_token_id", "<|audio_pad|>"),
        (thinker, "image_token_id", "<|image_pad|>"),
        (thinker, "video_token_id", "<|video_pad|>"),
        (thinker, "audio_start_token_id", "<|audio_start|>"),
        (thinker, "audio_end_token_id", "<|audio_end|>"),
        (thinker, "vision_start_token_id", "<|vision_start|>"),
        (thinker, "vision_end_token_id", "<|vision_end|>"),
        (talker, "audio_token_id", "<|audio_pad|>"),
        (talker, "image_token_id", "<|image_pad|>"),
        (talker, "video_token_id", "<|video_pad|>"),
        (talker, "audio_start_token_id", "<|audio_start|>"),
        (talker, "audio_end_token_id", "<|audio_end|>"),
        (talker, "vision_start_token_id", "<|vision_start|>"),
    ]
    for owner, field, token in expected:
        assert getattr(owner, field) == tokenizer.convert_tokens_to_ids(token), field
        # Each is one token as the text reaches the tokenizer (the role words after
        # <|im_start|>, where the talker looks for them).
        assert tokenizer(f"<|im_start|>{token}", add_special_tokens=False)["input_ids"] == [
            config.im_start_token_id,
            getattr(owner, field),
        ], field
    # Qwen's added tokens in Qwen's order after the BPE, special as Qwen's are.
    for offset, (token, special) in enumerate(ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == BPE_SIZE + offset, token
        assert tokenizer.added_tokens_decoder[BPE_SIZE + offset].special == special, token
    assert len(tokenizer) == BPE_SIZE + len(ADDED_TOKENS) <= thinker.text_config.vocab_size


def test_shapes_fit_vllm_and_the_talker(checkpoint: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    thinker, talker = config.thinker_config, config.talker_config
    # vLLM's CPU attention needs head_dim >= 32 (the thinker now, the talker later).
    for text in (thinker.text_config, talker.text_config, talker.code_predictor_config):
        assert text.head_dim >= 32
        assert sum(text.rope_parameters.get("mrope_section", [text.head_dim // 2])) == (
            text.head_dim // 2
        )
    assert thinker.audio_config.d_model // thinker.audio_config.encoder_attention_heads >= 32
    assert thinker.vision_config.hidden_size // thinker.vision_config.num_heads >= 32
    assert thinker.text_config.num_experts > thinker.text_config.num_experts_per_tok > 1
    # The talker reads a middle layer of the thinker, not the last.
    assert 0 < talker.accept_hidden_layer < thinker.text_config.num_hidden_layers
    assert talker.thinker_hidden_size == thinker.text_config.hidden_size
    # The talker may emit codes below vocab_size - 1024 (generate suppresses the rest,
    # EOS excepted): exactly code2wav's codebook. Its specials and voices lie above.
    vocab = talker.text_config.vocab_size
    assert vocab - 1024 == CODEBOOK_SIZE == config.code2wav_config.codebook_size
    assert talker.code_predictor_config.vocab_size == CODEBOOK_SIZE
    specials = [
        talker.codec_pad_id,
        talker.codec_bos_id,
        talker.codec_eos_token_id,
        talker.codec_nothink_id,
        talker.codec_think_bos_id,
        talker.codec_think_eos_id,
        *talker.speaker_id.values(),
    ]
    assert all(CODEBOOK_SIZE <= token < vocab for token in specials)
    assert talker.speaker_id == SPEAKERS
    assert talker.num_code_groups == config.code2wav_config.num_quantizers == NUM_CODE_GROUPS


def test_no_weight_is_left_uninitialised(model: Any) -> None:
    """transformers 5.19 leaves the talker's experts as allocated (the build draws them):
    such memory reads as near-zero garbage, different every build."""
    tiny = [
        name
        for name, parameter in model.named_parameters()
        if parameter.dim() > 1 and parameter.std().item() < 1e-3
    ]
    assert tiny == []
    experts = model.talker.model.layers[0].mlp.experts
    assert experts.gate_up_proj.std().item() > 0.01
    assert model.talker.model.layers[0].mlp.gate.weight.std().item() > 0.01


# --- Prompts: the chat template and the processor ----------------------------------------


def test_chat_template_frames_text_and_audio_as_qwen3_omni_does(processor: Any) -> None:
    assert prompt_text(processor, audio=False) == (
        f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt_text(processor, audio=True) == (
        f"<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>{PROMPT}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_processor_turns_audio_into_features_and_placeholders(processor: Any) -> None:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    inputs = model_inputs(processor, sine(440.0))
    # 128 mel bins every 10 ms: 50 frames for 0.5 s.
    assert inputs["input_features"].shape == (1, 128, 50)
    assert inputs["feature_attention_mask"].sum().item() == 50
    placeholders = (
        inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    ).sum()
    assert placeholders.item() == int(_get_feat_extract_output_lengths(torch.tensor(50))) == 7


# --- transformers: the references ------------------------------------------------------


def test_text_to_speech_is_deterministic_and_audible(
    model: Any, processor: Any, text_reference: tuple[list[int], torch.Tensor, torch.Tensor]
) -> None:
    tokens, waveform, codes = text_reference
    assert len(tokens) == THINKER_TOKENS
    again_tokens, again_waveform, again_codes = speak(model, model_inputs(processor), "Ethan")
    assert again_tokens == tokens
    assert torch.equal(again_codes, codes)
    assert torch.equal(again_waveform, waveform)
    # The code predictor decodes greedily: what makes the codes a reference.
    assert model.talker.code_predictor.generation_config.do_sample is False

    frames = codes.shape[-1]
    assert codes.shape == (1, NUM_CODE_GROUPS, frames)
    # No codec EOS within the budget (random weights). Each step predicts the residual
    # codes of the token the step before sampled: the last sampled token gets none, so
    # there is one frame fewer than talker tokens.
    assert frames == TALKER_TOKENS - 1
    assert model.config.talker_config.codec_eos_token_id not in codes[0, 0].tolist()
    assert int(codes.min()) >= 0
    assert int(codes.max()) < CODEBOOK_SIZE

    assert waveform.dtype == torch.float32
    assert bool(torch.isfinite(waveform).all())
    assert waveform.std().item() > 0.05  # audible, not silence
    assert waveform.abs().max().item() <= 1.0
    # code2wav: SAMPLES_PER_CODE samples (at 24 kHz) per frame, less a fixed number that
    # its causal transposed convolutions drop, whatever the length.
    assert model.code2wav.total_upsample == SAMPLES_PER_CODE
    lost = frames * SAMPLES_PER_CODE - waveform.shape[-1]
    assert 0 <= lost < SAMPLES_PER_CODE
    with torch.no_grad():
        half = model.code2wav(codes[..., : frames // 2])
        whole = model.code2wav.chunked_decode(codes)
    assert half.shape[-1] == (frames // 2) * SAMPLES_PER_CODE - lost
    assert waveform.shape == (1, 1, frames * SAMPLES_PER_CODE - lost)
    # The code2wav stage's reference: these codes alone give this waveform.
    assert torch.equal(whole, waveform)


def test_text_of_the_whole_model_is_the_thinkers_alone(
    model: Any, processor: Any, text_reference: tuple[list[int], torch.Tensor, torch.Tensor]
) -> None:
    tokens, _, _ = text_reference
    assert think(model, model_inputs(processor)) == tokens


def test_the_voice_changes_the_codes_not_the_text(
    model: Any, processor: Any, text_reference: tuple[list[int], torch.Tensor, torch.Tensor]
) -> None:
    tokens, waveform, codes = text_reference
    other_tokens, other_waveform, other_codes = speak(model, model_inputs(processor), "Chelsie")
    assert other_tokens == tokens
    assert not torch.equal(other_codes, codes)
    assert not torch.equal(other_waveform, waveform)


def test_audio_input_reaches_the_thinker(
    model: Any, processor: Any, text_reference: tuple[list[int], torch.Tensor, torch.Tensor]
) -> None:
    text_tokens, _, _ = text_reference
    heard = think(model, model_inputs(processor, sine(440.0)))
    assert len(heard) == THINKER_TOKENS
    assert heard != text_tokens
    assert think(model, model_inputs(processor, sine(440.0))) == heard
    # The samples themselves, not only their placeholders, reach it.
    assert think(model, model_inputs(processor, sine(880.0))) != heard
    # And the whole model speaks an answer to audio.
    spoken, waveform, codes = speak(model, model_inputs(processor, sine(440.0)), "Ethan")
    assert spoken == heard
    assert bool(torch.isfinite(waveform).all())
    assert waveform.std().item() > 0.05
    assert codes.shape[:2] == (1, NUM_CODE_GROUPS)


# --- vLLM: the thinker and the talker ------------------------------------------------------


def _run_stages(spec_path: str, out_path: str) -> None:
    """The child: the thinker's engine (vLLM's Qwen3-Omni thinker saying each token's
    talker rows) on every prompt of the spec at once, then the talker's engine on what the
    thinker said, all its requests at once too, as a pipeline's two LLM stages run them."""
    import gc

    import msgspec
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from omni_runtime.engine.models import STEP_STATE_WORKER, hf_overrides
    from omni_runtime.engine.models.qwen3_omni import (
        HIDDEN_ROWS,
        TALKER_INPUTS,
        TalkerInputs,
        talker_prompt_length,
    )

    spec = json.loads(Path(spec_path).read_text())
    work = Path(out_path).parent
    config = AutoConfig.from_pretrained(spec["model"])

    def run(llm: Any, requests: list[tuple[Any, Any]]) -> list[tuple[list[int], np.ndarray]]:
        engine = llm.llm_engine
        for index, (prompt, params) in enumerate(requests):
            engine.add_request(str(index), prompt, params)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        said: dict[str, list[np.ndarray]] = {str(i): [] for i in range(len(requests))}
        running = set(tokens)
        while running:
            # The engine core's own outputs: a generating request's pooling_output is what
            # the model said beside its token, which vLLM's output processor would drop.
            for output in engine.engine_core.get_output().outputs:
                # vLLM's engine appends a suffix of its own to the caller's id.
                key = output.request_id.rsplit("-", 1)[0]
                tokens[key] += list(output.new_token_ids)
                if output.pooling_output is not None:
                    said[key].append(output.pooling_output.numpy())
                if output.finish_reason is not None:
                    running.discard(key)
        return [
            (tokens[key], np.concatenate(said[key]) if said[key] else np.zeros((0, 0)))
            for key in sorted(tokens, key=int)
        ]

    thinker = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        limit_mm_per_prompt={"image": 0, "video": 0, "audio": 1},
        hf_overrides=hf_overrides("OmniQwen3OmniThinker", {}),
        worker_cls=STEP_STATE_WORKER,
        enable_prefix_caching=False,
    )
    thinking = SamplingParams(
        max_tokens=THINKER_TOKENS,
        temperature=0.0,
        stop_token_ids=[config.im_end_token_id],
        extra_args={HIDDEN_ROWS: True},
    )
    prompts: list[tuple[Any, Any]] = []
    for prompt in spec["prompts"]:
        if prompt.get("audio"):
            audio = np.load(prompt["audio"])
            prompts.append(
                (
                    {
                        "prompt": prompt["text"],
                        "multi_modal_data": {"audio": (audio, AUDIO_SAMPLE_RATE)},
                    },
                    thinking,
                )
            )
        else:
            prompts.append(({"prompt_token_ids": prompt["token_ids"]}, thinking))
    thought = run(thinker, prompts)
    del thinker
    gc.collect()

    talker_config = config.talker_config
    vocab = talker_config.text_config.vocab_size
    talker = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        skip_tokenizer_init=True,
        hf_overrides=hf_overrides("OmniQwen3OmniTalker", {}),
        worker_cls=STEP_STATE_WORKER,
        enable_prefix_caching=False,
    )
    requests: list[tuple[Any, Any]] = []
    for prompt, (_, rows) in zip(spec["prompts"], thought, strict=True):
        inputs = TalkerInputs(
            rows.astype(np.float32).tobytes(),
            (rows.shape[0], rows.shape[1]),
            "float32",
            prompt["token_ids"],
            talker_config.speaker_id[prompt["speaker"]],
        )
        params = SamplingParams(
            max_tokens=TALKER_TOKENS,
            temperature=0.0,
            repetition_penalty=REPETITION_PENALTY,
            stop_token_ids=[talker_config.codec_eos_token_id],
            # What generate suppresses: every id from vocab - 1024 on but the EOS.
            allowed_token_ids=[*range(vocab - 1024), talker_config.codec_eos_token_id],
            detokenize=False,
            extra_args={TALKER_INPUTS: msgspec.msgpack.encode(inputs)},
        )
        length = talker_prompt_length(prompt["token_ids"], config)
        requests.append(({"prompt_token_ids": [talker_config.codec_pad_id] * length}, params))
    spoken = run(talker, requests)

    results = []
    for index, ((tokens, rows), (codec_tokens, frames)) in enumerate(
        zip(thought, spoken, strict=True)
    ):
        np.save(work / f"rows{index}.npy", rows)
        np.save(work / f"frames{index}.npy", frames)
        results.append(
            {
                "token_ids": tokens,
                "codec_token_ids": codec_tokens,
                "rows": str(work / f"rows{index}.npy"),
                "frames": str(work / f"frames{index}.npy"),
            }
        )
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def audio_reference(model: Any, processor: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    return speak(model, model_inputs(processor, sine(440.0)), "Ethan")


def thinker_rows(model: Any, inputs: Any) -> np.ndarray:
    """What the talker reads of the thinker, per token it read (its prompt and its answer
    but the last token): the input embedding and layer accept_hidden_layer's output."""
    with torch.no_grad():
        result = model.thinker.generate(
            **inputs,
            max_new_tokens=THINKER_TOKENS,
            do_sample=False,
            eos_token_id=model.config.im_end_token_id,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
    accept = model.config.talker_config.accept_hidden_layer
    embeds = torch.cat([states[0] for states in result.hidden_states], dim=1)[0]
    accepted = torch.cat([states[accept] for states in result.hidden_states], dim=1)[0]
    rows: np.ndarray = torch.cat((embeds, accepted), dim=-1).numpy()
    return rows


@pytest.fixture(scope="module")
def vllm_stages(
    checkpoint: Path, processor: Any, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """vLLM's greedy answers to the text prompt (as token ids) and to the audio one (as text
    and samples, which vLLM's own processing expands), each with the thinker's rows, and
    the talker's codec tokens and frames for each."""
    work = tmp_path_factory.mktemp("qwen3-omni-vllm")
    np.save(work / "sine.npy", sine(440.0))
    spec = {
        "model": str(checkpoint),
        "prompts": [
            {"token_ids": model_inputs(processor)["input_ids"][0].tolist(), "speaker": "ethan"},
            {
                "text": prompt_text(processor, audio=True),
                "audio": str(work / "sine.npy"),
                # The talker reads the prompt as the thinker did, placeholders expanded.
                "token_ids": model_inputs(processor, sine(440.0))["input_ids"][0].tolist(),
                "speaker": "ethan",
            },
        ],
    }
    (work / "spec.json").write_text(json.dumps(spec))
    run_vllm_child(__file__, work / "spec.json", work / "out.json", timeout=400)
    results: list[dict[str, Any]] = json.loads((work / "out.json").read_text())
    return results


def test_vllm_thinker_answers_text_as_transformers_does(
    vllm_stages: list[dict[str, Any]],
    text_reference: tuple[list[int], torch.Tensor, torch.Tensor],
) -> None:
    tokens, _, _ = text_reference
    assert vllm_stages[0]["token_ids"] == tokens


def test_vllm_thinker_answers_audio_as_transformers_does(
    vllm_stages: list[dict[str, Any]], model: Any, processor: Any
) -> None:
    inputs = model_inputs(processor, sine(440.0))
    assert vllm_stages[1]["token_ids"] == think(model, inputs)


def test_vllm_thinker_says_the_rows_the_talker_reads(
    vllm_stages: list[dict[str, Any]], model: Any, processor: Any
) -> None:
    for result, inputs in zip(
        vllm_stages, (model_inputs(processor), model_inputs(processor, sine(440.0))), strict=True
    ):
        expected = thinker_rows(model, inputs)
        rows = np.load(result["rows"])
        # Every token it read: the prompt, and the answer but its last token.
        assert rows.shape == expected.shape
        assert rows.shape[0] == inputs["input_ids"].shape[1] + len(result["token_ids"]) - 1
        width = rows.shape[1] // 2
        # The embeddings are looked up (the audio's features computed): exact or nearly.
        assert np.abs(rows[:, :width] - expected[:, :width]).max() < 1e-5
        assert np.abs(rows[:, width:] - expected[:, width:]).max() < 1e-5


def test_vllm_talker_speaks_the_codes_transformers_does(
    vllm_stages: list[dict[str, Any]],
    text_reference: tuple[list[int], torch.Tensor, torch.Tensor],
    audio_reference: tuple[list[int], torch.Tensor, torch.Tensor],
) -> None:
    """The talker's engine, fed the thinker engine's rows, both requests in one batch: each
    frame (its codec token and the code predictor's 15) is transformers'."""
    for result, (_, _, codes) in zip(vllm_stages, (text_reference, audio_reference), strict=True):
        frames = np.load(result["frames"])
        assert frames.shape == (codes.shape[-1], NUM_CODE_GROUPS)
        assert np.array_equal(frames.T, codes[0].numpy())
        # The frames are of the codec tokens it sampled, all but the last.
        assert frames[:, 0].tolist() == result["codec_token_ids"][: len(frames)]
    assert not np.array_equal(np.load(vllm_stages[0]["frames"]), np.load(vllm_stages[1]["frames"]))


if __name__ == "__main__":
    _run_stages(sys.argv[1], sys.argv[2])
