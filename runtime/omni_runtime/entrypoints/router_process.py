"""``omni-runtime router``: the HTTP router over stage replicas at given addresses.

Replica addresses come from ``--replicas STAGE=HOST:PORT[,HOST:PORT...]`` (repeatable) or
the environment, ``OMNI_REPLICAS_<STAGE ID>=HOST:PORT,...`` (what a pod spec sets). The
router keeps reconnecting to an address whose replica is gone, so a restarted replica
takes traffic again.

In a cluster, ``--discover-namespace NS --stage-service STAGE=SERVICE`` (or
``OMNI_DISCOVERY_NAMESPACE`` and ``OMNI_STAGE_SERVICE_<STAGE ID>``) has the router follow
the EndpointSlices of each stage's Service instead: replicas come and go with their pods'
readiness (``omni_runtime.router.discovery``).

SIGTERM/SIGINT stop it gracefully (uvicorn's shutdown): it stops listening at once (its
readiness probe fails, so the Service stops sending it clients), finishes the HTTP
requests in flight for at most ``OMNI_DRAIN_TIMEOUT_S`` seconds (default 30), then closes
its replica pools and exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig
from omni_runtime.config.names import is_dns_label
from omni_runtime.kube import KubeClient, KubeConfig, load_kube_config
from omni_runtime.pod_contract import drain_timeout_from_env
from omni_runtime.router.app import create_app
from omni_runtime.router.auth import PROBE_PATHS, ApiKeys
from omni_runtime.router.discovery import EndpointSliceDiscovery
from omni_runtime.router.http_limits import descriptor_shortfall, guarded_http_protocol
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.replicas import ReplicaConnector
from omni_runtime.router.stage_replica_pool import StageReplicaPool
from omni_runtime.stage_keys import StageClientKeys

logger = logging.getLogger("omni_runtime.router")

REPLICAS_ENV_PREFIX = "OMNI_REPLICAS_"
DISCOVERY_NAMESPACE_ENV = "OMNI_DISCOVERY_NAMESPACE"
STAGE_SERVICE_ENV_PREFIX = "OMNI_STAGE_SERVICE_"


class ReplicaAddressError(ValueError):
    """A replica address list that cannot be used; the message says which and why."""


class DiscoveryConfigError(ValueError):
    """Discovery settings that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class DiscoverySettings:
    """Where the router finds its replicas in a cluster."""

    namespace: str
    services: dict[int, str]  # stage id -> Service name
    kube_config: KubeConfig


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


def parse_stage_services(
    pipeline: PipelineConfig,
    namespace: str | None,
    args: Sequence[str],
    environ: Mapping[str, str],
    static: Mapping[int, Sequence[str]],
) -> tuple[str, dict[int, str]] | None:
    """The namespace and stage id -> Service name to discover replicas from, or None when
    discovery is off; ``static`` are the stages' ``--replicas`` addresses, which must not
    overlap it. Arguments win over ``OMNI_DISCOVERY_NAMESPACE``/``OMNI_STAGE_SERVICE_<ID>``."""
    by_name = {stage.name: stage.stage_id for stage in pipeline.stages}
    names = {stage.stage_id: stage.name for stage in pipeline.stages}
    known = ", ".join(f"{s.stage_id} ({s.name})" for s in pipeline.stages)
    namespace = namespace or environ.get(DISCOVERY_NAMESPACE_ENV) or None
    services: dict[int, str] = {}
    for key, value in environ.items():
        suffix = key[len(STAGE_SERVICE_ENV_PREFIX) :]
        if key.startswith(STAGE_SERVICE_ENV_PREFIX) and suffix.isdigit() and value.strip():
            if int(suffix) not in names:
                raise DiscoveryConfigError(f"{key}: no stage {suffix}; stages: {known}")
            services[int(suffix)] = _service(value.strip(), key)
    for arg in args:
        stage, sep, value = arg.partition("=")
        named = int(stage) if stage.isdigit() else by_name.get(stage)
        if not sep or not value.strip():
            raise DiscoveryConfigError(
                f"--stage-service {arg!r}: expected STAGE=SERVICE, e.g. 0=mypipeline-thinker"
            )
        if named is None or named not in names:
            raise DiscoveryConfigError(
                f"--stage-service {arg!r}: no stage {stage!r}; stages: {known}"
            )
        services[named] = _service(value.strip(), f"--stage-service {arg!r}")
    if namespace is None:
        if services:
            raise DiscoveryConfigError(
                "--stage-service needs --discover-namespace (or "
                f"{DISCOVERY_NAMESPACE_ENV}): the namespace of the stages' Services"
            )
        return None
    if not is_dns_label(namespace):
        raise DiscoveryConfigError(
            f"--discover-namespace {namespace!r}: not a namespace name "
            "(lowercase letters, digits and '-', at most 63)"
        )
    for stage_id, name in names.items():
        if stage_id in services and static.get(stage_id):
            raise DiscoveryConfigError(
                f"stage {stage_id} ({name}) has both replica addresses (--replicas or "
                f"{REPLICAS_ENV_PREFIX}{stage_id}) and a Service to discover them from; "
                "give one of them"
            )
        if stage_id not in services and not static.get(stage_id):
            raise DiscoveryConfigError(
                f"stage {stage_id} ({name}) has no Service to discover its replicas from: "
                f"add --stage-service {stage_id}=SERVICE (or {STAGE_SERVICE_ENV_PREFIX}{stage_id})"
            )
    # Every stage has static addresses: nothing to discover (and no empty selector).
    return (namespace, services) if services else None


