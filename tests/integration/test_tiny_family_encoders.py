"""vLLM serves the tiny diffusers families' text encoders from their checkpoints' folders,
with the hidden states that transformers computes on the same weights.

One offline ``vllm.LLM`` per family (pooling runner, ``embed`` conversion, fp32, eager), in
a child process of its own: vLLM run in-process binds the process's threads and memory,
freezes its GC heap and caches its environment, which would leak into the rest of the test
session. The child is this file run as a script; it writes what vLLM returned to a file.

What works, per family (see the fixtures' jobs):
- Qwen-Image: ``model=<ckpt>/text_encoder, tokenizer=<ckpt>/tokenizer``, with
  ``limit_mm_per_prompt`` of 0 images and videos (or ``language_model_only=True``): the
  checkpoint has no image processor, and vLLM would load one to profile image inputs.
- Qwen-Image-Edit: vLLM loads the HF processor (image processor and tokenizer) from
  ``model``, never from ``tokenizer``; ``<ckpt>/text_encoder`` holds none, so ``model`` is a
  folder of links to ``text_encoder/``'s files and ``processor/``'s.
- Z-Image: ``model=<ckpt>/text_encoder, tokenizer=<ckpt>/tokenizer`` (the Qwen3Model
  checkpoint, weights without the ``model.`` prefix, loads as is). Plain pooling gives the
  last layer's normed states, not the ``hidden_states[-2]`` the pipeline conditions on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from serving import run_vllm_child

from omni_runtime.tiny_models import QWEN_IMAGE_EDIT_SUBDIR, QWEN_IMAGE_SUBDIR, Z_IMAGE_SUBDIR

pytestmark = pytest.mark.integration
# vLLM's Qwen2.5-VL and the edit checkpoint's Qwen2VLProcessor import it; scripts/setup.sh
# installs it.
pytest.importorskip("torchvision", reason="vLLM's Qwen2.5-VL needs torchvision")

PROMPT = "draw a red cat under the moon"
EDIT_PROMPT = "make the cat blue"
MAX_MODEL_LEN = 1024
TOLERANCE = 1e-4


def _run_jobs(spec_path: str, out_path: str) -> None:
    """The child: one LLM per job, in turn, each encoding the job's prompts."""
    import gc

    from vllm import LLM, PoolingParams
    from vllm.config import PoolerConfig

    results: dict[str, list[dict[str, Any]]] = {}
    for name, job in json.loads(Path(spec_path).read_text()).items():
        llm = LLM(
            model=job["model"],
            tokenizer=job["tokenizer"],
            runner="pooling",
            convert="embed",
            pooler_config=PoolerConfig(task="token_embed"),
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            **job["engine_args"],
        )
        prompts: list[Any] = []
        for prompt in job["prompts"]:
            if prompt.get("image"):
                image = Image.open(prompt["image"]).convert("RGB")
                prompts.append({"prompt": prompt["text"], "multi_modal_data": {"image": image}})
            else:
                prompts.append(prompt["text"])
        outputs = llm.encode(
            prompts,
            pooling_params=PoolingParams(task="token_embed", use_activation=False),
            pooling_task="token_embed",
            use_tqdm=False,
        )
        results[name] = [
            {"states": out.outputs.data.clone(), "token_ids": list(out.prompt_token_ids)}
            for out in outputs
        ]
        del llm, outputs
        gc.collect()
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def pipelines(tiny_models: Path) -> dict[str, Any]:
    from diffusers import DiffusionPipeline

    return {
        family: DiffusionPipeline.from_pretrained(tiny_models / family, local_files_only=True)
        for family in (QWEN_IMAGE_SUBDIR, QWEN_IMAGE_EDIT_SUBDIR, Z_IMAGE_SUBDIR)
    }


@pytest.fixture(scope="module")
def edit_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # About the size the edit pipeline hands its processor (it resizes to ~1024x1024).
    pixels = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("edit-image") / "input.png"
    Image.fromarray(pixels).save(path)
    return path


def _qwen_image_text(pipelines: dict[str, Any]) -> str:
    template: str = pipelines[QWEN_IMAGE_SUBDIR].prompt_template_encode
    return template.format(PROMPT)


def _edit_text(pipelines: dict[str, Any]) -> str:
    template: str = pipelines[QWEN_IMAGE_EDIT_SUBDIR].prompt_template_encode
    return template.format(EDIT_PROMPT)


def _z_image_text(pipelines: dict[str, Any]) -> str:
    text: str = pipelines[Z_IMAGE_SUBDIR].tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    return text


def _processor_view(checkpoint: Path, view: Path) -> Path:
    """A folder with the text encoder's files and the processor's, as vLLM wants ``model``."""
    view.mkdir(parents=True)
    for folder in ("text_encoder", "processor"):
        for file in (checkpoint / folder).iterdir():
            if not (view / file.name).exists():
                (view / file.name).symlink_to(file)
    return view


