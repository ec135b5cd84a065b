"""The ``omni-runtime`` command.

Subcommands:
  validate -f FILE [--model M]   print the normalised pipeline, or what is wrong with it
  make-tiny-models DIR           build the tiny LLM and diffusion pipeline (cached per DIR)
  generate --out DIR             send real requests through a diffusion stage proc, write PNGs
  serve -f FILE                  run a whole pipeline locally: stage processes and the router
  stage -f FILE --stages 0,1     serve some stages of a pipeline on TCP ports (a stage pod)
  router -f FILE --replicas ...  the OpenAI-compatible router over stage replicas

Errors a user can fix are printed as one clear message and exit 1; no tracebacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from omni_runtime.config.credentials import API_KEY_FILE_ENV
from omni_runtime.pod_contract import HEALTH_PORT
from omni_runtime.process_logging import drop_torchvision_notice

if TYPE_CHECKING:
    from omni_runtime.config import PipelineConfig
    from omni_runtime.router.auth import ApiKeys

DEFAULT_CACHE_DIR = Path(os.environ.get("OMNI_CACHE_DIR", Path.home() / ".cache" / "omni-operator"))
DEFAULT_MODELS_DIR = DEFAULT_CACHE_DIR / "tiny-models"
# Pipeline files may name the tiny models as $OMNI_TINY_MODELS/llm (examples/ do).
TINY_MODELS_ENV = "OMNI_TINY_MODELS"
_Keys = TypeVar("_Keys")


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
    tiny.add_argument(
        "dir", type=Path, nargs="?", help=f"default: ${TINY_MODELS_ENV}, else {DEFAULT_MODELS_DIR}"
    )
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

    serve = commands.add_parser("serve", help="serve a pipeline locally (stages and router)")
    serve.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    serve.add_argument("--model", help="the model, when the file does not name one")
    serve.add_argument("--host", default="127.0.0.1", help="the router's address")
    serve.add_argument("--port", type=int, default=None, help="default: the pipeline's router.port")
    serve.add_argument("--log-dir", type=Path, help="keep stage logs here (default: a temp dir)")
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    _add_state_dir_argument(serve)
    _add_api_key_argument(serve)
    serve.set_defaults(run=_serve)

    stage = commands.add_parser("stage", help="serve stages of a pipeline (what a stage pod runs)")
    stage.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    stage.add_argument("--model", help="the model, when the file does not name one")
    stage.add_argument("--stages", required=True, help="comma-separated stage ids, e.g. 0,1")
    stage.add_argument("--host", default="0.0.0.0", help="address the stage servers bind")
    stage.add_argument(
        "--port",
        action="append",
        default=[],
        metavar="STAGE=PORT",
        help="a stage server's port (0: any free one); default 52000 + stage id",
    )
    stage.add_argument(
        "--health-port",
        default=str(HEALTH_PORT),
        help="HTTP port for /livez and /readyz, or none",
    )
    stage.add_argument("--ready-file", type=Path, help="write the bound ports here when ready")
    stage.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    stage.add_argument("--startup-timeout", type=float, default=600.0)
    stage.set_defaults(run=_stage)

    router = commands.add_parser("router", help="the OpenAI-compatible router over replicas")
    router.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    router.add_argument("--model", help="the model, when the file does not name one")
    router.add_argument(
        "--replicas",
        action="append",
        default=[],
        metavar="STAGE=HOST:PORT[,...]",
        help="a stage's replica addresses (or OMNI_REPLICAS_<STAGE ID> in the environment)",
    )
    router.add_argument(
        "--discover-namespace",
        metavar="NS",
        help="find replicas from the EndpointSlices of the stages' Services in NS "
        "(or OMNI_DISCOVERY_NAMESPACE)",
    )
    router.add_argument(
        "--stage-service",
        action="append",
        default=[],
        metavar="STAGE=SERVICE",
        help="the Service whose ready endpoints are a stage's replicas, at its port named "
        "stage-<id> (or OMNI_STAGE_SERVICE_<STAGE ID>)",
    )
    router.add_argument("--host", default="0.0.0.0")
    router.add_argument(
        "--port", type=int, default=None, help="default: the pipeline's router.port"
    )
    _add_state_dir_argument(router)
    _add_api_key_argument(router)
    router.set_defaults(run=_router)

    args = parser.parse_args(argv)
    os.environ.setdefault(TINY_MODELS_ENV, str(DEFAULT_MODELS_DIR))
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


def _load(args: argparse.Namespace) -> PipelineConfig:
    from omni_runtime.config import PipelineConfigError, load_pipeline

    try:
        return load_pipeline(args.file, model=args.model)
    except PipelineConfigError as e:
        raise UsageError(f"{args.file}: invalid pipeline:\n{e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {args.file}: {e.strerror}") from None


def _configure_logging() -> None:
    import logging

    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s [%(name)s %(process)d] %(message)s",
    )


def _serve(args: argparse.Namespace) -> int:
    from omni_runtime.entrypoints.serve import run_serve
    from omni_runtime.router.orchestrator import stage_chain

    pipeline = _load(args)
    try:
        stage_chain(pipeline)
    except ValueError as e:
        raise UsageError(f"{args.file}: {e}") from None
    port = args.port if args.port is not None else pipeline.router.port
    return run_serve(
        pipeline,
        host=args.host,
        port=port,
        startup_timeout=args.startup_timeout,
        log_dir=args.log_dir,
        api_keys=_api_keys(args),
        state_dir=args.state_dir,
    )


def _stage(args: argparse.Namespace) -> int:
    from omni_runtime.entrypoints.stage_process import StageProcessOptions, run_stage_process

    pipeline = _load(args)
    known = {stage.stage_id for stage in pipeline.stages}
    try:
        stage_ids = [int(part) for part in args.stages.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--stages: expected stage ids such as 0,1 (got {args.stages!r})"
        ) from None
    unknown = [i for i in stage_ids if i not in known]
    if unknown or not stage_ids:
        raise UsageError(
            f"--stages: no stage {unknown or args.stages!r} in {args.file}; "
            f"stage ids: {', '.join(map(str, sorted(known)))}"
        )
    ports: dict[int, int] = {}
    for item in args.port:
        stage_text, _, port_text = item.partition("=")
        if not (stage_text.isdigit() and port_text.isdigit() and int(port_text) < 65536):
            raise UsageError(f"--port: expected STAGE=PORT such as 0=52000 (got {item!r})")
        ports[int(stage_text)] = int(port_text)
    health_port = None if args.health_port == "none" else _port(args.health_port, "--health-port")
    if args.exit_with_parent:
        _exit_with_parent()
    _configure_logging()
    from omni_runtime.stage_keys import load_server_keys

    keys = _stage_keys(load_server_keys, "the stage sockets admit any peer that reaches them")
    return run_stage_process(
        pipeline,
        stage_ids,
        StageProcessOptions(
            host=args.host,
            ports=ports,
            health_port=health_port,
            ready_file=args.ready_file,
            startup_timeout=args.startup_timeout,
            keys=keys,
        ),
    )


def _add_state_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="where a video pipeline's router keeps its jobs when router.videos.storeUrl "
        "names no Redis (default: ~/.cache/omni-runtime/videos/<model>)",
    )


def _add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=os.environ.get(API_KEY_FILE_ENV) or None,
        help="clients must send one of the keys in this file (one per line, re-read when it "
        "changes) as 'Authorization: Bearer <key>'; or set OMNI_API_KEY (or "
        "OMNI_API_KEY_FILE). Default: no key needed",
    )


def _api_keys(args: argparse.Namespace) -> ApiKeys | None:
    from omni_runtime.config.credentials import API_KEY_ENV
    from omni_runtime.router.auth import ApiKeyError, ApiKeys

    try:
        return ApiKeys.from_settings(args.api_key_file, os.environ.get(API_KEY_ENV) or None)
    except ApiKeyError as e:
        raise UsageError(str(e)) from None


def _stage_keys(load: Callable[[Path], _Keys], unset: str) -> _Keys | None:
    """This role's stage keys from OMNI_STAGE_KEYS_DIR, or None (with a warning) without."""
    import logging

    from omni_runtime.config.credentials import KEYS_DIR_ENV
    from omni_runtime.stage_keys import StageKeysError, keys_directory

    directory = keys_directory(os.environ)
    if directory is None:
        logging.getLogger("omni_runtime").warning("%s is not set: %s", KEYS_DIR_ENV, unset)
        return None
    try:
        return load(directory)
    except StageKeysError as e:
        raise UsageError(str(e)) from None


