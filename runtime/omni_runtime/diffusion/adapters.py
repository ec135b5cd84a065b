"""LoRA adapters on a diffusers DiT: read in the background, injected between batches.

A request names at most one adapter (``StageAdapter``: name, source, scale). The engine
keeps up to its stage's capacity of them injected into the pipeline's transformer, least
recently used evicted (``omni_runtime.adapters.AdapterLRU``, the order the stage server's
mirror of it follows). An adapter not held yet is first *read* (its source resolved, its
safetensors file loaded and converted to diffusers' keys by the pipeline class's
``lora_state_dict``, and checked against the DiT's modules) on a thread of its own, so the
engine's other batches keep running meanwhile; then *injected*, on the engine's thread
between batches, since PEFT rewires the transformer's modules in place.

Everything wrong with an adapter (no such file, not safetensors, keys of no module of the
DiT, a rank or width that does not fit) is an :class:`AdapterLoadError` naming the file:
the request that named it fails with a 400 (``param="model"``) and the engine serves on. A
half-injected adapter is removed before the error goes out, so the transformer is as it
was.

Which LoRA state the transformer is in (enabled, which adapter at which scale) is tracked
(:class:`LoraState`, :func:`lora_steps`), so that a run of batches of one adapter, or of
none, costs no per-batch walk over the transformer's modules.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omni_runtime.adapters import AdapterLRU, AdapterSourceError, resolve_source
from omni_runtime.engine.stage.stage_core_types import StageAdapter, StageError

logger = logging.getLogger(__name__)

__all__ = [
    "AdapterLoadError",
    "DiTAdapters",
    "LoraState",
    "ReadAdapter",
    "adapter_file",
    "check_fits",
    "lora_steps",
    "lora_target",
    "peft_name",
]

_SAFETENSORS = ".safetensors"
# The component of a DiT pipeline that LoRA adapters go into (diffusers' TRANSFORMER_NAME).
_TRANSFORMER = "transformer"
# How many offending keys an error lists before "and N more".
_SHOWN_KEYS = 3


class AdapterLoadError(Exception):
    """An adapter this engine cannot load: the message names its file and what was wrong."""

    @property
    def error(self) -> StageError:
        # "model": what a request names an adapter by (<pipeline>:<adapter>).
        return StageError.bad_request(str(self), "model")


@dataclass(frozen=True)
class ReadAdapter:
    """An adapter read from its file: diffusers-format LoRA weights (``transformer.``-prefixed
    PEFT keys) and the adapter's LoraConfig as saved with it (None if the file has none),
    ready to inject."""

    name: str
    source: str
    file: Path
    state_dict: dict[str, Any]
    metadata: dict[str, Any] | None


@dataclass(frozen=True)
class LoraState:
    """The transformer's LoRA switches as last set: whether its LoRA layers are on, and the
    adapter and scale active. None: not known (after an injection or an eviction, which
    change both), so the next batch sets them."""

    enabled: bool | None = True
    active: tuple[str, float] | None = None


Step = Literal["enable", "disable", "set"]


def lora_steps(state: LoraState, wanted: tuple[str, float] | None, held: bool) -> list[Step]:
    """The calls that make the transformer run with ``wanted`` (an adapter and its scale; None:
    the weights alone), from ``state``; ``held``: whether any adapter is injected (without
    one, LoRA layers exist nowhere and nothing needs turning off)."""
    if wanted is None:
        return ["disable"] if held and state.enabled is not False else []
    steps: list[Step] = []
    if state.enabled is not True:
        steps.append("enable")
    if state.active != wanted or state.enabled is not True:
        steps.append("set")
    return steps


def after_steps(state: LoraState, wanted: tuple[str, float] | None, steps: list[Step]) -> LoraState:
    """The state once ``steps`` (of :func:`lora_steps`) have run."""
    if "disable" in steps:
        return LoraState(enabled=False, active=state.active)
    if wanted is None:
        return state
    return LoraState(enabled=True, active=wanted)


def peft_name(name: str) -> str:
    """The name an adapter goes by inside the transformer. Not its own: PEFT keeps each
    adapter's layers as attributes and module-dict keys under its name, so a name with a
    '.' ("pixel.art") cannot be one, and one such as "half" or "cuda" collides with a
    module's own attributes; a hash of it is an identifier and unique."""
    return f"omni_lora_{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def lora_target(key: str) -> tuple[str, str] | None:
    """The module a LoRA weight's key is of, and which weight it is ("A", "B" or "B.bias"),
    for a PEFT key (``layers.0.attention.to_q.lora_A.weight``); None for any other key."""
    for suffix, part in (
        (".lora_A.weight", "A"),
        (".lora_B.weight", "B"),
        (".lora_B.bias", "B.bias"),
    ):
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    return None


