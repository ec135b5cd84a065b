"""The pods the operator renders really run: each container's command, args and environment
of the tiny CPU pipeline, started as local processes, serve an image through the router.

What a node would provide is mapped onto this machine: each volume mount to a directory
(the ConfigMap's files written into it), each container port to a free loopback port, and
the router's EndpointSlice discovery to the stage Services' loopback addresses (that watch
is tested against a real apiserver in tests/cluster/test_router_discovery.py).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from serving import wait_until

from omni_operator.api import OmniPipelineSpec
from omni_operator.render import render
from omni_operator.render.names import stage_keys_secret_name
from omni_operator.stage_keys import generate_stage_keys
from omni_testkit.port_leases import lease_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "manifests" / "examples" / "tiny-pipeline.yaml"
BIN = Path(sys.executable).parent
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class LocalPod:
    """A rendered pod template, translated to this machine."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[int, int]  # container port -> loopback port


def _translate(
    deployment: dict[str, Any],
    configmaps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    workdir: Path,
) -> LocalPod:
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    paths: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] == "/dev/shm":
            continue  # the real /dev/shm is what a memory-backed emptyDir gives a pod
        local = workdir / name / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        source = volumes[mount["name"]]
        if "configMap" in source:
            for key, text in configmaps[source["configMap"]["name"]].items():
                (local / key).write_text(text)
        if "secret" in source:
            # As the kubelet projects a Secret's items: only the listed keys.
            data = secrets[source["secret"]["secretName"]]
            for item in source["secret"]["items"]:
                (local / item["path"]).write_text(data[item["key"]])
        paths[mount["mountPath"]] = str(local)
    ports = {p["containerPort"]: lease_port() for p in container.get("ports", [])}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        port = container.get(probe, {}).get("httpGet", {}).get("port")
        if isinstance(port, int) and port not in ports:
            ports[port] = lease_port()

    # One pass, longest path first, whole path components only: a local directory is
    # itself under /tmp, which must not be mapped a second time.
    mounted = re.compile(
        r"(?<![\w/])("
        + "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
        + r")(?=/|$)"
    )

    def local_text(text: str) -> str:
        return mounted.sub(lambda m: paths[m[1]], text) if paths else text

    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = local_text(_VAR_REF.sub(lambda m: env.get(m[1], m[0]), var["value"]))
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = "default"
    argv = [*container.get("command", ["omni-runtime"]), *container.get("args", [])]
    argv = [local_text(_VAR_REF.sub(lambda m: env.get(m[1], m[0]), arg)) for arg in argv]
    if argv[0] == "omni-runtime":
        argv[0] = str(BIN / "omni-runtime")
    argv = [_map_ports(arg, ports) for arg in argv]
    return LocalPod(name, argv, env, ports)


def _map_ports(arg: str, ports: dict[int, int]) -> str:
    for container_port, local in ports.items():
        if arg == str(container_port):
            return str(local)
        if arg.endswith(f"={container_port}"):
            return arg[: -len(str(container_port))] + str(local)
    return arg


def _router_argv(argv: list[str], replicas: dict[str, str]) -> list[str]:
    """The router's discovery flags replaced by the stage Services' loopback addresses."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--discover-namespace", "--stage-service"):
            skip = True
            continue
        if arg.startswith(("--discover-namespace=", "--stage-service=")):
            continue
        out.append(arg)
    for stage, address in sorted(replicas.items()):
        out += ["--replicas", f"{stage}={address}"]
    return out


@pytest.fixture
def local_pods(tiny_models: Path, tmp_path: Path) -> Iterator[tuple[str, list[LocalPod]]]:
    body = yaml.safe_load(TINY.read_text())
    spec = OmniPipelineSpec.model_validate(body["spec"])
    objects = render("tiny", "default", "uid-1", spec, default_image="unused")
    configmaps = {
        o["metadata"]["name"]: dict(o["data"]) for o in objects if o["kind"] == "ConfigMap"
    }
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    # The Secret the reconciler creates beside what render gives.
    secrets = {stage_keys_secret_name("tiny"): generate_stage_keys()}
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    stage_pods = [
        _translate(d, configmaps, secrets, tmp_path)
        for d in deployments
        if d["metadata"]["labels"]["omni.dev/component"] == "stages"
    ]
    (router_dep,) = [
        d for d in deployments if d["metadata"]["labels"]["omni.dev/component"] == "router"
    ]
    router = _translate(router_dep, configmaps, secrets, tmp_path)
    # A stage Service's port named stage-<id> leads to its pod's port of that number.
    replicas: dict[str, str] = {}
    for service in services.values():
        if service["spec"].get("clusterIP") != "None":
            continue
        pod = next(p for p in stage_pods if p.name == service["metadata"]["name"])
        for port in service["spec"]["ports"]:
            stage_id = port["name"].removeprefix("stage-")
            replicas[stage_id] = f"127.0.0.1:{pod.ports[port['targetPort']]}"
    router.argv = _router_argv(router.argv, replicas)
    base_env = {
        **os.environ,
        "OMNI_TINY_MODELS": str(tiny_models),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    procs: list[tuple[LocalPod, subprocess.Popen[bytes], Path]] = []
    try:
        for pod in [*stage_pods, router]:
            log = tmp_path / f"{pod.name}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    pod.argv,
                    env={**base_env, **pod.env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            procs.append((pod, proc, log))
        url = f"http://127.0.0.1:{router.ports[spec.router.port]}"

        def healthy() -> bool:
            for pod, proc, log in procs:
                if proc.poll() is not None:
                    raise AssertionError(
                        f"{pod.name} exited {proc.returncode}: {pod.argv}\n"
                        f"{log.read_text(errors='replace')[-3000:]}"
                    )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, 240, "the rendered router reports every stage live", interval=0.5)
        yield url, [*stage_pods, router]
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_rendered_tiny_pipeline_serves_an_image(
    local_pods: tuple[str, list[LocalPod]],
) -> None:
    url, pods = local_pods
    # Each stage pod's probes answer on the port its template names.
    for pod in pods[:-1]:
        probe_port = pod.ports[8081]
        with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/readyz", timeout=5) as r:
            assert r.status == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list().data]
    result = client.images.generate(
        model=model, prompt="a red square", size="64x64", n=1, response_format="b64_json"
    )
    assert result.data is not None
    png = base64.b64decode(result.data[0].b64_json or "")
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), png[:16]
