"""BAGEL's thinker on vLLM: a prompt in, the context's per-layer KV cache out.

A BAGEL thinker stage prefills a request's *context* (what the DiT's latent tokens attend
to) and hands the DiT its keys and values. vLLM 0.32's own ``BagelForConditionalGeneration``
serves only the understanding side, and its CPU attention kernel has no attention that is
full within an image span and causal elsewhere; its KV cache, where a KV connector could
read it, is paged in a layout that depends on the attention backend (on CPU, on the ISA).
So this model computes the context with :mod:`omni_runtime.modeling.bagel` (the same code
the DiT stage runs, equal to the reference's) and returns, as each prompt token's pooled
row, that token's keys and values in every layer: vLLM's pooling runner batches and
schedules the prefills, and the stage hands each request's rows to the DiT through the
pipeline's connector (``llm_frontend``).

It is attention-free as far as vLLM knows: no paged cache is allocated, every prompt is
prefilled whole in one step (the stage's engine configuration turns chunked prefill and
prefix caching off), and the prompts of one step are told apart by their positions, which
restart at 0 for each.

A prompt is the text as BAGEL frames it (``<|im_start|>text<|im_end|>``), after
``<|image_pad|>`` where an input image comes first. vLLM's multimodal processing
(:class:`BagelThinkerProcessor`) replaces that placeholder with the image's two spans, its
VAE tokens and then its ViT tokens, each framed by ``<|vision_start|>`` ``<|vision_end|>``;
:meth:`OmniBagelThinker.embed_multimodal` embeds both (the VAE's sample drawn with noise
from the request's seed, as the reference's first draw), and the forward runs each span as
BAGEL does: an image's tokens at one position, full attention among them, VAE tokens through
the generation expert; text causal, one position per token.

In think mode a request's rows are its context with the plan written into it, and then the
plan's text for the caller (BAGEL's ``interleave_inference`` returns ``[text, image]``):
a pooling model's rows are its only channel to the stage, so the text rides as trailing
rows (:func:`plan_trailer`), each of its UTF-8 bytes a value (0-255 is exact in bf16, and
in any float a cast may turn it into), and :class:`ContextHandOff` takes them off again.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.config.multimodal import MultiModalDummyOptions
from vllm.inputs import MultiModalDataDict
from vllm.model_executor.layers.pooler import DispatchPooler, Pooler
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.interfaces_base import VllmModelForPooling
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdateDetails,
)
from vllm.utils.torch_utils import set_default_torch_dtype

from omni_runtime.engine.models import THINK_TOKENS
from omni_runtime.modeling.bagel.config import BagelShape, read_bagel_shape
from omni_runtime.modeling.bagel.generation import (
    image_pixels,
    plan,
    plan_trailer,
    prepare_image,
    special_tokens,
    split_plan_trailer,
    vae_noise,
)
from omni_runtime.modeling.bagel.model import BagelModel, ContextKV, SpecialTokens, context_layout
from omni_runtime.modeling.bagel.vae import FluxVAE, build_autoencoder, diffusers_state_dict

# The prompt's one token per input image, which processing replaces with the image's spans.
IMAGE_PLACEHOLDER = "<|image_pad|>"
# Inside an image's first span: its VAE tokens (ViT tokens take IMAGE_PLACEHOLDER's id).
VAE_TOKEN = "<|vision_pad|>"


def kv_row_width(shape: BagelShape) -> int:
    """The width of one token's pooled row: keys then values, every layer."""
    llm = shape.llm
    return 2 * llm.num_layers * llm.num_kv_heads * llm.head_dim


def rows_from_context(context: ContextKV) -> torch.Tensor:
    """``context``'s keys and values as one row per token, [tokens, 2 * layers * heads * dim],
    each row laid out [2, layers, kv_heads, head_dim]."""
    kv = torch.stack([context.keys, context.values])  # [2, layers, tokens, heads, dim]
    return kv.permute(2, 0, 1, 3, 4).reshape(context.length, -1)


def _checkpoint_dir(model: str) -> str:
    if os.path.isdir(model):
        return model
    # vLLM has fetched a hub model into the local cache by the time it builds the model.
    from huggingface_hub import snapshot_download

    return str(snapshot_download(model, local_files_only=True))


