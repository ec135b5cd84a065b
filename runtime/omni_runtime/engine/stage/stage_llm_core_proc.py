"""StageLLMCoreProc: vLLM's engine core in its own process, serving one LLM stage.

It is vLLM's ``EngineCoreProc`` (scheduler, busy loop, output thread, handshakes) with what
a stage adds:

- Requests decode as StageLLMCoreRequest, and what they carry beyond vLLM's fields
  (``additional_information``) reaches the scheduled request, a StageLLMRequest.
- A request the engine cannot serve is answered with an error output and never reaches the
  engine: one of the wrong kind for this stage's runner, an empty or too long prompt,
  token ids outside the vocabulary, parameters that do not decode or that vLLM's checks
  refuse (logprobs, logit bias, allowed token ids), a LoRA adapter or multimodal input the
  stage does not serve, an id in flight already. vLLM's front end checks these before its
  engine core sees a request, and the core trusts it: one such request kills the core.
  Every refusal is answered from the busy loop, in order with the requests before it, so
  that the answer can say whether the id is still in flight (a refused duplicate must not
  end the first request's binding in a data parallel client).
- A request naming a LoRA adapter the engine has not loaded from those files yet has it
  loaded first (vLLM's add_lora, which checks it), on the busy loop before the request
  joins the scheduler, and is refused if that fails: inside a model step the same failure
  would end the engine. The stage's clients load adapters before their requests
  (StageLLMCoreClientBase.load_adapter_async); this guards the core from any other caller.
- Before it says ready, the core runs one forward pass of a few tokens through every layer,
  attention included (``_initialize_kv_caches``): an engine that cannot run a request (a
  head size vLLM's CPU attention lacks) fails to start and says why, instead of saying
  ready and dying on its first request.
- A request made of what an upstream stage handed off (a talker's: ``inputs``, connector
  handles) has its arrays fetched here, through the pipeline's connectors, and is finished
  here as vLLM's front end would have (StageLLMInputs): the stage server forwards handles
  and never touches the arrays. Each such request is fetched on a thread of its own, so a
  slow producer holds up neither other requests nor aborts; an abort that comes meanwhile
  is answered once the fetch is over (the producer's copy is taken either way). A lost
  hand-off is refused as STAGE_FAILED naming the input (``param``), which the router
  answers by running the request again from the first stage.
- Aborting a request yields an output (finish_reason ABORT), as the stage contract asks.
- ``run_stage_core`` is its own process entry (vLLM's ``run_engine_core`` constructs
  vLLM's classes): SIGTERM, SIGINT or the death of the parent stop the busy loop cleanly,
  in-flight requests are answered as aborted, and the client is told the core is gone.

Outputs need no conversion: vLLM's scheduler builds EngineCoreOutputs, which decode as
StageLLMCoreOutputs (see ``_stage_llm_core_types``); the core builds StageLLMCoreOutputs
itself where it has something of the stage's to say (a refusal). Tensors (hidden states)
travel as dtype, shape and a raw frame.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
from vllm import envs
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.logger import configure_logging
from vllm.lora.request import LoRARequest
from vllm.tasks import POOLING_TASKS
from vllm.transformers_utils.config import maybe_register_config_serialize_by_value
from vllm.utils.network_utils import make_zmq_socket
from vllm.utils.system_utils import decorate_logs, set_process_title
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.executor import Executor
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder

from omni_runtime.engine.stage.stage_core_client import request_id_in_flight_error
from omni_runtime.engine.stage.stage_core_types import (
    StageError,
    StageErrorCode,
    StageLLMCoreOutputs,
    StageLLMCoreRequest,
)
from omni_runtime.engine.stage.stage_llm_inputs import InputsRefusedError, StageLLMInputs
from omni_runtime.engine.stage.stop_watchers import start_stop_watchers

logger = logging.getLogger(__name__)

_CLIENT_INDEX_POSITION = StageLLMCoreRequest.__struct_fields__.index("client_index")


class StageLLMRequest(Request):  # type: ignore[misc]
    """vLLM's scheduled request, with what a StageLLMCoreRequest carries beyond vLLM's."""

    additional_information: dict[str, Any] | None = None

    @classmethod
    def from_stage_request(cls, request: StageLLMCoreRequest, block_hasher: Any) -> StageLLMRequest:
        # vLLM builds a scheduled request from its engine-core request by classmethod, so
        # the result is of this class.
        scheduled: StageLLMRequest = cls.from_engine_core_request(request, block_hasher)
        scheduled.additional_information = request.additional_information
        return scheduled


class StageWarmUpError(RuntimeError):
    """The engine loaded but could not run its warm-up pass: it would fail every request."""


# Tokens of the warm-up pass: a few, so that attention runs over more than one position.
WARM_UP_TOKENS = 8


def warm_up_worker(worker: Any) -> None:
    """One dummy forward pass on ``worker`` (a vLLM worker) with attention metadata built,
    as the runner's own warm-up builds it for a compiled model; no request sees its
    tokens (a model that keeps per-request state is told the step is nobody's)."""
    runner = worker.model_runner
    runner._dummy_run(min(WARM_UP_TOKENS, runner.max_num_tokens), force_attention=True)


@dataclass(frozen=True)
class _Refused:
    """A request the core will not run, queued as an ADD so that the busy loop answers it
    (only the busy loop may read the scheduler, which knows whether the id is in flight)."""

    request_id: str
    client_index: int
    error: StageError


class StageLLMCoreProc(EngineCoreProc):  # type: ignore[misc]
    """vLLM's engine-core process wrapper, speaking the LLM stage's wire types."""

    def __init__(
        self, *args: Any, connectors: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """vLLM's arguments (``vllm_config`` by keyword), and the pipeline's ``connectors``
        (name -> ConnectorConfig or its JSON form), through which requests' inputs come."""
        # LoRA id -> the path add_lora loaded and checked it from. An adapter vLLM evicted
        # since is loaded again in a step from the same files, which were found good.
        self._checked_loras: dict[int, str] = {}
        # Before vLLM's init starts the input thread, which may take a request at once.
        self._inputs = StageLLMInputs(kwargs["vllm_config"], connectors or {})
        # Requests whose inputs are being fetched -> whether an abort came for them. The lock
        # orders an abort against the request's joining the input queue.
        self._fetching: dict[str, bool] = {}
        self._fetching_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._inputs.close()

    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> Any:
        """vLLM's, then the warm-up pass. vLLM's own profiling run proves the memory, not
        the kernels: on a CPU, or where the model runs eagerly, it runs no attention at all."""
        kv_cache_config = super()._initialize_kv_caches(vllm_config)
        try:
            self.model_executor.collective_rpc(warm_up_worker)
        except Exception as e:
            raise StageWarmUpError(
                f"the engine cannot run a request: {type(e).__name__}: {e}"
            ) from e
        return kv_cache_config

    def add_lora(self, lora_request: LoRARequest | list[Any]) -> bool:
        """vLLM's (a utility call, on the busy loop), remembering what loaded."""
        if not isinstance(lora_request, LoRARequest):
            # A utility call's arguments arrive as decoded msgpack; vLLM converts them by
            # the method's annotations, which this module's postponed annotations leave as
            # strings it cannot read.
            lora_request = msgspec.convert(lora_request, LoRARequest)
        loaded: bool = super().add_lora(lora_request)
        self._checked_loras[lora_request.lora_int_id] = lora_request.lora_path
        return loaded

    def _lora_refusal(self, lora_request: LoRARequest) -> StageError | None:
        """Why a request's adapter cannot run (it fails to load), or None once loaded."""
        if self._checked_loras.get(lora_request.lora_int_id) == lora_request.lora_path:
            return None
        try:
            self.add_lora(lora_request)
        except Exception as e:  # whatever loading raised, the request is what fails
            logger.warning("adapter %s did not load: %s", lora_request.lora_name, e)
            return StageError.bad_request(
                f"lora_request: adapter {lora_request.lora_name!r} ({lora_request.lora_path}) "
                f"cannot be loaded: {' '.join(str(e).split())}",
                "model",
            )
        return None

    def preprocess_add_request(self, request: StageLLMCoreRequest) -> tuple[Request, int]:
        """vLLM's preprocessing, building a StageLLMRequest instead of vLLM's Request."""
        if self.mm_receiver_cache is not None and request.mm_features:
            request.mm_features = self.mm_receiver_cache.get_and_update_features(
                request.mm_features
            )
        scheduled = StageLLMRequest.from_stage_request(request, self.request_block_hasher)
        if scheduled.use_structured_output:
            self.structured_output_manager.grammar_init(scheduled)
        return scheduled, request.current_wave

    def add_request(self, request: Request | _Refused, request_wave: int = 0) -> None:
        """vLLM's, refusing a request whose id is in flight already (vLLM's scheduler
        asserts on one, which ends the core; its front end makes ids unique, a stage's
        callers choose theirs), and answering the ones the input thread refused. Runs on
        the busy loop, which owns the scheduler."""
        request_id = request.request_id
        existing = self.scheduler.requests.get(request_id)
        if (
            existing is not None
            # A streaming-input session takes its next chunk under the same id.
            and existing.streaming_queue is None
            and existing.status != RequestStatus.WAITING_FOR_STREAMING_REQ
        ):
            error = request_id_in_flight_error(request_id)
            self._send_error_output(request_id, request.client_index, error, still_in_flight=True)
            return
        # A streaming session's id stays bound to this core whatever its next chunk.
        held = existing is not None
        if isinstance(request, _Refused):
            self._send_error_output(
                request_id, request.client_index, request.error, still_in_flight=held
            )
            return
        if request.lora_request is not None:
            lora_error = self._lora_refusal(request.lora_request)
            if lora_error is not None:
                self._send_error_output(
                    request_id, request.client_index, lora_error, still_in_flight=held
                )
                return
        super().add_request(request, request_wave)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort, and answer each request that was still unfinished with an ABORT output.

        vLLM's core answers nothing (its front end already knows), but a stage's caller
        waits on outputs. Aborts arrive twice (eagerly, then in order with the rest), and
        the second time the requests are finished already: one answer each.
        """
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._send_abort_outputs(aborted)

    def process_input_sockets(
        self,
        input_addresses: list[str],
        coord_input_address: str | None,
        identity: bytes,
        ready_event: threading.Event,
    ) -> None:
        """The input I/O thread: decode, refuse what the engine cannot serve, queue the rest.

        Like vLLM's, without its tensor-IPC queue and fault-tolerance hooks, which a stage
        does not enable.
        """
        with ExitStack() as stack, zmq.Context() as ctx:
            input_sockets = [
                stack.enter_context(
                    make_zmq_socket(ctx, address, zmq.DEALER, identity=identity, bind=False)
                )
                for address in input_addresses
            ]
            coord_socket = None
            if coord_input_address is not None:
                coord_socket = stack.enter_context(
                    make_zmq_socket(
                        ctx, coord_input_address, zmq.XSUB, identity=identity, bind=False
                    )
                )
                coord_socket.send(b"\x01")  # subscribe to the coordinator's broadcasts
            poller = zmq.Poller()
            ready_payload = msgspec.msgpack.encode(self._make_ready_response())
            for input_socket in input_sockets:
                # A ROUTER can only address a peer it has heard from: this first message
                # also tells the client where to send.
                input_socket.send(ready_payload)
                poller.register(input_socket, zmq.POLLIN)
            if coord_socket is not None:
                if coord_socket.recv() != b"READY":
                    raise RuntimeError("unexpected first message from the DP coordinator")
                poller.register(coord_socket, zmq.POLLIN)
            ready_event.set()
            del ready_event
            # vLLM's msgpack: tensors as dtype, shape and raw frames; pickle refused.
            add_decoder = MsgpackDecoder(StageLLMCoreRequest)
            generic_decoder = MsgpackDecoder()
            while True:
                for socket, _ in poller.poll():
                    type_frame, *data_frames = socket.recv_multipart(copy=False)
                    # The coordinator announces newly started engines with READY.
                    if type_frame.buffer == b"READY":
                        continue
                    self._accept_input(type_frame.bytes, data_frames, add_decoder, generic_decoder)

    def _accept_input(
        self,
        type_bytes: bytes,
        frames: Sequence[zmq.Frame],
        add_decoder: MsgpackDecoder,
        generic_decoder: MsgpackDecoder,
    ) -> None:
        try:
            request_type = EngineCoreRequestType(type_bytes)
        except ValueError:
            logger.warning("dropping a message of unknown type %r", type_bytes)
            return
        if request_type is EngineCoreRequestType.ADD:
            self._accept_add(frames, add_decoder)
            return
        try:
            payload = generic_decoder.decode(frames)
        except Exception as e:
            # A peer speaking another protocol must not take the core down.
            logger.warning("dropping an undecodable %s message: %s", request_type.name, e)
            return
        if request_type is EngineCoreRequestType.ABORT:
            with self._fetching_lock:
                for request_id in payload if isinstance(payload, list) else ():
                    if request_id in self._fetching:
                        self._fetching[request_id] = True
                # Eagerly (a running batch sees it) and in order (after the request's ADD).
                self.aborts_queue.put_nowait(payload)
                self.input_queue.put_nowait((request_type, payload))
            return
        self.input_queue.put_nowait((request_type, payload))

    def _accept_add(self, frames: Sequence[zmq.Frame], decoder: MsgpackDecoder) -> None:
        try:
            request: StageLLMCoreRequest = decoder.decode(frames)
        except Exception as e:
            self._refuse_undecodable(frames, e)
            return
        if request.inputs:
            self._accept_with_inputs(request)
            return
        self._admit(request)

    def _admit(self, request: StageLLMCoreRequest) -> None:
        """Queue ``request`` for the busy loop, or its refusal."""
        refusal = self._refusal(request)
        if refusal is not None:
            self._refuse(request.request_id, request.client_index, refusal, request.current_wave)
            return
        try:
            scheduled = self.preprocess_add_request(request)
        except Exception as e:
            logger.exception("preparing request %s failed", request.request_id)
            failed = StageError(
                StageErrorCode.STAGE_FAILED,
                f"the engine could not prepare the request: {type(e).__name__}: {e}",
            )
            self._refuse(request.request_id, request.client_index, failed, request.current_wave)
            return
        self.input_queue.put_nowait((EngineCoreRequestType.ADD, scheduled))

    def _accept_with_inputs(self, request: StageLLMCoreRequest) -> None:
        request_id = request.request_id
        with self._fetching_lock:
            if request_id in self._fetching:
                # Not in the scheduler yet, so the busy loop's check would miss it.
                error = request_id_in_flight_error(request_id)
                self._send_error_output(
                    request_id, request.client_index, error, still_in_flight=True
                )
                return
            self._fetching[request_id] = False
        threading.Thread(
            target=self._fetch_inputs, args=(request,), daemon=True, name="llm-core-inputs"
        ).start()

    def _fetch_inputs(self, request: StageLLMCoreRequest) -> None:
        """Fetch ``request``'s inputs, finish it and queue it (or its refusal), unless it
        was aborted meanwhile: then answer the abort."""
        finished: StageLLMCoreRequest | None = None
        error: StageError | None = None
        try:
            finished = self._inputs.finish(request, self._inputs.fetch(request))
        except InputsRefusedError as e:
            error = e.error
        except Exception as e:
            logger.exception("making request %s of its inputs failed", request.request_id)
            error = StageError(
                StageErrorCode.STAGE_FAILED,
                f"the engine could not prepare the request: {type(e).__name__}: {e}",
            )
        with self._fetching_lock:
            aborted = self._fetching.pop(request.request_id)
            if not aborted:
                if finished is not None:
                    self._admit(finished)
                else:
                    assert error is not None
                    self._refuse(
                        request.request_id, request.client_index, error, request.current_wave
                    )
        if aborted:
            self._send_abort_outputs_to_client([request.request_id], request.client_index)

    def _refuse(self, request_id: str, client_index: int, error: StageError, wave: int) -> None:
        refused = _Refused(request_id, client_index, error)
        self.input_queue.put_nowait((EngineCoreRequestType.ADD, (refused, wave)))

    def _refusal(self, request: StageLLMCoreRequest) -> StageError | None:
        """Why the engine must not see ``request``, or None."""
        bad = StageError.bad_request
        model_config = self.vllm_config.model_config
        encodes = model_config.runner_type == "pooling"
        if encodes and request.sampling_params is not None:
            return bad(
                "sampling_params: this stage encodes hidden states (pooling runner) and "
                "cannot generate; send pooling_params",
                "sampling_params",
            )
        if not encodes and request.pooling_params is not None:
            return bad(
                "pooling_params: this stage generates text and cannot return hidden "
                "states; send sampling_params",
                "pooling_params",
            )
        if request.sampling_params is None and request.pooling_params is None:
            return bad(
                "sampling_params: required (or pooling_params for a hidden-states stage)",
                "sampling_params",
            )
        if request.prompt_embeds is not None and not model_config.enable_prompt_embeds:
            return bad(
                "prompt_embeds: this stage was not started with enable_prompt_embeds",
                "prompt_embeds",
            )
        token_ids = request.prompt_token_ids or []
        prompt_len = len(token_ids) if request.prompt_embeds is None else len(request.prompt_embeds)
        if prompt_len == 0:
            return bad("prompt: empty", "prompt")
        # A generated token needs a position of its own.
        limit = model_config.max_model_len - (0 if encodes else 1)
        if prompt_len > limit:
            return bad(
                f"prompt: {prompt_len} tokens, but this stage takes at most {limit} "
                f"(max_model_len {model_config.max_model_len})",
                "prompt",
            )
        vocab_size = model_config.get_vocab_size()
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
            return bad(
                f"prompt_token_ids: token ids must be in [0, {vocab_size})", "prompt_token_ids"
            )
        if request.pooling_params is not None:
            tasks = [t for t in self.model_executor.supported_tasks if t in POOLING_TASKS]
            if request.pooling_params.task not in tasks:
                return bad(
                    f"pooling_params.task: {request.pooling_params.task!r} is not served "
                    f"here (served: {', '.join(tasks)})",
                    "task",
                )
        if request.lora_request is not None and self.vllm_config.lora_config is None:
            return bad("lora_request: this stage serves no LoRA adapters", "lora_request")
        if request.mm_features and not model_config.is_multimodal_model:
            return bad("mm_features: this stage's model takes no multimodal input", "mm_features")
        if request.sampling_params is not None:
            if request.sampling_params.n != 1:
                return bad(
                    "sampling_params.n: an engine core samples one sequence per request", "n"
                )
            if request.sampling_params.max_tokens is None:
                return bad("sampling_params.max_tokens: required", "max_tokens")
            if request.sampling_params.structured_outputs is not None:
                return bad(
                    "sampling_params.structured_outputs: not supported by a stage",
                    "structured_outputs",
                )
            try:
                # vLLM's own checks of what indexes the logits (logprobs, logit_bias,
                # stop/allowed token ids against the vocabulary), as its front end runs them.
                request.sampling_params.verify(
                    model_config, self.vllm_config.speculative_config, None, None
                )
            except (VLLMValidationError, ValueError) as e:
                return _describe_validation_error(e, f"sampling_params: {e}")
        return None

    def _refuse_undecodable(self, frames: Sequence[zmq.Frame], error: Exception) -> None:
        # The request cannot be read as a whole, but its id and client usually can, and an
        # answer naming the problem beats a caller waiting forever.
        try:
            fields = msgspec.msgpack.decode(frames[0].buffer)
            request_id, client_index = fields[0], fields[_CLIENT_INDEX_POSITION]
        except Exception:
            logger.warning("dropping an undecodable request: %s", error)
            return
        if not isinstance(request_id, str) or not isinstance(client_index, int):
            logger.warning("dropping an undecodable request: %s", error)
            return
        self._refuse(request_id, client_index, _describe_decode_error(error), 0)

    def _send_error_output(
        self, request_id: str, client_index: int, error: StageError, *, still_in_flight: bool
    ) -> None:
        logger.info("refusing request %s: %s", request_id, error)
        refusal = StageLLMCoreOutputs.refusal(request_id, error, still_in_flight=still_in_flight)
        self.output_queue.put_nowait((client_index, refusal))

    @staticmethod
    def run_stage_core(
        *,
        vllm_config: VllmConfig,
        local_client: bool,
        handshake_address: str,
        executor_class: type[Executor],
        log_stats: bool,
        client_handshake_address: str | None = None,
        tensor_queue: Any = None,
        dp_rank: int = 0,
        failure_pipe: Connection | None = None,
        connectors: Mapping[str, Any] | None = None,
    ) -> None:
        """The body of a stage core process (started by StageLLMCoreProcManager);
        ``connectors``: the pipeline's, in their JSON form (StageLLMCoreProc).

        Returns when the core stopped cleanly (SIGTERM, SIGINT, parent gone); raises, after
        telling the client, when it failed, and sends why on ``failure_pipe`` (one line),
        which the manager's error messages quote.
        """
        logging.basicConfig(
            level=os.environ.get("OMNI_LOG_LEVEL", "INFO"),
            format="%(asctime)s %(levelname)s [llm-core %(process)d] %(name)s: %(message)s",
        )
        if logging_config := getattr(vllm_config, "logging_config", None):
            configure_logging(logging_config)
        # Hugging Face configs of trust_remote_code models must pickle by value in this
        # process as well (vLLM's own engine-core entry does the same).
        maybe_register_config_serialize_by_value()
        if envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
            raise RuntimeError(
                "VLLM_ALLOW_INSECURE_SERIALIZATION is set: a stage core never unpickles "
                "what arrives on its sockets; unset it"
            )
        parallel_config = vllm_config.parallel_config
        data_parallel = parallel_config.data_parallel_size > 1
        set_process_title(f"StageLLMCoreProc_DP{dp_rank}" if data_parallel else "StageLLMCoreProc")
        decorate_logs()
        parallel_config.data_parallel_index = dp_rank
        # Ranks of a dense model share nothing: each is an engine of its own.
        parallel_config.reconfigure_for_independent_dp_rank()

        serving: list[StageLLMCoreProc] = []
        stop_requested = threading.Event()
        serving_lock = threading.Lock()

        def stop(reason: str) -> None:
            logger.info("LLM stage core stopping: %s", reason)
            with serving_lock:
                stop_requested.set()
                if not serving:
                    # Still loading: no request to answer, no output thread to flush.
                    os._exit(0)
                core = serving[0]
            core.shutdown_state = EngineShutdownState.REQUESTED
            core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

        start_stop_watchers(stop)
        try:
            core = StageLLMCoreProc(
                vllm_config=vllm_config,
                local_client=local_client,
                handshake_address=handshake_address,
                executor_class=executor_class,
                log_stats=log_stats,
                client_handshake_address=client_handshake_address,
                tensor_queue=tensor_queue,
                engine_index=dp_rank,
                connectors=connectors,
            )
        except Exception as e:
            if failure_pipe is not None:
                send_failure(failure_pipe, e)
            raise
        with serving_lock:
            serving.append(core)
            if stop_requested.is_set():  # a stop that arrived as loading finished
                core.shutdown_state = EngineShutdownState.REQUESTED
        try:
            core.run_busy_loop()
        except SystemExit:
            # The busy loop's way of saying shutdown is complete; in-flight requests have
            # been answered as aborted. The dead notice flushes them out and tells the
            # client not to wait for more.
            core._send_engine_dead()
        except BaseException as e:
            logger.exception("LLM stage core failed")
            if failure_pipe is not None:
                send_failure(failure_pipe, e)
            core._send_engine_dead()
            raise
        finally:
            core.shutdown()
            # The interpreter's last garbage collection would walk the engine's whole heap
            # (seconds); exit reclaims it anyway. vLLM does the same on ROCm.
            gc.freeze()


# Long enough for vLLM's messages (a KV cache that does not fit says by how much).
_FAILURE_CHARS = 600


def send_failure(pipe: Connection, error: BaseException) -> None:
    """Tell the manager, in one line of bytes (no pickle), why this core failed."""
    reason = " ".join(f"{type(error).__name__}: {error}".split())[:_FAILURE_CHARS]
    with contextlib.suppress(OSError):  # the manager is gone: nobody to tell
        pipe.send_bytes(reason.encode())


def _describe_validation_error(error: Exception, otherwise: str) -> StageError:
    """ "field: what is wrong" where vLLM's error names the field, else ``otherwise``."""
    if isinstance(error, VLLMValidationError) and error.parameter is not None:
        return StageError.bad_request(f"{error.parameter}: {error.args[0]}", error.parameter)
    return StageError.bad_request(otherwise)


def _describe_decode_error(error: Exception) -> StageError:
    # SamplingParams and PoolingParams validate themselves while decoding.
    return _describe_validation_error(
        error, f"request: cannot be decoded ({type(error).__name__}: {error})"
    )
