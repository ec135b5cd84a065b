"""Traces across stages, end to end: `omni-runtime serve` on the tiny two-stage pipeline
exports over OTLP/HTTP (the real exporter, in every process) to a collector this test
runs on loopback, and one request is one trace with every span where it belongs."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import serving, wait_until

from omni_testkit.otlp_collector import CollectedSpan, OTLPCollector

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-text-to-image.yaml"
ROUTER = "omni-router"
THINKER = "omni-stage-thinker"
DIT = "omni-stage-dit"
# One request's spans, by (service, name): the router's request span, a client span per
# stage call, each stage's queue and execution, the hand-off's put and get.
EXPECTED = {
    (ROUTER, "router POST /v1/chat/completions"),
    (ROUTER, "stage thinker"),
    (ROUTER, "stage dit"),
    (THINKER, "stage thinker queue"),
    (THINKER, "stage thinker execute"),
    (THINKER, "connector put"),
    (DIT, "connector get"),
    (DIT, "stage dit queue"),
    (DIT, "stage dit execute"),
}
# Span times come from one host's clock, but a stage's execution start is derived (from
# the engine's own figures): a child may start or end this much outside its parent.
SLACK_NS = 5_000_000


@pytest.fixture(scope="module")
def traced(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, OTLPCollector]]:
    workdir = tmp_path_factory.mktemp("traced")
    with OTLPCollector() as collector:
        env = {
            "OMNI_TINY_MODELS": str(tiny_models),
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            # Spans leave each process within 0.1 s rather than the default 5 s.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with serving(EXAMPLE, workdir, env=env) as url:
            yield url, collector


def _chat(url: str, headers: dict[str, str]) -> None:
    response = httpx.post(
        f"{url}/chat/completions",
        json={
            "model": "tiny-omni",
            "messages": [{"role": "user", "content": "a red cat"}],
            "modalities": ["image"],
            "height": 32,
            "width": 32,
            "num_inference_steps": 2,
        },
        headers=headers,
        timeout=120,
    )
    assert response.status_code == 200, response.text


def _trace(collector: OTLPCollector, trace_id: str) -> dict[tuple[str, str], CollectedSpan]:
    """The trace's spans by (service, name), once every expected one has arrived."""

    def complete() -> dict[tuple[str, str], CollectedSpan] | None:
        spans = collector.spans(lambda s: s.trace_id == trace_id)
        found = {(s.service, s.name): s for s in spans}
        return found if found.keys() >= EXPECTED else None

    try:
        found: dict[tuple[str, str], CollectedSpan] = wait_until(complete, 30, "the spans")
    except AssertionError:
        got = sorted((s.service, s.name) for s in collector.spans(lambda s: s.trace_id == trace_id))
        raise AssertionError(
            f"spans of trace {trace_id}: {got}; expected {sorted(EXPECTED)}"
        ) from None
    return found


def _within(child: CollectedSpan, parent: CollectedSpan) -> bool:
    return (
        parent.start_ns - SLACK_NS <= child.start_ns
        and child.end_ns <= parent.end_ns + SLACK_NS
        and child.start_ns <= child.end_ns
    )


def test_one_request_is_one_trace_from_the_callers_traceparent(
    traced: tuple[str, OTLPCollector],
) -> None:
    url, collector = traced
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    _chat(url, {"traceparent": f"00-{trace_id}-{caller_span}-01", "tracestate": "caller=1"})
    spans = _trace(collector, trace_id)
    assert len(collector.spans(lambda s: s.trace_id == trace_id)) == len(EXPECTED)

    request = spans[ROUTER, "router POST /v1/chat/completions"]
    assert request.parent_span_id == caller_span
    assert request.kind == "server"
    assert request.attributes["http.response.status_code"] == 200
    request_id = request.attributes["omni.request.id"]
    assert str(request_id).startswith("chatcmpl-")

    for stage_id, stage, service in ((0, "thinker", THINKER), (1, "dit", DIT)):
        call = spans[ROUTER, f"stage {stage}"]
        assert call.kind == "client"
        assert call.parent_span_id == request.span_id
        assert _within(call, request)
        queue = spans[service, f"stage {stage} queue"]
        execute = spans[service, f"stage {stage} execute"]
        for span in (call, queue, execute):
            assert span.attributes["omni.stage.name"] == stage
            assert span.attributes["omni.stage.id"] == stage_id
            assert span.attributes["omni.request.id"] == request_id
            assert not span.failed
            # The caller's tracestate travels with its traceparent, to the stages too.
            assert span.trace_state == "caller=1"
        # The stage's spans are children of the router's call, through the context the
        # request carried; the wait ends where the execution begins.
        for span in (queue, execute):
            assert span.parent_span_id == call.span_id
            assert _within(span, call)
        assert queue.end_ns == execute.start_ns
        assert execute.end_ns - execute.start_ns > 0

    put = spans[THINKER, "connector put"]
    get = spans[DIT, "connector get"]
    assert (put.kind, get.kind) == ("producer", "consumer")
    assert put.parent_span_id == spans[THINKER, "stage thinker execute"].span_id
    assert get.parent_span_id == spans[DIT, "stage dit execute"].span_id
    assert _within(put, spans[THINKER, "stage thinker execute"])
    # The consumer's core fetches its inputs as it begins executing the request.
    assert _within(get, spans[DIT, "stage dit execute"])
    assert get.start_ns == spans[DIT, "stage dit execute"].start_ns
    for span in (put, get):
        assert span.attributes["omni.connector.name"] == "shared_memory_connector"
        assert span.attributes["omni.request.id"] == request_id
    # The thinker's hidden states: what was put is what was fetched.
    assert put.attributes["omni.connector.bytes"] == get.attributes["omni.connector.bytes"] > 0


def test_a_request_without_traceparent_starts_its_own_trace(
    traced: tuple[str, OTLPCollector],
) -> None:
    url, collector = traced
    before = {s.trace_id for s in collector.spans()}
    _chat(url, {})

    def new_request_span() -> CollectedSpan | None:
        for span in collector.spans(lambda s: s.trace_id not in before and s.service == ROUTER):
            if span.name == "router POST /v1/chat/completions":
                return span
        return None

    root: CollectedSpan = wait_until(new_request_span, 30, "the request's span")
    assert root.parent_span_id == ""
    spans = _trace(collector, root.trace_id)
    assert spans[DIT, "stage dit execute"].parent_span_id == spans[ROUTER, "stage dit"].span_id
