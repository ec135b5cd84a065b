"""The step-state runner on a GPU (step_state.py says what it is for). Apart from the CPU
one because vLLM's CPU build and its CUDA build each import only their own worker.

vLLM's GPU worker builds its runner in ``_make_model_runner``, which it leaves for
subclasses to override. The V1 runner is the one subclassed: the engine runs with
``VLLM_USE_V2_MODEL_RUNNER=0`` (engine.models.STEP_STATE_ENV). Written against vLLM 0.32's
CUDA build and not run here (this machine has no GPU that vLLM's CUDA wheel could use).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from omni_runtime.engine.models.step_state import StepStateRunnerMixin


class StepStateGPUModelRunner(StepStateRunnerMixin, GPUModelRunner):  # type: ignore[misc]
    pass


class StepStateGPUWorker(Worker):  # type: ignore[misc]
    """vLLM's GPU worker with the step-state runner (``worker_cls``)."""

    def _make_model_runner(self) -> GPUModelRunner:
        if self.use_v2_model_runner:
            raise RuntimeError(
                "a step-state architecture needs vLLM's V1 runner: set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        return StepStateGPUModelRunner(self.vllm_config, self.device)
