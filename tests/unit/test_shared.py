"""gpud.shared: what gpuctl and the daemon write the same way."""

from __future__ import annotations

import pytest

from gpud.cli import output
from gpud.shared import first_few, format_number, is_about


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


def test_an_event_about_many_jobs_is_about_each_it_names() -> None:
    """A net.untagged event for the jobs past the first few of a pass names them all in
    ``names``: ``gpuctl events --job`` finds it for each."""
    fields = {"jobs": 3, "names": ["j1", "j2", "j3"]}
    assert is_about(fields, job="j3") and is_about(fields, job="")
    assert not is_about(fields, job="j4")
    assert not is_about({"names": "j1j2"}, job="j1")  # no list: no names
    assert is_about({"job": "a"}, job="a") and not is_about({"job": "a"}, job="b")


def test_first_few_names_what_fits_and_says_when_there_are_more() -> None:
    assert first_few([], 2) == ""
    assert first_few(["a", "b"], 2) == "a, b"
    assert first_few([1, 2, 3], 2) == "1, 2, ..."


def test_a_table_cell_shortens_a_list_under_its_own_name_not_a_messages() -> None:
    # two forms, two names: importing the one a module does not mean fails, not misprints
    assert not hasattr(output, "first_few")
    assert output.cell_first_few(["a", "b", "c"], 2) == "a,b,... (+1 more)"
    assert first_few(["a", "b", "c"], 2) == "a, b, ..."
