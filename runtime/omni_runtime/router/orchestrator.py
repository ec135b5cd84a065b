"""PipelineOrchestrator: runs one request through a pipeline's stages, in order.

Stage 0 gets the caller's prompt (or chat messages); each later stage gets its upstream's
output: text as its prompt, or what it handed off (hidden states, a context's KV cache) as
named inputs, by connector handles that the orchestrator passes on without ever holding the
arrays. In a model family's pipeline (``omni_runtime.families``) the encoder stage gets the
prompt text (and, for an edit, the input image, which the DiT gets too, as it gets the
prompt text beside its handed-off inputs), and the family
says which companion prompts of the same stage the DiT needs beside it (the negative
prompt's embeddings where the DiT will run guidance, BAGEL's image-dropped context) and
which of the DiT's inputs each one's hand-off becomes: they go in the request's own
message (``StageServerRequest.companions``), run on its replica, and come back with it.
The last stage's outputs are what the caller receives (streamed text, or images). Each
stage's replica comes from its StageReplicaPool.

Every stage request of one caller's request (companions included) goes to replicas of one
pipeline revision: the newest that every stage has a replica of (``router.revisions``);
none complete is a 503 that says so. A stage that reads its input from shared memory runs
in the pod of the replica that wrote it (the companions that feed it ran there too):
shared memory does not cross pods.

A failure in any stage fails this request only, as a PipelineError that carries the HTTP
status the router answers with. Retries are invisible to the caller and bounded:
- a replica that hands a request back unstarted (``StageErrorCode.DRAINING``: it is
  draining) has it sent to another replica of the same stage and revision, up to
  ``HANDBACK_RETRIES`` times per stage request; a request a replica accepted and runs is
  never sent elsewhere, it finishes there;
- a replica lost before the caller received anything (its connection died; nothing it did
  reached the caller), a revision whose replicas of a later stage went away meanwhile, or
  a stage that could not fetch its input from the replica that produced it (gone in a
  rollout before the hand-off was fetched: a STAGE_FAILED error whose ``param`` names the
  input), restarts the request from the first stage, once (hidden states handed to a dead
  replica are gone with it), on the revision then newest.
A pipeline of a family that speaks (Qwen3-Omni) runs its thinker alone for a request that
asks for text; for one that asks for audio too, the thinker's text reaches the caller as it
is written, and its hand-off feeds the talker, whose frames feed code2wav (each pinned to
its producer's pod where it reads shared memory); the last output carries the waveform.

Each retry is reported to ``on_retry`` (/metrics). Cancelling the consumer (a client that
disconnected) aborts the request in the stage running it. An attempt that ends without
being served releases the hand-offs its stages made at once (an abort of the finished
request, sent to the replica holding it): a companion that failed after its partner
finished, or a next stage never reached, leaves nothing for the connector's TTL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from opentelemetry.trace import SpanKind

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageAdapter,
    StageError,
    StageErrorCode,
    StagePrompt,
    StageServerOutput,
    StageServerRequest,
    TraceContext,
)
from omni_runtime.net import address_host
from omni_runtime.router.replica_policies import diffusion_work
from omni_runtime.router.revisions import NoCompleteRevisionError, choose_revision
from omni_runtime.router.stage_replica_pool import (
    NoLiveReplicaError,
    PoolSaturatedError,
    ReplicaLostError,
    StageReplicaPool,
)
from omni_runtime.tracing import SpanScope

logger = logging.getLogger(__name__)

# "speech": text, and audio where the request asks for it (a family that speaks).
OutputKind = Literal["text", "image", "video", "speech"]
# One retry: a second lost replica in a row says more about the stage than the request.
_ATTEMPTS = 2
# Hand-backs of one stage request: each comes from a replica that has since stopped taking
# work, so a few cover a rollout replacing several at once; more would hide a stage that
# only ever drains.
HANDBACK_RETRIES = 3

# (stage name, why): "handed_back" (a draining replica returned it unstarted),
# "replica_lost", "revision_gone" or "input_lost" (the request restarted from the first
# stage).
RetryHook = Callable[[str, str], None]
# (stage name, replica id, revision): a stage request that a replica answered in full.
ServedHook = Callable[[str, int, str], None]
# A stage's error code -> the HTTP status and OpenAI error type the caller gets.
_HTTP_ERRORS: dict[StageErrorCode, tuple[int, str]] = {
    StageErrorCode.BAD_REQUEST: (400, "invalid_request_error"),
    StageErrorCode.UNAVAILABLE: (503, "service_unavailable"),
    StageErrorCode.STAGE_FAILED: (500, "server_error"),
    # The router chose the id, not the caller: a clash is the router's fault.
    StageErrorCode.REQUEST_ID_IN_FLIGHT: (500, "server_error"),
    # Only once the hand-back retries are spent: every replica tried was draining.
    StageErrorCode.DRAINING: (503, "service_unavailable"),
}


@dataclass(frozen=True)
class _HandOff:
    """A stage request whose output names a hand-off, and the replica that holds it."""

    stage_id: int
    replica_id: int
    request_id: str


class _InputLost(Exception):
    """A stage could not fetch the input an upstream replica handed off (that replica went
    away first): run the request again from the first stage."""

    def __init__(self, stage_name: str, message: str) -> None:
        super().__init__(message)
        self.stage_name = stage_name


class _RevisionGone(Exception):
    """The request's revision has no live replica of a stage any more (a rollout took
    them away after the revision was chosen): start again on the revision newest now."""

    def __init__(self, stage_name: str, message: str) -> None:
        super().__init__(message)
        self.stage_name = stage_name


@dataclass
class _Attempt:
    """One pass of a request through the chain."""

    number: int
    revision: str = ""


class PipelineError(Exception):
    """A request the pipeline could not serve: an HTTP status and a message for the caller."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.retry_after = retry_after


