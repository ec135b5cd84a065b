"""The ``omni-runtime`` command.

Subcommands:
  validate -f FILE [--model M]   print the normalised pipeline, or what is wrong with it
  make-tiny-models DIR           build the tiny LLM and diffusion pipeline (cached per DIR)
  generate --out DIR             send real requests through a diffusion stage proc, write PNGs

Errors a user can fix are printed as one clear message and exit 1; no tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from omni_runtime.process_logging import drop_torchvision_notice

DEFAULT_CACHE_DIR = Path(os.environ.get("OMNI_CACHE_DIR", Path.home() / ".cache" / "omni-operator"))
DEFAULT_MODELS_DIR = DEFAULT_CACHE_DIR / "tiny-models"


class UsageError(Exception):
    """A problem with what the user asked for; printed without a traceback."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-runtime", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check a pipeline file and print it normalised")
    validate.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    validate.add_argument("--model", help="the model, when the file does not name one")
    validate.set_defaults(run=_validate)

    tiny = commands.add_parser("make-tiny-models", help="build the tiny test models into DIR")
    tiny.add_argument("dir", type=Path, nargs="?", default=DEFAULT_MODELS_DIR)
    tiny.set_defaults(run=_make_tiny_models)

    gen = commands.add_parser("generate", help="generate images through a diffusion stage proc")
    gen.add_argument("--out", type=Path, default=Path("out"), help="where PNGs are written")
    gen.add_argument("--model", help="a local diffusers pipeline directory (default: the tiny one)")
    gen.add_argument("--prompt", action="append", help="repeatable; default: three sample prompts")
    gen.add_argument("--size", default="128x128", help="WIDTHxHEIGHT (default 128x128)")
    gen.add_argument("--steps", type=int, default=10)
    gen.add_argument("--seed", type=int, default=42)
    gen.add_argument("--inline", action="store_true", help="run the engine in this process")
    gen.set_defaults(run=_generate)

    args = parser.parse_args(argv)
    drop_torchvision_notice()
    try:
        result: int = args.run(args)
        return result
    except UsageError as e:
        print(f"omni-runtime: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an unwritable --out, a full disk: the message is the whole story
        print(f"omni-runtime: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from omni_runtime.config import PipelineConfigError, dump_pipeline, load_pipeline

    try:
        config = load_pipeline(args.file, model=args.model)
    except PipelineConfigError as e:
        print(f"{args.file}: invalid pipeline:\n{e}", file=sys.stderr)
        return 1
    except OSError as e:
        raise UsageError(f"cannot read {args.file}: {e.strerror}") from None
    print(yaml.safe_dump(dump_pipeline(config), sort_keys=False), end="")
    return 0


def _make_tiny_models(args: argparse.Namespace) -> int:
    from omni_runtime.tiny_models import ensure_tiny_models

    start = time.perf_counter()
    root = ensure_tiny_models(args.dir)
    print(f"tiny models in {root} ({time.perf_counter() - start:.1f} s)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise UsageError(
            f"--size: expected WIDTHxHEIGHT, e.g. 128x128 (got {args.size!r})"
        ) from None
    model = args.model
    if model is None:
        from omni_runtime.tiny_models import DIFFUSION_SUBDIR, ensure_tiny_models

        model = str(ensure_tiny_models(DEFAULT_MODELS_DIR) / DIFFUSION_SUBDIR)
    elif not Path(model).is_dir():
        raise UsageError(f"--model: {model} is not a directory (a local diffusers pipeline)")
    prompts = args.prompt or [
        "a red cat on a green hydrant",
        "a gold sculpture of a dog",
        "a blue boat under a bright moon",
    ]
    return asyncio.run(_generate_async(args, model, prompts, width, height))


async def _generate_async(
    args: argparse.Namespace, model: str, prompts: list[str], width: int, height: int
) -> int:
    from omni_runtime.diffusion.engine import DiffusionEngineConfig
    from omni_runtime.diffusion.images import encode_png
    from omni_runtime.diffusion.stage.generate import generate
    from omni_runtime.diffusion.stage.inline_stage_diffusion_client import (
        InlineStageDiffusionClient,
    )
    from omni_runtime.diffusion.stage.stage_diffusion_core_client import (
        StageDiffusionCoreClient,
    )
    from omni_runtime.engine.stage.stage_core_client import StageCoreStartupError
    from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest

    config = DiffusionEngineConfig(model=model)
    start = time.perf_counter()
    client: InlineStageDiffusionClient | StageDiffusionCoreClient
    try:
        if args.inline:
            client = InlineStageDiffusionClient(config)
            where = "in this process"
        else:
            client = StageDiffusionCoreClient(config)
            where = f"in proc pid {client.proc_manager.pid}"
    except StageCoreStartupError as e:
        raise UsageError(str(e)) from None
    ready_after = time.perf_counter() - start
    print(f"diffusion stage ready {where} ({ready_after:.1f} s): {json.dumps(client.info)}")
    try:
        requests = [
            StageDiffusionCoreRequest(
                request_id=f"image-{i}",
                prompt=prompt,
                params={
                    "height": height,
                    "width": width,
                    "num_inference_steps": args.steps,
                    "seed": args.seed + i,
                },
            )
            for i, prompt in enumerate(prompts)
        ]
        start = time.perf_counter()
        outputs = await generate(client, requests)
        elapsed = time.perf_counter() - start
    finally:
        client.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for request in requests:
        output = outputs[request.request_id]
        if output.images is None:
            failed += 1
            print(f"{request.request_id}: failed: {output.error}", file=sys.stderr)
            continue
        for n, image in enumerate(output.images):
            path = args.out / f"{request.request_id}-{n}.png"
            path.write_bytes(encode_png(image))
            print(
                f"wrote {path.resolve()}  {image.shape[1]}x{image.shape[0]}  "
                f"{output.execute_time:.2f} s  prompt={request.prompt!r}"
            )
    print(f"{len(requests) - failed}/{len(requests)} requests succeeded in {elapsed:.2f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
