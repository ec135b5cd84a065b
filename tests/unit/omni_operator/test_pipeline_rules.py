"""The operator's own checks (reconciler.parse_spec: the pydantic models, then
placement.check_spec) over tests/pipeline_rules.py, the table the CRD's rules are held to
in tests/cluster/test_crd_validation.py: what one refuses, the other refuses too."""

from __future__ import annotations

import pytest

from omni_operator.reconciler import SpecRefused, parse_spec
from pipeline_rules import INVALID, VALID, RuleCase, ValidCase

# Rules the CRD alone holds: the pipeline's name is metadata, which no spec check sees.
CRD_ONLY = {"pipeline-name-not-dns-1035"}


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_the_operator_refuses_what_the_crd_refuses(case: RuleCase) -> None:
    if case.python is None:
        assert case.id in CRD_ONLY, f"{case.id}: no Python expectation; is it the CRD's alone?"
        parse_spec(case.manifest()["spec"])
        return
    with pytest.raises(SpecRefused) as refused:
        parse_spec(case.manifest()["spec"])
    for text in case.python:
        assert text in str(refused.value), f"{text!r} not in: {refused.value}"


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_the_operator_admits_what_the_crd_admits(case: ValidCase) -> None:
    parse_spec(case.manifest()["spec"])


def test_the_table_covers_the_rules() -> None:
    assert len(INVALID) >= 40
    assert len({case.id for case in INVALID + VALID}) == len(INVALID) + len(VALID)
    assert {case.id for case in INVALID if case.python is None} == CRD_ONLY
