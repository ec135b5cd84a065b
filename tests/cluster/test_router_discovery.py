"""The Kubernetes client and the router's EndpointSlice discovery, against a real apiserver.

The client's calls are checked on real objects (server-side apply and its conflicts, get,
list, watch, delete, the apiserver's error messages, a watch ended by close()). Discovery
runs end to end: a real ``omni-runtime router`` process follows hand-written EndpointSlices
of a selector-less Service whose endpoint is a real stage process on loopback, and serves
an image through it while the slice says ready, and no longer when it does not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import psutil
import pytest
from operator_harness import CLI, endpoint_slice, stage_process, stop
from PIL import Image

from omni_runtime.kube import (
    KubeApiError,
    KubeClient,
    load_kube_config,
    object_path,
    resource_path_for,
)
from omni_runtime.tiny_models import DIFFUSION_SUBDIR
from omni_testkit.port_leases import lease_port

if TYPE_CHECKING:
    from conftest import Kube

Eventually = Callable[..., Any]
MANAGER = "omni-test"


def config_map(namespace: str, name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"omni.dev/test": "yes"}},
        "data": data,
    }


def client_for(kube: Kube) -> KubeClient:
    return KubeClient(load_kube_config(str(kube.kubeconfig)))


async def test_apply_is_idempotent_and_conflicts_need_force(kube: Kube, namespace: str) -> None:
    async with client_for(kube) as client:
        cm = config_map(namespace, "applied", {"a": "1"})
        first = await client.apply(cm, field_manager=MANAGER)
        again = await client.apply(cm, field_manager=MANAGER)
        # A no-op apply writes nothing: the object keeps its resourceVersion.
        assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        assert [f["manager"] for f in again["metadata"]["managedFields"]] == [MANAGER]

        rival = config_map(namespace, "applied", {"a": "2"})
        with pytest.raises(KubeApiError) as error:
            await client.apply(rival, field_manager="rival", force=False)
        assert error.value.status == 409
        assert error.value.reason == "Conflict"
        assert MANAGER in error.value.message
        assert ".data.a" in error.value.message
        taken = await client.apply(rival, field_manager="rival")
        assert taken["data"] == {"a": "2"}
        # Forcing moved .data.a to the rival; the labels stay ours.
        owners = {f["manager"]: f["fieldsV1"] for f in taken["metadata"]["managedFields"]}
        assert "f:a" in owners["rival"]["f:data"]
        assert "f:data" not in owners[MANAGER]
        assert "f:labels" in owners[MANAGER]["f:metadata"]


async def test_get_list_patch_watch_delete_on_real_objects(kube: Kube, namespace: str) -> None:
    collection = object_path("v1", "configmaps", namespace)
    async with client_for(kube) as client:
        await client.apply(config_map(namespace, "one", {"k": "v"}), field_manager=MANAGER)
        await client.apply(config_map(namespace, "two", {}), field_manager=MANAGER)
        unlabelled = config_map(namespace, "three", {})
        del unlabelled["metadata"]["labels"]
        await client.apply(unlabelled, field_manager=MANAGER)

        one = await client.get(resource_path_for(config_map(namespace, "one", {})))
        assert one is not None
        assert one["data"] == {"k": "v"}
        assert await client.get(f"{collection}/absent") is None

        listed = await client.list(collection, label_selector="omni.dev/test=yes")
        assert sorted(item["metadata"]["name"] for item in listed["items"]) == ["one", "two"]

        events: list[tuple[str, str, dict[str, str]]] = []
        watch = client.watch(
            collection,
            label_selector="omni.dev/test=yes",
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=30,
        )
        async with contextlib.aclosing(watch):
            await client.patch_merge(f"{collection}/one", {"data": {"k": "changed"}})
            assert await client.delete(f"{collection}/two") is True
            async for kind, obj in watch:
                if kind == "BOOKMARK":
                    continue
                events.append((kind, obj["metadata"]["name"], obj.get("data") or {}))
                if len(events) == 2:
                    break
        assert events == [("MODIFIED", "one", {"k": "changed"}), ("DELETED", "two", {})]
        assert await client.delete(f"{collection}/two") is False


async def test_closing_the_client_wakes_a_watch_blocked_on_tls(kube: Kube, namespace: str) -> None:
    # The official client reads a watch in a blocking call; over TLS only shutting the
    # socket down wakes it, and close() must not wait out the watch's timeout.
    client = client_for(kube)
    collection = object_path("v1", "configmaps", namespace)
    listed = await client.list(collection)
    seen: list[str] = []

    async def follow() -> None:
        watch = client.watch(
            collection, resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=600,
        )  # fmt: skip
        async for kind, obj in watch:
            seen.append(f"{kind} {obj['metadata'].get('name')}")

    task = asyncio.create_task(follow())
    try:
        await client.apply(config_map(namespace, "woken", {}), field_manager=MANAGER)
        deadline = time.monotonic() + 30
        while "ADDED woken" not in seen:  # the watch is open and reading
            assert time.monotonic() < deadline, f"no ADDED event: {seen}"
            await asyncio.sleep(0.05)
        began = time.monotonic()
        await asyncio.wait_for(client.close(), 10)
        assert time.monotonic() - began < 5
        assert not [t for t in threading.enumerate() if t.name.startswith("kube-client")]
        # The consumer learns that the watch broke (and would list again).
        with pytest.raises(KubeApiError):
            await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_the_apiservers_message_surfaces_in_the_error(kube: Kube, namespace: str) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "bad-port", "namespace": namespace},
        "spec": {"ports": [{"name": "x", "port": 70000}]},
    }
    async with client_for(kube) as client:
        with pytest.raises(KubeApiError) as error:
            await client.apply(service, field_manager=MANAGER)
    assert error.value.status == 422
    assert error.value.reason == "Invalid"
    assert "spec.ports[0].port: Invalid value: 70000" in error.value.message
    assert "spec.ports[0].port" in str(error.value)


# --- discovery end to end ----------------------------------------------------------------


def local_address() -> str:
    """An IPv4 address of this machine that the apiserver takes in an EndpointSlice (it
    refuses loopback and link-local ones, so 127.0.0.1 will not do)."""
    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if name not in up or address.family != socket.AF_INET:
                continue
            ip = ipaddress.ip_address(address.address)
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return str(ip)
    pytest.skip("no non-loopback IPv4 address here to put in an EndpointSlice")


@pytest.fixture(scope="module")
def pipeline_file(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("discovery") / "pipeline.json"
    pipeline = {
        "model": str(tiny_models / DIFFUSION_SUBDIR),
        "stages": [
            {
                "stageId": 0,
                "name": "dit",
                "type": "diffusion",
                "defaultSamplingParams": {"num_inference_steps": 2},
            }
        ],
        "router": {"servedModelName": "tiny-dit"},
    }
    path.write_text(json.dumps(pipeline))
    return path


@pytest.fixture(scope="module")
def stage_address(pipeline_file: Path) -> Iterator[tuple[str, int]]:
    """A real diffusion stage process on this machine: what a stage pod would serve."""
    host = local_address()
    with stage_process(pipeline_file, host) as port:
        yield host, port


class Router:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def get(self, path: str) -> httpx.Response:
        assert self.proc.poll() is None, f"router exited:\n{self.log.read_text()[-3000:]}"
        try:
            return httpx.get(self.url + path, timeout=10)
        except httpx.TransportError as e:  # not listening yet: `eventually` retries this
            raise AssertionError(f"GET {path}: {e!r}") from e

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()


@pytest.fixture
def router(kube: Kube, namespace: str, pipeline_file: Path, tmp_path: Path) -> Iterator[Router]:
    port = lease_port()
    log = tmp_path / "router.log"
    env = {k: v for k, v in kube.env().items() if not k.startswith("OMNI_STAGE_SERVICE_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *CLI, "router", "-f", str(pipeline_file), "--host", "127.0.0.1",
                "--port", str(port), "--discover-namespace", namespace,
                "--stage-service", "0=stages",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )  # fmt: skip
    try:
        yield Router(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop(proc)


@pytest.mark.integration
def test_router_follows_the_endpointslices_of_its_stage_service(
    kube: Kube,
    namespace: str,
    stage_address: tuple[str, int],
    router: Router,
    eventually: Eventually,
) -> None:
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "stages", "namespace": namespace},
            "spec": {"clusterIP": "None", "ports": [{"name": "stage-0", "port": 52000}]},
        }
    )
    # Serving, listed, and nothing to route to yet: alive but not ready.
    eventually(lambda: router.get("/livez").status_code == 200, timeout=60, what="router up")
    eventually(lambda: router.logged("stage 0 (dit): 0 replica(s)"), timeout=30, what="first list")
    health = router.get("/health")
    assert health.status_code == 503, health.text
    assert "no live replica for stage(s): dit" in health.text

    kube.apply(endpoint_slice(namespace, stage_address, ready=True))
    eventually(lambda: router.get("/health").status_code == 200, timeout=60, what="replica in")
    host, port = stage_address
    assert router.logged(f"stage 0 (dit): 1 replica(s): {host}:{port}")

    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    result = client.images.generate(
        model="tiny-dit", prompt="a gold dog", size="64x64", response_format="b64_json"
    )
    assert result.data
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
    assert (image.format, image.size) == ("PNG", (64, 64))

    kube.apply(endpoint_slice(namespace, stage_address, ready=False))
    eventually(lambda: router.get("/health").status_code == 503, timeout=30, what="not ready")
    assert router.get("/livez").status_code == 200

    kube.apply(endpoint_slice(namespace, stage_address, ready=True))
    eventually(lambda: router.get("/health").status_code == 200, timeout=60, what="back in")
    kube.kubectl("delete", "endpointslice", "stages-hand", namespace=namespace)
    eventually(lambda: router.get("/health").status_code == 503, timeout=30, what="slice gone")
    assert router.get("/livez").status_code == 200