def _service(value: str, where: str) -> str:
    # The widest rule for Service names (newer apiservers relax theirs from DNS-1035 to
    # DNS-1123; the apiserver stays the judge).
    if not is_dns_label(value):
        raise DiscoveryConfigError(
            f"{where}: {value!r} is not a Service name (lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63)"
        )
    return value


def _addresses(value: str, where: str) -> list[str]:
    addresses = [part.strip() for part in value.split(",") if part.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ReplicaAddressError(f"{where}: {address!r} is not HOST:PORT")
    return addresses


# How long the router keeps an idle client connection open. Longer than clients keep
# theirs (the openai client's pool: 5 s, uvicorn's default here too): with equal timers a
# client may send on a connection the router is closing, and gets a connection error.
KEEP_ALIVE_S = 75


def router_server_config(
    app: FastAPI, host: str, port: int, *, drain_timeout: float | None = None
) -> uvicorn.Config:
    """uvicorn's config for the router app: quiet logs, idle connections kept
    ``KEEP_ALIVE_S``, requests in flight at a stop given ``drain_timeout`` seconds to finish
    (None: OMNI_DRAIN_TIMEOUT_S, else its default; DrainTimeoutError if it is not
    seconds), and the app's ``RouterLimits`` (``build_router``'s; the defaults for another
    app) on every connection (``router.http_limits``: deadlines for a request's head and
    body, a bound on connections)."""
    if drain_timeout is None:
        drain_timeout = drain_timeout_from_env(os.environ)
    serving = getattr(app.state, "router", None)
    limits: RouterLimits = serving.limits if serving is not None else RouterLimits()
    shortfall = descriptor_shortfall(limits)
    if shortfall is not None:
        logger.warning("%s", shortfall)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_http_protocol(limits, PROBE_PATHS),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=max(1, round(drain_timeout)),
    )


def build_router(
    pipeline: PipelineConfig,
    addresses: Mapping[int, Sequence[str]],
    *,
    limits: RouterLimits | None = None,
    model_name: str | None = None,
    discovery: DiscoverySettings | None = None,
    stage_keys: StageClientKeys | None = None,
    api_keys: ApiKeys | None = None,
    state_dir: Path | None = None,
) -> tuple[FastAPI, ReplicaConnector]:
    """The app and the connector that keeps its pools filled (started by the app), fed by
    EndpointSlice discovery too when ``discovery`` is given; it connects to the stages
    with ``stage_keys`` (the pipeline's CURVE client keys) when given. A video pipeline's
    embedded job store lives in ``state_dir`` (None: the app's default)."""
    policy = pipeline.router.policy
    pools = {stage.stage_id: StageReplicaPool(stage.name, policy) for stage in pipeline.stages}
    replicas = ReplicaConnector(pools, keys=stage_keys)
    for stage_id, stage_addresses in addresses.items():
        replicas.set_addresses(stage_id, stage_addresses)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            tasks = [asyncio.create_task(replicas.run(), name="replica-connector")]
            if discovery is not None:
                # Discovery lists, then watches: one call at a time, so one thread does.
                client = await stack.enter_async_context(
                    KubeClient(discovery.kube_config, max_workers=1)
                )
                watcher = EndpointSliceDiscovery(
                    client, discovery.namespace, discovery.services, replicas
                )
                app.state.discovery = watcher
                tasks.append(asyncio.create_task(watcher.run(), name="endpointslice-discovery"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = create_app(
        pipeline,
        pools,
        limits=limits,
        model_name=model_name,
        lifespan=lifespan,
        api_keys=api_keys,
        state_dir=state_dir,
    )
    app.state.replicas = replicas
    return app, replicas


def run_router(
    pipeline: PipelineConfig,
    replica_args: Sequence[str],
    *,
    host: str,
    port: int,
    limits: RouterLimits | None = None,
    discover_namespace: str | None = None,
    stage_service_args: Sequence[str] = (),
    stage_keys: StageClientKeys | None = None,
    api_keys: ApiKeys | None = None,
    state_dir: Path | None = None,
) -> int:
    """Serve until stopped. ReplicaAddressError, DiscoveryConfigError, DrainTimeoutError
    (omni_runtime.pod_contract) or KubeConfigError (omni_runtime.kube) before serving when
    the settings cannot be used."""
    drain_timeout = drain_timeout_from_env(os.environ)
    addresses = parse_replica_args(pipeline, replica_args, os.environ)
    found = parse_stage_services(
        pipeline, discover_namespace, stage_service_args, os.environ, addresses
    )
    discovery = None
    if found is not None:
        namespace, services = found
        # Loaded before serving, so that a pod without credentials fails at once.
        discovery = DiscoverySettings(namespace, services, load_kube_config())
        logger.info(
            "discovering replicas from EndpointSlices in %s (%s) via %s",
            namespace,
            ", ".join(f"stage {i}: service {name}" for i, name in sorted(services.items())),
            discovery.kube_config.source,
        )
    missing = [
        s.name
        for s in pipeline.stages
        if not addresses.get(s.stage_id) and not (found and s.stage_id in found[1])
    ]
    if missing:
        logger.warning("no replica addresses yet for stage(s): %s", ", ".join(missing))
    tracing.configure(tracing.ROUTER_SERVICE_NAME)
    app, _ = build_router(
        pipeline,
        addresses,
        limits=limits,
        discovery=discovery,
        stage_keys=stage_keys,
        api_keys=api_keys,
        state_dir=state_dir,
    )
    config = router_server_config(app, host, port, drain_timeout=drain_timeout)
    logger.info(
        "router on http://%s:%d/v1 (model %s)", host, port, app.state.router.served_model_name
    )
    uvicorn.Server(config).run()
    return 0
