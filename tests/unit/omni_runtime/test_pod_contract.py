"""Unit tests of omni_runtime.pod_contract: what the operator's pods and the runtime's
processes agree on, held in one place."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from omni_runtime import pod_contract
from omni_runtime.entrypoints import router_process, stage_process
from omni_runtime.pod_contract import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_TIMEOUT_ENV,
    DrainTimeoutError,
    deployment_is_ready,
    drain_timeout_from_env,
    endpoint_is_ready,
    endpoint_serves_while_terminating,
    parse_drain_timeout,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(None, 30.0), ("", 30.0), ("  ", 30.0), ("7.5", 7.5), (" 12 ", 12.0), ("0", 0.0)],
)
def test_a_drain_timeout_is_seconds_or_the_default(text: str | None, seconds: float) -> None:
    assert parse_drain_timeout(text) == seconds
    assert DEFAULT_DRAIN_TIMEOUT_S == 30


@pytest.mark.parametrize("text", ["soon", "-1", "-0.5", "inf", "nan", "1e400", "30s"])
def test_a_drain_timeout_that_is_not_seconds_is_an_error(text: str) -> None:
    with pytest.raises(DrainTimeoutError, match=re.escape(f"{DRAIN_TIMEOUT_ENV}={text!r}")):
        parse_drain_timeout(text)
    with pytest.raises(DrainTimeoutError):
        drain_timeout_from_env({DRAIN_TIMEOUT_ENV: text})


def test_every_process_refuses_a_bad_drain_timeout_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(stage_process.StageStartError, match="expected seconds"):
        stage_process.resolve_drain_timeout({DRAIN_TIMEOUT_ENV: "soon"})
    monkeypatch.setenv(DRAIN_TIMEOUT_ENV, "soon")
    with pytest.raises(DrainTimeoutError):
        router_process.router_server_config(FastAPI(), "127.0.0.1", 0)
    monkeypatch.setenv(DRAIN_TIMEOUT_ENV, "12")
    config = router_process.router_server_config(FastAPI(), "127.0.0.1", 0)
    assert config.timeout_graceful_shutdown == 12


def test_the_contract_is_written_down_once() -> None:
    """No module but pod_contract spells the contract's names, so none can drift."""
    literals = {
        f'"{value}"'
        for value in (
            pod_contract.DRAIN_TIMEOUT_ENV,
            pod_contract.REVISION_ENV,
            pod_contract.ANNOTATION_CONFIG_HASH,
            pod_contract.NAMESPACE_ENV,
            pod_contract.STAGE_CUDA_DEVICES_ENV_PREFIX,
        )
    }
    allowed = {REPO / "runtime/omni_runtime/pod_contract.py"}
    found = [
        f"{path.relative_to(REPO)}: {literal}"
        for root in ("runtime/omni_runtime", "operator/omni_operator")
        for path in sorted((REPO / root).rglob("*.py"))
        if path not in allowed
        for literal in literals
        if literal in path.read_text(encoding="utf-8")
    ]
    assert found == []


def test_endpoint_readiness() -> None:
    assert endpoint_is_ready({})
    assert endpoint_is_ready({"conditions": {"ready": True}})
    assert not endpoint_is_ready({"conditions": {"ready": False}})
    assert not endpoint_is_ready({"conditions": {"ready": True, "terminating": True}})
    assert endpoint_serves_while_terminating({"conditions": {"terminating": True}})
    assert not endpoint_serves_while_terminating(
        {"conditions": {"terminating": True, "serving": False}}
    )
    assert not endpoint_serves_while_terminating({"conditions": {"ready": True}})


@pytest.mark.parametrize(
    ("body", "ready"),
    [
        (None, False),
        ({"spec": {"replicas": 2}, "status": {"readyReplicas": 2}}, True),
        ({"spec": {"replicas": 2}, "status": {"readyReplicas": 1}}, False),
        ({"spec": {"replicas": 2}, "status": {}}, False),
        # Unset replicas are the apiserver's default, 1.
        ({"spec": {}, "status": {"readyReplicas": 1}}, True),
        # A Deployment scaled to nothing serves nothing.
        ({"spec": {"replicas": 0}, "status": {}}, False),
    ],
)
def test_deployment_readiness(body: dict[str, Any] | None, ready: bool) -> None:
    assert deployment_is_ready(body) is ready


def test_the_contract_imports_nothing_of_the_project() -> None:
    """Both sides import it, the lowest layers of the runtime included, so it may import
    none of them (kept here rather than as an import-linter layer: pyproject.toml is part
    of the images' dependency layers, and a change to it rebuilds the 10 GB CUDA one)."""
    import ast

    tree = ast.parse((REPO / "runtime/omni_runtime/pod_contract.py").read_text())
    imported = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert imported
    assert not [name for name in imported if name.startswith(("omni_runtime", "omni_operator"))]
