"""What each stage of a split family pipeline holds, against the monolithic pipeline: on
the tiny family checkpoints, measured; for the real models, from their model cards.

Per tiny family, each in a fresh process of its own (so its peak is its own), fp32, after
loading and one request (a 64x64, 4-step image; one prompt encoded):

- pipeline: the whole diffusers pipeline (``DiffusionPipeline.from_pretrained``).
- dit stage: the DiT stage's engine (``DiffusionEngine`` with ``text_from_upstream``: the
  checkpoint loaded with ``text_encoder=None, tokenizer=None``, ``processor=None`` for the
  edit family), fed random embeddings of its conditioning width.
- encoder, transformers: the checkpoint's text encoder alone (``transformer=None,
  vae=None``), its ``encode_prompt`` once.
- encoder, vLLM: the encoder stage as a stage process runs it (``start_stage_llm_client``
  behind ``StageLLMFrontend``), one prompt encoded and put into the connector: the peak RSS
  (VmHWM) of that process and of its vLLM core process (the core's includes the KV cache
  it allocated, VLLM_CPU_KVCACHE_SPACE GiB at most).
- baseline: a process with torch, transformers and diffusers imported, nothing loaded.

Parameter bytes: the parameters of the torch modules the process holds (buffers left out).
Then a table of bf16 GB per stage for the real models, from the parameter counts their
model cards publish (not measured).

    .venv/bin/python bench/family_memory.py [--family qwen-image --family z-image]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from _load import markdown_table
from omni_runtime.families import FAMILIES, FAMILY_NAMES, prompt_image_size

MIB = 1 << 20
KINDS = ("pipeline", "dit", "encoder-transformers", "encoder-vllm")
PROMPT = "a red cat on a green hydrant"
# Billions of parameters, as the model cards publish them.
REAL = {
    "qwen-image": {
        "encoder": ("Qwen2.5-VL-7B", 8.29),
        "dit": ("MMDiT", 20.4),
        "vae": ("VAE", 0.13),
    },
    "z-image": {"encoder": ("Qwen3-4B", 4.02), "dit": ("S3-DiT", 6.15), "vae": ("VAE", 0.08)},
}


def param_bytes(modules: Any) -> int:
    import torch

    return sum(
        p.numel() * p.element_size()
        for module in modules
        if isinstance(module, torch.nn.Module)
        for p in module.parameters()
    )


def vm_hwm(pid: int | str = "self") -> int:
    """A process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def edit_image() -> Any:
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)


# -- the children: one thing loaded and used once ---------------------------------------------


def child_pipeline(family: str, root: Path) -> dict[str, int]:
    import torch
    from PIL import Image

    from family_encoder import monolithic

    pipeline = monolithic(family, root)
    kwargs: dict[str, Any] = {"negative_prompt": "blurry", "num_inference_steps": 4}
    if FAMILIES[family].dit.takes_image:
        kwargs["image"] = Image.fromarray(edit_image())
    with torch.inference_mode():
        pipeline(prompt=PROMPT, height=64, width=64, **kwargs)
    return {"params": param_bytes(pipeline.components.values())}


def child_dit(family: str, root: Path) -> dict[str, int]:
    import numpy as np

    from omni_runtime.diffusion.engine import DiffusionEngine, DiffusionEngineConfig
    from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest

    config = DiffusionEngineConfig(model=str(root / family), family=family, text_from_upstream=True)
    engine = DiffusionEngine(config)
    rng = np.random.default_rng(0)
    embeds = rng.standard_normal((24, engine.conditioning_width)).astype(np.float32)
    takes_image = FAMILIES[family].dit.takes_image
    request = StageDiffusionCoreRequest(
        request_id="memory",
        prompt_embeds=embeds,
        negative_prompt_embeds=embeds,
        images=[edit_image()] if takes_image else [],
        params={"num_inference_steps": 4, "height": 64, "width": 64},
    )
    engine.admit("memory")
    output = engine.execute(request)
    if output.error is not None:
        raise RuntimeError(output.error.message)
    return {"params": param_bytes(engine.pipeline.components.values())}


