"""Pipelines as stage graphs: what each family declares, and what a declaration may not say."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_runtime.config.loader import load_pipeline
from omni_runtime.families.graph import GraphEdge, GraphRoute, StageGraph

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def graph_of(example: str, **changes: object) -> StageGraph:
    pipeline = load_pipeline(EXAMPLES / example)
    return pipeline.model_copy(update=changes).graph if changes else pipeline.graph


def test_an_encoder_hands_its_dit_what_it_computed_and_its_text_comes_with_the_image() -> None:
    graph = graph_of("tiny-qwen-image.yaml")
    assert graph.edges == (GraphEdge(0, 1, "hand_off"),)
    assert graph.routes == (GraphRoute("image", (0, 1), text_stage=0),)


def test_bagel_is_the_same_shape_its_plan_the_text() -> None:
    graph = graph_of("tiny-bagel.yaml")
    assert graph.edges == (GraphEdge(0, 1, "hand_off"),)
    assert graph.route(None) == GraphRoute("image", (0, 1), text_stage=0)


def test_a_video_family_answers_with_video() -> None:
    assert graph_of("tiny-wan.yaml").routes == (GraphRoute("video", (0,)),)
    assert graph_of("tiny-hunyuan-video.yaml").route(None).answer == "video"


def test_a_familyless_llm_feeds_its_dit_what_its_output_says() -> None:
    # Hidden states are the DiT's inputs; text would be its prompt.
    pipeline = load_pipeline(EXAMPLES / "tiny-text-to-image.yaml")
    assert pipeline.family_recipe is None
    assert pipeline.graph.edges == (GraphEdge(0, 1, "hand_off"),)
    writer = pipeline.stages[0].model_copy(update={"output": "text"})
    rewritten = pipeline.model_copy(update={"stages": [writer, *pipeline.stages[1:]]})
    assert rewritten.graph.edges == (GraphEdge(0, 1, "text"),)
    assert rewritten.graph.route(None) == GraphRoute("image", (0, 1), text_stage=0)


def test_a_speaking_pipeline_answers_text_from_its_thinker_alone() -> None:
    graph = graph_of("tiny-qwen3-omni.yaml")
    assert graph.route(None) == GraphRoute("text", (0,))
    assert graph.route("audio") == GraphRoute("audio", (0, 1, 2), text_stage=0, live_text=True)
    assert graph.caller_params == {1: ("voice",)}
    # The thinker sees and hears the caller's media.
    assert graph.reads_media == {0}
    assert graph.edge(0, 1).kind == "hand_off"
    # Whole frames, unless the pipeline streams between stages.
    assert graph.edge(1, 2).kind == "hand_off"
    assert graph_of("tiny-qwen3-omni.yaml", async_chunk=True).edge(1, 2).kind == "stream"


def test_a_thinker_alone_has_no_spoken_route() -> None:
    pipeline = load_pipeline(EXAMPLES / "tiny-qwen3-omni.yaml")
    alone = pipeline.model_copy(update={"stages": pipeline.stages[:1]})
    assert alone.graph.answers == ("text",)
    with pytest.raises(KeyError):
        alone.graph.route("audio")


@pytest.mark.parametrize(
    ("edges", "routes", "why"),
    [
        ((), (), "at least one route"),
        ((), (GraphRoute("text", (0,)), GraphRoute("text", (1,))), "two routes answer with text"),
        ((), (GraphRoute("image", (0, 1)),), "no edge from stage 0 to stage 1"),
        (
            (GraphEdge(0, 1, "stream"), GraphEdge(1, 2, "hand_off")),
            (GraphRoute("audio", (0, 1, 2)),),
            "a stream edge ends the route",
        ),
        (
            (GraphEdge(0, 1, "hand_off"),),
            (GraphRoute("image", (0, 1), text_stage=1),),
            "its text stage 1 runs before its last",
        ),
        ((), (GraphRoute("text", (0,), live_text=True),), "live text needs a text stage"),
    ],
)
def test_a_declaration_that_could_not_run_is_refused(
    edges: tuple[GraphEdge, ...], routes: tuple[GraphRoute, ...], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        StageGraph(edges, routes)
