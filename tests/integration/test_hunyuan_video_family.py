"""HunyuanVideo-1.5 split as Qwen-Image is served: its Qwen2.5-VL text encoder on vLLM (the
encoder stage), its DiT, VAE and ByT5 glyph encoder on diffusers (the DiT stage).

On the tiny checkpoint (``tiny_models.hunyuan_video``):

- the encoder stage (vLLM, ``OmniQwen2AntepenultimateModel``, through the LLM stage's
  frontend as a stage server runs it) hands over transformers' ``hidden_states[-3]`` of the
  pipeline's template, cropped as the pipeline crops it: the rows the pipeline's mask keeps,
  within 1e-5 (measured here: ~1e-7, float32 kernels of vLLM against transformers');
- the DiT stage, given those rows and the prompt's text (its ByT5 reads the quoted text),
  makes the frames diffusers' whole HunyuanVideo15Pipeline makes for the same prompt,
  negative prompt, seed, steps, size and frame count: identical bytes from the pipeline's
  own embeddings, and from vLLM's at most one uint8 level apart (the ~1e-7 of the
  embeddings reaching a rounding);
- through a real router and real stage processes of both stages, the official client's
  videos.create_and_poll completes and download_content is an MP4 of the clip's frames.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import openai
import pytest
import torch
import yaml
from hunyuan_video_stages import (
    DEADLINE_S,
    DIT,
    ENCODER,
    Encoder,
    encoded,
    encoder_stage,
    frames_of,
    reference_embeds,
    stage_processes,
)
from serving import (
    RunningRouter,
    StageProcess,
    pipeline_from,
    running_router,
)

from omni_runtime.config import load_pipeline
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.models import FixedConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.engine.stage.stage_llm_engine_config import make_stage_llm_engine_args
from omni_runtime.families import FAMILIES
from omni_runtime.images import encode_png, to_uint8
from omni_runtime.tiny_models import HUNYUAN_VIDEO_SUBDIR

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAMILY = FAMILIES["hunyuanvideo-1.5"]
# Quoted text is what ByT5 reads: with it both text encoders condition the DiT.
PROMPT = 'a red cat walks under a sign that says "OPEN"'
NEGATIVE = 'a dark room, a sign that says "CLOSED"'
# Longer than the pipeline's 1000 rows after the template: truncated as its tokenizer does.
LONG = "a red cat on a green hydrant " * 200
# The tiny clip: 5 frames of 16x32 (the VAE's 16x multiples, not square so a swap shows).
CLIP = {"num_inference_steps": 3, "height": 16, "width": 32, "num_frames": 5, "seed": 7}
EMBEDS_TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / HUNYUAN_VIDEO_SUBDIR


def example_data(checkpoint: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        (REPO / "examples" / "tiny-hunyuan-video.yaml").read_text()
    )
    data["model"] = str(checkpoint)
    return data


@pytest.fixture(scope="module")
def monolithic(checkpoint: Path) -> Any:
    """diffusers' whole HunyuanVideo15Pipeline, both text encoders in it."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(checkpoint, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == FAMILY.dit.pipeline_class
    return pipe


def reference_frames(pipe: Any, negative: str | None = None, **call: Any) -> np.ndarray:
    """The whole pipeline's clip of PROMPT as uint8 frames (as the DiT stage answers)."""
    params = {**CLIP, **call}
    seed, scale = params.pop("seed"), params.pop("guidance_scale", None)
    before = pipe.guider.guidance_scale
    if scale is not None:
        pipe.guider.guidance_scale = scale
    try:
        result = pipe(
            prompt=PROMPT,
            negative_prompt=negative,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            **params,
        )
    finally:
        pipe.guider.guidance_scale = before
    frames: np.ndarray = to_uint8(result.frames[0])
    return frames


# --- the encoder stage: vLLM's hidden_states[-3] ------------------------------------------


