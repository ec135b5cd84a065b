"""Tiny models built from configs with fixed seeds, for the main job, the tests and bench/.

Nothing is downloaded: the tokenizers are trained here on generated text and the weights
are random. Under one root:

- ``llm/`` and ``diffusion/``: a chat LLM (Qwen2) and a Stable Diffusion pipeline built to
  fit together the way a real omni pipeline does: the diffusion pipeline's text
  conditioning width (its UNet's cross-attention dim and its text encoder's hidden size)
  equals the LLM's hidden size, so an LLM stage's hidden states can condition the diffusion
  stage as prompt embeddings.
- ``qwen-image/``, ``qwen-image-edit/``, ``qwen-image-edit-plus/``, ``z-image/``: full
  diffusers checkpoints (``model_index.json`` and one folder per component) of
  QwenImagePipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline (the pipeline of
  Qwen-Image-Edit-2509 and -2511) and ZImagePipeline, laid out and shaped as the real checkpoints
  are, scaled down. Their text encoders (Qwen2.5-VL, Qwen3) load in vLLM from the
  ``text_encoder/`` folders.
- ``bagel/``: a BAGEL checkpoint in the real one's files and names (``tiny_models.bagel``).
- ``wan2.2/``: a WanPipeline checkpoint shaped as Wan2.2-TI2V-5B's (``tiny_models.wan``):
  text-to-video, and image-to-video through WanImageToVideoPipeline on the same weights.
- ``hunyuan-video-1.5/``: a HunyuanVideo15Pipeline checkpoint laid out as
  HunyuanVideo-1.5-Diffusers-480p_t2v is (``tiny_models.hunyuan_video``); its Qwen2.5-VL
  text encoder loads in vLLM from ``text_encoder/``.
- ``hunyuan-video-1.5-i2v/``: the same weights as a HunyuanVideo15ImageToVideoPipeline
  checkpoint, laid out as HunyuanVideo-1.5-Diffusers-480p_i2v is (hard links to the
  files of ``hunyuan-video-1.5/``).
- ``qwen3-omni/``: a Qwen3OmniMoeForConditionalGeneration checkpoint (thinker, talker,
  code2wav) laid out as Qwen3-Omni-30B-A3B-Instruct is (``tiny_models.qwen3_omni``), with
  its tokenizer, chat template and processor (audio input); vLLM serves its thinker.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._common import HIDDEN_SIZE, SEED, VOCAB_SIZE
from ._tokenizer import CHATML_TEMPLATE, build_qwen_tokenizer
from .bagel import build_bagel
from .chat_llm import build_chat_llm
from .hunyuan_video import build_hunyuan_video, build_hunyuan_video_i2v
from .qwen3_omni import build_qwen3_omni
from .qwen_image import MAX_POSITIONS, build_qwen_image
from .stable_diffusion import build_stable_diffusion
from .wan import build_wan
from .z_image import build_z_image

__all__ = [
    "BAGEL_SUBDIR",
    "CHATML_TEMPLATE",
    "DIFFUSION_SUBDIR",
    "HIDDEN_SIZE",
    "HUNYUAN_VIDEO_I2V_SUBDIR",
    "HUNYUAN_VIDEO_SUBDIR",
    "LLM_SUBDIR",
    "QWEN3_OMNI_SUBDIR",
    "QWEN_IMAGE_EDIT_PLUS_SUBDIR",
    "QWEN_IMAGE_EDIT_SUBDIR",
    "QWEN_IMAGE_SUBDIR",
    "SUBDIRS",
    "TINY_MODELS",
    "VOCAB_SIZE",
    "WAN_SUBDIR",
    "Z_IMAGE_SUBDIR",
    "TinyModel",
    "ensure_tiny_models",
]

LLM_SUBDIR = "llm"
DIFFUSION_SUBDIR = "diffusion"
QWEN_IMAGE_SUBDIR = "qwen-image"
QWEN_IMAGE_EDIT_SUBDIR = "qwen-image-edit"
QWEN_IMAGE_EDIT_PLUS_SUBDIR = "qwen-image-edit-plus"
Z_IMAGE_SUBDIR = "z-image"
BAGEL_SUBDIR = "bagel"
WAN_SUBDIR = "wan2.2"
HUNYUAN_VIDEO_SUBDIR = "hunyuan-video-1.5"
HUNYUAN_VIDEO_I2V_SUBDIR = "hunyuan-video-1.5-i2v"
QWEN3_OMNI_SUBDIR = "qwen3-omni"


class _Staging:
    """Where one build writes (``staging / subdir``), and what several builds share."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __truediv__(self, subdir: str) -> Path:
        return self.root / subdir

    @functools.cached_property
    def qwen_tokenizer(self) -> Any:
        """The Qwen2 tokenizer the Qwen-Image, Z-Image, BAGEL and HunyuanVideo encoders share."""
        return build_qwen_tokenizer(model_max_length=MAX_POSITIONS)