@dataclass
class PipelineRequest:
    """What the caller asked for, split by the kind of stage it is for."""

    request_id: str
    prompt: str | None = None
    # Content is text, or a list of parts where the stage takes them (a thinker that hears:
    # text and input_audio, whose samples are in ``audios``).
    messages: list[dict[str, Any]] | None = None
    # Sampling params for LLM stages that generate text, and for diffusion stages.
    llm_params: dict[str, Any] = field(default_factory=dict)
    diffusion_params: dict[str, Any] = field(default_factory=dict)
    # Input images (image-to-image, an edit's), uint8 RGB [height, width, 3] each.
    images: list[np.ndarray] = field(default_factory=list)
    sticky_key: str | None = None
    # Whether the caller reads the last stage's text as it is generated.
    stream: bool = False
    # Input audio (a thinker that hears), float32 mono samples at its processor's rate each,
    # placed by the messages' input_audio parts.
    audios: list[np.ndarray] = field(default_factory=list)
    # The voice to answer in (a family that speaks); None: text only.
    voice: str | None = None
    # The LoRA adapter each stage runs the request with, by stage id (router.adapters).
    adapters: dict[int, StageAdapter] = field(default_factory=dict)


def stage_chain(pipeline: PipelineConfig) -> list[StageConfig]:
    """The stages in the order a request visits them (by stage id).

    Each stage after the first takes its input from the stage before it; a pipeline whose
    connectors say otherwise (a fan-in, a skipped stage) is refused, since requests here
    flow down one chain.
    """
    stages = sorted(pipeline.stages, key=lambda s: s.stage_id)
    for previous, stage in itertools.pairwise(stages):
        sources = set(stage.input_stages)
        if sources and sources != {previous.stage_id}:
            raise ValueError(
                f"stage {stage.stage_id} ({stage.name}) takes input from stage(s) "
                f"{sorted(sources)}; the router runs stages as a chain, so each stage takes "
                f"its input from the one before it (stage {previous.stage_id})"
            )
    for stage in stages[:-1]:
        if stage.type == "diffusion":
            raise ValueError(
                f"stage {stage.stage_id} ({stage.name}) is a diffusion stage but not the last: "
                "images cannot feed a later stage"
            )
    return stages