def test_the_encoder_config_reads_the_text_only_qwen2_5_vl_as_qwen2(checkpoint: Path) -> None:
    """The family's architecture comes with its config fix: M-RoPE (which a text token
    rotates as plain RoPE) undeclared, the checkpoint's RoPE base kept; pickled by
    reference into the engine core's process."""
    from transformers import AutoConfig

    data = example_data(checkpoint)
    stage = load_pipeline(data).stages[ENCODER]
    args = make_stage_llm_engine_args(stage, str(checkpoint), FAMILY.encoder)
    overrides = args.hf_overrides
    assert isinstance(overrides, FixedConfig)
    assert pickle.loads(pickle.dumps(overrides)) == overrides  # noqa: S301 - our own bytes
    config = overrides(AutoConfig.from_pretrained(checkpoint / "text_encoder"))
    assert config.architectures == ["OmniQwen2AntepenultimateModel"]
    assert "mrope_section" not in config.rope_parameters
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.tie_word_embeddings is False


@pytest.fixture(scope="module")
def encoder(checkpoint: Path) -> Iterator[Encoder]:
    with encoder_stage(example_data(checkpoint), FAMILY) as stage:
        yield stage


_SERVED: dict[str, torch.Tensor] = {}


async def served_embeds(encoder: Encoder, prompt: str) -> Any:
    if prompt not in _SERVED:
        _SERVED[prompt] = await encoded(encoder, f"encode-{len(_SERVED)}", prompt)
    return _SERVED[prompt]


async def test_encoder_stage_hands_over_hidden_states_minus_3_cropped(
    encoder: Encoder, monolithic: Any
) -> None:
    # The pipeline's own crop and length are the recipe's.
    recipe = FAMILY.encoder
    assert recipe is not None
    assert recipe.drop_prefix == monolithic.prompt_template_encode_start_idx == 108
    assert recipe.max_length == monolithic.tokenizer_max_length + recipe.drop_prefix
    # " " is the empty negative prompt, as the pipeline's template writes it.
    worst = 0.0
    for prompt in (PROMPT, NEGATIVE, " ", LONG):
        served = await served_embeds(encoder, prompt)
        reference = reference_embeds(monolithic, prompt)
        assert served.shape == reference.shape, prompt[:20]
        difference = float((served - reference).abs().max())
        worst = max(worst, difference)
        assert difference <= EMBEDS_TOLERANCE, (prompt[:20], difference)
    assert (await served_embeds(encoder, LONG)).shape[0] == monolithic.tokenizer_max_length
    print(f"encoder stage vs transformers hidden_states[-3]: max |difference| {worst:.3g}")
    # Not the last layer: the two skipped layers and the final norm matter.
    with torch.no_grad():
        text = monolithic.tokenizer(FAMILY.encoder.template_text(PROMPT, 0), return_tensors="pt")
        last = monolithic.text_encoder(**text).last_hidden_state[0, recipe.drop_prefix :]
    assert float((last - await served_embeds(encoder, PROMPT)).abs().max()) > 0.1


# --- the DiT stage: the whole pipeline's frames --------------------------------------------


@pytest.fixture(scope="module")
def dit(checkpoint: Path) -> DiffusionEngine:
    """The DiT stage's engine as the example's DiT stage builds it: the checkpoint without
    the Qwen encoder and its tokenizer (ByT5 stays)."""
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=str(checkpoint), family=FAMILY.name, text_from_upstream=True)
    )
    assert engine.pipeline.text_encoder is None
    assert engine.pipeline.tokenizer is None
    assert engine.pipeline.text_encoder_2 is not None
    assert engine.describe()["video"]
    return engine


def run_dit(
    dit: DiffusionEngine,
    name: str,
    positive: Any,
    negative: Any = None,
    *,
    prompt: str | None = PROMPT,
    emit: Any = None,
    **params: Any,
) -> StageDiffusionCoreOutput:
    request = Request(
        request_id=name,
        prompt=prompt,
        params={**CLIP, **params},
        prompt_embeds=np.asarray(positive),
        negative_prompt_embeds=None if negative is None else np.asarray(negative),
    )
    dit.admit(name)
    return dit.execute(request, emit=emit)


