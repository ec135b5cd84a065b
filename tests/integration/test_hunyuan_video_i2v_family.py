"""HunyuanVideo-1.5 image-to-video (``hunyuanvideo-1.5-i2v``) served as its text-to-video
is: its Qwen2.5-VL text encoder on vLLM (the encoder stage, the same recipe as
text-to-video's: test_hunyuan_video_family.py checks its rows), its DiT, VAE, ByT5 glyph
encoder and SigLIP image encoder on diffusers (the DiT stage, which takes the input image).

On the tiny i2v checkpoint (``tiny_models.hunyuan_video.build_hunyuan_video_i2v``):

- the DiT stage, given the encoder's rows, the prompt's text and the image, makes the
  frames diffusers' whole HunyuanVideo15ImageToVideoPipeline makes for the same prompt,
  negative prompt, image, seed, steps and frame count: identical bytes from the pipeline's
  own embeddings, and from vLLM's at most one uint8 level apart (the ~1e-7 of the
  embeddings reaching a rounding);
- the clip's size is the pipeline's bucket for the image's aspect ratio, and a request
  without an image, or with a size, is refused naming the field;
- through a real router and real stage processes of both stages, the official client's
  videos.create with an input_reference completes, and download_content is an MP4 of the
  whole pipeline's frames (within H.264's loss); a job without an image, with a size, or
  with bytes that are no image is refused when it is created, naming the field.
"""

from __future__ import annotations

import io
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
from PIL import Image
from serving import (
    RunningRouter,
    StageProcess,
    pipeline_from,
    running_router,
)

from omni_runtime.config import load_pipeline
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageDiffusionCoreOutput,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.families import FAMILIES, read_checkpoint_family
from omni_runtime.images import encode_png, to_uint8
from omni_runtime.tiny_models import HUNYUAN_VIDEO_I2V_SUBDIR
from omni_runtime.videos import encode_mp4

pytestmark = pytest.mark.integration

# transformers' SiglipImageProcessor (the DiT stage's feature_extractor) needs torchvision;
# scripts/setup.sh installs it, as the runtime image has it.
pytest.importorskip("torchvision", reason="SiglipImageProcessor needs torchvision")

REPO = Path(__file__).resolve().parents[2]
FAMILY = FAMILIES["hunyuanvideo-1.5-i2v"]
# Quoted text is what ByT5 reads: with it both text encoders condition the DiT.
PROMPT = 'a red cat walks under a sign that says "OPEN"'
NEGATIVE = 'a dark room, a sign that says "CLOSED"'
# The tiny clip: 5 frames, 3 steps; its size is the image's bucket (no height or width).
CLIP = {"num_inference_steps": 3, "num_frames": 5, "seed": 7}
# 40x80 (1:2) is the 16x32 bucket around the tiny transformer's 32 px target size.
IMAGE_SHAPE = (40, 80, 3)
FRAME_SHAPE = (16, 32, 3)


