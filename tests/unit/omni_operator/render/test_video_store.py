"""A managed video store (router.videoStore): the Redis the routers share video jobs
through, as the renderer and the reconciler make it."""

from __future__ import annotations

import json
from typing import Any

from omni_operator.api import DEFAULT_VIDEO_STORE_IMAGE, OmniPipelineSpec
from omni_operator.render import render
from omni_operator.render.video_store import maxmemory_bytes, video_store_secret
from omni_runtime.config import VIDEO_STORE_PASSWORD_ENV, load_pipeline
from omni_runtime.pod_contract import ANNOTATION_CONFIG_HASH
from pipeline_specs import spec_of

NAME = "clips"


def _video_spec(**router: Any) -> OmniPipelineSpec:
    return spec_of(
        [{"stageId": 0, "name": "dit", "type": "diffusion"}], family="wan2.2", router=router
    )


def _objects(spec: OmniPipelineSpec) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render(NAME, "demo", "uid-1", spec, default_image="img:1")
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _pipeline(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    config = next(o for (kind, _), o in objects.items() if kind == "ConfigMap")
    loaded: dict[str, Any] = json.loads(next(iter(config["data"].values())))
    return loaded


def test_the_store_is_a_redis_pod_its_service_and_a_policy_for_the_routers_only() -> None:
    objects = _objects(_video_spec(replicas=2, videoStore={"memory": "2Gi"}))
    names = [key for key in objects if key[1] == f"{NAME}-video-store"]
    assert sorted(names) == [
        ("Deployment", f"{NAME}-video-store"),
        ("NetworkPolicy", f"{NAME}-video-store"),
        ("Service", f"{NAME}-video-store"),
    ]
    # Applied before the routers that use it.
    order = list(objects)
    assert order.index(("Deployment", f"{NAME}-video-store")) < order.index(
        ("Deployment", f"{NAME}-router")
    )

    deployment = objects[("Deployment", f"{NAME}-video-store")]["spec"]
    # One Redis, never two at once (a surge would split the jobs between them).
    assert deployment["replicas"] == 1
    assert deployment["strategy"] == {"type": "Recreate"}
    pod = deployment["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == DEFAULT_VIDEO_STORE_IMAGE
    command = container["command"]
    assert command[:2] == ["redis-server", "/etc/omni/video-store/redis.conf"]
    options = dict(zip(command[2::2], command[3::2], strict=True))
    assert options["--maxmemory"] == str(3 * 2**30 // 2)  # three quarters of 2Gi
    assert options["--maxmemory-policy"] == "noeviction"
    assert options["--appendonly"] == "yes"
    assert options["--port"] == "6379"
    assert container["resources"]["limits"] == {"memory": "2Gi"}
    # No password anywhere in the pod spec: it comes as the Secret's redis.conf.
    assert "requirepass" not in json.dumps(pod)
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["secret"]["secretName"] == f"{NAME}-video-store"
    assert next(v for v in pod["volumes"] if v["name"] == "data") == {
        "name": "data",
        "emptyDir": {},
    }
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False

    service = objects[("Service", f"{NAME}-video-store")]["spec"]
    assert service["ports"][0]["port"] == 6379
    assert service["selector"] == deployment["selector"]["matchLabels"]
    policy = objects[("NetworkPolicy", f"{NAME}-video-store")]["spec"]
    router_pods = objects[("Deployment", f"{NAME}-router")]["spec"]["template"]["metadata"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= router_pods["labels"].items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


def test_the_routers_find_the_store_by_its_service_and_its_password_in_its_secret() -> None:
    objects = _objects(_video_spec(videoStore={}))
    pipeline = _pipeline(objects)
    assert pipeline["router"]["videos"]["storeUrl"] == f"redis://{NAME}-video-store:6379/0"
    # The runtime loads what the ConfigMap holds, Kubernetes fields left out.
    assert "videoStore" not in pipeline["router"]
    assert load_pipeline(pipeline).router.videos is not None
    router = objects[("Deployment", f"{NAME}-router")]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    assert env[VIDEO_STORE_PASSWORD_ENV]["valueFrom"] == {
        "secretKeyRef": {"name": f"{NAME}-video-store", "key": "password"}
    }


def test_a_pipeline_change_rolls_the_routers_but_not_the_store() -> None:
    # The store's pod holds the jobs: nothing but its own settings may restart it.
    before = _objects(_video_spec(videoStore={}))
    after = _objects(
        spec_of(
            [{"stageId": 0, "name": "dit", "type": "diffusion",
              "defaultSamplingParams": {"num_inference_steps": 7}}],
            family="wan2.2",
            router={"videoStore": {}},
        )
    )  # fmt: skip
    key = ("Deployment", f"{NAME}-video-store")
    assert before[key] == after[key]
    assert ANNOTATION_CONFIG_HASH not in json.dumps(before[key])
    router = ("Deployment", f"{NAME}-router")
    assert before[router] != after[router]


def test_a_claim_keeps_the_append_only_file() -> None:
    spec = _video_spec(
        videoStore={
            "persistentVolumeClaim": "clip-jobs",
            "image": "valkey/valkey:8.1",
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "spot", "operator": "Exists"}],
        }
    )
    pod = _objects(spec)[("Deployment", f"{NAME}-video-store")]["spec"]["template"]["spec"]
    data = next(v for v in pod["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"] == {"claimName": "clip-jobs"}
    assert pod["containers"][0]["image"] == "valkey/valkey:8.1"
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]


def test_maxmemory_reads_kubernetes_quantities() -> None:
    assert maxmemory_bytes("1Gi") == 3 * 2**28
    assert maxmemory_bytes("4G") == 3 * 10**9
    assert maxmemory_bytes(1000) == 750
    assert maxmemory_bytes("lots") is None


def test_no_store_without_the_field() -> None:
    objects = _objects(_video_spec())
    assert not [key for key in objects if "video-store" in key[1]]
    assert "storeUrl" not in json.dumps(_pipeline(objects))


def test_the_secret_is_immutable_and_goes_with_the_pipeline() -> None:
    secret = video_store_secret(NAME, "demo", "uid-1", "00ff")
    assert secret["immutable"] is True
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == "uid-1"
    assert owner["kind"] == "OmniPipeline"
