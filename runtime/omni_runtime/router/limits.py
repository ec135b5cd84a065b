"""What one request may ask for (``RouterLimits``), and the checks of a request against
them: each excess is a 4xx whose message names the field and the limit."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omni_runtime.router.errors import RequestError


@dataclass(frozen=True)
class RouterLimits:
    """What one request may ask for; each excess is a 4xx naming the limit."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_prompt_chars: int = 32_000
    max_image_side: int = 2048
    max_steps: int = 200
    max_n: int = 4
    max_tokens: int = 8192
    max_input_image_bytes: int = 16 * 1024 * 1024
    max_input_image_pixels: int = 4096 * 4096
    # Far deeper than any body of this API (about 6 levels), far shallower than what
    # would exhaust a recursive validator or repr.
    max_json_nesting: int = 64
    # Requests in the router at once, and on one stage replica (a stage queues what it
    # cannot batch); beyond either, 429 with Retry-After.
    max_concurrent_requests: int = 256
    max_in_flight_per_replica: int = 64
    # How long a client may take to send its request, and leave the answer unread
    # (router.http_limits; past each, 408 or a close). A client sends its head in one write
    # as it connects: 10 s is a congested link's few retransmits, and a connection that
    # never sends one costs its descriptor for no longer. A body that moves no byte for
    # 30 s, or a response left unread as long, has lost ~5 TCP retransmits in a row (1+2+4+
    # 8+16 s). 64 KiB/s is 512 kbit/s, a slow uplink's rate: to hold every connection the
    # router allows, bodies at that rate take 256 Mbit/s, no slow client's bandwidth; a
    # body at the floor is done within 30 s + max_body_bytes / rate (9 min for 32 MiB).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    min_body_bytes_per_s: float = 64 * 1024
    send_timeout_s: float = 30.0
    # HTTP connections one router process holds; past it a 503 (the probes still
    # answered). Twice max_concurrent_requests leaves room for clients' idle kept-alive
    # connections, and with the rest of the router it stays below the 1024 descriptors
    # that a container's soft limit often is (containerd 2 leaves it at systemd's
    # 1024:524288; 1.x set 1048576).
    max_connections: int = 512
    # A video's frames: 10 s at 24 fps and a latent frame's worth more.
    max_video_frames: int = 245


def check_common(
    limits: RouterLimits,
    prompt_chars: int,
    n: int,
    steps: int | None,
    prompt_param: str = "messages",
) -> None:
    if prompt_chars > limits.max_prompt_chars:
        raise RequestError(
            400,
            f"prompt is {prompt_chars} characters; the limit is {limits.max_prompt_chars}",
            param=prompt_param,
        )
    if n > limits.max_n:
        raise RequestError(400, f"n: at most {limits.max_n} (got {n})", param="n")
    if steps is not None and steps > limits.max_steps:
        raise RequestError(
            400,
            f"num_inference_steps: at most {limits.max_steps} (got {steps})",
            param="num_inference_steps",
        )


def check_size(limits: RouterLimits, height: int | None, width: int | None) -> None:
    for name, value in (("height", height), ("width", width)):
        if value is not None and value > limits.max_image_side:
            raise RequestError(
                400, f"{name}: at most {limits.max_image_side} (got {value})", param=name
            )


_SIZE = re.compile(r"([1-9][0-9]*)x([1-9][0-9]*)")


def parse_size(size: str | None, limits: RouterLimits) -> tuple[int | None, int | None]:
    """``WIDTHxHEIGHT`` (OpenAI's order) -> (height, width); None: the stage's default."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise RequestError(
            400, f"size: expected WIDTHxHEIGHT such as 512x512, or auto (got {size!r})", "size"
        )
    width, height = int(match.group(1)), int(match.group(2))
    check_size(limits, height, width)
    return height, width


def image_too_large(limits: RouterLimits, where: str) -> RequestError:
    return RequestError(
        413, f"{where}: the image is over {_amount(limits.max_input_image_bytes)}", param=where
    )


def body_too_large(limits: RouterLimits) -> RequestError:
    return RequestError(413, f"the body is over the limit of {_amount(limits.max_body_bytes)}")


def _amount(size: int) -> str:
    mib = 1024 * 1024
    return f"{size // mib} MiB" if size >= mib and size % mib == 0 else f"{size} bytes"
