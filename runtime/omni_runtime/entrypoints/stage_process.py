"""``omni-runtime stage``: what a stage pod runs, and what ``serve`` runs per replica.

Starts the core of each named stage (through its proc manager), serves each on a TCP port
(StageServer) and answers kubelet probes on an HTTP port. When it is ready, it writes
``{"pid": ..., "stages": {"<stage id>": <port>, ...}}`` to ``--ready-file`` (atomically),
so that a parent that asked for ephemeral ports learns them without racing.

SIGTERM/SIGINT drain it, then stop it: /readyz answers 503 at once (the EndpointSlice
marks the pod not ready), every connected router is told the replica is draining (so it
sends nothing new, without waiting for the EndpointSlice), requests not started are handed
back for the router to run elsewhere, and those in execution finish, for at most
``OMNI_DRAIN_TIMEOUT_S`` seconds (default 30); then the cores stop and
the process exits 0. A second signal skips what is left of the drain. The death of a
stage's core ends the process with exit code 1 and the reason on stderr (Kubernetes
restarts the pod; routers evict the replica when its connection drops).

Each stage advertises the pipeline revision it runs (``OMNI_PIPELINE_REVISION``, which
the operator sets on every stage pod; without it, ``0-<hash of the config>``, the same for
every replica that ``serve`` starts from one config file): see ``router.revisions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from omni_runtime import tracing
from omni_runtime.config import (
    STEP_CACHE_OFF,
    PipelineConfig,
    StageConfig,
    dump_pipeline,
    stage_port,
)
from omni_runtime.connectors import ConnectorError, StageConnectors
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreStartupError
from omni_runtime.families import EncoderRecipe
from omni_runtime.pod_contract import (
    HEALTH_PORT,
    REVISION_ENV,
    STAGE_CUDA_DEVICES_ENV_PREFIX,
    DrainTimeoutError,
    drain_timeout_from_env,
)
from omni_runtime.router.revisions import local_revision
from omni_runtime.stage_keys import StageServerKeys
from omni_runtime.stage_server.frontend import StageFrontend, stage_connector_names
from omni_runtime.stage_server.probes import start_probe_server
from omni_runtime.stage_server.server import StageServer

if TYPE_CHECKING:
    from omni_runtime.diffusion.engine_base import DiffusionEngineConfig

logger = logging.getLogger("omni_runtime.stage")

# vLLM's CPU build refuses to start without a KV cache size; 1 GiB serves small models.
_DEFAULT_CPU_KVCACHE_GIB = "1"


class StageStartError(RuntimeError):
    """A stage that could not start; the message says which and why."""


@dataclass(frozen=True)
class StageProcessOptions:
    host: str = "0.0.0.0"
    # stage id -> port; a stage not named takes config.stage_port(its id), 0 = any.
    ports: dict[int, int] | None = None
    health_host: str = "0.0.0.0"
    health_port: int | None = HEALTH_PORT
    ready_file: Path | None = None
    startup_timeout: float = 300.0
    # None: OMNI_DRAIN_TIMEOUT_S, else pod_contract.DEFAULT_DRAIN_TIMEOUT_S.
    drain_timeout: float | None = None
    # None: OMNI_PIPELINE_REVISION, else the config's local revision.
    revision: str | None = None
    # The pipeline's stage keys (CURVE); None: the stage sockets admit any peer.
    keys: StageServerKeys | None = None


def resolve_revision(pipeline: PipelineConfig, environ: Mapping[str, str]) -> str:
    """The revision this process advertises: the environment's, else the config's own."""
    given = environ.get(REVISION_ENV, "").strip()
    if given:
        return given
    return local_revision(json.dumps(dump_pipeline(pipeline), sort_keys=True))


def resolve_drain_timeout(environ: Mapping[str, str]) -> float:
    """OMNI_DRAIN_TIMEOUT_S (seconds, >= 0), else the default; StageStartError if bad."""
    try:
        return drain_timeout_from_env(environ)
    except DrainTimeoutError as e:
        raise StageStartError(str(e)) from None


def resolve_model(model: str) -> str:
    """A model path as written in a pipeline, with ``~`` and ``$VARS`` expanded."""
    return os.path.expanduser(os.path.expandvars(model))


def _is_hub_id(model: str) -> bool:
    return not os.path.isdir(model) and not model.startswith(("/", ".", "~"))


def fetch_encoder_files(hub_id: str, encoder: EncoderRecipe) -> str:
    """The local snapshot of the parts of a family's checkpoint its encoder stage loads
    (the text encoder and its tokenizer or processor), fetched into HF_HOME if not there."""
    from huggingface_hub import snapshot_download

    if encoder.context_kv:
        # BAGEL's thinker reads the whole checkpoint's layout (its configs and weights);
        # the DiT beside it fetches the same files.
        patterns = None
    else:
        folders = (encoder.text_encoder_subfolder, encoder.tokenizer_subfolder)
        patterns = ["model_index.json", *(f"{folder}/*" for folder in folders)]
    path: str = snapshot_download(hub_id, allow_patterns=patterns)
    return path


def diffusion_engine_config(
    pipeline: PipelineConfig, stage: StageConfig, model: str
) -> DiffusionEngineConfig:
    """What the core of diffusion stage ``stage`` loads ``model`` (a local path or hub id)
    with."""
    from omni_runtime.diffusion.engine_base import DiffusionEngineConfig
    from omni_runtime.diffusion.step_cache import StepCacheTier

    cache = stage.step_cache
    return DiffusionEngineConfig(
        model=model,
        dtype=stage.dtype or "auto",
        default_params=dict(stage.default_sampling_params),
        device="cpu" if stage.devices == "cpu" else "auto",
        gpu_memory_utilization=stage.gpu_memory_utilization,
        family=pipeline.family,
        text_from_upstream=bool(stage.input_connectors),
        connectors={
            name: connector.model_dump(mode="json")
            for name, connector in pipeline.connectors.items()
        },
        step_cache_tiers={
            name: StepCacheTier(**tier.model_dump(by_alias=False))
            for name, tier in cache.tiers.items()
        }
        if cache is not None
        else {},
        step_cache_default=cache.default if cache is not None else STEP_CACHE_OFF,
        max_batch=stage.max_num_seqs or 1,
        torch_compile=bool(stage.torch_compile),
        num_threads=stage.num_threads,
        max_loras=pipeline.adapter_capacity(stage),
    )


def start_frontend(
    pipeline: PipelineConfig,
    stage: StageConfig,
    connectors: StageConnectors,
    startup_timeout: float,
) -> StageFrontend:
    """Start ``stage``'s core and wrap its client; StageStartError if it cannot start."""
    model = resolve_model(pipeline.stage_model(stage))
    visible = os.environ.get(f"{STAGE_CUDA_DEVICES_ENV_PREFIX}{stage.stage_id}")
    if visible is not None:
        # The engine runs in a child process, which takes the environment as it is now.
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    # Made now, so that a connector whose backend is missing stops the stage at start
    # with what to install, not its first request.
    for name in sorted(stage_connector_names(pipeline, stage)):
        try:
            connectors.get(name)
        except ConnectorError as e:
            raise StageStartError(f"stage {stage.name!r}: connector {name!r}: {e}") from None
    client: StageCoreClientBase
    try:
        if stage.type == "llm":
            if stage.devices == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = _DEFAULT_CPU_KVCACHE_GIB
            from omni_runtime.engine.stage.stage_llm_core_client import start_stage_llm_client
            from omni_runtime.engine.stage.stage_llm_engine_config import StageLLMConfigError
            from omni_runtime.stage_server.llm_frontend import StageLLMFrontend

            try:
                encoder = pipeline.encoder_recipe(stage)
                if encoder is not None and stage.model is None and _is_hub_id(model):
                    model = fetch_encoder_files(model, encoder)
                llm_client = start_stage_llm_client(
                    stage,
                    model,
                    encoder=encoder,
                    speech=pipeline.speech_stage(stage),
                    adapter_capacity=pipeline.adapter_capacity(stage),
                    # A traced stage's spans need the core's scheduling events.
                    log_stats=tracing.enabled(),
                    startup_timeout=startup_timeout,
                    connectors=pipeline.connectors,
                )
            except StageLLMConfigError as e:
                raise StageStartError(f"stage {stage.name!r}: {e}") from None
            return StageLLMFrontend(pipeline, stage, llm_client, connectors)
        from omni_runtime.diffusion.stage.stage_diffusion_core_client import (
            StageDiffusionCoreClient,
        )
        from omni_runtime.stage_server.diffusion_frontend import StageDiffusionFrontend

        if not os.path.isdir(model) and not _is_hub_id(model):
            raise StageStartError(
                f"stage {stage.name!r}: model {model} is not a directory (a diffusion stage "
                "loads a local diffusers pipeline, or one by its hub id, org/name)"
            )
        config = diffusion_engine_config(pipeline, stage, model)
        client = StageDiffusionCoreClient(config, startup_timeout=startup_timeout)
        return StageDiffusionFrontend(pipeline, stage, client, connectors)
    except StageCoreStartupError as e:
        raise StageStartError(f"stage {stage.name!r} did not start: {e}") from None


