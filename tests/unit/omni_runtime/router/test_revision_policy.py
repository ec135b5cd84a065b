"""Which revision a request runs through (router.revisions): pure, no processes."""

from __future__ import annotations

import pytest

from omni_runtime.router.revisions import (
    NoCompleteRevisionError,
    choose_revision,
    local_revision,
    revision_key,
)

CHAIN = ["encoder", "dit"]


def test_the_newest_complete_revision_wins() -> None:
    live = {"encoder": {"1-aa", "2-bb"}, "dit": {"1-aa", "2-bb"}}
    assert choose_revision(CHAIN, live) == "2-bb"


def test_a_newest_revision_missing_a_stage_is_passed_over() -> None:
    live = {"encoder": {"1-aa", "2-bb"}, "dit": {"1-aa"}}
    assert choose_revision(CHAIN, live) == "1-aa"
    live = {"encoder": {"1-aa"}, "dit": {"1-aa", "2-bb"}}
    assert choose_revision(CHAIN, live) == "1-aa"


def test_order_is_numeric_not_textual() -> None:
    live = {"encoder": {"9-zz", "10-aa"}, "dit": {"9-zz", "10-aa"}}
    assert choose_revision(CHAIN, live) == "10-aa"


def test_no_complete_revision_says_what_each_stage_has() -> None:
    live = {"encoder": {"2-bb"}, "dit": {"1-aa"}}
    with pytest.raises(NoCompleteRevisionError) as refused:
        choose_revision(CHAIN, live)
    message = str(refused.value)
    assert "no pipeline revision has a live replica for every stage" in message
    assert "encoder: 2-bb; dit: 1-aa" in message


def test_a_stage_without_replicas_is_named() -> None:
    with pytest.raises(NoCompleteRevisionError, match=r"no live replica for stage\(s\): dit"):
        choose_revision(CHAIN, {"encoder": {"1-aa"}, "dit": set()})


def test_unparsed_revisions_sort_below_every_parsed_one_and_still_pair() -> None:
    assert revision_key("") < revision_key("0-aa") < revision_key("1-aa")
    assert revision_key("x-1") < revision_key("0-aa")
    assert choose_revision(CHAIN, {"encoder": {""}, "dit": {""}}) == ""
    assert choose_revision(CHAIN, {"encoder": {"", "0-aa"}, "dit": {"", "0-aa"}}) == "0-aa"


def test_equal_orders_are_broken_the_same_way_everywhere() -> None:
    live = {"encoder": {"3-bb", "3-aa"}, "dit": {"3-aa", "3-bb"}}
    assert choose_revision(CHAIN, live) == choose_revision(CHAIN, dict(reversed(live.items())))


def test_a_local_revision_is_the_config_hash_at_order_zero() -> None:
    revision = local_revision('{"stages": []}')
    assert revision == local_revision(b'{"stages": []}')
    assert revision != local_revision('{"stages": [1]}')
    assert revision_key(revision).order == 0
