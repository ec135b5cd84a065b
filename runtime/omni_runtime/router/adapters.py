"""The LoRA adapters a router serves: the pipeline's declared ones and those added at run
time, and which of them a request's model name picks.

Names follow vLLM's server: a request picks an adapter with ``model: "<adapter>"``, or here
also ``"<served model>:<adapter>"``, and one adapter per stage with ``+`` between them
(``"tiny-z-image:chat-ink+ink"``). ``GET /v1/models`` lists each adapter as a model whose
``parent`` is the served model. Adapters added with ``POST /v1/load_lora_adapter`` live in
this router's memory: a restart, or another replica of the router, does not know them, so a
cluster declares its adapters in the pipeline (``spec.adapters``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from omni_runtime.adapters import ADAPTER_NAME_RULE, source_issue
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.config.adapters import ADAPTER_NAME_PATTERN_RE
from omni_runtime.engine.stage.stage_core_types import StageAdapter
from omni_runtime.router.errors import RequestError

__all__ = ["AdapterCatalog", "CatalogEntry"]

# Between one stage's adapter and the next in a request's model name.
ADAPTER_JOIN = "+"


@dataclass(frozen=True)
class CatalogEntry:
    """One adapter the router serves: which stage runs it, with what."""

    stage: StageConfig
    adapter: StageAdapter
    # Declared in the pipeline (False: added at run time, which unloading may remove).
    declared: bool


class AdapterCatalog:
    """The adapters of one pipeline, by name."""

    def __init__(self, pipeline: PipelineConfig, served_model_name: str) -> None:
        self.pipeline = pipeline
        self.served_model_name = served_model_name
        by_name = {stage.name: stage for stage in pipeline.stages}
        self._entries: dict[str, CatalogEntry] = {
            adapter.name: CatalogEntry(
                by_name[adapter.stage],
                StageAdapter(adapter.name, adapter.source, adapter.scale),
                declared=True,
            )
            for adapter in pipeline.adapters or ()
        }
        # Loads and unloads come from request handlers on one event loop, and /metrics
        # reads from the exporter's thread: the lock keeps what it reads whole.
        self._lock = threading.Lock()

    @property
    def takes_adapters(self) -> bool:
        """Whether any stage of the pipeline takes adapters."""
        return any(self.pipeline.adapter_capacity(stage) for stage in self.pipeline.stages)

    @property
    def dit_takes_adapters(self) -> bool:
        """Whether a diffusion stage takes adapters (requests may then give lora_scale)."""
        return any(
            self.pipeline.adapter_capacity(stage)
            for stage in self.pipeline.stages
            if stage.type == "diffusion"
        )

    def entries(self) -> list[CatalogEntry]:
        with self._lock:
            return list(self._entries.values())

    def pick(self, model: str | None, lora_scale: float | None = None) -> dict[int, StageAdapter]:
        """The adapter of each stage that the request's ``model`` names (none: {}), with
        ``lora_scale`` as the scale of its diffusion stage's adapter. RequestError (404 for
        a name not served, 400 for two adapters of one stage) names the field."""
        picked: dict[int, StageAdapter] = {}
        if model is not None and model != self.served_model_name:
            names = model
            prefix = f"{self.served_model_name}:"
            if model.startswith(prefix):
                names = model[len(prefix) :]
            with self._lock:
                for name in names.split(ADAPTER_JOIN):
                    entry = self._entries.get(name)
                    if entry is None:
                        raise RequestError(404, self._unknown(model, name), param="model")
                    stage_id = entry.stage.stage_id
                    if stage_id in picked:
                        raise RequestError(
                            400,
                            f"model: {model!r} names two adapters of stage "
                            f"{entry.stage.name!r} ({picked[stage_id].name} and {name}); "
                            "pick one adapter per stage",
                            param="model",
                        )
                    picked[stage_id] = entry.adapter
        if lora_scale is not None:
            dits = [
                stage_id for stage_id in picked if self.pipeline.stage(stage_id).type == "diffusion"
            ]
            if not dits:
                raise RequestError(
                    400,
                    "lora_scale: the request picks no adapter of the DiT to scale (name one "
                    f"in model, as '{self.served_model_name}:<adapter>')",
                    param="lora_scale",
                )
            for stage_id in dits:
                adapter = picked[stage_id]
                picked[stage_id] = StageAdapter(adapter.name, adapter.source, lora_scale)
        return picked

    def _unknown(self, model: str, name: str) -> str:
        served = [self.served_model_name, *self._entries]
        shown = ", ".join(repr(n) for n in served[:20]) + (" ..." if len(served) > 20 else "")
        if model == name:
            return (
                f"model: {model!r} is not served here; this router serves {shown} (GET /v1/models)"
            )
        return (
            f"model: {model!r} names adapter {name!r}, which is not served here; models and "
            f"adapters: {shown} (GET /v1/models)"
        )

    def add(self, name: str, source: str, stage_name: str | None, scale: float) -> CatalogEntry:
        """Serve adapter ``name`` from ``source`` on a stage (None: the one stage that takes
        adapters). The replicas load it on first use. RequestError names the field."""
        return self.insert(self.entry(name, source, stage_name, scale))

    def entry(self, name: str, source: str, stage_name: str | None, scale: float) -> CatalogEntry:
        """What ``add`` would serve, checked but not served yet (a load at run time first
        has a replica load it). RequestError names the field."""
        if not ADAPTER_NAME_PATTERN_RE.fullmatch(name):
            raise RequestError(
                400,
                f"lora_name: {name!r} is not an adapter name: use {ADAPTER_NAME_RULE}",
                param="lora_name",
            )
        if name == self.served_model_name:
            raise RequestError(
                400, f"lora_name: {name!r} is the served model's name", param="lora_name"
            )
        issue = source_issue(source)
        if issue is not None:
            raise RequestError(400, f"lora_path: {issue}", param="lora_path")
        stage = self._stage_for(stage_name)
        if stage.type == "llm":
            if source.startswith("https://"):
                raise RequestError(
                    400,
                    "lora_path: an llm stage's adapter is a directory (adapter_config.json and "
                    "its weights): give a path in the stage's pod or a hub id",
                    param="lora_path",
                )
            if scale != 1.0:
                raise RequestError(
                    400,
                    "scale: vLLM applies an llm stage's adapter at its trained scale",
                    param="scale",
                )
        with self._lock:
            self._check_free(name)
        return CatalogEntry(stage, StageAdapter(name, source, scale), declared=False)

    def insert(self, entry: CatalogEntry) -> CatalogEntry:
        """Serve ``entry`` (from :meth:`entry`) from now on; RequestError if its name was
        taken meanwhile."""
        with self._lock:
            self._check_free(entry.adapter.name)
            self._entries[entry.adapter.name] = entry
        return entry

    def _check_free(self, name: str) -> None:
        # Under the lock, held by the caller.
        if name in self._entries:
            raise RequestError(
                400,
                f"lora_name: the adapter {name!r} has already been loaded; unload it first "
                "to load it from elsewhere",
                param="lora_name",
            )

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name``, added at run time; RequestError names the field."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise RequestError(
                    404, f"lora_name: no adapter {name!r} is loaded", param="lora_name"
                )
            if entry.declared:
                raise RequestError(
                    400,
                    f"lora_name: {name!r} is declared in the pipeline (adapters); remove it "
                    "there to stop serving it",
                    param="lora_name",
                )
            del self._entries[name]

    def _stage_for(self, stage_name: str | None) -> StageConfig:
        takers = [s for s in self.pipeline.stages if self.pipeline.adapter_capacity(s)]
        names = ", ".join(s.name for s in takers) or "none"
        if stage_name is None:
            if len(takers) == 1:
                return takers[0]
            raise RequestError(
                400,
                "stage: say which stage the adapter is for; stages that take adapters: " + names,
                param="stage",
            )
        for stage in takers:
            if stage.name == stage_name:
                return stage
        raise RequestError(
            400,
            f"stage: {stage_name!r} is not a stage that takes adapters; those that do: {names}",
            param="stage",
        )

    def models(self, created: int) -> list[dict[str, Any]]:
        """``GET /v1/models``'s entries for the adapters, as vLLM lists its LoRA modules."""
        return [
            {
                "id": entry.adapter.name,
                "object": "model",
                "created": created,
                "owned_by": "omni-operator",
                "root": entry.adapter.source,
                "parent": self.served_model_name,
                "stage": entry.stage.name,
            }
            for entry in self.entries()
        ]
