"""BAGEL's thinker on vLLM (``OmniBagelThinker``): its rows are the context's KV cache.

vLLM runs the thinker as the stage configures it (``make_stage_llm_engine_args`` with
BAGEL's recipe: the pooling runner, chunked prefill and prefix caching off), in a child
process, and takes its prompts as the stage's request builder makes them (an edit's input
image through the thinker's multimodal processor, its VAE sample from the seed); the
prompts go in one batch, so that one forward holds several of them. Each prompt's rows,
reordered as the stage hands them on, must be the context that ``BagelGenerator`` builds,
bit for bit, input image included: that one is equal to the reference's own (test_bagel.py),
and so the thinker is too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from serving import run_vllm_child

from omni_runtime.config import load_pipeline
from omni_runtime.families.bagel import THINK_SYSTEM_PROMPT
from omni_runtime.modeling.bagel.generation import (
    BagelGenerator,
    image_pixels,
    plan,
    split_plan_trailer,
    vae_noise,
)
from omni_runtime.modeling.bagel.model import ContextKV, context_layout
from omni_runtime.tiny_models import BAGEL_SUBDIR

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EDIT_PROMPT = "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>"
# (prompt, input image's seed or None, think mode). An edit's requested size is the DiT's
# alone: the context holds the image as BAGEL's transforms resize it.
CASES: list[tuple[str, int | None, bool]] = [
    ("a red cat on a city street", None, False),
    # The seed's edit prompt: its own framing tokens, framed once more, as BAGEL does.
    (EDIT_PROMPT, None, False),
    (EDIT_PROMPT, 3, False),
    ("x", 4, False),
    ("a red cat on a city street", None, True),
    (EDIT_PROMPT, 3, True),
]
SEED = 42
THINK_TOKENS = 6


def _run_thinker(spec_path: str, out_path: str) -> None:
    """The child: the thinker as its stage configures it; every prompt's rows."""
    from vllm import LLM
    from vllm.config import PoolerConfig
    from vllm.engine.arg_utils import EngineArgs

    from omni_runtime.engine.stage.stage_llm_engine_config import make_stage_llm_engine_args
    from omni_runtime.engine.stage.stage_llm_request_builder import StageLLMRequestBuilder

    spec = json.loads(Path(spec_path).read_text())
    pipeline = load_pipeline(spec["pipeline"])
    thinker = pipeline.stages[0]
    recipe = pipeline.encoder_recipe(thinker)
    args = make_stage_llm_engine_args(thinker, spec["model"], recipe)
    defaults = EngineArgs(model=args.model)
    changed = {
        name: value
        for name, value in vars(args).items()
        if name != "model" and value != getattr(defaults, name)
    }
    llm = LLM(model=args.model, pooler_config=PoolerConfig(task="token_embed"), **changed)
    vllm_config = llm.llm_engine.vllm_config
    builders = {
        False: StageLLMRequestBuilder(vllm_config, None, recipe),
        True: StageLLMRequestBuilder(vllm_config, None, recipe, think_tokens=THINK_TOKENS),
    }
    prompts, token_ids, pooling_params, prompt_lengths = [], [], [], []
    for prompt, image_seed, think in spec["cases"]:
        builder = builders[think]
        params: dict[str, Any] = {"seed": SEED}
        image = None if image_seed is None else input_image(image_seed)
        images = [] if image is None else [image]
        request = builder.build("r", prompt=prompt, images=images, params=params)
        token_ids.append(list(request.prompt_token_ids or ()))
        pooling_params.append(request.pooling_params)
        prompt_lengths.append(len(builder.framed_prompt_ids(prompt)))
        # The same prompt before vLLM's processing: think mode's system prompt, the image's
        # placeholder, then the text.
        context = builder.framed_prompt_ids(THINK_SYSTEM_PROMPT) if think else []
        if image is not None:
            context.append(builder.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
        engine_prompt: dict[str, Any] = {
            "prompt_token_ids": [*context, *builder.framed_prompt_ids(prompt)]
        }
        if image is not None:
            engine_prompt["multi_modal_data"] = {"image": Image.fromarray(image)}
            engine_prompt["mm_processor_kwargs"] = {"seed": SEED}
        prompts.append(engine_prompt)
    outputs = llm.encode(
        prompts, pooling_params=pooling_params, pooling_task="token_embed", use_tqdm=False
    )
    rows = [output.outputs.data for output in outputs]
    # The prompts as vLLM ran them.
    seen = [list(output.prompt_token_ids) for output in outputs]
    torch.save(
        {
            "rows": rows,
            "token_ids": seen,
            "built": token_ids,
            "prompt_lengths": prompt_lengths,
            "runner": llm.llm_engine.model_config.runner_type,
        },
        out_path,
    )


def input_image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / BAGEL_SUBDIR


def test_the_thinkers_rows_are_the_contexts_keys_and_values(
    checkpoint: Path, tmp_path: Path
) -> None:
    generator = BagelGenerator.load(checkpoint)
    data = yaml.safe_load((ROOT / "examples" / "tiny-bagel.yaml").read_text())
    data["model"] = str(checkpoint)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(data))
    spec, out = tmp_path / "spec.json", tmp_path / "rows.pt"
    spec.write_text(
        json.dumps({"pipeline": str(pipeline), "model": str(checkpoint), "cases": CASES})
    )
    run_vllm_child(__file__, spec, out)
    result: dict[str, Any] = torch.load(out, weights_only=True)
    assert result["runner"] == "pooling"
    llm = generator.shape.llm
    tokens = generator.tokens
    for case, built, ids, rows, prompt_length in zip(
        CASES,
        result["built"],
        result["token_ids"],
        result["rows"],
        result["prompt_lengths"],
        strict=True,
    ):
        prompt, image_seed, think = case
        # The stage's request is what vLLM ran: the image's placeholder already replaced
        # with its spans, and think mode's system prompt before it.
        assert built == ids
        # bf16 as the model made them: vLLM's float32 head is not in the way.
        assert rows.dtype == torch.bfloat16
        picture = None
        if image_seed is not None:
            picture = generator.prepare_image(Image.fromarray(input_image(image_seed)))
        rng = torch.Generator().manual_seed(SEED)
        with torch.inference_mode():
            if think:
                context, kept, planned = think_mode_context(generator, prompt, picture, rng)
                # After the context's rows, the plan's text, for the caller.
                rows, text = split_plan_trailer(rows)
                assert text == planned, case
            else:
                contexts = generator.contexts(prompt, picture, 64, 64, rng)
                context, kept = contexts.full, contexts.no_text
        kv = rows.view(rows.shape[0], 2, llm.num_layers, llm.num_kv_heads, llm.head_dim)
        kv = kv.permute(1, 2, 0, 3, 4)
        assert torch.equal(kv[0], context.keys), case
        assert torch.equal(kv[1], context.values), case
        layout = context_layout(ids, tokens, prompt_length)
        # Rows past the prompt's are the plan (think mode), a position each.
        assert layout.rope + rows.shape[0] - len(ids) == context.rope
        # The text-dropped context: what comes before the prompt.
        assert (layout.prefix_length, layout.prefix_rope) == (kept.length, kept.rope)
        # A plan is there only in think mode.
        assert (rows.shape[0] > len(ids)) == think, case


