"""A family's DiT stage (the diffusion engine, in this process) refuses what its family's
pipeline cannot take, naming the field, and loads without the components the encoder has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_runtime.config import ConnectorConfig
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    InvalidStageRequestError,
    StageErrorCode,
)
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest as Request
from omni_runtime.tiny_models import (
    DIFFUSION_SUBDIR,
    HIDDEN_SIZE,
    QWEN_IMAGE_EDIT_PLUS_SUBDIR,
    QWEN_IMAGE_EDIT_SUBDIR,
    QWEN_IMAGE_SUBDIR,
    Z_IMAGE_SUBDIR,
)

pytestmark = pytest.mark.integration

_ENGINES: dict[tuple[str, str | None], DiffusionEngine] = {}


def engine(tiny_models: Path, subdir: str, family: str | None) -> DiffusionEngine:
    key = (subdir, family)
    if key not in _ENGINES:
        config = DiffusionEngineConfig(
            model=str(tiny_models / subdir), family=family, text_from_upstream=True
        )
        _ENGINES[key] = DiffusionEngine(config)
    return _ENGINES[key]


def embeds(tokens: int = 5, width: int = HIDDEN_SIZE) -> np.ndarray:
    return np.random.default_rng(tokens).standard_normal((tokens, width), dtype=np.float32)


def error_of(dit: DiffusionEngine, request: Request) -> Any:
    dit.admit(request.request_id)
    output = dit.execute(request)
    assert output.error is not None, "expected a refusal"
    return output.error


@pytest.mark.parametrize(
    ("subdir", "family", "left_out"),
    [
        (QWEN_IMAGE_SUBDIR, "qwen-image", ("text_encoder", "tokenizer")),
        (QWEN_IMAGE_EDIT_SUBDIR, "qwen-image-edit", ("text_encoder", "tokenizer", "processor")),
        (
            QWEN_IMAGE_EDIT_PLUS_SUBDIR,
            "qwen-image-edit-plus",
            ("text_encoder", "tokenizer", "processor"),
        ),
        (Z_IMAGE_SUBDIR, "z-image", ("text_encoder", "tokenizer")),
    ],
)
def test_a_family_dit_loads_without_the_encoders_components(
    tiny_models: Path, subdir: str, family: str, left_out: tuple[str, ...]
) -> None:
    dit = engine(tiny_models, subdir, family)
    for name in left_out:
        assert getattr(dit.pipeline, name) is None
    assert dit.pipeline.transformer is not None
    assert dit.describe()["family"] == family
    assert dit.conditioning_width == HIDDEN_SIZE


@pytest.mark.parametrize(
    ("subdir", "family", "request_fields", "param"),
    [
        # The encoder stage is its text encoder: text alone cannot be encoded here.
        (QWEN_IMAGE_SUBDIR, "qwen-image", {"prompt": "a cat"}, "prompt_embeds"),
        # Parameters the family's pipeline does not take.
        (QWEN_IMAGE_SUBDIR, "qwen-image", {"params": {"strength": 0.5}}, "strength"),
        (Z_IMAGE_SUBDIR, "z-image", {"params": {"true_cfg_scale": 4.0}}, "true_cfg_scale"),
        # An edit edits an input image; a text-to-image family takes none.
        (QWEN_IMAGE_EDIT_SUBDIR, "qwen-image-edit", {}, "image"),
        (
            QWEN_IMAGE_SUBDIR,
            "qwen-image",
            {"images": [np.zeros((32, 32, 3), np.uint8)]},
            "image",
        ),
        # More input images than the family's pipeline takes.
        (
            QWEN_IMAGE_EDIT_SUBDIR,
            "qwen-image-edit",
            {"images": [np.zeros((32, 32, 3), np.uint8)] * 2},
            "image",
        ),
        (
            QWEN_IMAGE_EDIT_PLUS_SUBDIR,
            "qwen-image-edit-plus",
            {"images": [np.zeros((32, 32, 3), np.uint8)] * 4},
            "image",
        ),
        # Embeddings of another width than the DiT's conditioning.
        (Z_IMAGE_SUBDIR, "z-image", {"prompt_embeds": embeds(4, 64)}, "prompt_embeds"),
        (
            QWEN_IMAGE_SUBDIR,
            "qwen-image",
            {"negative_prompt_embeds": embeds(4, 64)},
            "negative_prompt_embeds",
        ),
        # Z-Image guides by default: the negative prompt's embeddings are needed too.
        (Z_IMAGE_SUBDIR, "z-image", {}, "negative_prompt_embeds"),
        # Z-Image's DiT sizes must be multiples of its image processor's (VAE x patch).
        (Z_IMAGE_SUBDIR, "z-image", {"params": {"height": 72, "width": 64}}, "height"),
    ],
)
def test_what_the_family_cannot_take_is_refused_by_name(
    tiny_models: Path, subdir: str, family: str, request_fields: dict[str, Any], param: str
) -> None:
    dit = engine(tiny_models, subdir, family)
    fields: dict[str, Any] = {"prompt_embeds": embeds(), **request_fields}
    if family == "z-image" and param != "negative_prompt_embeds":
        fields.setdefault("negative_prompt_embeds", embeds(3))
    if "prompt" in request_fields:
        fields.pop("prompt_embeds")
    error = error_of(dit, Request(request_id=f"bad-{param}", **fields))
    assert error.param == param, error.message
    assert error.message.startswith((param, f"params.{param}")), error.message
    # The stage goes on serving.
    good = Request(request_id=f"good-{param}", prompt_embeds=embeds(), params={"height": 32,
                   "width": 32, "num_inference_steps": 2})  # fmt: skip
    if family in ("qwen-image-edit", "qwen-image-edit-plus"):
        good.images = [np.zeros((32, 32, 3), np.uint8)]
    if family == "z-image":
        good.negative_prompt_embeds = embeds(3)
    dit.admit(good.request_id)
    output = dit.execute(good)
    assert output.error is None, output.error
    assert output.images is not None


def test_a_family_checkpoint_without_its_family_is_refused(tiny_models: Path) -> None:
    with pytest.raises(InvalidStageRequestError, match="set family: qwen-image"):
        engine(tiny_models, QWEN_IMAGE_SUBDIR, None)
    with pytest.raises(InvalidStageRequestError, match="runs ZImagePipeline"):
        engine(tiny_models, QWEN_IMAGE_SUBDIR, "z-image")


def test_true_cfg_scale_is_refused_by_a_pipeline_without_it(tiny_models: Path) -> None:
    sd = DiffusionEngine(DiffusionEngineConfig(model=str(tiny_models / DIFFUSION_SUBDIR)))
    error = error_of(sd, Request(request_id="sd", prompt="a cat", params={"true_cfg_scale": 2}))
    assert error.param == "true_cfg_scale"
    assert "StableDiffusionPipeline" in error.message


def test_handed_off_embeddings_are_fetched_by_the_engine_itself(tiny_models: Path) -> None:
    """The one hand-off path: an upstream stage's embeddings, put into a connector, reach
    the DiT as named inputs that its engine fetches itself (into its dtype, on its device);
    the image is the one the same embeddings make given as arrays, and the producer's copies
    are gone once fetched. A refused request frees them too; one already gone is a
    STAGE_FAILED naming the input, so that the router runs the request again."""
    connectors = {"tcp": {"name": "TCPConnector", "extra": {"bind_host": "127.0.0.1"}}}
    producer = StageConnectors({"tcp": ConnectorConfig.model_validate(connectors["tcp"])})
    dit = DiffusionEngine(
        DiffusionEngineConfig(
            model=str(tiny_models / Z_IMAGE_SUBDIR),
            family="z-image",
            text_from_upstream=True,
            connectors=connectors,
        )
    )
    tcp = producer.get("tcp")
    params = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 3}
    positive, negative = embeds(), embeds(3)

    def run(request: Request) -> Any:
        dit.admit(request.request_id)
        return dit.execute(request)

    def handed(key: str) -> dict[str, HandOff]:
        return {
            "prompt_embeds": HandOff(tcp.put(f"{key}-p", positive)),
            "negative_prompt_embeds": HandOff(tcp.put(f"{key}-n", negative)),
        }

    try:
        arrays = run(
            Request(
                "arrays", params=params, prompt_embeds=positive, negative_prompt_embeds=negative
            )
        )
        inputs = handed("fetched")
        fetched = run(Request("fetched", params=params, inputs=inputs))
        assert arrays.error is None, arrays.error
        assert fetched.error is None, fetched.error
        np.testing.assert_array_equal(fetched.images, arrays.images)
        assert fetched.fetch_time > 0
        for hand_off in inputs.values():
            with pytest.raises(ConnectorError):
                tcp.get(hand_off.handle)

        refused_inputs = handed("refused")
        refused = run(Request("refused", params={**params, "height": 33}, inputs=refused_inputs))
        assert refused.error is not None
        assert refused.error.param == "height"
        for hand_off in refused_inputs.values():
            with pytest.raises(ConnectorError):
                tcp.get(hand_off.handle)

        lost_inputs = handed("lost")
        tcp.release(lost_inputs["negative_prompt_embeds"].handle.key)
        lost = run(Request("lost", params=params, inputs=lost_inputs))
        assert lost.error is not None
        assert (lost.error.code, lost.error.param) == (
            StageErrorCode.STAGE_FAILED,
            "negative_prompt_embeds",
        )

        both = run(Request("both", params=params, prompt_embeds=positive, inputs=handed("both")))
        assert both.error is not None
        assert both.error.param == "prompt_embeds"
        unknown = run(
            Request(
                "unknown",
                params=params,
                prompt_embeds=positive,
                negative_prompt_embeds=negative,
                inputs={"context_kv": HandOff(tcp.put("unknown", positive))},
            )
        )
        assert unknown.error is not None
        assert unknown.error.param == "context_kv"
    finally:
        dit.close()
        producer.close()