def child_encoder_transformers(family: str, root: Path) -> dict[str, int]:
    import torch
    from PIL import Image

    from family_encoder import monolithic

    pipeline = monolithic(family, root, transformer=None, vae=None)
    kwargs: dict[str, Any] = {"device": "cpu"}
    area = FAMILIES[family].encoder.image_area
    if area is not None:  # resized as the edit pipeline's __call__ resizes it
        picture = Image.fromarray(edit_image())
        width, height = prompt_image_size(picture.width, picture.height, area)
        kwargs["image"] = [pipeline.image_processor.resize(picture, height, width)]
    if family == "z-image":
        kwargs["do_classifier_free_guidance"] = False
    with torch.inference_mode():
        pipeline.encode_prompt(prompt=PROMPT, **kwargs)
    return {"params": param_bytes([pipeline.text_encoder])}


def child_encoder_vllm(family: str, root: Path) -> dict[str, int]:
    import asyncio

    from family_encoder import example
    from omni_runtime.engine.stage.stage_core_types import StageServerRequest
    from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
    from omni_runtime.stage_server.frontend import StageConnectors
    from omni_runtime.stage_server.llm_frontend import StageLLMFrontend

    pipeline = example(family, root)
    stage = pipeline.stages[0]
    client = start_stage_llm_client(stage, pipeline.model, encoder=FAMILIES[family].encoder)
    connectors = StageConnectors(pipeline.connectors)
    frontend = StageLLMFrontend(pipeline, stage, client, connectors)
    images = [edit_image()] if FAMILIES[family].encoder.takes_image else []

    async def encode() -> None:
        request = StageServerRequest(
            request_id="memory",
            prompt=PROMPT,
            images=images,
            output_connector="shared_memory_connector",
        )
        if refused := await frontend.add(request):
            raise RuntimeError(f"refused: {refused[0].error}")
        while not any(o.finished for o in await frontend.next_outputs()):
            pass

    try:
        asyncio.run(encode())
        assert client.proc_manager is not None
        core = vm_hwm(client.proc_manager.processes[0].pid)
    finally:
        client.shutdown()
        connectors.close()
    return {"core_peak": core}


def child(kind: str, family: str) -> None:
    from family_encoder import tiny_root

    root = tiny_root()
    if kind == "baseline":
        import diffusers
        import torch
        import transformers

        del diffusers, torch, transformers
        result: dict[str, int] = {}
    else:
        run = {
            "pipeline": child_pipeline,
            "dit": child_dit,
            "encoder-transformers": child_encoder_transformers,
            "encoder-vllm": child_encoder_vllm,
        }[kind]
        result = run(family, root)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({**result, "peak": max(peak, vm_hwm())}))


# -- the parent: children one after another, then the tables ---------------------------------


def measure(kind: str, family: str) -> dict[str, int]:
    env = {
        **os.environ,
        "TRANSFORMERS_VERBOSITY": "error",
        "DIFFUSERS_VERBOSITY": "error",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    command = [sys.executable, __file__, "--child", kind, family]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {family} failed:\n{done.stderr[-3000:]}")
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def real_table() -> str:
    rows: list[list[object]] = []
    for family, parts in REAL.items():
        encoder, dit, vae = (parts[k] for k in ("encoder", "dit", "vae"))
        for stage, members in (
            ("monolithic pipeline", (encoder, dit, vae)),
            ("encoder stage", (encoder,)),
            ("DiT stage (DiT + VAE)", (dit, vae)),
        ):
            billions = sum(count for _, count in members)
            names = " + ".join(f"{name} {count}B" for name, count in members)
            rows.append([family, stage, names, f"{billions * 2:.2f}"])
    return markdown_table(["family", "stage", "parameters", "bf16 GB (1e9 B)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", action="append", choices=FAMILY_NAMES, help="repeatable")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "FAMILY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    baseline = measure("baseline", "qwen-image")["peak"]
    print(
        f"\nTiny checkpoints, fp32, peak RSS (MiB) of a process after loading and one request;"
        f" baseline (torch, transformers, diffusers imported, nothing loaded): "
        f"{mib(baseline)} MiB\n"
    )
    rows: list[list[object]] = []
    for family in args.family or list(FAMILY_NAMES):
        for kind in KINDS:
            print(f"{family}: {kind}", file=sys.stderr, flush=True)
            found = measure(kind, family)
            params = found.get("params")
            core = found.get("core_peak")
            extra = "" if core is None else f"{mib(core)} (its vLLM core)"
            peak = found["peak"]
            rows.append([family, kind, mib(params), mib(peak), mib(peak - baseline), extra])
    headers = ["family", "process", "param MiB", "peak RSS MiB", "above baseline", "also"]
    print(markdown_table(headers, rows))
    print("\nReal models, bf16, from model cards, not measured (Qwen-Image-Edit: Qwen-Image's)\n")
    print(real_table())


if __name__ == "__main__":
    main()