@dataclass(frozen=True)
class TinyModel:
    """One line of the registry: the directories a build writes under the root, and it."""

    subdirs: tuple[str, ...]
    build: Callable[[_Staging], None]


# Every tiny model, one line each, in build order (a build may read one built before it).
TINY_MODELS: tuple[TinyModel, ...] = (
    TinyModel((LLM_SUBDIR,), lambda s: build_chat_llm(s / LLM_SUBDIR)),
    TinyModel(
        (DIFFUSION_SUBDIR,), lambda s: build_stable_diffusion(s / DIFFUSION_SUBDIR, s / LLM_SUBDIR)
    ),
    # One text encoder and VAE under three pipelines, as the real checkpoints share them.
    TinyModel(
        (QWEN_IMAGE_SUBDIR, QWEN_IMAGE_EDIT_SUBDIR, QWEN_IMAGE_EDIT_PLUS_SUBDIR),
        lambda s: build_qwen_image(
            s / QWEN_IMAGE_SUBDIR,
            s / QWEN_IMAGE_EDIT_SUBDIR,
            s / QWEN_IMAGE_EDIT_PLUS_SUBDIR,
            s.qwen_tokenizer,
        ),
    ),
    TinyModel((Z_IMAGE_SUBDIR,), lambda s: build_z_image(s / Z_IMAGE_SUBDIR, s.qwen_tokenizer)),
    TinyModel((BAGEL_SUBDIR,), lambda s: build_bagel(s / BAGEL_SUBDIR, s.qwen_tokenizer)),
    TinyModel((WAN_SUBDIR,), lambda s: build_wan(s / WAN_SUBDIR)),
    TinyModel(
        (HUNYUAN_VIDEO_SUBDIR,),
        lambda s: build_hunyuan_video(s / HUNYUAN_VIDEO_SUBDIR, s.qwen_tokenizer),
    ),
    TinyModel(
        (HUNYUAN_VIDEO_I2V_SUBDIR,),
        lambda s: build_hunyuan_video_i2v(s / HUNYUAN_VIDEO_I2V_SUBDIR, s / HUNYUAN_VIDEO_SUBDIR),
    ),
    TinyModel((QWEN3_OMNI_SUBDIR,), lambda s: build_qwen3_omni(s / QWEN3_OMNI_SUBDIR)),
)
SUBDIRS = tuple(subdir for model in TINY_MODELS for subdir in model.subdirs)
_MARKER = "omni-tiny-models.json"
# Bump when what is built changes, so that old directories are rebuilt.
_RECIPE_VERSION = 13


def _readable_by_all(tree: Path) -> None:
    """Give everyone read access to ``tree``: safetensors writes its files 0600, and an
    image bakes the models as root for a process that runs as another user."""
    for path in (tree, *tree.rglob("*")):
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)


def ensure_tiny_models(root: str | Path) -> Path:
    """Build every tiny model under ``root`` unless this recipe's build is already there."""
    root = Path(root)
    marker = root / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == _RECIPE_VERSION:
        return root
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move into place, so an interrupted build never leaves a
    # directory that looks complete.
    with tempfile.TemporaryDirectory(dir=root, prefix=".building-") as tmp:
        staging = _Staging(Path(tmp))
        for model in TINY_MODELS:
            model.build(staging)
        for sub in SUBDIRS:
            _readable_by_all(staging / sub)
            shutil.rmtree(root / sub, ignore_errors=True)
            (staging / sub).rename(root / sub)
    marker.write_text(json.dumps({"recipe": _RECIPE_VERSION, "seed": SEED}))
    return root
