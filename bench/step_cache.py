"""Step caching (stepCache tiers, diffusers' TaylorSeer): what each setting saves and costs.

Two tables:

1. Each family's tiny checkpoint through the DiT stage's engine (DiffusionEngine, as a
   stage runs it): DiT ms per image, the steps computed, and the image's PSNR against the
   uncached one, per setting. Random weights change far more from step to step than
   trained ones, so the PSNR here is a floor of the machinery, not the quality a real
   checkpoint gets (cache-dit and TaylorSeer publish theirs on real weights, GPU).
2. Real-sized layers: the family's transformer at its published width (Qwen-Image: 24
   heads of 128, text width 3584; Z-Image: 30 heads of 128, text width 2560) with a few
   blocks instead of 60 / 30, random weights, on this CPU, in the family's own diffusers
   pipeline (prompt embeddings given, the tiny VAE): the compute a setting skips.

    .venv/bin/python bench/step_cache.py [--steps 20] [--size 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from _load import markdown_table
from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
from omni_runtime.diffusion.step_cache import StepCacheTier, computed_steps, step_cache
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.families import FAMILIES
from omni_runtime.tiny_models import QWEN_IMAGE_SUBDIR, Z_IMAGE_SUBDIR, ensure_tiny_models

# The settings measured: diffusers' defaults (TaylorSeerCacheConfig: interval 5, 3 warm-up
# steps, order 1) and tighter and looser ones around them.
SETTINGS = {
    "interval 2, warm-up 2": StepCacheTier(interval=2, warmup_steps=2),
    "interval 3, warm-up 3": StepCacheTier(interval=3, warmup_steps=3),
    "interval 5, warm-up 3 (diffusers' default)": StepCacheTier(interval=5, warmup_steps=3),
    "interval 5, warm-up 3, order 0": StepCacheTier(interval=5, warmup_steps=3, max_order=0),
    "interval 5, warm-up 3, cool-down 2": StepCacheTier(
        interval=5, warmup_steps=3, cooldown_steps=2
    ),
}
SUBDIRS = {"qwen-image": QWEN_IMAGE_SUBDIR, "z-image": Z_IMAGE_SUBDIR}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def timed(run: Callable[[], np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    """The median ms of ``repeat`` runs after one warm-up, and the image."""
    image = run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        image = run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), image


def tiny_table(args: argparse.Namespace) -> str:
    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    rows: list[list[object]] = []
    for family, subdir in SUBDIRS.items():
        engine = DiffusionEngine(
            DiffusionEngineConfig(
                model=str(root / subdir), family=family, step_cache_tiers=dict(SETTINGS)
            )
        )
        counter = iter(range(10**9))

        def run(tier: str, engine: DiffusionEngine = engine, counter: Any = counter) -> np.ndarray:
            request = StageDiffusionCoreRequest(
                request_id=f"r{next(counter)}",
                prompt="a red fox in the snow",
                params={
                    "num_inference_steps": args.steps,
                    "height": args.size,
                    "width": args.size,
                    "seed": 7,
                    "negative_prompt": "blurry",
                    "step_cache": tier,
                },
            )
            engine.admit(request.request_id)
            output = engine.execute(request)
            assert output.images is not None, output.error
            return output.images

        off_ms, off = timed(lambda: run("off"), args.repeat)
        rows.append(
            [family, "off", f"{args.steps}/{args.steps}", f"{off_ms:.0f}", "1.00x", "exact"]
        )
        for name, tier in SETTINGS.items():
            ms, image = timed(lambda name=name: run(name), args.repeat)
            computed = len(computed_steps(tier, args.steps))
            rows.append(
                [
                    family,
                    name,
                    f"{computed}/{args.steps}",
                    f"{ms:.0f}",
                    f"{off_ms / ms:.2f}x",
                    f"{psnr(image, off):.1f}",
                ]
            )
    headers = ["family", "setting", "steps computed", "DiT ms", "speed-up", "PSNR dB"]
    return markdown_table(headers, rows)


def real_width_pipeline(family: str, blocks: int) -> tuple[Any, dict[str, Any]]:
    """The family's diffusers pipeline around a transformer of the published width with
    ``blocks`` blocks (random weights), the tiny checkpoint's VAE and scheduler, and the
    call arguments that give it prompt embeddings of that width."""
    from diffusers import (
        DiffusionPipeline,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    root = ensure_tiny_models(DEFAULT_MODELS_DIR)
    tiny = DiffusionPipeline.from_pretrained(str(root / SUBDIRS[family]), local_files_only=True)
    torch.manual_seed(0)
    tokens = 32
    if family == "qwen-image":
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=blocks,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        ).eval()
        pipeline = QwenImagePipeline(
            transformer=transformer,
            vae=tiny.vae,
            scheduler=tiny.scheduler,
            text_encoder=None,
            tokenizer=None,
        )
        embeds = torch.randn(1, tokens, 3584)
        mask = torch.ones(1, tokens, dtype=torch.long)
        kwargs = {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": torch.randn(1, tokens, 3584),
            "negative_prompt_embeds_mask": mask,
            "true_cfg_scale": 4.0,
        }
    else:
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=3840,
            n_layers=blocks,
            n_refiner_layers=1,
            n_heads=30,
            n_kv_heads=30,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=2560,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[32, 48, 48],
            axes_lens=[1024, 512, 512],
        ).eval()
        pipeline = ZImagePipeline(
            transformer=transformer,
            vae=tiny.vae,
            scheduler=tiny.scheduler,
            text_encoder=None,
            tokenizer=None,
        )
        kwargs = {
            "prompt_embeds": [torch.randn(tokens, 2560)],
            "negative_prompt_embeds": [torch.randn(tokens, 2560)],
            "guidance_scale": 5.0,
        }
    pipeline.set_progress_bar_config(disable=True)
    return pipeline, kwargs


def real_width_table(args: argparse.Namespace) -> str:
    rows: list[list[object]] = []
    for family in SUBDIRS:
        pipeline, kwargs = real_width_pipeline(family, args.blocks)
        modules = FAMILIES[family].dit.step_cache
        assert modules is not None

        def run(
            tier: StepCacheTier | None,
            pipeline: Any = pipeline,
            kwargs: Any = kwargs,
            modules: Any = modules,
        ) -> Any:
            cache: Any = (
                step_cache(
                    pipeline.transformer,
                    tier,
                    args.real_steps,
                    modules.skip,
                    modules.predict,
                    torch.float32,
                )
                if tier is not None
                else _nothing()
            )
            with torch.inference_mode(), cache:
                result = pipeline(
                    height=args.real_size,
                    width=args.real_size,
                    num_inference_steps=args.real_steps,
                    generator=torch.Generator("cpu").manual_seed(0),
                    output_type="np",
                    **kwargs,
                )
            return np.clip(np.round(np.asarray(result.images) * 255), 0, 255).astype(np.uint8)

        off_ms, _ = timed(lambda: run(None), 1)
        steps = args.real_steps
        rows.append([family, "off", f"{steps}/{steps}", f"{off_ms:.0f}", "1.00x", "0%"])
        for name in ("interval 2, warm-up 2", "interval 5, warm-up 3 (diffusers' default)"):
            tier = SETTINGS[name]
            ms, _ = timed(lambda tier=tier: run(tier), 1)
            computed = len(computed_steps(tier, steps))
            rows.append(
                [
                    family,
                    name,
                    f"{computed}/{steps}",
                    f"{ms:.0f}",
                    f"{off_ms / ms:.2f}x",
                    f"{1 - ms / off_ms:.0%}",
                ]
            )
        del pipeline
    headers = ["family", "setting", "steps computed", "DiT ms", "speed-up", "time skipped"]
    return markdown_table(headers, rows)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=2, help="real-width blocks")
    parser.add_argument("--real-steps", type=int, default=10)
    parser.add_argument("--real-size", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"tiny checkpoints, {args.size}x{args.size}, {args.steps} steps, guidance on:\n")
    print(tiny_table(args))
    print(
        f"\nreal-width transformers, {args.blocks} blocks, {args.real_size}x{args.real_size}, "
        f"{args.real_steps} steps, guidance on:\n"
    )
    print(real_width_table(args))


if __name__ == "__main__":
    main()
