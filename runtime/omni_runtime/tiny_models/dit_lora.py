"""Tiny LoRA adapters of the tiny Z-Image DiT, in diffusers' LoRA format.

Each is made the way a trainer makes one (PEFT's ``LoraConfig`` on the transformer) and
saved with ``ZImagePipeline.save_lora_weights``: ``transformer.``-prefixed PEFT keys and the
adapter's config in the safetensors header, which diffusers reads back. A fresh LoRA's B
matrices are zeros (it changes nothing); these draw A and B from a fixed seed, large enough
that an image made with one differs visibly from one made without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from ._common import SEED

__all__ = ["DIT_LORAS", "DitLora", "build_dit_loras"]


class DitLora(NamedTuple):
    """One adapter: its rank, its LoRA alpha (scaling alpha/rank), the DiT modules it
    adapts (PEFT's target_modules: name suffixes), and the seed of its weights."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int


# By name (the file is <name>.safetensors). Ranks, alphas and modules differ, so that a mix
# of them in one engine's cache exercises adapters of different shapes; ink's alpha is not
# its rank, so a loader that drops the saved config (and scales by 1) makes another image.
DIT_LORAS: dict[str, DitLora] = {
    "z-image-ink": DitLora(4, 8, ("to_q", "to_k", "to_v", "to_out.0"), SEED + 60),
    "z-image-neon": DitLora(8, 8, ("w1", "w2", "w3"), SEED + 61),
    "z-image-mono": DitLora(2, 2, ("to_out.0", "w2"), SEED + 62),
}
# The spread of the drawn weights: B * A adds about this much relative change per layer.
_STD = 0.25


def build_dit_loras(out_dir: Path, pipeline_dir: Path) -> dict[str, Path]:
    """Write each of DIT_LORAS for the Z-Image checkpoint at ``pipeline_dir`` (its
    ``transformer/``) into ``out_dir``; their paths by name. The same bytes every time."""
    import torch
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, lora in DIT_LORAS.items():
        # A fresh transformer per adapter: PEFT's layers stay out of the next one's.
        transformer = ZImageTransformer2DModel.from_pretrained(
            pipeline_dir / "transformer", dtype=torch.float32
        )
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=list(lora.targets),
            init_lora_weights=False,
        )
        transformer.add_adapter(config, adapter_name=name)
        weights: dict[str, Any] = get_peft_model_state_dict(transformer, adapter_name=name)
        generator = torch.Generator().manual_seed(lora.seed)
        state = {}
        for key in sorted(weights):
            value = weights[key]
            # Scaled by fan-in, so a layer's change is about _STD of its input whatever
            # its width.
            scale = _STD / max(1, value.shape[1]) ** 0.5
            state[key] = (torch.randn(value.shape, generator=generator) * scale).contiguous()
        ZImagePipeline.save_lora_weights(
            out_dir,
            transformer_lora_layers=state,
            weight_name=f"{name}.safetensors",
            transformer_lora_adapter_metadata=_metadata(config),
        )
        paths[name] = out_dir / f"{name}.safetensors"
    return paths


def _metadata(config: Any) -> dict[str, Any]:
    """The adapter's LoraConfig as diffusers saves it, with what differs between runs or
    PEFT versions left out so the file's bytes stay the same."""
    metadata: dict[str, Any] = config.to_dict()
    metadata.pop("peft_version", None)
    # A set in PEFT's config: ordered here, so the header's JSON is the same every run.
    metadata["target_modules"] = sorted(metadata["target_modules"])
    return metadata
