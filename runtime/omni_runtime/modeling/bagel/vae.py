"""BAGEL's VAE: FLUX's autoencoder, run as diffusers' AutoencoderKL.

BAGEL ships FLUX's autoencoder as ``ae.safetensors`` in Black Forest Labs' naming
(``encoder.down.0.block.0.norm1.weight``, ``decoder.up.3.upsample.conv.weight``,
``encoder.mid.attn_1.q.weight`` as a 1x1 convolution). :func:`diffusers_state_dict` maps
those names onto an AutoencoderKL of the same shape (four resolutions, no quant convs, one
attention head in the middle blocks), and :class:`FluxVAE` applies FLUX's latent scale and
shift, which AutoencoderKL leaves to its pipelines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import VAEShape

_RESNET = {"nin_shortcut": "conv_shortcut"}
_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def diffusers_name(name: str, levels: int) -> str:
    """The AutoencoderKL parameter name of a BFL autoencoder parameter ``name``."""
    side, rest = name.split(".", 1)
    if m := re.fullmatch(r"(down|up)\.(\d+)\.block\.(\d+)\.(\w+)\.(weight|bias)", rest):
        kind, level, block, part, leaf = m.groups()
        index = int(level) if kind == "down" else levels - 1 - int(level)
        return f"{side}.{kind}_blocks.{index}.resnets.{block}.{_RESNET.get(part, part)}.{leaf}"
    if m := re.fullmatch(r"(down|up)\.(\d+)\.(downsample|upsample)\.conv\.(weight|bias)", rest):
        kind, level, which, leaf = m.groups()
        index = int(level) if kind == "down" else levels - 1 - int(level)
        return f"{side}.{kind}_blocks.{index}.{which}rs.0.conv.{leaf}"
    if m := re.fullmatch(r"mid\.block_(\d)\.(\w+)\.(weight|bias)", rest):
        block, part, leaf = m.groups()
        return f"{side}.mid_block.resnets.{int(block) - 1}.{_RESNET.get(part, part)}.{leaf}"
    if m := re.fullmatch(r"mid\.attn_1\.(\w+)\.(weight|bias)", rest):
        part, leaf = m.groups()
        return f"{side}.mid_block.attentions.0.{_ATTENTION[part]}.{leaf}"
    if m := re.fullmatch(r"norm_out\.(weight|bias)", rest):
        return f"{side}.conv_norm_out.{m.group(1)}"
    return name  # conv_in, conv_out: the same names


def bfl_name(name: str, levels: int) -> str:
    """The inverse of :func:`diffusers_name`."""
    side, rest = name.split(".", 1)
    resnet = {v: k for k, v in _RESNET.items()}
    attention = {v: k for k, v in _ATTENTION.items()}
    if m := re.fullmatch(r"(down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.(weight|bias)", rest):
        kind, index, block, part, leaf = m.groups()
        level = int(index) if kind == "down" else levels - 1 - int(index)
        return f"{side}.{kind}.{level}.block.{block}.{resnet.get(part, part)}.{leaf}"
    if m := re.fullmatch(
        r"(down|up)_blocks\.(\d+)\.(downsample|upsample)rs\.0\.conv\.(weight|bias)", rest
    ):
        kind, index, which, leaf = m.groups()
        level = int(index) if kind == "down" else levels - 1 - int(index)
        return f"{side}.{kind}.{level}.{which}.conv.{leaf}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(\w+)\.(weight|bias)", rest):
        block, part, leaf = m.groups()
        return f"{side}.mid.block_{int(block) + 1}.{resnet.get(part, part)}.{leaf}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(\w+(?:\.0)?)\.(weight|bias)", rest):
        part, leaf = m.groups()
        return f"{side}.mid.attn_1.{attention[part]}.{leaf}"
    if m := re.fullmatch(r"conv_norm_out\.(weight|bias)", rest):
        return f"{side}.norm_out.{m.group(1)}"
    return name


def diffusers_state_dict(bfl: Mapping[str, Tensor], levels: int) -> dict[str, Tensor]:
    """A BFL autoencoder state dict in AutoencoderKL's names and shapes."""
    out = {}
    for name, tensor in bfl.items():
        new = diffusers_name(name, levels)
        if ".attentions.0.to_" in new and new.endswith(".weight") and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0]  # a 1x1 convolution is a linear map
        out[new] = tensor
    return out


def build_autoencoder(shape: VAEShape) -> Any:
    from diffusers import AutoencoderKL

    channels = tuple(shape.ch * m for m in shape.ch_mult)
    levels = len(channels)
    return AutoencoderKL(
        in_channels=shape.in_channels,
        out_channels=shape.out_ch,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=channels,
        layers_per_block=shape.num_res_blocks,
        latent_channels=shape.z_channels,
        norm_num_groups=32,
        scaling_factor=shape.scale_factor,
        shift_factor=shape.shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


def bfl_state_dict(diffusers: Mapping[str, Tensor], levels: int) -> dict[str, Tensor]:
    """An AutoencoderKL state dict in BFL's names and shapes (how a checkpoint ships it)."""
    out = {}
    for name, tensor in diffusers.items():
        if ".attentions.0.to_" in name and name.endswith(".weight") and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]
        out[bfl_name(name, levels)] = tensor
    return out


class FluxVAE:
    """Images in [-1, 1] to FLUX latents and back (latents scaled and shifted as FLUX's)."""

    def __init__(self, autoencoder: Any, shape: VAEShape) -> None:
        self.autoencoder = autoencoder
        self.shape = shape

    @classmethod
    def load(cls, path: str | Path, shape: VAEShape, dtype: torch.dtype, device: str) -> FluxVAE:
        from safetensors.torch import load_file

        autoencoder = build_autoencoder(shape)
        state = diffusers_state_dict(load_file(str(path)), len(shape.ch_mult))
        autoencoder.load_state_dict(state, strict=True)
        autoencoder.to(device=device).eval()
        if dtype != torch.float32:  # built in float32; a cast warns even when a no-op
            autoencoder.to(dtype=dtype)
        return cls(autoencoder, shape)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.autoencoder.parameters()).dtype

    def encode(self, pixels: Tensor, noise: Tensor) -> Tensor:
        """[3, H, W] in [-1, 1] -> a latent [z, H/8, W/8] drawn from the encoder's
        distribution (its mean plus its deviation times ``noise``, [1, z, H/8, W/8]), as
        FLUX's encoder samples it; scaled and shifted."""
        moments = self.autoencoder.encoder(pixels[None].to(self.dtype))
        mean, logvar = moments.chunk(2, dim=1)
        if noise.shape != mean.shape:
            raise ValueError(
                f"VAE noise of shape {list(noise.shape)}; the sample needs {list(mean.shape)}"
            )
        latent = mean + torch.exp(0.5 * logvar) * noise.to(mean.device, mean.dtype)
        return ((latent - self.shape.shift_factor) * self.shape.scale_factor)[0]

    def decode(self, latent: Tensor) -> Tensor:
        """A latent [z, h, w] -> an image [3, 8h, 8w] in [-1, 1] (unclamped)."""
        z = latent[None].to(self.dtype) / self.shape.scale_factor + self.shape.shift_factor
        return self.autoencoder.decode(z).sample[0]
