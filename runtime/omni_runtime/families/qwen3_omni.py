"""Qwen3-Omni (Qwen3-Omni-30B-A3B-Instruct): one checkpoint served as three stages. The
thinker (a MoE LLM with audio and vision encoders, on vLLM) reads text, images and audio
and writes the answer; the talker (a MoE LLM over codec tokens, on vLLM) reads what the
thinker read and wrote and speaks it as frames of 16 codes; code2wav (a convolutional
vocoder, a diffusion-kind stage of its own engine) turns the frames into a 24 kHz waveform.
Each scales on its own: the thinker's work grows with the prompt, the talker's with the
answer's length, code2wav's with the audio's.

The thinker and talker architectures are in ``omni_runtime.engine.models.qwen3_omni``,
code2wav's engine in ``omni_runtime.diffusion.code2wav_engine``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .base import DiTRecipe, Family, Issue, SpeechRecipe, StageView, TopologyStage
from .graph import GraphEdge, GraphRoute, StageGraph


@dataclass(frozen=True)
class Qwen3OmniFamily(Family):
    def graph(self, stages: Sequence[StageView], async_chunk: bool) -> StageGraph:
        """The thinker answers a text question alone; a spoken answer's text goes to the
        caller as the thinker writes it, its rows to the talker, whose frames go to code2wav
        whole, or chunk by chunk where the pipeline streams (asyncChunk)."""
        ids = tuple(stage.stage_id for stage in sorted(stages, key=lambda s: s.stage_id))
        text = GraphRoute("text", ids[:1])
        hears = frozenset(ids[:1])
        if len(ids) == 1:
            return StageGraph((), (text,), reads_media=hears)
        thinker, talker, code2wav = ids
        edges = (
            GraphEdge(thinker, talker, "hand_off"),
            GraphEdge(talker, code2wav, "stream" if async_chunk else "hand_off"),
        )
        spoken = GraphRoute("audio", ids, text_stage=thinker, live_text=True)
        return StageGraph(
            edges, (text, spoken), caller_params={talker: ("voice",)}, reads_media=hears
        )

    def pipeline_issues(
        self, stages: Sequence[StageView], index_of_id: Mapping[int, int]
    ) -> list[Issue]:
        chain = sorted(stages, key=lambda s: s.stage_id)
        kinds = [(stage.type, stage.output) for stage in chain]
        if kinds in ([("llm", "text"), ("llm", "text"), ("diffusion", None)], [("llm", "text")]):
            return []
        where = f"stages[{index_of_id[chain[-1].stage_id]}]"
        return [
            (
                where,
                "a qwen3-omni pipeline is three stages: the thinker and the talker (type llm, "
                "output text) and then code2wav (type diffusion); or the thinker alone, "
                "which answers in text only",
            )
        ]


QWEN3_OMNI = Qwen3OmniFamily(
    name="qwen3-omni",
    architectures=("Qwen3OmniMoeForConditionalGeneration",),
    encoder=None,
    dit=DiTRecipe(
        pipeline_class="Qwen3OmniMoeCode2Wav",
        text_components=(),
        unsupported_fields=(),
        engine="omni_runtime.diffusion.code2wav_engine:Code2WavEngine",
    ),
    topology=(
        TopologyStage(stage_id=0, name="thinker", type="llm", output="text"),
        TopologyStage(stage_id=1, name="talker", type="llm", output="text"),
        TopologyStage(stage_id=2, name="code2wav", type="diffusion"),
    ),
    hub_ids=("Qwen/Qwen3-Omni-30B-A3B-Instruct",),
    aliases=("qwen3-omni-30b-a3b",),
    # What the thinker sees with a question (each image hundreds of its tokens).
    max_input_images=4,
    speech=SpeechRecipe(
        thinker_architecture="OmniQwen3OmniThinker",
        talker_architecture="OmniQwen3OmniTalker",
        # The talker config's speaker_id; transformers' generate speaks as Ethan by default.
        voices=("ethan", "chelsie", "aiden"),
        sample_rate=24000,
        # Its WhisperFeatureExtractor's rate. A bound on what one request makes the
        # thinker encode: about 13 tokens a second, which must fit its context.
        input_sample_rate=16000,
        max_input_seconds=600.0,
    ),
)
