"""BAGEL's model: one Qwen2 decoder whose every layer holds two experts.

BAGEL (Deng et al., "Emerging Properties in Unified Multimodal Pretraining", 2025) is a
Mixture-of-Transformers: each decoder layer has an understanding expert (the Qwen2 layer:
attention projections, q/k norms, MLP, layer norms) and a generation expert of the same
shape (the ``*_moe_gen`` weights). Text and ViT tokens go through the first, VAE latent
tokens through the second, and all of them attend to each other in one shared attention.
Every token of one image shares one RoPE position; within an image attention is full, across
text it is causal.

A request's *context* is the key/value cache of everything before the image to generate
(:class:`ContextKV`); generation runs the latent tokens, non-causally, against it, through
the generation expert (:meth:`BagelModel.velocity`). Module and parameter names are the
checkpoint's (``ema.safetensors``), so the released weights load as they are.

Precision follows the reference: weights in the model's dtype (bf16 for the released
checkpoint); the generation expert's q/k norms and RoPE in float32; attention on the
model's dtype; positional tables and timestep frequencies computed in float64/float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import BagelShape, LLMShape, ViTShape

TIMESTEP_FREQUENCIES = 256


@dataclass(frozen=True)
class SpecialTokens:
    """The token ids BAGEL frames text and images with."""

    bos: int  # <|im_start|>: before each text
    eos: int  # <|im_end|>: after each text
    start_of_image: int  # <|vision_start|>
    end_of_image: int  # <|vision_end|>


@dataclass(frozen=True)
class ContextLayout:
    """Where a context's RoPE positions stand: after it (``rope``), and after what comes
    before its prompt (``prefix_length`` tokens, ``prefix_rope``): the text-dropped context."""

    rope: int
    prefix_length: int
    prefix_rope: int


def rope_after(ids: Sequence[int], tokens: SpecialTokens) -> int:
    """The RoPE position after ``ids``: each image span (<|vision_start|> through
    <|vision_end|>) takes one position, each other token one of its own."""
    rope = 0
    inside = False
    for token in ids:
        if token == tokens.start_of_image:
            inside = True
        elif not inside:
            rope += 1
        if inside and token == tokens.end_of_image:
            inside = False
            rope += 1
    return rope


def context_layout(ids: Sequence[int], tokens: SpecialTokens, prompt_length: int) -> ContextLayout:
    """The layout of a context made of ``ids`` whose last ``prompt_length`` tokens are its
    prompt: BAGEL's text-dropped context drops the prompt alone, keeping what precedes it (a
    system prompt, the input image)."""
    prefix = len(ids) - prompt_length
    return ContextLayout(rope_after(ids, tokens), prefix, rope_after(ids[:prefix], tokens))


@dataclass(frozen=True)
class ContextKV:
    """The key/value cache of a request's context: per layer, every context token's key
    (after its q/k norm and RoPE) and value, ``[layers, tokens, kv_heads, head_dim]``, and
    the RoPE position the next token takes."""

    keys: Tensor
    values: Tensor
    rope: int

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @staticmethod
    def empty(shape: LLMShape, dtype: torch.dtype, device: torch.device) -> ContextKV:
        size = (shape.num_layers, 0, shape.num_kv_heads, shape.head_dim)
        return ContextKV(
            torch.empty(size, dtype=dtype, device=device),
            torch.empty(size, dtype=dtype, device=device),
            rope=0,
        )

    def extended(self, keys: Tensor, values: Tensor, rope: int) -> ContextKV:
        return ContextKV(
            torch.cat([self.keys, keys], dim=1), torch.cat([self.values, values], dim=1), rope
        )

    def prefix(self, length: int, rope: int) -> ContextKV:
        """The context's first ``length`` tokens (a context that ended there)."""
        return ContextKV(self.keys[:, :length], self.values[:, :length], rope)


