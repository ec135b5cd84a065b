"""Model family recipes: which family a pipeline is, and when its DiT needs a negative prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.config import PipelineConfigError, load_pipeline
from omni_runtime.families import (
    FAMILIES,
    FAMILY_NAMES,
    family_of_model_name,
    family_of_pipeline_class,
    prompt_image_size,
    read_checkpoint_family,
)


def two_stages(model: str, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "stages": [
            {"stageId": 0},
            {"stageId": 1, "inputConnectors": {"from_stage_0": "shm"}},
        ],
        "connectors": {"shm": {"name": "SharedMemoryConnector"}},
        **more,
    }


@pytest.mark.parametrize(
    ("model", "family"),
    [
        ("Qwen/Qwen-Image", "qwen-image"),
        ("Qwen/Qwen-Image-Edit", "qwen-image-edit"),
        ("/models/qwen_image_edit/", "qwen-image-edit"),
        # Published under dates, served by the several-image pipeline.
        ("Qwen/Qwen-Image-Edit-2509", "qwen-image-edit-plus"),
        ("Qwen/Qwen-Image-Edit-2511", "qwen-image-edit-plus"),
        ("/models/qwen-image-edit-plus", "qwen-image-edit-plus"),
        ("Tongyi-MAI/Z-Image-Turbo", "z-image"),
        ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", "hunyuanvideo-1.5"),
        ("/models/hunyuan-video-1.5", "hunyuanvideo-1.5"),
        # Its image-to-video checkpoints are other weights, of a family of their own.
        ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v", "hunyuanvideo-1.5-i2v"),
        ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v", "hunyuanvideo-1.5-i2v"),
        ("hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", "hunyuanvideo-1.5-i2v"),
        ("/models/hunyuan-video-1.5-i2v", "hunyuanvideo-1.5-i2v"),
        # HunyuanVideo (1.0) is another pipeline.
        ("hunyuanvideo-community/HunyuanVideo", None),
        ("Qwen/Qwen2.5-VL-7B-Instruct", None),
        ("/models/qwen-image/sdxl", None),
    ],
)
def test_family_from_the_models_last_name(model: str, family: str | None) -> None:
    found = family_of_model_name(model)
    assert (found.name if found else None) == family


def test_a_known_family_needs_no_stage_types() -> None:
    config = load_pipeline(two_stages("Qwen/Qwen-Image-Edit"))
    assert config.family == "qwen-image-edit"
    assert [(s.name, s.type, s.output) for s in config.stages] == [
        ("encoder", "llm", "hidden_states"),
        ("dit", "diffusion", None),
    ]
    assert config.family_recipe is FAMILIES["qwen-image-edit"]


def test_family_from_the_checkpoints_model_index(tmp_path: Path) -> None:
    checkpoint = tmp_path / "my-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    data = two_stages(str(checkpoint))
    data["stages"][0].update(type="llm", output="hidden_states")
    data["stages"][1]["type"] = "diffusion"
    assert load_pipeline(data).family == "z-image"
    # HunyuanVideo-1.5's i2v checkpoints name their own pipeline, and so their family.
    (checkpoint / "model_index.json").write_text(
        json.dumps({"_class_name": "HunyuanVideo15ImageToVideoPipeline"})
    )
    assert load_pipeline(data).family == "hunyuanvideo-1.5-i2v"
    assert read_checkpoint_family(str(tmp_path / "missing")) is None
    assert family_of_pipeline_class("StableDiffusionPipeline") is None


def test_a_named_family_wins_over_the_models_name() -> None:
    config = load_pipeline(two_stages("Qwen/Qwen-Image", family="qwen-image-edit"))
    assert config.family == "qwen-image-edit"


def test_unknown_family_names_the_field() -> None:
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(two_stages("Qwen/Qwen-Image", family="sdxl"))
    paths = [path for path, _ in caught.value.issues]
    assert paths == ["family"]


def test_a_family_encoder_that_outputs_text_is_refused() -> None:
    data = two_stages("Qwen/Qwen-Image")
    data["stages"][0]["output"] = "text"
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(data)
    ((path, message),) = caught.value.issues
    assert path == "stages[0].output"
    assert "hidden_states" in message


def test_a_dit_on_its_own_engine_takes_no_torch_compile() -> None:
    data = two_stages("ByteDance-Seed/BAGEL-7B-MoT")
    data["stages"][1]["torchCompile"] = True
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(data)
    ((path, message),) = caught.value.issues
    assert path == "stages[1].torchCompile"
    assert "bagel DiT runs on its own engine" in message
    # A diffusers family's DiT takes it.
    data = two_stages("Qwen/Qwen-Image")
    data["stages"][1]["torchCompile"] = True
    assert load_pipeline(data).stages[1].torch_compile


@pytest.mark.parametrize(
    ("family", "params", "negative"),
    [
        # Qwen-Image: guidance only with a negative prompt and true_cfg_scale > 1 (default 4).
        ("qwen-image", {}, None),
        ("qwen-image", {"negative_prompt": "blurry"}, "blurry"),
        ("qwen-image", {"negative_prompt": " ", "true_cfg_scale": 1.0}, None),
        ("qwen-image-edit", {"negative_prompt": "", "true_cfg_scale": 2}, ""),
        # Z-Image: guidance while guidance_scale > 0 (default 5), "" unless one is given.
        ("z-image", {}, ""),
        ("z-image", {"negative_prompt": "dark"}, "dark"),
        ("z-image", {"guidance_scale": 0.0, "negative_prompt": "dark"}, None),
        # Wrong types are the DiT's to refuse; the router decides as if they were absent.
        ("z-image", {"guidance_scale": "high", "negative_prompt": 3}, ""),
        # HunyuanVideo-1.5: its guider's guidance, on unless the scale is 1 (default 6).
        ("hunyuanvideo-1.5", {}, ""),
        ("hunyuanvideo-1.5", {"negative_prompt": "dark"}, "dark"),
        ("hunyuanvideo-1.5", {"guidance_scale": 1, "negative_prompt": "dark"}, None),
        ("hunyuanvideo-1.5", {"guidance_scale": 0.0}, ""),
    ],
)
def test_when_the_dit_needs_negative_embeddings(
    family: str, params: dict[str, Any], negative: str | None
) -> None:
    assert FAMILIES[family].negative_prompt(params) == negative


@pytest.mark.parametrize(("negative", "encoded"), [(None, " "), ("", " "), ("dark", "dark")])
def test_hunyuan_videos_negative_prompt_is_templated_as_its_pipeline_does(
    negative: str | None, encoded: str
) -> None:
    """The encoder's companion request for the negative prompt: an empty one is one space
    (the pipeline's format_text_input), and its hand-off is the DiT's negative."""
    family = FAMILIES["hunyuanvideo-1.5"]
    params = {"negative_prompt": negative} if negative is not None else {}
    (companion,) = family.companions("a cat", False, params, False)
    assert companion.prompt == encoded
    assert companion.inputs == {"prompt_embeds": "negative_prompt_embeds"}
    assert family.companions("a cat", False, {"guidance_scale": 1.0}, False) == ()


@pytest.mark.parametrize(
    ("size", "expected"),
    [((1024, 1024), (1024, 1024)), ((64, 64), (1024, 1024)), ((800, 400), (1440, 736))],
)
def test_edit_image_resized_as_the_pipeline_does(
    size: tuple[int, int], expected: tuple[int, int]
) -> None:
    width, height = prompt_image_size(*size, 1024 * 1024)
    assert (width, height) == expected
    assert width % 32 == height % 32 == 0


def test_the_schemas_family_names_are_the_registrys() -> None:
    """FamilyName (the schema's enum, and so the CRD's) lists exactly the registered
    families, each under its own name."""
    assert sorted(FAMILY_NAMES) == sorted(FAMILIES)
    assert all(family.name == name for name, family in FAMILIES.items())


def test_every_family_declares_a_topology_its_rules_accept() -> None:
    """A config of a family's model that gives no stage types gets its topology, and the
    family's own rules accept it."""
    for family in FAMILIES.values():
        stages: list[dict[str, Any]] = [{"stageId": stage.stage_id} for stage in family.topology]
        if len(stages) > 1:
            stages[-1]["inputConnectors"] = {"from_stage_0": "shm"}
        config = load_pipeline(
            {
                "model": "m",
                "family": family.name,
                "stages": stages,
                "connectors": {"shm": {"name": "SharedMemoryConnector"}},
            }
        )
        encoders = [stage for stage in config.stages if config.encoder_recipe(stage)]
        # A family without an encoder stage (Wan: its DiT encodes its prompts) has none.
        assert [stage.stage_id for stage in encoders] == ([0] if family.encoder else []), (
            family.name
        )


@pytest.mark.parametrize(
    ("family", "params", "has_image", "thinks", "companions"),
    [
        # Guidance: the negative prompt's embeddings, with an edit's image.
        ("qwen-image", {"true_cfg_scale": 4.0, "negative_prompt": "dark"}, False, False,
         [("negative", "dark", False, {"prompt_embeds": "negative_prompt_embeds"})]),
        ("qwen-image-edit", {"true_cfg_scale": 4.0, "negative_prompt": "dark"}, True, False,
         [("negative", "dark", True, {"prompt_embeds": "negative_prompt_embeds"})]),
        ("qwen-image", {"true_cfg_scale": 1.0, "negative_prompt": "dark"}, False, False, []),
        ("z-image", {}, False, False,
         [("negative", "", False, {"prompt_embeds": "negative_prompt_embeds"})]),
        ("z-image", {"guidance_scale": 0.0}, False, False, []),
        # BAGEL: the image-dropped context, for an edit or in think mode.
        ("bagel", {}, True, False,
         [("no-image", "p", False, {"context_kv": "no_image_context_kv"})]),
        ("bagel", {}, False, True,
         [("no-image", "p", False, {"context_kv": "no_image_context_kv"})]),
        ("bagel", {}, False, False, []),
        # HunyuanVideo-1.5's image-to-video: its encoder reads the text alone, the negative
        # prompt's too (the image is the DiT stage's).
        ("hunyuanvideo-1.5-i2v", {}, True, False,
         [("negative", " ", False, {"prompt_embeds": "negative_prompt_embeds"})]),
    ],
)  # fmt: skip
def test_a_familys_companion_requests(
    family: str,
    params: dict[str, Any],
    has_image: bool,
    thinks: bool,
    companions: list[tuple[str, str, bool, dict[str, str]]],
) -> None:
    found = FAMILIES[family].companions("p", has_image, params, thinks)
    assert [(c.suffix, c.prompt, c.with_image, dict(c.inputs)) for c in found] == companions


def test_bagels_thinker_takes_the_seed_of_an_edit_alone() -> None:
    bagel = FAMILIES["bagel"]
    assert bagel.encoder_params({"seed": 5, "height": 32}, has_image=True) == {"seed": 5}
    assert bagel.encoder_params({"seed": 5}, has_image=False) == {}
    assert FAMILIES["qwen-image-edit"].encoder_params({"seed": 5}, has_image=True) == {}


def test_a_qwen3_omni_pipeline_is_thinker_talker_code2wav_or_the_thinker_alone() -> None:
    data = {
        "model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
        "stages": [{"stageId": i} for i in range(3)],
    }
    pipeline = load_pipeline(data)
    assert pipeline.family == "qwen3-omni"
    assert [(s.name, s.type) for s in pipeline.stages] == [
        ("thinker", "llm"),
        ("talker", "llm"),
        ("code2wav", "diffusion"),
    ]
    roles = [pipeline.speech_stage(s) for s in pipeline.stages]
    assert [role.role if role else None for role in roles] == ["thinker", "talker", None]
    assert [role.architecture if role else None for role in roles] == [
        "OmniQwen3OmniThinker",
        "OmniQwen3OmniTalker",
        None,
    ]
    # The thinker alone answers in text.
    alone = load_pipeline({**data, "stages": [{"stageId": 0}]})
    assert alone.speech_stage(alone.stages[0]) is not None
    # Two stages are neither.
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline({**data, "stages": [{"stageId": 0}, {"stageId": 1}]})
    ((path, message),) = caught.value.issues
    assert path == "stages[1]"
    assert "thinker and the talker" in message


def test_async_chunk_is_a_speaking_pipelines_alone() -> None:
    speaking = {
        "model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
        "asyncChunk": True,
        "stages": [{"stageId": i} for i in range(3)],
    }
    assert load_pipeline(speaking).async_chunk
    data = {**two_stages("Qwen/Qwen-Image"), "asyncChunk": True}
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(data)
    ((path, message),) = caught.value.issues
    assert path == "asyncChunk"
    assert "qwen3-omni" in message


def test_num_threads_is_a_diffusion_stages_alone() -> None:
    data = two_stages("Qwen/Qwen-Image")
    data["stages"][1]["numThreads"] = 2
    assert load_pipeline(data).stages[1].num_threads == 2
    data["stages"][0]["numThreads"] = 2
    with pytest.raises(PipelineConfigError) as caught:
        load_pipeline(data)
    assert any(
        path.startswith("stages[0]") and "only diffusion stages take numThreads" in message
        for path, message in caught.value.issues
    ), caught.value.issues


def test_a_transformers_checkpoint_names_its_family(tmp_path: Path) -> None:
    # A Qwen3-Omni checkpoint under a path that names no family: its config.json's
    # architecture gives it, so its stages get the family's types and rules (not a generic
    # LLM, LLM, diffusers pipeline that fails when code2wav looks for model_index.json).
    checkpoint = tmp_path / "my-speaker"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"]})
    )
    config = load_pipeline(
        {
            "model": str(checkpoint),
            "stages": [
                {"stageId": 0},
                {"stageId": 1, "inputConnectors": {"from_stage_0": "shm"}},
                {"stageId": 2, "inputConnectors": {"from_stage_1": "shm"}},
            ],
            "connectors": {"shm": {"name": "SharedMemoryConnector"}},
        }
    )
    assert config.family == "qwen3-omni"
    assert [(s.name, s.type) for s in config.stages] == [
        ("thinker", "llm"),
        ("talker", "llm"),
        ("code2wav", "diffusion"),
    ]
    # An architecture of no family's (a plain LLM) names none.
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert read_checkpoint_family(str(checkpoint)) is None


def test_every_family_architecture_is_one_familys() -> None:
    seen: dict[str, str] = {}
    for family in FAMILIES.values():
        for architecture in family.architectures:
            assert seen.setdefault(architecture, family.name) == family.name


def test_import_linter_forbids_every_family_module_to_the_generic_layers() -> None:
    # import-linter reads pyproject.toml as it is: its list of family modules must be the
    # package's, so that a new family's room is closed to the generic layers as it lands.
    import importlib
    import pkgutil
    import tomllib

    import omni_runtime.families as families

    pyproject = tomllib.loads((Path(__file__).resolve().parents[4] / "pyproject.toml").read_text())
    (contract,) = (
        c
        for c in pyproject["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("Only the family registry")
    )
    modules = {
        f"{families.__name__}.{module.name}"
        for module in pkgutil.iter_modules(families.__path__)
        if module.name not in ("base", "graph")
    }
    assert set(contract["forbidden_modules"]) == modules
    # Each of them is a family's room: it defines a family the registry lists.
    registered = {id(family) for family in FAMILIES.values()}
    for name in modules:
        module = importlib.import_module(name)
        assert any(id(value) in registered for value in vars(module).values()), name
