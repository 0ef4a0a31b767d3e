"""gpud.shared: what gpuctl and the daemon write the same way."""

from __future__ import annotations

import pytest

from gpud.shared import format_number, is_about


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


@pytest.mark.parametrize("gpu", ["²", "\u0661"])
def test_a_gpu_filter_of_other_digits_is_no_index(gpu: str) -> None:
    """``"²".isdigit()`` holds but ``int("²")`` raises, and U+0661 is an Arabic-Indic one:
    neither is a GPU index (ListEvents answered INTERNAL for the first)."""
    assert not is_about({"gpu": 1, "uuid": "GPU-1"}, gpu=gpu, job="")
    assert not is_about({"gpu": 2}, gpu=gpu, job="")
