"""FIFO with backfill: the head of the queue is never delayed (hypothesis), and FIFO order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.admission.model import NO_JOB, Device, Holding, Loads, Request, Vec
from gpud.admission.placement_fit import PlacementFit
from gpud.admission.queue import Queued, Start, admission_pass, harmless
from gpud.shared import MAX_THREADS_PERCENT

GIB = 1 << 30

requests = st.one_of(
    st.builds(
        Request,
        gpu_count=st.integers(1, 3),
        memory_bytes=st.sampled_from([None, 10 * GIB, 20 * GIB, 40 * GIB, 80 * GIB]),
        threads_percent=st.sampled_from([None, 25, 50, 100]),
    ),
    st.builds(
        Request,
        mig_profile=st.just("1g.10gb"),
        memory_bytes=st.sampled_from([5 * GIB, 10 * GIB]),
        threads_percent=st.sampled_from([None, 50]),
    ),
    st.builds(
        Request,
        devices=st.sampled_from([("GPU-0",), ("GPU-1",), ("GPU-0", "GPU-1")]),
        memory_bytes=st.sampled_from([20 * GIB, 60 * GIB]),
    ),
)


@st.composite
def nodes(draw: st.DrawFn) -> list[Device]:
    gpus = draw(st.integers(2, 4))
    # a GPU may have an MPS default memory limit: what a request without one asks there
    devices = [
        Device(
            f"GPU-{i}",
            i,
            None,
            "H100",
            Vec(draw(st.sampled_from([40, 80])) * GIB, 100),
            default_memory=draw(st.sampled_from([None, 20 * GIB, 30 * GIB])),
        )
        for i in range(gpus)
    ]
    for j in range(draw(st.integers(0, 3))):
        devices.append(Device(f"MIG-{gpus}-{j}", gpus, j, "1g.10gb", Vec(10 * GIB, 100)))
    return devices


# a run's user where MPS serves the devices (None: unknown), and its job's name: runs of
# one job count once on a device, and a device serving a user orders the devices that fit
uids = st.sampled_from([None, 1000, 1001])
job_names = st.sampled_from(["t", "u", "v"])
runs = st.tuples(requests, uids, job_names)


def holding(
    fit: PlacementFit,
    job: str,
    devices: tuple[str, ...],
    r: Request,
    *,
    uid: int | None = None,
    name: str | None = None,
) -> list[Holding]:
    """What ``r`` holds on each of ``devices``: its limits, else each one's MPS default."""
    by_uuid = {d.uuid: d for d in fit.devices()}
    return [Holding(job, (u,), r.on(by_uuid[u]), uid, name=name or job) for u in devices]


def place(fit: PlacementFit, r: Request, loads: Loads, uid: int | None) -> tuple[str, ...] | None:
    """Where ``r`` of user ``uid`` goes beside ``loads``: never a device another known
    user's run holds, as the reservation's own placement keeps users apart under MPS."""
    others = {u for u, seen in loads.users.items() if any(i != uid for i, _ in seen)}
    allowed = None if uid is None else {d.uuid for d in fit.devices()} - others
    return fit.place(r, loads.total, allowed=allowed, names=loads.names, users=loads.users, uid=uid)


def running(fit: PlacementFit, wanted: list[tuple[Request, int | None, str]]) -> list[Holding]:
    loads = Loads()
    out = []
    for i, (r, uid, name) in enumerate(wanted):
        devices = place(fit, r, loads, uid)
        if devices is not None:
            for h in holding(fit, f"r{i}", devices, r, uid=uid, name=name):
                loads.add(h)
                out.append(h)
    return out


