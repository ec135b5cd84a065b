"""Runs BAGEL's official reference inference on CPU and dumps what it computes to an .npz.

Run with the reference environment's python (env.sh), never the project's:

    <reference python> run_reference.py SPEC.json

SPEC.json keys: checkpoint (a BAGEL checkpoint directory: config.json, llm_config.json,
vit_config.json, ema.safetensors, ae.safetensors, tokenizer files), reference_dir (the
unmodified reference: inferencer.py, modeling/, data/), out (the .npz to write), prompt,
image (a PNG path for an edit, or null for text-to-image), seed, num_timesteps,
timestep_shift, cfg_text_scale, cfg_img_scale, cfg_interval ([lo, hi]), cfg_renorm_type,
cfg_renorm_min, height, width (the text-to-image size; an edit takes its input's size),
and optionally repeat (run the job that many times; job_seconds times each) and think
(think mode, greedy, at most think_tokens tokens: think_text is the plan it wrote).

The model is loaded as BAGEL's app.py loads it, scaled to the checkpoint's config, and
InterleaveInferencer.interleave_inference runs unchanged; a subclass records the three KV
contexts gen_image receives and the latent and image decode_image produces.

The .npz holds, for each context NAME in gen, cfg_text, cfg_img: NAME_keys, NAME_values
(float32 [num_layers, kv_len, num_kv_heads, head_dim]), NAME_kv_len, NAME_rope; latent
(float32 [tokens, z_channels * p * p], what the decoder got); image (uint8 [H, W, 3]);
image_shape ([H, W] generated); prompt_ids (the prompt's ids as the reference feeds them:
<|im_start|> + tokens + <|im_end|>); special_ids (bos, eos, start_of_image, end_of_image);
timings (seconds: load, inference) with timing_names.

What an implementation must do to meet these arrays, read from the reference: after
torch.manual_seed(seed) the CPU generator's first draw, in an edit only, is the VAE
posterior sample (modeling.autoencoder's DiagonalGaussian samples: mean + std * randn_like,
not the mean; the encoder's output is bf16 under autocast, and a bf16 randn on CPU equals a
float32 randn rounded, from the same stream); the next is the initial noise,
torch.randn(tokens, z_channels * p * p) in float32 (prepare_vae_latent). The KV caches are
bf16 (cast before attention). x_t stays float32 while each velocity is bf16 (llm2vae under
autocast, times the float32 dt, stays bf16) before it is subtracted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONTEXTS = ("gen", "cfg_text", "cfg_img")

# FLUX's autoencoder, as the reference's modeling.autoencoder.load_ae hard-codes it; a
# checkpoint's config.json "vae_config" overrides each key it has (tiny checkpoints).
FLUX_AE = {
    "resolution": 256,
    "in_channels": 3,
    "downsample": 8,
    "ch": 128,
    "out_ch": 3,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "z_channels": 16,
    "scale_factor": 0.3611,
    "shift_factor": 0.1159,
}


def _load(checkpoint: Path) -> tuple[Any, ...]:
    """The model, VAE, tokenizer, special ids and transforms, as BAGEL's app.py loads them."""
    import torch
    from data.data_utils import add_special_tokens  # type: ignore[import-not-found]
    from data.transforms import ImageTransform  # type: ignore[import-not-found]
    from modeling.autoencoder import AutoEncoder, AutoEncoderParams  # type: ignore[import-not-found]
    from modeling.bagel import (  # type: ignore[import-not-found]
        Bagel,
        BagelConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
    )
    from modeling.qwen2 import Qwen2Tokenizer  # type: ignore[import-not-found]
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())

    llm_config = Qwen2Config.from_json_file(str(checkpoint / "llm_config.json"))
    llm_config.qk_norm = True
    llm_config.tie_word_embeddings = False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"

    vit_config = SiglipVisionConfig.from_json_file(str(checkpoint / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers = vit_config.num_hidden_layers - 1

    vae_values = {
        **FLUX_AE,
        **{k: v for k, v in config.get("vae_config", {}).items() if k in FLUX_AE},
    }
    vae_config = AutoEncoderParams(**vae_values)
    vae_model = AutoEncoder(vae_config)
    # load_ae loads with assign=True (the file's dtype is the VAE's: float32 for FLUX's) but
    # strict=False, printing what is missing; here a missing or unexpected key is an error.
    ae_state = load_file(str(checkpoint / "ae.safetensors"))
    vae_model.load_state_dict(ae_state, strict=True, assign=True)

    bagel_config = BagelConfig(
        visual_gen=True,
        visual_und=True,
        llm_config=llm_config,
        vit_config=vit_config,
        vae_config=vae_config,
        vit_max_num_patch_per_side=config["vit_max_num_patch_per_side"],
        connector_act=config["connector_act"],
        latent_patch_size=config["latent_patch_size"],
        max_latent_size=config["max_latent_size"],
    )
    language_model = Qwen2ForCausalLM(llm_config)
    vit_model = SiglipVisionModel(vit_config)
    model = Bagel(language_model, vit_model, bagel_config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)

    state = load_file(str(checkpoint / "ema.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"ema.safetensors does not match the reference's Bagel module: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    # app.py loads with accelerate's load_checkpoint_and_dispatch(dtype=torch.bfloat16): the
    # checkpoint's tensors (every parameter here) become bf16, while buffers that are not in
    # the checkpoint keep the dtype they were built with (the rotary embeddings' inv_freq
    # stays float32). A blanket model.to(bfloat16) would also round inv_freq to bf16 and
    # shift every RoPE angle, so only what the checkpoint holds is cast.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in state and tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.bfloat16)
    model = model.eval()
    vae_model = vae_model.eval()

    tokenizer = Qwen2Tokenizer.from_pretrained(str(checkpoint))
    tokenizer, new_token_ids, _ = add_special_tokens(tokenizer)
    vae_transform = ImageTransform(*config.get("vae_transform", [1024, 512, 16]))
    vit_transform = ImageTransform(*config.get("vit_transform", [980, 224, 14]))
    return model, vae_model, tokenizer, new_token_ids, vae_transform, vit_transform


def _context_arrays(
    name: str, context: dict[str, Any], num_layers: int, kv_shape: tuple[int, int]
) -> dict[str, Any]:
    import numpy as np
    import torch

    cache = context["past_key_values"]
    arrays: dict[str, Any] = {}
    for kind, layers in (("keys", cache.key_cache), ("values", cache.value_cache)):
        per_layer = [layers[i] for i in range(num_layers)]
        if all(t is None for t in per_layer):
            arrays[f"{name}_{kind}"] = np.zeros((num_layers, 0, *kv_shape), dtype=np.float32)
        else:
            stacked = torch.stack([t.detach().to(torch.float32) for t in per_layer])
            arrays[f"{name}_{kind}"] = stacked.cpu().numpy()
    arrays[f"{name}_kv_len"] = np.int64(context["kv_lens"][0])
    arrays[f"{name}_rope"] = np.int64(context["ropes"][0])
    return arrays


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    reference_dir = Path(spec["reference_dir"]).resolve()
    # The reference imports its packages (modeling, data, inferencer) from its root and
    # `flash_attn` from beside this file (the SDPA stand-in).
    sys.path[:0] = [str(reference_dir), str(HERE)]

    import numpy as np
    import torch
    from inferencer import InterleaveInferencer  # type: ignore[import-not-found]
    from PIL import Image

    started = time.perf_counter()
    model, vae_model, tokenizer, new_token_ids, vae_transform, vit_transform = _load(
        Path(spec["checkpoint"])
    )
    loaded = time.perf_counter()

    llm_config = model.config.llm_config
    num_layers = llm_config.num_hidden_layers
    kv_shape = (
        llm_config.num_key_value_heads,
        llm_config.hidden_size // llm_config.num_attention_heads,
    )
    captured: dict[str, Any] = {}

    class CapturingInferencer(InterleaveInferencer):  # type: ignore[misc]
        def gen_image(self, image_shape: Any, gen_context: dict[str, Any], **kw: Any) -> Any:
            for name, context in zip(
                CONTEXTS,
                (gen_context, kw["cfg_text_precontext"], kw["cfg_img_precontext"]),
                strict=True,
            ):
                captured.update(_context_arrays(name, context, num_layers, kv_shape))
            captured["image_shape"] = np.asarray(image_shape, dtype=np.int64)
            return super().gen_image(image_shape, gen_context, **kw)

        def decode_image(self, latent: Any, image_shape: Any) -> Any:
            captured["latent"] = latent.detach().to(torch.float32).cpu().numpy()
            image = super().decode_image(latent, image_shape)
            captured["image"] = np.asarray(image, dtype=np.uint8)
            return image

    inferencer = CapturingInferencer(
        model=model,
        vae_model=vae_model,
        tokenizer=tokenizer,
        vae_transform=vae_transform,
        vit_transform=vit_transform,
        new_token_ids=new_token_ids,
    )
    input_list: list[Any] = []
    if spec.get("image"):
        input_list.append(Image.open(spec["image"]))
    input_list.append(spec["prompt"])

    # bench/bagel_serve.py times several jobs of one process: "repeat" runs the same job
    # that many times (the same seed, so the same arrays), timing each.
    job_seconds = []
    for _ in range(int(spec.get("repeat", 1))):
        job_started = time.perf_counter()
        torch.manual_seed(int(spec["seed"]))
        # interleave_inference wraps its work in torch.autocast(device_type="cuda",
        # dtype=bfloat16), which does nothing on a CPU-only machine (torch warns and disables
        # it). On a GPU that autocast is what lets the bf16 weights meet float32 inputs: vae2llm
        # on the float32 noise and VAE latents, the time embedder on float32 frequencies, and it
        # runs the float32 VAE's convolutions in bf16. Without it those linears fail with a
        # dtype mismatch here, so CPU autocast to bf16 stands in for it: linears, matmuls,
        # convolutions and SDPA run in bf16 as under CUDA autocast. One difference remains:
        # CUDA autocast runs layer_norm, group_norm, norm and softmax in float32 and CPU
        # autocast leaves them in their input's dtype (bf16 here), which touches SigLIP's
        # LayerNorm outputs, the VAE's GroupNorms and the CFG renorm's norms (bf16 rounding,
        # below the bf16 noise the next linear adds). RMSNorm, RoPE and the flow update cast
        # explicitly and are the same on both.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = inferencer.interleave_inference(
                input_list,
                think=bool(spec.get("think", False)),
                max_think_token_n=int(spec.get("think_tokens", 1000)),
                do_sample=False,
                cfg_text_scale=float(spec["cfg_text_scale"]),
                cfg_img_scale=float(spec["cfg_img_scale"]),
                cfg_interval=[float(x) for x in spec["cfg_interval"]],
                timestep_shift=float(spec["timestep_shift"]),
                num_timesteps=int(spec["num_timesteps"]),
                cfg_renorm_min=float(spec["cfg_renorm_min"]),
                cfg_renorm_type=str(spec["cfg_renorm_type"]),
                image_shapes=(int(spec["height"]), int(spec["width"])),
            )
        job_seconds.append(time.perf_counter() - job_started)
    done = time.perf_counter()
    if not any(isinstance(o, Image.Image) for o in outputs) or "image" not in captured:
        raise RuntimeError(f"the reference produced no image: {outputs!r}")
    texts = [o for o in outputs if isinstance(o, str)]
    if texts:
        captured["think_text"] = np.asarray(texts[0])

    ids = tokenizer.encode(spec["prompt"])
    captured["prompt_ids"] = np.asarray(
        [new_token_ids["bos_token_id"], *ids, new_token_ids["eos_token_id"]], dtype=np.int64
    )
    captured["special_ids"] = np.asarray(
        [
            new_token_ids[k]
            for k in ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")
        ],
        dtype=np.int64,
    )
    captured["timings"] = np.asarray([loaded - started, done - loaded], dtype=np.float64)
    captured["timing_names"] = np.asarray(["load", "inference"])
    captured["job_seconds"] = np.asarray(job_seconds, dtype=np.float64)
    out = Path(spec["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **captured)
    print(
        f"wrote {out}: load {loaded - started:.2f}s, inference {done - loaded:.2f}s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json")
    main(sys.argv[1])
