"""PipelineOrchestrator: runs one request along a route of its pipeline's stage graph.

The pipeline's family declares its stages' graph (``omni_runtime.families.graph``): typed
edges, and the route each kind of answer runs. The request asks for one kind (a spoken
answer; none: the pipeline's first), and its route's stages run in order, each fed by the
edge into it (``stage_requests``): the first reads the caller's request; a ``text`` edge
makes the producer's text the consumer's prompt; a ``hand_off`` edge passes the producer's
hand-offs (hidden states, a context's KV cache, a thinker's rows) as the consumer's named
inputs, by connector handles that the orchestrator passes on without ever holding the
arrays; a ``stream`` edge sends the consumer each chunk the producer hands off as it comes,
every chunk to the replica the first went to, and passes its answers on in order while the
producer goes on. The route's last stage's outputs are the caller's (streamed text, images,
a video, audio), with its text stage's text: beside the final output (a thinking encoder's
plan beside its image), or as it is written, the text stage's finish closing the answer (a
spoken answer's transcript). Each stage's replica comes from its StageReplicaPool.

An encoder stage's family says which companion prompts of the same stage the DiT needs
beside the caller's (the negative prompt's embeddings where the DiT will run guidance,
BAGEL's image-dropped context) and which of the DiT's inputs each one's hand-off becomes:
they go in the request's own message (``StageServerRequest.companions``), run on its
replica, and come back with it.

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

import msgspec
from opentelemetry.trace import SpanKind

from omni_runtime import tracing
from omni_runtime.config import PipelineConfig, StageConfig
from omni_runtime.engine.stage.stage_core_types import (
    StageError,
    StageErrorCode,
    StageServerOutput,
    StageServerRequest,
    TraceContext,
)
from omni_runtime.families.graph import GraphEdge, GraphRoute
from omni_runtime.net import address_host
from omni_runtime.router import stage_requests
from omni_runtime.router.replica_policies import diffusion_work
from omni_runtime.router.revisions import NoCompleteRevisionError, choose_revision
from omni_runtime.router.stage_replica_pool import (
    NoLiveReplicaError,
    PoolSaturatedError,
    ReplicaLostError,
    StageReplicaPool,
)
from omni_runtime.router.stage_requests import PipelineRequest
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


@dataclass
class _StageResult:
    """What a stage that feeds another returned, once it finished."""

    final: StageServerOutput | None = None
    text: str = ""
    host: str = ""


@dataclass
class _RouteRun:
    """One attempt's pass along a route, and what the caller's answer takes from it."""

    request: PipelineRequest
    attempt: int
    revision: str
    route: GraphRoute
    # The hand-offs this attempt's stages made, for release if it fails.
    handed: list[_HandOff] = field(default_factory=list)
    served: bool = False
    # The route's text stage's whole text and final output, once it finished.
    text: str = ""
    text_final: StageServerOutput | None = None

    def is_text(self, stage: StageConfig) -> bool:
        return stage.stage_id == self.route.text_stage

    def answer(self, output: StageServerOutput) -> StageServerOutput:
        """The caller's output for one of the route's last stage's."""
        if self.route.live_text:
            # Its media alone: the text went as it was written, and its stage's finish
            # closes the answer.
            return StageServerOutput(
                request_id=output.request_id, images=output.images, audio=output.audio
            )
        if output.finished and self.text:
            # What the text stage wrote (BAGEL's plan in think mode, the prompt an LLM
            # stage wrote for the DiT) comes with the image, as BAGEL's own inference
            # returns [text, image].
            output.text = self.text
        return output

    def closing(self) -> StageServerOutput:
        """The answer's last output where its text was live: the text stage's finish and
        usage."""
        final = self.text_final
        assert final is not None
        return StageServerOutput(
            request_id=final.request_id,
            finished=True,
            finish_reason=final.finish_reason,
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            execute_time=final.execute_time,
        )


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
    """Runs requests along the routes of one pipeline's stage graph."""

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
        self.graph = pipeline.graph
        self._stages_by_id = {stage.stage_id: stage for stage in self.stages}
        family = pipeline.family_recipe
        # A family that hears and speaks answers chat in text, spoken too where its
        # pipeline has the stages that speak (a thinker alone hears, and answers in text).
        hears = family is not None and family.speech is not None
        first = self.graph.answers[0]
        self.output_kind: OutputKind = "speech" if hears else "text" if first == "audio" else first
        for route in self.graph.routes:
            last = self._stages_by_id[route.stages[-1]]
            if last.type == "llm" and last.output == "hidden_states":
                raise ValueError(
                    f"the last stage ({last.name}) outputs hidden states, which no caller can "
                    "use; end the pipeline with a text LLM stage or a diffusion stage"
                )

    @property
    def first_stage(self) -> StageConfig:
        """The stage that reads a request of the pipeline's first answer (its tokenizer is
        the pipeline's)."""
        return self._stages_by_id[self.graph.routes[0].stages[0]]

    @property
    def answer_stage(self) -> StageConfig:
        """The stage that makes the pipeline's first answer (a video pipeline's DiT)."""
        return self._stages_by_id[self.graph.routes[0].stages[-1]]

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
        # The caller's mistake is said before any replica is asked for.
        try:
            route = self.graph.route(request.answer)
        except KeyError:
            answers = ", ".join(self.graph.answers)
            raise PipelineError(
                400, f"this pipeline answers with {answers}, not {request.answer}"
            ) from None
        revision = attempt.revision = self.choose_revision()
        run = _RouteRun(request, attempt.number, revision, route)
        try:
            async for output in self._run_route(run):
                yield output
            run.served = True
        finally:
            if not run.served and run.handed:
                # Their consumer will never fetch them (a companion failed after its partner
                # finished, the next stage refused the request, the caller went away): the
                # producers drop them now, not at their connector's TTL.
                await asyncio.shield(self._release(run.handed))

    async def _run_route(self, run: _RouteRun) -> AsyncIterator[StageServerOutput]:
        """The caller's outputs of ``run``: its route's stages in order, each fed by the
        edge into it; the last one's outputs are the answer's, with the text stage's text."""
        route, request = run.route, run.request
        stages = [self._stages_by_id[stage_id] for stage_id in route.stages]
        upstream: StageServerOutput | None = None
        upstream_text = ""
        # The host of the replica whose output the next stage reads.
        host: str | None = None
        edge: GraphEdge | None = None
        for index, stage in enumerate(stages):
            stage_request = self._request_for(run, stage, edge, upstream, upstream_text)
            pin = host if stage.stage_id in self._pod_local else None
            if index == len(stages) - 1:
                async for output in self._run_stage(
                    stage, stage_request, request.sticky_key, run.revision, pin
                ):
                    yield run.answer(output)
                break
            edge = self.graph.edge(stage.stage_id, stages[index + 1].stage_id)
            # The stage hands off only where the route goes on from it by hand-off.
            stage_request.hand_off = edge.kind != "text"
            # The companions go in the same message, to the same replica: their hand-offs
            # come back among the request's, under the names the next stage reads.
            stage_request.companions = stage_requests.companions(
                self.pipeline, request, stage, stage_request.prompt or ""
            )
            if edge.kind == "stream":
                consumer = stages[index + 1]
                async for output in self._stream(run, stage, stage_request, consumer, pin):
                    yield output
                break
            result = _StageResult()
            live = route.live_text and run.is_text(stage)
            async for output in self._stage_outputs(stage, stage_request, run, pin, result):
                if live and output.text:
                    # The answer's text, as it is written; its finish closes the answer.
                    yield StageServerOutput(request_id=output.request_id, text=output.text)
            upstream, upstream_text, host = result.final, result.text, result.host
            if run.is_text(stage):
                run.text, run.text_final = upstream_text, upstream
        if route.live_text:
            yield run.closing()

    def _request_for(
        self,
        run: _RouteRun,
        stage: StageConfig,
        edge: GraphEdge | None,
        upstream: StageServerOutput | None,
        upstream_text: str,
    ) -> StageServerRequest:
        route = run.route
        # Only a streaming caller reads a stage's text in steps, and only the answer's.
        answers_text = (
            route.text_stage == stage.stage_id
            if route.live_text
            else (stage.stage_id == route.stages[-1])
        )
        return stage_requests.build_stage_request(
            self.pipeline,
            run.request,
            run.attempt,
            stage,
            edge,
            upstream,
            upstream_text,
            caller_params=self.graph.caller_params.get(stage.stage_id, ()),
            reads_media=stage.stage_id in self.graph.reads_media,
            streams=run.request.stream and answers_text,
        )

    async def _stream(
        self,
        run: _RouteRun,
        producer: StageConfig,
        producer_request: StageServerRequest,
        consumer: StageConfig,
        pin: str | None,
    ) -> AsyncIterator[StageServerOutput]:
        """The caller's outputs of a stream edge that ends the route: the consumer's answer
        to each chunk the producer hands off, in order, each sent as its chunk comes, all to
        the replica the first went to (the stream's consumer, which keeps its left
        context), and passed on as soon as it is done while the producer goes on."""
        sticky, revision = run.request.sticky_key, run.revision
        edge = self.graph.edge(producer.stage_id, consumer.stage_id)
        consumer_request = self._request_for(run, consumer, edge, None, "")
        chunks: collections.deque[asyncio.Future[StageServerOutput]] = collections.deque()
        arrived = asyncio.Event()
        placed: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def produce() -> None:
            where: list[tuple[str, int]] = []
            sent = 0
            async for output in self._run_stage(
                producer, producer_request, sticky, revision, pin, where=where
            ):
                if not output.hand_offs:
                    continue
                if not sent:
                    # Released if the request ends before the consumer fetched them all.
                    run.handed.append(
                        _HandOff(producer.stage_id, where[-1][1], producer_request.request_id)
                    )
                chunk = msgspec.structs.replace(
                    consumer_request,
                    request_id=f"{producer_request.request_id}-chunk-{sent}",
                    inputs=dict(output.hand_offs),
                )
                first, sent = not sent, sent + 1
                local = consumer.stage_id in self._pod_local
                decoding = self._final_output(
                    consumer,
                    chunk,
                    run,
                    where[-1][0] if local else None,
                    placed=placed if first else None,
                    follow=None if first else placed,
                )
                chunks.append(asyncio.ensure_future(decoding))
                arrived.set()

        producing = asyncio.ensure_future(produce())
        try:
            while chunks or not producing.done():
                if producing.done() and producing.exception() is not None:
                    break
                # The next chunk's answer, or (while the producer runs) its next chunk or
                # its end, whichever comes first.
                watched: set[asyncio.Future[Any]] = set()
                if not producing.done():
                    watched.add(producing)
                if chunks:
                    watched.add(chunks[0])
                else:
                    arrived.clear()
                    watched.add(asyncio.ensure_future(arrived.wait()))
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for waiting in watched - {producing, *chunks}:
                    waiting.cancel()
                if chunks and chunks[0].done():
                    yield run.answer(chunks.popleft().result())
            producing.result()  # the producer's failure, if it failed
        finally:
            producing.cancel()
            for pending in chunks:
                pending.cancel()
            await asyncio.gather(producing, *chunks, return_exceptions=True)

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

    async def _stage_outputs(
        self,
        stage: StageConfig,
        stage_request: StageServerRequest,
        run: _RouteRun,
        host: str | None,
        result: _StageResult,
        placed: asyncio.Future[str] | None = None,
        follow: asyncio.Future[str] | None = None,
    ) -> AsyncIterator[StageServerOutput]:
        """The outputs of a stage that feeds another; ``result`` gets its final output, all
        of its text and the host of the replica that made it, and ``run`` a hand-off it
        names. ``placed`` learns that host as soon as the request is placed; ``follow``
        (another request's ``placed``) says where this one must go."""
        if follow is not None:
            host = await follow
        text_parts: list[str] = []
        where: list[tuple[str, int]] = []
        async for output in self._run_stage(
            stage, stage_request, run.request.sticky_key, run.revision, host, placed, where
        ):
            text_parts.append(output.text)
            if output.finished:
                result.final = output
                if output.hand_offs:
                    # Recorded at once: a cancel before this loop ends must not lose it.
                    run.handed.append(
                        _HandOff(stage.stage_id, where[-1][1], stage_request.request_id)
                    )
            yield output
        assert result.final is not None
        result.text, result.host = "".join(text_parts), where[-1][0]

    async def _final_output(
        self,
        stage: StageConfig,
        stage_request: StageServerRequest,
        run: _RouteRun,
        host: str | None,
        placed: asyncio.Future[str] | None = None,
        follow: asyncio.Future[str] | None = None,
    ) -> StageServerOutput:
        """The final output of ``stage_request`` (see _stage_outputs)."""
        result = _StageResult()
        async for _ in self._stage_outputs(stage, stage_request, run, host, result, placed, follow):
            pass
        assert result.final is not None
        return result.final

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
