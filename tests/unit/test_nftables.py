"""NftablesMarker against a scripted ``nft``: the batches it writes for what it reads.

The real program in a network namespace: tests/integration/test_nftables.py."""

from __future__ import annotations

import json
from typing import Any

from netshaper.nftables import CgroupMark, NftablesMarker

MARK = CgroupMark("a", 10, "unified/gpud/gpud-job-a", 2, 4711)


def _rule(handle: int, family: str, comment: str) -> dict[str, Any]:
    return {
        "rule": {
            "family": "inet",
            "table": "gpud",
            "chain": "jobs",
            "handle": handle,
            "comment": comment,
            "expr": [
                {
                    "match": {
                        "op": "==",
                        "left": {"socket": {"key": "cgroupv2"}},
                        "right": MARK.path,
                    }
                },
                {
                    "mangle": {
                        "key": {"payload": {"protocol": family, "field": "dscp"}},
                        "value": MARK.dscp,
                    }
                },
                {"counter": {"packets": 0, "bytes": 0}},
            ],
        }
    }


def _chain(name: str) -> dict[str, Any]:
    return {
        "chain": {
            "family": "inet",
            "table": "gpud",
            "name": name,
            "type": "filter",
            "hook": "output",
            "prio": -150 if name == "jobs" else 0,
            "policy": "accept",
        }
    }


class ScriptedNft:
    """Lists gpud's table as ``items`` (None: no table); records the batches written."""

    def __init__(self, items: list[dict[str, Any]] | None) -> None:
        self.items = items
        self.batches: list[list[str]] = []

    def __call__(self, args: list[str], stdin: str | None) -> tuple[int, str, str]:
        if args[:3] == ["-j", "-n", "list"]:
            if self.items is None:
                return 1, "", "Error: No such file or directory"
            return 0, json.dumps({"nftables": [{"table": {"name": "gpud"}}, *self.items]}), ""
        assert args == ["-f", "-"] and stdin is not None
        self.batches.append(stdin.splitlines())
        return 0, "", ""


def test_a_chain_added_by_hand_is_named_and_the_table_rebuilt_without_it() -> None:
    comments = MARK.comments()
    nft = ScriptedNft(
        [
            _chain("jobs"),
            _chain("zap"),
            _rule(3, "ip", comments["ip"]),
            _rule(4, "ip6", comments["ip6"]),
        ]
    )
    result = NftablesMarker(runner=nft).sync([MARK])
    assert result.foreign == ("zap",)
    assert result.created and result.rebuilt and result.kept == ()
    assert sorted(result.removed) == sorted(result.added) == sorted(comments.values())
    (batch,) = nft.batches
    # added first: a table gone since the read (nft flush ruleset) is no failed delete
    assert batch[:3] == ["add table inet gpud", "delete table inet gpud", "add table inet gpud"]


def test_a_table_in_order_is_left_as_it_is() -> None:
    comments = MARK.comments()
    nft = ScriptedNft(
        [_chain("jobs"), _rule(3, "ip", comments["ip"]), _rule(4, "ip6", comments["ip6"])]
    )
    result = NftablesMarker(runner=nft).sync([MARK])
    assert not result.changed and not result.rebuilt and result.foreign == ()
    assert nft.batches == []


def test_a_first_sync_creates_the_table_and_rebuilds_nothing() -> None:
    nft = ScriptedNft(None)
    result = NftablesMarker(runner=nft).sync([MARK])
    assert result.created and not result.rebuilt and result.removed == ()
    assert "delete table inet gpud" not in nft.batches[0]


def test_a_delete_cannot_fail_on_a_table_gone_since_the_read() -> None:
    nft = ScriptedNft([_chain("jobs")])
    assert NftablesMarker(runner=nft).delete()
    assert nft.batches == [["add table inet gpud", "delete table inet gpud"]]