def _router(args: argparse.Namespace) -> int:
    from omni_runtime.entrypoints.router_process import (
        DiscoveryConfigError,
        ReplicaAddressError,
        run_router,
    )
    from omni_runtime.kube import KubeConfigError
    from omni_runtime.pod_contract import DrainTimeoutError
    from omni_runtime.router.orchestrator import stage_chain

    pipeline = _load(args)
    try:
        stage_chain(pipeline)
    except ValueError as e:
        raise UsageError(f"{args.file}: {e}") from None
    _configure_logging()
    from omni_runtime.stage_keys import load_client_keys

    stage_keys = _stage_keys(
        load_client_keys, "the router connects to stages without a key (they must have none)"
    )
    port = args.port if args.port is not None else pipeline.router.port
    try:
        return run_router(
            pipeline,
            args.replicas,
            host=args.host,
            port=port,
            discover_namespace=args.discover_namespace,
            stage_service_args=args.stage_service,
            stage_keys=stage_keys,
            api_keys=_api_keys(args),
            state_dir=args.state_dir,
        )
    except ReplicaAddressError as e:
        raise UsageError(str(e)) from None
    except (DiscoveryConfigError, DrainTimeoutError, KubeConfigError) as e:
        # Exit 2, like argparse: the router cannot start with these settings.
        print(f"omni-runtime router: error: {e}", file=sys.stderr)
        return 2


