"""/v1/images/edits' multipart form: parsed as it streams in, checked field by field, and
turned into the same pipeline request as /v1/images/generations, plus the input image."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Mapping, Sequence

import httpx
import numpy as np
import pytest
from PIL import Image

from omni_runtime.router.endpoints.bodies import request_models
from omni_runtime.router.endpoints.images import ImageEditRequest, edit_form
from omni_runtime.router.errors import RequestError
from omni_runtime.router.json_body import parse_body
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.multipart import MultipartForm
from omni_runtime.router.stage_requests import PipelineRequest

LIMITS = RouterLimits()
# The bodies of a pipeline of no family (a diffusers pipeline such as Stable Diffusion's):
# the common fields and the generic diffusers ones (true_cfg_scale among them).
BODIES = request_models(None)
SOURCE = np.arange(8 * 12 * 3, dtype=np.uint8).reshape(8, 12, 3)


def png(image: np.ndarray = SOURCE) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixels (nothing to decode)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


BOUNDARY = "b0undary-c8f1"


def multipart(
    fields: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    files: Sequence[tuple[str, bytes]] = (("image", png()),),
) -> tuple[str, bytes]:
    """The content type and body of a form, laid out as httpx (the openai client's
    transport) lays it out: text fields first, then files."""
    parts = [
        b'Content-Disposition: form-data; name="%s"\r\n\r\n%s' % (name.encode(), value.encode())
        for name, value in (fields.items() if isinstance(fields, Mapping) else fields)
    ]
    parts += [
        b'Content-Disposition: form-data; name="%s"; filename="%s.png"\r\n'
        b"Content-Type: image/png\r\n\r\n%s" % (name.encode(), name.encode(), data)
        for name, data in files
    ]
    delimiter = b"--" + BOUNDARY.encode()
    body = b"".join(delimiter + b"\r\n" + part + b"\r\n" for part in parts)
    return f"multipart/form-data; boundary={BOUNDARY}", body + delimiter + b"--\r\n"


def test_what_httpx_sends_parses() -> None:
    request = httpx.Request(
        "POST",
        "http://router/v1/images/edits",
        data={"prompt": "a cat", "n": "2"},
        files={"image": ("a.png", png(), "image/png")},
    )
    body, images = parse(request.headers["content-type"], request.read())
    assert (body.prompt, body.n, images) == ("a cat", 2, [png()])


def parse(
    content_type: str, body: bytes, limits: RouterLimits = LIMITS, chunk: int = 7
) -> tuple[ImageEditRequest, list[bytes]]:
    """Fed in small chunks, as a slow client's body arrives."""
    form = edit_form(content_type, limits, BODIES.edits)
    for start in range(0, len(body), chunk):
        form.feed(body[start : start + chunk])
    return form.finish()


def edit(
    fields: Mapping[str, str] | Sequence[tuple[str, str]],
    files: Sequence[tuple[str, bytes]] = (("image", png()),),
    limits: RouterLimits = LIMITS,
) -> PipelineRequest:
    request, images = parse(*multipart(fields, files), limits=limits)
    return request.to_pipeline_request("r", limits, images)


def refusal(
    fields: Mapping[str, str] | Sequence[tuple[str, str]] = (("prompt", "x"),),
    files: Sequence[tuple[str, bytes]] = (("image", png()),),
    limits: RouterLimits = LIMITS,
) -> RequestError:
    with pytest.raises(RequestError) as info:
        edit(fields, files, limits)
    return info.value


def test_a_form_becomes_a_pipeline_request_with_the_decoded_image() -> None:
    request = edit(
        {
            "prompt": "turn it gold",
            "model": "tiny",
            "n": "2",
            "size": "96x64",
            "response_format": "b64_json",
            "user": "u1",
            "negative_prompt": "blurry",
            "num_inference_steps": "3",
            "guidance_scale": "4.5",
            "true_cfg_scale": "2",
            "seed": "7",
            "strength": "0.6",
        }
    )
    assert request.messages == [{"role": "user", "content": "turn it gold"}]
    assert request.diffusion_params == {
        "height": 64,
        "width": 96,
        "num_inference_steps": 3,
        "guidance_scale": 4.5,
        "seed": 7,
        "negative_prompt": "blurry",
        "num_images": 2,
        "true_cfg_scale": 2.0,
        "strength": 0.6,
    }
    (image,) = request.images
    assert np.array_equal(image, SOURCE)
    assert request.sticky_key == "u1"