@pytest.mark.parametrize(
    ("negative", "call"),
    [
        # The guider's own scale (6), the empty negative prompt.
        (None, {}),
        # A negative prompt with quoted text (ByT5 reads it too) and another scale.
        (NEGATIVE, {"guidance_scale": 3.5}),
        # No guidance: the conditional pass alone, no negative embeddings.
        (None, {"guidance_scale": 1.0}),
    ],
    ids=["default-guidance", "negative-prompt", "no-guidance"],
)
async def test_dit_stage_frames_are_the_whole_pipelines(
    dit: DiffusionEngine,
    monolithic: Any,
    encoder: Encoder,
    negative: str | None,
    call: dict[str, Any],
) -> None:
    reference = reference_frames(monolithic, negative, **call)
    assert reference.shape == (5, 16, 32, 3)
    guided = FAMILY.negative_prompt({"negative_prompt": negative, **call})
    params = {**call, **({"negative_prompt": negative} if negative is not None else {})}
    # From the pipeline's own embeddings: the DiT stage is the pipeline, byte for byte.
    own = run_dit(
        dit,
        "own",
        reference_embeds(monolithic, PROMPT),
        None if guided is None else reference_embeds(monolithic, guided or " "),
        **params,
    )
    assert np.array_equal(frames_of(own), reference)
    # From the encoder stage's: vLLM's rows are transformers' within ~1e-7.
    served = run_dit(
        dit,
        "served",
        await served_embeds(encoder, PROMPT),
        None if guided is None else await served_embeds(encoder, guided or " "),
        **params,
    )
    difference = np.abs(frames_of(served).astype(np.int16) - reference.astype(np.int16))
    print(
        f"{call or 'default'}: frames from vLLM's embeddings vs the whole pipeline's: "
        f"max {difference.max()} levels, {(difference == 0).mean():.4%} identical"
    )
    assert difference.max() <= 1


def test_the_prompts_quoted_text_reaches_the_frames(dit: DiffusionEngine, monolithic: Any) -> None:
    """The DiT stage reads the prompt's text itself (ByT5): the same Qwen embeddings with
    other quoted text make another clip, and without the text the request is refused."""
    embeds = reference_embeds(monolithic, PROMPT)
    negative = reference_embeds(monolithic, " ")
    frames = frames_of(run_dit(dit, "quoted", embeds, negative))
    other = frames_of(run_dit(dit, "other", embeds, negative, prompt='a sign that says "SHUT"'))
    assert not np.array_equal(frames, other)
    refused = run_dit(dit, "no-text", embeds, negative, prompt=None)
    assert refused.error is not None
    assert refused.error.param == "prompt"


def test_the_dit_stage_refuses_what_its_pipeline_does_not_take(
    dit: DiffusionEngine, monolithic: Any
) -> None:
    embeds = reference_embeds(monolithic, PROMPT)
    # Guidance on (the default) needs the negative prompt's embeddings from the encoder.
    missing = run_dit(dit, "no-negative", embeds)
    assert missing.error is not None
    assert missing.error.param == "negative_prompt_embeds"
    # More rows than the pipeline's 1000.
    too_long = run_dit(
        dit, "too-long", np.zeros((1001, embeds.shape[1]), np.float32), guidance_scale=1.0
    )
    assert too_long.error is not None
    assert too_long.error.param == "prompt_embeds"
    # Not a parameter of its pipeline.
    refused = run_dit(dit, "strength", embeds, embeds, strength=0.5)
    assert refused.error is not None
    assert refused.error.param == "strength"
    # The clip is as long as asked.
    frames = frames_of(run_dit(dit, "frames", embeds, guidance_scale=1.0, num_frames=9))
    assert frames.shape == (9, 16, 32, 3)


