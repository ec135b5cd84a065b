"""A talker's request as its stage builds it (the stage server's half, then the engine
core's, which makes its prompt of the thinker's arrays), through vLLM's own input
processing: its only stop is the codec's end token.

The checkpoint's generation_config.json is the thinker's, and vLLM adds its end-of-text ids
to every request's stops. In the tiny Qwen3-Omni, as in any checkpoint whose special ids lie
below the talker's codebook size, that id is also a valid code: a talker that sampled it
ended the spoken answer early (36 of 63 frames on one such checkpoint). vLLM's engine config
is built without loading the model (``create_engine_config``), in a child, as the stage's
own builder sees it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from serving import run_vllm_child

from omni_runtime.config import load_pipeline
from omni_runtime.tiny_models import QWEN3_OMNI_SUBDIR

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _build_talker_request(checkpoint: str, out_path: str) -> None:
    """The child: the talker stage's request for a short prompt, its stops written out."""
    import torch
    from transformers import AutoConfig

    from omni_runtime.connectors import ConnectorHandle
    from omni_runtime.engine.models import STEP_HAND_OFFS
    from omni_runtime.engine.stage.stage_core_types import HandOff
    from omni_runtime.engine.stage.stage_llm_engine_config import make_stage_llm_engine_args
    from omni_runtime.engine.stage.stage_llm_inputs import StageLLMInputs
    from omni_runtime.engine.stage.stage_llm_request_builder import StageLLMRequestBuilder

    pipeline = load_pipeline(ROOT / "examples" / "tiny-qwen3-omni.yaml", model=checkpoint)
    talker = pipeline.stages[1]
    speech = pipeline.speech_stage(talker)
    assert speech is not None
    assert speech.role == "talker"
    args = make_stage_llm_engine_args(talker, checkpoint, speech=speech)
    vllm_config = args.create_engine_config()
    builder = StageLLMRequestBuilder(vllm_config, talker.default_sampling_params, speech=speech)
    # The architectures hand off and read under the names of the family's recipe.
    recipe = speech.recipe
    assert builder.input_prompt.inputs == (recipe.rows, recipe.prompt)
    thinker_says = STEP_HAND_OFFS[recipe.thinker_architecture]
    assert (thinker_says.said, thinker_says.prompt) == (recipe.rows, recipe.prompt)
    assert builder.step_hand_off == STEP_HAND_OFFS[recipe.talker_architecture]
    assert builder.step_hand_off.said == recipe.codes
    config = AutoConfig.from_pretrained(checkpoint)
    width = 2 * config.thinker_config.text_config.hidden_size
    start, user, assistant = (
        config.im_start_token_id,
        config.user_token_id,
        config.assistant_token_id,
    )
    prompt_ids = [start, user, 10, 11, 12, start, assistant]
    arrays = {
        speech.recipe.rows: torch.zeros((len(prompt_ids), width)),
        speech.recipe.prompt: torch.tensor(prompt_ids),
    }
    # Handles that go nowhere: the stage server's half never reads the arrays.
    inputs = {
        name: HandOff(ConnectorHandle("nowhere", name, str(a.dtype), list(a.shape), 0))
        for name, a in arrays.items()
    }
    pending = builder.build_with_inputs("r", inputs, {"voice": speech.recipe.voices[0]})
    assert pending.prompt_token_ids is None
    request = StageLLMInputs(vllm_config, {}).finish(pending, arrays)
    assert request.prompt_token_ids
    params = request.sampling_params
    assert params is not None
    generation = json.loads(Path(checkpoint, "generation_config.json").read_text())
    thinker_eos = generation["eos_token_id"]
    result = {
        "stop_token_ids": sorted(params.stop_token_ids or []),
        # What the core stops at besides them (None where eos is ignored).
        "eos_token_id": params.eos_token_id,
        "codec_eos": config.talker_config.codec_eos_token_id,
        "thinker_eos": [thinker_eos] if isinstance(thinker_eos, int) else thinker_eos,
        "codebook": config.talker_config.text_config.vocab_size - 1024,
    }
    Path(out_path).write_text(json.dumps(result))


def test_the_talkers_only_stop_is_the_codecs_end(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "talker.json"
    run_vllm_child(__file__, tiny_models / QWEN3_OMNI_SUBDIR, out, timeout=180)
    result = json.loads(out.read_text())
    # The exposure is real in this checkpoint: the thinker's end id is a valid code.
    assert any(eos < result["codebook"] for eos in result["thinker_eos"])
    assert result["stop_token_ids"] == [result["codec_eos"]]
    assert result["eos_token_id"] is None


if __name__ == "__main__":
    _build_talker_request(sys.argv[1], sys.argv[2])
