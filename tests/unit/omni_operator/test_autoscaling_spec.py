"""``spec.stages[].autoscaling``: what it accepts, what it refuses and how it renders; the
autoscaler's pure parts (settings, the replicas it hands over, finding the routers)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from omni_operator.api import OmniPipelineSpec, runtime_config
from omni_operator.autoscaler import initial_replicas, router_endpoints, settings_of
from omni_operator.placement import check_spec, placement_groups
from omni_operator.planner import LatencyObjective
from omni_operator.render import render
from omni_operator.render.config import config_data
from omni_operator.render.names import OPERATOR_POD_LABEL
from pipeline_specs import spec_of, stage_of

PLANNER = {"maxReplicas": 6, "minReplicas": 2, "targetInFlight": 2}


def _render(spec: OmniPipelineSpec, **kwargs: Any) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render("p", "ns", "uid-1", spec, default_image="img", **kwargs)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_an_autoscaled_group_has_no_replicas_in_its_deployment_the_others_keep_theirs() -> None:
    spec = spec_of([stage_of(0, replicas=2), stage_of(1, autoscaling=PLANNER)])
    objects = _render(spec)
    assert objects[("Deployment", "p-s0")]["spec"]["replicas"] == 2
    assert "replicas" not in objects[("Deployment", "p-s1")]["spec"]
    # Up to 6 replicas: a PodDisruptionBudget keeps evictions one at a time.
    assert ("PodDisruptionBudget", "p-s1") in objects


def test_autoscaling_changes_no_pod_it_is_not_in_the_runtime_config() -> None:
    plain = spec_of([stage_of(0)])
    scaled = spec_of([stage_of(0, autoscaling=PLANNER)])
    assert config_data(plain, "p") == config_data(scaled, "p")
    assert "autoscaling" not in runtime_config(scaled).model_dump(by_alias=True)["stages"][0]


def test_the_operator_may_read_the_routers_metrics_only_where_a_stage_uses_the_planner() -> None:
    def router_peers(spec: OmniPipelineSpec, namespace: str | None) -> list[dict[str, Any]]:
        policy = _render(spec, operator_namespace=namespace)[("NetworkPolicy", "p-router")]
        peers: list[dict[str, Any]] = policy["spec"]["ingress"][0]["from"]
        return peers

    planned = spec_of([stage_of(0, autoscaling=PLANNER)])
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "omni-system"}},
        "podSelector": {"matchLabels": {OPERATOR_POD_LABEL: "omni-operator"}},
    }
    assert operator_peer in router_peers(planned, "omni-system")
    assert operator_peer not in router_peers(planned, None)
    external = spec_of([stage_of(0, autoscaling={"mode": "external"})])
    assert router_peers(external, "omni-system") == [{"podSelector": {}}]


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"minReplicas": 2}, "mode planner needs maxReplicas"),
        ({"maxReplicas": 2, "minReplicas": 3}, "maxReplicas (2) is below minReplicas (3)"),
        ({"mode": "external", "maxReplicas": 4}, "mode external leaves replicas to another"),
        ({"maxReplicas": 0}, "greater than or equal to 1"),
        ({"maxReplicas": 2, "targetInFlight": 0}, "greater than 0"),
        ({"maxReplicas": 2, "latencyObjective": {"seconds": 1, "percentile": 80}}, "50, 90"),
        ({"maxReplicas": 2, "scaleDownWindowSeconds": 7200}, "less than or equal to 3600"),
    ],
)
def test_bad_autoscaling_is_refused_saying_what_is_allowed(
    autoscaling: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        spec_of([stage_of(0, autoscaling=autoscaling)])


def test_stages_of_one_pod_must_scale_alike() -> None:
    spec = spec_of(
        [
            stage_of(0, "0", autoscaling=PLANNER),
            stage_of(1, "0", autoscaling={**PLANNER, "maxReplicas": 9}),
        ]
    )
    issues = dict(check_spec(spec))
    assert "stages[1].autoscaling" in issues
    assert "scale together" in issues["stages[1].autoscaling"]
    alike = spec_of([stage_of(0, "0", autoscaling=PLANNER), stage_of(1, "0", autoscaling=PLANNER)])
    assert check_spec(alike) == []


def test_the_planner_cannot_read_metrics_that_need_an_api_key() -> None:
    router = {
        "apiKeySecretRef": {"name": "keys"},
        "metricsNeedApiKey": True,
    }
    spec = spec_of([stage_of(0, autoscaling=PLANNER)], router=router)
    assert "unset metricsNeedApiKey" in dict(check_spec(spec))["router.metricsNeedApiKey"]
    external = spec_of([stage_of(0, autoscaling={"mode": "external"})], router=router)
    assert check_spec(external) == []


def test_settings_fill_in_the_defaults() -> None:
    spec = spec_of([stage_of(0, autoscaling={"maxReplicas": 4})])
    scaling = spec.stages[0].autoscaling
    assert scaling is not None
    settings = settings_of(scaling)
    assert (settings.min_replicas, settings.max_replicas) == (1, 4)
    assert settings.target_in_flight == 1.0
    assert (settings.scale_up_window_s, settings.scale_down_window_s) == (0.0, 300.0)
    latency = {"maxReplicas": 4, "latencyObjective": {"seconds": 2.5}, "scaleDownWindowSeconds": 0}
    scaling = spec_of([stage_of(0, autoscaling=latency)]).stages[0].autoscaling
    assert scaling is not None
    settings = settings_of(scaling)
    assert settings.target_in_flight is None  # latency alone
    assert settings.latency == LatencyObjective(90, 2.5)
    assert settings.scale_down_window_s == 0.0


def test_handed_over_replicas_keep_what_runs_within_the_bounds() -> None:
    spec = spec_of(
        [
            stage_of(0, replicas=1, autoscaling=PLANNER),
            stage_of(1, replicas=3, autoscaling={"mode": "external"}),
        ]
    )
    planned, external = placement_groups(spec)
    assert initial_replicas(planned, None) == 2  # stage replicas 1, raised to min 2
    assert initial_replicas(planned, 4) == 4
    assert initial_replicas(planned, 40) == 6
    assert initial_replicas(external, None) == 3
    assert initial_replicas(external, 40) == 40  # another autoscaler's, whatever it is


def test_routers_are_the_ready_endpoints_of_the_slices() -> None:
    slices = [
        {
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "r-a"},
                },
                {
                    "addresses": ["10.0.0.2"],
                    "conditions": {"ready": False},
                    "targetRef": {"name": "r-b"},
                },
                {"addresses": ["10.0.0.3"], "targetRef": {"name": "r-c"}},
            ],
        },
        {
            "addressType": "IPv6",
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": ["fd00::1"], "conditions": {"ready": True}}],
        },
        {"addressType": "FQDN", "ports": [{"port": 80}], "endpoints": [{"addresses": ["x.y"]}]},
    ]
    found = {e.key: e.url for e in router_endpoints(slices)}
    assert found == {
        "r-a": "http://10.0.0.1:8000/metrics",
        "r-c": "http://10.0.0.3:8000/metrics",
        "fd00::1": "http://[fd00::1]:8000/metrics",
    }


def test_an_omnipipeline_yaml_with_autoscaling_still_runs_locally() -> None:
    from omni_runtime.config.loader import strip_kubernetes_fields

    raw = {"model": "m", "stages": [{"stageId": 0, "type": "llm", "autoscaling": PLANNER}]}
    assert "autoscaling" not in strip_kubernetes_fields(raw)["stages"][0]


def test_the_planners_interval_comes_from_the_environment_within_bounds() -> None:
    from omni_operator.handlers import PLANNER_INTERVAL_ENV, planner_interval

    assert planner_interval({}) == 15.0
    assert planner_interval({PLANNER_INTERVAL_ENV: "2"}) == 2.0
    for bad in ("0", "abc", "601"):
        with pytest.raises(ValueError, match=re.escape("from 0.1 to 600")):
            planner_interval({PLANNER_INTERVAL_ENV: bad})
