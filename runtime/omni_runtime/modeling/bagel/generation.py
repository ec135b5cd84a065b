"""BAGEL's image generation: the request's contexts, the flow, and guidance.

A request is an optional input image and a text. Its three contexts (BAGEL's TI2I):

- ``full``: the image (as VAE latent tokens through the generation expert, then as ViT
  tokens through the understanding expert), then the text;
- ``no_text`` (text dropped): the full context's image part, a prefix of it;
- ``no_image`` (image dropped): the text alone, at the start of its own context.

Text-to-image has no image: ``no_text`` is then empty and ``no_image`` equals ``full``.
Generation integrates the rectified flow from noise (t = 1) to the image (t = 0) on a
shifted schedule with Euler steps, three velocity evaluations per step where guidance is on.

The random draws are the reference's, in its order, from one generator: the VAE's sample of
each input image, then the initial noise. A request's ``seed`` therefore reproduces what
BAGEL's own inference code makes after ``torch.manual_seed(seed)`` on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from .config import MODEL_WEIGHTS, VAE_WEIGHTS, BagelShape, read_bagel_shape
from .model import BagelModel, ContextKV, SpecialTokens, unpatchify
from .vae import FluxVAE

RenormType = Literal["global", "channel", "text_channel"]
RENORM_TYPES: tuple[str, ...] = ("global", "channel", "text_channel")


@dataclass(frozen=True)
class GuidanceParams:
    """The flow's schedule and its classifier-free guidance. The defaults are BAGEL's for
    an edit (:func:`default_guidance` gives text-to-image's)."""

    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 2.0
    cfg_interval: tuple[float, float] = (0.0, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: RenormType = "text_channel"


def default_guidance(edit: bool) -> GuidanceParams:
    """BAGEL's defaults for an edit, or for text-to-image (no image guidance, guidance only
    for t in (0.4, 1], global renormalisation)."""
    if edit:
        return GuidanceParams()
    return GuidanceParams(cfg_img_scale=1.0, cfg_interval=(0.4, 1.0), cfg_renorm_type="global")


def timesteps(count: int, shift: float) -> Tensor:
    """``count`` times from 1 to 0, shifted towards 1 (``shift`` > 1 spends more steps at
    high noise): t' = s t / (1 + (s - 1) t)."""
    t = torch.linspace(1, 0, count)
    return shift * t / (1 + (shift - 1) * t)


def combine_guidance(
    v: Tensor,
    v_no_text: Tensor | None,
    v_no_image: Tensor | None,
    text_scale: float,
    image_scale: float,
    renorm: RenormType,
    renorm_min: float,
) -> Tensor:
    """The guided velocity from the full context's ``v`` and the text-dropped and
    image-dropped contexts' (None where that guidance is off). The result is rescaled so
    that its norm is at most ``v``'s (over everything for ``global``, per token for
    ``channel``; ``text_channel`` rescales the text-guided velocity per token before image
    guidance), by a factor no lower than ``renorm_min``."""
    if v_no_text is None:
        return v

    def ratio(num: Tensor, den: Tensor) -> Tensor:
        return (num / (den + 1e-8)).clamp(min=renorm_min, max=1.0)

    def norm(x: Tensor, per_token: bool) -> Tensor:
        # float32, as CUDA autocast computes a norm
        if per_token:
            return torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
        return torch.linalg.vector_norm(x.float())

    text_guided = v_no_text + text_scale * (v - v_no_text)
    if renorm == "text_channel":
        text_guided = text_guided * ratio(norm(v, True), norm(text_guided, True))
        if v_no_image is None:
            return text_guided
        return v_no_image + image_scale * (text_guided - v_no_image)
    guided = text_guided
    if v_no_image is not None:
        guided = v_no_image + image_scale * (text_guided - v_no_image)
    per_token = renorm == "channel"
    return guided * ratio(norm(v, per_token), norm(guided, per_token))


@dataclass(frozen=True)
class Contexts:
    full: ContextKV
    no_text: ContextKV
    no_image: ContextKV
    # The output's (height, width): the requested size, or the input image's.
    image_size: tuple[int, int]


class BagelGenerator:
    """A BAGEL checkpoint loaded for generation: the model, its VAE and its tokenizer."""

    def __init__(
        self, model: BagelModel, vae: FluxVAE, tokenizer: Any, tokens: SpecialTokens
    ) -> None:
        self.model = model
        self.vae = vae
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.shape: BagelShape = model.shape

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        vae_dtype: torch.dtype = torch.float32,
    ) -> BagelGenerator:
        from safetensors.torch import load_file
        from transformers import Qwen2Tokenizer

        root = Path(path)
        shape = read_bagel_shape(root)
        # Built without memory, then given the checkpoint's tensors, on the device and in
        # the dtype asked: the released model (~29 GB bf16) never sits in host memory in
        # float32, nor twice.
        with torch.device("meta"):
            model = BagelModel(shape)
        weights = load_file(str(root / MODEL_WEIGHTS), device=device)
        state = {name: tensor.to(dtype) for name, tensor in weights.items()}
        del weights
        model.load_state_dict(state, strict=True, assign=True)
        model.eval()
        vae = FluxVAE.load(root / VAE_WEIGHTS, shape.vae, vae_dtype, device)
        tokenizer = Qwen2Tokenizer.from_pretrained(str(root), local_files_only=True)
        return cls(model, vae, tokenizer, special_tokens(tokenizer))

    def max_side(self) -> int:
        """The largest height or width the latent position table covers."""
        return self.shape.max_latent_size * self.shape.latent_downsample

    def prepare_image(self, image: Any) -> Any:
        """:func:`prepare_image` for this checkpoint."""
        return prepare_image(image, self.shape)

    def skip_vae_sample(self, image: Any, generator: torch.Generator) -> None:
        """Draw from ``generator`` what encoding ``image`` (prepared) draws, the VAE's sample,
        for a request whose contexts were built elsewhere (the thinker): its next draw is
        then the initial noise, as in the reference."""
        vae_noise(image, self.shape, generator)

    def contexts(
        self,
        prompt: str,
        image: Any | None,
        height: int,
        width: int,
        generator: torch.Generator,
    ) -> Contexts:
        """The three contexts of a request; ``image`` (PIL) already :meth:`prepare_image`d.
        The output is ``height`` x ``width`` where given (0: not given; an edit then makes
        its input image's size)."""
        with torch.inference_mode():
            return self._contexts(prompt, image, height, width, generator)

    def _contexts(
        self, prompt: str, image: Any | None, height: int, width: int, generator: torch.Generator
    ) -> Contexts:
        model, tokens = self.model, self.tokens
        empty = ContextKV.empty(self.shape.llm, model.dtype, model.device)
        context = empty
        if image is not None:
            if not (height and width):
                width, height = image.size
            pixels = image_pixels(image, image.size).to(model.device)
            noise = vae_noise(image, self.shape, generator)
            latent = self.vae.encode(pixels, noise)
            context = model.extend_with_vae(context, latent, tokens)
            vit_size = self.shape.vit_transform.size_for(*image.size)
            context = model.extend_with_vit(
                context, image_pixels(image, vit_size).to(model.device), tokens
            )
        no_text = context
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        full = model.extend_with_text(context, ids, tokens)
        no_image = model.extend_with_text(empty, ids, tokens) if image is not None else full
        return Contexts(full, no_text, no_image, (height, width))

    def generate(
        self,
        contexts: Contexts,
        params: GuidanceParams,
        generator: torch.Generator,
        on_step: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """The image [H, W, 3] uint8 the flow makes from ``contexts``. ``on_step(i)`` runs
        before each step (an abort raises from it)."""
        with torch.inference_mode():
            latent = self.denoise(contexts, params, generator, on_step)
            return self.decode(latent, contexts.image_size)

    def denoise(
        self,
        contexts: Contexts,
        params: GuidanceParams,
        generator: torch.Generator,
        on_step: Callable[[int], None] | None = None,
    ) -> Tensor:
        """The final latent tokens [rows * cols, width] (float32)."""
        model, tokens = self.model, self.tokens
        height, width = contexts.image_size
        rows, cols = height // self.shape.latent_downsample, width // self.shape.latent_downsample
        x = torch.randn((rows * cols, self.shape.latent_token_width), generator=generator)
        x = x.to(model.device)
        times = timesteps(params.num_timesteps, params.timestep_shift)
        low, high = params.cfg_interval
        for i in range(len(times) - 1):
            if on_step is not None:
                on_step(i)
            t = float(times[i])
            guided = low < t <= high
            text_scale = params.cfg_text_scale if guided else 1.0
            image_scale = params.cfg_img_scale if guided else 1.0
            v = model.velocity(contexts.full, x, t, rows, cols, tokens)
            v_no_text = v_no_image = None
            if text_scale > 1.0:
                v_no_text = model.velocity(contexts.no_text, x, t, rows, cols, tokens)
            if image_scale > 1.0:
                v_no_image = model.velocity(contexts.no_image, x, t, rows, cols, tokens)
            v = combine_guidance(
                v,
                v_no_text,
                v_no_image,
                text_scale,
                image_scale,
                params.cfg_renorm_type,
                params.cfg_renorm_min,
            )
            x = x - v.to(x.device) * (times[i] - times[i + 1])
        return x

    def decode(self, latent: Tensor, image_size: tuple[int, int]) -> np.ndarray:
        height, width = image_size
        d, p = self.shape.latent_downsample, self.shape.latent_patch_size
        z = unpatchify(latent, height // d, width // d, p)
        image = self.vae.decode(z)
        # Truncated, not rounded, to 8 bits, as the reference converts it.
        pixels = ((image.float() * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8)
        return pixels.permute(1, 2, 0).cpu().numpy()  # type: ignore[no-any-return]


def plan(
    model: BagelModel, tokenizer: Any, tokens: SpecialTokens, context: ContextKV, max_tokens: int
) -> tuple[str, ContextKV]:
    """Think mode: the plan BAGEL writes after ``context`` (greedy, from <|im_start|>, at
    most ``max_tokens`` tokens with it, until <|im_end|>), and ``context`` followed by the
    plan as a text of its own, re-tokenized, as BAGEL's inference appends it."""
    generated: list[int] = []
    token, work = tokens.bos, context
    for _ in range(max_tokens):
        generated.append(token)
        logits, work = model.decode_step(work, token)
        token = int(logits.argmax())
        if token == tokens.eos:
            break
    decoded = tokenizer.decode(generated)
    bos, eos = tokenizer.convert_ids_to_tokens([tokens.bos, tokens.eos])
    text = decoded.split(eos)[0].split(bos)[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text, model.extend_with_text(context, ids, tokens)


# The last row of a plan's trailer ends with how many rows the trailer has, and its first
# values say how many bytes the text has: each a number in _DIGITS base-256 digits.
_DIGITS = 3


def _base256(number: int) -> list[int]:
    if not 0 <= number < 256**_DIGITS:
        raise ValueError(f"{number} does not fit {_DIGITS} base-256 digits")
    return [(number >> (8 * i)) & 0xFF for i in range(_DIGITS)]


def _number(digits: Sequence[float]) -> int:
    return sum(int(digit) << (8 * i) for i, digit in enumerate(digits))


def plan_trailer(text: str, width: int, like: torch.Tensor) -> torch.Tensor:
    """The rows, ``width`` wide and of ``like``'s dtype and device, that carry a plan's text
    after its context's rows: its length, then its UTF-8 bytes, one per value, padded with
    zeros; the last row's last values count the rows."""
    data = text.encode()
    values = [*_base256(len(data)), *data]
    count = -(-(len(values) + _DIGITS) // width)
    flat = torch.zeros(count * width, dtype=torch.float32)
    flat[: len(values)] = torch.tensor(values, dtype=torch.float32)
    flat[-_DIGITS:] = torch.tensor(_base256(count), dtype=torch.float32)
    return flat.view(count, width).to(dtype=like.dtype, device=like.device)


def split_plan_trailer(rows: torch.Tensor) -> tuple[torch.Tensor, str]:
    """``rows`` without the plan's trailer (:func:`plan_trailer`), and the plan's text."""
    count = _number(rows[-1, -_DIGITS:].tolist())
    flat = rows[-count:].reshape(-1).float()
    length = _number(flat[:_DIGITS].tolist())
    data = bytes(int(value) for value in flat[_DIGITS : _DIGITS + length].tolist())
    return rows[:-count], data.decode(errors="replace")


def prepare_image(image: Any, shape: BagelShape) -> Any:
    """An input image (PIL, RGB) resized as BAGEL's VAE transform resizes it: what its
    context holds, whatever size the edit is made at."""
    from PIL import Image

    target = shape.vae_transform.size_for(*image.size)
    if image.size != target:
        image = image.resize(target, Image.Resampling.BICUBIC)
    return image


def image_pixels(image: Any, size: tuple[int, int]) -> Tensor:
    """``image`` (PIL) at ``size`` (width, height) as [3, H, W] float32 in [-1, 1]."""
    from PIL import Image

    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1) * 2.0 - 1.0


def vae_noise(image: Any, shape: BagelShape, generator: torch.Generator | None) -> Tensor:
    """The noise the VAE's sample of ``image`` (prepared) takes, [1, z, H/8, W/8] float32,
    drawn from ``generator``: the first draw of a request's seed, as in the reference."""
    d = shape.vae.downsample
    size = (1, shape.vae.z_channels, image.height // d, image.width // d)
    return torch.randn(size, generator=generator, dtype=torch.float32)


def special_tokens(tokenizer: Any) -> SpecialTokens:
    """BAGEL's framing tokens in ``tokenizer``; ValueError naming one it lacks."""

    def find(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or found == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token} token, which BAGEL needs")
        return found

    return SpecialTokens(
        bos=find("<|im_start|>"),
        eos=find("<|im_end|>"),
        start_of_image=find("<|vision_start|>"),
        end_of_image=find("<|vision_end|>"),
    )
