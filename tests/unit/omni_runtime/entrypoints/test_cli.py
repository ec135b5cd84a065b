"""The omni-runtime command as a user runs it: exit codes and messages, never tracebacks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[4]


def omni_runtime(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_runtime.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_validate_prints_the_normalised_seed_pipeline() -> None:
    result = omni_runtime(
        "validate",
        "-f",
        str(REPO / "examples/bagel.yaml"),
        "--model",
        "ByteDance-Seed/BAGEL-7B-MoT",
    )
    assert result.returncode == 0, result.stderr
    pipeline = yaml.safe_load(result.stdout)
    assert [s["type"] for s in pipeline["stages"]] == ["llm", "diffusion"]
    assert pipeline["stages"][1]["inputConnectors"] == {"from_stage_0": "shared_memory_connector"}


def test_validate_reports_errors_by_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - stage_id: 0\n    type: llm\n    replicas: -1\n")
    result = omni_runtime("validate", "-f", str(bad), "--model", "m")
    assert result.returncode == 1
    assert "stages[0].replicas" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_missing_file_is_a_message(tmp_path: Path) -> None:
    result = omni_runtime("validate", "-f", str(tmp_path / "nope.yaml"))
    assert result.returncode == 1
    assert "No such file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.yaml", "[" * 5000 + "]" * 5000),
        ("deep-map.yaml", "".join(" " * i + "- a:\n" for i in range(0, 400, 2)) + " " * 400 + "1"),
        ("deep.json", "[" * 5000 + "]" * 5000),
        ("deep-map.json", '{"a":' * 100 + "1" + "}" * 100),
    ],
)
def test_validate_refuses_deep_nesting_in_one_line(tmp_path: Path, name: str, text: str) -> None:
    deep = tmp_path / name
    deep.write_text(text)
    result = omni_runtime("validate", "-f", str(deep), "--model", "m")
    assert result.returncode == 1
    assert "nested deeper than 64 levels" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # the file, then the one issue


def test_unwritable_models_dir_is_a_message(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = omni_runtime("make-tiny-models", str(blocker / "models"))
    assert result.returncode == 1
    assert "omni-runtime: error:" in result.stderr
    assert "Traceback" not in result.stderr


def test_stage_and_router_refuse_bad_arguments_with_one_line_each(tmp_path: Path) -> None:
    pipeline = str(REPO / "examples/tiny-chat.yaml")
    cases = [
        (("stage", "-f", pipeline, "--stages", "7"), "--stages: no stage [7]"),
        (("stage", "-f", pipeline, "--stages", "x"), "--stages: expected stage ids"),
        (
            ("stage", "-f", pipeline, "--stages", "0", "--port", "0:1"),
            "--port: expected STAGE=PORT",
        ),
        (("stage", "-f", pipeline, "--stages", "0", "--health-port", "x"), "--health-port"),
        (("router", "-f", pipeline, "--replicas", "0"), "expected STAGE=HOST:PORT"),
        (("router", "-f", pipeline, "--replicas", "9=h:1"), "no stage '9'"),
        (("router", "-f", pipeline, "--replicas", "chat=h:x"), "is not HOST:PORT"),
        (("serve", "-f", str(tmp_path / "missing.yaml")), "cannot read"),
    ]
    for args, needle in cases:
        result = omni_runtime(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_serve_refuses_a_pipeline_the_router_cannot_run(tmp_path: Path) -> None:
    # Stage 2 takes its input from stage 0, skipping stage 1: not a chain.
    pipeline = tmp_path / "fan.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "model": "m",
                "stages": [
                    {"stageId": 0, "type": "llm", "output": "hidden_states"},
                    {"stageId": 1, "type": "llm"},
                    {
                        "stageId": 2,
                        "type": "diffusion",
                        "inputConnectors": {"from_stage_0": "c"},
                    },
                ],
                "connectors": {"c": {"name": "SharedMemoryConnector"}},
            }
        )
    )
    result = omni_runtime("serve", "-f", str(pipeline))
    assert result.returncode == 1
    assert "takes input from stage(s) [0]" in result.stderr


def test_serve_claims_its_port_before_any_stage_starts(tmp_path: Path) -> None:
    # A port in use is reported at once, not after the models load; and while they do, no
    # stage process can take the router's port (it did, once: vLLM binds ephemeral ports).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = omni_runtime(
            "serve", "-f", str(REPO / "examples/tiny-text-to-image.yaml"), "--port", str(port)
        )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "--port" in result.stderr
    assert "starting" not in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_a_stage_whose_connector_cannot_load_refuses_to_start(tmp_path: Path) -> None:
    # A mooncake package whose engine cannot load, as where its system libraries are missing.
    stub = tmp_path / "stub" / "mooncake"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "engine.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"
    )
    pipeline = tmp_path / "rdma.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "model": str(tmp_path / "no-model"),
                "stages": [
                    {"stageId": 0, "type": "llm", "output": "hidden_states"},
                    {
                        "stageId": 1,
                        "type": "diffusion",
                        "inputConnectors": {"from_stage_0": "rdma"},
                    },
                ],
                "connectors": {
                    "rdma": {
                        "name": "MooncakeTransferEngineConnector",
                        "extra": {"protocol": "tcp", "zmq_port": 0},
                    }
                },
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(stub.parent), "OMNI_MOONCAKE_LIBRARY_PATH": ""}
    result = subprocess.run(
        [
            sys.executable, "-m", "omni_runtime.entrypoints.cli", "stage",
            "-f", str(pipeline), "--stages", "1", "--health-port", "none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "stage 'stage-1': connector 'rdma':" in result.stderr
    assert "mooncake-transfer-engine" in result.stderr
    assert "Traceback" not in result.stderr
