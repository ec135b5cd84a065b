"""BAGEL's thinker on vLLM (``OmniBagelThinker``): its rows are the context's KV cache.

vLLM runs the thinker as the stage configures it (``make_stage_llm_engine_args`` with
BAGEL's recipe: the pooling runner, chunked prefill and prefix caching off), in a child
process; the prompts go in one batch, so that one forward holds several of them. Each
prompt's rows, reordered as the stage hands them on, must be the context that
``BagelGenerator`` builds bit for bit: that one is equal to the reference's own
(test_bagel.py), and so the thinker is too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from omni_runtime.config import load_pipeline
from omni_runtime.config.families import BAGEL_THINKER
from omni_runtime.modeling.bagel.generation import BagelGenerator
from omni_runtime.modeling.bagel.model import context_layout
from omni_runtime.tiny_models import BAGEL_SUBDIR

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "a red cat on a city street",
    # The seed's edit prompt: its own framing tokens, framed once more, as BAGEL does.
    "<|im_start|>Turn the main subject into a polished gold sculpture.<|im_end|>",
    "x",
]


def _run_thinker(spec_path: str, out_path: str) -> None:
    """The child: the thinker as its stage configures it; every prompt's rows."""
    from vllm import LLM, PoolingParams
    from vllm.config import PoolerConfig
    from vllm.engine.arg_utils import EngineArgs

    from omni_runtime.engine.stage.stage_llm_engine_config import make_stage_llm_engine_args

    spec = json.loads(Path(spec_path).read_text())
    pipeline = load_pipeline(spec["pipeline"])
    thinker = pipeline.stages[0]
    args = make_stage_llm_engine_args(thinker, spec["model"], pipeline.encoder_recipe(thinker))
    defaults = EngineArgs(model=args.model)
    changed = {
        name: value
        for name, value in vars(args).items()
        if name != "model" and value != getattr(defaults, name)
    }
    llm = LLM(model=args.model, pooler_config=PoolerConfig(task="token_embed"), **changed)
    prompts = [{"prompt_token_ids": ids} for ids in spec["token_ids"]]
    outputs = llm.encode(
        prompts,
        pooling_params=PoolingParams(task="token_embed"),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    rows = [output.outputs.data for output in outputs]
    torch.save({"rows": rows, "runner": llm.llm_engine.model_config.runner_type}, out_path)


@pytest.fixture(scope="module")
def checkpoint(tiny_models: Path) -> Path:
    return tiny_models / BAGEL_SUBDIR


def test_the_thinkers_rows_are_the_contexts_keys_and_values(
    checkpoint: Path, tmp_path: Path
) -> None:
    generator = BagelGenerator.load(checkpoint)
    template = BAGEL_THINKER.template
    assert template is not None
    token_ids = [
        generator.tokenizer.encode(template.format(prompt), add_special_tokens=False)
        for prompt in PROMPTS
    ]
    data = yaml.safe_load((ROOT / "examples" / "tiny-bagel.yaml").read_text())
    data["model"] = str(checkpoint)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(data))
    spec, out = tmp_path / "spec.json", tmp_path / "rows.pt"
    spec.write_text(
        json.dumps({"pipeline": str(pipeline), "model": str(checkpoint), "token_ids": token_ids})
    )
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    child = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result: dict[str, Any] = torch.load(out, weights_only=True)
    assert result["runner"] == "pooling"
    llm = generator.shape.llm
    for prompt, ids, rows in zip(PROMPTS, token_ids, result["rows"], strict=True):
        # bf16 as the model made them: vLLM's float32 head is not in the way.
        assert rows.dtype == torch.bfloat16
        context = generator.contexts(prompt, None, 64, 64, torch.Generator()).full
        kv = rows.view(len(ids), 2, llm.num_layers, llm.num_kv_heads, llm.head_dim)
        kv = kv.permute(1, 2, 0, 3, 4)
        assert torch.equal(kv[0], context.keys), prompt
        assert torch.equal(kv[1], context.values), prompt
        layout = context_layout(ids, generator.tokens)
        assert (layout.rope, layout.prefix_length, layout.prefix_rope) == (context.rope, 0, 0)


if __name__ == "__main__":
    _run_thinker(sys.argv[1], sys.argv[2])
