"""Traces across stages: W3C trace context in, OpenTelemetry spans out over OTLP/HTTP.

One request is one trace: the router's server span (a child of the caller's
``traceparent``, if it sent one), a client span per stage call, and in each stage process
the request's queue wait, its execution and its connector hand-offs, parented through the
trace context that travels in ``StageServerRequest.trace_context``.

Nothing is set up unless the standard ``OTEL_*`` variables ask for it
(:func:`export_requested`): a process entrypoint calls :func:`configure` with its default
service name, which installs the SDK's provider with a batching OTLP/HTTP exporter (the
exporter reads its own ``OTEL_EXPORTER_OTLP_*`` settings, the provider its sampler's). Until
then :func:`enabled` is false, no SDK module is even imported, and every helper here
returns at its first test: the per-request cost of tracing off is a global read.

Spans are never made current inside the code paths that stream (async generators resumed
from other tasks would detach a context they did not attach): parents are passed
explicitly, and only :class:`TraceRequests`, a plain ASGI coroutine, attaches its span.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "BYTES",
    "CONNECTOR_NAME",
    "NO_SPAN",
    "REPLICA_ID",
    "REQUEST_ID",
    "ROUTER_SERVICE_NAME",
    "STAGE_ID",
    "STAGE_NAME",
    "SpanScope",
    "TraceRequests",
    "child_service_environment",
    "configure",
    "context_of",
    "enabled",
    "export_requested",
    "fail",
    "monotonic_to_ns",
    "parent_context",
    "set_current_attribute",
    "span",
    "stage_service_name",
    "start_span",
    "trace_headers",
]

logger = logging.getLogger(__name__)

ROUTER_SERVICE_NAME = "omni-router"
_STAGE_SERVICE_PREFIX = "omni-stage-"

# Span attributes (the OpenTelemetry convention: dotted, lowercase, namespaced).
REQUEST_ID = "omni.request.id"
STAGE_NAME = "omni.stage.name"
STAGE_ID = "omni.stage.id"
REPLICA_ID = "omni.replica.id"
CONNECTOR_NAME = "omni.connector.name"
BYTES = "omni.connector.bytes"

# Either names where to export; OTEL_TRACES_EXPORTER=otlp alone exports to the default
# endpoint (localhost:4318).
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_SUPPORTED_EXPORTERS = ("otlp", "console")

_enabled = False
# A proxy until a provider is installed, then the provider's: one object for every caller.
_tracer = trace.get_tracer("omni_runtime")
_propagator = TraceContextTextMapPropagator()

Attributes = Mapping[str, AttributeValue]


def enabled() -> bool:
    """Whether this process exports spans (``configure`` installed a provider)."""
    return _enabled


def export_requested(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the standard ``OTEL_*`` variables ask for ([] = tracing off):
    "otlp" when an OTLP endpoint is set (or ``OTEL_TRACES_EXPORTER`` says otlp), "console"
    when ``OTEL_TRACES_EXPORTER`` says so; none when ``OTEL_SDK_DISABLED`` is true or
    ``OTEL_TRACES_EXPORTER`` is none."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = [
        name.strip().lower()
        for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
        if name.strip()
    ]
    if not named:
        has_endpoint = any(environ.get(name, "").strip() for name in _ENDPOINT_VARIABLES)
        return ["otlp"] if has_endpoint else []
    if "none" in named:
        return []
    unknown = [name for name in named if name not in _SUPPORTED_EXPORTERS]
    if unknown:
        logger.warning(
            "OTEL_TRACES_EXPORTER: %s not supported here (supported: %s); ignored",
            ", ".join(unknown),
            ", ".join(_SUPPORTED_EXPORTERS),
        )
    return [name for name in _SUPPORTED_EXPORTERS if name in named]


def configure(default_service_name: str) -> bool:
    """Install the SDK's tracer provider if the ``OTEL_*`` variables ask for export;
    whether this process now traces. ``default_service_name`` names the process unless
    ``OTEL_SERVICE_NAME`` (or ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``) does.
    Once per process: a second call changes nothing."""
    global _enabled
    if _enabled:
        return True
    exporters = export_requested(os.environ)
    if not exporters:
        return False
    # The SDK and the exporter (requests, protobuf) load only here: a process that does
    # not trace never imports them.
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    given = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    resource = Resource.create({} if given else {SERVICE_NAME: default_service_name})
    # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
    provider = TracerProvider(resource=resource)
    for name in exporters:
        exporter: SpanExporter
        if name == "otlp":
            if _otlp_protocol() not in ("", "http/protobuf"):
                logger.warning(
                    "OTEL_EXPORTER_OTLP_PROTOCOL=%s: only http/protobuf is supported here; "
                    "exporting over it",
                    _otlp_protocol(),
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        # Off the request path: spans are queued and exported from the processor's thread
        # (OTEL_BSP_* tunes it); the provider flushes at exit.
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    logger.info(
        "tracing: exporting spans (%s) as service %r",
        ", ".join(exporters),
        resource.attributes.get(SERVICE_NAME),
    )
    return True


def _otlp_protocol() -> str:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = os.environ.get(name, "").strip().lower()
        if value:
            return value
    return ""


def stage_service_name(stage_names: Iterable[str]) -> str:
    """The default service name of a stage process serving ``stage_names``."""
    return _STAGE_SERVICE_PREFIX + "+".join(stage_names)


def child_service_environment(environ: Mapping[str, str], stage_name: str) -> dict[str, str]:
    """What a stage process started by this one (``serve``) adds to its environment to
    export under a service of its own: where the user named the service (for the whole
    ``serve``), ``<that name>-stage-<stage>``; otherwise nothing (the stage's default,
    ``omni-stage-<stage>``, applies)."""
    given = environ.get("OTEL_SERVICE_NAME", "").strip()
    if not given:
        for pair in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
            key, _, value = pair.partition("=")
            if key.strip() == "service.name" and value.strip():
                given = value.strip()
    # OTEL_SERVICE_NAME wins over the resource attribute, so setting it is enough.
    return {"OTEL_SERVICE_NAME": f"{given}-stage-{stage_name}"} if given else {}


# -- propagation ------------------------------------------------------------------------


def trace_headers(span: Span) -> tuple[str, str] | None:
    """``span``'s W3C (traceparent, tracestate), to send with a request it makes; None for
    a span that is not recorded (tracing off, or not sampled and nothing to pass on)."""
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    traceparent = carrier.get("traceparent")
    if traceparent is None:
        return None
    return traceparent, carrier.get("tracestate", "")


def parent_context(traceparent: str, tracestate: str = "") -> Context:
    """The context whose span a remote ``traceparent`` names (an empty one if malformed:
    a span made under it starts a trace of its own)."""
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _propagator.extract(carrier)


def context_of(span: Span) -> Context:
    """A context whose current span is ``span``: the parent for its children."""
    return trace.set_span_in_context(span)


def monotonic_to_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` reading of this host as a span timestamp (ns since the epoch)."""
    return time.time_ns() - round((time.monotonic() - monotonic) * 1e9)