@functools.lru_cache(maxsize=4)
def _shape(model: str) -> BagelShape:
    return read_bagel_shape(_checkpoint_dir(model))


def image_token_counts(shape: BagelShape, width: int, height: int) -> tuple[int, int]:
    """(VAE tokens, ViT tokens) of an input image of this size, after BAGEL's transforms."""
    vae_w, vae_h = shape.vae_transform.size_for(width, height)
    d = shape.latent_downsample
    vit_w, vit_h = shape.vit_transform.size_for(vae_w, vae_h)
    p = shape.vit.patch_size
    return (vae_h // d) * (vae_w // d), (vit_h // p) * (vit_w // p)


class BagelThinkerProcessingInfo(BaseProcessingInfo):  # type: ignore[misc]
    @property
    def shape(self) -> BagelShape:
        return _shape(self.ctx.model_config.model)

    @functools.cached_property
    def tokens(self) -> SpecialTokens:
        return special_tokens(self.get_tokenizer())

    def token_id(self, token: str) -> int:
        found: int = self.get_tokenizer().convert_tokens_to_ids(token)
        return found

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        # BAGEL's edit reads one input image.
        return {"image": 1}

    def largest_image(self) -> tuple[int, int]:
        side = self.shape.vae_transform.max_size
        return side, side

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        vae, vit = image_token_counts(self.shape, *self.largest_image())
        return {"image": vae + vit + 4}


class BagelThinkerDummyInputs(BaseDummyInputsBuilder[BagelThinkerProcessingInfo]):  # type: ignore[misc]
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: MultiModalDummyOptions,
    ) -> MultiModalDataDict:
        width, height = self.info.largest_image()
        images = self._get_dummy_images(
            width=width,
            height=height,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}