@settings(max_examples=300, deadline=None)
@given(
    node=nodes(),
    wanted=st.lists(runs, max_size=10),
    queued=st.lists(runs, min_size=1, max_size=10),
    order=st.randoms(use_true_random=False),
)
def test_backfill_never_delays_the_head(node, wanted, queued, order) -> None:
    fit = PlacementFit(node)
    holdings = running(fit, wanted)
    queue = [
        Queued(f"q{i}", r, i, 0.0, uid=uid, name=name) for i, (r, uid, name) in enumerate(queued)
    ]
    by_id = {q.id: q for q in queue}

    def held(starts: list[Start]) -> list[Holding]:
        out = []
        for s in starts:
            q = by_id[s.id]
            out += holding(fit, s.id, s.devices, q.request, uid=q.uid, name=q.name)
        return out

    first = admission_pass(queue, fit, holdings, backfill=True)
    if first.head is None:
        return
    head = next(q for q in queue if q.id == first.head)
    fifo = admission_pass(queue, fit, holdings, backfill=False)
    assert fifo.head == first.head
    assert [s.id for s in fifo.starts] == [s.id for s in first.starts if not s.backfilled]
    # The FIFO world holds only what started ahead of the head; the backfill world also holds
    # the backfilled jobs, never releases them, and backfills again after every release.
    started = {s.id for s in first.starts}
    fifo_held = holdings + held(fifo.starts)
    bf_held = holdings + held(first.starts)
    waiting = [q for q in queue if q.id not in started]
    releases = sorted({h.job for h in holdings})
    order.shuffle(releases)
    for gone_job in releases:
        fifo_held = [h for h in fifo_held if h.job != gone_job]
        bf_held = [h for h in bf_held if h.job != gone_job]
        fifo_fits = place(fit, head.request, Loads.of(fifo_held), head.uid) is not None
        step = admission_pass(waiting, fit, bf_held, backfill=True)
        bf_started = {s.id for s in step.starts}
        if fifo_fits:
            assert head.id in bf_started, "backfill delayed the head"
            return
        assert head.id not in bf_started or fifo_fits is False
        bf_held += held(step.starts)
        waiting = [q for q in waiting if q.id not in bf_started]
        if head.id in bf_started:
            return


def test_fifo_starts_in_order_and_stops_at_the_head() -> None:
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(2)]
    fit = PlacementFit(node)
    whole = Request(gpu_count=1, memory_bytes=80 * GIB)
    pair = Request(gpu_count=2, memory_bytes=80 * GIB)
    queue = [
        Queued("a", whole, 0, 0.0),
        Queued("b", pair, 1, 0.0),
        Queued("c", whole, 2, 0.0),
    ]
    result = admission_pass(queue, fit, [], backfill=True)
    assert [s.id for s in result.starts] == ["a"]
    assert result.head == "b"  # "c" would take the GPU "b" waits for: not harmless


def test_backfill_uses_what_the_head_cannot() -> None:
    node = [
        Device("GPU-0", 0, None, "H100", Vec(80 * GIB, 100)),
        Device("MIG-1-0", 1, 0, "1g.10gb", Vec(10 * GIB, 100)),
    ]
    fit = PlacementFit(node)
    held = [Holding("x", ("GPU-0",), Vec(80 * GIB, 0), name="x")]
    queue = [
        Queued("big", Request(gpu_count=1, memory_bytes=80 * GIB), 0, 0.0),
        Queued("small", Request(mig_profile="1g.10gb", memory_bytes=10 * GIB), 1, 0.0),
    ]
    result = admission_pass(queue, fit, held, backfill=True)
    assert result.head == "big"
    assert [(s.id, s.backfilled) for s in result.starts] == [("small", True)]
    assert admission_pass(queue, fit, held, backfill=False).starts == []


def test_unfeasible_jobs_never_block() -> None:
    node = [Device("GPU-0", 0, None, "H100", Vec(80 * GIB, 100))]
    fit = PlacementFit(node)
    queue = [
        Queued("huge", Request(gpu_count=1, memory_bytes=100 * GIB), 0, 0.0),
        Queued("ok", Request(gpu_count=1, memory_bytes=40 * GIB), 1, 0.0),
    ]
    result = admission_pass(queue, fit, [], backfill=False)
    assert [s.id for s in result.starts] == ["ok"]
    assert (
        "100.0GiB" in result.unfeasible["huge"].reason or "GiB" in result.unfeasible["huge"].reason
    )


