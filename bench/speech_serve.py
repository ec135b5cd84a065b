"""A spoken answer served (the tiny Qwen3-Omni behind `omni-runtime serve`: thinker, talker
and code2wav as three stages, streamed chat completions with modalities ["text", "audio"])
against transformers' own Qwen3OmniMoeForConditionalGeneration.generate(...,
return_audio=True) in-process on the same weights (float32), prompt, thinker and talker
max tokens, greedy, in one run.

Measured for each: the time to the first audio (for the reference, which gives nothing
before it ends, its whole time), the time to the whole answer (medians and p90s), the
audio's length (samples / 24000) and the real-time factor (whole time / audio seconds, of
the medians). Served twice, one server each: with the pipeline's asyncChunk off ("whole":
code2wav decodes every frame once the talker has finished, so the first audio comes with
the last) and on ("chunked": the talker hands code2wav its codes every 25 frames and the
audio reaches the caller chunk by chunk). Each at every --concurrency: that many client
threads, each sending --requests requests back to back, after a warm-up of one request
each, all at once, not counted. The served time is the client's: HTTP, SSE, base64 pcm16
and all.

The chunked hand-off's added latency per chunk is read from the router's /metrics over
each measured run: each chunk is a code2wav stage request of its own, so the router's
omni_stage_request_duration_seconds{stage="code2wav"} (from its sending the request to
the stage's last output) less omni_stage_execution_seconds (the code2wav engine's own
time, fetching the codes from the connector included) is what the round trip through the
router and the stage server adds to a chunk, and the wait behind the requests ahead of it:
code2wav decodes one batch at a time (chunks of one length together), so where a chunk
comes before the last is decoded
(the talker's time for 25 frames, from its own execute time per answer, is printed beside
it), or under concurrency, most of the difference is that queue. The same figures for the
whole mode are per answer (one code2wav request each): at concurrency 1 nothing is ahead,
so there it is the round trip alone.

    .venv/bin/python bench/speech_serve.py [--requests 5] [--concurrency 1 8]
        [--thinker-tokens 16] [--talker-tokens 200] [--modes whole chunked]
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from _load import (
    ManagedProcess,
    exit_on_sigterm,
    free_port,
    markdown_table,
    percentile,
    ratio_cell,
    running,
    wait_http_ok,
)
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.families import FAMILIES
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR, ensure_tiny_models
from omni_runtime.tiny_models.qwen3_omni import SAMPLES_PER_CODE

REPO = Path(__file__).resolve().parents[1]
PROMPT = "draw a red cat under the moon"
MODEL = "tiny-qwen3-omni"
SPEECH = FAMILIES["qwen3-omni"].speech
assert SPEECH is not None
SAMPLE_RATE = SPEECH.sample_rate
CHUNK_FRAMES = SPEECH.chunk_frames
# The project's target for the chunked mode at concurrency 1.
FIRST_AUDIO_TARGET = 0.3


@dataclass
class Answer:
    """One streamed request, as the client saw it."""

    first_audio_s: float
    whole_s: float
    audio_s: float


@dataclass
class StageTimes:
    """A stage's requests over a run (histogram deltas from the router's /metrics)."""

    requests: float
    router_s: float  # omni_stage_request_duration_seconds' sum
    engine_s: float  # omni_stage_execution_seconds' sum
    engine_requests: float


@dataclass
class Run:
    """One mode at one concurrency."""

    label: str
    concurrency: int
    answers: list[Answer] = field(default_factory=list)
    stages: dict[str, StageTimes] = field(default_factory=dict)


# -- the reference ------------------------------------------------------------------------


def reference(model: Path, args: argparse.Namespace) -> tuple[list[float], float]:
    """Seconds per whole answer (after a warm-up), and the audio's seconds."""
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor

    processor = Qwen3OmniMoeProcessor.from_pretrained(model, local_files_only=True)
    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        model, dtype=torch.float32, local_files_only=True
    ).eval()
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=text, return_tensors="pt")
    times: list[float] = []
    samples = 0
    for run in range(args.requests + 1):  # the first warms up
        start = time.perf_counter()
        with torch.inference_mode():
            _, waveform = loaded.generate(
                **inputs,
                return_audio=True,
                speaker="Ethan",
                thinker_max_new_tokens=args.thinker_tokens,
                thinker_do_sample=False,
                thinker_eos_token_id=loaded.config.im_end_token_id,
                talker_max_new_tokens=args.talker_tokens,
                talker_do_sample=False,
                talker_repetition_penalty=1.05,
            )
        if run:
            times.append(time.perf_counter() - start)
        samples = waveform.numel()
    return times, samples / SAMPLE_RATE


