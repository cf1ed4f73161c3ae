"""The statistics the benchmarks print their ratios with."""

from __future__ import annotations

import pytest

from benchmarks.common import best_of, paired_median


def test_paired_median_is_the_median_of_each_rounds_own_ratio() -> None:
    # Round 2 ran on a loud machine: both sides slowed. Its own ratio (0.5) is still the fleet's share of that round.
    fleet = [9_000.0, 3_000.0, 8_000.0]
    raw = [10_000.0, 6_000.0, 10_000.0]
    assert paired_median(fleet, raw) == pytest.approx(0.8)
    assert best_of(fleet) / best_of(raw) == pytest.approx(0.9)  # best fleet round against best raw round


def test_paired_median_of_an_even_number_of_rounds_averages_the_middle_two() -> None:
    assert paired_median([1.0, 3.0, 2.0, 4.0], [2.0, 2.0, 2.0, 2.0]) == pytest.approx(1.25)


@pytest.mark.parametrize(("fleet", "raw"), [([], []), ([1.0], [1.0, 2.0])])
def test_paired_median_needs_as_many_rounds_on_each_side(fleet: list[float], raw: list[float]) -> None:
    with pytest.raises(ValueError, match="as many rounds"):
        paired_median(fleet, raw)