def _port(text: str, flag: str) -> int:
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise UsageError(f"{flag}: expected a port number or none (got {text!r})")
    return int(text)


def _exit_with_parent() -> None:
    """SIGTERM this process when its parent exits (``serve`` killed without a chance to
    stop its stages), so that no stage process outlives it."""
    import select
    import signal
    import threading

    parent = os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _make_tiny_models(args: argparse.Namespace) -> int:
    target = args.dir or Path(os.environ[TINY_MODELS_ENV])
    # Before the imports below (torch, transformers, diffusers: a minute on a loaded
    # machine): a directory that cannot be made is an error at once, not after them.
    target.mkdir(parents=True, exist_ok=True)
    from omni_runtime.process_logging import disable_loading_bars
    from omni_runtime.tiny_models import ensure_tiny_models

    disable_loading_bars()

    start = time.perf_counter()
    root = ensure_tiny_models(target)
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
    from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
    from omni_runtime.diffusion.stage.generate import generate
    from omni_runtime.diffusion.stage.inline_stage_diffusion_client import (
        InlineStageDiffusionClient,
    )
    from omni_runtime.diffusion.stage.stage_diffusion_core_client import (
        StageDiffusionCoreClient,
    )
    from omni_runtime.engine.stage.stage_core_client import StageCoreStartupError
    from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest
    from omni_runtime.families import read_checkpoint_family
    from omni_runtime.images import encode_png

    # The whole checkpoint (its own text encoder included), run as its family's pipeline.
    family = read_checkpoint_family(model)
    config = DiffusionEngineConfig(model=model, family=family.name if family else None)
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
