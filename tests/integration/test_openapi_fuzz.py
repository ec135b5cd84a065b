"""The router's OpenAPI document, fuzzed: schemathesis (`schemathesis run`, every check)
against a router serving the tiny chat LLM from a real stage process.

Besides schemathesis' own checks (no 5xx, every status and content type documented,
responses valid by their schemas, valid requests accepted and invalid ones refused,
methods a path does not take answered 405), openapi_fuzz_hooks.py checks that every error
is OpenAI-shaped. Afterwards no request may be left in flight, in the router or the stage.

The router runs with limits far below the defaults, which the document states: so a valid
request generated at a limit (the longest prompt, the most tokens) stays quick on a CPU and
fits the tiny model's 512-token context. The pipeline answers with text, so the document
lists no image paths (tests/unit/omni_runtime/router/test_router_openapi.py checks an image
pipeline's).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import RunningRouter, pipeline_from, running_router, start_stage_processes, wait_until

from omni_runtime.config import dump_pipeline
from omni_runtime.router.protocol import RouterLimits
from omni_runtime.tiny_models import LLM_SUBDIR
from omni_runtime.tiny_models._common import VOCAB_SIZE

pytestmark = pytest.mark.integration

HOOKS = Path(__file__).with_name("openapi_fuzz_hooks.py")
MODEL = "tiny-chat"
# 64 characters are at most 256 byte-level tokens; with MAX_MESSAGES messages' template
# tokens, a prompt stays well inside the 512-token context (a generated token needs one).
LIMITS = RouterLimits(max_prompt_chars=64, max_tokens=16, max_n=2, max_steps=2)
MAX_MESSAGES = 16
# Per operation and phase: about 500 requests, which take 20-40 s on two cores (the
# stage's start, about 30 s more); RUN_TIMEOUT bounds a run that would hang.
MAX_EXAMPLES = 200
RUN_TIMEOUT = 180
# A fixed seed: the same cases every run, so that a failure is the router's and can be
# replayed. Another seed explores further (schemathesis run --seed, by hand).
SEED = 20261202


@pytest.fixture(scope="module")
def router(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningRouter]:
    workdir = tmp_path_factory.mktemp("openapi-fuzz")
    pipeline = pipeline_from(
        {
            "model": str(tiny_models / LLM_SUBDIR),
            "stages": [
                {
                    "stageId": 0,
                    "name": "chat",
                    "type": "llm",
                    "dtype": "float32",
                    "enforceEager": True,
                    "maxModelLen": 512,
                }
            ],
            "router": {"servedModelName": MODEL},
        }
    )
    config = workdir / "pipeline.json"
    config.write_text(json.dumps(dump_pipeline(pipeline)))
    (stage,) = start_stage_processes(config, [0], workdir)
    try:
        with running_router(pipeline, {0: [stage.address]}, limits=LIMITS) as running:
            yield running
    finally:
        stage.stop()
    assert stage.proc.returncode == 0, stage.log.read_text()[-2000:]


def test_schemathesis_finds_nothing(
    router: RunningRouter,
    tmp_path: Path,
    record_property: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    har = tmp_path / "run.har"
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{router.url}/openapi.json",
        "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", str(SEED),
        "--workers", "1",
        "--generation-database", "none",
        "--request-timeout", "60",
        "--report", "har", "--report-har-path", str(har),
        "--no-color",
    ]  # fmt: skip
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": str(HOOKS),
        "FUZZ_MAX_PROMPT_CHARS": str(LIMITS.max_prompt_chars),
        "FUZZ_MAX_MESSAGES": str(MAX_MESSAGES),
        "FUZZ_VOCAB_SIZE": str(VOCAB_SIZE),
        "FUZZ_MAX_TOKENS": str(LIMITS.max_tokens),
    }
    start = time.monotonic()
    run = subprocess.run(
        command,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    elapsed = time.monotonic() - start
    document = httpx.get(f"{router.url}/openapi.json", timeout=10).json()
    counts, streams = _counts(har, document)
    summary = (
        f"schemathesis: {sum(counts['total'].values())} requests in {elapsed:.0f} s "
        f"({streams} streamed); "
        + "; ".join(
            f"{operation}: {dict(sorted(statuses.items()))}"
            for operation, statuses in sorted(counts.items())
        )
    )
    # On the terminal whether or not output is captured, and in the JUnit report.
    with capsys.disabled():
        print(f"\n{summary}")
    record_property("schemathesis", summary)
    assert run.returncode == 0, f"{summary}\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    # Each operation was called, and chat completions were both answered and refused.
    for operation in ("POST /v1/chat/completions", "GET /v1/models", "GET /health"):
        assert counts[operation], f"{operation} was never called: {summary}"
    chat = counts["POST /v1/chat/completions"]
    assert chat[200] > 0, summary
    assert chat[400] > 0, summary
    _wait_for_nothing_in_flight(router)
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


def _counts(har: Path, document: dict[str, Any]) -> tuple[dict[str, collections.Counter[int]], int]:
    """Responses by operation ("METHOD /path"; "other methods" for those a path does not
    take, and "total") and status, from the run's HAR; and how many were event streams."""
    counts: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    streams = 0
    for entry in json.loads(har.read_text())["log"]["entries"]:
        method = entry["request"]["method"]
        path = httpx.URL(entry["request"]["url"]).path
        documented = method.lower() in document["paths"].get(path, {})
        operation = f"{method} {path}" if documented else "other methods"
        status = entry["response"]["status"]
        counts[operation][status] += 1
        counts["total"][status] += 1
        headers = {h["name"].lower(): h["value"] for h in entry["response"]["headers"]}
        streams += headers.get("content-type", "").startswith("text/event-stream")
    return counts, streams


def _wait_for_nothing_in_flight(router: RunningRouter) -> None:
    """Every request the run made has ended in the router and in the stage: the gauges
    /metrics shows come back to 0 (a request ends a moment after its last byte)."""

    def in_flight() -> dict[str, float]:
        text = httpx.get(f"{router.url}/metrics", timeout=10).text
        gauges = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(("omni_router_in_flight", "omni_stage_in_flight")):
                gauges[name] = float(value)
        assert "omni_router_in_flight" in gauges, text
        return gauges

    def settled() -> bool:
        return not any(in_flight().values())

    try:
        wait_until(settled, 30, "no request in flight", interval=0.2)
    except AssertionError:
        raise AssertionError(f"requests left in flight: {in_flight()}") from None
