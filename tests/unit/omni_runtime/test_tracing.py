"""omni_runtime.tracing: off (and SDK-free) unless OTEL_* asks, the W3C context on the wire.

Whether a provider is installed is process-wide state, so what touches it runs in a child
interpreter with an environment of the test's choosing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from omni_runtime import tracing
from omni_runtime.engine.stage.stage_core_types import (
    StageCoreRequest,
    StageServerRequest,
    TraceContext,
)
from omni_runtime.wire import WireDecoder, WireEncoder

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# Runs in the child: sets tracing up as a router process would, then reports.
_PROBE = """
import json, os, sys
import omni_runtime.entrypoints.router_process  # the router app and everything it imports
from opentelemetry import trace
from omni_runtime import tracing

on = tracing.configure(tracing.ROUTER_SERVICE_NAME)
provider = trace.get_tracer_provider()
resource = getattr(provider, "resource", None)
with tracing.span("probe") as span:
    recording = span.is_recording()
print(json.dumps({
    "configured": on,
    "enabled": tracing.enabled(),
    "provider": type(provider).__module__ + "." + type(provider).__name__,
    "sdk_imported": any(name.startswith("opentelemetry.sdk") for name in sys.modules),
    "exporter_imported": "opentelemetry.exporter.otlp.proto.http" in sys.modules,
    "service": resource.attributes.get("service.name") if resource is not None else None,
    "recording": recording,
}), flush=True)
# Not the provider's flush at exit: these endpoints lead nowhere.
os._exit(0)
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize(
    "env",
    [
        {},
        # Disabled wins over an endpoint, and so does an exporter of none.
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        # A service name alone asks for no export.
        {"OTEL_SERVICE_NAME": "mine"},
    ],
    ids=["no-otel-variables", "sdk-disabled", "exporter-none", "service-name-only"],
)
def test_without_an_export_asked_for_no_sdk_provider_is_installed(env: dict[str, str]) -> None:
    report = _probe(env)
    assert report["configured"] is False
    assert report["enabled"] is False
    # The API's own proxy: spans are the no-op span, and the SDK is not even imported.
    assert report["provider"] == "opentelemetry.trace.ProxyTracerProvider"
    assert report["sdk_imported"] is False
    assert report["exporter_imported"] is False
    assert report["recording"] is False


@pytest.mark.parametrize(
    ("env", "service"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "omni-router"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"}, "omni-router"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "mine"},
            "mine",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                "OTEL_RESOURCE_ATTRIBUTES": "service.name=theirs,team=a",
            },
            "theirs",
        ),
    ],
    ids=["endpoint", "traces-endpoint", "service-name", "resource-attributes"],
)
def test_an_otlp_endpoint_installs_the_sdk_under_the_process_service_name(
    env: dict[str, str], service: str
) -> None:
    report = _probe(env)
    assert report["configured"] is True
    assert report["provider"] == "opentelemetry.sdk.trace.TracerProvider"
    assert report["exporter_imported"] is True
    assert report["service"] == service
    assert report["recording"] is True


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, []),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ["otlp"]),
    ],
)
def test_export_requested_reads_the_standard_variables(
    env: dict[str, str], exporters: list[str]
) -> None:
    assert tracing.export_requested(env) == exporters


def test_serve_gives_each_stage_process_a_service_name_of_its_own() -> None:
    # No name given: the stage's default (omni-stage-<name>) applies, nothing to add.
    assert tracing.child_service_environment({}, "dit") == {}
    assert tracing.child_service_environment({"OTEL_SERVICE_NAME": "shop"}, "dit") == {
        "OTEL_SERVICE_NAME": "shop-stage-dit"
    }
    given = {"OTEL_RESOURCE_ATTRIBUTES": "team=a,service.name=shop"}
    assert tracing.child_service_environment(given, "thinker") == {
        "OTEL_SERVICE_NAME": "shop-stage-thinker"
    }
    assert tracing.stage_service_name(["thinker"]) == "omni-stage-thinker"
    assert tracing.stage_service_name(["thinker", "dit"]) == "omni-stage-thinker+dit"


def test_the_router_span_context_reaches_the_stage_in_the_request() -> None:
    request = StageServerRequest(
        request_id="r", prompt="p", trace_context=TraceContext(TRACEPARENT, "vendor=x")
    )
    decoded = WireDecoder(StageServerRequest).decode(
        [bytes(f) for f in WireEncoder().encode(request)]
    )
    assert decoded.trace_context == TraceContext(TRACEPARENT, "vendor=x")
    from opentelemetry import trace

    parent = trace.get_current_span(tracing.parent_context(TRACEPARENT, "vendor=x"))
    context = parent.get_span_context()
    assert context.is_remote
    assert f"{context.trace_id:032x}" == TRACEPARENT.split("-")[1]
    assert f"{context.span_id:016x}" == TRACEPARENT.split("-")[2]
    assert context.trace_state.to_header() == "vendor=x"
    # The same span, sent on: the header it came in as.
    assert tracing.trace_headers(parent) == (TRACEPARENT, "vendor=x")


def test_a_malformed_traceparent_starts_a_trace_of_its_own() -> None:
    from opentelemetry import trace

    parent = trace.get_current_span(tracing.parent_context("00-nonsense"))
    assert not parent.get_span_context().is_valid


def _previous_request_type() -> type[msgspec.Struct]:
    """StageServerRequest as a peer of the revision before tracing has it: the fields
    before ``trace_context`` (every later field was added after it), in the same order."""
    every = msgspec.structs.fields(StageServerRequest)
    before = every[: [f.name for f in every].index("trace_context")]
    fields = [
        (f.name, f.type, f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
        if f.required is False
        else (f.name, f.type)
        for f in before
    ]
    return msgspec.defstruct(
        "StageServerRequest",
        fields,
        bases=(StageCoreRequest,),
        array_like=True,
        omit_defaults=True,
        gc=False,
    )


def test_frames_without_the_trace_context_still_decode_and_old_peers_ignore_it() -> None:
    previous = _previous_request_type()
    old = WireEncoder().encode(previous(request_id="r", prompt="p", stream=False))
    decoded = WireDecoder(StageServerRequest).decode(old)
    assert (decoded.prompt, decoded.stream, decoded.trace_context) == ("p", False, None)
    # A traced frame, read by a peer that does not know the field.
    traced = StageServerRequest(
        request_id="r", prompt="p", stream=False, trace_context=TraceContext(TRACEPARENT)
    )
    read = WireDecoder(previous).decode(WireEncoder().encode(traced))
    assert (read.request_id, read.prompt, read.stream) == ("r", "p", False)


def test_spans_are_the_no_op_span_while_tracing_is_off() -> None:
    if tracing.enabled():
        pytest.skip("this process traces")
    assert tracing.span("x") is tracing.NO_SPAN
    with tracing.span("x") as span:
        assert not span.is_recording()
    assert tracing.trace_headers(span) is None