def test_harmless_checks_every_subset() -> None:
    cap = Vec(80, MAX_THREADS_PERCENT)
    head = Vec(40, 0)
    # Jobs 30 + 30 on the device: alone, either leaves room for the head (30 + 40 <= 80);
    # adding 20 to a lone 30 would not (30 + 20 + 40 > 80).
    assert not harmless(Vec(20, 0), head, [Vec(30, 0), Vec(30, 0)], cap)
    assert harmless(Vec(10, 0), head, [Vec(30, 0), Vec(30, 0)], cap)
    assert harmless(Vec(50, 0), Vec(90, 0), [], cap)  # the head can never use it


def test_a_queued_job_starts_only_where_no_other_user_runs() -> None:
    """Under MPS a control daemon serves one user at a time: a job of a known user starts on
    no device a job of another known user holds, or started on in the same pass."""
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(2)]
    fit = PlacementFit(node)
    ten = Request(gpu_count=1, memory_bytes=10 * GIB)
    held = [
        Holding("x", ("GPU-0",), Vec(10 * GIB, 0), uid=1000, name="x"),
        Holding("y1", ("GPU-1",), Vec(10 * GIB, 0), uid=1001, name="y1"),
        Holding("y2", ("GPU-1",), Vec(10 * GIB, 0), uid=1001, name="y2"),
    ]
    result = admission_pass([Queued("b", ten, 0, 0.0, uid=1001)], fit, held)
    assert [(s.id, s.devices) for s in result.starts] == [("b", ("GPU-1",))]
    queue = [
        Queued("a", ten, 0, 0.0, uid=1000),
        Queued("b", ten, 1, 0.0, uid=1001),
        Queued("c", ten, 2, 0.0, uid=1000),
        Queued("d", ten, 3, 0.0, uid=1002),
        Queued("e", ten, 4, 0.0),  # user unknown: anywhere
    ]
    result = admission_pass(queue, fit, [], backfill=True)
    assert [(s.id, s.devices) for s in result.starts] == [
        ("a", ("GPU-0",)),
        ("b", ("GPU-1",)),
        ("c", ("GPU-0",)),
        ("e", ("GPU-1",)),
    ]
    assert result.head == "d"


def test_backfill_of_another_user_is_harmful_on_the_heads_devices() -> None:
    node = [Device("GPU-0", 0, None, "H100", Vec(80 * GIB, 100))]
    fit = PlacementFit(node)
    held = [Holding("x", ("GPU-0",), Vec(70 * GIB, 0), name="x")]  # of no known user
    head = Queued("h", Request(gpu_count=1, memory_bytes=20 * GIB), 0, 0.0, uid=1000)
    small = Request(gpu_count=1, memory_bytes=5 * GIB)
    other = admission_pass([head, Queued("s", small, 1, 0.0, uid=1001)], fit, held)
    assert other.head == "h" and other.starts == []
    own = admission_pass([head, Queued("s", small, 1, 0.0, uid=1000)], fit, held)
    assert [(s.id, s.backfilled) for s in own.starts] == [("s", True)]


def test_runs_without_limits_spread_over_the_least_held_mig_devices() -> None:
    # Reservations that set no memory and no thread share hold a zero vector: the job count
    # on each device is what keeps the next run off the first device of the list.
    node = [Device(f"MIG-0-{j}", 0, j, "1g.10gb", Vec(10 * GIB, 100)) for j in range(3)]
    fit = PlacementFit(node)
    held = [
        Holding("r1", ("MIG-0-0",), Vec(0, 0), name="j1"),
        Holding("r2", ("MIG-0-0",), Vec(0, 0), name="j2"),
        Holding("r3", ("MIG-0-1",), Vec(0, 0), name="j3"),
    ]
    queue = [
        Queued("a", Request(mig_profile="1g.10gb"), 0, 0.0),
        Queued("b", Request(mig_profile="1g.10gb"), 1, 0.0),
        Queued("c", Request(mig_profile="1g.10gb"), 2, 0.0),
    ]
    result = admission_pass(queue, fit, held, backfill=True)
    assert [(s.id, s.devices) for s in result.starts] == [
        ("a", ("MIG-0-2",)),
        ("b", ("MIG-0-1",)),
        ("c", ("MIG-0-2",)),
    ]