class RMSNorm(nn.Module):  # type: ignore[misc]
    """Qwen2's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):  # type: ignore[misc]
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_Fn = Callable[[Tensor], Tensor]


def _by_expert(
    x: Tensor, gen: slice | None, und_fn: _Fn, gen_fn: _Fn, out_dim: int | None = None
) -> Tensor:
    """``und_fn`` on the understanding tokens and ``gen_fn`` on the generation ones: the
    rows ``gen`` spans (an image's latent tokens, between its two framing tokens); all
    tokens through ``und_fn`` when ``gen`` is None."""
    if gen is None:
        return und_fn(x)
    out = x.new_zeros((*x.shape[:-1], out_dim or x.shape[-1]))
    # The understanding rows gathered into one batch, as the reference runs them.
    und = torch.cat([x[: gen.start], x[gen.stop :]])
    done = und_fn(und).to(out.dtype)
    out[: gen.start] = done[: gen.start]
    out[gen.stop :] = done[gen.start :]
    out[gen] = gen_fn(x[gen]).to(out.dtype)
    return out


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """Attention of ``q`` [n, heads, dim] over ``k``/``v`` [t, kv_heads, dim] (t >= n, the
    queries being the last n of the t positions; causal aligns them bottom-right, as
    flash-attention does). Returns [n, heads * dim]."""
    n, heads, dim = q.shape
    t, kv_heads = k.shape[0], k.shape[1]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = None
    if causal:
        rows = torch.arange(n, device=q.device)[:, None] + (t - n)
        mask = torch.arange(t, device=q.device)[None, :] <= rows
    # [1, heads, tokens, dim]: SDPA's batched layout, whose CPU kernel the reference's
    # attention runs too (its results then agree bit for bit).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
    )
    return out[0].transpose(0, 1).reshape(n, heads * dim)


class MoTAttention(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: LLMShape) -> None:
        super().__init__()
        hidden, heads, kv, dim = (
            shape.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, dim
        for suffix in ("", "_moe_gen"):
            self.add_module(f"q_proj{suffix}", nn.Linear(hidden, heads * dim, bias=True))
            self.add_module(f"k_proj{suffix}", nn.Linear(hidden, kv * dim, bias=True))
            self.add_module(f"v_proj{suffix}", nn.Linear(hidden, kv * dim, bias=True))
            self.add_module(f"o_proj{suffix}", nn.Linear(heads * dim, hidden, bias=False))
            self.add_module(f"q_norm{suffix}", RMSNorm(dim, shape.rms_norm_eps))
            self.add_module(f"k_norm{suffix}", RMSNorm(dim, shape.rms_norm_eps))

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        gen: slice | None,
        past: tuple[Tensor, Tensor] | None,
        causal: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The attention output for ``x`` and the keys and values it adds to the cache."""
        m: dict[str, _Fn] = self._modules
        heads, kv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q = _by_expert(x, gen, m["q_proj"], m["q_proj_moe_gen"], heads * dim).view(-1, heads, dim)
        k = _by_expert(x, gen, m["k_proj"], m["k_proj_moe_gen"], kv * dim).view(-1, kv, dim)
        v = _by_expert(x, gen, m["v_proj"], m["v_proj_moe_gen"], kv * dim).view(-1, kv, dim)
        if gen is not None:
            # The generation path normalises q and k (both experts' tokens) in float32.
            q, k = q.float(), k.float()
        q = _by_expert(q, gen, m["q_norm"], m["q_norm_moe_gen"])
        k = _by_expert(k, gen, m["k_norm"], m["k_norm_moe_gen"])
        cos, sin = (c.unsqueeze(1) for c in cos_sin)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        dtype = v.dtype
        q, k = q.to(dtype), k.to(dtype)
        all_k, all_v = k, v
        if past is not None and past[0].shape[0]:
            all_k = torch.cat([past[0], k])
            all_v = torch.cat([past[1], v])
        out = attention(q, all_k, all_v, causal=causal)
        return _by_expert(out, gen, m["o_proj"], m["o_proj_moe_gen"], x.shape[-1]), k, v


class MoTDecoderLayer(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: LLMShape) -> None:
        super().__init__()
        self.self_attn = MoTAttention(shape)
        self.mlp = GatedMLP(shape.hidden_size, shape.intermediate_size)
        self.mlp_moe_gen = GatedMLP(shape.hidden_size, shape.intermediate_size)
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps)
        self.input_layernorm_moe_gen = RMSNorm(shape.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(shape.hidden_size, eps)

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        gen: slice | None,
        past: tuple[Tensor, Tensor] | None,
        causal: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        h = _by_expert(x, gen, self.input_layernorm, self.input_layernorm_moe_gen)
        attn, k, v = self.self_attn(h, cos_sin, gen, past, causal)
        x = x + attn
        if gen is None:
            h = self.mlp(self.post_attention_layernorm(x))
        else:
            h = _by_expert(
                x,
                gen,
                lambda u: self.mlp(self.post_attention_layernorm(u)),
                lambda g: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(g)),
            )
        return x + h, k, v


