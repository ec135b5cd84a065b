"""schemathesis hooks for test_openapi_fuzz.py, loaded by its `schemathesis run` child
(SCHEMATHESIS_HOOKS names this file): a check that every error is OpenAI-shaped, and the
rules of valid requests that no JSON schema can state.
"""

from __future__ import annotations

import base64
import io
import json
import os
from typing import Any

import numpy as np
import schemathesis
from PIL import Image
from schemathesis import GenerationMode

# The router's prompt limit holds for all messages together; the schema can bound each.
MAX_PROMPT_CHARS = int(os.environ["FUZZ_MAX_PROMPT_CHARS"])
# Each message costs a few tokens of the chat template besides its text: enough of them
# would overflow the tiny model's context, which only the model's tokenizer can tell.
MAX_MESSAGES = int(os.environ["FUZZ_MAX_MESSAGES"])


# Token ids the model has (a stop token past them is refused by vLLM's checks in the stage).
VOCAB_SIZE = int(os.environ["FUZZ_VOCAB_SIZE"])
MAX_TOKENS = int(os.environ["FUZZ_MAX_TOKENS"])
# The DiT's loaded pipeline makes heights and widths of this multiple (the router, which
# loads none, cannot know it); 1 for a text pipeline.
SIZE_MULTIPLE = int(os.environ["FUZZ_SIZE_MULTIPLE"])
# How many input images a valid request here carries at most: a schema cannot count image
# parts across messages (the family's limit), and the fuzz keeps to fewer where each costs
# the DiT seconds.
MAX_IMAGES = int(os.environ.get("FUZZ_MAX_IMAGES", "0"))
# The pipeline fuzzed (test_openapi_fuzz.Fuzzed.name): some DiTs have rules of their own.
PIPELINE = os.environ.get("FUZZ_PIPELINE", "")
_TEXT_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
_IMAGE_PATHS = ("/v1/chat/completions", "/v1/images/generations", "/v1/images/edits")
# A video pipeline's clip: frames of 1 + 4k (its VAE's) up to this many (the fuzz's limit),
# at the family's 24 fps unless a request gives another.
MAX_VIDEO_FRAMES = int(os.environ.get("FUZZ_MAX_VIDEO_FRAMES", "0"))
VIDEO_FPS = 24


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Requests within the rules no schema states; everything else as is."""
    if not isinstance(case.body, dict):
        return True
    if case.operation.path in _IMAGE_PATHS and _positive(case) and not _sizes_valid(case.body):
        return False
    if _positive(case) and _image_parts(case.body) > MAX_IMAGES:
        return False
    files = case.body.get("image[]")
    if _positive(case) and isinstance(files, list) and len(files) > MAX_IMAGES:
        return False
    if PIPELINE == "bagel" and _positive(case) and not _bagel_valid(case.body):
        return False
    if case.operation.path == "/v1/videos" and _positive(case) and case.method == "POST":
        return _sizes_valid(case.body) and _clip_valid(case.body)
    if case.operation.path not in _TEXT_PATHS:
        return True
    body = case.body
    # In every mode: a negative case's mutation may leave the body valid but for a token
    # id the model lacks, which the stage then refuses as it should (the schema cannot know
    # the vocabulary).
    if not _in_vocabulary(body.get("tokens")) or not _in_vocabulary(body.get("stop_token_ids")):
        return False
    if not _positive(case):
        return True
    if case.operation.path == "/tokenize" and (body.get("prompt") is None) == (
        body.get("messages") is None
    ):
        return False  # exactly one of the two
    if not _sampling_valid(body):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    return len(messages) <= MAX_MESSAGES and _prompt_chars(messages) <= MAX_PROMPT_CHARS


def _bagel_valid(body: dict[str, Any]) -> bool:
    """BagelParams' rules that no schema states (its DiT checks them, and names the field):
    a schedule of at least one step (2 points), height and width together, one guidance
    scale by one of its two names, and cfg_interval's low below its high."""
    steps = body.get("num_inference_steps")
    if _number(steps) and steps < 2:
        return False
    if (body.get("height") is None) != (body.get("width") is None):
        return False
    if body.get("guidance_scale") is not None and body.get("cfg_text_scale") is not None:
        return False
    interval = body.get("cfg_interval")
    if isinstance(interval, list) and len(interval) == 2 and all(map(_number, interval)):
        return bool(interval[0] < interval[1])
    return True


