"""Reading a pipeline config from a file or mapping, and writing its normalised form."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omni_runtime.families import family_of_model_name, read_checkpoint_family

from .errors import PipelineConfigError, join_path
from .models import PipelineConfig

# A file may hold the pipeline at its root (the engine's deploy YAML), under this key, or as
# the spec of an OmniPipeline resource (what `kubectl apply -f` takes).
WRAPPER_KEY = "pipeline"
RESOURCE_KIND = "OmniPipeline"
_RESOURCE_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
# What an OmniPipeline's spec adds to the pipeline to say where things run in a cluster
# (omni_operator.api); a local run, and the config a pod loads, has none of it.
KUBERNETES_ONLY_FIELDS = {
    "spec": ("image", "imagePullPolicy"),
    "stage": ("placement", "autoscaling"),
    "router": (
        "replicas",
        "serviceType",
        "placement",
        "apiKeySecretRef",
        "videoStorePasswordSecretRef",
        "videoStore",
        "allowedFrom",
    ),
}
_STAGE_TYPE = re.compile(r"stages\[[0-9]+\]\.type")


def load_pipeline(
    source: str | os.PathLike[str] | Mapping[str, Any], *, model: str | None = None
) -> PipelineConfig:
    """Load and validate a pipeline from a YAML/JSON file path or an already-parsed mapping.

    ``model`` (given apart, like ``vllm serve MODEL --deploy-config FILE``) overrides or
    fills the config's ``model``. Raises PipelineConfigError listing every problem found.
    """
    origin: str | None
    if isinstance(source, Mapping):
        origin, data = None, source
    else:
        origin = os.fspath(source)
        data = _read(Path(origin))
    data, prefix = _unwrap(data, origin)
    if model is not None:
        data = {**data, "model": model}
    try:
        return PipelineConfig.model_validate(with_checkpoint_family(data))
    except ValidationError as error:
        # `from None`: pydantic's own dump is what this error exists to replace.
        found = PipelineConfigError.from_validation_error(error, PipelineConfig, source=origin)
        issues = [
            (join_path(prefix, path), message)
            for path, message in found.issues
            if not _follows_from_missing_model(path, message, found.issues)
        ]
        raise PipelineConfigError(issues, source=origin) from None


def with_checkpoint_family(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` (a pipeline, not yet validated) with its family read from its checkpoints,
    where it names none and its model's name gives none: a stage's own model or the
    pipeline's, a local directory whose model_index.json or config.json names a known
    family. Read before validation, so that the family's topology gives its stages their
    types and its rules apply, as they do to a model whose name gives its family."""
    model = data.get("model")
    if data.get("family") is not None or (
        isinstance(model, str) and family_of_model_name(model) is not None
    ):
        return data
    stages = data.get("stages")
    paths = [
        stage["model"]
        for stage in (stages if isinstance(stages, list) else [])
        if isinstance(stage, Mapping) and isinstance(stage.get("model"), str)
    ]
    if isinstance(model, str):
        paths.append(model)
    for path in paths:
        family = read_checkpoint_family(path)
        if family is not None:
            return {**data, "family": family.name}
    return data


def dump_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """The normalised camelCase form: JSON-able, and ``load_pipeline`` of it equals ``config``.

    Unset optional fields are left out rather than written as null.
    """
    return config.model_dump(mode="json", by_alias=True, exclude_none=True)


