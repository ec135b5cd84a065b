"""A video job served (the tiny Wan2.2 behind `omni-runtime serve`, OpenAI's client:
videos.create_and_poll, then download_content) against diffusers' own WanPipeline
in-process on the same weights, prompt, seed, steps, size and frames, in one run: a job's
latency one at a time, and jobs per minute with --concurrency clients at once (the
reference makes the same clips one after another: one pipeline call runs one clip; the
served DiT batches up to --concurrency clips, its maxNumSeqs).

The served figure is a job's whole life: the POST, the claim, the DiT stage process, the
MP4, the store, and the client's polling (every 50 ms); the reference is the pipeline call
alone. Their difference is what serving a clip as a job costs.

    .venv/bin/python bench/video_serve.py [--jobs 5] [--steps 8] [--frames 17] [--size 128x128]
        [--concurrency 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from _load import ManagedProcess, free_port, markdown_table, running, wait_http_ok
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import WAN_SUBDIR, ensure_tiny_models

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a red fox running through snow"


def reference_s(model: Path, args: argparse.Namespace, height: int, width: int) -> list[float]:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(model))
    pipe.set_progress_bar_config(disable=True)
    times = []
    for run in range(args.jobs + 1):  # the first warms up
        start = time.perf_counter()
        with torch.inference_mode():
            pipe(
                prompt=PROMPT,
                height=height,
                width=width,
                num_frames=args.frames,
                num_inference_steps=args.steps,
                generator=torch.Generator("cpu").manual_seed(7),
                output_type="np",
            )
        if run:
            times.append(time.perf_counter() - start)
    return times


def served_s(model: Path, args: argparse.Namespace, workdir: Path) -> tuple[list[float], float]:
    """Seconds per job one at a time, and the seconds ``args.concurrency`` clients took for
    ``args.concurrency * args.jobs`` jobs."""
    data = yaml.safe_load((REPO / "examples" / "tiny-wan.yaml").read_text())
    data["model"] = str(model)
    # Clips that come together run together: the DiT batches up to --concurrency of them
    # (maxNumSeqs), and one router runs as many jobs at once.
    data["stages"][0]["maxNumSeqs"] = args.concurrency
    data["router"]["videos"]["jobsPerRouter"] = args.concurrency
    config = workdir / "pipeline.yaml"
    config.write_text(yaml.safe_dump(data))
    port = free_port()
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve", "-f", str(config),
        "--port", str(port), "--state-dir", str(workdir / "jobs"),
    ]  # fmt: skip
    serve = ManagedProcess("serve", command, workdir / "serve.log")
    with running([serve]):
        wait_http_ok(f"http://127.0.0.1:{port}/health", 600, [serve])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

        def job() -> float:
            start = time.perf_counter()
            video = client.videos.create_and_poll(
                prompt=PROMPT,
                size=args.size,
                extra_body={
                    "num_frames": args.frames,
                    "num_inference_steps": args.steps,
                    "seed": 7,
                },
                poll_interval_ms=50,
            )
            assert video.status == "completed", video.error
            client.videos.download_content(video.id).read()
            return time.perf_counter() - start

        job()  # warms up
        times = [job() for _ in range(args.jobs)]
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as clients:
            list(clients.map(lambda _: job(), range(args.concurrency * args.jobs)))
        together = time.perf_counter() - start
        freed, step = delete_s(client, port, args)
    print(
        f"DELETE of a running job -> the DiT free: {freed * 1000:.0f} ms (one step: "
        f"{step * 1000:.0f} ms)\n"
    )
    return times, together


def delete_s(client: openai.OpenAI, port: int, args: argparse.Namespace) -> tuple[float, float]:
    """From DELETE of a job under way to the DiT stage holding no request (the router's
    omni_stage_in_flight), and the time of one of the job's steps (from its progress)."""
    steps = 200  # the router's most (RouterLimits.max_steps)
    video = client.videos.create(
        prompt=PROMPT,
        size=args.size,  # type: ignore[arg-type]
        extra_body={"num_frames": args.frames, "num_inference_steps": steps, "seed": 7},
    )

    def progress_at(least: int) -> tuple[float, int]:
        while (progress := client.videos.retrieve(video.id).progress) < least:
            time.sleep(0.01)
        return time.perf_counter(), progress

    t1, p1 = progress_at(5)
    t2, p2 = progress_at(p1 + 10)
    step = (t2 - t1) / ((p2 - p1) / 100 * steps)
    start = time.perf_counter()
    client.videos.delete(video.id)
    while dit_in_flight(port) > 0:
        time.sleep(0.002)
    return time.perf_counter() - start, step


def dit_in_flight(port: int) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "omni_stage_in_flight" and sample.labels.get("stage") == "dit":
                return sample.value
    raise AssertionError("no omni_stage_in_flight{stage=dit} in /metrics")


def main() -> None:
    # The client's videos.* warn of OpenAI's own hosted service shutting down; this is ours.
    warnings.filterwarnings("ignore", "The Sora API is scheduled", DeprecationWarning)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", default="128x128", help="WIDTHxHEIGHT")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    width, height = (int(side) for side in args.size.split("x"))
    model = ensure_tiny_models(DEFAULT_MODELS_DIR) / WAN_SUBDIR
    with tempfile.TemporaryDirectory() as tmp:
        served, together = served_s(model, args, Path(tmp))
    reference = reference_s(model, args, height, width)
    rows = [
        ["WanPipeline in-process (reference)", f"{statistics.median(reference):.2f}", "1.00x"],
        [
            "served job (create_and_poll + download_content)",
            f"{statistics.median(served):.2f}",
            f"{statistics.median(served) / statistics.median(reference):.2f}x",
        ],
    ]
    print(
        f"tiny Wan2.2, {args.size}, {args.frames} frames, {args.steps} steps, "
        f"median of {args.jobs}:\n"
    )
    print(markdown_table(["", "s per clip", "vs reference"], rows))
    # The reference makes clips one after another, so its rate is its latency's inverse.
    reference_rate = 60 / statistics.mean(reference)
    served_rate = 60 * args.concurrency * args.jobs / together
    print(f"\n{args.concurrency * args.jobs} jobs, {args.concurrency} clients at once:\n")
    print(
        markdown_table(
            ["", "jobs per minute", "vs reference"],
            [
                ["WanPipeline in-process, one after another", f"{reference_rate:.0f}", "1.00x"],
                [
                    f"served, {args.concurrency} at once",
                    f"{served_rate:.0f}",
                    f"{served_rate / reference_rate:.2f}x",
                ],
            ],
        )
    )


if __name__ == "__main__":
    main()
