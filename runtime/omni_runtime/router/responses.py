"""What every endpoint answers with: JSON bodies encoded with orjson, and Server-Sent Events
(a streamed completion's chunks, an image stream's events) released however they end."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import orjson
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from omni_runtime.engine.stage.stage_core_types import StageServerOutput
from omni_runtime.images import encode_png


class JSONBody(Response):
    """A JSON response encoded with orjson (numpy-free bodies only)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(final: StageServerOutput) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def sse(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ChunkWriter:
    """The SSE frames of one streamed completion: chat (``chat.completion.chunk``: an
    opening frame with the role, then ``delta``s) or text (``text_completion``: ``text``).

    Only the text and finish reason change from chunk to chunk, so the rest of the frame
    is encoded once; per token the router encodes a few dozen bytes.
    """

    def __init__(self, request_id: str, model: str, kind: str) -> None:
        self.head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        self._chat = kind == "chat.completion.chunk"
        self._prefix = b"data: " + orjson.dumps(self.head)[:-1] + b',"choices":[{"index":0,'
        self._suffix = b"}]}\n\n"

    def opening(self) -> bytes | None:
        if not self._chat:
            return None
        return self._frame(b'"delta":{"role":"assistant","content":""}', None)

    def text(self, text: str, finish_reason: str | None) -> bytes:
        if self._chat:
            delta = orjson.dumps({"content": text} if text else {})
            return self._frame(b'"delta":' + delta, finish_reason)
        return self._frame(b'"text":' + orjson.dumps(text) + b',"logprobs":null', finish_reason)

    def delta(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        """A chat chunk whose delta is ``delta`` (a spoken answer's audio)."""
        return self._frame(b'"delta":' + orjson.dumps(delta), finish_reason)

    def usage(self, usage: dict[str, int]) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage})

    def _frame(self, body: bytes, finish_reason: str | None) -> bytes:
        return (
            self._prefix + body + b',"finish_reason":' + orjson.dumps(finish_reason) + self._suffix
        )


class StreamWithCleanup(StreamingResponse):
    """An SSE response that releases its request however the response ends."""

    def __init__(
        self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def png_base64(images: np.ndarray | None) -> list[str]:
    """Each image as a base64 PNG (milliseconds each: call off the event loop)."""
    if images is None:
        return []
    return [base64.b64encode(encode_png(image)).decode("ascii") for image in images]
