"""The Kubernetes client helpers and router discovery's settings, without a cluster.

Credentials are loaded by the official ``kubernetes`` package; what is ours is where they
are looked for, the one-line errors, the asyncio calls over its ApiClient, and kopf's login
from the same configuration. Kubeconfigs, service-account files and exec plugins are
written in tmp_path; certificates are made with the openssl command (a self-signed one
serves as CA and client certificate alike). HTTP behaviour a real apiserver cannot be made
to show on demand (a watch line split across chunks, a watch left hanging mid-read) runs
against a small aiohttp server on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from kubernetes import client as k8s_client
from kubernetes.config import incluster_config

from fake_replica import FakeReplica
from omni_operator.handlers import connection_info, login
from omni_runtime.config import PipelineConfig
from omni_runtime.entrypoints.router_process import DiscoveryConfigError, parse_stage_services
from omni_runtime.kube import (
    KubeApiError,
    KubeClient,
    KubeConfig,
    KubeConfigError,
    WatchExpired,
    load_kube_config,
    object_path,
    resource_path_for,
)
from omni_runtime.router.discovery import (
    EndpointSliceDiscovery,
    StageEndpoints,
    addresses_by_stage,
)
from omni_runtime.router.replicas import ReplicaConnector
from omni_runtime.router.stage_replica_pool import StageReplicaPool

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("pki")
    crt, key = where / "client.crt", where / "client.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(crt), "-subj", "/CN=omni-test", "-days", "1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return crt, key


def write_kubeconfig(path: Path, users: dict[str, Any], **cluster: Any) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "second",
                "clusters": [
                    {"name": "other", "cluster": {"server": "https://wrong:1"}},
                    {"name": "c", "cluster": {"server": "https://10.0.0.1:6443/", **cluster}},
                ],
                "users": [{"name": "u", "user": users}],
                "contexts": [
                    {"name": "first", "context": {"cluster": "other", "user": "u"}},
                    {"name": "second", "context": {"cluster": "c", "user": "u", "namespace": "ns"}},
                ],
            }
        )
    )
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def b64d(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def exec_plugin(tmp_path: Path, body: str) -> dict[str, Any]:
    """A kubeconfig ``exec`` section running a Python script with ``body``."""
    script = tmp_path / "plugin.py"
    script.write_text(f"import json, sys\n{body}\n")
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script)],
            "interactiveMode": "Never",
        }
    }


def bearer(config: KubeConfig) -> str | None:
    value: str | None = config.configuration.get_api_key_with_prefix("BearerToken")
    return value


def test_kubeconfig_with_inline_data_uses_the_current_context(
    tmp_path: Path, cert: tuple[Path, Path]
) -> None:
    crt, key = cert
    path = write_kubeconfig(
        tmp_path / "config",
        {"client-certificate-data": b64(crt), "client-key-data": b64(key), "token": "t0k"},
        **{"certificate-authority-data": b64(crt)},
    )
    config = load_kube_config(str(path), environ={})
    assert config.server == "https://10.0.0.1:6443"
    assert config.namespace == "ns"
    assert str(path) in config.source
    c = config.configuration
    assert Path(c.ssl_ca_cert).read_bytes() == crt.read_bytes()
    assert Path(c.key_file).read_bytes() == key.read_bytes()
    assert c.verify_ssl
    assert bearer(config) == "Bearer t0k"


def test_kubeconfig_files_are_relative_to_it_and_kubeconfig_env_merges_its_files(
    tmp_path: Path, cert: tuple[Path, Path]
) -> None:
    crt, key = cert
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki/a.crt").write_bytes(crt.read_bytes())
    (tmp_path / "pki/a.key").write_bytes(key.read_bytes())
    path = write_kubeconfig(
        tmp_path / "config",
        {"client-certificate": "pki/a.crt", "client-key": "pki/a.key"},
        **{"insecure-skip-tls-verify": True},
    )
    # As kubectl does, a missing entry is skipped.
    env = {"KUBECONFIG": f"{tmp_path / 'missing'}{os.pathsep}{path}", "HOME": str(tmp_path)}
    config = load_kube_config(environ=env)
    assert config.configuration.cert_file == str(tmp_path / "pki/a.crt")
    assert "$KUBECONFIG" in config.source
    assert not config.configuration.verify_ssl
    assert bearer(config) is None  # a client certificate, no token


def test_in_cluster_config_rereads_the_rotating_token(
    tmp_path: Path, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("first")
    (tmp_path / "ca.crt").write_bytes(cert[0].read_bytes())
    (tmp_path / "namespace").write_text("team-a")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    config = load_kube_config(environ=env, service_account_dir=tmp_path)
    assert config.server == "https://[fd00::1]:443"
    assert config.namespace == "team-a"
    assert bearer(config) == "bearer first"
    (tmp_path / "token").write_text("second")
    assert bearer(config) == "bearer first"  # re-read once a minute, not per request

    class Later:
        """The datetime module, two minutes on."""

        timedelta = datetime.timedelta

        class datetime(datetime.datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:
                return datetime.datetime.now(tz) + datetime.timedelta(minutes=2)

    monkeypatch.setattr(incluster_config, "datetime", Later)
    assert bearer(config) == "bearer second"


def test_exec_plugin_credentials_are_used_and_its_failure_says_why(tmp_path: Path) -> None:
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": "from-plugin"},
    }
    ok = write_kubeconfig(
        tmp_path / "ok", exec_plugin(tmp_path, f"print(json.dumps({credential!r}))")
    )
    config = load_kube_config(str(ok), environ={})
    assert bearer(config) == "Bearer from-plugin"

    failing = write_kubeconfig(
        tmp_path / "failing",
        exec_plugin(tmp_path, "print('token expired,', file=sys.stderr)\nprint('run login')\n"
                    "sys.exit(3)"),
    )  # fmt: skip
    with pytest.raises(KubeConfigError) as error:
        load_kube_config(str(failing), environ={})
    message = str(error.value)
    assert str(failing) in message
    assert "user 'u'" in message
    assert "exec: process returned 3" in message
    assert "token expired," in message
    assert "\n" not in message


def counting_plugin(tmp_path: Path) -> dict[str, Any]:
    """An exec plugin whose n-th run hands out ``token-<n>``."""
    counter = tmp_path / "calls"
    body = (
        f"calls = open({str(counter)!r}, 'a+'); calls.write('x'); calls.seek(0)\n"
        "n = len(calls.read())\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1',"
        " 'kind': 'ExecCredential', 'status': {'token': f'token-{n}'}}))"
    )
    return exec_plugin(tmp_path, body)


def test_reload_runs_the_exec_plugin_again(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", counting_plugin(tmp_path))
    config = load_kube_config(str(path), environ={})
    assert bearer(config) == "Bearer token-1"
    assert config.reload is not None
    assert bearer(config.reload()) == "Bearer token-2"


@pytest.mark.parametrize(
    ("users", "cluster", "needle"),
    [
        ({"client-key-data": b64d("not a key")}, {}, "a client certificate needs a client key"),
        (
            {"client-certificate-data": b64d("x"), "client-key-data": b64d("y")},
            {},
            "unusable client certificate/key",
        ),
        ({}, {"certificate-authority-data": b64d("junk")}, "unusable certificate authority"),
        ({}, {"server": ""}, "cluster 'c' has no server"),
        ({"client-key": "absent.key"}, {}, "absent.key"),
    ],
)
def test_kubeconfig_errors_say_what_and_where(
    tmp_path: Path, users: dict[str, Any], cluster: dict[str, Any], needle: str
) -> None:
    path = write_kubeconfig(tmp_path / "config", users, **cluster)
    with pytest.raises(KubeConfigError) as error:
        load_kube_config(str(path), environ={})
    assert needle in str(error.value)
    assert str(path) in str(error.value)


def test_kubeconfig_naming_a_missing_context_or_not_yaml_says_so(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", {})
    data = yaml.safe_load(path.read_text())
    data["current-context"] = "nope"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(KubeConfigError, match=r"config.*object with name nope in .*contexts"):
        load_kube_config(str(path), environ={})
    path.write_text("clusters: [unclosed\n")
    with pytest.raises(KubeConfigError) as error:
        load_kube_config(str(path), environ={})
    assert str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_no_credentials_anywhere_names_every_place_looked(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError) as error:
        load_kube_config(environ={"HOME": str(tmp_path)})
    message = str(error.value)
    assert "$KUBECONFIG is not set" in message
    assert "$KUBERNETES_SERVICE_HOST" in message
    assert str(tmp_path / ".kube/config") in message
    with pytest.raises(KubeConfigError, match=f"cannot read kubeconfig {tmp_path / 'x'} "):
        load_kube_config(environ={"KUBECONFIG": str(tmp_path / "x")})


def test_in_cluster_without_a_token_says_which_file(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match=f"{tmp_path / 'token'} is missing"):
        load_kube_config(
            environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, service_account_dir=tmp_path
        )


def test_object_paths() -> None:
    assert object_path("v1", "services", "ns") == "/api/v1/namespaces/ns/services"
    assert (
        object_path("omni.dev/v1alpha1", "omnipipelines", "ns", "p", "status")
        == "/apis/omni.dev/v1alpha1/namespaces/ns/omnipipelines/p/status"
    )
    assert object_path("v1", "namespaces", None, "ns") == "/api/v1/namespaces/ns"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
    }
    assert resource_path_for(deployment) == "/apis/apps/v1/namespaces/ns/deployments/d"
    with pytest.raises(ValueError, match="kind 'CronJob' is not one this client knows"):
        resource_path_for({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "s"}})


# --- kopf's login --------------------------------------------------------------------


def test_kopf_logs_in_with_the_clients_credentials(tmp_path: Path, cert: tuple[Path, Path]) -> None:
    crt, key = cert
    with_token = write_kubeconfig(
        tmp_path / "token", {"token": "t0k"}, **{"certificate-authority-data": b64(crt)}
    )
    info = connection_info(load_kube_config(str(with_token), environ={}))
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.1:6443", "Bearer", "t0k")
    assert info.ca_path is not None
    assert Path(str(info.ca_path)).read_bytes() == crt.read_bytes()
    assert info.default_namespace == "ns"
    assert not info.insecure

    with_cert = write_kubeconfig(
        tmp_path / "cert",
        {"client-certificate-data": b64(crt), "client-key-data": b64(key)},
        **{"insecure-skip-tls-verify": True},
    )
    info = connection_info(load_kube_config(str(with_cert), environ={}))
    assert info.token is None
    assert info.insecure
    assert info.private_key_path is not None
    assert Path(str(info.private_key_path)).read_bytes() == key.read_bytes()


async def test_kopf_logs_in_again_with_credentials_loaded_afresh(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", counting_plugin(tmp_path))
    async with KubeClient(load_kube_config(str(path), environ={})) as client:
        memo = types.SimpleNamespace(kube=client)
        first = await login(memo=memo)
        assert first.token == "token-1"  # what the operator's client loaded: no new run
        # kopf asks again only once the apiserver refused those: the plugin runs again,
        # for kopf and for the operator's own calls alike.
        again = await login(memo=memo)
        assert again.token == "token-2"
        assert bearer(client.config) == "Bearer token-2"


# --- EndpointSlices -> addresses -------------------------------------------------------


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    ports: dict[str, int],
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


def ep(*addresses: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": list(addresses), "conditions": conditions}


def test_slices_to_addresses_by_readiness_port_name_and_service() -> None:
    group_ports = {"stage-0": 52000, "stage-1": 52001}
    slices = [
        endpoint_slice(
            "p-group-a",
            "p-group",
            [
                ep("10.0.0.1", ready=True),
                {"addresses": ["10.0.0.2"]},  # ready unknown: counts as ready
                ep("10.0.0.3", ready=False),
                # Terminating: still serving (serving unset: as ready says) or not.
                ep("10.0.0.4", ready=True, terminating=True),
                ep("10.0.0.7", ready=False, serving=True, terminating=True),
                ep("10.0.0.8", ready=False, serving=False, terminating=True),
                ep("10.0.0.9", ready=False, terminating=True),
                ep("10.0.0.5", "10.0.0.55", ready=True),  # fungible: the first only
            ],
            group_ports,
        ),
        # The same Service's second slice, repeating one endpoint (as during a handover),
        # once terminating: ready in one slice is ready.
        endpoint_slice(
            "p-group-b",
            "p-group",
            [ep("10.0.0.1"), ep("10.0.0.6"), ep("10.0.0.5", serving=True, terminating=True)],
            group_ports,
        ),
        endpoint_slice("other", "other-svc", [ep("10.9.9.9")], group_ports),
        endpoint_slice("p-v6", "p-v6", [ep("fd00::7", ready=True)], {"stage-2": 52002}, "IPv6"),
        endpoint_slice("p-fqdn", "p-v6", [ep("a.example")], {"stage-2": 52002}, "FQDN"),
        endpoint_slice("p-noport", "p-none", [ep("10.0.0.8")], {"http": 80}),
    ]
    services = {0: "p-group", 1: "p-group", 2: "p-v6", 3: "p-none", 4: "p-absent"}
    assert addresses_by_stage(slices, services) == {
        0: StageEndpoints(
            ("10.0.0.1:52000", "10.0.0.2:52000", "10.0.0.5:52000", "10.0.0.6:52000"),
            ("10.0.0.4:52000", "10.0.0.7:52000"),
        ),
        1: StageEndpoints(
            ("10.0.0.1:52001", "10.0.0.2:52001", "10.0.0.5:52001", "10.0.0.6:52001"),
            ("10.0.0.4:52001", "10.0.0.7:52001"),
        ),
        2: StageEndpoints(("[fd00::7]:52002",)),
        3: StageEndpoints(),
        4: StageEndpoints(),
    }


class RecordingConnector(ReplicaConnector):
    def __init__(self, stage_ids: Iterable[int]) -> None:
        super().__init__({i: StageReplicaPool(f"s{i}") for i in stage_ids})
        self.calls: list[tuple[int, list[str], list[str]]] = []

    def set_addresses(
        self, stage_id: int, addresses: Iterable[str], *, terminating: Iterable[str] = ()
    ) -> None:
        self.calls.append((stage_id, list(addresses), list(terminating)))
        super().set_addresses(stage_id, addresses, terminating=terminating)


class ScriptedClient:
    """Lists and watches from a script; each step a list result, events, or an error."""

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists, self.watches = lists, watches
        self.watched_from: list[str | None] = []
        self.done = asyncio.Event()

    async def list(self, path: str, *, label_selector: str | None = None) -> dict[str, Any]:
        assert label_selector == "kubernetes.io/service-name in (svc)"
        step = self.lists.pop(0)
        if isinstance(step, Exception):
            raise step
        return {"metadata": {"resourceVersion": step[0]}, "items": step[1]}

    async def watch(
        self, path: str, *, label_selector: str | None = None, resource_version: str | None = None,
        timeout_seconds: int = 0,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        self.watched_from.append(resource_version)
        if not self.watches:
            self.done.set()
            await asyncio.Event().wait()
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        for event in step:
            yield event


async def test_discovery_follows_the_watch_and_relists_after_expiry_and_errors() -> None:
    ports = {"stage-0": 52000}
    one = endpoint_slice("s1", "svc", [ep("10.0.0.1")], ports)
    one["metadata"]["resourceVersion"] = "11"
    two = endpoint_slice("s2", "svc", [ep("10.0.0.2")], ports)
    two["metadata"]["resourceVersion"] = "12"
    unready = endpoint_slice(
        "s1", "svc", [ep("10.0.0.1", ready=False, serving=True, terminating=True)], ports
    )
    unready["metadata"]["resourceVersion"] = "13"
    client = ScriptedClient(
        lists=[("10", [one]), KubeApiError(0, "ConnectionError", "refused", method="", path=""),
               ("20", [two])],
        watches=[
            [("ADDED", two), ("BOOKMARK", {"metadata": {"resourceVersion": "12b"}})],
            [("MODIFIED", unready)],
            WatchExpired(410, "Expired", "too old", method="", path=""),
        ],
    )  # fmt: skip
    connector = RecordingConnector([0])
    discovery = EndpointSliceDiscovery(
        client,  # type: ignore[arg-type]
        "ns",
        {0: "svc"},
        connector,
        backoff_initial=0.01,
    )
    task = asyncio.create_task(discovery.run())
    try:
        await asyncio.wait_for(client.done.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # A watch continues from the last version seen (bookmarks included); after expiry and
    # a failed relist, the next list's version.
    assert client.watched_from == ["10", "12b", "13", "20"]
    assert connector.calls == [
        (0, ["10.0.0.1:52000"], []),
        (0, ["10.0.0.1:52000", "10.0.0.2:52000"], []),
        (0, ["10.0.0.2:52000"], ["10.0.0.1:52000"]),
        (0, ["10.0.0.2:52000"], []),
    ]
    assert discovery.current == {0: StageEndpoints(("10.0.0.2:52000",))}


async def test_a_terminating_address_keeps_its_replica_as_a_last_resort_until_it_goes() -> None:
    pool = StageReplicaPool("s0")
    connector = ReplicaConnector({0: pool})
    a, b = FakeReplica("a"), FakeReplica("b")
    a_id = pool.add_replica(a, "a:1", revision="1-x")
    pool.add_replica(b, "b:1", revision="2-y")
    try:
        connector.set_addresses(0, ["b:1"], terminating=["a:1"])
        await connector.reconcile()
        assert {s.address: s.terminating for s in pool.stats()} == {"a:1": True, "b:1": False}
        assert pool.revisions() == {"2-y"}
        assert pool.revisions(terminating=True) == {"1-x", "2-y"}

        # Named ready as well (two slices during a handover): ready wins.
        connector.set_addresses(0, ["a:1", "b:1"], terminating=["a:1"])
        await connector.reconcile()
        assert [s.terminating for s in pool.stats()] == [False, False]

        # Gone from both: drained out of the pool.
        connector.set_addresses(0, ["b:1"])
        await connector.reconcile()
        deadline = time.monotonic() + 5
        while a_id in {s.replica_id for s in pool.stats()}:
            assert time.monotonic() < deadline, "the replica was not removed"
            await asyncio.sleep(0.01)
        assert a.shut_down
        assert not b.shut_down
    finally:
        await pool.close()


# --- the client over HTTP (a loopback aiohttp server) -----------------------------------


def loopback_config(url: str, token: str = "t") -> KubeConfig:
    configuration = k8s_client.Configuration()
    configuration.host = url
    configuration.api_key["BearerToken"] = f"Bearer {token}"
    return KubeConfig(configuration, "test")


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kube-client")]


async def test_client_surfaces_status_messages_and_splits_watch_lines(
    aiohttp_server_factory: Any,
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != "Bearer t":
            return web.json_response({"kind": "Status", "reason": "Unauthorized"}, status=401)
        if request.path.endswith("/missing"):
            body = {"kind": "Status", "reason": "NotFound", "message": 'pods "missing" not found'}
            return web.json_response(body, status=404)
        if request.path.endswith("/bad"):
            body = {"kind": "Status", "reason": "Invalid", "message": "spec.x: Invalid value"}
            return web.json_response(body, status=422)
        if request.path.endswith("/expired"):
            body = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            return web.json_response(body, status=410)
        if request.method == "PATCH":
            return web.json_response(
                {
                    "contentType": request.content_type,
                    "query": dict(request.query),
                    "body": await request.json(),
                }
            )
        if request.query.get("watch") == "true":
            assert request.query["labelSelector"] == "a in (b, c)"
            response = web.StreamResponse()
            await response.prepare(request)
            line = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "a"}}})
            await response.write(line[:10].encode())  # a line split across chunks
            await response.write((line[10:] + "\n").encode())
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            await response.write((json.dumps({"type": "ERROR", "object": gone}) + "\n").encode())
            return response
        return web.json_response({"kind": "Pod", "metadata": {"name": "p"}})

    url = await aiohttp_server_factory(handler)
    async with KubeClient(loopback_config(url)) as client:
        assert await client.get("/api/v1/namespaces/ns/pods/p") == {
            "kind": "Pod",
            "metadata": {"name": "p"},
        }
        assert await client.get("/api/v1/namespaces/ns/pods/missing") is None
        with pytest.raises(KubeApiError) as error:
            await client.request("GET", "/api/v1/bad")
        assert (error.value.status, error.value.reason) == (422, "Invalid")
        assert error.value.message == "spec.x: Invalid value"
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "n"}}
        applied = await client.apply(cm, field_manager="me")
        assert applied == {
            "contentType": "application/apply-patch+yaml",
            "query": {"fieldManager": "me", "force": "true"},
            "body": cm,
        }
        events: list[tuple[str, dict[str, Any]]] = []

        async def follow() -> None:
            async for event in client.watch(
                "/api/v1/namespaces/ns/pods", label_selector="a in (b, c)"
            ):
                events.append(event)

        with pytest.raises(WatchExpired):
            await follow()
        assert events == [("ADDED", {"metadata": {"name": "a"}})]
        with pytest.raises(WatchExpired):
            async for _ in client.watch("/api/v1/expired"):
                pass
    async with KubeClient(loopback_config(url, token="wrong")) as client:
        with pytest.raises(KubeApiError) as error:
            await client.list("/api/v1/pods")
        assert (error.value.status, error.value.reason) == (401, "Unauthorized")
    assert client_threads() == []


async def test_closing_the_client_ends_a_watch_blocked_mid_read(
    aiohttp_server_factory: Any,
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"type": "ADDED", "object": {"metadata": {"name": "a"}}}\n')
        started.set()
        await release.wait()  # then nothing more: the client's read blocks
        return response

    url = await aiohttp_server_factory(handler)
    client = KubeClient(loopback_config(url))
    seen: list[str] = []

    async def follow() -> None:
        async for kind, _ in client.watch("/api/v1/pods", timeout_seconds=600):
            seen.append(kind)

    task = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(started.wait(), 10)
        deadline = time.monotonic() + 10
        while not seen:  # the event arrives, then the next read blocks in a thread
            assert time.monotonic() < deadline, "no watch event"
            await asyncio.sleep(0.01)
        assert client_threads(), "the watch is read on the client's threads"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        began = time.monotonic()
        await asyncio.wait_for(client.close(), 10)
        # The blocked read was woken, not waited out (the watch would run for 690 s).
        assert time.monotonic() - began < 5
        assert client_threads() == []
        assert seen == ["ADDED"]
    finally:
        release.set()
        await client.close()


@pytest.fixture
async def aiohttp_server_factory() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def start(handler: Any) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


# --- router settings --------------------------------------------------------------------


@pytest.fixture
def two_stages() -> PipelineConfig:
    return PipelineConfig.model_validate(
        yaml.safe_load((REPO / "examples/tiny-text-to-image.yaml").read_text())
    )


def test_stage_services_from_arguments_and_environment(two_stages: PipelineConfig) -> None:
    env = {"OMNI_DISCOVERY_NAMESPACE": "team-a", "OMNI_STAGE_SERVICE_1": "p-dit"}
    assert parse_stage_services(two_stages, None, ["thinker=p-thinker"], env, {}) == (
        "team-a",
        {0: "p-thinker", 1: "p-dit"},
    )
    # Arguments win; a stage may keep static addresses instead of a Service.
    assert parse_stage_services(two_stages, "ns", ["1=x"], env, {0: ["h:1"]}) == ("ns", {1: "x"})
    assert parse_stage_services(two_stages, None, [], {}, {}) is None
    assert parse_stage_services(two_stages, "ns", [], {}, {0: ["h:1"], 1: ["h:2"]}) is None


@pytest.mark.parametrize(
    ("namespace", "args", "static", "needle"),
    [
        (None, ["0=a"], {}, "--stage-service needs --discover-namespace"),
        ("ns", ["7=a", "1=b"], {}, "--stage-service '7=a': no stage '7'; stages: 0 (thinker)"),
        ("ns", ["0=a"], {}, "stage 1 (dit) has no Service to discover its replicas from"),
        ("ns", ["0=a", "1=b"], {1: ["h:1"]}, "stage 1 (dit) has both replica addresses"),
        ("ns", ["0=A_b", "1=b"], {}, "'A_b' is not a Service name"),
        ("ns", ["0", "1=b"], {}, "expected STAGE=SERVICE"),
        ("Bad_NS", ["0=a", "1=b"], {}, "--discover-namespace 'Bad_NS': not a namespace"),
    ],
)
def test_stage_service_errors(
    two_stages: PipelineConfig,
    namespace: str | None,
    args: list[str],
    static: dict[int, list[str]],
    needle: str,
) -> None:
    with pytest.raises(DiscoveryConfigError) as error:
        parse_stage_services(two_stages, namespace, args, {}, static)
    assert needle in str(error.value)


def omni_runtime(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_runtime.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_router_refuses_discovery_it_cannot_do_with_exit_2_and_one_line(tmp_path: Path) -> None:
    pipeline = str(REPO / "examples/tiny-text-to-image.yaml")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "OMNI_STAGE"))}
    failing = write_kubeconfig(
        tmp_path / "exec-config",
        exec_plugin(tmp_path, "print('no SSO session', file=sys.stderr)\nsys.exit(1)"),
    )
    services = ["--stage-service", "0=a", "--stage-service", "1=b"]
    cases = [
        (
            ["--replicas", "0=127.0.0.1:1", *services],
            {},
            "stage 0 (thinker) has both replica addresses",
        ),
        (
            services,
            {"KUBECONFIG": str(tmp_path / "absent")},
            f"cannot read kubeconfig {tmp_path / 'absent'} ($KUBECONFIG)",
        ),
        (services, {"HOME": str(tmp_path)}, "no Kubernetes credentials"),
        (
            services,
            {"KUBECONFIG": str(failing)},
            f"kubeconfig {failing} ($KUBECONFIG): user 'u': exec: process returned 1. "
            "no SSO session",
        ),
    ]
    for args, env, needle in cases:
        result = omni_runtime(
            "router", "-f", pipeline, "--discover-namespace", "ns", *args, env={**base, **env}
        )
        assert result.returncode == 2, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, result.stderr
