"""What a pipeline serves, and where: each endpoint asks once, as its routes are built.

A pipeline answers with one kind of output (its orchestrator's ``output_kind``: text,
images, videos, or text spoken too), and its model family says whether its DiT takes an
input image and whether it makes nothing without one. From those follow the paths that
serve it (and that its OpenAPI document lists), and, for every other path, a refusal that
says what this pipeline serves and where to ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_runtime.config import PipelineConfig
from omni_runtime.router.errors import RequestError
from omni_runtime.router.orchestrator import OutputKind

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
VIDEOS = "/v1/videos"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"

_IMAGE_CHAT = f'{CHAT} with modalities ["image"]'


@dataclass(frozen=True)
class Served:
    """One pipeline's outputs, and the paths that ask for them."""

    output: OutputKind
    # Whether its DiT takes an input image (edits, image to video), and whether it makes
    # nothing without one (an edit family; an image-to-video one).
    takes_image: bool = False
    requires_image: bool = False

    @classmethod
    def of(cls, pipeline: PipelineConfig, output: OutputKind) -> Served:
        family = pipeline.family_recipe
        if output not in ("image", "video"):
            return cls(output)
        # A pipeline of no family may edit (its diffusers pipeline's image-to-image
        # variant, which only its stage knows of).
        takes = family is None or family.dit.takes_image
        return cls(output, takes, family is not None and family.dit.requires_image)

    @property
    def paths(self) -> frozenset[str]:
        """The POST paths that serve this pipeline's requests."""
        match self.output:
            case "text":
                return frozenset((CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE))
            case "speech":
                return frozenset((CHAT,))
            case "video":
                return frozenset((VIDEOS,))
            case "image":
                paths = {CHAT}
                if not self.requires_image:
                    paths.add(GENERATIONS)
                if self.takes_image:
                    paths.add(EDITS)
                return frozenset(paths)

    def serves(self, path: str) -> bool:
        return path in self.paths

    @property
    def makes(self) -> str:
        """What this pipeline answers with, as a sentence's predicate."""
        match self.output:
            case "text":
                return "answers with text"
            case "speech":
                return "answers with text, spoken too where a chat completion asks for audio"
            case "video":
                return "makes videos (jobs)"
            case "image":
                if self.requires_image:
                    return "edits an input image"
                return "makes images"

    @property
    def where(self) -> str:
        """Where to ask this pipeline for its outputs."""
        match self.output:
            case "text":
                return f"use {CHAT} or {COMPLETIONS}"
            case "speech":
                return f'use {CHAT} (modalities ["text", "audio"] for a spoken answer)'
            case "video":
                return f"use POST {VIDEOS} (OpenAI's Videos API)"
            case "image":
                if self.requires_image:
                    return f"use {EDITS}, or {_IMAGE_CHAT} and the image in a message"
                if self.takes_image:
                    return f"use {GENERATIONS}, {EDITS} or {_IMAGE_CHAT}"
                return f"use {GENERATIONS} or {_IMAGE_CHAT}"

    def elsewhere(self, path: str, param: str | None = None) -> RequestError:
        """The refusal of a request at ``path``, which does not serve this pipeline."""
        return RequestError(
            400, f"{path} does not serve this pipeline: it {self.makes}; {self.where}", param
        )

    def require(self, path: str, param: str | None = None) -> None:
        """Refuse a request at ``path`` unless it serves this pipeline."""
        if not self.serves(path):
            raise self.elsewhere(path, param)
