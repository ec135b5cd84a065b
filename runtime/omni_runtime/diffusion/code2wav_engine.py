"""Code2WavEngine: Qwen3-Omni's code2wav stage, request by request.

code2wav turns the talker's codec frames (``[frames, 16]`` codes, each in its codebook)
into a waveform: float32 mono samples at 24 kHz, 1920 samples a frame. It is a
diffusion-kind stage with an engine of its own rather than a stage kind of its own because
it is what a DiT is to the serving: a non-autoregressive torch model run once over an array
an upstream stage handed off. The diffusion stage already admits requests, aborts them,
fetches and frees their hand-offs, runs replicas and pins them to GPUs; a kind of its own
would repeat all of that for a different ``_run``.

The model is transformers' ``Qwen3OmniMoeCode2Wav`` built from the checkpoint's
``code2wav_config`` and loaded with the checkpoint's ``code2wav.`` tensors alone: the
thinker and talker beside it (tens of GB in the real checkpoint) are never read, and of a
sharded checkpoint only the shards holding code2wav are opened (or, for a hub id, fetched).
The waveform is transformers' ``chunked_decode`` with the chunking its ``generate`` uses,
so it is the reference's to the bit in float32.

The request's one input is ``codes`` (the talker's hand-off); it takes no sampling
parameters. The output is the base's ``audio``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from omni_runtime.diffusion.engine_base import (
    DiffusionEngineBase,
    DiffusionEngineConfig,
    PartialEmit,
    RequestAbortedError,
    engine_device,
    torch_dtype,
)
from omni_runtime.diffusion.params import InvalidRequestError, check_input_names
from omni_runtime.engine.stage.stage_core_types import StageDiffusionCoreRequest

FAMILY = "qwen3-omni"
# Qwen3-Omni's output rate. Some versions of Qwen3OmniMoeCode2WavConfig carry no rate, and
# the model's upsampling (1920 samples a frame at 12.5 frames a second) fixes it anyway.
SAMPLE_RATE = 24000
# transformers' Qwen3OmniMoeForConditionalGeneration.generate decodes with these: chunks
# of 300 frames, each after the 25 frames before it (whose samples are cut off again), so
# that a long answer's memory is bounded and its chunk seams are heard from context.
CHUNK_FRAMES = 300
LEFT_CONTEXT_FRAMES = 25
INPUT = "codes"
_PREFIX = "code2wav."
_INDEX = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
# The dtypes a codes hand-off may come in (torch's spelling); each holds a codebook index.
_INTEGER_DTYPES = frozenset({"int64", "int32", "int16", "uint16", "uint32", "uint64"})


class CodesOutOfRangeError(RuntimeError):
    """The talker handed off a code outside code2wav's codebook. Neither the caller's fault
    (a caller cannot send codes) nor a lost input (the router would run the talker again,
    greedily to the same codes): the stage failed, and says where."""


class Code2WavEngine(DiffusionEngineBase):
    """Qwen3-Omni's code2wav loaded from a checkpoint in this process."""

    makes_audio = True

    def __init__(self, config: DiffusionEngineConfig) -> None:
        import torch

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        if config.family not in (None, FAMILY):
            raise InvalidRequestError(
                f"family: the code2wav engine runs {FAMILY}'s checkpoints, not {config.family!r}",
                "family",
            )
        if config.default_params:
            name = min(config.default_params)
            raise InvalidRequestError(
                f"defaultSamplingParams.{name}: the code2wav stage takes no sampling parameters",
                name,
            )
        super().__init__(config.connectors)
        try:
            self._load(config)
        except BaseException:
            # The connectors are open by now; a stage that fails to load must not keep them.
            self.close()
            raise

    def _load(self, config: DiffusionEngineConfig) -> None:
        from transformers import AutoConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeCode2Wav,
        )

        self.device = engine_device(config)
        # auto: float32. code2wav is small (about 0.2B parameters in the real model), and in
        # float32 its waveform is transformers' own, to the bit.
        self.compute_dtype = torch_dtype("float32" if config.dtype == "auto" else config.dtype)
        checkpoint = _local_checkpoint(config.model)
        code2wav_config = getattr(
            AutoConfig.from_pretrained(checkpoint, local_files_only=True), "code2wav_config", None
        )
        if code2wav_config is None:
            raise InvalidRequestError(
                f"model: {config.model} is no Qwen3-Omni checkpoint (its config has no "
                "code2wav_config)",
                "model",
            )
        model = Qwen3OmniMoeCode2Wav._from_config(code2wav_config, dtype=self.compute_dtype)
        weights = _code2wav_weights(checkpoint)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            # Named here, with the checkpoint: load_state_dict's own error names neither the
            # checkpoint nor the prefix the keys had in it.
            wrong = (
                f"lacks {len(missing)} code2wav tensor(s), {_PREFIX}{missing[0]} first"
                if missing
                else f"has {len(unexpected)} code2wav tensor(s) its config does not make, "
                f"{_PREFIX}{unexpected[0]} first"
            )
            raise InvalidRequestError(f"model: {config.model} ({checkpoint}) {wrong}", "model")
        model.load_state_dict(weights, strict=True)
        self.model: Any = model.eval().to(self.device)
        self.sample_rate = SAMPLE_RATE
        self.num_quantizers = int(code2wav_config.num_quantizers)
        self.codebook_size = int(code2wav_config.codebook_size)
        self.samples_per_frame = int(model.total_upsample)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.config.model,
            "device": self.device,
            "pipeline": "Qwen3OmniMoeCode2Wav",
            "family": FAMILY,
            # Qwen3-Omni's rate, not read from the config (which need not carry one).
            "sample_rate": self.sample_rate,
            "num_quantizers": self.num_quantizers,
            "codebook_size": self.codebook_size,
            "samples_per_frame": self.samples_per_frame,
        }

    def validate(self, request: StageDiffusionCoreRequest) -> None:
        params = {**self.config.default_params, **request.params}
        if params:
            name = min(params)
            raise InvalidRequestError(
                f"params.{name}: the code2wav stage takes no sampling parameters", name
            )
        check_input_names(request, (INPUT,))
        if INPUT not in request.inputs:
            raise InvalidRequestError(
                f"inputs.{INPUT}: required (the talker's codec frames, handed off)", INPUT
            )
        # The router may send the answer's text along; code2wav has no use for it, so the
        # prompt is left alone. Arrays it would have no use for are refused by name.
        if request.images:
            raise InvalidRequestError("image: the code2wav stage takes no input image", "image")
        for name in ("prompt_embeds", "negative_prompt_embeds"):
            if getattr(request, name) is not None:
                raise InvalidRequestError(
                    f"{name}: the code2wav stage takes codec frames, not embeddings", name
                )
        handle = request.inputs[INPUT].handle
        shape, dtype = list(handle.shape), handle.dtype
        if len(shape) != 2 or shape[1] != self.num_quantizers or dtype not in _INTEGER_DTYPES:
            raise InvalidRequestError(
                f"inputs.{INPUT}: expected integer codes of shape [frames, "
                f"{self.num_quantizers}], got {dtype} {shape}",
                INPUT,
            )

    def _run(
        self,
        request: StageDiffusionCoreRequest,
        params: None,
        should_abort: Callable[[], bool],
        emit: PartialEmit | None = None,
    ) -> np.ndarray:
        import torch

        # As integers: the compute dtype's float would round codes (bf16 past 256).
        codes = self.fetch(request, INPUT, dtype=torch.long)
        if should_abort():
            raise RequestAbortedError
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        self._check_codes(codes)
        # A streamed chunk (asyncChunk) starts with frames decoded before it, as its left
        # context: decoded with it and dropped, as transformers' chunked_decode does each
        # chunk after the first.
        context = request.inputs[INPUT].meta.get("context", 0)
        if not 0 <= context < codes.shape[0]:
            raise CodesOutOfRangeError(
                f"inputs.{INPUT}: a left context of {context} frames in a chunk of {codes.shape[0]}"
            )
        with torch.inference_mode():
            if context:
                waveform = self.model(codes.T[None].long())[..., context * self.samples_per_frame :]
            else:
                waveform = self.model.chunked_decode(
                    codes.T[None].long(),
                    chunk_size=CHUNK_FRAMES,
                    left_context_size=LEFT_CONTEXT_FRAMES,
                )
        samples: np.ndarray = waveform[0, 0].float().cpu().numpy()
        return samples

    def batch_key(self, request: StageDiffusionCoreRequest) -> Hashable | None:
        """Chunks of one length and left context decode together (a streamed answer's
        chunks are all 25 + 25 frames but its first and last): code2wav is convolutional,
        each row of the batch its own. A whole answer longer than one decoding chunk runs
        alone, chunked."""
        hand_off = request.inputs.get(INPUT)
        if hand_off is None or len(hand_off.handle.shape) != 2:
            return None
        frames = hand_off.handle.shape[0]
        if not 0 < frames <= CHUNK_FRAMES:
            return None
        return (frames, hand_off.meta.get("context", 0))

    def _run_batch(
        self,
        requests: list[StageDiffusionCoreRequest],
        params: list[Any],
        all_aborted: Callable[[], bool],
        emit: PartialEmit | None,
    ) -> list[np.ndarray]:
        import torch

        batch = [self.fetch(request, INPUT, dtype=torch.long) for request in requests]
        if all_aborted():
            raise RequestAbortedError
        for codes in batch:
            self._check_codes(codes)
        context = requests[0].inputs[INPUT].meta.get("context", 0)
        with torch.inference_mode():
            waveforms = self.model(torch.stack([codes.T for codes in batch]).long())
        kept = waveforms[:, 0, context * self.samples_per_frame :].float().cpu().numpy()
        return [row.copy() for row in kept]

    def _check_codes(self, codes: Any) -> None:
        """CodesOutOfRangeError naming the first code outside the codebook: the embedding
        lookup would index another quantizer's rows or fail on the device."""
        outside = (codes < 0) | (codes >= self.codebook_size)
        if not bool(outside.any()):
            return
        frame, quantizer = (int(i) for i in outside.nonzero()[0])
        raise CodesOutOfRangeError(
            f"inputs.{INPUT}: code {int(codes[frame, quantizer])} at frame {frame}, quantizer "
            f"{quantizer} is outside the codebook [0, {self.codebook_size}) "
            f"({int(outside.sum())} such codes)"
        )


