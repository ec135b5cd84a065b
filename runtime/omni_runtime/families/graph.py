"""A pipeline as a graph of stages: typed edges, and the route each kind of answer runs.

A family declares its pipelines' graph (``Family.graph``); a pipeline of no family gets the
chain its stages' outputs say (``chain_graph``). The router's executor
(``omni_runtime.router.orchestrator``) runs any such graph and names no stage or family:
what it does at a stage follows from the edge into it and the route it is on.

Edges are typed by what crosses them:
- ``text``: the producer's whole text is the consumer's prompt (an LLM writing the prompt a
  DiT draws);
- ``hand_off``: the producer's arrays, whole, through a connector, under the names the
  consumer reads (an encoder's hidden states, a context's KV cache, a thinker's rows);
- ``stream``: the producer's arrays in chunks as it makes them, each chunk a request of the
  consumer's, all pinned to the replica the first went to (a talker's frames, which
  code2wav decodes chunk by chunk with the frames before each as its left context).

A route is the stages one kind of answer runs, in order along the graph's edges: a spoken
pipeline answers a text-only question from its first stage alone. Its last stage makes the
answer's media (or text, where the answer is text); its ``text_stage`` (where another)
writes the answer's text, which reaches the caller either beside the last stage's final
output (BAGEL's plan beside its image) or, with ``live_text``, as it is written, the last
stage's outputs following, and that stage's finish and usage closing the answer (a spoken
answer's transcript, then its audio).

This module imports nothing but the standard library, as the rest of the package.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

# What crosses an edge (see the module's docstring).
EdgeKind = Literal["text", "hand_off", "stream"]
# What a route answers with.
AnswerKind = Literal["text", "image", "video", "audio"]


class GraphStage(Protocol):
    """What a graph reads of a pipeline's stage (the schema's StageConfig)."""

    @property
    def stage_id(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def output(self) -> str | None: ...


Stage = TypeVar("Stage", bound=GraphStage)


@dataclass(frozen=True)
class GraphEdge:
    """Stage ``source`` feeds stage ``target`` (stage ids) with what ``kind`` says."""

    source: int
    target: int
    kind: EdgeKind


@dataclass(frozen=True)
class GraphRoute:
    """The stages (ids, in the order they run) one kind of answer runs."""

    answer: AnswerKind
    stages: tuple[int, ...]
    # The stage whose text is the answer's, where it is not the last (None: the last's own).
    text_stage: int | None = None
    # Whether that text reaches the caller as it is written, before the last stage's
    # outputs, its finish and usage closing the answer; False: it comes whole, on the last
    # stage's final output.
    live_text: bool = False


@dataclass(frozen=True)
class StageGraph:
    """A pipeline's stages as its family (or its stages' outputs) connect them."""

    edges: tuple[GraphEdge, ...]
    # The first is the answer a request that asks for no other kind gets.
    routes: tuple[GraphRoute, ...]
    # The caller's per-stage params (by name) a stage takes, by stage id: a talker's voice.
    caller_params: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # The LLM stages that read the caller's images and audio beside its messages (a
    # thinker that sees and hears), by id; elsewhere a caller's images are the DiT's (an
    # encoder reads them where its recipe says).
    reads_media: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # A declaration that breaks these would fail requests, not the pipeline's start.
        issues = self.issues()
        if issues:
            raise ValueError("; ".join(issues))

    def issues(self) -> list[str]:
        """What is wrong with the declaration (empty: nothing)."""
        issues: list[str] = []
        if not self.routes:
            issues.append("a graph has at least one route")
        answers = [route.answer for route in self.routes]
        for answer in sorted(set(answers)):
            if answers.count(answer) > 1:
                issues.append(f"two routes answer with {answer}")
        by_pair = {(edge.source, edge.target): edge for edge in self.edges}
        for route in self.routes:
            where = f"the {route.answer} route"
            if not route.stages:
                issues.append(f"{where} runs no stage")
                continue
            for source, target in itertools.pairwise(route.stages):
                edge = by_pair.get((source, target))
                if edge is None:
                    issues.append(f"{where}: no edge from stage {source} to stage {target}")
                elif edge.kind == "stream" and target != route.stages[-1]:
                    # A consumer of chunks answers each with an output of its own: only
                    # the caller can take them as they come.
                    issues.append(f"{where}: a stream edge ends the route (stage {target})")
            if route.text_stage is not None and route.text_stage not in route.stages[:-1]:
                issues.append(f"{where}: its text stage {route.text_stage} runs before its last")
            if route.live_text and route.text_stage is None:
                issues.append(f"{where}: live text needs a text stage")
        return issues

    def route(self, answer: AnswerKind | None) -> GraphRoute:
        """The route that answers with ``answer`` (None: the first). KeyError if none does."""
        if answer is None:
            return self.routes[0]
        for route in self.routes:
            if route.answer == answer:
                return route
        raise KeyError(answer)

    def edge(self, source: int, target: int) -> GraphEdge:
        """The edge from ``source`` to ``target``; KeyError if there is none."""
        for edge in self.edges:
            if (edge.source, edge.target) == (source, target):
                return edge
        raise KeyError((source, target))

    @property
    def answers(self) -> tuple[AnswerKind, ...]:
        return tuple(route.answer for route in self.routes)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """Every stage some route runs, by id."""
        return tuple(sorted({stage for route in self.routes for stage in route.stages}))


def chain_graph(
    stages: Sequence[Stage],
    diffusion_answer: AnswerKind,
    hands_off: Callable[[Stage], bool],
) -> StageGraph:
    """The stages (by id) as one chain, each feeding the next: by hand-off where
    ``hands_off(producer)``, else by text. It answers with ``diffusion_answer`` where it
    ends in a diffusion stage, whose final output carries the text of the stage before it
    (what an LLM wrote for the DiT, BAGEL's plan); else with text."""
    chain = sorted(stages, key=lambda s: s.stage_id)
    edges = tuple(
        GraphEdge(a.stage_id, b.stage_id, "hand_off" if hands_off(a) else "text")
        for a, b in itertools.pairwise(chain)
    )
    ids = tuple(stage.stage_id for stage in chain)
    if chain and chain[-1].type == "diffusion":
        text_stage = ids[-2] if len(ids) > 1 else None
        route = GraphRoute(diffusion_answer, ids, text_stage=text_stage)
    else:
        route = GraphRoute("text", ids)
    return StageGraph(edges, (route,))


def outputs_hidden_states(stage: GraphStage) -> bool:
    """Whether ``stage`` hands off by its config alone: an LLM that outputs hidden states."""
    return stage.type == "llm" and stage.output == "hidden_states"
