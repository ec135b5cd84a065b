"""LoRA adapters of the tiny chat LLM (``llm/``), in PEFT's layout, for LLM stages' tests
and bench/.

Each is a directory with ``adapter_config.json`` and ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes and vLLM loads. PEFT initialises a new adapter as a
no-op (its B matrices are zero), so the weights are drawn here from a fixed seed, large
enough that greedy outputs differ from the base model's and from each other's:

- ``attn``: rank 8 on the attention's q_proj and v_proj;
- ``mlp``: rank 8 on o_proj and the MLP's gate_proj;
- ``wide``: rank 32 on q_proj and v_proj, above vLLM's default max_lora_rank (16), for the
  "rank too big" refusal.
"""

from __future__ import annotations

from pathlib import Path

from ._common import SEED

__all__ = ["ATTN_LORA", "LLM_LORAS", "MLP_LORA", "WIDE_LORA", "build_llm_loras"]

ATTN_LORA = "attn"
MLP_LORA = "mlp"
WIDE_LORA = "wide"
# name -> (rank, target modules)
LLM_LORAS: dict[str, tuple[int, tuple[str, ...]]] = {
    ATTN_LORA: (8, ("q_proj", "v_proj")),
    MLP_LORA: (8, ("o_proj", "gate_proj")),
    WIDE_LORA: (32, ("q_proj", "v_proj")),
}
# The spread of the drawn A and B weights: with lora_alpha = 2 * rank the update of a
# 128-wide projection is of the order of its own random weights, which moves greedy tokens.
_WEIGHT_STD = 0.15


def build_llm_loras(out_dir: Path, llm_dir: Path) -> dict[str, Path]:
    """Write the adapters of ``LLM_LORAS`` for the tiny LLM at ``llm_dir`` under
    ``out_dir`` (one directory each, named as the adapter); their paths by name."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths: dict[str, Path] = {}
    for index, (name, (rank, targets)) in enumerate(LLM_LORAS.items()):
        base = AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(targets),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(SEED + index)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_A" in parameter_name or "lora_B" in parameter_name:
                    drawn = torch.randn(parameter.shape, generator=generator) * _WEIGHT_STD
                    parameter.copy_(drawn)
        path = out_dir / name
        model.save_pretrained(str(path), safe_serialization=True)
        paths[name] = path
    return paths