# -- spans ------------------------------------------------------------------------------


class SpanScope:
    """A span from ``with`` to its end, never made current (see the module's note); what
    escapes the block marks it failed. Disabled tracing makes it the no-op span."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    @property
    def span(self) -> Span:
        return self._span

    def __enter__(self) -> Span:
        return self._span

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None and self._span.is_recording():
            if isinstance(error, GeneratorExit):
                # The consumer stopped reading: not a failure of this operation.
                pass
            elif not isinstance(error, Exception):
                # Cancelled (the caller went away) or interrupted: not a failure either.
                self._span.set_attribute("omni.cancelled", True)
            else:
                self._span.record_exception(error)
                self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end()


# What every span helper returns while tracing is off.
NO_SPAN = SpanScope(INVALID_SPAN)


def span(
    name: str,
    *,
    parent: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_ns: int | None = None,
) -> SpanScope:
    """A span named ``name`` under ``parent`` (None: the current span), for a ``with``."""
    if not _enabled:
        return NO_SPAN
    return SpanScope(
        start_span(name, parent=parent, kind=kind, attributes=attributes, start_ns=start_ns)
    )


def start_span(
    name: str,
    *,
    parent: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_ns: int | None = None,
) -> Span:
    """A started span the caller ends (the no-op span when tracing is off)."""
    if not _enabled:
        return INVALID_SPAN
    return _tracer.start_span(
        name, context=parent, kind=kind, attributes=attributes, start_time=start_ns
    )


def set_current_attribute(key: str, value: AttributeValue) -> None:
    """Set an attribute of the current span (the router's span of the request)."""
    if _enabled:
        trace.get_current_span().set_attribute(key, value)


def fail(span: Span, message: str) -> None:
    """Mark ``span`` failed, for a failure that is data rather than an exception."""
    if span.is_recording():
        span.set_status(Status(StatusCode.ERROR, message))


# -- the router's server span -----------------------------------------------------------

_TRACE_HEADERS = (b"traceparent", b"tracestate")


class TraceRequests:
    """ASGI middleware: a server span for each HTTP request under ``prefix``, named
    ``router <METHOD> <route>``, a child of the request's ``traceparent`` when it has one,
    and current while the app runs it (the orchestrator's stage spans are its children).

    Plain ASGI, as the router's other middleware, so that ``receive`` stays the server's
    own (the endpoints watch it for a client's disconnect)."""

    def __init__(self, app: ASGIApp, prefix: str = "/v1/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _enabled or scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in _TRACE_HEADERS
        }
        parent = _propagator.extract(carrier) if carrier else None
        span = _tracer.start_span(
            f"router {method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"]},
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        status = 500

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except Exception as e:
            span.record_exception(e)
            raise
        finally:
            otel_context.detach(token)
            # The route is known once the app has matched it; a path that matched none
            # (a 404) keeps the method alone, so that names stay few.
            route: Any = scope.get("route")
            route_path = getattr(route, "path", None)
            if isinstance(route_path, str):
                span.update_name(f"router {method} {route_path}")
                span.set_attribute("http.route", route_path)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