class BagelThinkerProcessor(BaseMultiModalProcessor[BagelThinkerProcessingInfo]):  # type: ignore[misc]
    """An input image's pixels for both towers and its VAE sample's noise.

    ``mm_processor_kwargs``: ``seed`` (the request's: the noise is its first draw, as the
    reference draws the VAE's sample first). The image is resized by BAGEL's transforms
    alone: the size an edit is made at is the DiT's business, not its context's."""

    def _hf_processor_applies_updates(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        shape = self.info.shape
        seed = hf_kwargs.get("seed")
        generator = torch.Generator()
        if isinstance(seed, int):
            generator.manual_seed(seed)
        else:
            generator.seed()
        vae_pixels, vit_pixels, noises = [], [], []
        images = hf_data.get("images") or []
        assert isinstance(images, Sequence)
        for picture in images:
            image = prepare_image(picture.convert("RGB"), shape)
            vae_pixels.append(image_pixels(image, image.size))
            vit_pixels.append(image_pixels(image, shape.vit_transform.size_for(*image.size)))
            noises.append(vae_noise(image, shape, generator))
        return BatchFeature(
            {"vae_pixels": vae_pixels, "vit_pixels": vit_pixels, "vae_noise": noises}
        )

    def _get_mm_fields_config(
        self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return {
            name: MultiModalFieldConfig.batched("image")
            for name in ("vae_pixels", "vit_pixels", "vae_noise")
        }

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[PromptReplacement]:
        info = self.info
        tokens = info.tokens
        placeholder, vae_token = info.token_id(IMAGE_PLACEHOLDER), info.token_id(VAE_TOKEN)

        def spans(index: int) -> PromptUpdateDetails:
            item = out_mm_kwargs["image"][index]
            vae_pixels = item["vae_pixels"].data
            vit_pixels = item["vit_pixels"].data
            d, p = info.shape.latent_downsample, info.shape.vit.patch_size
            vae = (vae_pixels.shape[1] // d) * (vae_pixels.shape[2] // d)
            vit = (vit_pixels.shape[1] // p) * (vit_pixels.shape[2] // p)
            start, end = tokens.start_of_image, tokens.end_of_image
            ids = [start, *[vae_token] * vae, end, start, *[placeholder] * vit, end]
            return PromptUpdateDetails.select_token_ids(ids, [vae_token, placeholder])

        return [PromptReplacement(modality="image", target=[placeholder], replacement=spans)]


class ContextRowsPooler(Pooler):  # type: ignore[misc]
    """Each prompt's rows as the forward made them (no head: neither vLLM's float32 cast of
    pooled rows nor a normalisation touches the cache); a request in think mode gets the
    rows of its context with the plan in it (:meth:`OmniBagelThinker.planned`)."""

    def __init__(self, planned: Any) -> None:
        super().__init__()
        self._planned = planned

    def get_supported_tasks(self) -> set[str]:
        return {"token_embed"}

    def forward(self, hidden_states: torch.Tensor, pooling_metadata: Any) -> list[torch.Tensor]:
        lengths = pooling_metadata.prompt_lens.tolist()
        rows = list(hidden_states.split(lengths))
        for index, params in enumerate(pooling_metadata.pooling_params):
            think = (params.extra_kwargs or {}).get(THINK_TOKENS)
            if think:
                rows[index] = self._planned(index, int(think))
        return rows


@MULTIMODAL_REGISTRY.register_processor(
    BagelThinkerProcessor,
    info=BagelThinkerProcessingInfo,
    dummy_inputs=BagelThinkerDummyInputs,
)
class OmniBagelThinker(nn.Module, VllmModelForPooling, SupportsMultiModal):  # type: ignore[misc]
    """BAGEL's context prefill as a vLLM pooling model (token_embed: one row per token)."""

    is_pooling_model: ClassVar[bool] = True
    is_attention_free: ClassVar[bool] = True
    # The forward tells text from image spans by the token ids under the embeddings.
    requires_raw_input_tokens: ClassVar[bool] = True

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return IMAGE_PLACEHOLDER
        raise ValueError(f"BAGEL's thinker reads images, not {modality}")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        model_config = vllm_config.model_config
        root = _checkpoint_dir(model_config.model)
        self.shape = _shape(model_config.model)
        # Built in vLLM's default dtype and device (set around this call), then loaded.
        self.bagel = BagelModel(self.shape)
        # The VAE encodes an input image in float32, as the DiT stage's does.
        with set_default_torch_dtype(torch.float32):
            self.vae_model = build_autoencoder(self.shape.vae)
        self.vae = FluxVAE(self.vae_model, self.shape.vae)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        self.tokenizer = tokenizer
        self.tokens = special_tokens(tokenizer)
        self.vae_token = int(tokenizer.convert_tokens_to_ids(VAE_TOKEN))
        self.pooler = DispatchPooler({"token_embed": ContextRowsPooler(self.planned)})
        # The contexts of the step that ran last, in its order, for think mode's plans.
        self._step_contexts: list[ContextKV] = []

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Any = None,
        *,
        is_multimodal: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        embeddings: torch.Tensor = self.bagel.language_model.model.embed_tokens(input_ids)
        if (
            multimodal_embeddings is None
            or is_multimodal is None
            or len(multimodal_embeddings) == 0
        ):
            return embeddings
        merged = torch.cat([e.to(embeddings.dtype) for e in multimodal_embeddings])
        embeddings[is_multimodal] = merged
        return embeddings

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        """Per image, its VAE tokens then its ViT tokens, embedded."""
        vae_pixels = kwargs.get("vae_pixels")
        if vae_pixels is None:
            return []
        vit_pixels, noises = kwargs["vit_pixels"], kwargs["vae_noise"]
        assert isinstance(vae_pixels, list | tuple | torch.Tensor)
        embedded = []
        for pixels, vit, noise in zip(vae_pixels, vit_pixels, noises, strict=True):  # type: ignore[call-overload]
            latent = self.vae.encode(pixels.to(self.bagel.device), noise)
            embedded.append(
                torch.cat([self.bagel.vae_embeddings(latent), self.bagel.vit_embeddings(vit)])
            )
        return embedded

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Each prompt's context rows, the prompts one after another as vLLM laid them out."""
        if input_ids is None:
            raise ValueError("the BAGEL thinker reads token ids (no prompt embeddings)")
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        n = int(input_ids.shape[0])
        starts = (positions == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            # Not a whole prompt: only vLLM's own warm-up passes make these.
            starts = [0, *starts]
        bounds = [*starts, n]
        contexts = [
            self._context(input_ids[begin:end].tolist(), inputs_embeds[begin:end])
            for begin, end in itertools.pairwise(bounds)
        ]
        self._step_contexts = contexts
        if not contexts:
            return torch.empty(0, kv_row_width(self.shape))
        return torch.cat([rows_from_context(context) for context in contexts])

    def planned(self, index: int, max_tokens: int) -> torch.Tensor:
        """The rows of the step's ``index``-th context followed by its plan (think mode),
        and then the plan's text (:func:`plan_trailer`)."""
        text, context = plan(
            self.bagel, self.tokenizer, self.tokens, self._step_contexts[index], max_tokens
        )
        rows = rows_from_context(context)
        return torch.cat([rows, plan_trailer(text, rows.shape[1], rows)])

    def _context(self, ids: list[int], x: torch.Tensor) -> ContextKV:
        """The context of one prompt: its text runs and image spans in order."""
        bagel, tokens = self.bagel, self.tokens
        context = ContextKV.empty(self.shape.llm, bagel.dtype, bagel.device)
        index = 0
        while index < len(ids):
            if ids[index] == tokens.start_of_image and tokens.end_of_image in ids[index:]:
                end = ids.index(tokens.end_of_image, index) + 1
                latent = end - index > 2 and ids[index + 1] == self.vae_token
                context = bagel.extend_with_image(context, x[index:end], latent=latent)
            else:
                end = index + 1
                while end < len(ids) and ids[end] != tokens.start_of_image:
                    end += 1
                context = bagel.extend_with_text_embeddings(context, x[index:end])
            index = end
        return context

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors by their own names: BAGEL's (``ema.safetensors``) and
        the VAE's in Black Forest Labs' names (``ae.safetensors``)."""
        params = {f"bagel.{name}": p for name, p in self.bagel.named_parameters()}
        params.update({f"vae_model.{name}": p for name, p in self.vae_model.named_parameters()})
        levels = len(self.shape.vae.ch_mult)
        loaded: set[str] = set()
        for name, weight in weights:
            target_name = f"bagel.{name}"
            if target_name not in params and "." in name:
                ((vae_name, weight),) = diffusers_state_dict({name: weight}, levels).items()
                target_name = f"vae_model.{vae_name}"
            target = params.get(target_name)
            if target is None:
                continue
            with torch.no_grad():
                target.copy_(weight.to(target.dtype))
            loaded.add(target_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} of BAGEL's weights (first: {missing[0]})"
            )
        return loaded


class ContextHandOff:
    """What a thinker stage hands BAGEL's DiT for one request: its pooled rows (a token's
    keys and values per row) as the context KV ``[2, layers, tokens, kv_heads, head_dim]``
    (keys first), and the context's layout as the hand-off's meta: the RoPE position the
    next token takes (``rope``) and where the text-dropped context inside it ends
    (``prefix_length`` tokens, ``prefix_rope``); and in think mode the plan's text, for
    the caller."""

    def __init__(self, model: str, tokenizer: Any) -> None:
        llm = _shape(model).llm
        self._kv_shape = (llm.num_layers, llm.num_kv_heads, llm.head_dim)
        self._tokens = special_tokens(tokenizer)

    def __call__(
        self, rows: torch.Tensor, prompt_token_ids: Sequence[int], prompt_length: int
    ) -> tuple[torch.Tensor, dict[str, int], str]:
        """``prompt_length``: how many of the context's last tokens are its prompt. Returns
        the KV, its meta and the plan's text ("" for a request that did not think)."""
        text = ""
        if rows.shape[0] > len(prompt_token_ids):
            # Think mode: the plan's rows, and after them its text.
            rows, text = split_plan_trailer(rows)
        layout = context_layout(prompt_token_ids, self._tokens, prompt_length)
        # Rows past the prompt's are think mode's plan: text, a position each.
        rope = layout.rope + rows.shape[0] - len(prompt_token_ids)
        layers, kv_heads, head_dim = self._kv_shape
        # Reordered as the connector copies it in (one copy, no intermediate array).
        kv = rows.view(rows.shape[0], 2, layers, kv_heads, head_dim).permute(1, 2, 0, 3, 4)
        meta = {
            "rope": rope,
            "prefix_length": layout.prefix_length,
            "prefix_rope": layout.prefix_rope,
        }
        return kv, meta, text