def test_the_shared_fields_map_as_generations_map_them() -> None:
    shared = {"prompt": "a cat", "n": 3, "size": "auto", "seed": 1, "guidance_scale": 2.0}
    generation = parse_body(BODIES.images, shared).to_pipeline_request("g", LIMITS)
    edited = edit({name: str(value) for name, value in shared.items()})
    assert edited.diffusion_params == generation.diffusion_params
    assert edited.diffusion_params == {"seed": 1, "guidance_scale": 2.0, "num_images": 3}
    assert edited.messages == generation.messages


def test_a_list_of_one_image_is_taken_and_a_jpeg_is_read_as_rgb() -> None:
    jpeg = io.BytesIO()
    Image.new("L", (16, 8), 200).save(jpeg, format="JPEG")
    request = edit({"prompt": "x"}, files=[("image[]", jpeg.getvalue())])
    (image,) = request.images
    assert image.shape == (8, 16, 3)
    assert request.diffusion_params == {"num_images": 1}


TOO_MANY_PIXELS = RouterLimits(max_input_image_pixels=8 * 12 - 1)


@pytest.mark.parametrize(
    ("fields", "files", "limits", "status", "param", "needle"),
    [
        ({"prompt": "x"}, [], LIMITS, 400, "image", "image: required"),
        ({"prompt": "x"}, [("image", b"hello")], LIMITS, 400, "image", "not a readable image"),
        ({"prompt": "x"}, [("image", b"")], LIMITS, 400, "image", "not a readable image"),
        (
            {"prompt": "x"},
            [("image", png()), ("image", png())],
            LIMITS,
            400,
            "image",
            "one input image",
        ),
        (
            {"prompt": "x"},
            [("image[]", png()), ("image[]", png())],
            LIMITS,
            400,
            "image",
            "one input image",
        ),
        ({"prompt": "x"}, [("image", png())], TOO_MANY_PIXELS, 400, "image", "at most 95 pixels"),
        (
            {"prompt": "x"},
            [("image", png_header_only(5000, 4000))],
            LIMITS,
            400,
            "image",
            "the image is 5000x4000",
        ),
        (
            {"prompt": "x"},
            [("image", png()), ("mask", png())],
            LIMITS,
            400,
            "mask",
            "masks are not supported",
        ),
        ({}, [("image", png())], LIMITS, 400, "prompt", "prompt: required"),
        ({"prompt": ""}, [("image", png())], LIMITS, 400, "prompt", "at least 1 character"),
        ({"prompt": "x" * 40_000}, [("image", png())], LIMITS, 400, "prompt", "the limit is"),
        ({"prompt": "x", "n": "abc"}, [("image", png())], LIMITS, 400, "n", "valid integer"),
        ({"prompt": "x", "n": "0"}, [("image", png())], LIMITS, 400, "n", "greater than"),
        ({"prompt": "x", "n": "50"}, [("image", png())], LIMITS, 400, "n", "at most 4"),
        ({"prompt": "x", "seed": "-1"}, [("image", png())], LIMITS, 400, "seed", "seed"),
        ({"prompt": "x", "size": "big"}, [("image", png())], LIMITS, 400, "size", "WIDTHxHEIGHT"),
        ({"prompt": "x", "size": "99999x64"}, [("image", png())], LIMITS, 400, "width", "2048"),
        (
            {"prompt": "x", "num_inference_steps": "1.5"},
            [("image", png())],
            LIMITS,
            400,
            "num_inference_steps",
            "integer",
        ),
        (
            {"prompt": "x", "num_inference_steps": "100000"},
            [("image", png())],
            LIMITS,
            400,
            "num_inference_steps",
            "at most",
        ),
        (
            {"prompt": "x", "guidance_scale": "inf"},
            [("image", png())],
            LIMITS,
            400,
            "guidance_scale",
            "finite",
        ),
        (
            {"prompt": "x", "true_cfg_scale": "high"},
            [("image", png())],
            LIMITS,
            400,
            "true_cfg_scale",
            "number",
        ),
        (
            {"prompt": "x", "strength": "2"},
            [("image", png())],
            LIMITS,
            400,
            "strength",
            "less than or equal to 1",
        ),
        (
            {"prompt": "x", "response_format": "url"},
            [("image", png())],
            LIMITS,
            400,
            "response_format",
            "only 'b64_json' is supported",
        ),
        (
            {"prompt": "x", "frobnicate": "1"},
            [("image", png())],
            LIMITS,
            400,
            "frobnicate",
            "unknown field",
        ),
        (
            {"prompt": "x", "quality": "high"},
            [("image", png())],
            LIMITS,
            400,
            "quality",
            "unknown field",
        ),
        (
            {"prompt": "x"},
            [("image", png()), ("extra", png())],
            LIMITS,
            400,
            "extra",
            "unknown field",
        ),
    ],
)
def test_each_bad_form_is_refused_naming_its_field(
    fields: dict[str, str],
    files: list[tuple[str, bytes]],
    limits: RouterLimits,
    status: int,
    param: str,
    needle: str,
) -> None:
    error = refusal(fields, files, limits)
    assert (error.status, error.param) == (status, param), error.message
    assert needle in error.message, error.message
    assert error.message.startswith(param), error.message