def test_memory_beyond_reservations_is_no_job_on_its_device() -> None:
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(2)]
    fit = PlacementFit(node)
    held = [
        Holding("unreserved:GPU-0", ("GPU-0",), Vec(GIB, 0), name=NO_JOB),  # no job there
        Holding("r1", ("GPU-1",), Vec(0, 0), name="j1"),
    ]
    result = admission_pass([Queued("a", Request(), 0, 0.0)], fit, held, backfill=True)
    assert [s.devices for s in result.starts] == [("GPU-0",)]


def test_runs_of_a_job_count_once_on_their_device() -> None:
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(2)]
    fit = PlacementFit(node)
    held = [
        Holding("r1", ("GPU-0",), Vec(0, 0), name="t"),
        Holding("r2", ("GPU-1",), Vec(0, 0), name="a"),
        Holding("r3", ("GPU-0",), Vec(0, 0), name="t"),
    ]
    queue = [Queued("q", Request(), 0, 0.0, name="b")]
    result = admission_pass(queue, fit, held, backfill=True)
    assert [s.devices for s in result.starts] == [("GPU-0",)]  # one job on each: the first


def test_a_users_runs_share_the_gpu_serving_them_and_leave_the_other_to_another_user() -> None:
    # An MPS control daemon serves one user at a time: a's and b's runs spread over both
    # GPUs would leave c, of another user, nowhere to go.
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(2)]
    fit = PlacementFit(node)
    queue = [
        Queued("a", Request(), 0, 0.0, uid=1000),
        Queued("b", Request(), 1, 0.0, uid=1000),
        Queued("c", Request(), 2, 0.0, uid=2000),
    ]
    result = admission_pass(queue, fit, [], backfill=True)
    assert [(s.id, s.devices) for s in result.starts] == [
        ("a", ("GPU-0",)),
        ("b", ("GPU-0",)),
        ("c", ("GPU-1",)),
    ]
    assert result.head is None


def test_a_users_queued_runs_keep_the_last_idle_gpu_for_another_user() -> None:
    node = [Device(f"GPU-{i}", i, None, "H100", Vec(80 * GIB, 100)) for i in range(4)]
    fit = PlacementFit(node)
    queue = [Queued(f"a{i}", Request(), i, 0.0, uid=1000) for i in range(4)]
    queue.append(Queued("b", Request(), 4, 0.0, uid=2000))
    result = admission_pass(queue, fit, [], backfill=True)
    assert [(s.id, s.devices) for s in result.starts] == [
        ("a0", ("GPU-0",)),
        ("a1", ("GPU-1",)),
        ("a2", ("GPU-2",)),
        ("a3", ("GPU-0",)),
        ("b", ("GPU-3",)),
    ]


def test_a_holding_says_whether_it_is_a_job_in_so_many_words() -> None:
    # a holding left without its job's name would silently count as no job on its device
    with pytest.raises(TypeError, match="name"):
        Holding("r1", ("GPU-0",), Vec(0, 0))  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Holding("r1", ("GPU-0",), Vec(0, 0), 1000, "t")  # type: ignore[misc]
    loads = Loads.of([
        Holding("r1", ("GPU-0",), Vec(0, 0), 1000, name="t"),
        Holding("r2", ("GPU-0",), Vec(0, 0), 1000, name="t"),
        Holding("unreserved:GPU-0", ("GPU-0",), Vec(GIB, 0), name=NO_JOB),
    ])  # fmt: skip
    assert loads.names == {"GPU-0": {"t"}}
    assert loads.users == {"GPU-0": {(1000, "t")}}
