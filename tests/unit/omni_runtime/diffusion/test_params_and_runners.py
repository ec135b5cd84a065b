"""A family's request knobs are declared once (``Family.request_fields``): the DiT's
parameters are the common ones and those fields, with the bounds the family declares; and
each family's DiTRecipe names the runner its pipeline runs through."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from omni_runtime.diffusion.engine_base import DiffusionEngineBase
from omni_runtime.diffusion.params import (
    DiffusionParams,
    InvalidRequestError,
    diffusers_params,
    parse_params,
    with_fields,
)
from omni_runtime.diffusion.runners.base import PipelineRunner, import_named, runner_class
from omni_runtime.families import FAMILIES, familyless_request_fields
from omni_runtime.families.base import RequestField

REPO = Path(__file__).resolve().parents[4]
COMMON = set(DiffusionParams.__struct_fields__)
DIFFUSERS = [name for name, family in FAMILIES.items() if family.dit.engine is None]
FIELDS = [(family.name, field) for family in FAMILIES.values() for field in family.request_fields]


@pytest.mark.parametrize("name", DIFFUSERS)
def test_a_family_dit_takes_the_common_parameters_and_its_own_fields(name: str) -> None:
    family = FAMILIES[name]
    fields = set(diffusers_params(family).__struct_fields__)
    assert fields == COMMON | {field.name for field in family.request_fields}


def test_a_pipeline_of_no_family_takes_every_diffusers_family_field() -> None:
    taken = set(diffusers_params(None).__struct_fields__) - COMMON
    assert taken == {field.name for field in familyless_request_fields()}
    assert {"true_cfg_scale", "cfg_normalization", "cfg_truncation"} <= taken
    # BAGEL's guidance is its own engine's, which no diffusers pipeline takes.
    assert "cfg_text_scale" not in taken


def _edges(field: RequestField) -> tuple[list[Any], list[Any]]:
    """Values ``field`` takes and values it refuses, at and beyond its declared bounds."""
    if field.kind == "boolean":
        return [True, False], [1, "yes"]
    if field.kind == "enum":
        return list(field.values), ["none of them", 1]
    good: list[Any] = []
    bad: list[Any] = ["1"]
    for bound in (field.ge, field.le):
        if bound is not None:
            good.append(bound)
    if field.ge is not None:
        bad.append(field.ge - 0.5)
    if field.gt is not None:
        bad.append(field.gt)
        good.append(field.gt + 0.5)
    if field.le is not None:
        bad.append(field.le + 0.5)
    if field.kind == "number_pair":
        return [[value, value] for value in good], [[value, value] for value in bad] + [[0.5]]
    return good, bad


@pytest.mark.parametrize(("family", "field"), FIELDS, ids=[f"{n}-{f.name}" for n, f in FIELDS])
def test_a_family_field_keeps_its_declared_bounds_in_the_dit(
    family: str, field: RequestField
) -> None:
    params = with_fields(DiffusionParams, FAMILIES[family].request_fields)
    good, bad = _edges(field)
    assert good, "a field the probe knows no valid value of"
    for value in good:
        parsed = parse_params({field.name: value}, "params", params)
        assert getattr(parsed, field.name) == (tuple(value) if isinstance(value, list) else value)
    for value in bad:
        with pytest.raises(InvalidRequestError) as refused:
            parse_params({field.name: value}, "params", params)
        # A pair names the element at fault: cfg_interval[0].
        assert (refused.value.error.param or "").startswith(field.name), value


def test_a_field_of_another_family_is_an_unknown_parameter() -> None:
    with pytest.raises(InvalidRequestError, match=r"params.true_cfg_scale: unknown parameter"):
        parse_params({"true_cfg_scale": 2.0}, "params", diffusers_params(FAMILIES["z-image"]))


def test_parameters_keep_the_common_set_name_and_type() -> None:
    params = diffusers_params(FAMILIES["qwen-image"])
    assert issubclass(params, DiffusionParams)
    assert params.__name__ == "DiffusionParams"
    # No field of its own: the common set itself.
    assert diffusers_params(FAMILIES["wan2.2"]) is DiffusionParams


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_names_a_runner_or_an_engine_that_imports(name: str) -> None:
    dit = FAMILIES[name].dit
    if dit.engine is not None:
        assert dit.runner is None, "an engine of its own runs no diffusers pipeline"
        assert issubclass(import_named(dit.engine), DiffusionEngineBase)
        return
    runner = runner_class(FAMILIES[name])
    assert issubclass(runner, PipelineRunner)
    assert (runner is PipelineRunner) == (dit.runner is None)


def test_the_quirky_pipelines_have_runners_of_their_own() -> None:
    runners = {name: runner_class(family).__name__ for name, family in FAMILIES.items()
               if family.dit.engine is None}  # fmt: skip
    assert runners == {
        "qwen-image": "PipelineRunner",
        "qwen-image-edit": "PipelineRunner",
        "qwen-image-edit-plus": "PipelineRunner",
        "z-image": "ZImageRunner",
        "wan2.2": "WanRunner",
        "hunyuanvideo-1.5": "HunyuanVideoRunner",
        "hunyuanvideo-1.5-i2v": "HunyuanVideoRunner",
    }
    assert runner_class(None) is PipelineRunner


def test_a_dit_with_an_engine_of_its_own_names_no_runner() -> None:
    with pytest.raises(ValueError, match="has no runner"):
        dataclasses.replace(FAMILIES["bagel"].dit, runner=FAMILIES["wan2.2"].dit.runner)


def test_every_runner_and_engine_a_family_names_is_kept_from_the_generic_layers() -> None:
    """The import-linter contract lists each module a DiTRecipe names by path, so that no
    generic layer imports one."""
    with open(REPO / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith("Only a family's DiTRecipe")]
    named = {
        path.partition(":")[0]
        for family in FAMILIES.values()
        for path in (family.dit.runner, family.dit.engine)
        if path is not None
    }
    assert named == set(contract["forbidden_modules"])
