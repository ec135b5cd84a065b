"""vLLM's own benchmark client (`vllm bench serve`) against our router and vLLM's server.

What vLLM's users measure a server with, run unchanged against both: the `openai-chat`
backend (POST /v1/chat/completions) and the `openai` backend (POST /v1/completions), on
the tiny chat model (`omni-runtime make-tiny-models`), random prompts of `--input-len`
tokens, `--output-len` tokens each (`--ignore-eos`, a vLLM sampling extension our router
passes to its stage as vLLM's server does), `--num-prompts` requests at most
`--concurrency` at a time. The systems are bench/router_vs_vllm.py's: `omni-runtime serve`
of a one-stage pipeline, and vLLM's OpenAI server placed as it places itself (`vLLM
default`) and as our stage core is placed (`same as ours`); one at a time on the machine.

Per system and backend: requests completed and failed, request throughput, and TTFT and
TPOT (mean, p99) as the client reports them. Failed requests must be 0 for every system.

    .venv/bin/python bench/vllm_bench_client.py [--num-prompts 200] [--concurrency 8]
        [--input-len 64] [--output-len 16] [--placement both|same|default] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _load import ManagedProcess, ServerStartError, exit_on_sigterm, markdown_table, running
from omni_runtime.entrypoints.cli import DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models
from router_vs_vllm import (
    OURS,
    PLACEMENTS,
    SAME,
    SERVED_NAME,
    SystemRun,
    observe_placement,
    start_serve,
    start_vllm_single,
)

BACKENDS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
# What `vllm bench serve` may take for one backend's run before it is called hung.
CLIENT_TIMEOUT_S = 900


@dataclass
class ClientRun:
    system: str
    placement: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None


def bench_serve(base_url: str, backend: str, model: Path, out: Path, args: Any) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result (JSON)."""
    command = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", backend,
        "--base-url", base_url,
        "--endpoint", BACKENDS[backend],
        "--model", SERVED_NAME,
        "--tokenizer", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency),
        "--ignore-eos",
        "--seed", "0",
        "--save-result",
        "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, check=False
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure(
    system: str, placement: str, start: Any, model: Path, logs: Path, args: Any
) -> tuple[ClientRun, SystemRun]:
    run = ClientRun(system, placement)
    seen = SystemRun("single", system, placement)
    own = logs / f"{system}-{placement}".replace(" ", "-")
    own.mkdir(parents=True)
    processes: list[ManagedProcess] = []
    print(f"{system} ({placement}): starting", file=sys.stderr, flush=True)
    with running(processes):
        try:
            base_url = start(processes, own).removesuffix("/v1")
        except ServerStartError as e:
            run.error = f"did not start: {e}"
            return run, seen
        observe_placement(seen, own)
        for backend in BACKENDS:
            print(f"  {backend}", file=sys.stderr, flush=True)
            try:
                run.results[backend] = bench_serve(
                    base_url, backend, model, own / f"{backend}.json", args
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                run.error = f"{backend}: {e}"
    return run, seen


def table(runs: list[ClientRun]) -> str:
    rows = []
    for run in runs:
        for backend, r in run.results.items():
            rows.append(
                [
                    run.system,
                    run.placement,
                    backend,
                    r["completed"],
                    r["failed"],
                    f"{r['request_throughput']:.1f}",
                    f"{r['mean_ttft_ms']:.1f}",
                    f"{r['p99_ttft_ms']:.1f}",
                    f"{r['mean_tpot_ms']:.2f}",
                    f"{r['p99_tpot_ms']:.2f}",
                ]
            )
        if run.error:
            rows.append([run.system, run.placement, run.error, "", "", "", "", "", "", ""])
    headers = [
        "system", "placement", "backend", "completed", "failed", "req/s",
        "TTFT mean ms", "TTFT p99 ms", "TPOT mean ms", "TPOT p99 ms",
    ]  # fmt: skip
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="both")
    parser.add_argument(
        "--models-dir", type=Path, default=DEFAULT_MODELS_DIR, help="tiny models (built if absent)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    model = ensure_tiny_models(args.models_dir) / LLM_SUBDIR
    runs: list[ClientRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-client-") as tmp:
        logs = Path(tmp)

        def ours(processes: list[ManagedProcess], where: Path) -> str:
            return start_serve(model, 1, where, processes)

        run, seen = measure("ours", OURS, ours, model, logs, args)
        runs.append(run)
        for placement in PLACEMENTS[args.placement]:
            binding: set[int] | None = None
            if placement == SAME:
                if len(seen.engine_cpus) != 1:
                    runs.append(ClientRun("vLLM", placement, error="ours did not start"))
                    continue
                binding = seen.engine_cpus[0]

            def vllm(processes: list[ManagedProcess], where: Path, b: Any = binding) -> str:
                return start_vllm_single(model, where, processes, b)

            runs.append(measure("vLLM", placement, vllm, model, logs, args)[0])
    if args.json:
        print(json.dumps([run.__dict__ for run in runs], indent=2, default=str))
        return
    print(
        f"vllm bench serve: {args.num_prompts} random prompts of {args.input_len} tokens, "
        f"{args.output_len} tokens each (--ignore-eos), at most {args.concurrency} at once\n"
    )
    print(table(runs))
    failed = sum(r["failed"] for run in runs for r in run.results.values())
    if failed or any(run.error for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
