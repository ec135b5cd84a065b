"""Our router (`omni-runtime serve`) against vLLM's own OpenAI server, same model, same load,
with vLLM run both as it places itself and as our stages are placed.

Side by side in one run, on the tiny chat model (`omni-runtime make-tiny-models`):

- single: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the
  `vllm serve` console script fails with the CPU build) against `omni-runtime serve` of a
  one-stage pipeline (LLM, float32, eager, max model len 512, served as `tiny`).
- two replicas: `vllm-router` (round robin; installed with pip into a venv of its own,
  `--vllm-router-venv`, never into .venv) in front of two vLLM servers, against
  `omni-runtime serve` of the same pipeline with `replicas: 2` (round robin).

Placement. Neither `serve` nor `stage` (nor the operator's pods) set a CPU variable: an LLM
stage core is started by vLLM's OMPProcessManager (stage_llm_core_proc_manager.py) with
VLLM_CPU_OMP_THREADS_BIND=auto, which on x86 reserves one CPU per engine for the processes
around it (VLLM_CPU_NUM_OF_RESERVED_CPU's default) and starts the core with
OMP_NUM_THREADS = the CPUs left and the OpenMP binding to them (GOMP_CPU_AFFINITY, as it
preloads torch's libgomp), which pins every thread of the core: scheduler and model on
those CPUs, router and stage server unpinned. vLLM's own server resolves the same
variables the same way for its worker (one OMP thread on CPU 0, CPU 1 reserved, on 2
cores), but schedules in a process of its own, the engine core, which stays unpinned and
spins beside the API server while it waits for the worker. So each vLLM system runs twice
(`--placement`, default both):

- `vLLM default`: nothing set; vLLM places itself.
- `same as ours`: VLLM_CPU_OMP_THREADS_BIND = the CPUs our stage core ran on (read from its
  threads in the `ours` run, which therefore goes first), VLLM_CPU_NUM_OF_RESERVED_CPU =
  the CPUs left out, and, once the server is up, every thread of its engine core bound to
  those CPUs too, as our scheduler is (vLLM's CPU platform turns a uniprocess executor into
  a worker process whenever the engine core is a process, so its scheduler and model cannot
  share one process as ours do).

A third table shows where every process's threads may run, as seen once each system is
up, and the notes quote each engine's OpenMP binding from its log.

Every system answers the same chat requests from the official `openai` client
(AsyncOpenAI, no retries): 16 greedy tokens (`max_tokens=16, temperature=0`; standard
fields only, so the load is the OpenAI API's, and each answer's `usage.completion_tokens`
is checked to be 16; bench/vllm_bench_client.py runs vLLM's own client). A closed loop runs
at each `--concurrency` for `--warmup` s, then `--duration` s measured: p50 and p99 latency of the
requests sent in the window and throughput (requests finished in it per second). Systems
run one at a time (never two on the 2 cores at once); startup is the time from launch to
`GET /health` answering 200 (and, for vllm-router, its workers' too). Ratios, in each vLLM
row, are ours over that row's; so `vLLM default` shows the whole lead, `same as ours` what
is left once placement is equal, and the two vLLM rows what placement alone changes.
Targets: latency <= 1.05x, throughput >= 0.95x.

Where the rest comes from: the CPU time (user + system, psutil) of every process, read at
the start and the end of each measured window, divided by the requests finished in it, per
process role (vLLM: API server, engine core, worker; ours: router, stage server, stage
core; vllm-router; this script, the load generator, apart from the servers' total), with
the CPUs those processes kept busy on average. Prints the three markdown tables; `--json`
prints the figures as JSON.

    .venv/bin/python bench/router_vs_vllm.py [--duration 20] [--warmup 5]
        [--concurrency 1,8,32] [--placement both|same|default] [--skip-two-replicas]
        [--models-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from _load import (
    THIS_SCRIPT,
    CpuSampler,
    LoadResult,
    ManagedProcess,
    ServerStartError,
    closed_loop,
    cpu_list,
    exit_on_sigterm,
    free_port,
    markdown_table,
    ms,
    pin_threads,
    placement_of,
    process_role,
    process_tree,
    ratio_cell,
    role_order,
    running,
    thread_affinities,
    wait_http_ok,
)
from omni_runtime.entrypoints.cli import DEFAULT_CACHE_DIR, DEFAULT_MODELS_DIR
from omni_runtime.tiny_models import LLM_SUBDIR, ensure_tiny_models

SERVED_NAME = "tiny"
MAX_TOKENS = 16
MAX_MODEL_LEN = 512
LATENCY_TARGET = 1.05
THROUGHPUT_TARGET = 0.95
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
VLLM_ROUTER_PIN = "vllm-router==0.1.17"
# Varied a little so that no system gains from serving one identical prompt; request i
# uses PROMPTS[i % len(PROMPTS)] on every system.
PROMPTS = [
    "draw a red cat in a garden",
    "paint a blue river under the moon",
    "a portrait of a dog wearing a hat",
    "write a short poem about the sea",
]
OURS = "ours"
SAME = "same as ours"
DEFAULT = "vLLM default"
PLACEMENTS = {"both": [SAME, DEFAULT], "same": [SAME], "default": [DEFAULT]}
# The processes whose threads run an engine's model: what `same as ours` copies (ours)
# and what it is checked against (vLLM's).
ENGINE_ROLES = ("LLM stage core", "vLLM worker")
# vLLM's OMPProcessManager logs its binding once per engine it starts.
OMP_BINDING = re.compile(
    r"VLLM_CPU_OMP_THREADS_BIND='(?P<mask>[^']*)'.*?reserve_cpu_num=(?P<reserve>\d+)"
    r".*?core ids=\[(?P<cores>[^\]]*)\].*?reserved_cpus=\[(?P<reserved>[^\]]*)\]",
    re.DOTALL,
)


@dataclass
class SystemRun:
    """One system of one setup: how it started and what each concurrency gave."""

    setup: str
    system: str
    placement: str
    startup_s: float = math.nan
    loads: dict[int, LoadResult] = field(default_factory=dict)
    # Completion tokens and text of one request per prompt, sent before the load.
    check_tokens: list[int] = field(default_factory=list)
    check_texts: list[str] = field(default_factory=list)
    error: str | None = None
    # Once up: each process's role and where its threads may run (placement_of).
    placement_seen: list[tuple[str, str]] = field(default_factory=list)
    # The CPUs each engine's model threads may run on (ENGINE_ROLES), one set per engine.
    engine_cpus: list[set[int]] = field(default_factory=list)
    # Each engine's OpenMP binding as its log says.
    omp_bindings: list[str] = field(default_factory=list)


# -- the systems ------------------------------------------------------------------------------


def vllm_env(binding: set[int] | None = None) -> dict[str, str]:
    """This environment for vLLM's server (and serve), bound to ``binding`` if given."""
    env = dict(os.environ)
    # vLLM's CPU build sizes its KV cache from this (GiB); unset, it refuses to start.
    # `serve` sets the same 1 GiB for its LLM stages, so both sides get the same cache.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if binding is not None:
        # What OMPProcessManager resolved `auto` to for our stage core, given explicitly:
        # the worker's OMP threads (OMP_NUM_THREADS = their count) on those CPUs, the rest
        # kept for the other processes.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(binding)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(len(os.sched_getaffinity(0) - binding))
    return env


