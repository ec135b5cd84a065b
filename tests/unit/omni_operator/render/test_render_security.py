"""What the renderer gives each pod of credentials, and the pipeline's NetworkPolicies."""

from __future__ import annotations

import json
from typing import Any

import zmq
from zmq.utils import z85

from omni_operator.api import OmniPipelineSpec
from omni_operator.render import render
from omni_operator.render.config import config_data, config_hash
from omni_operator.render.names import CHILD_KINDS, LABEL_COMPONENT, LABEL_PIPELINE, ChildKind
from omni_operator.render.secrets import API_KEYS_DIR, STAGE_KEYS_DIR, stage_keys_secret
from omni_operator.stage_keys import generate_stage_keys, z85_encode
from omni_runtime.config.credentials import CLIENT_FILES, KEYS_DIR_ENV, SERVER_FILES
from omni_runtime.kube import KIND_PLURALS
from pipeline_specs import spec_of, stage_of


def _render(spec: OmniPipelineSpec) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render("p", "ns", "uid-1", spec, default_image="img")
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _pod(deployment: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


def _mount(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == name]
    return mount


def test_operator_keys_are_curve_key_pairs_libzmq_accepts() -> None:
    keys = generate_stage_keys()
    for secret, public in (("server.key", "server.pub"), ("client.key", "client.pub")):
        assert zmq.curve_public(keys[secret].encode()) == keys[public].encode()
    assert keys["server.key"] != keys["client.key"]
    raw = bytes(range(32))
    assert z85_encode(raw) == z85.encode(raw).decode()


def test_each_pod_mounts_only_its_roles_stage_keys() -> None:
    objects = _render(spec_of([stage_of(0), stage_of(1)]))
    stage_pods = [
        _pod(o)
        for (kind, _), o in objects.items()
        if kind == "Deployment" and o["metadata"]["labels"][LABEL_COMPONENT] == "stages"
    ]
    assert stage_pods
    for pod, files in [
        *((p, SERVER_FILES) for p in stage_pods),
        (_pod(objects[("Deployment", "p-router")]), CLIENT_FILES),
    ]:
        secret = _volume(pod, "omni-stage-keys")["secret"]
        assert secret["secretName"] == "p-stage-keys"
        assert [item["key"] for item in secret["items"]] == list(files)
        assert _mount(pod, "omni-stage-keys") == {
            "name": "omni-stage-keys",
            "mountPath": STAGE_KEYS_DIR,
            "readOnly": True,
        }
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env[KEYS_DIR_ENV] == STAGE_KEYS_DIR


def test_the_api_key_secret_is_mounted_whole_for_rotation() -> None:
    spec = spec_of([stage_of(0)], router={"apiKeySecretRef": {"name": "keys"}})
    pod = _pod(_render(spec)[("Deployment", "p-router")])
    secret = _volume(pod, "omni-api-keys")["secret"]
    assert secret["secretName"] == "keys"
    assert secret["items"] == [{"key": "api-key", "path": "api-keys"}]
    mount = _mount(pod, "omni-api-keys")
    # A subPath mount would never see the rotated Secret.
    assert "subPath" not in mount
    args = pod["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == f"{API_KEYS_DIR}/api-keys"
    # The Secret's name is no part of the runtime's config: changing it rolls the router
    # alone (its pod template), not the stages.
    assert config_hash(config_data(spec, "p")) == config_hash(
        config_data(spec_of([stage_of(0)]), "p")
    )


def test_without_an_api_key_secret_the_router_asks_for_none() -> None:
    pod = _pod(_render(spec_of([stage_of(0)]))[("Deployment", "p-router")])
    assert "--api-key-file" not in pod["containers"][0]["args"]
    assert not [v for v in pod["volumes"] if v["name"] == "omni-api-keys"]


def test_stage_pods_admit_only_the_pipelines_pods_and_the_router_its_namespace() -> None:
    objects = _render(spec_of([stage_of(0)]))
    stages = objects[("NetworkPolicy", "p-stages")]["spec"]
    assert stages["podSelector"]["matchLabels"] == {
        LABEL_COMPONENT: "stages",
        LABEL_PIPELINE: "p",
    }
    assert stages["policyTypes"] == ["Ingress"]
    (rule,) = stages["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"][LABEL_PIPELINE] == "p"
    assert "namespaceSelector" not in peer  # the pipeline's namespace only

    router = objects[("NetworkPolicy", "p-router")]["spec"]
    assert router["podSelector"]["matchLabels"][LABEL_COMPONENT] == "router"
    (rule,) = router["ingress"]
    assert rule["from"] == [{"podSelector": {}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_allowed_from_replaces_the_routers_default_peers() -> None:
    peers = [
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
        {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
    ]
    spec = spec_of([stage_of(0)], router={"allowedFrom": peers, "port": 9000})
    router = _render(spec)[("NetworkPolicy", "p-router")]["spec"]
    assert router["ingress"] == [{"from": peers, "ports": [{"protocol": "TCP", "port": 9000}]}]


def test_the_stage_keys_secret_is_owned_immutable_and_the_only_place_of_the_keys() -> None:
    keys = generate_stage_keys()
    secret = stage_keys_secret("p", "ns", "uid-1", keys)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["immutable"] is True
    assert secret["stringData"] == keys
    rendered = json.dumps(render("p", "ns", "uid-1", spec_of([stage_of(0)]), default_image="i"))
    assert not any(value in rendered for value in keys.values())


def test_the_kube_client_knows_every_kind_the_operator_writes() -> None:
    written = [*CHILD_KINDS, ChildKind("v1", "Secret", "secrets")]
    assert {k.kind: KIND_PLURALS.get(k.kind) for k in written} == {
        k.kind: k.plural for k in written
    }