@pytest.fixture(scope="module")
def vllm_states(
    tiny_models: Path,
    pipelines: dict[str, Any],
    edit_image: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("vllm-encoders")
    edit = tiny_models / QWEN_IMAGE_EDIT_SUBDIR
    jobs = {
        QWEN_IMAGE_SUBDIR: {
            "model": str(tiny_models / QWEN_IMAGE_SUBDIR / "text_encoder"),
            "tokenizer": str(tiny_models / QWEN_IMAGE_SUBDIR / "tokenizer"),
            "engine_args": {"limit_mm_per_prompt": {"image": 0, "video": 0}},
            "prompts": [{"text": _qwen_image_text(pipelines)}],
        },
        QWEN_IMAGE_EDIT_SUBDIR: {
            "model": str(_processor_view(edit, work / "edit-text-encoder")),
            "tokenizer": str(edit / "processor"),
            "engine_args": {"limit_mm_per_prompt": {"image": 1, "video": 0}},
            "prompts": [{"text": _edit_text(pipelines), "image": str(edit_image)}],
        },
        Z_IMAGE_SUBDIR: {
            "model": str(tiny_models / Z_IMAGE_SUBDIR / "text_encoder"),
            "tokenizer": str(tiny_models / Z_IMAGE_SUBDIR / "tokenizer"),
            "engine_args": {},
            "prompts": [{"text": _z_image_text(pipelines)}],
        },
    }
    spec, out = work / "jobs.json", work / "states.pt"
    spec.write_text(json.dumps(jobs))
    run_vllm_child(__file__, spec, out)
    states: dict[str, list[dict[str, Any]]] = torch.load(out, weights_only=True)
    return states


def _hidden_states(text_encoder: Any, inputs: dict[str, Any]) -> tuple[Any, ...]:
    with torch.no_grad():
        states: tuple[Any, ...] = text_encoder(**inputs, output_hidden_states=True).hidden_states
    return states


def test_qwen_image_text_states_are_transformers_last_hidden_states(
    pipelines: dict[str, Any], vllm_states: dict[str, list[dict[str, Any]]]
) -> None:
    pipe = pipelines[QWEN_IMAGE_SUBDIR]
    (served,) = vllm_states[QWEN_IMAGE_SUBDIR]
    inputs = pipe.tokenizer(_qwen_image_text(pipelines), return_tensors="pt")
    assert served["token_ids"] == inputs.input_ids[0].tolist()
    expected = _hidden_states(pipe.text_encoder, dict(inputs))[-1][0]
    assert served["states"].shape == expected.shape
    assert (served["states"] - expected).abs().max().item() < TOLERANCE
    # What the pipeline conditions on: those rows, the template's first ones dropped.
    embeds, _ = pipe.encode_prompt(PROMPT)
    drop = pipe.prompt_template_encode_start_idx
    assert (served["states"][drop:] - embeds[0]).abs().max().item() < TOLERANCE


def test_qwen_image_edit_states_with_the_image_match_transformers_with_mrope(
    pipelines: dict[str, Any],
    vllm_states: dict[str, list[dict[str, Any]]],
    edit_image: Path,
) -> None:
    pipe = pipelines[QWEN_IMAGE_EDIT_SUBDIR]
    (served,) = vllm_states[QWEN_IMAGE_EDIT_SUBDIR]
    image = Image.open(edit_image).convert("RGB")
    inputs = pipe.processor(text=[_edit_text(pipelines)], images=image, return_tensors="pt")
    # vLLM expanded the one image placeholder as the checkpoint's processor does.
    assert served["token_ids"] == inputs["input_ids"][0].tolist()
    image_token = pipe.text_encoder.config.image_token_id
    assert served["token_ids"].count(image_token) == 16
    # mm_token_type_ids (the processor returns them) make transformers apply M-RoPE, as vLLM
    # does; diffusers' encode_prompt drops them and gets 1-D positions instead.
    assert "mm_token_type_ids" in inputs
    expected = _hidden_states(pipe.text_encoder, dict(inputs))[-1][0]
    assert served["states"].shape == expected.shape
    assert (served["states"] - expected).abs().max().item() < TOLERANCE
    without_mrope = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    one_d = _hidden_states(pipe.text_encoder, without_mrope)[-1][0]
    assert (served["states"] - one_d).abs().max().item() > 10 * TOLERANCE


def test_z_image_states_are_the_last_layer_not_the_one_the_pipeline_uses(
    pipelines: dict[str, Any], vllm_states: dict[str, list[dict[str, Any]]]
) -> None:
    pipe = pipelines[Z_IMAGE_SUBDIR]
    (served,) = vllm_states[Z_IMAGE_SUBDIR]
    inputs = pipe.tokenizer(_z_image_text(pipelines), return_tensors="pt")
    assert served["token_ids"] == inputs.input_ids[0].tolist()
    states = _hidden_states(pipe.text_encoder, dict(inputs))
    assert (served["states"] - states[-1][0]).abs().max().item() < TOLERANCE
    # ZImagePipeline conditions on hidden_states[-2] (no final norm, one layer less): plain
    # pooling is not that, by far.
    (embeds,) = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False)[0]
    assert (embeds - states[-2][0]).abs().max().item() < TOLERANCE
    assert (served["states"] - embeds).abs().max().item() > 0.1


if __name__ == "__main__":
    _run_jobs(sys.argv[1], sys.argv[2])
