"""bench/step_profile.py's GPU-busy union, tested on ranges since CI has no GPU (a real profiled
run: tests/test_encode_buckets.py, with bench/train_speed.py --profile)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from step_profile import _union_us  # noqa: E402


@pytest.mark.parametrize(
    "ranges,expected",
    [
        ([], 0.0),
        ([(0, 10), (20, 25)], 15.0),
        ([(0, 10), (5, 15)], 15.0),  # overlapping streams count once
        ([(5, 15), (0, 10), (2, 3)], 15.0),  # unsorted, nested
    ],
)
def test_gpu_busy_is_the_union_of_kernel_ranges(ranges, expected):
    assert _union_us(ranges) == expected
