"""Chat messages (OpenAI's: text, image_url and input_audio content parts), and what a
stage takes of them: text for an LLM, the images decoded beside it, or (a thinker that hears)
a list of parts with the audio decoded at its processor's rate."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from omni_runtime.families.base import SpeechRecipe
from omni_runtime.router.body import Body
from omni_runtime.router.errors import RequestError
from omni_runtime.router.limits import RouterLimits
from omni_runtime.router.media import decode_audio, decode_data_url, too_many_images


class ImageURL(Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Body):
    data: str
    format: str


class InputAudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[TextPart | ImagePart | InputAudioPart, Field(discriminator="type")]


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


def flatten_messages(
    messages: list[ChatMessage], limits: RouterLimits, max_images: int
) -> tuple[list[dict[str, str]], list[np.ndarray]]:
    """Chat messages as the LLM stage takes them (text content), and the input images;
    RequestError for more than ``max_images`` of them, before any is decoded."""
    count = sum(
        isinstance(part, ImagePart)
        for message in messages
        if not isinstance(message.content, str)
        for part in message.content
    )
    if count > max_images:
        raise RequestError(400, f"messages: {too_many_images(max_images, count)}", "messages")
    flat: list[dict[str, str]] = []
    images: list[np.ndarray] = []
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            flat.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        for part_index, part in enumerate(message.content):
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, InputAudioPart):
                where = f"messages[{index}].content[{part_index}]"
                raise RequestError(400, f"{where}: this pipeline takes no audio", where)
            else:
                where = f"messages[{index}].content[{part_index}].image_url.url"
                images.append(decode_data_url(part.image_url.url, limits, where))
        flat.append({"role": message.role, "content": "\n".join(texts)})
    return flat, images


def hear_messages(
    messages: list[ChatMessage], speech: SpeechRecipe, limits: RouterLimits, max_images: int
) -> tuple[list[dict[str, Any]], list[np.ndarray], list[np.ndarray]]:
    """Chat messages as a thinker that hears and sees takes them (text, or a list of text,
    input_audio and image parts, their data taken out), the audio's samples, decoded at its
    processor's rate, and the images; RequestError naming the part for an image or audio
    that cannot be decoded."""
    flat: list[dict[str, Any]] = []
    audios: list[np.ndarray] = []
    images: list[np.ndarray] = []
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            flat.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        for part_index, part in enumerate(message.content):
            where = f"messages[{index}].content[{part_index}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, InputAudioPart):
                audios.append(
                    decode_audio(
                        part.input_audio.data,
                        part.input_audio.format,
                        sample_rate=speech.input_sample_rate,
                        max_seconds=speech.max_input_seconds,
                        where=f"{where}.input_audio",
                    )
                )
                parts.append({"type": "input_audio"})
            else:
                if len(images) >= max_images:
                    raise RequestError(400, f"messages: {too_many_images(max_images)}", "messages")
                images.append(decode_data_url(part.image_url.url, limits, f"{where}.image_url.url"))
                parts.append({"type": "image"})
        flat.append({"role": message.role, "content": parts})
    return flat, audios, images