class PipelineOrchestrator:
    """Runs requests through the stage chain of one pipeline."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        pools: Mapping[int, StageReplicaPool],
        *,
        request_timeout: float = 600.0,
        on_retry: RetryHook | None = None,
        on_served: ServedHook | None = None,
        on_revision: Callable[[str], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stages = stage_chain(pipeline)
        self.pools = dict(pools)
        self.request_timeout = request_timeout
        self.on_retry = on_retry
        self.on_served = on_served
        # Called with the revision of each request that completed.
        self.on_revision = on_revision
        # Stages whose input comes through shared memory: each runs in its producer's pod.
        self._pod_local = {
            stage.stage_id
            for stage in self.stages
            if any(
                (connector := pipeline.connectors.get(name)) is not None
                and connector.name == "SharedMemoryConnector"
                for name in stage.input_stages.values()
            )
        }
        last = self.stages[-1]
        family = pipeline.family_recipe
        self.speaks = family is not None and family.speech is not None
        self.output_kind: OutputKind = (
            "speech"
            if self.speaks
            else "text"
            if last.type != "diffusion"
            else "video"
            if pipeline.video_recipe is not None
            else "image"
        )
        if last.type == "llm" and last.output == "hidden_states":
            raise ValueError(
                f"the last stage ({last.name}) outputs hidden states, which no caller can "
                "use; end the pipeline with a text LLM stage or a diffusion stage"
            )

    async def run(
        self, request: PipelineRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[StageServerOutput, None]:
        """Yield the last stage's outputs for ``request`` (until and including the final
        one); raise PipelineError if any stage fails it, or if it takes longer than
        ``timeout`` seconds (None: the orchestrator's request timeout)."""
        deadline_s = self.request_timeout if timeout is None else timeout
        tracing.set_current_attribute(tracing.REQUEST_ID, request.request_id)
        for number in range(_ATTEMPTS):
            yielded = False
            attempt = _Attempt(number)
            try:
                async with asyncio.timeout(deadline_s):
                    async for output in self._run_once(request, attempt):
                        yielded = True
                        yield output
                self._report(self.on_revision, attempt.revision)
                return
            except (ReplicaLostError, _RevisionGone, _InputLost) as e:
                if yielded or number + 1 == _ATTEMPTS:
                    raise PipelineError(503, str(e), kind="service_unavailable") from None
                logger.warning("request %s: %s; retrying", request.request_id, e)
                reason = (
                    "replica_lost"
                    if isinstance(e, ReplicaLostError)
                    else "input_lost"
                    if isinstance(e, _InputLost)
                    else "revision_gone"
                )
                self._report(self.on_retry, e.stage_name, reason)
            except TimeoutError:
                raise PipelineError(
                    504,
                    f"the request did not finish within {deadline_s:.0f} s",
                    kind="timeout",
                ) from None

    async def complete(self, request: PipelineRequest) -> list[StageServerOutput]:
        """Every output of the last stage for ``request``."""
        return [output async for output in self.run(request)]

    def choose_revision(self) -> str:
        """The revision a request starts on now; PipelineError (503) if none is complete.

        Replicas whose pods are terminating but still serve count only when no revision
        is complete without them, as kube-proxy sends to a Service's serving terminating
        endpoints only when it has no ready one: mid-rollout at one replica per stage, the
        old DiT's pod is terminating before this router has connected the new thinker, and
        the old revision still serves every request meanwhile."""
        chain = [stage.name for stage in self.stages]

        def live(terminating: bool) -> dict[str, set[str]]:
            return {
                stage.name: self.pools[stage.stage_id].revisions(terminating=terminating)
                for stage in self.stages
            }

        with contextlib.suppress(NoCompleteRevisionError):
            return choose_revision(chain, live(terminating=False))
        try:
            return choose_revision(chain, live(terminating=True))
        except NoCompleteRevisionError as e:
            raise PipelineError(503, str(e), kind="service_unavailable") from None

    async def _run_once(
        self, request: PipelineRequest, attempt: _Attempt
    ) -> AsyncIterator[StageServerOutput]:
        upstream: StageServerOutput | None = None
        upstream_text = ""
        revision = attempt.revision = self.choose_revision()
        sticky = request.sticky_key
        # The host of the replica whose output the next stage reads.
        host: str | None = None
        # The hand-offs this attempt's stages made, for release if it fails.
        handed: list[_HandOff] = []
        served = False
        try:
            if self.speaks:
                async for output in self._run_speech(request, attempt.number, revision, handed):
                    yield output
                served = True
                return
            for index, stage in enumerate(self.stages):
                stage_request = self._stage_request(
                    request, attempt.number, index, upstream, upstream_text
                )
                pin = host if stage.stage_id in self._pod_local else None
                if index == len(self.stages) - 1:
                    async for output in self._run_stage(
                        stage, stage_request, sticky, revision, pin
                    ):
                        if output.finished and upstream_text and stage.type == "diffusion":
                            # What the stage before wrote (BAGEL's plan in think mode, or
                            # the prompt an LLM stage wrote for the DiT) comes with the
                            # image, as BAGEL's own inference returns [text, image].
                            output.text = upstream_text
                        yield output
                    served = True
                    return
                # The companions go in the same message, to the same replica: their
                # hand-offs come back among the request's, under the names the DiT reads.
                stage_request.companions = self._companions(request, index, stage_request)
                upstream, upstream_text, host = await self._final_output(
                    stage, stage_request, sticky, revision, pin, handed
                )
        finally:
            if not served and handed:
                # Their consumer will never fetch them (a companion failed after its partner
                # finished, the next stage refused the request, the caller went away): the
                # producers drop them now, not at their connector's TTL.
                await asyncio.shield(self._release(handed))

    async def _run_speech(
        self, request: PipelineRequest, attempt: int, revision: str, handed: list[_HandOff]
    ) -> AsyncIterator[StageServerOutput]:
        """A speaking family's request: the thinker's outputs, then (for a request with a
        voice) one last output with the waveform, the thinker's finish and usage."""
        thinker = self.stages[0]
        thinker_request = self._stage_request(request, attempt, 0, None, "")
        thinker_request.audios = request.audios
        thinker_request.images = request.images
        thinker_request.stream = request.stream
        sticky = request.sticky_key
        if request.voice is None or len(self.stages) == 1:
            async for output in self._run_stage(thinker, thinker_request, sticky, revision):
                yield output
            return
        thinker_request.params = {**thinker_request.params, "speak": True}
        where: list[tuple[str, int]] = []
        thought: StageServerOutput | None = None
        async for output in self._run_stage(
            thinker, thinker_request, sticky, revision, where=where
        ):
            if output.finished:
                thought = output
                handed.append(_HandOff(thinker.stage_id, where[-1][1], thinker_request.request_id))
                # Its text goes on now; the answer finishes with its audio.
                output = StageServerOutput(request_id=output.request_id, text=output.text)
            if output.text:
                yield output
        assert thought is not None
        talker, code2wav = self.stages[1], self.stages[2]
        talker_request = StageServerRequest(
            request_id=thinker_request.request_id,
            inputs=dict(thought.hand_offs),
            params={"voice": request.voice},
            stream=False,
        )
        host = where[-1][0]
        pin = host if talker.stage_id in self._pod_local else None
        # code2wav's answers to the talker's chunks, in order: each is sent as its chunk
        # comes, all to the replica the first went to (the stream's consumer), and passed
        # on as soon as it is decoded, while the talker goes on (a task of its own).
        chunks: collections.deque[asyncio.Future[tuple[StageServerOutput, str, str]]] = (
            collections.deque()
        )
        arrived = asyncio.Event()
        placed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def talk() -> None:
            where: list[tuple[str, int]] = []
            sent = 0
            async for output in self._run_stage(
                talker, talker_request, sticky, revision, pin, where=where
            ):
                if not output.hand_offs:
                    continue
                if not sent:
                    # Released if the request ends before code2wav fetched them all.
                    handed.append(
                        _HandOff(talker.stage_id, where[-1][1], talker_request.request_id)
                    )
                chunk_request = StageServerRequest(
                    request_id=f"{talker_request.request_id}-audio-{sent}",
                    inputs=dict(output.hand_offs),
                )
                first, sent = not sent, sent + 1
                decoding = self._final_output(
                    code2wav,
                    chunk_request,
                    sticky,
                    revision,
                    where[-1][0] if code2wav.stage_id in self._pod_local else None,
                    [],
                    placed=placed if first else None,
                    follow=None if first else placed,
                )
                chunks.append(asyncio.ensure_future(decoding))
                arrived.set()

        talking = asyncio.ensure_future(talk())
        try:
            while chunks or not talking.done():
                if talking.done() and talking.exception() is not None:
                    break
                # The next chunk's audio, or (while the talker speaks) its next chunk or
                # its end, whichever comes first.
                watched: set[asyncio.Future[Any]] = set()
                if not talking.done():
                    watched.add(talking)
                if chunks:
                    watched.add(chunks[0])
                else:
                    arrived.clear()
                    watched.add(asyncio.ensure_future(arrived.wait()))
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for waiting in watched - {talking, *chunks}:
                    waiting.cancel()
                if chunks and chunks[0].done():
                    yield _audio_output(talker_request.request_id, chunks.popleft().result()[0])
            talking.result()  # the talker's failure, if it failed
        finally:
            talking.cancel()
            for pending in chunks:
                pending.cancel()
            await asyncio.gather(talking, *chunks, return_exceptions=True)
        yield StageServerOutput(
            request_id=thinker_request.request_id,
            finished=True,
            finish_reason=thought.finish_reason,
            prompt_tokens=thought.prompt_tokens,
            completion_tokens=thought.completion_tokens,
            execute_time=thought.execute_time,
        )

    async def _release(self, handed: Sequence[_HandOff]) -> None:
        """Tell each replica that made one of ``handed`` to drop it (a no-op for one its
        consumer fetched already); never raises."""
        by_replica: dict[tuple[int, int], list[str]] = {}
        for hand_off in handed:
            by_replica.setdefault((hand_off.stage_id, hand_off.replica_id), []).append(
                hand_off.request_id
            )
        for (stage_id, replica_id), request_ids in by_replica.items():
            try:
                await self.pools[stage_id].release_hand_offs(replica_id, request_ids)
            except Exception:
                logger.debug("release of %s failed", request_ids, exc_info=True)

    async def _final_output(
        self,
        stage: StageConfig,
        stage_request: StageServerRequest,
        sticky_key: str | None,
        revision: str,
        host: str | None,
        handed: list[_HandOff],
        placed: asyncio.Future[str] | None = None,
        follow: asyncio.Future[str] | None = None,
    ) -> tuple[StageServerOutput, str, str]:
        """The final output of a stage that feeds another, all of its text, and the host of
        the replica that made it; a hand-off it names is added to ``handed``. ``placed``
        learns that host as soon as the request is placed; ``follow`` (another request's
        ``placed``) says where this one must go."""
        if follow is not None:
            host = await follow
        text_parts: list[str] = []
        final: StageServerOutput | None = None
        where: list[tuple[str, int]] = []
        async for output in self._run_stage(
            stage, stage_request, sticky_key, revision, host, placed, where
        ):
            text_parts.append(output.text)
            if output.finished:
                final = output
                if output.hand_offs:
                    # Recorded at once: a cancel before this loop ends must not lose it.
                    handed.append(_HandOff(stage.stage_id, where[-1][1], stage_request.request_id))
        assert final is not None
        return final, "".join(text_parts), where[-1][0]

    def _companions(
        self, request: PipelineRequest, index: int, stage_request: StageServerRequest
    ) -> list[StagePrompt]:
        """The prompts the stage at ``index`` runs beside ``stage_request`` where it is its
        family's encoder: the companions its DiT needs (the negative prompt's embeddings,
        BAGEL's image-dropped context), each with the DiT input its hand-off becomes."""
        stage = self.stages[index]
        family = self.pipeline.family_recipe
        if family is None or self.pipeline.encoder_recipe(stage) is None:
            return []
        companions = family.companions(
            stage_request.prompt or "",
            bool(request.images),
            self._dit_params(request),
            thinks=bool(stage.think),
        )
        return [
            StagePrompt(
                suffix=companion.suffix,
                prompt=companion.prompt,
                with_images=companion.with_image,
                params=dict(companion.params),
                names=dict(companion.inputs),
            )
            for companion in companions
        ]

    def _dit_params(self, request: PipelineRequest) -> dict[str, Any]:
        """The DiT's params for ``request``: its defaults, then the caller's."""
        return {**self.stages[-1].default_sampling_params, **request.diffusion_params}

    def _stage_request(
        self,
        request: PipelineRequest,
        attempt: int,
        index: int,
        upstream: StageServerOutput | None,
        upstream_text: str,
    ) -> StageServerRequest:
        """The request to the stage at ``index``, given its upstream's final output (its
        companions' hand-offs among its own) and text."""
        stage = self.stages[index]
        encoder = self.pipeline.encoder_recipe(stage)
        # Ids are unique per stage and attempt: a retried request must not collide with
        # what a replica may still hold of the first attempt.
        request_id = f"{request.request_id}-{attempt}" if attempt else request.request_id
        result = StageServerRequest(
            request_id=request_id, adapter=request.adapters.get(stage.stage_id)
        )
        if stage.type == "llm":
            if encoder is None:
                result.params = dict(request.llm_params)
                # Only a streaming caller reads the last stage's text in steps.
                result.stream = request.stream and index == len(self.stages) - 1
            # An encoder stage's hand-off connector is left to the stage: its own config,
            # of the revision that serves the request, names it.
            if upstream is not None:
                result.prompt = upstream_text
            elif encoder is not None:
                # An encoder applies its model's own template to the prompt text.
                result.prompt = _prompt_text(request)
                if encoder.takes_image:
                    result.images = request.images
                family = self.pipeline.family_recipe
                if family is not None:
                    # BAGEL's thinker samples the input image's VAE latent with the seed's
                    # first draw, which the DiT's generator then skips, as the reference
                    # draws both from one generator.
                    result.params = family.encoder_params(
                        self._dit_params(request), bool(request.images)
                    )
            else:
                result.prompt, result.messages = request.prompt, request.messages
            return result
        result.params = dict(request.diffusion_params)
        result.images = request.images
        if upstream is None:
            result.prompt = _prompt_text(request)
        elif upstream.hand_offs:
            result.inputs = dict(upstream.hand_offs)
            # The caller's prompt too, for what the DiT's pipeline encodes of it itself
            # (HunyuanVideo-1.5's ByT5 reads its quoted text); the others read none of it
            # beside handed-off embeddings.
            result.prompt = _prompt_text(request)
        else:
            result.prompt = upstream_text
        return result

    async def _run_stage(
        self,
        stage: StageConfig,
        stage_request: StageServerRequest,
        sticky_key: str | None,
        revision: str,
        host: str | None = None,
        placed: asyncio.Future[str] | None = None,
        where: list[tuple[str, int]] | None = None,
    ) -> AsyncIterator[StageServerOutput]:
        """The stage's outputs for ``stage_request``, run on a replica of ``revision`` (at
        ``host`` where given). ``placed`` gets the host of the first replica it goes to;
        ``where`` the host and id of each replica it goes to, in order."""
        pool = self.pools[stage.stage_id]
        for handback in range(HANDBACK_RETRIES + 1):
            # One client span per replica tried: the stage's own spans are its children.
            with self._stage_span(stage, stage_request) as span:
                try:
                    pending = await pool.add_request(
                        stage_request,
                        sticky_key=sticky_key,
                        revision=revision,
                        host=host,
                        work=_work(stage, stage_request),
                        adapter=stage_request.adapter.name if stage_request.adapter else None,
                    )
                except NoLiveReplicaError as e:
                    # The revision was complete when chosen: its replicas went away since.
                    raise _RevisionGone(stage.name, str(e)) from None
                except PoolSaturatedError as e:
                    raise PipelineError(
                        429, str(e), kind="rate_limit_exceeded", retry_after=1.0
                    ) from None
                replica_host = address_host(pending.address)
                span.set_attribute(tracing.REPLICA_ID, pending.replica_id)
                if placed is not None and not placed.done():
                    placed.set_result(replica_host)
                if where is not None:
                    where.append((replica_host, pending.replica_id))
                finished = False
                handed_back = False
                try:
                    async for output in pending:
                        assert isinstance(output, StageServerOutput)
                        if output.error is not None:
                            finished = True
                            # A hand-back is the request's only output: nothing was yielded.
                            if (
                                output.error.code is StageErrorCode.DRAINING
                                and handback < HANDBACK_RETRIES
                            ):
                                handed_back = True
                                tracing.fail(span, output.error.message)
                                break
                            if _input_lost(output.error, stage_request):
                                message = f"stage {stage.name!r}: {output.error.message}"
                                raise _InputLost(stage.name, message)
                            raise _stage_error(stage, output.error)
                        finished = output.finished
                        if finished:
                            self._report(self.on_served, stage.name, pending.replica_id, revision)
                        yield output
                finally:
                    if not finished:
                        # Cancelled (the caller went away) or failed: free the stage of it.
                        try:
                            await asyncio.shield(pending.abort())
                        except Exception:
                            logger.debug(
                                "abort of %s failed", stage_request.request_id, exc_info=True
                            )
            if not handed_back:
                return
            logger.info(
                "request %s: stage %s replica %d is draining and handed it back; retrying",
                stage_request.request_id,
                stage.name,
                pending.replica_id,
            )
            self._report(self.on_retry, stage.name, "handed_back")

    def _stage_span(self, stage: StageConfig, stage_request: StageServerRequest) -> SpanScope:
        """The router's span of one call of ``stage`` (a child of the request's span), whose
        context ``stage_request`` carries to the stage."""
        if not tracing.enabled():
            return tracing.NO_SPAN
        scope = tracing.span(
            f"stage {stage.name}",
            kind=SpanKind.CLIENT,
            attributes={
                tracing.REQUEST_ID: stage_request.request_id,
                tracing.STAGE_NAME: stage.name,
                tracing.STAGE_ID: stage.stage_id,
            },
        )
        headers = tracing.trace_headers(scope.span)
        stage_request.trace_context = TraceContext(*headers) if headers else None
        return scope

    def _report(self, hook: Callable[..., None] | None, *args: Any) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            # Metrics must not fail a request that succeeded.
            logger.exception("an orchestrator hook failed")


def _audio_output(request_id: str, spoken: StageServerOutput) -> StageServerOutput:
    """The caller's next piece of a spoken answer: code2wav's audio of one chunk."""
    return StageServerOutput(request_id=request_id, audio=spoken.audio)


def _work(stage: StageConfig, stage_request: StageServerRequest) -> float | None:
    """A diffusion request's estimated work (its params over the stage's defaults); None
    for an LLM stage's, which have no estimate."""
    if stage.type != "diffusion":
        return None
    return diffusion_work({**stage.default_sampling_params, **stage_request.params})


def _input_lost(error: StageError, stage_request: StageServerRequest) -> bool:
    """Whether ``error`` says the stage could not fetch an input handed off to it: a
    STAGE_FAILED error naming one of its inputs (the hand-off was lost, the stage is fine)."""
    return error.code is StageErrorCode.STAGE_FAILED and error.param in stage_request.inputs


def _stage_error(stage: StageConfig, error: StageError) -> PipelineError:
    status, kind = _HTTP_ERRORS[error.code]
    # Only a bad request is the caller's to fix, so only then is a field of theirs named.
    param = error.param if error.code is StageErrorCode.BAD_REQUEST else None
    return PipelineError(status, f"stage {stage.name!r}: {error.message}", kind=kind, param=param)


def _prompt_text(request: PipelineRequest) -> str:
    """The caller's prompt as text: its prompt, else its last user message."""
    if request.prompt is not None:
        return request.prompt
    return _last_user_text(request.messages or [])


def _last_user_text(messages: Sequence[Mapping[str, str]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message.get("content", "")
    return ""
