"""Replica discovery in a cluster: the EndpointSlices of the stages' Services.

Each stage's replicas are the ready endpoints of its Service's slices, at the slice port
named ``stage-<stage id>`` (a placement group's Service carries one such port per stage).
One list-then-watch over the namespace, selected by the ``kubernetes.io/service-name``
label, feeds ``ReplicaConnector.set_addresses`` whenever a stage's set changes. The list
and the watch's reads run on the KubeClient's own threads (the official client blocks), so
the event loop never waits on the apiserver; cancelling ``run`` and closing the client wakes
a watch blocked mid-read instead of waiting out its timeout.

Readiness follows the EndpointSlice API: ``ready`` unset means unknown, which consumers
should treat as ready; a terminating endpoint is never a ready one, whatever ``ready`` says
(its pod is going away; a Service with publishNotReadyAddresses may still mark it ready).
A terminating endpoint that is still ``serving`` (unset: as ``ready`` says) is passed on
as such: the router keeps its replica as a last resort (ReplicaConnector), as kube-proxy
uses a Service's serving terminating endpoints when it has no ready one.
Of an endpoint's addresses only the first is used: the API declares them fungible, and
using each would count one pod as several replicas.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_runtime.kube import KubeApiError, KubeClient, WatchExpired, object_path
from omni_runtime.pod_contract import endpoint_is_ready, endpoint_serves_while_terminating
from omni_runtime.router.replicas import ReplicaConnector

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
STAGE_PORT_PREFIX = "stage-"


def stage_port_name(stage_id: int) -> str:
    return f"{STAGE_PORT_PREFIX}{stage_id}"


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass(frozen=True)
class StageEndpoints:
    """One stage's replicas in its Service's slices, each sorted ``ip:port``: ``ready``
    ones, and ``terminating`` ones (their pods going away) that still serve."""

    ready: tuple[str, ...] = ()
    terminating: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"{len(self.ready)} replica(s)" + (
            ": " + ", ".join(self.ready) if self.ready else ""
        )
        if self.terminating:
            text += "; terminating, still serving: " + ", ".join(self.terminating)
        return text


def addresses_by_stage(
    slices: Iterable[Mapping[str, Any]], services: Mapping[int, str]
) -> dict[int, StageEndpoints]:
    """Stage id -> the endpoints of its Service's slices (merged, deduplicated; an
    address both ready and terminating, as two slices may say during a handover, is
    ready).

    Every stage of ``services`` is in the result, with no address if no slice has any.
    """
    ready: dict[int, set[str]] = {stage_id: set() for stage_id in services}
    terminating: dict[int, set[str]] = {stage_id: set() for stage_id in services}
    for eps in slices:
        service = ((eps.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL)
        if eps.get("addressType") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name hosts, not replicas we can dial
        ports = {
            port.get("name"): port.get("port")
            for port in eps.get("ports") or []
            if port.get("protocol", "TCP") == "TCP" and isinstance(port.get("port"), int)
        }
        for stage_id, stage_service in services.items():
            port = ports.get(stage_port_name(stage_id))
            if stage_service != service or port is None:
                continue
            for endpoint in eps.get("endpoints") or []:
                addresses = endpoint.get("addresses") or []
                if not addresses:
                    continue
                if endpoint_is_ready(endpoint):
                    ready[stage_id].add(format_address(addresses[0], port))
                elif endpoint_serves_while_terminating(endpoint):
                    terminating[stage_id].add(format_address(addresses[0], port))
    return {
        stage_id: StageEndpoints(
            tuple(sorted(addresses)), tuple(sorted(terminating[stage_id] - addresses))
        )
        for stage_id, addresses in ready.items()
    }


class EndpointSliceDiscovery:
    """Keeps ``connector``'s addresses equal to the endpoints of the stages' Services."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        services: Mapping[int, str],
        connector: ReplicaConnector,
        *,
        watch_timeout: int = 300,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.services = dict(services)
        self.connector = connector
        self.watch_timeout = watch_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.current: dict[int, StageEndpoints] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self._path = object_path("discovery.k8s.io/v1", "endpointslices", namespace)
        names = ",".join(sorted(set(self.services.values())))
        self._selector = f"{SERVICE_NAME_LABEL} in ({names})"

    async def run(self) -> None:
        """List and watch forever (cancel to stop). The apiserver being away keeps the
        addresses as they were: the connector evicts replicas that really die."""
        delay = self.backoff_initial
        while True:
            try:
                version = await self._relist()
                delay = self.backoff_initial
                while True:
                    version = await self._watch(version)
            except WatchExpired:
                logger.info("endpointslice watch expired in %s; listing again", self.namespace)
            except Exception as e:
                # Whatever broke (apiserver away, RBAC, a bug), discovery must go on: the
                # router without it would never learn of a new replica again.
                level = logging.WARNING if isinstance(e, KubeApiError) else logging.ERROR
                logger.log(
                    level,
                    "endpointslice discovery in %s: %s; retrying in %.1f s",
                    self.namespace,
                    e if isinstance(e, KubeApiError) else repr(e),
                    delay,
                    exc_info=not isinstance(e, KubeApiError),
                )
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.backoff_max)

    async def _relist(self) -> str:
        listed = await self.client.list(self._path, label_selector=self._selector)
        self._slices = {item["metadata"]["name"]: item for item in listed.get("items") or []}
        self._update()
        return str(listed.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, version: str) -> str:
        """One watch call from ``version``; the version to continue from when it ends."""
        async for kind, obj in self.client.watch(
            self._path,
            label_selector=self._selector,
            resource_version=version,
            timeout_seconds=self.watch_timeout,
        ):
            metadata = obj.get("metadata") or {}
            version = metadata.get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED"):
                self._slices[metadata["name"]] = obj
            elif kind == "DELETED":
                self._slices.pop(metadata.get("name", ""), None)
            else:
                continue  # BOOKMARK: only its resourceVersion matters
            self._update()
        return version

    def _update(self) -> None:
        wanted = addresses_by_stage(self._slices.values(), self.services)
        for stage_id, endpoints in wanted.items():
            if self.current.get(stage_id) == endpoints:
                continue
            self.current[stage_id] = endpoints
            pool = self.connector.pools.get(stage_id)
            logger.info(
                "stage %d (%s): %s",
                stage_id,
                pool.stage_name if pool is not None else "?",
                endpoints.describe(),
            )
            self.connector.set_addresses(
                stage_id, endpoints.ready, terminating=endpoints.terminating
            )