def picture(seed: int, shape: tuple[int, int, int] = IMAGE_SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


IMAGE = picture(0)


@pytest.fixture(scope="module", autouse=True)
def engine_environment(llm_engine_environment: None) -> None:
    """vLLM's CPU environment for this module's cores (tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / HUNYUAN_VIDEO_I2V_SUBDIR


def example_data(checkpoint: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        (REPO / "examples" / "tiny-hunyuan-video-i2v.yaml").read_text()
    )
    data["model"] = str(checkpoint)
    return data


@pytest.fixture(scope="module")
def monolithic(checkpoint: Path) -> Any:
    """diffusers' whole HunyuanVideo15ImageToVideoPipeline, every encoder in it."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(checkpoint, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == FAMILY.dit.pipeline_class
    return pipe


def reference_frames(
    pipe: Any, image: np.ndarray = IMAGE, negative: str | None = None, **call: Any
) -> np.ndarray:
    """The whole pipeline's clip of PROMPT from ``image`` as uint8 frames (as the DiT stage
    answers)."""
    params = {**CLIP, **call}
    seed, scale = params.pop("seed"), params.pop("guidance_scale", None)
    before = pipe.guider.guidance_scale
    if scale is not None:
        pipe.guider.guidance_scale = scale
    try:
        result = pipe(
            image=Image.fromarray(image),
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


def test_the_checkpoint_and_the_example_are_the_image_to_video_familys(checkpoint: Path) -> None:
    """Its model_index.json names the i2v pipeline, and so the family; the example's model
    (the tiny folder) is the family's by its name too."""
    assert read_checkpoint_family(str(checkpoint)) is FAMILY
    config = load_pipeline(example_data(checkpoint))
    assert config.family_recipe is FAMILY
    assert config.encoder_recipe(config.stages[ENCODER]) is FAMILY.encoder


# --- the encoder stage (vLLM), in this process as a stage server runs it ------------------


@pytest.fixture(scope="module")
def encoder(checkpoint: Path) -> Iterator[Encoder]:
    with encoder_stage(example_data(checkpoint), FAMILY) as stage:
        yield stage


_SERVED: dict[str, torch.Tensor] = {}


async def served_embeds(encoder: Encoder, prompt: str) -> Any:
    if prompt not in _SERVED:
        _SERVED[prompt] = await encoded(encoder, f"encode-{len(_SERVED)}", prompt)
    return _SERVED[prompt]


# --- the DiT stage: the whole pipeline's frames --------------------------------------------


@pytest.fixture(scope="module")
def dit(checkpoint: Path) -> DiffusionEngine:
    """The DiT stage's engine as the example's DiT stage builds it: the checkpoint without
    the Qwen encoder and its tokenizer (ByT5 and SigLIP stay)."""
    engine = DiffusionEngine(
        DiffusionEngineConfig(model=str(checkpoint), family=FAMILY.name, text_from_upstream=True)
    )
    assert engine.pipeline.text_encoder is None
    assert engine.pipeline.tokenizer is None
    assert engine.pipeline.text_encoder_2 is not None
    assert engine.pipeline.image_encoder is not None
    facts = engine.describe()
    assert facts["video"]
    assert facts["takes_image"]
    return engine


def run_dit(
    dit: DiffusionEngine,
    name: str,
    positive: Any,
    negative: Any = None,
    *,
    images: tuple[np.ndarray, ...] = (IMAGE,),
    **params: Any,
) -> StageDiffusionCoreOutput:
    request = Request(
        request_id=name,
        prompt=PROMPT,
        params={**CLIP, **params},
        images=list(images),
        prompt_embeds=np.asarray(positive),
        negative_prompt_embeds=None if negative is None else np.asarray(negative),
    )
    dit.admit(name)
    return dit.execute(request)


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
# The encoder's client answers on the event loop of its first request: every case on one.
@pytest.mark.asyncio(loop_scope="module")
async def test_dit_stage_frames_are_the_whole_pipelines(
    dit: DiffusionEngine,
    monolithic: Any,
    encoder: Encoder,
    negative: str | None,
    call: dict[str, Any],
) -> None:
    reference = reference_frames(monolithic, IMAGE, negative, **call)
    assert reference.shape == (5, *FRAME_SHAPE)
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
        f"i2v {call or 'default'}: frames from vLLM's embeddings vs the whole pipeline's: "
        f"max {difference.max()} levels, {(difference == 0).mean():.4%} identical"
    )
    assert difference.max() <= 1


def test_the_image_is_the_clips_start_and_sets_its_size(
    dit: DiffusionEngine, monolithic: Any
) -> None:
    embeds = reference_embeds(monolithic, PROMPT)
    frames = frames_of(run_dit(dit, "first", embeds, guidance_scale=1.0))
    other = frames_of(run_dit(dit, "second", embeds, guidance_scale=1.0, images=(picture(1),)))
    assert not np.array_equal(frames, other)
    # A tall image makes a tall clip: the bucket nearest its aspect ratio (2:1 -> 32x16).
    tall = run_dit(dit, "tall", embeds, guidance_scale=1.0, images=(picture(2, (80, 40, 3)),))
    assert frames_of(tall).shape == (5, 32, 16, 3)


@pytest.mark.parametrize(
    ("params", "images", "field"),
    [
        # No image: the pipeline has no text-only path.
        ({}, (), "image"),
        # A size: the pipeline takes it from the image.
        ({"height": 16}, (IMAGE,), "height"),
        ({"width": 32}, (IMAGE,), "width"),
        # One image starts a clip.
        ({}, (IMAGE, IMAGE), "image"),
    ],
    ids=["no-image", "height", "width", "two-images"],
)
def test_the_dit_stage_refuses_what_its_pipeline_does_not_take(
    dit: DiffusionEngine,
    monolithic: Any,
    params: dict[str, Any],
    images: tuple[np.ndarray, ...],
    field: str,
) -> None:
    embeds = reference_embeds(monolithic, PROMPT)
    refused = run_dit(dit, "refused", embeds, guidance_scale=1.0, images=images, **params)
    assert refused.error is not None
    assert refused.error.param == field, refused.error


# --- through a real router and real stage processes, with the official client ------------


@pytest.fixture(scope="module")
def stages(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    workdir = tmp_path_factory.mktemp("hunyuan-video-i2v-serving")
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


def decoded(mp4: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or 0)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames), rate


def test_videos_api_through_both_stages(router: RunningRouter, monolithic: Any) -> None:
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=DEADLINE_S)
    video = client.videos.create_and_poll(
        prompt=PROMPT,
        input_reference=("start.png", encode_png(IMAGE), "image/png"),
        extra_body=CLIP,
        poll_interval_ms=100,
    )
    assert video.status == "completed", video.error
    assert video.model == "tiny-hunyuan-video-i2v"
    assert video.size == "32x16"
    assert video.seconds == f"{5 / 24:g}"
    frames, rate = decoded(client.videos.download_content(video.id).read())
    assert frames.shape == (5, *FRAME_SHAPE)
    assert rate == 24
    # Both stages ran it, once each: the encoder's one message carried the prompt and, a
    # companion, the empty negative prompt for the guider's default guidance.
    pools = router.state.pools
    assert sum(s.done for s in pools[ENCODER].stats()) == 1
    assert sum(s.done for s in pools[DIT].stats()) == 1

    # The whole pipeline's frames, through H.264 (CRF 18, 4:2:0 chroma): the same frames
    # encoded here decode to what was served, up to the DiT's one level from vLLM's
    # embeddings; another image's clip, encoded so, is far from it.
    def through_mp4(image: np.ndarray) -> np.ndarray:
        expected, _ = decoded(encode_mp4(reference_frames(monolithic, image), 24))
        return np.abs(frames.astype(np.int16) - expected.astype(np.int16))

    same, other = through_mp4(IMAGE), through_mp4(picture(1))
    print(
        f"i2v served MP4 vs the whole pipeline's frames through the same encoder: max "
        f"{same.max()} levels, mean {same.mean():.3f} (another image's clip: mean "
        f"{other.mean():.1f})"
    )
    assert same.mean() < min(1.0, other.mean() / 10), (same.mean(), other.mean())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        # No image: the pipeline makes clips from one.
        ({}, "input_reference"),
        # A size: the clip's is the image's bucket.
        (
            {
                "input_reference": ("start.png", encode_png(IMAGE), "image/png"),
                "size": "32x16",
            },
            "size",
        ),
        # Bytes that are no image.
        ({"input_reference": ("start.png", b"not an image", "image/png")}, "input_reference"),
    ],
    ids=["no-image", "size", "not-an-image"],
)
def test_a_job_the_pipeline_cannot_make_is_refused_when_created(
    router: RunningRouter, kwargs: dict[str, Any], field: str
) -> None:
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", timeout=DEADLINE_S)
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt=PROMPT, extra_body=CLIP, **kwargs)
    assert refused.value.body["param"] == field  # type: ignore[index]
    assert refused.value.status_code == 400