def run_stage_process(
    pipeline: PipelineConfig, stage_ids: Sequence[int], options: StageProcessOptions
) -> int:
    """Start, serve and stop the stages ``stage_ids`` of ``pipeline``; the exit code."""
    from omni_runtime.connectors.shared_memory import sweep_orphaned_segments

    stages = [pipeline.stage(stage_id) for stage_id in stage_ids]
    try:
        options = dataclasses.replace(
            options,
            drain_timeout=(
                options.drain_timeout
                if options.drain_timeout is not None
                else resolve_drain_timeout(os.environ)
            ),
            revision=options.revision or resolve_revision(pipeline, os.environ),
        )
    except StageStartError as e:
        print(f"omni-runtime stage: error: {e}", file=sys.stderr)
        return 1
    tracing.configure(tracing.stage_service_name(stage.name for stage in stages))
    removed = sweep_orphaned_segments()
    if removed:
        logger.info("removed %d shared-memory segment(s) left by dead processes", removed)
    connectors = StageConnectors(pipeline.connectors)
    frontends: list[StageFrontend] = []
    # Stop signals that arrive while models load end the process without a traceback.
    stopping: list[int] = []

    def stop_during_startup(signum: int, _frame: object) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, stop_during_startup) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for stage in stages:
            start = time.perf_counter()
            frontends.append(start_frontend(pipeline, stage, connectors, options.startup_timeout))
            logger.info(
                "stage %d %r (%s) ready in %.1f s",
                stage.stage_id,
                stage.name,
                stage.type,
                time.perf_counter() - start,
            )
    except KeyboardInterrupt:
        _shutdown(frontends, connectors)
        return 0
    except StageStartError as e:
        _shutdown(frontends, connectors)
        print(f"omni-runtime stage: error: {e}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    try:
        # uvloop, as the router's uvicorn and vLLM's server run: its loop costs less CPU per
        # message than asyncio's, and a stage server's work is mostly messages.
        return uvloop.run(_serve(frontends, options))
    finally:
        _shutdown(frontends, connectors)


async def _serve(frontends: list[StageFrontend], options: StageProcessOptions) -> int:
    ports = options.ports or {}
    servers = [
        StageServer(
            frontend,
            host=options.host,
            port=ports.get(frontend.stage.stage_id, stage_port(frontend.stage.stage_id)),
            revision=options.revision or "",
            keys=options.keys,
        )
        for frontend in frontends
    ]
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)

    def readiness() -> dict[str, str | None]:
        return {
            server.stage.name: server.dead_reason or ("draining" if server.draining else None)
            for server in servers
        }

    probes = None
    if options.health_port is not None:
        probes = await start_probe_server(options.health_host, options.health_port, readiness)
    serving: dict[asyncio.Task[Any], StageServer] = {
        asyncio.create_task(server.serve()): server for server in servers
    }
    for server in servers:
        logger.info(
            "stage %d %r serving on %s:%d (revision %s)",
            server.stage.stage_id,
            server.stage.name,
            options.host,
            server.port,
            server.revision,
        )
    if options.ready_file is not None:
        _write_ready_file(options.ready_file, {str(s.stage.stage_id): s.port for s in servers})
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({stopped, *serving}, return_when=asyncio.FIRST_COMPLETED)
        exit_code = 0
        if stopped in done:
            await _drain(servers, options.drain_timeout or 0.0, hurry)
        for task in done:
            if task is stopped:
                continue
            server = serving[task]
            reason = task.result() if not task.cancelled() else "cancelled"
            print(
                f"omni-runtime stage: error: stage {server.stage.name!r} stopped: {reason}",
                file=sys.stderr,
            )
            exit_code = 1
        return exit_code
    finally:
        for task in (stopped, *serving):
            task.cancel()
        await asyncio.gather(stopped, *serving, return_exceptions=True)
        if probes is not None:
            probes.close()
        for server in servers:
            server.close()


async def _drain(servers: list[StageServer], timeout: float, hurry: asyncio.Event) -> None:
    """Drain every live server at once, for at most ``timeout`` seconds (or until
    ``hurry``: a second stop signal)."""
    start = time.perf_counter()
    held = sum(server.held for server in servers)
    logger.info("draining: %d request(s) held; at most %.0f s", held, timeout)
    draining: asyncio.Future[list[bool]] = asyncio.gather(
        *(server.drain(timeout) for server in servers if server.alive)
    )
    hurried: asyncio.Future[Any] = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait({draining, hurried}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
    if not draining.done():
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)
        logger.warning("drain cut short by a second stop signal")
        return
    complete = all(draining.result())
    logger.info(
        "drained in %.1f s%s",
        time.perf_counter() - start,
        "" if complete else " (some requests failed at the drain timeout)",
    )


def _write_ready_file(path: Path, ports: dict[str, int]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "stages": ports}))
    tmp.replace(path)


def _shutdown(frontends: list[StageFrontend], connectors: StageConnectors) -> None:
    for frontend in frontends:
        with contextlib.suppress(Exception):
            frontend.shutdown()
    connectors.close()