def test_progress_and_abort_without_a_step_callback(dit: DiffusionEngine, monolithic: Any) -> None:
    """Its pipeline takes no step callback: the scheduler's steps are watched instead."""
    embeds = reference_embeds(monolithic, PROMPT)
    sent: list[StageDiffusionCoreOutput] = []
    output = run_dit(
        dit, "progress", embeds, guidance_scale=1.0, num_inference_steps=4,
        report_progress=True, emit=sent.append,
    )  # fmt: skip
    frames_of(output)
    assert [report.progress for report in sent] == [25, 50, 75, 99]
    # Watching ends with the call: the scheduler is the pipeline's own again.
    assert "step" not in vars(dit.pipeline.scheduler)

    def abort_at_first_report(report: StageDiffusionCoreOutput) -> None:
        dit.abort(["aborted"])

    aborted = run_dit(
        dit, "aborted", embeds, guidance_scale=1.0, report_progress=True,
        emit=abort_at_first_report,
    )  # fmt: skip
    assert aborted.aborted
    assert "step" not in vars(dit.pipeline.scheduler)


# --- through a real router and real stage processes, with the official client ------------


@pytest.fixture(scope="module")
def stages(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    workdir = tmp_path_factory.mktemp("hunyuan-video-serving")
    data = example_data(checkpoint)
    with stage_processes(data, workdir) as procs:
        yield [data, workdir, *procs]


@pytest.fixture(scope="module")
def router(stages: list[Any]) -> Iterator[RunningRouter]:
    data, workdir, encoder_proc, dit_proc = stages
    assert isinstance(encoder_proc, StageProcess)
    addresses = {ENCODER: [encoder_proc.address], DIT: [dit_proc.address]}
    with running_router(pipeline_from(data), addresses, state_dir=workdir / "jobs") as r:
        yield r


def decoded(mp4: bytes) -> tuple[list[np.ndarray], float]:
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or 0)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return frames, rate


def test_videos_api_through_both_stages(router: RunningRouter, monolithic: Any) -> None:
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=DEADLINE_S)
    video = client.videos.create_and_poll(
        prompt=PROMPT,
        size="32x16",  # type: ignore[arg-type]
        extra_body={"num_frames": 5, "num_inference_steps": 3, "seed": 7},
        poll_interval_ms=100,
    )
    assert video.status == "completed", video.error
    assert video.model == "tiny-hunyuan-video"
    assert video.size == "32x16"
    assert video.seconds == f"{5 / 24:g}"
    frames, rate = decoded(client.videos.download_content(video.id).read())
    assert len(frames) == 5
    assert frames[0].shape == (16, 32, 3)
    assert rate == 24
    # Both stages ran it, once each: the encoder's one message carried the prompt and, a
    # companion, the empty negative prompt for the guider's default guidance.
    pools = router.state.pools
    assert sum(s.done for s in pools[ENCODER].stats()) == 1
    assert sum(s.done for s in pools[DIT].stats()) == 1
    # No size, no length: the pipeline's own size bucket (its transformer's target size,
    # 16:9) and the Videos API's 4 s at 24 fps (97 frames: 1 + a multiple of 4).
    video = client.videos.create_and_poll(
        prompt="a cat", extra_body={"num_inference_steps": 1, "guidance_scale": 1.0},
        poll_interval_ms=100,
    )  # fmt: skip
    assert video.status == "completed", video.error
    height, width = monolithic.video_processor.calculate_default_height_width(
        9, 16, monolithic.target_size
    )
    assert video.size == f"{width}x{height}"
    frames, _ = decoded(client.videos.download_content(video.id).read())
    assert len(frames) == 97


def test_an_input_reference_is_refused(router: RunningRouter) -> None:
    """Text to video only (image-to-video is another pipeline on other weights): a job that
    would start from an image is refused when it is created, naming the field."""
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=DEADLINE_S)
    picture = np.random.default_rng(0).integers(0, 256, (16, 32, 3), dtype=np.uint8)
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(
            prompt=PROMPT,
            input_reference=("start.png", encode_png(picture), "image/png"),
            extra_body={"num_frames": 5, "num_inference_steps": 1},
        )
    assert refused.value.body["param"] == "input_reference"  # type: ignore[index]