def strip_kubernetes_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` (an OmniPipeline's, camelCase) without its placement fields."""
    result = {k: v for k, v in spec.items() if k not in KUBERNETES_ONLY_FIELDS["spec"]}
    stages = result.get("stages")
    if isinstance(stages, list):
        result["stages"] = [
            {k: v for k, v in stage.items() if k not in KUBERNETES_ONLY_FIELDS["stage"]}
            if isinstance(stage, Mapping)
            else stage
            for stage in stages
        ]
    router = result.get("router")
    if isinstance(router, Mapping):
        result["router"] = {
            k: v for k, v in router.items() if k not in KUBERNETES_ONLY_FIELDS["router"]
        }
    return result


def _follows_from_missing_model(path: str, message: str, issues: list[tuple[str, str]]) -> bool:
    # Without a model no topology can give stage types, so "type: required" would only
    # repeat, once per stage, what the missing model already says.
    return (
        _STAGE_TYPE.fullmatch(path) is not None
        and message.startswith("required")
        and any(other == "model" for other, _ in issues)
    )


def _read(path: Path) -> Any:
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PipelineConfigError(
            [(where, f"cannot read the file: {error.strerror or error}")], source=where
        ) from None
    except UnicodeDecodeError as error:
        raise PipelineConfigError(
            [(where, f"not UTF-8 text: {error.reason} at byte {error.start}")], source=where
        ) from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            message = f"invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
            raise PipelineConfigError([(where, message)], source=where) from None
        except RecursionError:
            raise PipelineConfigError([(where, _too_deep())], source=where) from None
        if nesting_depth(data, MAX_NESTING) > MAX_NESTING:
            raise PipelineConfigError([(where, _too_deep())], source=where)
        return data
    try:
        documents = [d for d in yaml.load_all(text, Loader=_StrictSafeLoader) if d is not None]
    except yaml.YAMLError as error:
        raise PipelineConfigError([(where, _describe_yaml_error(error))], source=where) from None
    if len(documents) <= 1:
        return documents[0] if documents else None
    # A manifest that brings what its pipeline mounts (a PersistentVolumeClaim) beside it,
    # as `kubectl apply -f` takes it: the one OmniPipeline is the pipeline.
    pipelines = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == "OmniPipeline"]
    if len(pipelines) != 1:
        raise PipelineConfigError(
            [
                (
                    where,
                    f"the file holds {len(documents)} YAML documents and {len(pipelines)} "
                    "OmniPipeline(s); give one pipeline, or a manifest with exactly one "
                    "OmniPipeline",
                )
            ],
            source=where,
        )
    return pipelines[0]


# Far deeper than any pipeline (about 6 levels, engineArgs included), far shallower than
# the interpreter's recursion limit, which the parsers would otherwise reach.
MAX_NESTING = 64


def _too_deep() -> str:
    return f"nested deeper than {MAX_NESTING} levels; a pipeline file needs a handful"


def nesting_depth(value: Any, limit: int) -> int:
    """How deep lists and maps nest in ``value`` (parsed JSON or YAML), counted up to
    ``limit`` + 1. Iterative: the input may be nested deeper than Python can recurse."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth <= limit:
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _unwrap(data: Any, origin: str | None) -> tuple[dict[str, Any], str]:
    """The pipeline mapping in ``data``, and the path prefix under which it was found."""
    where = origin or "<input>"
    if data is None:
        raise PipelineConfigError([(where, "empty; expected a pipeline mapping")], source=origin)
    if not isinstance(data, Mapping):
        raise PipelineConfigError(
            [
                (
                    where,
                    f"expected a mapping (stages, connectors, ...) at the top level, "
                    f"got {_kind(data)}",
                )
            ],
            source=origin,
        )
    if "kind" in data or "apiVersion" in data:
        return _unwrap_resource(data, origin), "spec"
    if WRAPPER_KEY in data and set(data) <= {WRAPPER_KEY, "model"}:
        inner = data[WRAPPER_KEY]
        if not isinstance(inner, Mapping):
            raise PipelineConfigError(
                [(WRAPPER_KEY, f"expected a pipeline mapping, got {_kind(inner)}")], source=origin
            )
        if "model" in data:
            inner = {"model": data["model"], **inner}
        return dict(inner), WRAPPER_KEY
    return dict(data), ""


def _unwrap_resource(data: Mapping[str, Any], origin: str | None) -> dict[str, Any]:
    """The spec of an OmniPipeline resource, less where its pods run; its metadata and
    status say nothing to a run either."""
    issues = []
    if data.get("kind") != RESOURCE_KIND:
        issues.append(("kind", f"expected {RESOURCE_KIND}, got {data.get('kind')!r}"))
    for key in data:
        if key not in _RESOURCE_FIELDS:
            issues.append((str(key), f"unknown field; allowed: {', '.join(_RESOURCE_FIELDS)}"))
    spec = data.get("spec")
    if not isinstance(spec, Mapping):
        found = "nothing" if spec is None else _kind(spec)
        issues.append(("spec", f"expected the pipeline mapping, got {found}"))
    if issues:
        raise PipelineConfigError(issues, source=origin)
    assert isinstance(spec, Mapping)
    return strip_kubernetes_fields(spec)


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        problem = error.problem or error.context or "invalid YAML"
        if mark is not None:
            return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
        return f"invalid YAML: {problem}"
    return f"invalid YAML: {error}"


class _StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice, which PyYAML would let the last one win,
    and nesting deeper than MAX_NESTING, which its recursive composer would meet as a
    RecursionError."""

    _nesting = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._nesting += 1
        try:
            if self._nesting > MAX_NESTING:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.composer.ComposerError(None, None, _too_deep(), mark)
            return super().compose_node(parent, index)
        finally:
            self._nesting -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"key {key!r} is given twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
