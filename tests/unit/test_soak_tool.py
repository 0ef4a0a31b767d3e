"""tools/soak's arithmetic and clean-up, without a daemon."""

from __future__ import annotations

from pathlib import Path

from tools.soak import Sample, slope, stray_mps_daemons, summary


def _sample(minute: float, rss: float) -> Sample:
    return Sample(minute, rss, rss - 26, rss - 26, 20, 15, 400, int(minute * 60))


def test_slope_is_the_least_squares_fit() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == 2.0
    assert slope([(0, 1)]) == 0.0
    assert slope([(1, 1), (1, 5)]) == 0.0


def test_summary_tells_a_plateau_from_growth() -> None:
    rising_then_flat = [_sample(m, 60 + min(m, 10)) for m in range(0, 21)]
    lines = summary(rising_then_flat).splitlines()
    first, second = lines[1].split(), lines[2].split()
    assert first[:2] == ["first", "half"] and float(first[2]) == 1.0
    assert second[:2] == ["second", "half"] and float(second[2]) == 0.0
    assert summary(rising_then_flat[:3]) == "too few samples for slopes"


def test_stray_mps_daemons_are_those_under_the_run_dir(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    run = tmp_path / "run"
    for pid, env in {
        "10": f"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY={run}/mps/GPU-1\0",
        "11": "CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/GPU-1\0",
        "12": "HOME=/root\0",
    }.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "environ").write_text(env)
    (proc / "13").mkdir()  # gone before its environ was read
    (proc / "self").mkdir()
    assert stray_mps_daemons(run, proc) == [10]
