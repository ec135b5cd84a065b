"""A BAGEL checkpoint's shape, read from its directory (ByteDance-Seed/BAGEL-7B-MoT's layout).

The checkpoint is ``config.json`` (a ``bagel`` config: ``llm_config``, ``vit_config``,
``vae_config`` and the latent/ViT patching), ``llm_config.json`` and ``vit_config.json``
(read where ``config.json`` lacks its nested copies), ``ema.safetensors`` (the model),
``ae.safetensors`` (the FLUX VAE, in Black Forest Labs' naming) and a Qwen2 tokenizer.

Depths come from the weights, not the configs: BAGEL runs SigLIP without its last layer
(the released ``vit_config`` says 27 layers; the weights hold 26), and the latent position
table's size is the checkpoint's, whatever ``max_latent_size`` the config says.

Three things the official inference code hard-codes, kept here with its values as defaults
and read from ``config.json`` where a checkpoint sets them (the tiny test checkpoint does):
the VAE's dimensions (FLUX's), and the two image transforms (``vae_transform``: longest
side 1024, shortest 512, stride 16; ``vit_transform``: 980, 224, 14).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG = "config.json"
LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
MODEL_WEIGHTS = "ema.safetensors"
VAE_WEIGHTS = "ae.safetensors"
VIT_LAYER_PREFIX = "vit_model.vision_model.encoder.layers."
LATENT_POSITIONS = "latent_pos_embed.pos_embed"


class BagelCheckpointError(ValueError):
    """A directory that is not a BAGEL checkpoint this code can run, and why."""


@dataclass(frozen=True)
class LLMShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ViTShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    # Positions of the learned table: (image_size / patch_size) squared.
    image_size: int


@dataclass(frozen=True)
class VAEShape:
    """The FLUX autoencoder's dimensions (Black Forest Labs' names)."""

    z_channels: int = 16
    downsample: int = 8
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    in_channels: int = 3
    out_ch: int = 3
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159


@dataclass(frozen=True)
class ImageTransform:
    """How an input image is resized before a tower reads it: both sides within
    [min_size, max_size] where the aspect ratio allows, multiples of ``stride``, and at
    most ``max_pixels`` in all."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = 14 * 14 * 9 * 1024

    def size_for(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) an image of this size is resized to."""

        def apply(w: float, h: float, scale: float) -> tuple[int, int]:
            def divisible(value: int) -> int:
                return max(self.stride, round(value / self.stride) * self.stride)

            return divisible(round(w * scale)), divisible(round(h * scale))

        scale = min(self.max_size / max(width, height), 1.0)
        scale = max(scale, self.min_size / min(width, height))
        new_w, new_h = apply(width, height, scale)
        if new_w * new_h > self.max_pixels:
            new_w, new_h = apply(new_w, new_h, self.max_pixels / (new_w * new_h))
        if max(new_w, new_h) > self.max_size:
            new_w, new_h = apply(new_w, new_h, self.max_size / max(new_w, new_h))
        return new_w, new_h


@dataclass(frozen=True)
class BagelShape:
    llm: LLMShape
    vit: ViTShape
    vae: VAEShape
    latent_patch_size: int
    max_latent_size: int
    vit_max_num_patch_per_side: int
    connector_act: str
    vae_transform: ImageTransform
    vit_transform: ImageTransform

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent token along a side."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def latent_token_width(self) -> int:
        """Channels of one latent token: a p x p patch of the VAE's latent."""
        return self.latent_patch_size**2 * self.vae.z_channels