# -- served -------------------------------------------------------------------------------


def ask(http: httpx.Client, args: argparse.Namespace) -> Answer:
    """One streamed spoken answer: when its first audio came, when it ended, how long."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": args.thinker_tokens,
        "temperature": 0.0,
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": "pcm16"},
        "stream": True,
    }
    first_audio: float | None = None
    audio_bytes = 0
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices", ()):
                data = (choice["delta"].get("audio") or {}).get("data")
                if data:
                    if first_audio is None:
                        first_audio = time.perf_counter() - start
                    audio_bytes += len(base64.b64decode(data))
    whole = time.perf_counter() - start
    if first_audio is None:
        raise RuntimeError("a spoken answer came without audio")
    return Answer(first_audio, whole, audio_bytes / 2 / SAMPLE_RATE)


HISTOGRAMS = ("omni_stage_request_duration_seconds", "omni_stage_execution_seconds")
TIMED_STAGES = ("talker", "code2wav")


def histogram_totals(http: httpx.Client) -> dict[tuple[str, str], float]:
    """The router's stage histograms now: each sum and count, by sample name and stage."""
    totals = {
        (f"{name}{suffix}", stage): 0.0
        for name in HISTOGRAMS
        for suffix in ("_sum", "_count")
        for stage in TIMED_STAGES
    }
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("stage", ""))
            if key in totals:
                totals[key] = sample.value
    return totals


def stage_times(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, StageTimes]:
    def delta(name: str, stage: str) -> float:
        return after[(name, stage)] - before[(name, stage)]

    return {
        stage: StageTimes(
            requests=delta("omni_stage_request_duration_seconds_count", stage),
            router_s=delta("omni_stage_request_duration_seconds_sum", stage),
            engine_s=delta("omni_stage_execution_seconds_sum", stage),
            engine_requests=delta("omni_stage_execution_seconds_count", stage),
        )
        for stage in TIMED_STAGES
    }


