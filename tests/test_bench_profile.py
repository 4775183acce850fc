"""bench/profile_decode_step.py's split of overlapping kernel times (importing it needs no GPU)."""

from __future__ import annotations

import pytest

from bench.profile_decode_step import exclusive_us


def test_back_to_back_kernels_keep_their_whole_times():
    assert exclusive_us([(0.0, 5.0), (5.0, 7.0), (9.0, 12.0)]) == [5.0, 2.0, 3.0]


def test_a_dependent_kernel_is_charged_only_past_the_end_of_the_one_before():
    # the second kernel starts (as a programmatic dependent) 2 us before the first ends
    shares = exclusive_us([(0.0, 10.0), (8.0, 15.0), (15.0, 16.0)])
    assert shares == [10.0, 5.0, 1.0]
    assert sum(shares) == 16.0  # the time any kernel ran


def test_intervals_are_split_in_start_order_whatever_order_they_come_in():
    intervals = [(8.0, 15.0), (20.0, 21.0), (0.0, 10.0), (1.0, 4.0)]
    assert exclusive_us(intervals) == [5.0, 1.0, 10.0, 0.0]  # the last lies inside the first: nothing


@pytest.mark.parametrize("count", [0, 1])
def test_no_or_one_kernel(count):
    assert exclusive_us([(3.0, 4.5)] * count) == [1.5] * count
