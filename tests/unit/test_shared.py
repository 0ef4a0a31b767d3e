"""gpud.shared: what gpuctl and the daemon write the same way."""

from __future__ import annotations

import pytest

from gpud.shared import format_number


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0.01, "0.01"),
        (1e7, "1e+07"),
        (3_600_001.0, "3600001"),
        (1.0000001, "1.0000001"),
        (86400.5, "86400.5"),
        (-5.0, "-5"),
        (float("nan"), "nan"),
        (float("-inf"), "-inf"),
        (7, "7"),
    ],
)
def test_a_refused_number_is_written_with_every_digit_it_has(value: float, words: str) -> None:
    assert format_number(value) == words
