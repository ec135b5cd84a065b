"""What the operator refuses beyond the CRD, and how it says so (reconciler.parse_spec)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_operator.reconciler import SpecRefused, parse_spec

TINY = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-pipeline.yaml"


def tiny_spec() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(TINY.read_text())["spec"]
    return spec


def test_the_tiny_example_is_accepted() -> None:
    spec = parse_spec(tiny_spec())
    assert [stage.name for stage in spec.stages] == ["thinker", "dit"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda s: s["stages"][0]["placement"]["resources"]["requests"].update(cpu="lots"),
            "spec.stages[0].placement.resources.requests.cpu: 'lots' is not a Kubernetes quantity",
        ),
        (
            lambda s: s["stages"][1].update(devices="gpu0"),
            "spec.stages[1].devices: expected 'cpu'",
        ),
        (
            # Both stages on GPU 0 form one pod, so their replicas must agree.
            lambda s: [
                s["stages"][0].update(devices="0"),
                s["stages"][1].update(devices="0", replicas=2),
            ],
            "spec.stages[1].replicas: stage 'dit' shares a placement group",
        ),
        (
            lambda s: s["stages"][0]["placement"].update(env=[{"name": "HOME", "value": "/x"}]),
            "spec.stages[0].placement.env",
        ),
    ],
)
def test_a_refused_spec_names_the_field_under_spec(change: Any, expected: str) -> None:
    spec = copy.deepcopy(tiny_spec())
    change(spec)
    with pytest.raises(SpecRefused) as info:
        parse_spec(spec)
    assert expected in str(info.value)
