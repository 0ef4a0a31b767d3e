"""The what-if tool on both trace formats, and the Weighted Wait-Time Score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpud.admission.wws import percentile, wws
from tools.whatif.__main__ import main
from tools.whatif.traces import TraceError, load, pai_request

DATA = Path(__file__).parent.parent / "data"
PAI = DATA / "traces" / "pai_task_sample.csv"
HISTORY = DATA / "traces" / "gpud_history.json"
GIB = 1 << 30


def test_wws_is_bounded_and_rewards_mean_and_tail() -> None:
    assert wws([], mean_service_s=10.0) == 1.0
    assert wws([0.0, 0.0], mean_service_s=10.0) == 1.0
    # One mean run of wait, mean and p95: each term is 1/2.
    assert wws([10.0, 10.0], mean_service_s=10.0) == pytest.approx(0.5)
    short_tail = wws([1.0] * 19 + [100.0], mean_service_s=10.0)
    no_tail = wws([1.0] * 20, mean_service_s=10.0)
    assert 0.0 < short_tail < no_tail <= 1.0
    assert wws([0.0], mean_service_s=10.0, unfeasible_fraction=0.5) == pytest.approx(0.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0


def test_pai_rows_map_to_requests() -> None:
    trace = load(PAI, gpu_memory_bytes=80 * GIB)
    assert trace.skipped >= 2  # failed / running tasks and the CPU-only one
    assert trace.jobs and all(j.service >= 0 for j in trace.jobs)
    whole = pai_request(400, 80 * GIB)
    assert (whole.gpu_count, whole.memory_bytes, whole.threads_percent) == (4, 80 * GIB, None)
    share = pai_request(25, 80 * GIB)
    assert (share.gpu_count, share.memory_bytes, share.threads_percent) == (1, 20 * GIB, 25)


@pytest.mark.parametrize("trace", [PAI, HISTORY])
def test_more_gpus_never_make_waits_worse(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(trace), "--node-gpus", "8", "--gpus", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    before, after = result["as_is"], result["modified"]
    assert (before["gpus"], after["gpus"]) == (8, 16)
    for side in (before, after):
        assert 0.0 <= side["wws"] <= 1.0
        assert side["p95_wait_s"] >= 0.0
    assert after["mean_wait_s"] <= before["mean_wait_s"]
    assert after["unfeasible_fraction"] <= before["unfeasible_fraction"]
    assert after["wws"] >= before["wws"]


def test_runs_still_going_are_skipped(tmp_path: Path) -> None:
    # `gpuctl jobs history --json` lists a run still holding its devices with a null end
    doc = json.loads(HISTORY.read_text())
    before = load(HISTORY, gpu_memory_bytes=80 * GIB)
    running = dict(doc["records"][0], ended_unix_seconds=None, reservation="r9")
    doc["records"].insert(0, running)
    path = tmp_path / "history.json"
    path.write_text(json.dumps(doc))
    trace = load(path, gpu_memory_bytes=80 * GIB)
    assert (len(trace.jobs), trace.skipped) == (len(before.jobs), before.skipped + 1)


def test_a_mig_layout_makes_mig_jobs_feasible(capsys: pytest.CaptureFixture[str]) -> None:
    mig = DATA / "mig-parted" / "config.yaml"
    argv = [
        str(HISTORY),
        "--node-gpus",
        "8",
        "--mig-config",
        str(mig),
        "-c",
        "all-balanced",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    # As is (whole GPUs) the 3g.40gb run cannot start; all-balanced hosts it, but then no
    # whole GPU is left for the others.
    assert 0.0 < result["as_is"]["unfeasible_fraction"] < result["modified"]["unfeasible_fraction"]
    assert result["modified"]["mig_config"].endswith(":all-balanced")


def test_bad_traces_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    assert main([str(bad)]) == 2
    assert "gpuctl jobs history --json" in capsys.readouterr().err
    short = tmp_path / "short.csv"
    short.write_text("a,b,c\n")
    with pytest.raises(TraceError, match=r"short.csv:1: 3 fields"):
        load(short, gpu_memory_bytes=GIB)


def test_plot_draws_both_distributions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # the "plot" extra
    out = tmp_path / "waits.png"
    assert main([str(PAI), "--gpus", "16", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "WWS" in capsys.readouterr().out
