"""Which size of the gang a placement takes, table-driven: the plans at each size -> the one chosen."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshtrain import placement
from meshtrain.api import elastic, loading
from meshtrain.operator.policy import memory_admission, placement_outcome
from tests.unit.test_operator_running import ELASTIC

SPEC = loading.parse_spec(ELASTIC.raw())  # dp4, allowed down to dp2
CHOICE = memory_admission.Choice(None, "the operator default")
REFUSED = memory_admission.Refused(CHOICE, "WontFit", "needs 90 GiB", {})
FITS = placement.Placement(("n0",), {"nvlink": 0.0}, 0.0, (), {})
NO_ROOM = placement.Unschedulable(placement.INSUFFICIENT_GPUS, "needs 4 GPUs, 3 free")


def sized(data: int, answer: str) -> placement_outcome.Sized:
    """The plan at data-parallel degree ``data``: ``fits``, ``no room`` or refused by ``memory``."""
    verdict = REFUSED if answer == "memory" else None
    found = {"fits": FITS, "no room": NO_ROOM, "memory": None}[answer]
    return placement_outcome.Sized(elastic.size_at(SPEC, data), SPEC, verdict, found, [])


CASES = [
    # name, the answers at 4, 3, 2 (largest first), the degree chosen
    ("the largest that fits", ["fits", "fits", "fits"], 4),
    ("the first that fits, largest first", ["no room", "fits", "fits"], 3),
    ("a size refused by memory is passed over", ["memory", "no room", "fits"], 2),
    ("none fits: the largest size's reason", ["no room", "no room", "no room"], 4),
    (
        "none fits: the first a plan answered, not a memory refusal",
        ["memory", "no room", "memory"],
        3,
    ),
    ("memory refuses every size: the largest's refusal", ["memory", "memory", "memory"], 4),
]


@pytest.mark.parametrize(("name", "answers", "chosen"), CASES, ids=[c[0] for c in CASES])
def test_the_size_chosen(name, answers, chosen):
    tried = [sized(data, answer) for data, answer in zip((4, 3, 2), answers, strict=True)]
    found = placement_outcome.choose(tried)
    assert found.size is not None and found.size.data == chosen


def test_sizes_below_the_first_that_fits_are_not_planned():
    def plans() -> Iterator[placement_outcome.Sized]:
        yield sized(4, "no room")
        yield sized(3, "fits")
        raise AssertionError("planned a size below one that fits")

    assert placement_outcome.choose(plans()).answer is FITS


def test_a_job_without_elastic_sizes_takes_its_one_answer():
    only = placement_outcome.Sized(None, SPEC, None, NO_ROOM, ["n1: Insufficient nvidia.com/gpu"])
    assert placement_outcome.choose([only]) is only
