"""``omni-runtime router``: the HTTP router over stage replicas at given addresses.

Replica addresses come from ``--replicas STAGE=HOST:PORT[,HOST:PORT...]`` (repeatable) or
the environment, ``OMNI_REPLICAS_<STAGE ID>=HOST:PORT,...`` (what a pod spec sets). The
router keeps reconnecting to an address whose replica is gone, so a restarted replica
takes traffic again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from omni_runtime.config import PipelineConfig
from omni_runtime.engine.stage.stage_replica_pool import StageReplicaPool
from omni_runtime.router.app import create_app
from omni_runtime.router.protocol import RouterLimits
from omni_runtime.router.replicas import ReplicaConnector

logger = logging.getLogger("omni_runtime.router")

REPLICAS_ENV_PREFIX = "OMNI_REPLICAS_"


class ReplicaAddressError(ValueError):
    """A replica address list that cannot be used; the message says which and why."""


def parse_replica_args(
    pipeline: PipelineConfig, args: Sequence[str], environ: Mapping[str, str]
) -> dict[int, list[str]]:
    """Stage id -> replica addresses, from ``STAGE=HOST:PORT,...`` arguments (a stage id or
    name) and ``OMNI_REPLICAS_<ID>`` variables; arguments win over the environment."""
    by_name = {stage.name: stage.stage_id for stage in pipeline.stages}
    ids = {stage.stage_id for stage in pipeline.stages}
    result: dict[int, list[str]] = {}
    for key, value in environ.items():
        if key.startswith(REPLICAS_ENV_PREFIX) and key[len(REPLICAS_ENV_PREFIX) :].isdigit():
            stage_id = int(key[len(REPLICAS_ENV_PREFIX) :])
            if stage_id in ids:
                result[stage_id] = _addresses(value, key)
    for arg in args:
        stage, sep, value = arg.partition("=")
        if not sep:
            raise ReplicaAddressError(
                f"--replicas {arg!r}: expected STAGE=HOST:PORT[,HOST:PORT...], "
                "e.g. 0=127.0.0.1:52000"
            )
        named = int(stage) if stage.isdigit() else by_name.get(stage)
        if named is None or named not in ids:
            known = ", ".join(f"{s.stage_id} ({s.name})" for s in pipeline.stages)
            raise ReplicaAddressError(f"--replicas {arg!r}: no stage {stage!r}; stages: {known}")
        result[named] = _addresses(value, f"--replicas {arg!r}")
    return result


def _addresses(value: str, where: str) -> list[str]:
    addresses = [part.strip() for part in value.split(",") if part.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ReplicaAddressError(f"{where}: {address!r} is not HOST:PORT")
    return addresses


def build_router(
    pipeline: PipelineConfig,
    addresses: Mapping[int, Sequence[str]],
    *,
    limits: RouterLimits | None = None,
    model_name: str | None = None,
) -> tuple[FastAPI, ReplicaConnector]:
    """The app and the connector that keeps its pools filled (started by the app)."""
    policy = pipeline.router.policy
    pools = {stage.stage_id: StageReplicaPool(stage.name, policy) for stage in pipeline.stages}
    replicas = ReplicaConnector(pools)
    for stage_id, stage_addresses in addresses.items():
        replicas.set_addresses(stage_id, stage_addresses)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(replicas.run(), name="replica-connector")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app = create_app(pipeline, pools, limits=limits, model_name=model_name, lifespan=lifespan)
    app.state.replicas = replicas
    return app, replicas


def run_router(
    pipeline: PipelineConfig,
    replica_args: Sequence[str],
    *,
    host: str,
    port: int,
    limits: RouterLimits | None = None,
) -> int:
    addresses = parse_replica_args(pipeline, replica_args, os.environ)
    missing = [s.name for s in pipeline.stages if not addresses.get(s.stage_id)]
    if missing:
        logger.warning("no replica addresses yet for stage(s): %s", ", ".join(missing))
    app, _ = build_router(pipeline, addresses, limits=limits)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    logger.info(
        "router on http://%s:%d/v1 (model %s)", host, port, app.state.router.served_model_name
    )
    uvicorn.Server(config).run()
    return 0
