"""The LLM stage's clients: vLLM's async multiprocess clients behind the stage contract.

StageLLMCoreClient is vLLM's AsyncMPClient (one engine core) and DPLBStageLLMCoreClient
vLLM's DPLBAsyncMPClient (one core per data parallel rank, requests balanced across them),
each also a StageLLMCoreClientBase: the part of the StageCoreClientBase contract vLLM does
not have (``get_outputs_async``, ``get_outputs_nowait``, ``check_health``), engine death
as StageCoreDeadError, outputs decoded as StageLLMCoreOutputs, the request builder, and
``_default_process_core_inputs``.

The vLLM client comes first among each client's bases, so its methods (``add_request_async``,
``abort_requests_async``, ``collective_rpc_async``, ``shutdown``) are the contract's own
and a StageLLMCoreClientBase method of the same name would never be reached. The few that
need a stage behaviour (construction, death as StageCoreDeadError) are therefore
overridden on each client, each a line that hands vLLM's method to a helper of the base.

The clients do not start their cores: ``launch_stage_llm_cores`` does, and a client adopts
what it started (``proc_manager``, ``coordinator``); ``start_stage_llm_client`` does both
from the pipeline schema. An instance belongs to the event loop it is first used in.

LoRA adapters: ``load_adapter_async`` makes a request's StageAdapter into vLLM's
LoRARequest, resolving its source to local files and loading them into every core with
vLLM's ``add_lora`` utility before any request names it. The load is where vLLM validates
an adapter (its rank, its target modules, its weights); the same failure inside a model
step would end the engine and every request on it, so a bad adapter is refused here, as
the request that named it. Where vLLM's CPU kernels would apply an adapter to requests
without one that share its batch (``lora_needs_zero_adapter``), the first load also loads
a zero adapter made from it (``base_lora``), which those requests run with.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import shutil
import tempfile
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import msgspec
from vllm import envs
from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.engine.coordinator import DPCoordinator
from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.executor import Executor
from vllm.v1.serial_utils import MsgpackDecoder

from omni_runtime.adapters import AdapterSourceError, resolve_source
from omni_runtime.config import ConnectorConfig, StageConfig
from omni_runtime.engine.stage.stage_core_client import StageCoreClientBase, StageCoreDeadError
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageCoreRequest,
    StageError,
    StageErrorCode,
    StageLLMCoreOutputs,
    StageLLMCoreRequest,
)
from omni_runtime.engine.stage.stage_llm_core_proc_manager import (
    DEFAULT_STARTUP_TIMEOUT,
    StageLLMCoreProcManager,
    launch_stage_llm_cores,
)
from omni_runtime.engine.stage.stage_llm_engine_config import (
    lora_needs_zero_adapter,
    make_stage_llm_vllm_config,
)
from omni_runtime.engine.stage.stage_llm_request_builder import (
    StageLLMRequestBuilder,
)
from omni_runtime.families import EncoderRecipe, SpeechStage
from omni_runtime.net import advertised_host

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})
# What vLLM's engine core puts before the message of a utility call that raised.
_ADD_LORA_FAILED = "Call to add_lora method failed: "
# The files of a PEFT adapter vLLM reads. vLLM falls back to a pickled
# adapter_model.bin where the safetensors file is missing; requiring it keeps that away.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterLoadError(Exception):
    """A request's LoRA adapter that the stage did not load: its source or files are bad
    (BAD_REQUEST, the message naming the source or file and what is wrong), or the engine
    failed otherwise (STAGE_FAILED). ``error`` is the request's refusal, param "model"
    (the request's field that chose the adapter)."""

    def __init__(self, message: str, code: StageErrorCode = StageErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code

    @property
    def error(self) -> StageError:
        return StageError(self.code, str(self), "model")


@dataclass(frozen=True)
class AdapterLoad:
    """One load of an adapter into a stage's engine: how long it took to resolve its
    source, and how long the engine's add_lora took."""

    name: str
    path: str
    resolve_seconds: float
    add_lora_seconds: float


# The zero adapter's name: ':' is outside adapter names (ADAPTER_NAME_PATTERN), so no
# pipeline's adapter has it.
ZERO_ADAPTER_NAME = "omni:zero"

# vLLM keys the adapters it holds by an int id it leaves to the caller; the name keys
# them everywhere else (a LoRARequest compares and hashes by name). One id per name for
# the life of the process keeps the two keys in step.
_LORA_INT_IDS: dict[str, int] = {}


def lora_int_id(name: str) -> int:
    """vLLM's id of the adapter named ``name`` in this process (from 1, stable)."""
    return _LORA_INT_IDS.setdefault(name, len(_LORA_INT_IDS) + 1)


def adapter_dir(source: str) -> Path:
    """The local directory of an LLM stage's adapter ``source``, fetched where it is a hub
    id, with PEFT's two files present and readable (the weights' header only).
    AdapterSourceError names the source or the file and what is wrong; blocking I/O."""
    path = resolve_source(source)
    if not path.is_dir():
        raise AdapterSourceError(
            f"{path}: an llm stage's adapter is a directory holding {ADAPTER_CONFIG_FILE} "
            f"and {ADAPTER_WEIGHTS_FILE}, not a file"
        )
    config, weights = path / ADAPTER_CONFIG_FILE, path / ADAPTER_WEIGHTS_FILE
    for file in (config, weights):
        if not file.is_file():
            raise AdapterSourceError(f"{file}: missing (a PEFT adapter directory holds it)")
    try:
        settings = json.loads(config.read_bytes())
    except (OSError, ValueError) as e:
        raise AdapterSourceError(f"{config}: not a readable JSON adapter config: {e}") from None
    if not isinstance(settings, dict):
        raise AdapterSourceError(f"{config}: expected a JSON object (PEFT's LoraConfig)")
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt"):
            pass
    except Exception as e:  # safetensors raises its own error kinds, and OSError
        raise AdapterSourceError(f"{weights}: not a readable safetensors file: {e}") from None
    return path


def write_zero_adapter(adapter: Path, target: Path) -> None:
    """An adapter at ``target`` shaped as the one at ``adapter`` (its config, its tensors'
    names and shapes), every weight zero: it fits the model wherever ``adapter`` does, and
    changes nothing."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(adapter / ADAPTER_CONFIG_FILE, target / ADAPTER_CONFIG_FILE)
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS_FILE))
    zeros = {name: tensor.new_zeros(tensor.shape) for name, tensor in tensors.items()}
    save_file(zeros, str(target / ADAPTER_WEIGHTS_FILE))


class UpstreamResult(Protocol):
    """What ``_default_process_core_inputs`` reads of an upstream LLM request's result."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def error(self) -> StageError | None: ...


class StageLLMCoreClientBase(StageCoreClientBase):
    """The stage contract over a vLLM async multiprocess client (a mixin of both clients)."""

    if TYPE_CHECKING:
        # Supplied by the vLLM client each concrete client is also made of.
        vllm_config: VllmConfig
        resources: Any
        outputs_queue: asyncio.Queue[Any]

        async def get_output_async(self) -> Any: ...
        async def add_request_async(self, request: StageCoreRequest) -> None: ...
        async def collective_rpc_async(
            self,
            method: str,
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any: ...
        async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]: ...
        async def add_lora_async(self, lora_request: LoRARequest) -> bool: ...
        def _ensure_output_queue_task(self) -> None: ...
        def start_engine_core_monitor(self) -> None: ...
        def shutdown(self, timeout: float | None = None) -> None: ...

    # The pipeline's entry for this stage (name, output kind, default sampling params);
    # None for a client made from a bare VllmConfig.
    stage: StageConfig | None
    # Set by start_stage_llm_client for a model family's encoder stage, before the first
    # request: how prompts become what the family's DiT reads.
    encoder_recipe: EncoderRecipe | None = None
    speech_stage: SpeechStage | None = None
    proc_manager: StageLLMCoreProcManager | None
    client_addresses: dict[str, str]
    # The host a downstream stage pulls this stage's handoffs from.
    _core_host: str
    # Adapter loads in progress, by (name, source): concurrent first requests of one
    # adapter wait on one load.
    _adapter_loads: dict[tuple[str, str], asyncio.Future[LoRARequest]]
    # name -> the path the engine last loaded it from.
    _adapter_paths: dict[str, str]
    # Every load this client made, oldest first (what bench/ and tests read).
    adapter_load_log: list[AdapterLoad]
    # What a request without an adapter runs with on an engine that serves adapters: None
    # (vLLM's own way), or the zero adapter (lora_needs_zero_adapter) once one is loaded.
    base_lora: LoRARequest | None
    _zero_adapter: asyncio.Future[LoRARequest] | None

    @staticmethod
    def make_async_mp_client(
        vllm_config: VllmConfig,
        executor_class: type[Executor],
        log_stats: bool = False,
        metadata: StageConfig | None = None,
        client_addresses: dict[str, str] | None = None,
        proc_manager: StageLLMCoreProcManager | None = None,
        coordinator: DPCoordinator | None = None,
    ) -> StageLLMCoreClient | DPLBStageLLMCoreClient:
        """The client for the stage's data parallel size: DPLBStageLLMCoreClient above 1."""
        client_class: type[StageLLMCoreClient | DPLBStageLLMCoreClient] = (
            DPLBStageLLMCoreClient
            if vllm_config.parallel_config.data_parallel_size > 1
            else StageLLMCoreClient
        )
        return client_class(
            vllm_config,
            executor_class,
            log_stats,
            client_addresses,
            metadata=metadata,
            proc_manager=proc_manager,
            coordinator=coordinator,
        )

    @staticmethod
    def _default_process_core_inputs(source_outputs: Sequence[UpstreamResult]) -> list[list[int]]:
        """The prompt of this stage's next request for each upstream request: the token
        ids the upstream LLM generated (an upstream that encoded hidden states generated
        none, and cannot feed an LLM stage this way)."""
        prompts = []
        for source in source_outputs:
            if source.error is not None or not source.token_ids:
                why = source.error or "it generated no tokens"
                raise ValueError(f"upstream request {source.request_id} has no prompt: {why}")
            prompts.append(list(source.token_ids))
        return prompts

    @staticmethod
    def _resolve_core_host(client_addresses: Mapping[str, str]) -> str:
        """The host this stage's core serves on, as another machine reaches it."""
        if explicit := client_addresses.get("core_host"):
            return explicit
        for key in ("input_address", "output_address"):
            address = client_addresses.get(key, "")
            if address.startswith("tcp://"):
                host = urlsplit(address).hostname or ""
                if host not in _WILDCARD_HOSTS:
                    return host
        # ipc (the core runs on this machine) or a wildcard bind: this machine's address.
        return advertised_host()

    @property
    def decoder(self) -> MsgpackDecoder:
        return self._stage_outputs_decoder

    @decoder.setter
    def decoder(self, _vllm_decoder: MsgpackDecoder) -> None:
        # vLLM's MPClient sets ``self.decoder = MsgpackDecoder(EngineCoreOutputs)`` and the
        # output task reads it, possibly while the client is still being constructed. As a
        # data descriptor this property receives that assignment (no class before it in
        # the MRO defines ``decoder``) and installs the stage's decoder instead, so every
        # message is decoded as StageLLMCoreOutputs and no field of the stage is dropped.
        self._stage_outputs_decoder = MsgpackDecoder(StageLLMCoreOutputs)

    @functools.cached_property
    def request_builder(self) -> StageLLMRequestBuilder:
        """Builds this stage's requests (with the stage's default sampling params)."""
        defaults = self.stage.default_sampling_params if self.stage is not None else None
        think_tokens = None
        if self.encoder_recipe is not None and self.encoder_recipe.context_kv:
            # A BAGEL thinker's sampling params are its think mode's: max_tokens bounds a
            # plan, which it writes greedily, as BAGEL does (its other params go unused).
            if self.stage is not None and self.stage.think:
                think_tokens = int((defaults or {}).get("max_tokens") or DEFAULT_THINK_TOKENS)
            defaults = None
        return StageLLMRequestBuilder(
            self.vllm_config, defaults, self.encoder_recipe, think_tokens, self.speech_stage
        )

    async def load_adapter_async(self, adapter: StageAdapter) -> LoRARequest:
        """vLLM's LoRARequest of ``adapter``, loaded into the engine (every core), to be
        given to the request builder. Resolves the source in a thread (a hub id is
        fetched), checks PEFT's files, then has the engine load them (vLLM's add_lora,
        which checks the rank and target modules against the engine's), so that a bad
        adapter never reaches a model step. Concurrent calls for one adapter share one load;
        a failed load is not remembered (the next request tries again, and finds files
        fixed since). AdapterLoadError says why it failed; StageCoreDeadError when the
        core is gone."""
        key = (adapter.name, adapter.source)
        pending = self._adapter_loads.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._load_adapter(adapter))
            self._adapter_loads[key] = pending
            pending.add_done_callback(functools.partial(self._adapter_loaded, key))
        # Shielded: one waiter that gives up must not cancel the load the others wait on.
        return await asyncio.shield(pending)

    def _adapter_loaded(self, key: tuple[str, str], load: asyncio.Future[LoRARequest]) -> None:
        if self._adapter_loads.get(key) is load:
            del self._adapter_loads[key]
        if not load.cancelled():
            # Retrieved here, so that a failure whose waiters all went away is not logged
            # as never retrieved.
            load.exception()

    async def _load_adapter(self, adapter: StageAdapter) -> LoRARequest:
        started = time.perf_counter()
        try:
            path = str(await asyncio.to_thread(adapter_dir, adapter.source))
        except AdapterSourceError as e:
            raise AdapterLoadError(f"adapter {adapter.name!r}: {e}") from None
        resolved = time.perf_counter()
        lora = LoRARequest(
            lora_name=adapter.name, lora_int_id=lora_int_id(adapter.name), lora_path=path
        )
        previous = self._adapter_paths.get(adapter.name)
        # An adapter of the same name from other files (another revision's source) replaces
        # the weights the engine holds under the name's id. Only this call says so: a
        # request's LoRARequest saying it would reload the files at every step.
        load = (
            lora if previous in (None, path) else msgspec.structs.replace(lora, load_inplace=True)
        )
        try:
            await self._until_core_dies(self.add_lora_async(load))
        except StageCoreDeadError:
            raise
        except Exception as e:
            message = str(e)
            if not message.startswith(_ADD_LORA_FAILED):
                raise AdapterLoadError(
                    f"adapter {adapter.name!r}: the engine did not load it: {message}",
                    StageErrorCode.STAGE_FAILED,
                ) from None
            reason = " ".join(message.removeprefix(_ADD_LORA_FAILED).split())
            raise AdapterLoadError(
                f"adapter {adapter.name!r} ({path}): the engine cannot load it: {reason}"
            ) from None
        self._adapter_paths[adapter.name] = path
        self.adapter_load_log.append(
            AdapterLoad(adapter.name, path, resolved - started, time.perf_counter() - resolved)
        )
        if self.base_lora is None and lora_needs_zero_adapter():
            # Before the request with this adapter goes in: from then on, requests without
            # one share batches with it.
            if self._zero_adapter is None or self._zero_adapter.done():
                self._zero_adapter = asyncio.ensure_future(self._load_zero_adapter(Path(path)))
            try:
                self.base_lora = await asyncio.shield(self._zero_adapter)
            except (AdapterLoadError, OSError) as e:
                raise AdapterLoadError(
                    f"adapter {adapter.name!r}: the zero adapter that requests without an "
                    f"adapter need beside it did not load: {e}",
                    StageErrorCode.STAGE_FAILED,
                ) from None
        return lora

    async def _load_zero_adapter(self, like: Path) -> LoRARequest:
        directory = Path(tempfile.mkdtemp(prefix="omni-zero-lora-"))
        # The engine reads it again after evicting it: kept as long as the client.
        weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)
        await asyncio.to_thread(write_zero_adapter, like, directory)
        zero = LoRARequest(ZERO_ADAPTER_NAME, lora_int_id(ZERO_ADAPTER_NAME), str(directory))
        try:
            await self._until_core_dies(self.add_lora_async(zero))
        except StageCoreDeadError:
            raise
        except Exception as e:
            raise AdapterLoadError(str(e), StageErrorCode.STAGE_FAILED) from None
        logger.info("requests without an adapter run with a zero adapter (%s)", directory)
        return zero

    async def get_outputs_async(self) -> StageLLMCoreOutputs:
        if self.outputs_queue.empty():
            self.check_health()
        try:
            outputs: StageLLMCoreOutputs = await self.get_output_async()
        except Exception as e:
            # The output task forwards the end of the stream as an exception: nothing more
            # will arrive (EngineDeadError when the core died or said it is going).
            self.resources.engine_dead = True
            raise StageCoreDeadError(await self._dead_reason_async()) from e
        return outputs

    def get_outputs_nowait(self) -> StageLLMCoreOutputs | None:
        self._ensure_output_queue_task()
        try:
            outputs = self.outputs_queue.get_nowait()
        except asyncio.QueueEmpty:
            self.check_health()
            return None
        if isinstance(outputs, Exception):
            self.resources.engine_dead = True
            raise StageCoreDeadError(self._dead_reason()) from outputs
        assert isinstance(outputs, StageLLMCoreOutputs)
        return outputs

    def check_health(self) -> None:
        manager = self.proc_manager
        if self.resources.engine_dead or (manager is not None and manager.finished_procs()):
            raise StageCoreDeadError(self._dead_reason()) from EngineDeadError()

    def _init_stage(
        self,
        init_transport: Callable[[], None],
        metadata: StageConfig | None,
        client_addresses: dict[str, str] | None,
        proc_manager: StageLLMCoreProcManager | None,
        coordinator: DPCoordinator | None,
    ) -> None:
        """Construct the vLLM client (``init_transport``), then adopt the started cores.

        The client owns ``proc_manager`` and ``coordinator`` from here on: they are ended
        by ``shutdown`` (or the client's finaliser), or at once if construction fails.
        """
        self.stage = metadata
        self.proc_manager = proc_manager
        self._adapter_loads = {}
        self._adapter_paths = {}
        self.adapter_load_log = []
        self.base_lora = None
        self._zero_adapter = None
        self.client_addresses = dict(client_addresses or {})
        self._core_host = self._resolve_core_host(self.client_addresses)
        try:
            _refuse_insecure_serialization()
            init_transport()
        except BaseException:
            if proc_manager is not None:
                proc_manager.shutdown()
            if coordinator is not None:
                coordinator.shutdown()
            raise
        # vLLM's background resources end these with the client and its finaliser.
        self.resources.engine_manager = proc_manager
        self.resources.coordinator = coordinator
        if proc_manager is not None:
            self.start_engine_core_monitor()

    async def _add_request(
        self, vllm_add: Callable[[StageLLMCoreRequest], Awaitable[None]], request: StageCoreRequest
    ) -> None:
        if not isinstance(request, StageLLMCoreRequest):
            raise TypeError(f"an LLM stage takes StageLLMCoreRequest, not {type(request).__name__}")
        self.check_health()
        # Ids in flight are the core's to check (StageLLMCoreProc.add_request), not the
        # client's. A duplicate reaches the core that has the first request: vLLM's data
        # parallel client keeps an unfinished request's core binding and routes a request
        # under a bound id to that core (its streaming-input affinity), without a second
        # count. The core's refusal of it does not list the id as finished, so the client
        # keeps the binding and an abort of the first request still reaches its core.
        try:
            await vllm_add(request)
        except EngineDeadError as e:
            raise StageCoreDeadError(await self._dead_reason_async()) from e

    async def _until_core_dies(self, call: Awaitable[_T]) -> _T:
        """Await ``call``, or raise StageCoreDeadError once the core is gone (vLLM leaves a
        utility call to a dead core waiting forever)."""
        call_task = asyncio.ensure_future(call)
        try:
            self.check_health()
            self._ensure_output_queue_task()
            output_task = self.resources.output_queue_task
            await asyncio.wait({call_task, output_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call_task.done():
                call_task.cancel()
        if call_task.done() and not call_task.cancelled():
            try:
                return call_task.result()
            except EngineDeadError as e:
                raise StageCoreDeadError(await self._dead_reason_async()) from e
        # The output task ends only when the stream does: the core is gone.
        raise StageCoreDeadError(await self._dead_reason_async()) from EngineDeadError()

    def _dead_reason(self) -> str:
        manager = self.proc_manager
        state = manager.describe_exit() if manager is not None else "its cores run elsewhere"
        name = f"stage {self.stage.name!r}" if self.stage is not None else "LLM stage"
        return f"{name}: the engine core is gone: {state}"

    async def _dead_reason_async(self) -> str:
        # A core that announced its end is exiting: give its exit code a moment to show.
        manager = self.proc_manager
        if manager is not None:
            await asyncio.to_thread(manager.wait_for_first_exit)
        return self._dead_reason()


class StageLLMCoreClient(AsyncMPClient, StageLLMCoreClientBase):  # type: ignore[misc]
    """The client of one LLM stage core (vLLM's AsyncMPClient transport)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        executor_class: type[Executor],
        log_stats: bool = False,
        client_addresses: dict[str, str] | None = None,
        *,
        metadata: StageConfig | None = None,
        proc_manager: StageLLMCoreProcManager | None = None,
        coordinator: DPCoordinator | None = None,
    ) -> None:
        self._init_stage(
            functools.partial(
                super().__init__, vllm_config, executor_class, log_stats, client_addresses
            ),
            metadata,
            client_addresses,
            proc_manager,
            coordinator,
        )

    async def add_request_async(self, request: StageCoreRequest) -> None:
        await self._add_request(super().add_request_async, request)

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return await self._until_core_dies(
            super().collective_rpc_async(method, timeout, args, kwargs)
        )


class DPLBStageLLMCoreClient(DPLBAsyncMPClient, StageLLMCoreClientBase):  # type: ignore[misc]
    """The client of an LLM stage's data parallel cores (vLLM's DPLBAsyncMPClient)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        executor_class: type[Executor],
        log_stats: bool = False,
        client_addresses: dict[str, str] | None = None,
        *,
        metadata: StageConfig | None = None,
        proc_manager: StageLLMCoreProcManager | None = None,
        coordinator: DPCoordinator | None = None,
    ) -> None:
        self._init_stage(
            functools.partial(
                super().__init__, vllm_config, executor_class, log_stats, client_addresses
            ),
            metadata,
            client_addresses,
            proc_manager,
            coordinator,
        )

    async def add_request_async(self, request: StageCoreRequest) -> None:
        await self._add_request(super().add_request_async, request)

    async def collective_rpc_async(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return await self._until_core_dies(
            super().collective_rpc_async(method, timeout, args, kwargs)
        )


# BAGEL's own default for a plan's length (max_think_token_n).
DEFAULT_THINK_TOKENS = 1000


def start_stage_llm_client(
    stage: StageConfig,
    model: str,
    *,
    encoder: EncoderRecipe | None = None,
    speech: SpeechStage | None = None,
    adapter_capacity: int = 0,
    log_stats: bool = False,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    connectors: Mapping[str, ConnectorConfig] | None = None,
) -> StageLLMCoreClient | DPLBStageLLMCoreClient:
    """Start the cores of the LLM stage ``stage`` serving ``model`` and return its client;
    ``encoder``: the stage encodes prompts for its model family's DiT, by this recipe;
    ``speech``: it is the thinker or the talker of a family that speaks;
    ``adapter_capacity``: the LoRA adapters a replica holds loaded
    (``PipelineConfig.adapter_capacity``; 0: none, vLLM's LoRA off); ``connectors``: the
    pipeline's, through which the cores fetch what upstream stages handed off (a talker's
    inputs).

    Blocks until the cores are ready (about 10 s for a small model on CPU); raises
    StageCoreStartupError, with nothing left running, if they are not.
    """
    _refuse_insecure_serialization()  # before anything is started
    vllm_config = make_stage_llm_vllm_config(stage, model, encoder, speech, adapter_capacity)
    executor_class = Executor.get_class(vllm_config)
    launch = launch_stage_llm_cores(
        vllm_config,
        executor_class,
        log_stats,
        startup_timeout=startup_timeout,
        # Plain data: the cores start by spawn, and read it with the pipeline's schema.
        connectors={
            name: connector.model_dump(mode="json")
            for name, connector in (connectors or {}).items()
        },
    )
    client = StageLLMCoreClientBase.make_async_mp_client(
        vllm_config,
        executor_class,
        log_stats,
        metadata=stage,
        client_addresses=launch.client_addresses,
        proc_manager=launch.proc_manager,
        coordinator=launch.coordinator,
    )
    client.encoder_recipe = encoder
    client.speech_stage = speech
    return client


def _refuse_insecure_serialization() -> None:
    # With it set, vLLM's msgpack would pickle what it cannot encode and unpickle what
    # arrives: anyone who can reach a stage socket could run code in the stage.
    if envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
        raise RuntimeError(
            "VLLM_ALLOW_INSECURE_SERIALIZATION is set: stage sockets never carry pickle; unset it"
        )