def _image_parts(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(
        isinstance(part, dict) and part.get("type") == "image_url"
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


_PNG_DATA_URL = "data:image/png;base64," + base64.b64encode(_png(0)).decode()


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    """A valid request's input images are images: a schema can only say "a string" of a data
    URL and "bytes" of a file, and random ones are (rightly) refused as unreadable."""
    if not _positive(case) or not isinstance(case.body, dict):
        return case
    body = case.body
    if case.operation.path == "/v1/videos" and "input_reference" in body:
        body["input_reference"] = _png(2)
    if case.operation.path == "/v1/images/edits":
        if isinstance(body.get("image"), bytes | str):
            body["image"] = _png(1)
        if isinstance(body.get("image[]"), list):
            body["image[]"] = [_png(n) for n in range(len(body["image[]"]))]
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            for part in message["content"]:
                if isinstance(part, dict) and isinstance(part.get("image_url"), dict):
                    part["image_url"]["url"] = _PNG_DATA_URL
    return case


def _positive(case: schemathesis.Case) -> bool:
    """Whether ``case`` is meant to be valid (and so accepted)."""
    return case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE


def _sizes_valid(body: dict[str, Any]) -> bool:
    """The image's height and width (chat's fields, or the images API's WIDTHxHEIGHT) are
    sizes the DiT makes."""
    sides = [body.get("height"), body.get("width")]
    size = body.get("size")
    if isinstance(size, str) and "x" in size:
        sides += size.split("x")
    return all(side is None or side % SIZE_MULTIPLE == 0 for side in map(_side, sides))


def _clip_valid(body: dict[str, Any]) -> bool:
    """The clip's frames (``num_frames``, else ``seconds`` at ``fps``) are 1 + 4k and
    within the limit: rules of the video VAE and of the router's limit on the frames that
    ``seconds`` asks for, which the schema cannot state (seconds is OpenAI's string)."""
    try:
        seconds = float(body.get("seconds", "4"))
    except (TypeError, ValueError):
        return False
    if not 0 < seconds < 1e6:
        return False
    frames = body.get("num_frames")
    if frames is None:
        fps = body.get("fps", VIDEO_FPS)
        if not isinstance(fps, int):
            return False
        frames = 1 + 4 * max(1, round((seconds * fps - 1) / 4))
    return isinstance(frames, int) and (frames - 1) % 4 == 0 and frames <= MAX_VIDEO_FRAMES


def _side(value: Any) -> int | None:
    """A side as the router reads it (an integral float is the integer), else None."""
    if isinstance(value, str):
        return int(value) if value.isdigit() else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value) if float(value).is_integer() else None
    return None


def _in_vocabulary(token_ids: Any) -> bool:
    # An integral float (41128.0) is the integer to the router, as JSON has it.
    return not isinstance(token_ids, list) or all(
        not isinstance(t, int | float) or t < VOCAB_SIZE for t in token_ids
    )


def _sampling_valid(body: dict[str, Any]) -> bool:
    """vLLM's rule that ties two fields together."""
    min_tokens = body.get("min_tokens")
    # Without max_tokens, a completion makes 16 tokens (OpenAI's default) and a chat
    # completion up to the router's limit; min_tokens may not ask for more.
    default = 16 if "messages" not in body else MAX_TOKENS
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default
    # An integral float (8.0) is the integer to the router, as JSON has it.
    if _number(min_tokens) and _number(max_tokens):
        return bool(min_tokens <= max_tokens)
    return True


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _prompt_chars(messages: list[dict[str, Any]]) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            # The router joins a message's parts with newlines.
            total += sum(len(part.get("text", "")) for part in content)
            total += max(0, len(content) - 1)
    return total


@schemathesis.check
def openai_error_shape(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """Every 4xx/5xx body, and every error inside an event stream, is
    ``{"error": {"message": str, "type": str, "param": str | null, "code": int}}`` with the
    response's status as its code; a text stream ends with [DONE], an image stream with its
    completed event."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)
        except ValueError:
            raise AssertionError(
                f"a {response.status_code} whose body is not JSON: {response.content[:200]!r}"
            ) from None
        _check_error(body, response.status_code)
    elif content_type.startswith("text/event-stream"):
        # An event's data line (an image stream's events have an event line first).
        events = [
            line.removeprefix("data: ")
            for block in response.content.decode().split("\n\n")
            for line in block.split("\n")
            if line.startswith("data: ")
        ]
        if case.path.startswith("/v1/images/"):
            # OpenAI's image stream ends with the image (or an error), not [DONE].
            last = json.loads(events[-1]) if events else {}
            if "error" not in last and not str(last.get("type", "")).endswith(".completed"):
                raise AssertionError(f"the image stream does not end with the image: {last!r}")
        elif not events or events[-1] != "[DONE]":
            raise AssertionError(f"the stream does not end with [DONE]: {events[-3:]!r}")
        for event in events:
            if event == "[DONE]":
                continue
            payload = json.loads(event)
            if "error" in payload:
                _check_error(payload, None)
    return None


def _check_error(body: Any, status: int | None) -> None:
    error = body.get("error") if isinstance(body, dict) else None
    shape_ok = (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["message"], str)
        and error["message"] != ""
        and isinstance(error["type"], str)
        and (error["param"] is None or isinstance(error["param"], str))
        and isinstance(error["code"], int)
    )
    if not shape_ok:
        raise AssertionError(f"not an OpenAI-shaped error: {body!r:.300}")
    if status is not None and error["code"] != status:
        raise AssertionError(f"error code {error['code']} in a {status} response")