def _local_checkpoint(model: str) -> str:
    """``model`` if it is a directory; else the hub id's snapshot in HF_HOME, with only
    what code2wav reads: the config, the index, and the shards holding ``code2wav.``
    tensors (the real checkpoint's are a few of its many; the thinker and talker stages
    fetch theirs)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    # First the small files, to learn from the index which shards hold code2wav.
    path: str = snapshot_download(model, allow_patterns=["config.json", _INDEX])
    shards = _code2wav_shards(path) if os.path.isfile(os.path.join(path, _INDEX)) else []
    # A checkpoint without an index is one file, which holds everything.
    path = snapshot_download(
        model, allow_patterns=["config.json", _INDEX, *(shards or [_SINGLE_FILE])]
    )
    return path


def _code2wav_shards(checkpoint: str) -> list[str]:
    """The files of ``checkpoint`` holding its ``code2wav.`` tensors, by its index if it
    has one, else its one safetensors file."""
    index = os.path.join(checkpoint, _INDEX)
    if not os.path.isfile(index):
        return [_SINGLE_FILE]
    with open(index) as f:
        weight_map: dict[str, str] = json.load(f).get("weight_map", {})
    return sorted({shard for key, shard in weight_map.items() if key.startswith(_PREFIX)})


def _code2wav_weights(checkpoint: str) -> dict[str, Any]:
    """The ``code2wav.`` tensors of ``checkpoint`` (a local directory), by their names in
    the code2wav model (the prefix stripped), read from only the files holding them."""
    from safetensors import safe_open

    weights: dict[str, Any] = {}
    for shard in _code2wav_shards(checkpoint):
        file = os.path.join(checkpoint, shard)
        if not os.path.isfile(file):
            raise InvalidRequestError(f"model: {checkpoint} has no {shard}", "model")
        with safe_open(file, framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                if key.startswith(_PREFIX):
                    weights[key.removeprefix(_PREFIX)] = tensors.get_tensor(key)
    return weights
