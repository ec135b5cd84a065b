"""The renderer's part in rollouts that lose no request: preStop, the grace period derived
from the drain timeout, and the revision every stage pod advertises."""

from __future__ import annotations

from typing import Any

import pytest

from omni_operator.render import render
from omni_operator.render.pods import PRESTOP_DELAY_S, drain_timeout_s, grace_period_s
from omni_runtime.pod_contract import (
    ANNOTATION_CONFIG_HASH,
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_TIMEOUT_ENV,
    REVISION_ENV,
    DrainTimeoutError,
)
from omni_runtime.router import revisions
from pipeline_specs import spec_of, stage_of


def _deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Deployment"}


def _env(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var.get("value") for var in container["env"]}


def _render(spec: Any, generation: int = 0) -> dict[str, dict[str, Any]]:
    return _deployments(
        render("p", "ns", "uid-1", spec, default_image="img:1", config_generation=generation)
    )


def test_every_pod_sleeps_before_sigterm_and_has_time_to_drain() -> None:
    deployments = _render(spec_of([stage_of(0), stage_of(1)]))
    assert set(deployments) == {"p-s0", "p-s1", "p-router"}
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": PRESTOP_DELAY_S}}}, name
        assert _env(deployment)[DRAIN_TIMEOUT_ENV] == str(DEFAULT_DRAIN_TIMEOUT_S)
        grace = pod["terminationGracePeriodSeconds"]
        # SIGKILL never cuts a drain short: the sleep, the whole drain, then some.
        assert grace > PRESTOP_DELAY_S + DEFAULT_DRAIN_TIMEOUT_S, name
        assert grace == grace_period_s(DEFAULT_DRAIN_TIMEOUT_S)


def test_a_placement_drain_timeout_sets_its_pods_grace_period() -> None:
    env = [{"name": DRAIN_TIMEOUT_ENV, "value": "120"}]
    deployments = _render(spec_of([stage_of(0, placement={"env": env}), stage_of(1)]))
    slow, default = deployments["p-s0"], deployments["p-s1"]
    assert _env(slow)[DRAIN_TIMEOUT_ENV] == "120"
    (container,) = slow["spec"]["template"]["spec"]["containers"]
    assert [v["name"] for v in container["env"]].count(DRAIN_TIMEOUT_ENV) == 1
    assert slow["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 135
    assert default["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 45


def test_drain_timeout_is_read_as_the_runtime_reads_it() -> None:
    assert drain_timeout_s([{"name": DRAIN_TIMEOUT_ENV, "value": "7.5"}]) == 7.5
    assert drain_timeout_s([{"name": "OTHER", "value": "7.5"}]) == DEFAULT_DRAIN_TIMEOUT_S
    assert grace_period_s(7.5) == PRESTOP_DELAY_S + 8 + 10
    # check_spec refuses these first (test_placement.py); the renderer never guesses.
    for value in ("soon", "-1"):
        with pytest.raises(DrainTimeoutError):
            drain_timeout_s([{"name": DRAIN_TIMEOUT_ENV, "value": value}])


def test_stage_pods_advertise_generation_and_config_hash_and_the_router_none() -> None:
    spec = spec_of([stage_of(0), stage_of(1)])
    deployments = _render(spec, generation=7)
    for name in ("p-s0", "p-s1"):
        template = deployments[name]["spec"]["template"]
        config_hash = template["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
        assert _env(deployments[name])[REVISION_ENV] == f"7-{config_hash}"
        assert revisions.revision_key(f"7-{config_hash}").order == 7
    assert REVISION_ENV not in _env(deployments["p-router"])


def test_a_new_config_generation_orders_after_the_old_one() -> None:
    old = _env(_render(spec_of([stage_of(0)]), generation=3)["p-s0"])[REVISION_ENV]
    changed = spec_of([stage_of(0, defaultSamplingParams={"max_tokens": 9})])
    new = _env(_render(changed, generation=4)["p-s0"])[REVISION_ENV]
    assert old.split("-")[1] != new.split("-")[1]
    assert revisions.revision_key(new) > revisions.revision_key(old)


def test_a_placement_cannot_set_the_revision() -> None:
    env = [{"name": REVISION_ENV, "value": "999-forged"}]
    deployment = _render(spec_of([stage_of(0, placement={"env": env})]), generation=2)["p-s0"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    values = [v["value"] for v in container["env"] if v["name"] == REVISION_ENV]
    assert len(values) == 1
    assert values[0].startswith("2-")
