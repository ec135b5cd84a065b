"""POST /v1/images/edits end to end: `omni-runtime serve -f examples/tiny-text-to-image.yaml`
(an LLM stage whose hidden states feed a tiny Stable Diffusion stage, which takes an input
image: image-to-image) started once for the module, called with the official `openai`
client's `images.edit` and with raw multipart bodies (httpx) that break one rule each."""

from __future__ import annotations

import base64
import io
import os
import signal
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from serving import CLI, served_base_url

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-omni"  # examples/tiny-text-to-image.yaml's servedModelName
QUICK = {"num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def server(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL (…/v1) of the example pipeline, served by `omni-runtime serve`."""
    log = tmp_path_factory.mktemp("edits") / "serve.log"
    env = {**os.environ, "OMNI_TINY_MODELS": str(tiny_models)}
    command = [*CLI, "serve", "-f", "examples/tiny-text-to-image.yaml", "--port", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        base_url = served_base_url(proc, log, 600)
        assert httpx.get(base_url.removesuffix("/v1") + "/health", timeout=5).status_code == 200
        yield base_url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, 130), log.read_text()[-3000:]


def png_bytes(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` and that holds no pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def decoded(b64: str | None) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64 or "")))
    assert image.format == "PNG"
    image.load()
    return image


def test_the_openai_client_edits_a_png_file(server: str, tmp_path: Path) -> None:
    source = tmp_path / "source.png"
    source.write_bytes(png_bytes(64, 64))
    client = openai.OpenAI(base_url=server, api_key="x", max_retries=0, timeout=300)
    with open(source, "rb") as image:
        result = client.images.edit(
            image=image,
            prompt="turn it into gold",
            model=MODEL,
            size="96x64",
            response_format="b64_json",
            extra_body={**QUICK, "strength": 0.5, "negative_prompt": "blurry"},
        )
    assert result.data is not None
    assert len(result.data) == 1
    assert decoded(result.data[0].b64_json).size == (96, 64)

    with open(source, "rb") as image:
        two = client.images.edit(image=image, prompt="a gold cat", n=2, extra_body=QUICK)
    assert two.data is not None
    images = [decoded(item.b64_json) for item in two.data]
    # No size: the input image's.
    assert [image.size for image in images] == [(64, 64), (64, 64)]


def test_malformed_edits_get_4xx_naming_the_field_and_the_server_keeps_serving(
    server: str,
) -> None:
    good = png_bytes(32, 32)

    def image(data: bytes = good, name: str = "image") -> tuple[str, tuple[str, bytes, str]]:
        return (name, ("in.png", data, "image/png"))

    def field(name: str, value: str) -> tuple[str, tuple[None, str]]:
        return (name, (None, value))

    prompt = field("prompt", "a cat")

    def with_field(name: str, value: str) -> list[Any]:
        return [prompt, field(name, value), image()]

    huge = b"\0" * (17 * 1024 * 1024)  # over the 16 MiB input image limit
    cases: list[tuple[str, list[Any], int, str | None, str]] = [
        ("no image", [prompt], 400, "image", "required"),
        ("not an image", [prompt, image(b"hello, not a png")], 400, "image", "not a readable"),
        ("too many pixels", [prompt, image(png_declaring(5000, 4000))], 400, "image", "5000x4000"),
        ("too many bytes", [prompt, image(huge)], 413, "image", "MiB"),
        ("two images", [prompt, image(), image()], 400, "image", "one input image"),
        ("two in a list", [prompt, *[image(name="image[]")] * 2], 400, "image", "one input"),
        ("no prompt", [image()], 400, "prompt", "required"),
        ("n not an int", with_field("n", "abc"), 400, "n", "integer"),
        ("n over the limit", with_field("n", "50"), 400, "n", "at most"),
        ("seed a float", with_field("seed", "1.5"), 400, "seed", "integer"),
        ("guidance a word", with_field("guidance_scale", "x"), 400, "guidance_scale", "number"),
        ("strength zero", with_field("strength", "0"), 400, "strength", "greater"),
        ("bad size", with_field("size", "big"), 400, "size", "WIDTHxHEIGHT"),
        ("url format", with_field("response_format", "url"), 400, "response_format", "b64_json"),
        ("unknown field", with_field("frobnicate", "1"), 400, "frobnicate", "unknown"),
        ("mask", [prompt, image(), image(name="mask")], 400, "mask", "not supported"),
        ("unknown model", with_field("model", "gpt-9"), 404, "model", "gpt-9"),
    ]  # fmt: skip
    with httpx.Client(base_url=server, timeout=120) as http:
        for name, parts, status, param, needle in cases:
            response = http.post("/images/edits", files=parts)
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (name, error)
            assert needle.lower() in error["message"].lower(), (name, error)
            assert (error["code"], error["type"]) == (status, "invalid_request_error"), error
        # Not a form at all.
        response = http.post("/images/edits", json={"prompt": "a cat", "image": "x"})
        assert response.status_code == 415, response.text
        assert "multipart/form-data" in response.json()["error"]["message"]
        # And a good request still gets its image.
        response = http.post(
            "/images/edits",
            files=[prompt, field("num_inference_steps", "2"), field("size", "32x32"), image()],
        )
        assert response.status_code == 200, response.text
        (item,) = response.json()["data"]
        assert decoded(item["b64_json"]).size == (32, 32)