def start_vllm(
    model: Path, logs: Path, label: str, binding: set[int] | None
) -> tuple[ManagedProcess, int]:
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--enforce-eager",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
        # Per-request access lines and engine statistics cost the baseline CPU time that
        # our router and stages do not spend: off, the baseline is at its fastest.
        "--disable-uvicorn-access-log",
        "--disable-log-stats",
    ]  # fmt: skip
    process = ManagedProcess(label, command, logs / f"{label}.log", env=vllm_env(binding))
    return process, port


def bind_engine_core(server: ManagedProcess, binding: set[int] | None) -> None:
    """Bind every thread of ``server``'s engine core (its scheduler) to ``binding``, as
    our stage core's scheduler is bound with its model; nothing when ``binding`` is None."""
    if binding is None:
        return
    cores = [p for p in process_tree(server.proc.pid) if process_role(p) == "vLLM engine core"]
    if not cores:
        raise ServerStartError(f"{server.name}: no engine core process to bind")
    for core in cores:
        pin_threads(core, binding)


def start_vllm_single(
    model: Path, logs: Path, processes: list[ManagedProcess], binding: set[int] | None
) -> str:
    process, port = start_vllm(model, logs, "vllm", binding)
    processes.append(process)
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    bind_engine_core(process, binding)
    return f"http://127.0.0.1:{port}/v1"