def read_bagel_shape(path: str | Path) -> BagelShape:
    """The shape of the BAGEL checkpoint in directory ``path``; BagelCheckpointError if it
    is not one."""
    root = Path(path)
    config = _read_json(root / CONFIG)
    if config.get("model_type") not in (None, "bagel"):
        raise BagelCheckpointError(
            f"{root / CONFIG}: model_type is {config.get('model_type')!r}, not 'bagel'"
        )
    config.setdefault("llm_config", None)
    config.setdefault("vit_config", None)
    config["llm_config"] = config["llm_config"] or _read_json(root / LLM_CONFIG)
    config["vit_config"] = config["vit_config"] or _read_json(root / VIT_CONFIG)
    vit_layers, latent_positions = _depths_from_weights(root / MODEL_WEIGHTS)
    try:
        return shape_from_config(config, vit_layers, latent_positions)
    except KeyError as e:
        raise BagelCheckpointError(f"{root / CONFIG}: {e.args[0]} missing") from None
    except (TypeError, ValueError) as e:
        raise BagelCheckpointError(f"{root / CONFIG}: {e}") from None


def shape_from_config(config: dict[str, Any], vit_layers: int, latent_positions: int) -> BagelShape:
    """The shape a ``config.json`` (its ``llm_config`` and ``vit_config`` filled in) gives,
    with the depths the weights hold: ``vit_layers`` SigLIP layers and ``latent_positions``
    rows of the latent position table."""
    llm, vit = config["llm_config"], config["vit_config"]
    max_latent_size = math.isqrt(latent_positions)
    if max_latent_size**2 != latent_positions:
        raise ValueError(f"{LATENT_POSITIONS}: {latent_positions} rows is not a square grid")
    vae_fields: dict[str, Any] = {
        key: tuple(value) if isinstance(value, list) else value
        for key, value in (config.get("vae_config") or {}).items()
        if key in VAEShape.__dataclass_fields__
    }
    return BagelShape(
        llm=LLMShape(
            hidden_size=int(llm["hidden_size"]),
            intermediate_size=int(llm["intermediate_size"]),
            num_layers=int(llm["num_hidden_layers"]),
            num_heads=int(llm["num_attention_heads"]),
            num_kv_heads=int(llm.get("num_key_value_heads", llm["num_attention_heads"])),
            vocab_size=int(llm["vocab_size"]),
            rms_norm_eps=float(llm.get("rms_norm_eps", 1e-6)),
            rope_theta=float(llm.get("rope_theta", 10000.0)),
        ),
        vit=ViTShape(
            hidden_size=int(vit["hidden_size"]),
            intermediate_size=int(vit["intermediate_size"]),
            num_layers=vit_layers,
            num_heads=int(vit["num_attention_heads"]),
            patch_size=int(vit["patch_size"]),
            num_channels=int(vit.get("num_channels", 3)),
            layer_norm_eps=float(vit.get("layer_norm_eps", 1e-6)),
            image_size=int(vit["image_size"]),
        ),
        vae=VAEShape(**vae_fields),
        latent_patch_size=int(config.get("latent_patch_size", 2)),
        max_latent_size=max_latent_size,
        vit_max_num_patch_per_side=int(config.get("vit_max_num_patch_per_side", 70)),
        connector_act=str(config.get("connector_act", "gelu_pytorch_tanh")),
        vae_transform=ImageTransform(*config.get("vae_transform", (1024, 512, 16))),
        vit_transform=ImageTransform(*config.get("vit_transform", (980, 224, 14))),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise BagelCheckpointError(f"{path}: not found (is this a BAGEL checkpoint?)") from None
    except ValueError as e:
        raise BagelCheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BagelCheckpointError(f"{path}: not a JSON object")
    return data


def _depths_from_weights(path: Path) -> tuple[int, int]:
    """(ViT layers, latent positions) as the weights hold them; reads only the header."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            positions = f.get_slice(LATENT_POSITIONS).get_shape()[0]
    except FileNotFoundError:
        raise BagelCheckpointError(f"{path}: not found (is this a BAGEL checkpoint?)") from None
    except Exception as e:  # safetensors raises its own errors for a bad file or name
        raise BagelCheckpointError(f"{path}: {e}") from None
    layers = {
        int(name[len(VIT_LAYER_PREFIX) :].split(".", 1)[0])
        for name in names
        if name.startswith(VIT_LAYER_PREFIX)
    }
    return len(layers), int(positions)