def served(model: Path, args: argparse.Namespace, mode: str, workdir: Path) -> list[Run]:
    data = yaml.safe_load((REPO / "examples" / "tiny-qwen3-omni.yaml").read_text())
    data["model"] = str(model)
    data["asyncChunk"] = mode == "chunked"
    talker = next(stage for stage in data["stages"] if stage["name"] == "talker")
    talker["defaultSamplingParams"]["max_tokens"] = args.talker_tokens
    config = workdir / f"pipeline-{mode}.yaml"
    config.write_text(yaml.safe_dump(data))
    port = free_port()
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", "-f", str(config),
        "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    serve = ManagedProcess(f"serve ({mode})", command, workdir / f"serve-{mode}.log", env)
    runs: list[Run] = []
    with running([serve]):
        ready = wait_http_ok(f"http://127.0.0.1:{port}/health", 600, [serve])
        print(f"{mode}: serve ready in {ready:.0f} s", file=sys.stderr)
        limits = httpx.Limits(max_connections=max(args.concurrency) + 2)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as http:
            for concurrency in args.concurrency:
                count = args.requests if concurrency == 1 else args.concurrent_requests
                run = Run(mode, concurrency)

                def client(_: int, count: int = count) -> list[Answer]:
                    return [ask(http, args) for _ in range(count)]

                started = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as clients:
                    # One request per client at once first, not counted: what a first
                    # batch of this size costs once (allocations, first-time paths).
                    list(clients.map(lambda _: ask(http, args), range(concurrency)))
                    before = histogram_totals(http)
                    for answers in clients.map(client, range(concurrency)):
                        run.answers.extend(answers)
                run.stages = stage_times(before, histogram_totals(http))
                print(
                    f"{mode}: concurrency {concurrency}, {concurrency * (count + 1)} requests "
                    f"in {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                )
                runs.append(run)
    return runs


# -- the tables ---------------------------------------------------------------------------


def seconds(value: float) -> str:
    return f"{value:.2f}"


def answer_row(
    label: str,
    concurrency: int,
    first: list[float],
    whole: list[float],
    audio_s: float,
    reference_s: float,
    target: bool,
) -> list[object]:
    first_median, whole_median = statistics.median(first), statistics.median(whole)
    ratio = first_median / whole_median
    return [
        label,
        concurrency,
        len(whole),
        seconds(first_median),
        seconds(percentile(first, 90)),
        seconds(whole_median),
        seconds(percentile(whole, 90)),
        f"{audio_s:.2f}",
        f"{whole_median / audio_s:.3f}",
        ratio_cell(ratio, FIRST_AUDIO_TARGET, higher_is_better=False) if target else f"{ratio:.2f}",
        f"{first_median / reference_s:.2f}x",
        f"{whole_median / reference_s:.2f}x",
    ]


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5, help="per client (and reference)")
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=None,
        help="per client where concurrency > 1 (default: --requests)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--thinker-tokens", type=int, default=16)
    parser.add_argument("--talker-tokens", type=int, default=200, help="codec frames")
    parser.add_argument(
        "--modes", nargs="+", choices=["whole", "chunked"], default=["whole", "chunked"]
    )
    args = parser.parse_args()
    if args.concurrent_requests is None:
        args.concurrent_requests = args.requests
    model = ensure_tiny_models(DEFAULT_MODELS_DIR) / QWEN3_OMNI_SUBDIR
    runs: list[Run] = []
    # The servers first, each alone; then the reference, with the CPUs to itself.
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            runs += served(model, args, mode, Path(tmp))
    reference_times, reference_audio_s = reference(model, args)
    reference_s = statistics.median(reference_times)

    print(
        f"\ntiny Qwen3-Omni, float32, greedy, thinker {args.thinker_tokens} tokens, talker "
        f"{args.talker_tokens} frames, {CHUNK_FRAMES} frames a chunk when chunked; "
        f"medians (p90) of --requests {args.requests} per client "
        f"({args.concurrent_requests} per client where concurrency > 1):\n"
    )
    headers = [
        "",
        "concurrency",
        "answers",
        "first audio s",
        "p90",
        "whole s",
        "p90",
        "audio s",
        "RTF",
        "first audio / whole",
        "first audio / ref. whole",
        "whole / ref. whole",
    ]
    rows = [
        answer_row(
            "transformers generate(return_audio=True), in-process (reference)",
            1,
            reference_times,  # it gives nothing before the whole answer
            reference_times,
            reference_audio_s,
            reference_s,
            target=False,
        )
    ]
    for run in runs:
        rows.append(
            answer_row(
                f"served, {run.label} (asyncChunk: {str(run.label == 'chunked').lower()})",
                run.concurrency,
                [a.first_audio_s for a in run.answers],
                [a.whole_s for a in run.answers],
                statistics.median(a.audio_s for a in run.answers),
                reference_s,
                target=run.label == "chunked" and run.concurrency == 1,
            )
        )
    print(markdown_table(headers, rows))

    print(
        "\ncode2wav's stage requests, from the router's /metrics over each measured run: the "
        "router's time for one (sent to last output) against the engine's own (codes fetched "
        "and decoded), and what the router adds (its round trip to the stage and the wait "
        "behind the requests ahead: code2wav runs one batch at a time, chunks of one length "
        "together, up to its maxNumSeqs). Chunked, one request is "
        "one chunk; the talker's time for that many frames (its execute time per answer over "
        "its frames, samples / 1920) says how often the next chunk comes:\n"
    )
    hand_off_rows = []
    for run in runs:
        code2wav, talker = run.stages["code2wav"], run.stages["talker"]
        frames = statistics.median(a.audio_s for a in run.answers) * SAMPLE_RATE / SAMPLES_PER_CODE
        talker_ms = 1000 * mean_s(talker.engine_s, talker.engine_requests) / frames * CHUNK_FRAMES
        router_ms = 1000 * mean_s(code2wav.router_s, code2wav.requests)
        engine_ms = 1000 * mean_s(code2wav.engine_s, code2wav.engine_requests)
        hand_off_rows.append(
            [
                run.label,
                run.concurrency,
                f"{code2wav.requests / len(run.answers):.1f}",
                f"{router_ms:.1f}",
                f"{engine_ms:.1f}",
                f"{router_ms - engine_ms:.1f}",
                f"{talker_ms:.1f}",
            ]
        )
    print(
        markdown_table(
            [
                "mode",
                "concurrency",
                "code2wav requests per answer",
                "router ms per request",
                "engine ms per request",
                "added ms per request",
                f"talker ms per {CHUNK_FRAMES} frames",
            ],
            hand_off_rows,
        )
    )


def mean_s(total_s: float, count: float) -> float:
    return total_s / count if count else math.nan


if __name__ == "__main__":
    main()