def start_vllm_router(
    model: Path,
    logs: Path,
    router_bin: Path,
    processes: list[ManagedProcess],
    bindings: list[set[int]] | None,
) -> str:
    # Both workers start at once, as serve starts its two replicas.
    servers = []
    for index in range(2):
        binding = bindings[index] if bindings is not None else None
        process, port = start_vllm(model, logs, f"vllm-{index}", binding)
        processes.append(process)
        servers.append((process, port, binding))
    for process, port, binding in servers:
        wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
        bind_engine_core(process, binding)
    port = free_port()
    command = [
        str(router_bin),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *(f"http://127.0.0.1:{p}" for _, p, _ in servers),
        "--policy", "round_robin",
        # Its default would bind a fixed port (29000) on every address.
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
        # The workers are up already; the default check interval is 30 s.
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    processes.append(ManagedProcess("vllm-router", command, logs / "vllm-router.log"))
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def write_pipeline(model: Path, replicas: int, directory: Path) -> Path:
    pipeline = {
        "model": str(model),
        "stages": [
            {
                "stageId": 0,
                "name": "chat",
                "type": "llm",
                "dtype": "float32",
                "enforceEager": True,
                "maxModelLen": MAX_MODEL_LEN,
                "replicas": replicas,
            }
        ],
        "router": {"servedModelName": SERVED_NAME, "policy": "round-robin"},
    }
    path = directory / f"chat-{replicas}.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return path


def start_serve(model: Path, replicas: int, logs: Path, processes: list[ManagedProcess]) -> str:
    pipeline_file = write_pipeline(model, replicas, logs)
    port = free_port()
    stage_logs = logs / f"serve-{replicas}"
    command = [
        sys.executable, "-m", "omni_runtime.entrypoints.cli", "serve",
        "-f", str(pipeline_file),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-dir", str(stage_logs),
    ]  # fmt: skip
    # No CPU variable: the stages place themselves as in a pod.
    processes.append(
        ManagedProcess(f"serve-{replicas}", command, logs / f"serve-{replicas}.log", vllm_env())
    )
    wait_http_ok(f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, processes)
    return f"http://127.0.0.1:{port}/v1"


def vllm_router_binary(venv: Path) -> Path:
    """vllm-router's launcher in ``venv``, installed there first if missing.

    A venv of its own: its dependencies (fastapi, uvicorn, aiohttp...) must not move the
    project's pins. RuntimeError with pip's or the launcher's own words if it cannot be had.
    """
    launcher = venv / "bin" / "vllm-router"
    if not launcher.exists():
        print(f"installing {VLLM_ROUTER_PIN} into {venv} ...", file=sys.stderr, flush=True)
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", VLLM_ROUTER_PIN],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
                raise RuntimeError(f"`{' '.join(step)}` failed ({done.returncode}):\n{tail}")
    # The Rust router ships as a compiled extension; --help loads it, so a wheel that
    # does not run on this machine fails here rather than mid-benchmark.
    done = subprocess.run(
        [str(launcher), "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`{launcher} --help` failed ({done.returncode}):\n{tail}")
    return launcher


# -- the load ---------------------------------------------------------------------------------


def chat_messages(index: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}]


async def drive(base_url: str, run: SystemRun, args: argparse.Namespace) -> None:
    client = AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )

    async def send(index: int) -> int:
        reply = await client.chat.completions.create(
            model=SERVED_NAME,
            messages=chat_messages(index),
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.usage.completion_tokens if reply.usage is not None else -1

    try:
        for index in range(len(PROMPTS)):
            reply = await client.chat.completions.create(
                model=SERVED_NAME,
                messages=chat_messages(index),
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            run.check_tokens.append(reply.usage.completion_tokens if reply.usage else -1)
            run.check_texts.append(reply.choices[0].message.content or "")
        for concurrency in args.concurrency:
            run.loads[concurrency] = await closed_loop(
                send, concurrency, args.warmup, args.duration, sampler=CpuSampler()
            )
            load = run.loads[concurrency]
            print(
                f"  {label(run)}, concurrency {concurrency}: "
                f"{load.throughput:.1f} req/s, p50 {ms(load.percentile(50))} ms, "
                f"p99 {ms(load.percentile(99))} ms, {load.errors} errors",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await client.close()


def label(run: SystemRun) -> str:
    return f"{run.setup} / {run.system} ({run.placement})"


def observe_placement(run: SystemRun, logs: Path) -> None:
    """What ``run``'s processes got: their threads' CPUs, and the engines' OMP binding."""
    for proc in process_tree():
        try:
            role = process_role(proc)
            run.placement_seen.append((role, placement_of(proc)))
            if role in ENGINE_ROLES:
                cpus: set[int] = set()
                for affinity in thread_affinities(proc):
                    cpus |= affinity
                run.engine_cpus.append(cpus)
        except psutil.Error:
            continue
    for log in sorted(logs.rglob("*.log")):
        for match in OMP_BINDING.finditer(log.read_text(errors="replace")):
            # An explicit list reserves the CPUs outside it (reserved_cpus stays empty).
            reserved = f"[{match['reserved']}]" if match["mask"] == "auto" else "the others"
            run.omp_bindings.append(
                f"VLLM_CPU_OMP_THREADS_BIND={match['mask']!r}, reserve_cpu_num "
                f"{match['reserve']}: OMP threads on CPU(s) [{match['cores']}], reserved: "
                f"{reserved}"
            )


Starter = Callable[[list[ManagedProcess], Path], str]


def vllm_single(model: Path, binding: set[int] | None) -> Starter:
    def start(processes: list[ManagedProcess], logs: Path) -> str:
        return start_vllm_single(model, logs, processes, binding)

    return start


def vllm_router(model: Path, router_bin: Path, bindings: list[set[int]] | None) -> Starter:
    def start(processes: list[ManagedProcess], logs: Path) -> str:
        return start_vllm_router(model, logs, router_bin, processes, bindings)

    return start


def serve(model: Path, replicas: int) -> Starter:
    def start(processes: list[ManagedProcess], logs: Path) -> str:
        return start_serve(model, replicas, logs, processes)

    return start


def measure(
    setup: str,
    system: str,
    placement: str,
    start: Starter,
    logs: Path,
    args: argparse.Namespace,
) -> SystemRun:
    """Start one system (logging under a folder of its own), see where its processes may
    run, load it at each concurrency, stop it (whatever happens)."""
    run = SystemRun(setup, system, placement)
    print(f"{label(run)}: starting", file=sys.stderr, flush=True)
    own_logs = logs / re.sub(r"[^a-z0-9]+", "-", f"{setup} {system} {placement}".lower())
    own_logs.mkdir(parents=True)
    processes: list[ManagedProcess] = []
    with running(processes):
        began = time.monotonic()
        try:
            base_url = start(processes, own_logs)
        except ServerStartError as e:
            run.error = f"did not start: {e}"
            return run
        run.startup_s = time.monotonic() - began
        print(f"  ready in {run.startup_s:.1f} s", file=sys.stderr, flush=True)
        observe_placement(run, own_logs)
        try:
            asyncio.run(drive(base_url, run, args))
        except Exception as e:  # the other systems are still worth measuring
            run.error = f"failed: {type(e).__name__}: {e}"
    return run


# -- the report -------------------------------------------------------------------------------


def tokens_cell(load: LoadResult) -> str:
    counts = [t for t in load.tags if isinstance(t, int)]
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def by_setup(runs: list[SystemRun]) -> dict[str, list[SystemRun]]:
    """Each setup's runs: vLLM's placements in PLACEMENTS order, then ours."""
    order = {DEFAULT: 0, SAME: 1, OURS: 2}
    setups: dict[str, list[SystemRun]] = {}
    for run in runs:
        setups.setdefault(run.setup, []).append(run)
    return {
        setup: sorted(members, key=lambda run: order.get(run.placement, 3))
        for setup, members in setups.items()
    }


def table(runs: list[SystemRun], concurrencies: list[int]) -> str:
    headers = [
        "setup", "system", "placement", "startup s", "conc", "req/s", "p50 ms", "p99 ms",
        "errors", "tokens", "req/s ours/this", "p50 ours/this", "p99 ours/this",
    ]  # fmt: skip
    rows: list[list[object]] = []
    for setup, members in by_setup(runs).items():
        ours = next((run for run in members if run.placement == OURS), None)
        for run in members:
            startup = "-" if math.isnan(run.startup_s) else f"{run.startup_s:.1f}"
            if run.error is not None and not run.loads:
                rows.append([setup, run.system, run.placement, startup, *["-"] * 6, "", "", ""])
                continue
            for concurrency in concurrencies:
                load = run.loads.get(concurrency)
                if load is None:
                    continue
                cells: list[object] = [
                    setup, run.system, run.placement, startup, concurrency,
                    f"{load.throughput:.1f}", ms(load.percentile(50)), ms(load.percentile(99)),
                    load.errors, tokens_cell(load),
                ]  # fmt: skip
                mine = ours.loads.get(concurrency) if ours is not None and run is not ours else None
                if mine is not None and load.throughput > 0:
                    p50 = mine.percentile(50) / load.percentile(50)
                    p99 = mine.percentile(99) / load.percentile(99)
                    cells += [
                        ratio_cell(mine.throughput / load.throughput, THROUGHPUT_TARGET, True),
                        ratio_cell(p50, LATENCY_TARGET, False),
                        ratio_cell(p99, LATENCY_TARGET, False),
                    ]
                else:
                    cells += ["", "", ""]
                rows.append(cells)
    return markdown_table(headers, rows)


def cpu_table(runs: list[SystemRun], concurrencies: list[int]) -> str:
    """ms of CPU per request finished in the window, per process role; the servers' total
    and how many CPUs they kept busy; the load generator (this script) apart."""
    roles: set[str] = set()
    for run in runs:
        for load in run.loads.values():
            if load.cpu is not None and load.completed_in_window:
                per_request = {
                    role: seconds / load.completed_in_window
                    for role, seconds in load.cpu.seconds.items()
                }
                # Roles that never reach 0.05 ms a request (the resource tracker) are noise.
                roles |= {r for r, v in per_request.items() if v >= 5e-5 and r != THIS_SCRIPT}
    columns = sorted(roles, key=role_order)
    headers = ["setup", "system", "placement", "conc", "requests", *columns, "servers", "CPUs busy"]
    headers.append(THIS_SCRIPT)
    rows: list[list[object]] = []
    for setup, members in by_setup(runs).items():
        for run in members:
            for concurrency in concurrencies:
                level = run.loads.get(concurrency)
                if level is None or level.cpu is None or not level.completed_in_window:
                    continue
                done = level.completed_in_window
                seconds = level.cpu.seconds
                servers = sum(v for role, v in seconds.items() if role != THIS_SCRIPT)
                cells: list[object] = [setup, run.system, run.placement, concurrency, done]
                for role in columns:
                    value = seconds.get(role)
                    count = level.cpu.processes.get(role, 0)
                    suffix = f" ({count})" if count > 1 else ""
                    cells.append("-" if value is None else f"{value / done * 1000:.2f}{suffix}")
                cells += [
                    f"{servers / done * 1000:.2f}",
                    f"{servers / level.cpu.wall_s:.2f}" if level.cpu.wall_s > 0 else "-",
                    f"{seconds.get(THIS_SCRIPT, 0.0) / done * 1000:.2f}",
                ]
                rows.append(cells)
    return markdown_table(headers, rows)


def placement_table(runs: list[SystemRun]) -> str:
    headers = ["setup", "system", "placement", "process", "where its threads may run"]
    rows: list[list[object]] = []
    for setup, members in by_setup(runs).items():
        for run in members:
            counted: dict[tuple[str, str], int] = {}
            for seen in run.placement_seen:
                counted[seen] = counted.get(seen, 0) + 1
            for (role, where), count in sorted(
                counted.items(), key=lambda item: (role_order(item[0][0]), item[0][1])
            ):
                name = f"{role} (x{count})" if count > 1 else role
                rows.append([setup, run.system, run.placement, name, where])
    return markdown_table(headers, rows)


def notes(runs: list[SystemRun], skipped: dict[str, str]) -> list[str]:
    lines = []
    for run in runs:
        if run.error is not None:
            lines.append(f"{label(run)}: {run.error}")
        if run.check_tokens and any(t != MAX_TOKENS for t in run.check_tokens):
            lines.append(
                f"{label(run)}: completion tokens per prompt {run.check_tokens}, "
                f"not all {MAX_TOKENS} (an early end of sequence): latencies are not comparable"
            )
        for load in run.loads.values():
            if load.first_error is not None:
                lines.append(
                    f"{label(run)}, concurrency {load.concurrency}: first error: {load.first_error}"
                )
            if load.cpu is not None and load.cpu.ended:
                lines.append(
                    f"{label(run)}, concurrency {load.concurrency}: ended inside the window "
                    f"(CPU time left out): {', '.join(load.cpu.ended)}"
                )
        for binding in sorted(set(run.omp_bindings)):
            count = run.omp_bindings.count(binding)
            times = f" (x{count})" if count > 1 else ""
            lines.append(f"{label(run)}: OpenMP binding{times}: {binding}")
    for setup, reason in skipped.items():
        lines.append(f"{setup}: {reason}")
    for setup, members in by_setup(runs).items():
        texts = [run.check_texts for run in members if run.check_texts]
        if len(texts) > 1:
            same = all(text == texts[0] for text in texts)
            lines.append(
                f"{setup}: greedy answers {'identical' if same else 'DIFFER'} across systems"
            )
        placed = {run.placement: run for run in members}
        if SAME in placed and DEFAULT in placed:
            for concurrency, load in placed[SAME].loads.items():
                base = placed[DEFAULT].loads.get(concurrency)
                if base is not None and base.throughput > 0:
                    lines.append(
                        f"{setup}, concurrency {concurrency}: vLLM placed as ours / as it "
                        f"places itself: {load.throughput / base.throughput:.2f}x req/s"
                    )
    return lines


def figures(runs: list[SystemRun], skipped: dict[str, str]) -> dict[str, Any]:
    return {
        "runs": [
            {
                "setup": run.setup,
                "system": run.system,
                "placement": run.placement,
                "startup_s": None if math.isnan(run.startup_s) else run.startup_s,
                "error": run.error,
                "check_completion_tokens": run.check_tokens,
                "placement_seen": [
                    {"process": role, "threads": where} for role, where in run.placement_seen
                ],
                "omp_bindings": run.omp_bindings,
                "loads": [
                    {
                        "concurrency": load.concurrency,
                        "requests": len(load.latencies),
                        "completed_in_window": load.completed_in_window,
                        "throughput_rps": load.throughput,
                        "p50_s": load.percentile(50),
                        "p99_s": load.percentile(99),
                        "errors": load.errors,
                        "first_error": load.first_error,
                        "cpu_s_by_process": load.cpu.seconds if load.cpu else None,
                        "processes_by_role": load.cpu.processes if load.cpu else None,
                        "cpu_window_s": load.cpu.wall_s if load.cpu else None,
                    }
                    for load in run.loads.values()
                ],
            }
            for run in runs
        ],
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0, help="measured s per level")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured s before each")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 8, 32],
        help="comma-separated closed-loop concurrencies (default 1,8,32)",
    )
    parser.add_argument(
        "--placement",
        choices=sorted(PLACEMENTS),
        default="both",
        help="vLLM placed as our stages are (same), as it places itself (default), or both",
    )
    parser.add_argument("--skip-two-replicas", action="store_true")
    parser.add_argument(
        "--models-dir", type=Path, default=DEFAULT_MODELS_DIR, help="tiny models (built if absent)"
    )
    parser.add_argument(
        "--vllm-router-venv",
        type=Path,
        default=DEFAULT_CACHE_DIR / "bench-venv",
        help=f"venv holding {VLLM_ROUTER_PIN} (created with pip if absent)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    model = ensure_tiny_models(args.models_dir) / LLM_SUBDIR
    runs: list[SystemRun] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-vs-vllm-") as tmp:
        logs = Path(tmp)
        # Ours first: `same as ours` copies where its stage cores ran.
        ours = measure("single", "ours", OURS, serve(model, 1), logs, args)
        runs.append(ours)
        for placement in PLACEMENTS[args.placement]:
            binding: set[int] | None = None
            if placement == SAME:
                if len(ours.engine_cpus) != 1:
                    skipped[f"single / vLLM ({SAME})"] = "not measured: ours did not start"
                    continue
                binding = ours.engine_cpus[0]
            runs.append(
                measure(
                    "single",
                    "vLLM",
                    placement,
                    vllm_single(model, binding),
                    logs,
                    args,
                )
            )
        if args.skip_two_replicas:
            skipped["two replicas"] = "skipped (--skip-two-replicas)"
        else:
            ours2 = measure("two replicas", "ours", OURS, serve(model, 2), logs, args)
            runs.append(ours2)
            try:
                router_bin = vllm_router_binary(args.vllm_router_venv)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                skipped["two replicas / vllm-router"] = f"not measured: {e}"
            else:
                for placement in PLACEMENTS[args.placement]:
                    bindings: list[set[int]] | None = None
                    if placement == SAME:
                        if len(ours2.engine_cpus) != 2:
                            skipped[f"two replicas / vllm-router ({SAME})"] = (
                                "not measured: ours did not start"
                            )
                            continue
                        bindings = ours2.engine_cpus
                    runs.append(
                        measure(
                            "two replicas",
                            "vllm-router",
                            placement,
                            vllm_router(model, router_bin, bindings),
                            logs,
                            args,
                        )
                    )
    if args.json:
        print(json.dumps(figures(runs, skipped), indent=2))
        return
    print(
        f"\nchat completions of {MAX_TOKENS} greedy tokens, closed loop, {args.warmup:g} s "
        f"warm-up + {args.duration:g} s per level; targets: latency <= {LATENCY_TARGET}x, "
        f"throughput >= {THROUGHPUT_TARGET}x of vLLM (ours over each vLLM row)\n"
    )
    print(table(runs, args.concurrency))
    print(
        "\nms of CPU (user + system) per request finished in the window, per process (x N: "
        "N processes, summed); servers: all but this script; CPUs busy: the servers' CPU "
        "seconds per second of the window\n"
    )
    print(cpu_table(runs, args.concurrency))
    print("\nwhere each process's threads may run, once up\n")
    print(placement_table(runs))
    for line in notes(runs, skipped):
        print(f"- {line}")


if __name__ == "__main__":
    main()
