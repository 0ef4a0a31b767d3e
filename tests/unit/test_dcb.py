"""The NIC DSCP -> priority map: the pure parts, and the dcb backend against a fake dcb."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from pathlib import Path

import pytest

from netshaper import dcb, ethtool

FAKE_DCB = str(Path(__file__).parents[1] / "fakes" / "dcb")


def ether(netdev: str) -> int:
    """Every netdev an Ethernet port (ARPHRD_ETHER): no read of the host's netdevs."""
    return 1


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "state.json").write_text(json.dumps({"eth2": [[26, 1], [48, 6]], "eth3": []}))
    monkeypatch.setenv("FAKE_DCB_DIR", str(tmp_path))
    return tmp_path


def calls(root: Path) -> list[list[str]]:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table(root: Path, dev: str) -> list[list[int]]:
    return list(json.loads((root / "state.json").read_text())[dev])


def test_map_from_tags_and_levels() -> None:
    m = dcb.dscp_prio_map({"a": 26, "b": 34, "c": 10}, {"a": 0, "b": 2}, dcb.DEFAULT_LEVEL_PRIOS)
    assert m == {26: 7, 34: 5}
    with pytest.raises(ValueError, match="x: has level 1 but no DSCP tag"):
        dcb.dscp_prio_map({}, {"x": 1}, dcb.DEFAULT_LEVEL_PRIOS)
    with pytest.raises(ValueError, match="a: level 3 has no NIC priority"):
        dcb.dscp_prio_map({"a": 26}, {"a": 3}, (3, 3, 3))
    with pytest.raises(ValueError, match=r"level_prios\[1\] must be in \[0, 7\]"):
        dcb.dscp_prio_map({}, {}, (3, 9))


def test_only_differing_entries_change() -> None:
    current = {26: (1,), 34: (5,), 40: (2, 3), 48: (6,)}
    assert dcb.map_changes(current, {26: 1, 34: 6, 40: 2, 10: 0}) == {10: 0, 34: 6, 40: 2}
    assert dcb.map_changes(current, {26: 1}) == {}


def test_parse_dcb_json() -> None:
    assert dcb.parse_app_json('{"dscp_prio":[[26,3],[26,4],[48,6]]}') == {26: (3, 4), 48: (6,)}
    assert dcb.parse_app_json('{"dscp_prio":[{"dscp":1,"prio":2}]}') == {1: (2,)}
    assert dcb.parse_app_json("{}") == {}
    with pytest.raises(ValueError):
        dcb.parse_app_json('{"dscp_prio":[7]}')


def test_dcb_backend_writes_only_what_differs(fake: Path) -> None:
    backend = dcb.DcbAppBackend(FAKE_DCB)
    assert backend.current("eth2") == {26: (1,), 48: (6,)}
    result = backend.apply("eth2", {26: 7, 34: 6})
    assert result.changed == {26: 7, 34: 6}
    assert calls(fake)[-1] == ["app", "replace", "dev", "eth2", "dscp-prio", "26:7", "34:6"]
    assert table(fake, "eth2") == [[26, 7], [34, 6], [48, 6]]  # the CNP entry stays

    before = len(calls(fake))
    assert backend.apply("eth2", {26: 7, 34: 6}).changed == {}
    assert calls(fake)[before:] == [["-j", "app", "show", "dev", "eth2", "dscp-prio"]]  # read only

    assert backend.apply("eth2", {26: 7, 34: 2}).changed == {34: 2}
    assert calls(fake)[-1] == ["app", "replace", "dev", "eth2", "dscp-prio", "34:2"]
    assert table(fake, "eth2") == [[26, 7], [34, 2], [48, 6]]


def test_dcb_backend_in_a_netns_passes_n(fake: Path) -> None:
    dcb.DcbAppBackend(FAKE_DCB, netns="rdma0").apply("eth3", {10: 3})
    assert calls(fake)[-1] == ["-n", "rdma0", "app", "replace", "dev", "eth3", "dscp-prio", "10:3"]


def test_dcb_errors_name_the_netdev(fake: Path) -> None:
    backend = dcb.DcbAppBackend(FAKE_DCB)
    with pytest.raises(
        dcb.DcbError, match="eth9: app show failed \\(exit 1\\): Attribute read: No such device"
    ) as err:
        backend.apply("eth9", {26: 7})
    assert err.value.netdev == "eth9" and "-j app show dev eth9" in err.value.command
    with pytest.raises(dcb.DcbError, match="eth2: cannot run"):
        dcb.DcbAppBackend(str(fake / "no-such-dcb")).current("eth2")


def test_dry_run_prints_changes_only() -> None:
    lines: list[str] = []
    backend = dcb.DryRunBackend(lines.append)
    backend.apply("eth2", {26: 7, 34: 6})
    backend.apply("eth2", {26: 7, 34: 6})
    backend.apply("eth2", {26: 5, 34: 6})
    assert lines == [
        "dcb app replace dev eth2 dscp-prio 26:7 34:6",
        "dcb app replace dev eth2 dscp-prio 26:5",
    ]


