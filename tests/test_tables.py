"""benchmarks/tables.py's statistics: the median's order-statistic interval (its coverage from the
binomial(n, ½) distribution, written out here by hand)."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from tables import median_interval  # noqa: E402


def test_the_median_interval_is_the_narrowest_with_95_percent_coverage():
    values = [float(v) for v in range(1, 16)]  # 15 values in order, shuffled below
    shuffled = values[7:] + values[:7]
    # 15 values: P(X ≤ 3) = (1 + 15 + 105 + 455) / 2^15, so the 4th from each end covers 96.5%;
    # the 5th would cover 1 − 2·(576 + 1365)/2^15 = 88.2%, below 95%
    assert median_interval(shuffled) == (4.0, 12.0, pytest.approx(1 - 2 * 576 / 2**15))
    # 7 values: only min and max reach 95% (1 − 2/2^7); fewer than 6 values cannot
    assert median_interval(values[:7]) == (1.0, 7.0, pytest.approx(1 - 2 / 2**7))
    low, high, cover = median_interval(values[:5])
    assert (low, high) == (1.0, 5.0) and cover == pytest.approx(1 - 2 / 2**5) and cover < 0.95
