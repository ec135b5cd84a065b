"""Which pipeline revision a request runs through: pure functions, no I/O.

While a rollout replaces pods, a stage may have replicas of two configurations at once,
and what one stage hands the next (its template, its layer, its connector) may differ
between them. So a request crosses replicas of ONE revision for every stage of its chain,
companion requests included.

A revision is the text a stage replica advertises in its StageLoad, ``<order>-<hash>``:
``hash`` is the pipeline's config hash (what the operator puts on the pod template as
``omni.dev/config-hash``), ``order`` a non-negative integer that grows with each new
configuration (the OmniPipeline's generation at which the config took its value). One
variable, ``OMNI_PIPELINE_REVISION``, carries both, so that what travels and what is
compared for equality is one opaque token, and its order is read from it without a
second source that could disagree. Locally (``serve``) every replica derives the same
``0-<hash of its config>``.

The router prefers the newest revision that is complete (every stage of the chain has a
replica of it that takes requests); ties of order are broken by the hash, so that every
router picks the same one. A revision that does not parse sorts below every one that
does (a replica of an older runtime advertises "").
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from omni_runtime.pod_contract import REVISION_ENV

__all__ = [
    "REVISION_ENV",
    "NoCompleteRevisionError",
    "RevisionKey",
    "choose_revision",
    "local_revision",
    "revision_key",
]


class NoCompleteRevisionError(RuntimeError):
    """No revision has a replica that takes requests for every stage of the chain."""


@dataclass(frozen=True, order=True, slots=True)
class RevisionKey:
    """How revisions sort: by order, then by hash (the text, for unparsed ones)."""

    order: int
    text: str


def revision_key(revision: str) -> RevisionKey:
    """The sort key of ``revision``; one that is not ``<int>-<hash>`` has order -1."""
    order, sep, _ = revision.partition("-")
    if sep and order.isdigit():
        return RevisionKey(int(order), revision)
    return RevisionKey(-1, revision)


def local_revision(config_text: str | bytes) -> str:
    """The revision of a pipeline served without a cluster: order 0, the config's hash."""
    data = config_text.encode() if isinstance(config_text, str) else config_text
    return f"0-{hashlib.sha256(data).hexdigest()[:16]}"


def choose_revision(chain: Sequence[str], revisions: Mapping[str, Collection[str]]) -> str:
    """The newest revision that every stage of ``chain`` (stage names, in request order)
    has a replica of, where ``revisions`` maps each stage to the revisions of its replicas
    that take requests now. NoCompleteRevisionError saying what each stage has if none."""
    if not chain:
        raise ValueError("a pipeline has at least one stage")
    common = set(revisions.get(chain[0], ()))
    for stage in chain[1:]:
        common &= set(revisions.get(stage, ()))
    if common:
        return max(common, key=revision_key)
    empty = [stage for stage in chain if not revisions.get(stage)]
    if empty:
        raise NoCompleteRevisionError("no live replica for stage(s): " + ", ".join(empty))
    have = "; ".join(
        f"{stage}: {', '.join(sorted(revisions.get(stage, ()), key=revision_key)) or 'none'}"
        for stage in chain
    )
    raise NoCompleteRevisionError(
        "no pipeline revision has a live replica for every stage (a rollout may be "
        f"replacing them; retry shortly); live revisions by stage: {have}"
    )
