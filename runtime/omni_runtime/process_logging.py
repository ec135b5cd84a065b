"""Logging choices for the processes omni-runtime owns: its CLI and its stage processes.

Library code never calls these: an application that embeds a client (the inline diffusion
client, say) keeps its logging as it set it.
"""

from __future__ import annotations

import logging

_TORCHVISION_NOTICE = "requires torchvision (not installed)"


def drop_torchvision_notice() -> None:
    """Drop transformers' notice that torchvision is missing, with its advice to install it.

    scripts/setup.sh removes torchvision on purpose: the registry's build is CUDA's and
    breaks ``import vllm`` on CPU. Following the advice would break the LLM stage, and the
    PIL image processors transformers falls back to are what the pipelines here use.
    """
    logging.getLogger("transformers.utils.import_utils").addFilter(_not_torchvision_notice)


def disable_loading_bars() -> None:
    """No progress bars while models load: a stage process's output is a server log."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _not_torchvision_notice(record: logging.LogRecord) -> bool:
    return _TORCHVISION_NOTICE not in record.getMessage()
