"""The OmniPipeline CustomResourceDefinition, generated from the API models.

``build_crd()`` turns the pydantic JSON schemas of ``OmniPipelineSpec`` and
``OmniPipelineStatus`` into a Kubernetes structural schema (``$ref`` inlined, no
``anyOf`` with null, free-form dicts kept with ``x-kubernetes-preserve-unknown-fields``,
quantities as int-or-string) and adds what only the apiserver can do: bounds that keep
the CEL rules within their cost budget, and the CEL rules for what crosses fields.

    python -m omni_operator.crd            # writes crds/omnipipelines.yaml
    python -m omni_operator.crd --check    # exits 1 when the checked-in file is stale

The CEL rules check pairs of stages; what needs the whole graph (placement groups chained
through three or more stages, merged placements) is checked by the operator
(``placement.check_spec``), which reports it as SpecValid=False.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from omni_runtime.adapters import ADAPTER_SOURCE_FORMS
from omni_runtime.config.connectors import SHARED_MEMORY_CONNECTOR
from omni_runtime.config.names import DNS_1035_LABEL_PATTERN, DNS_LABEL_PATTERN
from omni_runtime.config.stages import (
    GPU_SHARE_EPSILON,
    MAX_STAGE_ID,
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
)
from omni_runtime.config.step_cache import STEP_CACHE_OFF, STEP_CACHE_TIER_PATTERN
from omni_runtime.families import FAMILIES

from .api import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    OmniPipelineSpec,
    OmniPipelineStatus,
)

CRD_NAME = f"{PLURAL}.{GROUP}"
CATEGORIES = ("omni",)
DEFAULT_OUTPUT = Path(__file__).resolve().parents[2] / "crds" / f"{PLURAL}.yaml"

# Bounds for everything a CEL rule walks: the apiserver refuses a CRD whose rules could
# cost too much on the largest object the schema admits, so lists, maps and strings that
# rules iterate over must be bounded.
MAX_STAGES = 16
MAX_CONNECTORS = 16
MAX_INPUT_CONNECTORS = 8
# 40 holds all ids of a 16-GPU node ("0,1,...,15" is 37 characters).
MAX_DEVICES_LENGTH = 40
MAX_NAME_LENGTH = 63
MAX_FREE_FORM_KEYS = 64
# GPU ids whose memory shares the CRD's rules sum (one rule each): those of a 16-GPU node.
CEL_CHECKED_GPUS = 16
# Adapters a pipeline declares (PipelineConfig's bound too).
MAX_ADAPTERS = 64
_HUB_ID = "^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$"

# A key of inputConnectors. At most nine digits, so that int() in a rule cannot overflow;
# MAX_STAGE_ID is far below that anyway.
_FROM_STAGE_KEY = "^from_stage_(0|[1-9][0-9]{0,8})$"
_GPU_IDS = "^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*$"
# Roughly what devices allows (its own rule is exact), cheaply enough to guard others.
_DEVICES_FORM = "^(cpu|[0-9,]*)$"
_GPU_RESOURCE = "nvidia.com/gpu"
_DEVICES_ALLOWED = "'cpu', '' (same as cpu), or comma-separated GPU ids such as '0' or '0,1'"
_OTHER_CONNECTORS = "use a TCPConnector or MooncakeTransferEngineConnector"

# Keys pydantic writes that mean the same in a Kubernetes schema.
_KEPT_KEYS = frozenset(
    {
        "type",
        "description",
        "enum",
        "default",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "format",
    }
)
# Keys that carry nothing the apiserver needs (title) or that the conversion replaces.
_HANDLED_KEYS = frozenset(
    {
        "title",
        "$ref",
        "anyOf",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)


class SchemaError(ValueError):
    """A pydantic schema construct that has no faithful structural form."""


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of OmniPipeline, as a JSON-able mapping."""
    spec = to_structural(OmniPipelineSpec.model_json_schema(mode="validation"))
    status = to_structural(OmniPipelineStatus.model_json_schema(mode="validation"))
    _add_spec_rules(spec)
    _add_status_rules(status)
    root: dict[str, Any] = {
        "type": "object",
        "description": "OmniPipeline is a multi-stage model pipeline (an LLM stage feeding a "
        "diffusion stage, say) served behind one OpenAI-compatible endpoint; the operator "
        "runs it as Deployments and Services.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "The versioned schema of this object: omni.dev/v1alpha1.",
            },
            "kind": {"type": "string", "description": "The REST resource: OmniPipeline."},
            # The apiserver allows nothing here but name and generateName, not even a
            # description.
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": MAX_NAME_LENGTH}},
            },
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                # The pipeline's Service is named after it, and Service names are DNS-1035.
                "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
                f"self.metadata.name.matches('{DNS_1035_LABEL_PATTERN}')",
                "messageExpression": "'\\'' + self.metadata.name + '\\' names the "
                "pipeline\\'s Service, so it must be a DNS-1035 label: at most 63 lower-case "
                "letters, digits and \\'-\\', starting with a letter and ending with a letter "
                "or digit'",
                "fieldPath": ".metadata.name",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": ".status.ready",
                            "description": "Ready stages / stages.",
                        },
                        {
                            "name": "Phase",
                            "type": "string",
                            "jsonPath": ".status.phase",
                            "description": "Pending, Progressing, Ready, Degraded or Failed.",
                        },
                        {
                            "name": "Endpoint",
                            "type": "string",
                            "jsonPath": ".status.endpoint",
                            "description": "The in-cluster URL of the pipeline's router.",
                        },
                        {
                            "name": "Age",
                            "type": "date",
                            "jsonPath": ".metadata.creationTimestamp",
                        },
                    ],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def to_structural(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema (draft 2020-12, with ``$defs``) as a structural schema."""
    defs: Mapping[str, Any] = schema.get("$defs", {})
    body = {key: value for key, value in schema.items() if key != "$defs"}
    return _convert(body, defs)


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        # The field's own keys (its description, say) win over the model's.
        target = _convert(defs[node["$ref"].removeprefix("#/$defs/")], defs)
        return {**target, **_convert({k: v for k, v in node.items() if k != "$ref"}, defs)}
    if "anyOf" in node:
        return _convert_any_of(node, defs)

    unknown = set(node) - _KEPT_KEYS - _HANDLED_KEYS
    if unknown:
        raise SchemaError(f"no structural form for schema keys {sorted(unknown)} in {node}")
    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT_KEYS}
    if out.get("default", 0) is None:
        # null is "absent" here: the apiserver prunes nulls of non-nullable fields.
        del out["default"]
    # Draft 2020-12 gives the bound itself; OpenAPI 3.0 a flag beside minimum/maximum.
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if exclusive in node:
            out[bound] = node[exclusive]
            out[exclusive] = True

    if "properties" in node:
        out["properties"] = {
            name: _convert(prop, defs) for name, prop in node["properties"].items()
        }
        if node.get("required"):
            out["required"] = list(node["required"])
        # additionalProperties: false (extra="forbid") is left out: a structural schema may
        # not have both, and the apiserver prunes unknown fields (kubectl refuses them).
    elif "additionalProperties" in node:
        extra = node["additionalProperties"]
        if extra is True:
            # Free-form (engine arguments, a Kubernetes Affinity, ...): kept as written.
            out["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(extra, Mapping):
            out["additionalProperties"] = _convert(extra, defs)
    if "items" in node:
        out["items"] = _convert(node["items"], defs)
    return out


def _convert_any_of(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    options = [option for option in node["anyOf"] if option != {"type": "null"}]
    if len(options) == 1:
        # Optional[X]: absent rather than null.
        merged = {**_convert(options[0], defs), **_convert(outer, defs)}
        return merged
    types = sorted(option.get("type", "") for option in options)
    if types == ["integer", "string"] and all(
        set(option) <= {"type", "pattern"} for option in options
    ):
        # int-or-string; a string's pattern (a quantity's grammar) applies to strings only.
        patterns = [option["pattern"] for option in options if "pattern" in option]
        return {
            **_convert(outer, defs),
            "x-kubernetes-int-or-string": True,
            **({"pattern": patterns[0]} if patterns else {}),
        }
    raise SchemaError(f"no structural form for anyOf {node['anyOf']}")


def _at(schema: dict[str, Any], *path: str) -> dict[str, Any]:
    """The subschema at ``path``: property names, "[]" for list items, "{}" for map values."""
    node = schema
    for step in path:
        if step == "[]":
            node = node["items"]
        elif step == "{}":
            node = node["additionalProperties"]
        else:
            node = node["properties"][step]
    return node


def _rule(
    rule: str,
    *,
    message: str | None = None,
    message_expression: str | None = None,
    field_path: str | None = None,
    reason: str | None = None,
) -> dict[str, str]:
    out = {"rule": " ".join(rule.split())}
    if message is not None:
        out["message"] = message
    if message_expression is not None:
        out["messageExpression"] = " ".join(message_expression.split())
    if field_path is not None:
        out["fieldPath"] = field_path
    if reason is not None:
        out["reason"] = reason
    return out


def _validations(node: dict[str, Any], *rules: dict[str, str]) -> None:
    node.setdefault("x-kubernetes-validations", []).extend(rules)


# CEL building blocks. The apiserver estimates each rule's cost on the largest object the
# schema admits and refuses the CRD when it is too high, which shapes these: a stage's key
# is made with format() and looked up in the map (constant cost), GPU sharing is one regex
# match instead of a split-and-compare, and messages are a single format() call (the
# estimator cannot bound a concatenation with format's or string()'s result).


def _key(stage: str) -> str:
    """The inputConnectors key that names ``stage``."""
    return f"'from_stage_%d'.format([{stage}.stageId])"


def _share_gpu(a: str, b: str) -> str:
    """``a`` and ``b`` have a GPU id in common. The guard keeps ``a``'s devices digits and
    commas, which the regex is built from; 'cpu' and '' share nothing."""
    return (
        f"({a}.devices.matches('^[0-9,]+$') && "
        f"{b}.devices.matches('(^|,)(' + {a}.devices.replace(',', '|') + ')(,|$)'))"
    )


def _first(items: str, var: str, condition: str) -> str:
    """The first of ``items`` for which ``condition`` (on ``var``) holds; only evaluated in
    a message, where the rule has failed, so there is one."""
    return f"{items}.filter({var}, {condition})[0]"


def _message(template: str, *args: str) -> str:
    return _message_of(template, f"[{', '.join(args)}]")


def _message_of(template: str, args: str) -> str:
    """``template`` filled from the CEL list ``args``. Messages that name what failed build
    that list in one comprehension: nesting a search inside another's condition would
    repeat it per element, which the cost estimate refuses (CEL here has no let)."""
    return f"{_cel_string(template)}.format({args})"


def _cel_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _first_pair(outer: str, inner: str, condition: str, fields: str) -> str:
    """``[fields]`` of the first (s, inner) with ``condition``: s over the stages (those
    with inputConnectors when ``inner`` is their keys), ``inner`` as given."""
    return (
        f"self.stages.map(s, {inner}.filter({outer}, {condition}).map({outer}, [{fields}]))"
        ".flatten()[0]"
    )


def _add_spec_rules(spec: dict[str, Any]) -> None:
    spec["required"] = sorted(set(spec.get("required", [])) | {"model", "stages"})
    _at(spec, "model")["maxLength"] = 1024
    _at(spec, "router")["default"] = {}
    connectors = _at(spec, "connectors")
    connectors["maxProperties"] = MAX_CONNECTORS
    _at(connectors, "{}", "extra")["maxProperties"] = MAX_FREE_FORM_KEYS

    stages = _at(spec, "stages")
    stages["maxItems"] = MAX_STAGES
    # A map keyed by stageId: the apiserver itself reports a repeated id as a Duplicate
    # value, and server-side apply merges stages by id.
    stages["x-kubernetes-list-type"] = "map"
    stages["x-kubernetes-list-map-keys"] = ["stageId"]
    named_twice = "has(s.name) && !self.exists_one(t, has(t.name) && t.name == s.name)"
    _validations(
        stages,
        # The list-map already refuses a repeated id; this says it in words.
        _rule(
            "self.all(s, self.exists_one(t, t.stageId == s.stageId))",
            message_expression=_message_of(
                "stage ids must be unique: %d stages have stageId %d",
                "self.filter(s, !self.exists_one(t, t.stageId == s.stageId)).map(s, "
                "[self.filter(t, t.stageId == s.stageId).size(), s.stageId])[0]",
            ),
        ),
        _rule(
            f"self.all(s, !({named_twice}))",
            message_expression=_message_of(
                "stage names must be unique: stages %d and %d are both named %s",
                "self.map(s, self.filter(t, has(s.name) && has(t.name) && t.name == s.name "
                "&& t.stageId > s.stageId).map(t, [s.stageId, t.stageId, s.name])).flatten()[0]",
            ),
        ),
    )
    _add_stage_rules(_at(stages, "[]"))
    _add_adapter_rules(spec)
    _add_placement_rules(_at(spec, "router", "placement"))
    _validations(
        _at(spec, "router"),
        # One Redis for the jobs: the operator's or the user's (placement.py says the rest).
        _rule(
            "!has(self.videoStore) || !has(self.videos) || !has(self.videos.storeUrl)",
            message="set one of videoStore (a Redis the operator runs) or videos.storeUrl "
            "(your own), not both",
            field_path=".videoStore",
        ),
        _rule(
            "!has(self.videoStore) || !has(self.videoStorePasswordSecretRef)",
            message="the operator makes the password of the Redis that videoStore runs; "
            "videoStorePasswordSecretRef is for a Redis that videos.storeUrl names",
            field_path=".videoStorePasswordSecretRef",
        ),
    )

    # Each key k of a stage s's inputConnectors names an existing stage...
    unknown_stage = f"k.matches('{_FROM_STAGE_KEY}') && !self.stages.exists(u, {_key('u')} == k)"
    # ... and its value a declared connector.
    unknown_connector = "!has(self.connectors) || !(s.inputConnectors[k] in self.connectors)"
    inputs = "(has(s.inputConnectors) ? s.inputConnectors : {})"
    defined = (
        "has(self.connectors) && size(self.connectors) > 0 ? "
        "'%s'.format([self.connectors.map(c, c)]) : 'none (define them under spec.connectors)'"
    )
    _validations(
        spec,
        _rule(
            f"self.stages.all(s, !{inputs}.exists(k, {unknown_stage}))",
            message_expression=_message_of(
                "stage %d's inputConnectors.%s: no stage has id %s; stage ids: %s",
                _first_pair("k", inputs, unknown_stage, "s.stageId, k, k.substring(11)")
                + " + [self.stages.map(u, u.stageId)]",
            ),
            field_path=".stages",
        ),
        _rule(
            f"self.stages.all(s, !{inputs}.exists(k, {unknown_connector}))",
            message_expression=_message_of(
                "stage %d's inputConnectors.%s: unknown connector '%s'; defined connectors: %s",
                _first_pair("k", inputs, unknown_connector, "s.stageId, k, s.inputConnectors[k]")
                + f" + [{defined}]",
            ),
            field_path=".stages",
        ),
        _shared_memory_rule(),
        _equal_replicas_rule(),
        _equal_autoscaling_rule(),
        _stage_type_rule(),
        *_gpu_memory_rules(),
    )


def _add_adapter_rules(spec: dict[str, Any]) -> None:
    """What PipelineConfig checks of its adapters, where CEL can say it: the name and source
    forms, a repeated name (the list-map), an adapter of a stage that is not there, and of a
    stage that certainly takes none. Where a stage takes its name from its family's
    topology, any of the topologies' names for its id is taken here, and the operator checks
    the exact one (SpecValid=False)."""
    adapters = _at(spec, "adapters")
    adapters["maxItems"] = MAX_ADAPTERS
    # Keyed by name: the apiserver itself reports a repeated name as a Duplicate value.
    adapters["x-kubernetes-list-type"] = "map"
    adapters["x-kubernetes-list-map-keys"] = ["name"]
    adapter = _at(adapters, "[]")
    _at(adapter, "stage")["maxLength"] = MAX_NAME_LENGTH
    _at(adapter, "source")["maxLength"] = 1024
    _validations(
        adapter,
        _rule(
            f"self.source.startsWith('/') || self.source.startsWith('https://') || "
            f"self.source.matches('{_HUB_ID}')",
            message_expression=_message(f"'%s' is not {ADAPTER_SOURCE_FORMS}", "self.source"),
            field_path=".source",
        ),
    )
    topology_names: dict[int, set[str]] = {}
    for family in FAMILIES.values():
        for known in family.topology:
            topology_names.setdefault(known.stage_id, set()).add(known.name)
    by_topology = "false"
    for stage_id, names in sorted(topology_names.items()):
        listed = ", ".join(f"'{name}'" for name in sorted(names))
        by_topology = f"(s.stageId == {stage_id} ? a.stage in [{listed}] : {by_topology})"
    named = (
        f"(has(s.name) ? s.name == a.stage : "
        f"(a.stage == 'stage-%d'.format([s.stageId]) || {by_topology}))"
    )
    engines = sorted(f.name for f in FAMILIES.values() if f.dit.engine is not None)
    listed_engines = ", ".join(f"'{name}'" for name in engines)
    encoder = "has(s.type) && s.type == 'llm' && has(s.output) && s.output == 'hidden_states'"
    _validations(
        spec,
        _rule(
            f"!has(self.adapters) || self.adapters.all(a, self.stages.exists(s, {named}))",
            message_expression=_message_of(
                "adapter '%s' names stage '%s', which is not a stage of this pipeline",
                f"self.adapters.filter(a, !self.stages.exists(s, {named}))"
                ".map(a, [a.name, a.stage])[0]",
            ),
            field_path=".adapters",
        ),
        _rule(
            f"!has(self.adapters) || size(self.adapters) == 0 || !has(self.family) || "
            f"!(self.family in [{listed_engines}])",
            message_expression=_message(
                "a %s pipeline takes no adapters: its DiT runs on its own engine, not a "
                "diffusers pipeline, and its LLM stages encode or speak for it",
                "self.family",
            ),
            field_path=".adapters",
        ),
        _rule(
            f"!has(self.adapters) || !self.adapters.exists(a, self.stages.exists(s, "
            f"has(s.name) && s.name == a.stage && {encoder}))",
            message_expression=_message_of(
                "adapter '%s': stage '%s' takes no adapters: an encoder stage's hidden states "
                "condition the DiT as the family's recipe computes them",
                f"self.adapters.filter(a, self.stages.exists(s, has(s.name) && s.name == a.stage "
                f"&& {encoder})).map(a, [a.name, a.stage])[0]",
            ),
            field_path=".adapters",
        ),
    )


def _stage_type_rule() -> dict[str, str]:
    """A stage may leave out type only where the pipeline's family's topology gives it one
    (the runtime's model fills it in before it validates): the family the spec names, else
    the one whose name is in the last part of the model path, the longest name winning, as
    family_of_model_name finds it."""
    by_name = by_family = "false"
    # Shortest name first, so that the longest ends up tested first.
    for family in sorted(FAMILIES.values(), key=lambda f: len(f.name)):
        ids = f"s.stageId in [{', '.join(str(s.stage_id) for s in family.topology)}]"
        in_basename = (
            f"self.model.lowerAscii().matches(r'{re.escape(family.name)}[^/\\\\]*[/\\\\]*$')"
        )
        by_name = f"({in_basename} ? {ids} : {by_name})"
        by_family = f"(self.family == '{family.name}' ? {ids} : {by_family})"
    gives_type = f"(has(self.family) ? {by_family} : {by_name})"
    untyped = f"!has(s.type) && !{gives_type}"
    return _rule(
        f"!self.stages.exists(s, {untyped})",
        message_expression=_message_of(
            "stage %d has no type, and no known topology of model '%s' gives it one; set "
            "type to llm or diffusion",
            f"self.stages.filter(s, {untyped}).map(s, [s.stageId, self.model])[0]",
        ),
        field_path=".stages",
    )


def _shared_memory_rule() -> dict[str, str]:
    name = f"s.inputConnectors[{_key('u')}]"
    # u feeds s through a SharedMemoryConnector, though they share no GPU and one of them
    # shares a GPU with no other stage: then it is a placement group of its own (a cpu
    # stage always is), so the two run in different pods. Placement groups are the
    # transitive closure of sharing a GPU id, which CEL cannot follow in general; so this
    # rule refuses only what is certainly wrong, never a group chained through other
    # stages, and the operator checks the rest (placement.check_spec -> SpecValid=False).
    offending = (
        # Devices that are not valid have a message of their own.
        f"s.devices.matches('{_DEVICES_FORM}') && u.devices.matches('{_DEVICES_FORM}') && "
        f"has(s.inputConnectors) && {_key('u')} in s.inputConnectors && "
        f"has(self.connectors) && {name} in self.connectors && "
        f"self.connectors[{name}].name == '{SHARED_MEMORY_CONNECTOR}' && "
        f"!{_share_gpu('s', 'u')} && "
        f"(!self.stages.exists(t, t.stageId != s.stageId && {_share_gpu('s', 't')}) || "
        f"!self.stages.exists(t, t.stageId != u.stageId && {_share_gpu('t', 'u')}))"
    )
    return _rule(
        f"self.stages.all(s, self.stages.all(u, !({offending})))",
        message_expression=_message_of(
            "stage %d (devices '%s') takes input from stage %d (devices '%s') through "
            "connector '%s', a SharedMemoryConnector, which only works between stages of "
            "one placement group (one pod: stages whose devices share a GPU id; a cpu stage "
            "is a group of its own); give both stages a common GPU id in devices, or "
            f"{_OTHER_CONNECTORS}",
            _first_pair(
                "u", "self.stages", offending, f"s.stageId, s.devices, u.stageId, u.devices, {name}"
            ),
        ),
        field_path=".stages",
    )


def _equal_replicas_rule() -> dict[str, str]:
    # Pairwise equality over stages that share a GPU is exact: equality is transitive, so
    # it holds across a whole placement group.
    unequal = f"s.replicas != t.replicas && {_share_gpu('s', 't')}"
    return _rule(
        f"self.stages.all(s, self.stages.all(t, !({unequal})))",
        message_expression=_message_of(
            "stages %d and %d share a GPU, so they run in one pod (a placement group) and "
            "must have equal replicas, not %d and %d",
            _first_pair(
                "t", "self.stages", unequal, "s.stageId, t.stageId, s.replicas, t.replicas"
            ),
        ),
        field_path=".stages",
    )


def _equal_autoscaling_rule() -> dict[str, str]:
    # As replicas: a placement group is one Deployment, scaled as one.
    unequal = (
        "(has(s.autoscaling) != has(t.autoscaling) || "
        "(has(s.autoscaling) && s.autoscaling != t.autoscaling)) && "
        f"{_share_gpu('s', 't')}"
    )
    return _rule(
        f"self.stages.all(s, self.stages.all(t, !({unequal})))",
        message_expression=_message_of(
            "stages %d and %d share a GPU, so they run in one pod (a placement group) and "
            "scale together: give them equal autoscaling",
            _first_pair("t", "self.stages", unequal, "s.stageId, t.stageId"),
        ),
        field_path=".stages",
    )


def _gpu_memory_rules() -> list[dict[str, str]]:
    """The gpuMemoryUtilization of the stages on a GPU id sum to at most 1 (an unset share
    counted as PipelineConfig counts it: vLLM's default for an llm stage, nothing for a
    diffusion stage; config.stages.VLLM_DEFAULT_GPU_MEMORY_UTILIZATION says why).

    One rule per GPU id below CEL_CHECKED_GPUS, each with the id written into its regex:
    the ids a rule could take from devices (split) have no size bound the cost estimate
    knows, and a regex built from one makes the rule cost too much. Higher ids, and a stage
    that leaves type to its model's topology and its share unset (counted as nothing here),
    are left to the operator (SpecValid=False), so the rules refuse only what is certainly
    over-subscribed."""
    share = (
        "(has(t.gpuMemoryUtilization) ? t.gpuMemoryUtilization : "
        f"has(t.type) && t.type == 'llm' ? {VLLM_DEFAULT_GPU_MEMORY_UTILIZATION!r} : 0.0)"
    )
    rules = []
    for gpu in range(CEL_CHECKED_GPUS):
        on_gpu = f"self.stages.filter(t, t.devices.matches('(^|,){gpu}(,|$)'))"
        total = f"{on_gpu}.map(t, {share}).sum()"
        rules.append(
            _rule(
                f"{total} <= {1 + GPU_SHARE_EPSILON!r}",
                message_expression=_message(
                    # Each stage's share is not listed: format prints a list of doubles
                    # as [0.600000, ...], and joining their strings costs too much.
                    f"GPU {gpu} is over-subscribed: the gpuMemoryUtilization of the stages on "
                    "it (stages %s) sum to %s, more than 1; lower them so that they sum "
                    "to at most 1 (an llm stage without gpuMemoryUtilization counts as "
                    f"vLLM's default, {VLLM_DEFAULT_GPU_MEMORY_UTILIZATION!r}; a diffusion "
                    "stage without it is not capped and not counted)",
                    f"{on_gpu}.map(t, t.stageId)",
                    total,
                ),
                field_path=".stages",
            )
        )
    return rules


def _add_stage_rules(stage: dict[str, Any]) -> None:
    # name and type are filled in by the runtime's model before it validates (from the
    # model's known topology, else stage-<stageId>); a type no topology gives is reported
    # by the operator (SpecValid=False).
    stage["required"] = [name for name in stage.get("required", []) if name not in {"name", "type"}]
    _at(stage, "stageId")["maximum"] = MAX_STAGE_ID

    name = _at(stage, "name")
    name["maxLength"] = MAX_NAME_LENGTH
    _validations(
        name,
        _rule(
            f"self.matches('{DNS_LABEL_PATTERN}')",
            message_expression=_message(
                "name '%s' is not a DNS label: use lower-case letters, digits and '-', "
                "starting and ending with a letter or digit (e.g. thinker, stage-0)",
                "self",
            ),
        ),
    )
    _at(stage, "model")["maxLength"] = 1024

    devices = _at(stage, "devices")
    devices["maxLength"] = MAX_DEVICES_LENGTH
    _validations(
        devices,
        _rule(
            f"self == '' || self == 'cpu' || self.matches('{_GPU_IDS}')",
            message_expression=_message(f"devices must be {_DEVICES_ALLOWED}, not '%s'", "self"),
        ),
        _rule(
            "self.split(',').all(g, self.split(',').exists_one(h, h == g))",
            message_expression=_message(
                "devices lists GPU id %s more than once in '%s'; list each GPU once",
                "self.split(',').filter(g, !self.split(',').exists_one(h, h == g))[0]",
                "self",
            ),
        ),
    )

    step_cache = _at(stage, "stepCache")
    bad_tier = f"!k.matches('{STEP_CACHE_TIER_PATTERN}') || k == '{STEP_CACHE_OFF}'"
    _validations(
        _at(step_cache, "tiers"),
        _rule(
            f"self.all(k, !({bad_tier}))",
            message_expression=_message(
                "tier name '%s': use 1-31 lower-case letters, digits and '-', starting with "
                f"a letter, and not '{STEP_CACHE_OFF}' (always a tier)",
                f"self.filter(k, {bad_tier})[0]",
            ),
        ),
    )
    _validations(
        step_cache,
        _rule(
            f"!has(self.default) || self.default == '{STEP_CACHE_OFF}' "
            "|| self.default in self.tiers",
            # Listing the tiers here would cost more than the apiserver's CEL budget allows.
            message_expression=_message(
                f"default: '%s' is not a tier; use '{STEP_CACHE_OFF}' or one of tiers' names",
                "self.default",
            ),
            field_path=".default",
        ),
    )

    inputs = _at(stage, "inputConnectors")
    inputs["maxProperties"] = MAX_INPUT_CONNECTORS
    _at(inputs, "{}")["maxLength"] = MAX_NAME_LENGTH
    _validations(
        inputs,
        _rule(
            f"self.all(k, k.matches('{_FROM_STAGE_KEY}'))",
            message_expression=_message(
                "keys must have the form from_stage_<id> (e.g. from_stage_0), not %s",
                f"self.filter(k, !k.matches('{_FROM_STAGE_KEY}'))[0]",
            ),
        ),
    )
    later = f"k.matches('{_FROM_STAGE_KEY}') && int(k.substring(11)) > self.stageId"
    _validations(
        stage,
        _rule(
            f"!has(self.inputConnectors) || !({_key('self')} in self.inputConnectors)",
            message_expression=_message(
                "stage %d cannot take input from itself (from_stage_%d); a stage takes "
                "input only from stages with lower ids",
                "self.stageId",
                "self.stageId",
            ),
            field_path=".inputConnectors",
        ),
        _rule(
            f"!has(self.inputConnectors) || !self.inputConnectors.exists(k, {later})",
            message_expression=_message(
                "stage %d cannot take input from a later stage (%s); a stage takes input "
                "only from stages with lower ids",
                "self.stageId",
                _first("self.inputConnectors", "k", later),
            ),
            field_path=".inputConnectors",
        ),
        _rule(
            "!has(self.stepCache) || !has(self.type) || self.type == 'diffusion'",
            message="only diffusion stages cache steps; remove stepCache from this llm stage",
            field_path=".stepCache",
        ),
        _rule(
            "!has(self.torchCompile) || !self.torchCompile || !has(self.type) "
            "|| self.type == 'diffusion'",
            message="only diffusion stages take torchCompile (vLLM compiles an llm stage on "
            "its own: see enforceEager); remove it from this llm stage",
            field_path=".torchCompile",
        ),
        _rule(
            "!has(self.maxLoraRank) || !has(self.type) || self.type == 'llm'",
            message="only llm stages take maxLoraRank (vLLM sizes its adapter slots by it; a "
            "diffusion stage loads any rank); remove it from this diffusion stage",
            field_path=".maxLoraRank",
        ),
        _rule(
            "!has(self.output) || !has(self.type) || self.type == 'llm'",
            message="only llm stages have an output kind (text or hidden_states); remove "
            "output from this diffusion stage",
            field_path=".output",
        ),
    )
    _add_autoscaling_rules(_at(stage, "autoscaling"))
    # engineArgs repeating a stage field (ENGINE_ARG_FIELDS) is left to the operator's
    # validation: CEL cannot see the keys of a free-form object.
    for free_form in ("defaultSamplingParams", "engineArgs"):
        _at(stage, free_form)["maxProperties"] = MAX_FREE_FORM_KEYS
    _add_placement_rules(_at(stage, "placement"))


def _add_autoscaling_rules(autoscaling: dict[str, Any]) -> None:
    # What StageAutoscaling's own validator checks, so that kubectl apply refuses it.
    planner_only = "has(self.{0})"
    planner_fields = (
        "minReplicas",
        "maxReplicas",
        "targetInFlight",
        "latencyObjective",
        "scaleUpWindowSeconds",
        "scaleDownWindowSeconds",
    )
    given = " || ".join(planner_only.format(name) for name in planner_fields)
    _validations(
        autoscaling,
        _rule(
            f"self.mode != 'external' || !({given})",
            message="mode external leaves replicas to another autoscaler, so minReplicas, "
            "maxReplicas, targetInFlight, latencyObjective and the windows would do nothing; "
            "remove them, or use mode planner",
        ),
        _rule(
            "self.mode != 'planner' || has(self.maxReplicas)",
            message="mode planner needs maxReplicas: the most replicas it may run",
            field_path=".maxReplicas",
        ),
        _rule(
            "!has(self.maxReplicas) || self.maxReplicas >= (has(self.minReplicas) ? "
            "self.minReplicas : 1)",
            message_expression=_message(
                "maxReplicas (%d) is below minReplicas (%d)",
                "self.maxReplicas",
                "has(self.minReplicas) ? self.minReplicas : 1",
            ),
            field_path=".maxReplicas",
        ),
    )


def _add_placement_rules(placement: dict[str, Any]) -> None:
    for kind in ("requests", "limits"):
        resources = _at(placement, "resources", kind)
        resources["maxProperties"] = MAX_FREE_FORM_KEYS
        _validations(
            resources,
            _rule(
                f"!('{_GPU_RESOURCE}' in self)",
                message=f"{_GPU_RESOURCE} is set by the operator from the stages' devices; "
                "remove it",
            ),
        )


def _add_status_rules(status: dict[str, Any]) -> None:
    # Keyed lists, as Kubernetes' own conditions are, so that a status patch of one entry
    # merges instead of replacing the list.
    for path, key in ((("conditions",), "type"), (("stages",), "stageId")):
        node = _at(status, *path)
        node["x-kubernetes-list-type"] = "map"
        node["x-kubernetes-list-map-keys"] = [key]


def render_yaml(crd: Mapping[str, Any]) -> str:
    """The YAML of crds/omnipipelines.yaml."""
    header = (
        "# Generated by `python -m omni_operator.crd` from omni_operator/api.py; do not edit.\n"
    )
    return header + yaml.dump(crd, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        # A schema repeated in two places is written out twice, not as &id001/*id001.
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Multi-line descriptions (model docstrings) stay readable.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_operator.crd",
        description="Write the OmniPipeline CRD generated from the API models.",
    )
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the file differs from what would be generated",
    )
    args = parser.parse_args(argv)
    return write_or_check(
        args.output, render_yaml(build_crd()), args.check, "python -m omni_operator.crd"
    )


def write_or_check(output: Path, wanted: str, check: bool, command: str) -> int:
    """A generated file's command: write ``wanted`` to ``output`` (printing its path), or
    with ``check`` write nothing and exit 1 with a diff if ``output`` is stale."""
    if check:
        current = output.read_text(encoding="utf-8") if output.exists() else ""
        if current == wanted:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            fromfile=f"{output} (checked in)",
            tofile=f"{output} (generated)",
        )
        sys.stderr.write("".join(diff))
        sys.stderr.write(f"\n{output} is stale: regenerate it with `{command}`\n")
        return 1
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(wanted, encoding="utf-8")
    print(output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