class RotaryEmbedding(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: LLMShape) -> None:
        super().__init__()
        dim = shape.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        # Not a parameter: stays float32 whatever dtype the model is cast to, and real
        # when the model is built on the meta device to be loaded.
        self.inv_freq = 1.0 / (shape.rope_theta**exponents)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class MoTBackbone(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: LLMShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary = RotaryEmbedding(shape)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        gen: slice | None,
        context: ContextKV | None,
        causal: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run ``x`` [n, hidden] (at ``positions``, the tokens ``gen`` marks through the
        generation expert) after ``context``. Returns the final-normed hidden states and the
        keys and values of ``x``, [layers, n, kv_heads, head_dim]."""
        cos_sin = self.rotary(positions, x.dtype)
        keys, values = [], []
        for index, layer in enumerate(self.layers):
            past = None if context is None else (context.keys[index], context.values[index])
            x, k, v = layer(x, cos_sin, gen, past, causal)
            keys.append(k)
            values.append(v)
        x = _by_expert(x, gen, self.norm, self.norm_moe_gen)
        return x, torch.stack(keys), torch.stack(values)


class LanguageModel(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: LLMShape) -> None:
        super().__init__()
        self.model = MoTBackbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)


class SiglipAttention(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.num_heads = shape.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        split = (n, self.num_heads, -1)
        q, k, v = (p(x).view(split) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attention(q, k, v, causal=False))


class SiglipLayer(nn.Module):  # type: ignore[misc]
    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        hidden, eps = shape.hidden_size, shape.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(shape)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, shape.intermediate_size)
        self.mlp.fc2 = nn.Linear(shape.intermediate_size, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        h = self.mlp.fc1(self.layer_norm2(x))
        return x + self.mlp.fc2(F.gelu(h, approximate="tanh"))


class SiglipTower(nn.Module):  # type: ignore[misc]
    """SigLIP's vision transformer over the patches of one image, in any size (NaViT):
    the patch embedding as a linear map of flattened (row, column, channel) patches, and
    learned positions indexed by row * max_patches_per_side + column."""

    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        per_side = shape.image_size // shape.patch_size
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(
            shape.num_channels * shape.patch_size**2, shape.hidden_size
        )
        self.embeddings.position_embedding = nn.Embedding(per_side**2, shape.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipLayer(shape) for _ in range(shape.num_layers))
        self.post_layernorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def forward(self, patches: Tensor, positions: Tensor) -> Tensor:
        weight = self.embeddings.patch_embedding.weight
        x = self.embeddings.patch_embedding(patches.to(weight.dtype))
        x = x + self.embeddings.position_embedding(positions)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class PositionTable(nn.Module):  # type: ignore[misc]
    """A fixed 2-D sine-cosine table (MAE/DiT's), one row per position of a square grid:
    row ``r * side + c`` holds c's embedding in its first half and r's in its second."""

    def __init__(self, side: int, width: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_table(side, width), requires_grad=False)

    def forward(self, positions: Tensor) -> Tensor:
        return self.pos_embed[positions]


def sincos_table(side: int, width: int) -> Tensor:
    def one_axis(coords: Tensor, dim: int) -> Tensor:
        omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
        angles = coords[:, None] * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    grid = torch.arange(side, dtype=torch.float64)
    rows = grid.repeat_interleave(side)
    cols = grid.repeat(side)
    return torch.cat([one_axis(cols, width // 2), one_axis(rows, width // 2)], dim=1).float()


class TimestepEmbedder(nn.Module):  # type: ignore[misc]
    """DiT's timestep embedding: sinusoidal frequencies (cos, then sin) through an MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQUENCIES, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, t: Tensor) -> Tensor:
        half = TIMESTEP_FREQUENCIES // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs.to(t.device)[None, :]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def grid_positions(rows: int, cols: int, side: int, device: torch.device | None = None) -> Tensor:
    """Flattened positions of a rows x cols grid of patches in a table ``side`` wide."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :]
    return (r * side + c).flatten()


def patchify(image: Tensor, patch: int) -> Tensor:
    """[channels, H, W] -> [(H/p)(W/p), p * p * channels], patches in row order, each
    flattened as (row, column, channel)."""
    c, h, w = image.shape
    x = image.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, patch * patch * c)


def unpatchify(tokens: Tensor, rows: int, cols: int, patch: int) -> Tensor:
    """The inverse of :func:`patchify`: [rows * cols, p * p * c] -> [c, rows * p, cols * p]."""
    x = tokens.reshape(rows, cols, patch, patch, -1)
    return torch.einsum("hwpqc->chpwq", x).reshape(-1, rows * patch, cols * patch)


class BagelModel(nn.Module):  # type: ignore[misc]
    """BAGEL's transformer side: the MoT language model, the ViT with its connector, and
    the latent-token embeddings. (The VAE is apart: :mod:`.vae`.)"""

    def __init__(self, shape: BagelShape) -> None:
        super().__init__()
        self.shape = shape
        hidden = shape.llm.hidden_size
        self.language_model = LanguageModel(shape.llm)
        self.vit_model = nn.Module()
        self.vit_model.vision_model = SiglipTower(shape.vit)
        self.connector = nn.Module()
        self.connector.fc1 = nn.Linear(shape.vit.hidden_size, hidden)
        self.connector.fc2 = nn.Linear(hidden, hidden)
        self.vit_pos_embed = PositionTable(shape.vit_max_num_patch_per_side, hidden)
        self.latent_pos_embed = PositionTable(shape.max_latent_size, hidden)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(shape.latent_token_width, hidden)
        self.llm2vae = nn.Linear(hidden, shape.latent_token_width)
        if shape.connector_act != "gelu_pytorch_tanh":
            raise ValueError(f"connector_act: {shape.connector_act!r} is not supported")

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vae2llm.weight.device

    def _embed(self, ids: Sequence[int]) -> Tensor:
        return self.language_model.model.embed_tokens(
            torch.tensor(ids, dtype=torch.long, device=self.device)
        )

    def _run(
        self, x: Tensor, rope: int, gen: slice | None, context: ContextKV, causal: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One image's tokens (all at position ``rope``) or one text (from ``rope`` on)."""
        n = x.shape[0]
        positions = torch.arange(rope, rope + n) if causal else torch.full((n,), rope)
        backbone: MoTBackbone = self.language_model.model
        return backbone.forward(x, positions.to(self.device), gen, context, causal)

    def extend_with_text(
        self, context: ContextKV, ids: Sequence[int], tokens: SpecialTokens
    ) -> ContextKV:
        """The context followed by a text: <|im_start|> ids <|im_end|>, causal, through
        the understanding expert, one RoPE position per token."""
        return self.extend_with_token_ids(context, [tokens.bos, *ids, tokens.eos])

    def extend_with_token_ids(self, context: ContextKV, ids: Sequence[int]) -> ContextKV:
        """The context followed by ``ids`` as they are (framing included)."""
        return self.extend_with_text_embeddings(context, self._embed(ids))

    def _framed_image(self, inner: Tensor, tokens: SpecialTokens) -> Tensor:
        ends = self._embed([tokens.start_of_image, tokens.end_of_image])
        return torch.cat([ends[:1], inner.to(ends.dtype), ends[1:]])

    def vit_embeddings(self, pixels: Tensor) -> Tensor:
        """An image's ViT tokens as the language model takes them: ``pixels`` [3, H, W] in
        [-1, 1] (sides multiples of the ViT's patch) through SigLIP and the connector, plus
        their positions."""
        patch = self.shape.vit.patch_size
        rows, cols = pixels.shape[1] // patch, pixels.shape[2] // patch
        positions = grid_positions(rows, cols, self.shape.vit_max_num_patch_per_side, self.device)
        vit = self.vit_model.vision_model(patchify(pixels, patch).to(self.device), positions)
        h = self.connector.fc2(F.gelu(self.connector.fc1(vit), approximate="tanh"))
        embeddings: Tensor = h + self.vit_pos_embed(positions)
        return embeddings

    def vae_embeddings(self, latent: Tensor) -> Tensor:
        """An image's clean VAE latent [z_channels, h, w] as latent tokens at timestep 0,
        as the language model takes them."""
        p = self.shape.latent_patch_size
        rows, cols = latent.shape[1] // p, latent.shape[2] // p
        return self._latent_tokens(
            patchify(latent.to(self.device), p), torch.zeros(1, device=self.device), rows, cols
        )

    def extend_with_image(self, context: ContextKV, framed: Tensor, latent: bool) -> ContextKV:
        """The context followed by one image's tokens, embedded and framed by
        <|vision_start|> <|vision_end|> (``framed``: [tokens + 2, hidden]), all at one
        position, full attention among them; through the generation expert where they are
        ``latent`` (VAE) tokens, else the understanding expert (ViT tokens)."""
        gen = self._gen_rows(framed.shape[0] - 2) if latent else None
        _, k, v = self._run(framed, context.rope, gen, context, causal=False)
        return context.extended(k, v, context.rope + 1)

    def decode_step(self, context: ContextKV, token: int) -> tuple[Tensor, ContextKV]:
        """The next token's logits after ``token`` follows ``context`` (understanding expert,
        causal), and the context with ``token`` in it."""
        out, k, v = self._run(self._embed([token]), context.rope, None, context, causal=True)
        logits: Tensor = self.language_model.lm_head(out[-1])
        return logits, context.extended(k, v, context.rope + 1)

    def extend_with_text_embeddings(self, context: ContextKV, x: Tensor) -> ContextKV:
        """The context followed by embedded text tokens ``x``, causal, understanding expert,
        one RoPE position per token."""
        _, k, v = self._run(x, context.rope, None, context, causal=True)
        return context.extended(k, v, context.rope + x.shape[0])

    def extend_with_vit(
        self, context: ContextKV, pixels: Tensor, tokens: SpecialTokens
    ) -> ContextKV:
        """The context followed by an image's ViT tokens (:meth:`vit_embeddings`)."""
        framed = self._framed_image(self.vit_embeddings(pixels), tokens)
        return self.extend_with_image(context, framed, latent=False)

    def _latent_tokens(self, latent_tokens: Tensor, t: Tensor, rows: int, cols: int) -> Tensor:
        """vae2llm(latent) + timestep embedding + position, for rows x cols latent tokens."""
        positions = grid_positions(rows, cols, self.shape.max_latent_size, self.device)
        weight = self.vae2llm.weight
        return (
            self.vae2llm(latent_tokens.to(weight.dtype))
            + self.time_embedder(t)
            + self.latent_pos_embed(positions)
        )

    @staticmethod
    def _gen_rows(n_latent: int) -> slice:
        """The latent tokens of a framed image: all but its two framing tokens."""
        return slice(1, n_latent + 1)

    def extend_with_vae(
        self, context: ContextKV, latent: Tensor, tokens: SpecialTokens
    ) -> ContextKV:
        """The context followed by an image's VAE latent tokens (:meth:`vae_embeddings`)."""
        framed = self._framed_image(self.vae_embeddings(latent), tokens)
        return self.extend_with_image(context, framed, latent=True)

    def velocity(
        self,
        context: ContextKV,
        x_t: Tensor,
        t: float,
        rows: int,
        cols: int,
        tokens: SpecialTokens,
    ) -> Tensor:
        """The flow's velocity for the noisy latent tokens ``x_t`` [rows * cols, width] at
        time ``t`` (1 is noise, 0 the image), given ``context``; nothing is cached."""
        n = rows * cols
        x = self._latent_tokens(x_t, torch.full((n,), t, device=self.device), rows, cols)
        out, _, _ = self._run(
            self._framed_image(x, tokens), context.rope, self._gen_rows(n), context, causal=False
        )
        return self.llm2vae(out[1:-1])