def test_nic_map_writes_every_netdev_and_reports_failures(fake: Path) -> None:
    nic = dcb.NicMap(dcb.DcbAppBackend(FAKE_DCB), ["eth2", "eth3"], link_type=ether)
    written = nic.apply({26: 7, 48: 6})
    assert written == [
        dcb.MapResult("eth2", {26: 7}, {26: (1,)}),
        dcb.MapResult("eth3", {26: 7, 48: 6}),
    ]
    assert [line for result in written for line in result.lines()] == [
        "eth2: DSCP 26 -> prio 7 (was 1)",
        "eth3: DSCP 26 -> prio 7 (was none)",
        "eth3: DSCP 48 -> prio 6 (was none)",
    ]
    assert nic.apply({26: 7, 48: 6}) == []
    broken = dcb.NicMap(dcb.DcbAppBackend(FAKE_DCB), ["eth9", "eth3"], link_type=ether)
    with pytest.raises(dcb.DcbError, match="eth9: 1 of 2 netdev") as err:
        broken.apply({26: 5})
    assert "eth9: app show failed (exit 1): Attribute read: No such device" in str(err.value)
    assert table(fake, "eth3") == [[26, 5], [48, 6]]  # the healthy netdev was still written
    assert err.value.failed == ("eth9",)
    assert err.value.written == (dcb.MapResult("eth3", {26: 5}, {26: (7,)}),)
    with pytest.raises(ValueError, match="DSCP 64"):
        nic.apply({64: 1})


def test_the_loopback_under_another_name_gets_no_map_and_the_others_still_do(fake: Path) -> None:
    """``ip link set lo name lb0`` and lb0 in traffic.rdma_interfaces: the name passes the
    config's check, the kernel's link type (ARPHRD_LOOPBACK) does not, so dcb is never run
    (nor printed) for it, and eth3's map is written."""
    link_type = {"lb0": 772, "eth3": 1}.get
    nic = dcb.NicMap(dcb.DcbAppBackend(FAKE_DCB), ["lb0", "eth3"], link_type=link_type)
    with pytest.raises(dcb.DcbError) as refused:
        nic.apply({26: 5})
    said = str(refused.value)
    assert said.startswith("lb0: 1 of 2 netdev(s) not written"), said
    assert "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0: it has no NIC" in said
    assert all("lb0" not in call for call in calls(fake))
    assert table(fake, "eth3") == [[26, 5]]
    lines: list[str] = []
    dry = dcb.NicMap(dcb.DryRunBackend(lines.append), ["lb0", "eth3"], link_type=link_type)
    with pytest.raises(dcb.DcbError, match="named lb0"):
        dry.apply({26: 5})
    assert lines == ["dcb app replace dev eth3 dscp-prio 26:5"]


def test_a_netdev_made_again_since_its_last_write_says_its_ifindex_and_the_one_before(
    fake: Path,
) -> None:
    """eth3 deleted and created again (a driver reset, its VF re-made) between two applies:
    another ifindex under the same name, in the result of the write that put its map back."""
    indexes = {"eth2": 4, "eth3": 5}
    nic = dcb.NicMap(
        dcb.DcbAppBackend(FAKE_DCB), ["eth2", "eth3"], link_type=ether, ifindex=indexes.get
    )
    assert [r.remade for r in nic.apply({26: 7})] == [None, None]
    indexes["eth3"] = 9
    state = json.loads((fake / "state.json").read_text())
    (fake / "state.json").write_text(json.dumps({**state, "eth3": []}))
    assert nic.apply({26: 7}) == [dcb.MapResult("eth3", {26: 7}, remade=(9, 5))]
    assert nic.apply({26: 6})[1].remade is None  # from then on, the same netdev


def test_an_ifindex_is_the_kernels_and_none_for_no_such_netdev() -> None:
    assert ethtool.ifindex("lo") == socket.if_nametoindex("lo")
    assert ethtool.ifindex("no-such-dev0") is None


class _BreaksOnEth3(dcb.DryRunBackend):
    def apply(self, netdev: str, want: Mapping[int, int]) -> dcb.MapResult:
        if netdev == "eth3":
            raise RuntimeError("dcb: lost its netlink socket")
        return super().apply(netdev, want)


def test_an_unexpected_error_on_one_netdev_keeps_what_the_others_wrote() -> None:
    """eth2 written, eth3's backend raises something other than DcbError, eth4 written: the
    error names eth3, and eth2's and eth4's writes are still reported."""
    nic = dcb.NicMap(_BreaksOnEth3(lambda line: None), ["eth2", "eth3", "eth4"], link_type=ether)
    with pytest.raises(dcb.DcbError) as err:
        nic.apply({26: 7})
    assert err.value.failed == ("eth3",)
    assert [r.netdev for r in err.value.written] == ["eth2", "eth4"]
    assert "eth3: write failed: RuntimeError('dcb: lost its netlink socket')" in str(err.value)
