"""StageLLMFrontend: an LLM stage behind the stage server protocol.

The front-end work of vLLM's API server, done in the stage's own process so that routers
need neither the model nor vLLM: requests are tokenized (chat messages through the model's
chat template) by the stage's request builder, generated token ids become text deltas
through vLLM's incremental detokenizer (as its output processor drives it), and an encode
stage's hidden states are put into the connector that carries them to the next stage (the
router receives only the handle); a model family's encoder first drops the rows of its
template, as the family's pipeline does, and one that hands off a context KV (its recipe's
``hand_off``) has its architecture's ContextHandOff shape the rows and say their layout.

A stage whose model says something beside each token (step_state.StepStateModel: a
speaking family's thinker and talker) hands off what it said, gathered over the request,
as its architecture declares (engine.models.STEP_HAND_OFFS), for the requests that say it
(StageLLMRequestBuilder.says): rows, put when the request finishes, with its prompt's
token ids where declared (the thinker's); or frames of codes (the talker's, for code2wav),
whole when the request finishes, or, where the pipeline streams between stages
(asyncChunk), a chunk every ``chunk_frames`` frames as an output of its own, each with the
frames before it that the next stage decodes it after (its left context), the rest when
it finishes. The frontend names no role: what it does follows from the declaration.

A request made of what an upstream stage handed off (a talker's: ``inputs``) crosses to the
engine core with the hand-offs' handles, which the core fetches itself and makes the
request of (StageLLMInputs): the arrays never pass through here.

A request may name a LoRA adapter (``StageServerRequest.adapter``) where the stage takes
them: its first request has the client load it into the engine (resolved, checked, loaded
by vLLM's add_lora, concurrent first requests waiting on one load), and a bad adapter
refuses that request alone, naming what is wrong. Requests with different adapters share
the engine's batches (vLLM's multi-LoRA). ``adapters`` mirrors the engine's cache of them,
which evicts the least recently used as the mirror does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.engine import EngineCoreEventType, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.connectors import (
    DEFAULT_HANDOFF_CONNECTOR,
    ConnectorHandle,
    StageConnectors,
)
from omni_runtime.engine.models import context_hand_off
from omni_runtime.engine.stage.stage_core_types import (
    HandOff,
    StageAdapter,
    StageError,
    StageErrorCode,
    StageLLMCoreOutput,
    StageLLMCoreRequest,
    StageServerOutput,
    StageServerRequest,
)
from omni_runtime.engine.stage.stage_llm_core_client import (
    AdapterLoadError,
    StageLLMCoreClientBase,
)
from omni_runtime.engine.stage.stage_llm_request_builder import InvalidLLMRequestError
from omni_runtime.stage_server.frontend import RequestSpans, StageFrontend, refusal
from omni_runtime.stage_server.prompt_groups import PromptGroups

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest


logger = logging.getLogger(__name__)


# Hand-offs up to this size are put on the event loop: a thread hop costs ~0.15 ms of CPU,
# ten times the put of a small array (a tiny encoder's rows, a prompt's ids); a larger
# one's copy would hold the loop, so it goes to a thread.
_INLINE_PUT_BYTES = 256 * 1024

# vLLM's REPETITION (a repetition detector's stop) is a stop to an OpenAI client.
_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.REPETITION: "stop",
}


@dataclass
class _Request:
    # vLLM's: text deltas that never end in half a character, special tokens skipped or
    # not as the request's params say, no text for a request that asked for none.
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    output_connector: str | None
    # A context-KV encoder's: the context's token ids, and how many of the last are its
    # prompt.
    prompt_token_ids: list[int] | None = None
    prompt_length: int = 0
    stream: bool = True
    # What a request that does not stream has generated so far (sent when it finishes).
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    # While tracing.
    spans: RequestSpans | None = None
    # What the model said beside each step's tokens (rows, or frames of codes), and the
    # request's prompt ids where they go with it; None: nothing to hand off.
    said: list[torch.Tensor] | None = None
    said_prompt: list[int] | None = None
    # Frames handed off so far in chunks, and how many chunks.
    frames: int = 0
    sent: int = 0
    chunks: int = 0


class StageLLMFrontend(StageFrontend):
    """Tokenize, generate or encode, detokenize; hidden states out through a connector."""

    client: StageLLMCoreClientBase

    def __init__(
        self,
        pipeline: PipelineConfig,
        stage: StageConfig,
        client: StageLLMCoreClientBase,
        connectors: StageConnectors,
    ) -> None:
        super().__init__(pipeline, stage, client, connectors)
        # Keyed by id, which is unique: the stage server refuses an id in flight before it
        # gets here.
        self._requests: dict[str, _Request] = {}
        # Requests waiting for their adapter to load (not yet in _requests): whether an
        # abort came for them meanwhile.
        self._loading: dict[str, bool] = {}
        # Adapter name -> the source and LoRARequest it was last loaded as.
        self._loras: dict[str, tuple[str, LoRARequest]] = {}
        # request id -> (connector, key, when) of hidden states put and maybe not fetched,
        # so that an abort after the handoff still frees them.
        self._handoffs: OrderedDict[str, list[tuple[str, str, float]]] = OrderedDict()
        # Requests that carry companion prompts, run beside them and answered once.
        self._groups = PromptGroups()
        # What the stage hands off of what its model says per step; None: nothing.
        self._says = client.request_builder.step_hand_off
        speech = client.speech_stage
        frames = self._says is not None and self._says.frames and speech is not None
        # Frames in chunks where the pipeline streams between stages: the chunks' size, and
        # the most frames before a chunk that go with it.
        self._chunk_frames = (
            speech.recipe.chunk_frames if frames and speech and pipeline.async_chunk else None
        )
        self._context_frames = speech.recipe.context_frames if frames and speech else 0
        # The stage's own config names its hand-off, not the router's: during a rollout a
        # router of one revision routes through replicas of another, whose connectors may
        # differ (the replicas of one revision agree with each other).
        self._handoff_connector = (
            pipeline.output_connector(stage.stage_id) or DEFAULT_HANDOFF_CONNECTOR
        )
        encoder = client.encoder_recipe
        self._hand_off_name = encoder.hand_off if encoder is not None else "prompt_embeds"
        self._context_hand_off: Any = None
        if encoder is not None and encoder.context_kv:
            assert encoder.architecture is not None
            self._context_hand_off = context_hand_off(
                encoder.architecture,
                client.vllm_config.model_config.model,
                client.request_builder.tokenizer,
            )

    @property
    def in_flight(self) -> int:
        return len(self._requests) + len(self._loading)

    frontend_methods = StageFrontend.frontend_methods | {"tokenize", "detokenize"}

    async def frontend_call(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /tokenize and /detokenize, with this stage's tokenizer and template."""
        if method not in ("tokenize", "detokenize"):
            return await super().frontend_call(method, kwargs)
        builder = self.client.request_builder
        try:
            if method == "tokenize":
                messages, prompt = kwargs.get("messages"), kwargs.get("prompt")
                add_special = kwargs.get("add_special_tokens", True) is not False
                # A long prompt takes milliseconds to tokenize: not on the event loop.
                tokens = await asyncio.to_thread(builder.tokenize, prompt, messages, add_special)
                return {"tokens": tokens, "max_model_len": builder.model_config.max_model_len}
            if method == "detokenize":
                text = await asyncio.to_thread(builder.detokenize, kwargs.get("tokens") or [])
                return {"prompt": text}
        except InvalidLLMRequestError as e:
            return {"error": str(e), "param": e.param}
        raise NotImplementedError(method)

    async def add(self, request: StageServerRequest) -> list[StageServerOutput]:
        request_id = request.request_id
        if request.inputs and self.client.request_builder.input_prompt is None:
            name = next(iter(request.inputs))
            message = f"{name}: an LLM stage takes text (prompt or messages)"
            return [refusal(request_id, StageError.bad_request(message, name))]
        # A request without an adapter runs as the client says on a stage that serves
        # them (a zero adapter where vLLM's kernels need one).
        lora_request = self.client.base_lora if self.adapters is not None else None
        if request.adapter is not None:
            refused = self.adapter_refusal(request)
            if refused is not None:
                return [refusal(request_id, refused)]
            self._loading[request_id] = False
            try:
                lora_request = await self._lora_request(request.adapter)
            except AdapterLoadError as e:
                return [refusal(request_id, e.error)]
            finally:
                aborted = self._loading.pop(request_id)
            if aborted:
                return [
                    StageServerOutput(request_id=request_id, finished=True, finish_reason="abort")
                ]
        builder = self.client.request_builder
        companions: list[tuple[str, StageLLMCoreRequest]] = []
        try:
            if request.inputs:
                if request.companions:
                    message = "companions: a request made of inputs runs alone"
                    return [refusal(request_id, StageError.bad_request(message, "companions"))]
                # Its prompt is the core's to make, of the arrays it fetches.
                core_request = builder.build_with_inputs(request_id, request.inputs, request.params)
            else:
                core_request = builder.build(
                    request_id,
                    prompt=request.prompt,
                    messages=request.messages,
                    params=request.params,
                    images=request.images,
                    audios=request.audios,
                    lora_request=lora_request,
                    hand_off=request.hand_off,
                )
            for companion in request.companions:
                try:
                    built = builder.build(
                        f"{request_id}-{companion.suffix}",
                        prompt=companion.prompt,
                        params=companion.params,
                        images=request.images if companion.with_images else (),
                        lora_request=lora_request,
                    )
                except InvalidLLMRequestError as e:
                    error = e.error
                    message = f"companion {companion.suffix!r}: {error.message}"
                    return [refusal(request_id, StageError(error.code, message, error.param))]
                companions.append((companion.prompt, built))
        except InvalidLLMRequestError as e:
            return [refusal(request_id, e.error)]
        connector = request.output_connector or self._handoff_connector
        state = self._track(core_request, request.prompt, connector, request.stream)
        state.spans = RequestSpans.of(self.stage, request)
        if builder.says(core_request):
            assert self._says is not None
            state.said = []
            if self._says.prompt is not None:
                state.said_prompt = list(core_request.prompt_token_ids or ())
        for prompt, built in companions:
            self._track(built, prompt, connector, stream=False)
        if companions:
            self._groups.start(request_id, {c.suffix: dict(c.names) for c in request.companions})
        added: list[str] = []
        try:
            for built in (core_request, *(built for _, built in companions)):
                await self.client.add_request_async(built)
                added.append(built.request_id)
        except BaseException:
            for built in (core_request, *(built for _, built in companions)):
                self._requests.pop(built.request_id, None)
            if added:
                # The engine has them: they must not run on for nobody.
                await asyncio.shield(self.client.abort_requests_async(added))
            raise
        return []

    def _track(
        self, core_request: StageLLMCoreRequest, prompt: str | None, connector: str, stream: bool
    ) -> _Request:
        """Start keeping the state of ``core_request`` as it runs."""
        context = self._context_hand_off is not None
        ids = list(core_request.prompt_token_ids or ())
        builder = self.client.request_builder
        state = _Request(
            self._detokenizer(core_request),
            prompt_tokens=len(ids),
            output_connector=connector,
            prompt_token_ids=ids if context else None,
            prompt_length=len(builder.framed_prompt_ids(prompt or "")) if context else 0,
            stream=stream,
        )
        self._requests[core_request.request_id] = state
        return state

    async def next_outputs(self) -> list[StageServerOutput]:
        outputs = await self.client.get_outputs_async()
        converted: list[StageServerOutput] = []
        failed: list[str] = []
        for output in outputs.outputs:
            assert isinstance(output, StageLLMCoreOutput)
            result = await self._convert(output)
            if result is None:
                continue
            answer, abort = self._groups.take(result)
            failed += abort
            if answer is not None:
                converted.append(answer)
        if failed:
            # A companion failed (or its request did): the rest of its group runs for
            # nobody. Their outputs are dropped as they come, their hand-offs released.
            await self.abort(failed)
        return converted

    async def abort(self, request_ids: list[str]) -> None:
        request_ids = [
            *request_ids,
            *(companion for i in request_ids for companion in self._groups.running(i)),
        ]
        for request_id in request_ids:
            if request_id in self._loading:
                # Answered as aborted once its adapter's load is over (add).
                self._loading[request_id] = True
        running = [i for i in request_ids if i in self._requests]
        if running:
            await self.client.abort_requests_async(running)
        for request_id in running:
            spans = self._requests[request_id].spans
            if spans is not None:
                spans.aborted()
        for request_id in request_ids:
            for connector, key, _ in self._handoffs.pop(request_id, ()):
                self.connectors.get(connector).release(key)

    async def load_adapter(self, adapter: StageAdapter) -> str | None:
        try:
            await self._lora_request(adapter)
        except AdapterLoadError as e:
            return str(e)
        return None

    async def _lora_request(self, adapter: StageAdapter) -> LoRARequest:
        """vLLM's LoRARequest of ``adapter``, loaded into the engine unless this replica
        holds it already. AdapterLoadError where it cannot run."""
        assert self.adapters is not None
        held = self._loras.get(adapter.name)
        if adapter.name in self.adapters and held is not None and held[0] == adapter.source:
            self.adapters.use(adapter.name)
            return held[1]
        if self.client.vllm_config.lora_config is None:
            # The stage's process started its engine without the capacity the pipeline
            # gives it (start_stage_llm_client's adapter_capacity).
            raise AdapterLoadError(
                f"stage {self.stage.name!r}: its engine was started without LoRA; adapter "
                f"{adapter.name!r} cannot run on it",
                StageErrorCode.STAGE_FAILED,
            )
        # Loaded (and checked) before any request names it; the engine reloads an
        # adapter it evicted from the same files by itself.
        lora = await self.client.load_adapter_async(adapter)
        self._loras[adapter.name] = (adapter.source, lora)
        # The engine's cache over max_cpu_loras evicts the least recently used as this
        # mirror does, so what it evicts is not the mirror's to tell the engine.
        self.adapters.use(adapter.name)
        return lora

    def _detokenizer(self, request: StageLLMCoreRequest) -> IncrementalDetokenizer:
        params = request.sampling_params
        if params is None:  # an encode stage: hidden states, no tokens to read
            return IncrementalDetokenizer()
        # As vLLM's output processor: no tokenizer for a request that asked for no text.
        tokenizer = self.client.request_builder.tokenizer if params.detokenize else None
        return IncrementalDetokenizer.from_new_request(tokenizer, request)

    async def _convert(self, output: StageLLMCoreOutput) -> StageServerOutput | None:
        request_id = output.request_id
        state = self._requests.get(request_id)
        finished = output.finish_reason is not None
        if state is None:
            # Not a request of this frontend's (none is, in normal operation): a refusal
            # still says why, the rest is nobody's.
            if output.error is not None:
                return refusal(request_id, output.error)
            return None
        if state.spans is not None and output.events:
            # Where the stage traces, the core records its scheduling (log_stats): the
            # request's wait ends when it is first scheduled. Its clock is this host's
            # monotonic one, which every process here shares.
            for event in output.events:
                if event.type == EngineCoreEventType.SCHEDULED:
                    state.spans.started(tracing.monotonic_to_ns(event.timestamp))
                    break
        new_token_ids = list(output.new_token_ids)
        if state.said is not None and output.pooling_output is not None:
            # Every step's, whether or not the step is sent on.
            state.said.append(output.pooling_output)
            state.frames += len(output.pooling_output)
        # As vLLM's output processor: a stop token ends the text without being part of it.
        state.detokenizer.update(new_token_ids, output.finish_reason == FinishReason.STOP)
        text = state.detokenizer.get_next_output_text(finished, delta=True)
        chunk = self._chunk_frames
        if chunk and not finished and state.frames - state.sent >= chunk:
            # The next chunk of frames, on its way to the next stage.
            return await self._chunk_output(request_id, state, new_token_ids)
        if not state.stream:
            # Per step, a message to the router and its handling there would cost more
            # than the step itself on a small model; the caller reads only the whole.
            state.text.append(text)
            state.token_ids += new_token_ids
            if not finished:
                return None
            text, new_token_ids = "".join(state.text), state.token_ids
        result = StageServerOutput(request_id=request_id, prompt_tokens=state.prompt_tokens)
        result.token_ids = new_token_ids
        result.text = text
        result.completion_tokens = state.detokenizer.num_output_tokens()
        if state.said is not None:
            if finished and output.error is None and output.finish_reason != FinishReason.ABORT:
                try:
                    result.hand_offs = await self._said_hand_offs(request_id, state)
                except Exception as e:
                    output.finish_reason = FinishReason.ERROR
                    output.error = StageError(
                        StageErrorCode.STAGE_FAILED,
                        f"handing off to connector {state.output_connector!r} failed: {e}",
                    )
        elif output.pooling_output is not None:
            name = self._hand_off_name
            try:
                hand_off, plan = await self._hand_off(request_id, state, output)
                result.hand_offs = {name: hand_off}
                if plan:
                    # A thinking encoder's plan: the text the caller gets beside the image.
                    result.text = plan
            except Exception as e:
                finished = True
                output.finish_reason = FinishReason.ERROR
                output.error = StageError(
                    StageErrorCode.STAGE_FAILED,
                    f"handing {name} to connector {state.output_connector!r} failed: {e}",
                )
        if finished:
            del self._requests[request_id]
            result.finished = True
            reason = FinishReason(output.finish_reason)
            result.finish_reason = _FINISH_REASONS.get(reason, "stop")
            result.execute_time = time.perf_counter() - state.start
            if output.error is not None:
                result.error = output.error
            elif reason == FinishReason.ERROR:
                result.error = StageError(
                    StageErrorCode.STAGE_FAILED, "the engine failed this request"
                )
            if state.spans is not None:
                state.spans.finished(result)
        return result

    async def _hand_off(
        self, request_id: str, state: _Request, output: StageLLMCoreOutput
    ) -> tuple[HandOff, str]:
        """The request's pooled rows, put into its connector as the next stage reads them,
        and the text a thinking encoder wrote (its plan; "" for others)."""
        rows = output.pooling_output
        meta: dict[str, int] = {}
        plan = ""
        if state.prompt_token_ids is not None:
            rows, meta, plan = self._context_hand_off(
                rows, state.prompt_token_ids, state.prompt_length
            )
        else:
            encoder = self.client.encoder_recipe
            if encoder is not None and encoder.drop_prefix:
                # The family's pipeline drops its template's rows before its DiT sees them.
                rows = rows[encoder.drop_prefix :]
        return HandOff(await self._put(request_id, state, rows), meta), plan

    async def _put(
        self, request_id: str, state: _Request, array: Any, key: str | None = None
    ) -> ConnectorHandle:
        """``array`` put under ``key`` (the request's id unless given), recorded for
        release until the connector's TTL."""
        assert state.output_connector is not None
        key = key or request_id
        connector = self.connectors.get(state.output_connector)
        traced = state.spans.connector_put(connector.name) if state.spans else None
        with traced or tracing.NO_SPAN as span:
            if int(array.nbytes) <= _INLINE_PUT_BYTES:
                handle = connector.put(key, array)
            else:
                handle = await asyncio.to_thread(connector.put, key, array)
            span.set_attribute(tracing.BYTES, handle.nbytes)
        now = time.monotonic()
        # A companion's go with its request's: releasing the request releases them.
        owner = self._groups.owner(request_id)
        self._handoffs.setdefault(owner, []).append((connector.name, key, now))
        # Forget records older than the connector keeps their arrays anyway.
        while self._handoffs:
            _, records = next(iter(self._handoffs.items()))
            if now - records[-1][2] <= connector.ttl:
                break
            self._handoffs.popitem(last=False)
        return handle

    # --- What a model says per step -------------------------------------------------------

    async def _said_hand_offs(self, request_id: str, state: _Request) -> dict[str, HandOff]:
        """What a request's model said over its steps, put for the next stage as the
        architecture declares: its rows (and prompt ids), or its frames still unsent."""
        says = self._says
        assert says is not None
        assert state.said is not None
        if says.frames:
            if state.sent and state.sent == state.frames:
                return {}  # every frame went in a chunk
            return {says.said: await self._codes_chunk(request_id, state, state.frames)}
        said = torch.cat(state.said) if state.said else torch.zeros((0, 0))
        rows = await self._put(request_id, state, said, f"{request_id}/{says.said}")
        hand_offs = {says.said: HandOff(rows)}
        if says.prompt is not None:
            prompt = np.asarray(state.said_prompt or [], dtype=np.int64)
            ids = await self._put(request_id, state, prompt, f"{request_id}/{says.prompt}")
            hand_offs[says.prompt] = HandOff(ids)
        return hand_offs

    async def _chunk_output(
        self, request_id: str, state: _Request, new_token_ids: list[int]
    ) -> StageServerOutput | None:
        """The output that hands the next stage a request's next whole chunks of frames."""
        assert self._says is not None
        assert self._chunk_frames is not None
        state.token_ids += new_token_ids
        whole = self._chunk_frames * ((state.frames - state.sent) // self._chunk_frames)
        try:
            hand_off = await self._codes_chunk(request_id, state, state.sent + whole)
        except Exception as e:
            # The request goes on: its next chunk, or its end, hands these frames on.
            logger.warning("request %s: a chunk of codes was not put: %s", request_id, e)
            return None
        return StageServerOutput(request_id=request_id, hand_offs={self._says.said: hand_off})

    async def _codes_chunk(self, request_id: str, state: _Request, end: int) -> HandOff:
        """The frames from the last chunk's end to ``end``, after as many of the frames
        before them as the next stage's left context takes (its meta's ``context``)."""
        assert self._says is not None
        assert state.said is not None
        said = torch.cat(state.said) if state.said else torch.zeros((0, 0))
        state.said = [said]
        context = min(self._context_frames, state.sent)
        codes = said[state.sent - context : end].to(torch.int64)
        if not codes.numel():
            codes = torch.zeros((0, 0), dtype=torch.int64)
        key = f"{request_id}/{self._says.said}/{state.chunks}"
        handle = await self._put(request_id, state, codes, key)
        state.sent, state.chunks = end, state.chunks + 1
        return HandOff(handle, {"context": context})