def think_mode_context(
    generator: BagelGenerator, prompt: str, picture: Any, rng: torch.Generator
) -> tuple[ContextKV, ContextKV, str]:
    """Think mode's full context (system prompt, image, prompt, plan), its text-dropped
    one (system prompt, image), as BAGEL builds them, and the plan's text."""
    model, tokenizer, tokens = generator.model, generator.tokenizer, generator.tokens
    context = ContextKV.empty(generator.shape.llm, model.dtype, model.device)
    context = model.extend_with_text(
        context, tokenizer.encode(THINK_SYSTEM_PROMPT, add_special_tokens=False), tokens
    )
    if picture is not None:
        latent = generator.vae.encode(
            image_pixels(picture, picture.size), vae_noise(picture, generator.shape, rng)
        )
        context = model.extend_with_vae(context, latent, tokens)
        vit_size = generator.shape.vit_transform.size_for(*picture.size)
        context = model.extend_with_vit(context, image_pixels(picture, vit_size), tokens)
    kept = context
    context = model.extend_with_text(
        context, tokenizer.encode(prompt, add_special_tokens=False), tokens
    )
    text, context = plan(model, tokenizer, tokens, context, THINK_TOKENS)
    return context, kept, text


if __name__ == "__main__":
    _run_thinker(sys.argv[1], sys.argv[2])
