"""What every tiny model shares: the seed, the generated text, random norm weights."""

from __future__ import annotations

import random
from typing import Any

SEED = 1234
# The chat LLM's width, and so the Stable Diffusion UNet's cross-attention width. The Qwen
# families' text encoders are this wide too.
HIDDEN_SIZE = 128
# The chat LLM's vocabulary (its BPE holds exactly this many tokens).
VOCAB_SIZE = 384

_WORDS = """
a an the red green blue yellow gold silver small large tiny bright dark cat dog bird
hydrant street city tree river mountain sky sun moon house car boat flower garden
portrait painting photo sculpture of in on with under over near and draw paint make turn
into show me please image picture scene style polished shiny soft old new
""".split()  # noqa: SIM905 - a word list reads better as text


def corpus(lines: int, seed: int = SEED) -> list[str]:
    """Lines of random words from a small vocabulary of image prompts."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(4, 16))) for _ in range(lines)]


def randomize_rms_norms(model: Any, seed: int) -> int:
    """Draw every RMSNorm weight of ``model`` from [0.5, 1.5] (their init is all ones).

    With ones, a final norm that a reimplementation leaves out (or adds) changes the
    output by a mere rescaling, which tests comparing hidden states can miss. Returns how
    many norms were changed.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor):
                weight.copy_(0.5 + torch.rand(weight.shape, generator=generator))
                changed += 1
    return changed
