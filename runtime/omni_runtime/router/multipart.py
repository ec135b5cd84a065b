"""``multipart/form-data`` bodies (OpenAI's image edits and video jobs), parsed chunk by
chunk as they arrive, every limit holding on the way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from omni_runtime.router.errors import RequestError
from omni_runtime.router.json_body import check_declared_length, first_error
from omni_runtime.router.limits import RouterLimits, body_too_large, image_too_large
from omni_runtime.router.media import too_many_images
from omni_runtime.router.request_fields import unknown_field

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks


@dataclass(frozen=True)
class FileParts:
    """The file parts a form takes: the names it may spell them by (one kind per form),
    the field its errors name, how many it takes at most, and whether one is required."""

    names: tuple[str, ...]
    field: str
    most: int
    required: bool


# A video's image to start from (image-to-video): OpenAI's form part.
INPUT_REFERENCE = FileParts(("input_reference",), "input_reference", 1, required=False)

_UNSUPPORTED_PARTS = {
    "mask": "inpainting masks are not supported here; send the image alone (all of it is "
    "edited, as far as strength says)",
}


class MultipartForm:
    """A ``multipart/form-data`` body (an image edit's, a video job's), parsed chunk by
    chunk as it arrives: its text fields as ``model``, its ``files``' bytes beside.

    Every limit holds while the body streams in, so nothing is held past its limit: the
    whole body at ``max_body_bytes`` (413), a file at ``max_input_image_bytes`` (413
    naming its field), a text field at 4 bytes (UTF-8's most) per character of
    ``max_prompt_chars`` (413 naming it); python-multipart bounds each part's headers. A
    file past the form's count, a mask, a field given twice or one that is not part of
    this API is refused (400 naming it) as soon as its part's headers arrive, before its
    data: so a form has at most one part per field, and as many files as it takes.
    """

    def __init__(
        self,
        content_type: str,
        limits: RouterLimits,
        model: type[BaseModel],
        files: FileParts,
    ) -> None:
        media, options = parse_options_header(content_type)
        if media != b"multipart/form-data":
            raise RequestError(
                415,
                f"Content-Type must be multipart/form-data (got {content_type or 'none'!r})",
            )
        boundary = options.get(b"boundary")
        if not boundary:
            raise RequestError(
                400, "Content-Type: multipart/form-data needs its boundary parameter"
            )
        self.limits = limits
        self.model = model
        self.files = files
        self.fields: dict[str, str] = {}
        self.images: list[bytes] = []
        # How the form spells its image parts (image, or image[] for a list).
        self._image_part: str | None = None
        self._max_field_bytes = 4 * limits.max_prompt_chars
        self._received = 0
        self._ended = False
        self._header = bytearray()
        self._value = bytearray()
        self._disposition = b""
        self._name = ""
        self._data = bytearray()
        callbacks: MultipartCallbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    def feed(self, chunk: bytes) -> None:
        """The body's next bytes; RequestError as soon as they break a limit or the format."""
        self._received += len(chunk)
        if self._received > self.limits.max_body_bytes:
            raise body_too_large(self.limits)
        try:
            self._parser.write(chunk)
        except FormParserError as e:
            raise RequestError(400, f"the body is not valid multipart/form-data: {e}") from None

    def finish(self) -> tuple[Any, list[bytes]]:
        """The validated fields (a ``model``) and the files' bytes, once the whole body is
        fed."""
        if not self._ended:
            raise RequestError(
                400, "the body is not valid multipart/form-data: it ends before its last boundary"
            )
        if self.files.required and not self.images:
            field = self.files.field
            raise RequestError(400, f"{field}: required (a file part named {field})", param=field)
        try:
            # Form fields are text: "2" is the integer 2 here, "abc" is not.
            request = self.model.model_validate_strings(self.fields)
        except ValidationError as e:
            raise first_error(e, self.model) from None
        return request, self.images

    # -- python-multipart's callbacks --------------------------------------------------

    def _part_begin(self) -> None:
        self._disposition = b""
        self._data = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._header = bytearray()
        self._value = bytearray()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        raw = options.get(b"name")
        if not raw:
            raise RequestError(
                400, 'a form part has no name (Content-Disposition: form-data; name="...")'
            )
        name = raw.decode("utf-8", errors="replace")
        label = name if len(name) <= 60 else name[:57] + "..."
        self._name = name
        files = self.files
        if name in files.names:
            if len(self.images) >= files.most:
                why = too_many_images(files.most)
                raise RequestError(400, f"{files.field}: {why}", param=files.field)
            if self._image_part not in (None, name):
                raise RequestError(
                    400,
                    f"{files.field}: give one file as {files.field} or a list as "
                    f"{files.field}[], not both",
                    param=files.field,
                )
            self._image_part = name
        elif name in _UNSUPPORTED_PARTS:
            raise RequestError(400, f"{name}: {_UNSUPPORTED_PARTS[name]}", param=name)
        elif name not in self.model.model_fields:
            raise RequestError(400, f"{label}: {unknown_field(name, self.model)}", param=label)
        elif name in self.fields:
            raise RequestError(400, f"{name}: given more than once", param=name)

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if len(self._data) + end - start > self._part_limit():
            if self._name in self.files.names:
                raise image_too_large(self.limits, self.files.field)
            raise RequestError(
                413, f"{self._name}: over {self._part_limit()} bytes", param=self._name
            )
        self._data += data[start:end]

    def _part_limit(self) -> int:
        if self._name in self.files.names:
            return self.limits.max_input_image_bytes
        return self._max_field_bytes

    def _part_end(self) -> None:
        if self._name in self.files.names:
            self.images.append(bytes(self._data))
            return
        try:
            self.fields[self._name] = self._data.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(400, f"{self._name}: not UTF-8 text", param=self._name) from None

    def _end(self) -> None:
        self._ended = True


async def read_form(
    request: Request, limits: RouterLimits, model: type[BaseModel], files: FileParts
) -> MultipartForm:
    """The request's multipart/form-data body as ``model`` with ``files``, parsed as it
    streams in, each limit enforced on the way (``MultipartForm``): nothing past a limit is
    read, let alone held."""
    form = MultipartForm(request.headers.get("content-type", ""), limits, model, files)
    check_declared_length(request, limits)
    async for chunk in request.stream():
        form.feed(chunk)
    return form
