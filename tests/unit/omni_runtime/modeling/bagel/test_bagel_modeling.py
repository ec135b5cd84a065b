"""BAGEL's pure pieces: the checkpoint's shape, image sizing, the schedule, guidance, the
VAE's weight names, position tables and the context cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from omni_runtime.modeling.bagel.config import (
    BagelCheckpointError,
    ImageTransform,
    VAEShape,
    read_bagel_shape,
)
from omni_runtime.modeling.bagel.generation import (
    combine_guidance,
    default_guidance,
    plan_trailer,
    split_plan_trailer,
    timesteps,
)
from omni_runtime.modeling.bagel.model import (
    ContextKV,
    SpecialTokens,
    context_layout,
    grid_positions,
    patchify,
    sincos_table,
    unpatchify,
)
from omni_runtime.modeling.bagel.vae import bfl_state_dict, build_autoencoder, diffusers_state_dict
from omni_runtime.tiny_models import BAGEL_SUBDIR
from omni_runtime.tiny_models.bagel import LATENT_SIDE, bagel_config


def test_the_tiny_checkpoint_reads_back_with_depths_from_its_weights(tiny_models: Path) -> None:
    shape = read_bagel_shape(tiny_models / BAGEL_SUBDIR)
    config = bagel_config()
    assert shape.llm.num_layers == config["llm_config"]["num_hidden_layers"]
    assert shape.llm.head_dim == 32
    # vit_config.json says one layer more, as the released one does (27 for 26 run).
    vit_file = json.loads((tiny_models / BAGEL_SUBDIR / "vit_config.json").read_text())
    assert shape.vit.num_layers == vit_file["num_hidden_layers"] - 1
    assert shape.max_latent_size == LATENT_SIDE
    assert shape.latent_downsample == 16
    assert shape.latent_token_width == 64
    assert shape.vae.ch_mult == (1, 1, 1, 1)


def test_a_checkpoint_without_nested_configs_reads_the_separate_files(
    tiny_models: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "bagel"
    shutil.copytree(tiny_models / BAGEL_SUBDIR, copy)
    config = json.loads((copy / "config.json").read_text())
    del config["llm_config"], config["vit_config"]
    (copy / "config.json").write_text(json.dumps(config))
    assert read_bagel_shape(copy) == read_bagel_shape(tiny_models / BAGEL_SUBDIR)


def test_what_is_not_a_bagel_checkpoint_is_named(tiny_models: Path, tmp_path: Path) -> None:
    with pytest.raises(BagelCheckpointError, match=r"config\.json: not found"):
        read_bagel_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(BagelCheckpointError, match="model_type is 'qwen2', not 'bagel'"):
        read_bagel_shape(tmp_path)
    copy = tmp_path / "bagel"
    shutil.copytree(tiny_models / BAGEL_SUBDIR, copy)
    (copy / "ema.safetensors").unlink()
    with pytest.raises(BagelCheckpointError, match=r"ema\.safetensors: not found"):
        read_bagel_shape(copy)


@pytest.mark.parametrize(
    ("transform", "size", "expected"),
    [
        # BAGEL's VAE transform: a 640x480 photo is scaled up to a 512 short side, then
        # both sides rounded to multiples of 16.
        (ImageTransform(1024, 512, 16), (640, 480), (688, 512)),
        # Too long a side is scaled down to 1024.
        (ImageTransform(1024, 512, 16), (2048, 2048), (1024, 1024)),
        # The ViT's: 512x512 stays within [224, 980], to multiples of 14.
        (ImageTransform(980, 224, 14), (512, 512), (518, 518)),
        # The tiny checkpoint's: a 64-pixel image stays as it is for the VAE...
        (ImageTransform(64, 32, 16), (64, 64), (64, 64)),
        # ...and is 70 pixels (5 patches) for the ViT.
        (ImageTransform(112, 28, 14), (64, 64), (70, 70)),
        # Never below one stride.
        (ImageTransform(64, 32, 16), (1000, 10), (64, 16)),
    ],
)
def test_image_transform_sizes(
    transform: ImageTransform, size: tuple[int, int], expected: tuple[int, int]
) -> None:
    assert transform.size_for(*size) == expected


def test_the_schedule_is_shifted_towards_noise() -> None:
    t = timesteps(5, 3.0)
    assert t[0] == 1.0
    assert t[-1] == 0.0
    assert torch.all(t[:-1] > t[1:])
    # shift 3 at the midpoint: 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert float(t[2]) == pytest.approx(0.75)
    assert torch.equal(timesteps(5, 1.0), torch.linspace(1, 0, 5))


def test_guidance_without_a_second_context_is_the_velocity() -> None:
    v = torch.randn(6, 4)
    assert torch.equal(combine_guidance(v, None, None, 4.0, 2.0, "global", 0.0), v)


def test_guidance_extrapolates_away_from_the_dropped_contexts() -> None:
    v, v_text, v_img = torch.ones(2, 2), torch.zeros(2, 2), torch.full((2, 2), 0.5)
    # Without renormalisation's clamp biting (min 1 keeps the scale at 1): text guidance
    # 0 + 4 * (1 - 0) = 4, then image guidance 0.5 + 2 * (4 - 0.5) = 7.5.
    out = combine_guidance(v, v_text, v_img, 4.0, 2.0, "global", 1.0)
    assert torch.allclose(out, torch.full((2, 2), 7.5))


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
def test_renormalised_guidance_is_never_longer_than_the_velocity(renorm: str) -> None:
    generator = torch.Generator().manual_seed(0)
    v, v_text, v_img = (torch.randn(8, 16, generator=generator) for _ in range(3))
    out = combine_guidance(
        v, v_text, v_img if renorm != "text_channel" else None, 4.0, 2.0, renorm, 0.0
    )  # type: ignore[arg-type]
    if renorm == "global":
        assert float(out.norm()) <= float(v.norm()) * (1 + 1e-5)
    else:
        assert torch.all(out.norm(dim=-1) <= v.norm(dim=-1) * (1 + 1e-5))


def test_edit_and_text_to_image_defaults_are_bagels() -> None:
    edit, t2i = default_guidance(True), default_guidance(False)
    assert (edit.cfg_text_scale, edit.cfg_img_scale, edit.cfg_renorm_type) == (
        4.0,
        2.0,
        "text_channel",
    )
    assert (edit.num_timesteps, edit.timestep_shift, edit.cfg_interval) == (50, 3.0, (0.0, 1.0))
    assert (t2i.cfg_img_scale, t2i.cfg_interval, t2i.cfg_renorm_type) == (1.0, (0.4, 1.0), "global")


def test_vae_weights_round_trip_between_bfl_and_diffusers_names() -> None:
    shape = VAEShape(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1)
    state = build_autoencoder(shape).state_dict()
    bfl = bfl_state_dict(state, len(shape.ch_mult))
    # FLUX's names: blocks by level, the decoder's levels numbered from the top, 1x1 convs.
    assert "encoder.down.0.block.0.norm1.weight" in bfl
    assert "decoder.up.3.upsample.conv.weight" in bfl  # the lowest resolution's
    assert "decoder.up.0.block.1.conv2.weight" in bfl
    assert bfl["encoder.mid.attn_1.q.weight"].shape == (32, 32, 1, 1)
    assert "encoder.norm_out.weight" in bfl
    assert "decoder.mid.block_2.conv1.bias" in bfl
    back = diffusers_state_dict(bfl, len(shape.ch_mult))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_position_table_rows_hold_column_then_row() -> None:
    table = sincos_table(4, 8)
    # Row r * 4 + c: the column's embedding in the first half, the row's in the second.
    # Position 0's is sin(0) = 0 then cos(0) = 1 in each half.
    assert torch.equal(table[0], torch.tensor([0.0, 0.0, 1.0, 1.0] * 2))
    assert torch.equal(table[1, 4:], table[0, 4:])  # same row
    assert torch.equal(table[4, :4], table[0, :4])  # same column
    assert torch.equal(grid_positions(2, 3, 4), torch.tensor([0, 1, 2, 4, 5, 6]))


def test_patches_are_rows_of_row_column_channel() -> None:
    image = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)
    tokens = patchify(image, 2)
    assert tokens.shape == (6, 8)
    # The first patch: pixel (0,0) channels 0 and 1, then (0,1), (1,0), (1,1).
    assert tokens[0].tolist() == [0, 24, 1, 25, 6, 30, 7, 31]
    assert torch.equal(unpatchify(tokens, 2, 3, 2), image)


def test_a_context_prefix_is_its_first_tokens() -> None:
    keys = torch.randn(2, 5, 1, 4)
    context = ContextKV(keys, keys + 1, rope=3)
    prefix = context.prefix(2, rope=1)
    assert prefix.length == 2
    assert prefix.rope == 1
    assert torch.equal(prefix.keys, keys[:, :2])
    longer = prefix.extended(keys[:, 2:], keys[:, 2:] + 1, rope=3)
    assert torch.equal(longer.keys, context.keys)
    assert torch.equal(longer.values, context.values)


TOKENS = SpecialTokens(bos=1, eos=2, start_of_image=3, end_of_image=4)


@pytest.mark.parametrize(
    ("ids", "prompt_length", "layout"),
    [
        # text: a position per token; no image, so the text-dropped context is empty
        ([1, 9, 9, 2], 4, (4, 0, 0)),
        # an image's span (VAE tokens), another (ViT tokens), then text: one position each
        ([3, 7, 7, 7, 4, 3, 8, 8, 4, 1, 9, 2], 3, (5, 9, 2)),
        # the seed's prompt holds framing tokens of its own: only its length says where it is
        ([3, 7, 4, 1, 1, 9, 2, 2], 5, (6, 3, 1)),
        # think mode: a system prompt and the image are kept, the prompt dropped
        ([1, 5, 2, 3, 7, 7, 4, 1, 9, 2], 3, (7, 7, 4)),
        ([], 0, (0, 0, 0)),
    ],
)
def test_context_layout_gives_an_image_one_position(
    ids: list[int], prompt_length: int, layout: tuple[int, int, int]
) -> None:
    found = context_layout(ids, TOKENS, prompt_length)
    assert (found.rope, found.prefix_length, found.prefix_rope) == layout


@pytest.mark.parametrize("width", [6, 7, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_plans_text_rides_after_the_rows_and_comes_off_whole(
    width: int, dtype: torch.dtype
) -> None:
    rows = torch.randn(5, width).to(dtype)
    for text in ("", "a red cat, then the moon", "ünïcode ✓ " * 40):
        carried = torch.cat([rows, plan_trailer(text, width, rows)])
        assert carried.dtype == dtype
        # The stage may see the rows cast to float32 (vLLM's float heads): still exact.
        for seen in (carried, carried.float()):
            kept, got = split_plan_trailer(seen)
            assert got == text
            assert torch.equal(kept.to(dtype), rows)
