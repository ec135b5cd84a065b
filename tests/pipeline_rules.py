"""One table of OmniPipeline specs, valid and invalid, for both places the pipeline's
rules are written: the CRD's (CEL and the schema, crd.py) and the operator's own (the
pydantic models of api.py and omni_runtime.config, and placement.check_spec), so that
the two cannot drift apart unnoticed.

Each invalid case breaks one valid pipeline in one way and says what each side must
answer: ``cel``, what `kubectl apply` must print (the field's path and the cause;
tests/cluster/test_crd_validation.py, against a real apiserver), and ``python``, what
the operator's own check (``reconciler.parse_spec``) must say (tests/unit/
omni_operator/test_pipeline_rules.py, on every run). ``python`` is None only where the rule is the
CRD's alone, and the unit test lists those. Every valid case must pass both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Manifest = dict[str, Any]


def base_pipeline(name: str = "p") -> Manifest:
    """A valid pipeline that each case below breaks in exactly one way: a thinker and a DiT
    sharing GPU 0 (one placement group) joined by shared memory."""
    return {
        "apiVersion": "omni.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name},
        "spec": {
            "model": "/models/tiny",
            "stages": [
                {"stageId": 0, "name": "thinker", "type": "llm", "devices": "0"},
                {
                    "stageId": 1,
                    "name": "dit",
                    "type": "diffusion",
                    "devices": "0",
                    "inputConnectors": {"from_stage_0": "shm"},
                },
            ],
            "connectors": {
                "shm": {"name": "SharedMemoryConnector"},
                "tcp": {"name": "TCPConnector"},
            },
        },
    }


def stage(manifest: Manifest, index: int) -> dict[str, Any]:
    result: dict[str, Any] = manifest["spec"]["stages"][index]
    return result


Breaker = Callable[[Manifest], object]


def _set(index: int, **fields: object) -> Breaker:
    return lambda m: stage(m, index).update(fields)


def _spec(**fields: object) -> Breaker:
    return lambda m: m["spec"].update(fields)


def _del_spec(field: str) -> Breaker:
    return lambda m: m["spec"].pop(field)


def _both(*breakers: Breaker) -> Breaker:
    return lambda m: [b(m) for b in breakers]


def _adapter(name: str, stage_name: str) -> dict[str, str]:
    return {"name": name, "stage": stage_name, "source": f"/loras/{name}.safetensors"}


@dataclass(frozen=True)
class RuleCase:
    """A pipeline broken one way, and what each side must say of it."""

    id: str
    breaker: Breaker
    # Substrings of the apiserver's refusal: the field's path and the cause.
    cel: list[str]
    # Substrings of the operator's SpecRefused; None: the CRD's rule alone judges it.
    python: list[str] | None

    def manifest(self, name: str = "p") -> Manifest:
        manifest = base_pipeline(name)
        self.breaker(manifest)
        return manifest


INVALID: list[RuleCase] = [
    RuleCase(
        "duplicate-stage-id",
        _set(1, stageId=0, inputConnectors={}),
        cel=[
            "spec.stages[1]: Duplicate value",
            '"stageId":0',
            "stage ids must be unique: 2 stages have stageId 0",
        ],
        python=["spec.stages[1].stageId", "stage ids must be unique"],
    ),
    RuleCase(
        "duplicate-stage-name",
        _set(1, name="thinker"),
        cel=["spec.stages", "stage names must be unique", "stages 0 and 1 are both named thinker"],
        python=["spec.stages[1].name", "stage names must be unique"],
    ),
    RuleCase(
        "input-from-missing-stage",
        _set(1, inputConnectors={"from_stage_7": "shm"}),
        cel=["spec.stages", "stage 1's inputConnectors.from_stage_7: no stage has id 7"],
        python=["spec.stages[1].inputConnectors.from_stage_7", "not from a later stage"],
    ),
    RuleCase(
        "input-from-later-stage",
        _both(_set(0, inputConnectors={"from_stage_1": "tcp"}), _set(1, inputConnectors={})),
        cel=[
            "spec.stages[0].inputConnectors",
            "stage 0 cannot take input from a later stage (from_stage_1)",
        ],
        python=["spec.stages[0].inputConnectors.from_stage_1", "not from a later stage"],
    ),
    RuleCase(
        "input-from-itself",
        _set(1, inputConnectors={"from_stage_1": "tcp"}),
        cel=["spec.stages[1].inputConnectors", "stage 1 cannot take input from itself"],
        python=["spec.stages[1].inputConnectors.from_stage_1", "not from itself"],
    ),
    RuleCase(
        "input-key-form",
        _set(1, inputConnectors={"stage_0": "tcp"}),
        cel=[
            "spec.stages[1].inputConnectors",
            "keys must have the form from_stage_<id>",
            "stage_0",
        ],
        python=[
            "spec.stages[1].inputConnectors.stage_0",
            "keys must have the form from_stage_<id>",
        ],
    ),
    RuleCase(
        "unknown-connector-name",
        _set(1, inputConnectors={"from_stage_0": "nvlink"}),
        cel=["spec.stages", "stage 1's inputConnectors.from_stage_0: unknown connector 'nvlink'"],
        python=["spec.stages[1].inputConnectors.from_stage_0", "unknown connector 'nvlink'"],
    ),
    RuleCase(
        "unknown-connector-class",
        lambda m: m["spec"]["connectors"]["shm"].update(name="NvlinkConnector"),
        cel=["spec.connectors.shm.name", 'Unsupported value: "NvlinkConnector"', "TCPConnector"],
        python=["spec.connectors.shm.name", "unknown connector class 'NvlinkConnector'"],
    ),
    RuleCase(
        "shared-memory-across-gpus",
        _set(1, devices="1"),
        cel=[
            "spec.stages",
            "stage 1 (devices '1') takes input from stage 0 (devices '0') through connector "
            "'shm', a SharedMemoryConnector, which only works between stages of one "
            "placement group",
        ],
        python=[
            "spec.stages[1].inputConnectors.from_stage_0",
            "is a SharedMemoryConnector, which only works inside one pod",
        ],
    ),
    RuleCase(
        "shared-memory-from-cpu",
        _set(0, devices="cpu"),
        cel=["spec.stages", "stage 1 (devices '0') takes input from stage 0 (devices 'cpu')"],
        python=[
            "spec.stages[1].inputConnectors.from_stage_0",
            "is a SharedMemoryConnector, which only works inside one pod",
        ],
    ),
    RuleCase(
        "unequal-replicas-in-group",
        _set(1, replicas=2),
        cel=[
            "spec.stages",
            "stages 0 and 1 share a GPU, so they run in one pod (a placement group) and must "
            "have equal replicas, not 1 and 2",
        ],
        python=["spec.stages[1].replicas", "so it must have the same replicas (1), not 2"],
    ),
    RuleCase(
        "devices-syntax",
        _set(0, devices="gpu0"),
        cel=["spec.stages[0].devices", "devices must be 'cpu'", "not 'gpu0'"],
        python=["spec.stages[0].devices", "got 'gpu0'"],
    ),
    RuleCase(
        "devices-repeated-id",
        _both(_set(0, devices="0,0"), _set(1, devices="0,0")),
        cel=["spec.stages[0].devices", "devices lists GPU id 0 more than once in '0,0'"],
        python=["spec.stages[0].devices", "GPU id 0 listed more than once in '0,0'"],
    ),
    RuleCase(
        "negative-replicas",
        _both(_set(0, replicas=-1), _set(1, replicas=-1)),
        cel=["spec.stages[0].replicas", "should be greater than or equal to 0"],
        python=["spec.stages[0].replicas", "greater than or equal to 0"],
    ),
    RuleCase(
        "replicas-as-string",
        _set(0, replicas="2"),
        cel=["spec.stages[0].replicas", "must be of type integer"],
        python=["spec.stages[0].replicas", "a valid integer"],
    ),
    RuleCase(
        "gpu-memory-utilization-above-one",
        _set(0, gpuMemoryUtilization=1.5),
        cel=["spec.stages[0].gpuMemoryUtilization", "should be less than or equal to 1"],
        python=["spec.stages[0].gpuMemoryUtilization", "got 1.5"],
    ),
    RuleCase(
        "gpu-memory-utilization-zero",
        _set(0, gpuMemoryUtilization=0),
        cel=["spec.stages[0].gpuMemoryUtilization", "should be greater than 0"],
        python=["spec.stages[0].gpuMemoryUtilization", "got 0"],
    ),
    RuleCase(
        "router-port-zero",
        _spec(router={"port": 0}),
        cel=["spec.router.port", "should be greater than or equal to 1"],
        python=["spec.router.port", "greater than or equal to 1"],
    ),
    RuleCase(
        "router-port-too-high",
        _spec(router={"port": 70000}),
        cel=["spec.router.port", "should be less than or equal to 65535"],
        python=["spec.router.port", "less than or equal to 65535"],
    ),
    RuleCase(
        "unknown-stage-type",
        _set(1, type="vae"),
        cel=["spec.stages[1].type", 'Unsupported value: "vae"', '"llm", "diffusion"'],
        python=["spec.stages[1].type", "'llm' or 'diffusion'"],
    ),
    RuleCase(
        "unknown-field",
        _set(0, gpus=1),
        cel=['unknown field "spec.stages[0].gpus"'],
        python=["spec.stages[0].gpus", "unknown field 'gpus'"],
    ),
    RuleCase(
        "stage-name-not-dns-label",
        _set(0, name="Thinker_1"),
        cel=["spec.stages[0].name", "name 'Thinker_1' is not a DNS label"],
        python=["spec.stages[0].name", "'Thinker_1' is not a valid name"],
    ),
    RuleCase(
        "missing-model",
        _del_spec("model"),
        cel=["spec.model", "Required value"],
        python=["spec.model", "required"],
    ),
    RuleCase(
        "missing-stages",
        _del_spec("stages"),
        cel=["spec.stages", "Required value"],
        python=["spec.stages", "required"],
    ),
    RuleCase(
        "no-stages",
        _spec(stages=[]),
        cel=["spec.stages", "should have at least 1 items"],
        python=["spec.stages", "at least 1 item"],
    ),
    RuleCase(
        "step-cache-on-llm-stage",
        _set(0, stepCache={"tiers": {"fast": {}}}),
        cel=["spec.stages[0].stepCache", "only diffusion stages cache steps"],
        python=["spec.stages[0].stepCache", "only diffusion stages cache steps"],
    ),
    RuleCase(
        "step-cache-tier-named-off",
        _set(1, stepCache={"tiers": {"off": {"interval": 2}}}),
        cel=["spec.stages[1].stepCache.tiers", "tier name 'off'", "always a tier"],
        python=["spec.stages[1].stepCache.tiers", "tier name 'off'", "always a tier"],
    ),
    RuleCase(
        "step-cache-default-not-a-tier",
        _set(1, stepCache={"tiers": {"fast": {}}, "default": "faster"}),
        cel=["spec.stages[1].stepCache.default", "'faster' is not a tier; use 'off' or one of"],
        python=["spec.stages[1].stepCache", "'faster' is not a tier; tiers: off, fast"],
    ),
    RuleCase(
        "step-cache-interval-1",
        _set(1, stepCache={"tiers": {"fast": {"interval": 1}}}),
        cel=["spec.stages[1].stepCache.tiers.fast.interval", "greater than or equal to 2"],
        python=["spec.stages[1].stepCache.tiers.fast.interval", "greater than or equal to 2"],
    ),
    RuleCase(
        "torch-compile-on-llm-stage",
        _set(0, torchCompile=True),
        cel=["spec.stages[0].torchCompile", "only diffusion stages take torchCompile"],
        python=["spec.stages[0].torchCompile", "only diffusion stages take torchCompile"],
    ),
    RuleCase(
        "output-on-diffusion-stage",
        _set(1, output="text"),
        cel=["spec.stages[1].output", "only llm stages have an output kind"],
        python=["spec.stages[1].output", "only llm stages have an output kind"],
    ),
    RuleCase(
        "gpu-in-placement-resources",
        _set(0, placement={"resources": {"limits": {"nvidia.com/gpu": 1}}}),
        cel=[
            "spec.stages[0].placement.resources.limits",
            "nvidia.com/gpu is set by the operator from the stages' devices",
        ],
        python=[
            "spec.stages[0].placement.resources.limits",
            "nvidia.com/gpu is set by the operator from devices",
        ],
    ),
    RuleCase(
        "resource-quantity-not-a-quantity",
        _set(0, placement={"resources": {"requests": {"cpu": "lots"}}}),
        cel=["spec.stages[0].placement.resources.requests.cpu", "should match"],
        python=[
            "spec.stages[0].placement.resources.requests.cpu",
            "'lots' is not a Kubernetes quantity",
        ],
    ),
    RuleCase(
        "tensor-parallel-size-zero",
        _set(0, tensorParallelSize=0),
        cel=["spec.stages[0].tensorParallelSize", "should be greater than 0"],
        python=["spec.stages[0].tensorParallelSize", "greater than 0"],
    ),
    RuleCase(
        "router-policy",
        _spec(router={"policy": "random"}),
        cel=["spec.router.policy", 'Unsupported value: "random"', '"round-robin"'],
        python=[
            "spec.router.policy",
            "'round-robin', 'least-outstanding-requests', 'least-outstanding-work' or 'sticky'",
        ],
    ),
    RuleCase(
        "stage-type-missing",
        lambda m: stage(m, 0).pop("type"),
        cel=[
            "spec.stages",
            "stage 0 has no type, and no known topology of model '/models/tiny' gives it one",
        ],
        python=["spec.stages[0].type", "no known topology for this model gives this stage a type"],
    ),
    RuleCase(
        "stage-type-missing-topology-in-directory",
        _both(_spec(model="/models/bagel/tiny"), lambda m: stage(m, 1).pop("type")),
        cel=["spec.stages", "stage 1 has no type, and no known topology of model"],
        python=["spec.stages[1].type", "no known topology for this model gives this stage a type"],
    ),
    RuleCase(
        "gpu-over-subscribed",
        _both(_set(0, gpuMemoryUtilization=0.6), _set(1, gpuMemoryUtilization=0.6)),
        cel=[
            "spec.stages",
            "GPU 0 is over-subscribed: the gpuMemoryUtilization of the stages on it "
            "(stages [0, 1]) sum to 1.2, more than 1; lower them so that they sum to at most 1",
            "an llm stage without gpuMemoryUtilization counts as vLLM's default, 0.92",
        ],
        python=["spec.stages", "GPU 0 is over-subscribed", "sum to 1.2, more than 1"],
    ),
    RuleCase(
        "gpu-over-subscribed-by-an-unset-llm-share",
        _set(1, gpuMemoryUtilization=0.1),
        cel=["spec.stages", "GPU 0 is over-subscribed", "sum to 1.02, more than 1"],
        python=[
            "spec.stages",
            "GPU 0 is over-subscribed",
            "sum to 1.02",
            "unset: vLLM's default 0.92",
        ],
    ),
    RuleCase(
        "gpu-over-subscribed-by-a-whole-gpu",
        _both(_set(0, gpuMemoryUtilization=1), _set(1, gpuMemoryUtilization=0.5)),
        cel=["spec.stages", "GPU 0 is over-subscribed", "(stages [0, 1]) sum to 1.5"],
        python=["spec.stages", "GPU 0 is over-subscribed", "sum to 1.5"],
    ),
    RuleCase(
        "gpu-over-subscribed-on-the-second-gpu",
        _both(
            _set(0, devices="0,1", gpuMemoryUtilization=0.6),
            _set(1, devices="1", gpuMemoryUtilization=0.5),
        ),
        cel=["spec.stages", "GPU 1 is over-subscribed", "(stages [0, 1]) sum to 1.1, more than 1"],
        python=["spec.stages", "GPU 1 is over-subscribed", "sum to 1.1"],
    ),
    RuleCase(
        "autoscaling-unequal-in-a-placement-group",
        _both(_set(0, autoscaling={"maxReplicas": 4}), _set(1, autoscaling={"maxReplicas": 8})),
        cel=["spec.stages", "stages 0 and 1 share a GPU", "give them equal autoscaling"],
        python=["spec.stages[1].autoscaling", "give them equal autoscaling"],
    ),
    RuleCase(
        "autoscaling-planner-without-a-maximum",
        _both(_set(0, autoscaling={"minReplicas": 2}), _set(1, autoscaling={"minReplicas": 2})),
        cel=["spec.stages[0].autoscaling.maxReplicas", "mode planner needs maxReplicas"],
        python=["spec.stages[0].autoscaling", "mode planner needs maxReplicas"],
    ),
    RuleCase(
        "autoscaling-maximum-below-minimum",
        _both(
            _set(0, autoscaling={"minReplicas": 3, "maxReplicas": 2}),
            _set(1, autoscaling={"minReplicas": 3, "maxReplicas": 2}),
        ),
        cel=["spec.stages[0].autoscaling.maxReplicas", "maxReplicas (2) is below minReplicas (3)"],
        python=["spec.stages[0].autoscaling", "maxReplicas (2) is below minReplicas (3)"],
    ),
    RuleCase(
        "autoscaling-external-with-planner-fields",
        _both(
            _set(0, autoscaling={"mode": "external", "maxReplicas": 2}),
            _set(1, autoscaling={"mode": "external", "maxReplicas": 2}),
        ),
        cel=["spec.stages[0].autoscaling", "mode external leaves replicas to another autoscaler"],
        python=[
            "spec.stages[0].autoscaling",
            "mode external leaves replicas to another autoscaler",
        ],
    ),
    RuleCase(
        "video-store-beside-a-store-url",
        _spec(router={"videoStore": {}, "videos": {"storeUrl": "redis://redis:6379/0"}}),
        cel=["spec.router.videoStore", "set one of videoStore", "not both"],
        python=["router.videoStore"],
    ),
    RuleCase(
        "video-store-with-a-password-of-the-users",
        _spec(router={"videoStore": {}, "videoStorePasswordSecretRef": {"name": "auth"}}),
        cel=["spec.router.videoStorePasswordSecretRef", "the operator makes the password"],
        python=["router.videoStore"],
    ),
    RuleCase(
        "adapter-of-a-missing-stage",
        _spec(adapters=[_adapter("ink", "nowhere")]),
        cel=["spec.adapters", "adapter 'ink' names stage 'nowhere', which is not a stage"],
        python=["spec.adapters[0].stage", "no stage is named 'nowhere'"],
    ),
    RuleCase(
        "adapter-name-twice",
        _spec(adapters=[_adapter("ink", "dit"), _adapter("ink", "thinker")]),
        cel=["spec.adapters[1]: Duplicate value", '"name":"ink"'],
        python=["spec.adapters[1].name", "adapter names must be unique"],
    ),
    RuleCase(
        "adapter-name-not-a-name",
        _spec(adapters=[_adapter("Ink:v2", "dit")]),
        cel=["spec.adapters[0].name", "should match"],
        python=["spec.adapters[0].name", "'Ink:v2' is not a valid adapter name"],
    ),
    RuleCase(
        "adapter-source-relative",
        _spec(adapters=[{"name": "ink", "stage": "dit", "source": "ink.safetensors"}]),
        cel=["spec.adapters[0].source", "'ink.safetensors' is not an absolute path"],
        python=["spec.adapters[0].source", "'ink.safetensors' is not an absolute path"],
    ),
    RuleCase(
        "adapter-of-an-encoder",
        _both(_set(0, output="hidden_states"), _spec(adapters=[_adapter("ink", "thinker")])),
        cel=["spec.adapters", "adapter 'ink': stage 'thinker' takes no adapters"],
        python=["spec.adapters[0].stage", "stage 'thinker' takes no adapters: an encoder"],
    ),
    RuleCase(
        "adapter-of-a-bagel-pipeline",
        _both(_spec(family="bagel"), _spec(adapters=[_adapter("ink", "dit")])),
        cel=["spec.adapters", "a bagel pipeline takes no adapters"],
        python=["spec.adapters[0].stage", "a bagel DiT runs on its own engine"],
    ),
    RuleCase(
        "adapter-scale-out-of-range",
        _spec(adapters=[{**_adapter("ink", "dit"), "scale": 9}]),
        cel=["spec.adapters[0].scale", "should be less than or equal to 8"],
        python=["spec.adapters[0].scale", "less than or equal to 8"],
    ),
    RuleCase(
        "max-lora-rank-on-diffusion-stage",
        _both(_set(1, maxLoraRank=16, maxLoras=2)),
        cel=["spec.stages[1].maxLoraRank", "only llm stages take maxLoraRank"],
        python=["spec.stages[1].maxLoraRank", "only llm stages take maxLoraRank"],
    ),
    RuleCase(
        "max-lora-rank-not-vllms",
        _set(0, maxLoraRank=24, maxLoras=2),
        cel=["spec.stages[0].maxLoraRank", "Unsupported value: 24"],
        python=["spec.stages[0].maxLoraRank", "24 is not one of vLLM's ranks"],
    ),
    RuleCase(
        "pipeline-name-not-dns-1035",
        lambda m: m["metadata"].update(name="1-bagel"),
        cel=["metadata.name", "'1-bagel' names the pipeline's Service", "starting with a letter"],
        python=None,
    ),
]


@dataclass(frozen=True)
class ValidCase:
    """A pipeline both sides must admit."""

    id: str
    breaker: Breaker

    def manifest(self, name: str = "p") -> Manifest:
        manifest = base_pipeline(name)
        self.breaker(manifest)
        return manifest


def _shares(shares: dict[int, float]) -> Breaker:
    def apply(m: Manifest) -> None:
        for index, share in shares.items():
            stage(m, index)["gpuMemoryUtilization"] = share

    return apply


def _bridge(m: Manifest) -> None:
    # Stages 0 (GPU 0) and 1 (GPU 1) share no GPU, but stage 2 uses both, so all three are
    # one placement group and shared memory between 0 and 1 works.
    stage(m, 0)["gpuMemoryUtilization"] = 0.5
    stage(m, 1)["devices"] = "1"
    m["spec"]["stages"].append(
        {
            "stageId": 2,
            "name": "bridge",
            "type": "llm",
            "devices": "0,1",
            "gpuMemoryUtilization": 0.4,
        }
    )


def _apart(m: Manifest) -> None:
    m["spec"]["stages"] = [
        {"stageId": 0, "name": "a", "type": "llm", "devices": "0", "gpuMemoryUtilization": 0.9},
        {"stageId": 1, "name": "b", "type": "llm", "devices": "1", "gpuMemoryUtilization": 0.9},
        # CPU stages share no GPU, whatever they declare.
        {"stageId": 2, "name": "c", "type": "llm", "devices": "cpu", "gpuMemoryUtilization": 0.9},
        {"stageId": 3, "name": "d", "type": "llm", "devices": "cpu", "gpuMemoryUtilization": 0.9},
    ]


def _topology(m: Manifest) -> None:
    m["spec"]["model"] = "ByteDance-Seed/BAGEL-7B-MoT"
    for index in (0, 1):
        del stage(m, index)["type"]
        del stage(m, index)["name"]


def _named_family(m: Manifest) -> None:
    # A family named outright gives its topology whatever the model's path says.
    m["spec"]["family"] = "z-image"
    stage(m, 0)["output"] = "hidden_states"
    for index in (0, 1):
        del stage(m, index)["type"]


_SCALING = {"maxReplicas": 4, "latencyObjective": {"seconds": 8}}

VALID: list[ValidCase] = [
    ValidCase("base", lambda m: None),
    ValidCase("shared-memory-through-a-stage-in-between", _bridge),
    # Shares that fill GPU 0 exactly, in floating point a hair above 1 or not.
    ValidCase("gpu-shares-0.45-0.55", _shares({0: 0.45, 1: 0.55})),
    ValidCase("gpu-shares-0.1-0.9", _shares({0: 0.1, 1: 0.9})),
    # Without a share the DiT is not counted: it takes what the thinker leaves.
    ValidCase("gpu-share-0.92-and-unset", _shares({0: 0.92})),
    ValidCase("gpu-share-whole-and-unset", _shares({0: 1})),
    ValidCase("gpu-shares-on-different-gpus-are-not-summed", _apart),
    ValidCase(
        "equal-autoscaling-in-a-placement-group",
        _both(_set(0, autoscaling=dict(_SCALING)), _set(1, autoscaling=dict(_SCALING))),
    ),
    ValidCase("known-topology-gives-stage-types", _topology),
    ValidCase("named-family-gives-stage-types", _named_family),
    ValidCase("compiled-dit", _set(1, torchCompile=True)),
    ValidCase(
        "step-cached-dit-of-a-family",
        _both(_named_family, _set(1, stepCache={"tiers": {"fast": {"interval": 2}}})),
    ),
    ValidCase(
        "adapters-of-the-llm-and-the-dit",
        _both(
            _set(0, maxLoraRank=32),
            _spec(
                adapters=[
                    {"name": "chat-ink", "stage": "thinker", "source": "/loras/chat-ink"},
                    {**_adapter("ink", "dit"), "scale": 0.8},
                    {"name": "neon", "stage": "dit", "source": "org/neon-lora"},
                    {
                        "name": "pop",
                        "stage": "dit",
                        "source": "https://example.com/loras/pop.safetensors",
                    },
                ]
            ),
        ),
    ),
    # Unnamed stages take their family's topology names (an encoder and a dit).
    ValidCase(
        "adapter-of-a-topology-named-dit",
        _both(_named_family, _spec(adapters=[_adapter("ink", "dit")])),
    ),
    ValidCase("max-loras-without-declared-adapters", _set(1, maxLoras=8)),
]