def check_fits(
    state_dict: Mapping[str, Any],
    modules: Mapping[str, tuple[int, int] | None],
    where: str,
) -> None:
    """AdapterLoadError (``where``: the adapter and its file) unless every weight of
    ``state_dict`` (diffusers-format: ``transformer.``-prefixed PEFT keys) is a LoRA
    weight of a module of the DiT, shaped to fit it. ``modules``: the DiT's modules by
    name, with (in_features, out_features) for a linear one (None: another kind, whose
    shapes PEFT checks itself)."""
    if not state_dict:
        raise AdapterLoadError(f"{where}: holds no weights")
    prefix = f"{_TRANSFORMER}."
    own = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    if not own:
        raise AdapterLoadError(
            f"{where}: none of its {len(state_dict)} keys is of the DiT ({prefix}*), e.g. "
            f"{_keys(state_dict)}: an adapter of another model?"
        )
    targets = {key: lora_target(key) for key in own}
    not_lora = [key for key, target in targets.items() if target is None]
    if not_lora:
        raise AdapterLoadError(f"{where}: not LoRA weights (lora_A/lora_B): keys {_keys(not_lora)}")
    parts = {key: target for key, target in targets.items() if target is not None}
    unknown = {module for module, _ in parts.values() if module not in modules}
    if unknown:
        raise AdapterLoadError(
            f"{where}: its keys name modules the DiT does not have: {_keys(unknown)}: an "
            "adapter of another model?"
        )
    ranks: dict[str, dict[str, int]] = {}
    for key, (module, part) in parts.items():
        value = own[key]
        features = modules[module]
        shape = tuple(value.shape)
        if part == "B.bias" or features is None:
            continue
        in_features, out_features = features
        if part == "A":
            if len(shape) != 2 or shape[1] != in_features:
                raise AdapterLoadError(
                    f"{where}: {key} is {list(shape)}, but {module} takes {in_features} "
                    f"in_features (lora_A must be [rank, {in_features}]): an adapter of "
                    "another model?"
                )
            ranks.setdefault(module, {})["A"] = shape[0]
        else:
            if len(shape) != 2 or shape[0] != out_features:
                raise AdapterLoadError(
                    f"{where}: {key} is {list(shape)}, but {module} makes {out_features} "
                    f"out_features (lora_B must be [{out_features}, rank]): an adapter of "
                    "another model?"
                )
            ranks.setdefault(module, {})["B"] = shape[1]
    for module, pair in sorted(ranks.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterLoadError(f"{where}: {module} has no {missing} weight")
        if pair["A"] != pair["B"]:
            raise AdapterLoadError(
                f"{where}: {module}'s lora_A is of rank {pair['A']} but its lora_B of rank "
                f"{pair['B']}"
            )


def _keys(keys: Any) -> str:
    names = sorted(keys)
    shown = ", ".join(names[:_SHOWN_KEYS])
    more = len(names) - _SHOWN_KEYS
    return f"{shown} and {more} more" if more > 0 else shown


def adapter_file(path: Path) -> Path:
    """The safetensors file of an adapter resolved to ``path``: the file itself, or the one
    ``.safetensors`` file of a directory (PEFT's adapter_model.safetensors, or a
    diffusers LoRA's). AdapterLoadError naming the path otherwise."""
    if path.is_file():
        if path.suffix != _SAFETENSORS:
            raise AdapterLoadError(f"{path}: an adapter file must be {_SAFETENSORS}")
        return path
    files = sorted(path.glob(f"*{_SAFETENSORS}"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise AdapterLoadError(
            f"{path}: a diffusion adapter's directory must hold one {_SAFETENSORS} file "
            f"(found {found})"
        )
    return files[0]


def linear_modules(transformer: Any) -> dict[str, tuple[int, int] | None]:
    """The transformer's modules by name: (in_features, out_features) for a linear one."""
    import torch

    return {
        name: (module.in_features, module.out_features)
        if isinstance(module, torch.nn.Linear)
        else None
        for name, module in transformer.named_modules()
        if name
    }


def read_adapter(
    adapter: StageAdapter,
    pipeline_class: type[Any],
    modules: Mapping[str, tuple[int, int] | None],
) -> ReadAdapter:
    """``adapter`` read from its source and checked against the DiT's ``modules``: blocking
    I/O, run off the engine's thread. AdapterLoadError naming the file if it cannot be."""
    import safetensors
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    try:
        file = adapter_file(resolve_source(adapter.source))
    except AdapterSourceError as e:
        raise AdapterLoadError(f"adapter {adapter.name!r}: {e}") from None
    where = f"adapter {adapter.name!r} ({file})"
    try:
        # safetensors only (allow_pickle off): the pipeline class's own reader, which
        # converts other trainers' key layouts to diffusers' and returns the saved config.
        state_dict, metadata = pipeline_class.lora_state_dict(
            str(file.parent),
            weight_name=file.name,
            use_safetensors=True,
            local_files_only=True,
            return_lora_metadata=True,
        )
    except (OSError, ValueError, safetensors.SafetensorError, json.JSONDecodeError) as e:
        raise AdapterLoadError(f"{where}: not a readable safetensors LoRA file: {e}") from None
    except Exception as e:  # a converter choking on unexpected keys raises anything
        raise AdapterLoadError(
            f"{where}: cannot be read as a LoRA: {type(e).__name__}: {e}"
        ) from None
    prefix = f"{_TRANSFORMER}."
    own = {k for k in state_dict if k.startswith(prefix)}
    if own and not any("lora_A" in k for k in own):
        # Kohya's lora_down/lora_up, as diffusers' own loader converts them before injecting.
        state_dict = convert_unet_state_dict_to_peft(dict(state_dict))
    check_fits(state_dict, modules, where)
    return ReadAdapter(adapter.name, adapter.source, file, dict(state_dict), metadata)


def _held_key(adapter: StageAdapter) -> tuple[str, str]:
    return adapter.name, adapter.source


class DiTAdapters:
    """The adapters of one engine's pipeline: which are injected (at most ``capacity``,
    least recently used evicted), which are being read, and the transformer's LoRA state.

    :meth:`ready` is safe from any thread (the core's input thread asks it as a request
    arrives, which starts the read); :meth:`activate` and :meth:`close` run on the engine's
    thread alone. ``on_read`` (:meth:`notify_reads`) is called, from the reading thread, as
    each read ends: a scheduler waiting on one wakes up.
    """

    def __init__(
        self,
        pipeline: Any,
        capacity: int,
        read: Callable[[StageAdapter], ReadAdapter] | None = None,
    ) -> None:
        self.pipeline = pipeline
        modules = linear_modules(pipeline.transformer)
        self._read = read or (lambda adapter: read_adapter(adapter, type(pipeline), modules))
        self._lru = AdapterLRU(capacity)
        # The source each injected adapter was read from: a name reused for another source
        # (an adapter replaced at run time) is read and injected anew.
        self._sources: dict[str, str] = {}
        self._reads: dict[tuple[str, str], concurrent.futures.Future[ReadAdapter]] = {}
        self._lock = threading.Lock()
        self._on_read: Callable[[], None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="adapter-read"
        )
        self._state = LoraState()

    @property
    def held(self) -> list[str]:
        """The adapters injected, least recently used first."""
        with self._lock:
            return self._lru.names()

    def notify_reads(self, on_read: Callable[[], None] | None) -> None:
        self._on_read = on_read

    def ready(self, adapter: StageAdapter | None) -> bool:
        """Whether a request of ``adapter`` can run now without waiting on a read: it names
        none, its adapter is injected, or its read has ended (well or not: activate says).
        Otherwise its read is started, if it is not under way."""
        if adapter is None:
            return True
        key = _held_key(adapter)
        with self._lock:
            if self._sources.get(adapter.name) == adapter.source:
                return True
            future = self._reads.get(key)
            if future is None:
                future = self._pool.submit(self._read, adapter)
                self._reads[key] = future
                future.add_done_callback(self._read_ended)
            return future.done()

    def check(self, adapter: StageAdapter) -> None:
        """Read ``adapter`` now and check it against the DiT, without injecting it (a load
        at run time, which must refuse what cannot load: vLLM's /v1/load_lora_adapter).
        The read is kept for the first request that names it. AdapterLoadError naming the
        file if it cannot be loaded."""
        self.ready(adapter)
        with self._lock:
            if self._sources.get(adapter.name) == adapter.source:
                return
            future = self._reads[_held_key(adapter)]
        try:
            future.result()
        except BaseException:
            with self._lock:
                # Tried again by the next load or request (a file since fixed loads).
                if self._reads.get(_held_key(adapter)) is future:
                    del self._reads[_held_key(adapter)]
            raise

    def _read_ended(self, _future: concurrent.futures.Future[ReadAdapter]) -> None:
        on_read = self._on_read
        if on_read is not None:
            on_read()

    def activate(self, adapter: StageAdapter | None) -> None:
        """Make the pipeline run the next batch with ``adapter`` at its scale (None: the
        weights alone): read it (waiting for its read) and inject it if it is not held,
        evicting the least recently used. AdapterLoadError if it cannot be loaded; the
        pipeline is then as it was, but for any adapter evicted for it."""
        if adapter is not None:
            self._load(adapter)
        wanted = (adapter.name, adapter.scale) if adapter is not None else None
        with self._lock:
            held = len(self._lru) > 0
        steps = lora_steps(self._state, wanted, held)
        for step in steps:
            if step == "enable":
                self.pipeline.enable_lora()
            elif step == "disable":
                self.pipeline.disable_lora()
            else:
                assert wanted is not None
                self.pipeline.set_adapters([peft_name(wanted[0])], adapter_weights=[wanted[1]])
        self._state = after_steps(self._state, wanted, steps)

    def _load(self, adapter: StageAdapter) -> None:
        name = adapter.name
        with self._lock:
            if self._sources.get(name) == adapter.source:
                self._lru.use(name)
                return
        self.ready(adapter)  # starts the read, where no scheduler asked for it first
        if name in self._sources:
            self._evict([name])  # the same name from another source: replaced
        # Room made before the read is waited on, as the stage server's mirror of this
        # cache makes it when it sends the request: the two hold the same names, a failed
        # load's forgotten by both.
        with self._lock:
            evicted = self._lru.use(name)
            future = self._reads[_held_key(adapter)]
        self._evict(evicted)
        try:
            loaded = future.result()
        except BaseException:
            with self._lock:
                self._lru.discard(name)
            raise
        finally:
            # Read once, whatever came of it: a failed read is tried again by the next
            # request that names it (a file since fixed loads).
            with self._lock:
                self._reads.pop(_held_key(adapter), None)
        try:
            self._inject(loaded)
        except Exception as e:
            with self._lock:
                self._lru.discard(name)
            self._remove(name)
            where = f"adapter {name!r} ({loaded.file})"
            raise AdapterLoadError(
                f"{where}: does not fit this stage's DiT: {type(e).__name__}: {e}"
            ) from None
        finally:
            self._state = LoraState(enabled=None, active=None)
        with self._lock:
            self._sources[name] = adapter.source
            # A read another thread began as this one ended: not needed now.
            self._reads.pop(_held_key(adapter), None)
        logger.info("loaded LoRA adapter %r from %s", name, loaded.file)

    def _inject(self, loaded: ReadAdapter) -> None:
        pipeline = self.pipeline
        # The pipeline's load_lora_weights would re-read a dict without the saved LoraConfig
        # (an alpha other than the rank would then scale wrongly): its transformer loader
        # takes the config read with the weights.
        pipeline.load_lora_into_transformer(
            loaded.state_dict,
            transformer=pipeline.transformer,
            adapter_name=peft_name(loaded.name),
            metadata=loaded.metadata,
            _pipeline=pipeline,
        )
        if peft_name(loaded.name) not in getattr(pipeline.transformer, "peft_config", {}):
            raise ValueError("no weight of it was loaded into the transformer")

    def _evict(self, names: list[str]) -> None:
        for name in names:
            with self._lock:
                self._lru.discard(name)
                self._sources.pop(name, None)
            self._remove(name)
            self._state = LoraState(enabled=None, active=None)
            logger.info("evicted LoRA adapter %r", name)

    def _remove(self, name: str) -> None:
        """``name``'s layers out of the transformer, however far its injection got."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        transformer = self.pipeline.transformer
        inside = peft_name(name)
        if inside in getattr(transformer, "peft_config", {}):
            self.pipeline.delete_adapters(inside)
        # What an injection cut short may leave in layers the config no longer lists.
        for module in transformer.modules():
            if isinstance(module, BaseTunerLayer) and inside in getattr(module, "lora_A", {}):
                module.delete_adapter(inside)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
