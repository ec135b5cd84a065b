"""Requests that carry companion prompts (``StageServerRequest.companions``): a stage runs
each companion beside its request, on the same replica, and answers once for all of them.

The router then sends one message where it sent one per prompt (a guided image's encoder
request and its negative prompt's), and the companions' hand-offs lie in the pod of the
request's by construction. ``PromptGroups`` is the bookkeeping alone, on the stage's
outputs: the request's own outputs pass through as they come (but its final one, held until
every companion has finished); a companion's pass only as the hand-offs they add to that
final one, renamed as the request said; the first failure (an error, an abort) answers for
the whole group, whose other prompts are then to be aborted and their outputs dropped, and
whose hand-offs made so far are released.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omni_runtime.engine.stage.stage_core_types import HandOff, StageError, StageServerOutput


@dataclass
class _Group:
    request_id: str
    # The prompts' ids that have not finished (the request's own among them).
    pending: set[str]
    # A companion's id -> its suffix and how its hand-offs are renamed.
    companions: dict[str, tuple[str, Mapping[str, str]]]
    hand_offs: dict[str, HandOff] = field(default_factory=dict)
    # The request's own final output, until every companion has finished.
    held: StageServerOutput | None = None
    # Answered (with every prompt's hand-offs, or a failure): later outputs are dropped.
    answered: bool = False


class PromptGroups:
    """The groups in flight, by request id, and which request each companion belongs to."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._owners: dict[str, str] = {}

    def start(self, request_id: str, companions: Mapping[str, Mapping[str, str]]) -> list[str]:
        """Track ``request_id`` and its companions (suffix -> hand-off renames); returns the
        companions' ids."""
        ids = {f"{request_id}-{suffix}": (suffix, names) for suffix, names in companions.items()}
        self._groups[request_id] = _Group(request_id, {request_id, *ids}, ids)
        for companion_id in ids:
            self._owners[companion_id] = request_id
        return list(ids)

    def owner(self, prompt_id: str) -> str:
        """The request a prompt's outputs answer for: its own id but for a companion's."""
        return self._owners.get(prompt_id, prompt_id)

    def running(self, request_id: str) -> list[str]:
        """The companions of ``request_id`` that have not finished."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        return [prompt_id for prompt_id in group.companions if prompt_id in group.pending]

    def take(self, output: StageServerOutput) -> tuple[StageServerOutput | None, list[str]]:
        """What to answer for ``output`` (None: nothing yet), and, where the group failed,
        the prompts to abort now: the request's own among them, finished or not, so that an
        abort of it releases what its prompts handed off (its answer hands nothing on)."""
        prompt_id = output.request_id
        request_id = self.owner(prompt_id)
        group = self._groups.get(request_id)
        if group is None:
            return output, []
        if not output.finished:
            # The request's own steps go on as they come; a companion speaks only at its end.
            return (output if prompt_id == request_id and not group.answered else None), []
        group.pending.discard(prompt_id)
        answer, abort = self._finished(group, prompt_id, output)
        if not group.pending:
            self._forget(group)
        return answer, abort

    def _finished(
        self, group: _Group, prompt_id: str, output: StageServerOutput
    ) -> tuple[StageServerOutput | None, list[str]]:
        if group.answered:
            return None, []
        if output.error is not None or output.finish_reason in ("abort", "error"):
            group.answered = True
            return self._failure(group, prompt_id, output), sorted(
                group.pending | {group.request_id}
            )
        if prompt_id == group.request_id:
            group.held = output
        else:
            _, names = group.companions[prompt_id]
            for name, hand_off in output.hand_offs.items():
                group.hand_offs[names.get(name, name)] = hand_off
        if group.pending or group.held is None:
            return None, []
        group.answered = True
        answer = group.held
        answer.hand_offs = {**answer.hand_offs, **group.hand_offs}
        return answer, []

    def _failure(
        self, group: _Group, prompt_id: str, output: StageServerOutput
    ) -> StageServerOutput:
        if prompt_id == group.request_id:
            return output
        suffix, _ = group.companions[prompt_id]
        error = output.error
        if error is not None:
            error = StageError(error.code, f"companion {suffix!r}: {error.message}", error.param)
        return StageServerOutput(
            request_id=group.request_id,
            finished=True,
            finish_reason=output.finish_reason,
            error=error,
        )

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for companion_id in group.companions:
            self._owners.pop(companion_id, None)
