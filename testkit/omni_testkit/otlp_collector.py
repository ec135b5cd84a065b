"""A tiny OTLP/HTTP trace collector on loopback, for tests and benchmarks of tracing.

It answers ``POST /v1/traces`` as a collector does (an ``ExportTraceServiceRequest`` in
protobuf, gzip or not; an empty ``ExportTraceServiceResponse`` back) and keeps every span
it receives, flattened with its service's name. Processes export to it with the standard
variables: ``OTEL_EXPORTER_OTLP_ENDPOINT=<collector.endpoint>``.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

_KINDS = {
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}


@dataclass(frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str
    start_ns: int
    end_ns: int
    failed: bool
    trace_state: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)


class OTLPCollector:
    """Serves on an ephemeral loopback port from ``with`` to its end."""

    def __init__(self, keep: bool = True) -> None:
        # keep=False: count the spans, hold none (a benchmark's sink).
        self.keep = keep
        self.count = 0
        self.requests = 0
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-collector", daemon=True
        )

    @property
    def endpoint(self) -> str:
        """The base URL, for OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def spans(self, where: Callable[[CollectedSpan], bool] | None = None) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self._spans if where is None or where(s)]

    def __enter__(self) -> OTLPCollector:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _received(self, request: ExportTraceServiceRequest) -> None:
        spans: list[CollectedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        CollectedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=_KINDS.get(span.kind, "unspecified"),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            failed=span.status.code == Status.STATUS_CODE_ERROR,
                            trace_state=span.trace_state,
                            attributes=_attributes(span.attributes),
                        )
                    )
        with self._lock:
            self.requests += 1
            self.count += len(spans)
            if self.keep:
                self._spans.extend(spans)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector._received(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # not test output

        return Handler


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)
