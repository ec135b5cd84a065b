"""Runs BAGEL's official reference inference for tests that compare the project's BAGEL
with it.

The reference (an unmodified copy of ByteDance-Seed/Bagel's inference code, in
../shared/reference/bagel) needs transformers 4.49, so it runs in its own environment
(env.sh builds it once, outside the checkout) as a subprocess: run_reference.py loads a
checkpoint the way BAGEL's app.py does, runs InterleaveInferencer.interleave_inference, and
writes the KV contexts, the final latent and the image to an .npz that run_reference
returns as arrays. This module runs in the project's environment and imports no torch.

    from bagel_reference.harness import reference_dir, run_reference

    if reference_dir() is None:
        pytest.skip("no BAGEL reference code")
    ref = run_reference({"checkpoint": ..., "prompt": "a cat", "image": None, ...}, tmp_path)
    ref["gen_keys"]  # float32 [num_layers, kv_len, num_kv_heads, head_dim]

run_reference.py's docstring lists the spec's keys and the arrays.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
ENV_SH = HERE / "env.sh"
RUNNER = HERE / "run_reference.py"
# A cold env.sh installs a few wheels (about half a minute); a warm one takes a second.
ENV_TIMEOUT_S = 1800
_TAIL = 6000


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-_TAIL:]


def reference_dir() -> Path | None:
    """The BAGEL reference code: $OMNI_BAGEL_REFERENCE, else the first of
    <repo>/../shared/reference/bagel and /work/shared/reference/bagel that exists; None if
    there is none (the tests that need it skip)."""
    configured = os.environ.get("OMNI_BAGEL_REFERENCE")
    if configured:
        return Path(configured)
    for candidate in (
        REPO.parent / "shared" / "reference" / "bagel",
        Path("/work/shared/reference/bagel"),
    ):
        if (candidate / "inferencer.py").is_file():
            return candidate.resolve()
    return None


@functools.cache
def reference_python() -> Path:
    """The python of the reference's environment, built by env.sh on first use (cached in
    ${OMNI_CACHE_DIR:-~/.cache/omni-operator}, and per process here)."""
    env = dict(os.environ)
    # The reference's env takes torch & co from the environment running these tests.
    env.setdefault("OMNI_BAGEL_BASE_PYTHON", sys.executable)
    try:
        proc = subprocess.run(
            ["bash", str(ENV_SH)],
            capture_output=True,
            text=True,
            env=env,
            timeout=ENV_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"{ENV_SH} did not finish in {ENV_TIMEOUT_S}s:\n{_tail(exc.stderr)}"
        ) from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{ENV_SH} failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
    python = Path(lines[-1])
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"{ENV_SH} printed {python}, which is not an executable")
    return python


def run_reference(
    spec: dict[str, Any], tmp_path: Path, *, timeout: float = 600
) -> dict[str, np.ndarray]:
    """Runs the reference on ``spec`` (run_reference.py's keys; reference_dir defaults to
    reference_dir(), out to a file in tmp_path) and returns the .npz's arrays by name.
    Raises RuntimeError with the tail of the reference's stderr if it fails or times out."""
    spec = dict(spec)
    # The reference runs in tmp_path: paths in the spec must not depend on the cwd.
    for key in ("checkpoint", "image", "reference_dir", "out"):
        if spec.get(key):
            spec[key] = str(Path(spec[key]).resolve())
    if not spec.get("reference_dir"):
        found = reference_dir()
        if found is None:
            raise RuntimeError("no BAGEL reference code: set OMNI_BAGEL_REFERENCE")
        spec["reference_dir"] = str(found)
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec.setdefault("out", str(tmp_path / "bagel-reference.npz"))
    out = Path(spec["out"])
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec, indent=1))
    out.unlink(missing_ok=True)

    python = reference_python()
    env = dict(os.environ)
    # Only the reference and the flash_attn stand-in beside this file: nothing of the
    # project's environment (whose transformers would shadow 4.49) through PYTHONPATH.
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(spec["reference_dir"])])
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    command = [str(python), str(RUNNER), str(spec_path)]
    try:
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"the BAGEL reference ran past {timeout}s ({spec_path}):\n{_tail(exc.stderr)}"
        ) from exc
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"the BAGEL reference failed (exit {proc.returncode}, spec {spec_path}):\n"
            f"{_tail(proc.stderr)}"
        )
    with np.load(out, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def guidance_spec(guidance: Any) -> dict[str, Any]:
    """The spec keys of a flow and its guidance, from a GuidanceParams (or anything with
    its fields: this module imports no torch)."""
    return {
        "num_timesteps": guidance.num_timesteps,
        "timestep_shift": guidance.timestep_shift,
        "cfg_text_scale": guidance.cfg_text_scale,
        "cfg_img_scale": guidance.cfg_img_scale,
        "cfg_interval": list(guidance.cfg_interval),
        "cfg_renorm_type": guidance.cfg_renorm_type,
        "cfg_renorm_min": guidance.cfg_renorm_min,
    }
