"""A pod's resources from its components' placements: Kubernetes quantities summed
exactly and written back in canonical form (``1536Mi``, ``1500m``).

Values are read and printed by the official client's ``parse_quantity`` and
``format_quantity``; what is ours is which strings count as quantities (the CRD's
pattern, so that what the apiserver admits and what is summed agree) and which suffix is
canonical, which the client leaves to its caller.
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from kubernetes.utils.quantity import format_quantity, parse_quantity

from ..api import QUANTITY_PATTERN, Placement, Quantity
from ..placement import GPU_RESOURCE

_QUANTITY = re.compile(QUANTITY_PATTERN)
# Suffixes by exponent, largest first: the canonical form takes the first that keeps the
# value whole.
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))
_DECIMAL = (
    ("E", 18),
    ("P", 15),
    ("T", 12),
    ("G", 9),
    ("M", 6),
    ("k", 3),
    ("", 0),
    ("m", -3),
    ("u", -6),
    ("n", -9),
)
# Digits enough for every quantity a pod can ask for to be summed exactly (Decimal's
# default, 28, would round a large one written to the nano).
_PRECISION = 60


@dataclass(frozen=True)
class ReadQuantity:
    value: Decimal
    binary: bool  # written with a binary suffix (Ki, Mi, ...): written back that way


def read_quantity(quantity: Quantity) -> ReadQuantity | None:
    """A Kubernetes quantity ('500m', '1.5Gi', '1e3', 2) exactly; None if it is not one."""
    if isinstance(quantity, bool):
        return None
    text = str(quantity).strip()
    # The client's parser is laxer than the apiserver ('1 Gi', 'NaN', '1_000'): only what
    # the CRD's pattern admits is read.
    if not _QUANTITY.fullmatch(text):
        return None
    with decimal.localcontext(prec=_PRECISION):
        value = Decimal(parse_quantity(text))
    return ReadQuantity(value, binary=text.endswith("i"))


def canonical_quantity(value: Decimal, *, binary: bool) -> str:
    """``value`` in Kubernetes' canonical form: the largest suffix that keeps it whole."""
    with decimal.localcontext(prec=_PRECISION):
        if binary and value == value.to_integral_value() and abs(value) >= 1024:
            whole = int(value)
            for suffix, power in _BINARY:
                if whole % 2**power == 0:
                    return _format(Decimal(whole), suffix)
            return str(whole)
        # Kubernetes keeps nothing finer than 1n, rounding up.
        nanos = int((value * 10**9).to_integral_value(rounding=decimal.ROUND_CEILING))
        if nanos == 0:
            return "0"
        for suffix, exponent in _DECIMAL:
            if nanos % 10 ** (exponent + 9) == 0:
                return _format(Decimal(nanos // 10 ** (exponent + 9)).scaleb(exponent), suffix)
    raise AssertionError("unreachable: every value in nanos is whole in n")


def _format(value: Decimal, suffix: str) -> str:
    if not suffix:
        return str(int(value))
    # Whole in this suffix (the caller checked): quantize drops the digits after the point.
    return str(format_quantity(value, suffix, quantize=Decimal(1)))


def sum_quantities(quantities: Sequence[Quantity]) -> str:
    """The sum of ``quantities``, canonical; a single one as written; when one does not
    parse, the first as written (the apiserver then says what is wrong with it)."""
    if len(quantities) == 1:
        return str(quantities[0])
    parsed = [read_quantity(q) for q in quantities]
    if any(p is None for p in parsed):
        return str(quantities[0])
    values = [p for p in parsed if p is not None]
    with decimal.localcontext(prec=_PRECISION):
        total = sum((p.value for p in values), Decimal(0))
    return canonical_quantity(total, binary=values[0].binary)


def pod_resources(placements: Sequence[Placement], gpu_count: int) -> dict[str, dict[str, str]]:
    """The container resources of a pod running components with ``placements``: each
    resource's requests summed, a component that gives only a limit requesting its limit
    (as Kubernetes would), and limits summed; ``gpu_count`` GPUs requested and limited."""
    requests: dict[str, list[Quantity]] = {}
    limits: dict[str, list[Quantity]] = {}
    for placement in placements:
        given = placement.resources
        for name in sorted(set(given.requests) | set(given.limits)):
            requests.setdefault(name, []).append(
                given.requests.get(name, given.limits.get(name, 0))
            )
        for name, quantity in sorted(given.limits.items()):
            limits.setdefault(name, []).append(quantity)
    result = {
        kind: {
            name: sum_quantities(values)
            for name, values in sorted(found.items())
            if name != GPU_RESOURCE
        }
        for kind, found in (("requests", requests), ("limits", limits))
    }
    if gpu_count:
        for values in result.values():
            values[GPU_RESOURCE] = str(gpu_count)
    return {kind: values for kind, values in result.items() if values}
