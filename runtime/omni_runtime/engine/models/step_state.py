"""Models that keep state per request and say something per request beside their tokens.

vLLM hands a model a step's tokens flattened, with no word of whose they are, and takes
back only logits. Qwen3-Omni's stages need more: the thinker hands the talker two hidden
rows per token it reads, and the talker's next input is not the embedding of the token it
sampled but the sum of that token's and its 15 residual codes' embeddings, the residual
codes coming from a small model of its own run on the talker's last hidden state, plus the
thinker's text row of that step. So a model of this kind (``StepStateModel``) is told, at
each step, which requests its tokens belong to (``StepRequest``), and gives back one tensor
or None per request, which reaches the stage as that request's ``pooling_output`` beside
its sampled token (vLLM's scheduler passes a generating request's pooler output on).

The runner that tells it is vLLM's own, subclassed where vLLM invites it (``_model_forward``
is meant to be overridden, ``sample_tokens`` and ``_update_states`` are its step's ends),
and the worker that builds that runner is named with vLLM's ``worker_cls``. No patch: an
engine of any other architecture runs vLLM's classes as they are. Only vLLM's V1 runner is
subclassed: the CPU build has no Triton, so it always runs V1; a CUDA engine of these
architectures is started with ``VLLM_USE_V2_MODEL_RUNNER=0`` (``engine.models.STEP_STATE_ENV``;
its worker is in step_state_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a step: its tokens are the next ``num_tokens`` of the step's
    flattened batch, at positions from ``num_computed``."""

    request_id: str
    num_tokens: int
    num_computed: int
    # Its SamplingParams.extra_args: what the stage sent beside the prompt.
    extra: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class StepStateModel(Protocol):
    def begin_step(self, requests: Sequence[StepRequest]) -> None:
        """Before the step's forward. Empty for vLLM's warm-up and profiling runs, whose
        tokens are nobody's."""

    def end_step(self) -> list[torch.Tensor | None]:
        """After the step's forward: what each request of ``begin_step`` says, in order."""

    def finish(self, request_ids: Iterable[str]) -> None:
        """These requests ended (finished or aborted): forget them."""


class StepStateRunnerMixin:
    """The runner side: tells a StepStateModel whose tokens a step holds and puts what it
    says into the step's output. A model of any other kind runs as under vLLM's runner."""

    model: Any
    input_batch: Any
    query_start_loc: Any
    requests: dict[str, Any]

    def _step_model(self) -> StepStateModel | None:
        model = getattr(self, "model", None)
        return model if isinstance(model, StepStateModel) else None

    def _update_states(self, scheduler_output: Any) -> Any:
        result = super()._update_states(scheduler_output)  # type: ignore[misc]
        model = self._step_model()
        if model is not None and scheduler_output.finished_req_ids:
            model.finish(scheduler_output.finished_req_ids)
        return result

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._step_model()
        if model is not None:
            model.begin_step(self._step_requests())
        return super()._model_forward(*args, **kwargs)  # type: ignore[misc]

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        model = self._step_model()
        req_ids = getattr(output, "req_ids", None)
        if model is None or not req_ids:
            return output
        said = model.end_step()
        # The output lists the requests in the batch's order, as begin_step had them.
        if len(said) != len(req_ids):
            raise RuntimeError(f"the model said {len(said)} things for {len(req_ids)} requests")
        if any(item is not None for item in said):
            output.pooler_output = said
        return output

    def _step_requests(self) -> list[StepRequest]:
        batch = self.input_batch
        count = batch.num_reqs
        if count == 0:
            return []
        starts = self.query_start_loc.np[: count + 1]
        requests = []
        for index, request_id in enumerate(batch.req_ids[:count]):
            state = self.requests.get(request_id)
            params = getattr(state, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            requests.append(
                StepRequest(
                    request_id,
                    int(starts[index + 1] - starts[index]),
                    int(batch.num_computed_tokens_cpu[index]),
                    extra,
                )
            )
        return requests


class StepStateCPUModelRunner(StepStateRunnerMixin, CPUModelRunner):  # type: ignore[misc]
    pass


class StepStateCPUWorker(CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker with the step-state runner (``worker_cls``)."""

    def init_device(self) -> None:
        super().init_device()
        if not self.use_v2_model_runner:
            # vLLM's runner was just built with no model loaded (cheap): ours replaces it.
            self.model_runner = StepStateCPUModelRunner(self.vllm_config, torch.device("cpu"))