def test_a_field_given_twice_is_refused() -> None:
    error = _refused(*multipart([("prompt", "x"), ("n", "2"), ("n", "2")]))
    assert (error.status, error.param) == (400, "n")
    assert "more than once" in error.message


def _refused(content_type: str, body: bytes, limits: RouterLimits = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(content_type, body, limits, chunk=4096)
    return info.value


class _Stream:
    """Counts what the parser was fed before it refused."""

    def __init__(self, form: MultipartForm) -> None:
        self.form = form
        self.fed = 0

    def feed_all(self, body: bytes, chunk: int = 4096) -> RequestError:
        with pytest.raises(RequestError) as info:
            self._feed(body, chunk)
        return info.value

    def _feed(self, body: bytes, chunk: int) -> None:
        for start in range(0, len(body), chunk):
            self.form.feed(body[start : start + chunk])
            self.fed = start + chunk
        self.form.finish()


def test_an_image_over_the_bytes_limit_is_refused_while_it_streams_in() -> None:
    limits = RouterLimits(max_input_image_bytes=64 * 1024)
    content_type, body = multipart({"prompt": "x"}, [("image", b"\0" * (1024 * 1024))])
    stream = _Stream(edit_form(content_type, limits, BODIES.edits))
    error = stream.feed_all(body)
    assert (error.status, error.param) == (413, "image")
    assert "over 65536 bytes" in error.message
    assert stream.fed < 80 * 1024, "the parser must stop at the limit, not read the body"


def test_the_whole_body_and_each_text_field_are_bounded() -> None:
    limits = RouterLimits(max_body_bytes=32 * 1024)
    content_type, body = multipart({"prompt": "x"}, [("image", b"\0" * (64 * 1024))])
    error = _Stream(edit_form(content_type, limits, BODIES.edits)).feed_all(body)
    assert error.status == 413
    assert "the body is over the limit of 32768 bytes" in error.message
    # A text field is held to 4 bytes a prompt character: a long enough one never builds up.
    content_type, body = multipart({"prompt": "x", "user": "u" * (4 * 32_000 + 1)})
    error = _refused(content_type, body)
    assert (error.status, error.param) == (413, "user")


@pytest.mark.parametrize(
    ("content_type", "body", "status", "needle"),
    [
        ("application/json", b'{"prompt": "x"}', 415, "multipart/form-data"),
        ("", b"", 415, "multipart/form-data"),
        ("multipart/form-data", b"", 400, "boundary"),
        ("multipart/form-data; boundary=abc", b"--abc\r\nContent-Disposition: form-d", 400, "ends"),
        ("multipart/form-data; boundary=abc", b"garbage", 400, "not valid multipart"),
        (
            "multipart/form-data; boundary=abc",
            b"--abc\r\nContent-Type: text/plain\r\n\r\nx\r\n--abc--\r\n",
            400,
            "no name",
        ),
        (
            "multipart/form-data; boundary=abc",
            b'--abc\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n\xff\r\n--abc--\r\n',
            400,
            "UTF-8",
        ),
    ],
)
def test_bodies_that_are_not_a_form_are_refused(
    content_type: str, body: bytes, status: int, needle: str
) -> None:
    error = _refused(content_type, body)
    assert error.status == status, error.message
    assert needle in error.message, error.message


def test_generations_refuse_url_the_same_way() -> None:
    body = parse_body(BODIES.images, {"prompt": "x", "response_format": "url"})
    with pytest.raises(RequestError, match="only 'b64_json' is supported") as info:
        body.to_pipeline_request("g", LIMITS)
    assert info.value.param == "response_format"


def test_the_image_is_decoded_last() -> None:
    # A bad field is named even when the image is bad too: no decode before the checks.
    error = refusal({"prompt": "x", "n": "9"}, [("image", b"not an image")])
    assert error.param == "n"
