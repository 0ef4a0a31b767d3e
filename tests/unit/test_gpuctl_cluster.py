"""``gpuctl cluster status`` as an operator reads it, for a node in each state."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path
from typing import Any

from gpud.cli.cluster import problems_state, refused, run_attributes, run_status
from gpud.cli.context import EXIT_PARTIAL, Context
from gpud.cli.output import Output
from gpud.v1 import cluster_pb2 as pb


class Answer(Context):
    """A context whose daemon answers every call with ``response``."""

    def __init__(self, response: pb.GetClusterStatusResponse, *, json_output: bool) -> None:
        self.text = io.StringIO()
        super().__init__(
            socket_path=Path("/run/gpud/gpud.sock"),
            timeout=2.0,
            output=Output(json_output=json_output, stream=self.text),
        )
        self._response = response

    def stub(self, stub_class: Any) -> Any:
        return self

    @property
    def GetClusterStatus(self) -> Any:  # the stub method run_status names
        return None

    def call(self, method: Any, request: object) -> Any:
        return self._response


def status(response: pb.GetClusterStatusResponse) -> str:
    ctx = Answer(response, json_output=False)
    # 11 only where the nodes' problems are unknown or cannot be recorded, or the leader
    # refuses this gpud as a second one under its node name (tested below); an older gpud's
    # answer, without the field, is read from its other fields
    degraded = problems_state(response) not in ("", "ok") or refused(response)
    assert run_status(ctx, argparse.Namespace()) == (EXIT_PARTIAL if degraded else 0)
    return ctx.text.getvalue()


def exit_and_text(response: pb.GetClusterStatusResponse, *, json_output: bool) -> tuple[int, str]:
    ctx = Answer(response, json_output=json_output)
    return run_status(ctx, argparse.Namespace()), ctx.text.getvalue()


def base(**fields: Any) -> pb.GetClusterStatusResponse:
    values: dict[str, Any] = {
        "election": "etcd",
        "node": "n1",
        "leader": "n0",
        "leader_address": "10.0.0.1:7443",
        "leader_source": "election",
        "elected_leader": "n0",
        "elected_leader_address": "10.0.0.1:7443",
        "epoch": 7,
        "mode": "follower",
        "store_ok": True,
        "applied_epoch": 7,
        "applied_seq": 3,
        "last_order_age_seconds": 0.4,
        "grace_seconds": 30.0,
        "jobs": [pb.ClusterJob(job="a", level=1, nodes=["n1"])],
    }
    values.update(fields)
    return pb.GetClusterStatusResponse(**values)


def test_a_follower_on_a_hint_names_the_leader_it_reports_to_and_who_named_it() -> None:
    since = time.time() - 12
    response = base(
        leader="n2",
        leader_address="10.0.0.2:7443",
        leader_source="hint",
        leader_since_unix_seconds=since,
        store_ok=False,
        detail="etcd unreachable at http://10.0.0.9:2379: ConnectionFailedError",
        applied_epoch=9,
        nodes=[pb.ClusterNode(node="n2", report_age_seconds=0.1, jobs=1, applied_epoch=9)],
    )
    text = status(response)
    assert (
        "leader:      n2 at 10.0.0.2:7443, not from etcd: named by n0 when it refused this"
        " node's report; reporting there for 12" in text
    )
    assert (
        "etcd leader: n0 at 10.0.0.1:7443, epoch 7, as this node last read etcd;"
        " n0 does not lead now" in text
    )
    assert "leader:      n0" not in text
    assert "action:      make etcd reachable from this node" in text
    assert "n2    100 ms ago" in text  # the node list, as the hinted leader gave it
    ctx = Answer(response, json_output=True)
    run_status(ctx, argparse.Namespace())
    data = json.loads(ctx.text.getvalue())
    assert (data["leader"], data["leader_source"], data["elected_leader"]) == ("n2", "hint", "n0")
    assert data["leader_since_unix_seconds"] == since and data["epoch"] == 7


def test_each_state_says_what_the_node_does_and_what_to_do() -> None:
    leader = status(base(mode="leader", leading=True, leader="n1", elected_leader="n1"))
    assert "leader:      n1 at 10.0.0.1:7443, epoch 7\n" in leader
    # a leader computes its orders: it does not fall back to its local policy
    assert "applied 400 ms ago" in leader and "local policy after" not in leader
    assert "action:" not in leader

    follower = status(base())
    assert "follower (applying the leader's orders)" in follower
    assert "(local policy after 30.0 s without one)" in follower and "action:" not in follower

    cut_off = status(base(store_ok=False, detail="etcd unreachable"))
    assert "leader:      n0 at 10.0.0.1:7443, epoch 7 (as this node last read etcd)" in cut_off
    assert "action:      make etcd reachable from this node" in cut_off

    holding = status(
        base(mode="holding", last_order_age_seconds=10.0, last_error="leader n0: UNAVAILABLE")
    )
    assert "the last order stays in force; local policy in 20.0 s unless an order" in holding
    assert "action:      make the leader reachable from this node" in holding

    local = status(
        base(mode="local", last_order_age_seconds=45.0, last_error="leader n0: UNAVAILABLE")
    )
    assert "this node's own policy decides; it follows again at the next" in local
    assert "the last order's levels, not in force (the local policy decides):" in local

    refused = status(
        base(
            mode="local",
            applied_epoch=0,
            applied_seq=0,
            last_order_age_seconds=None,
            jobs=[],
            last_error="leader n0 at 10.0.0.1:7443: UNAVAILABLE failed to connect to all"
            " addresses; last error: UNKNOWN: Tls handshake failed (TSI_PROTOCOL_FAILURE)",
        )
    )
    assert "last order:  none yet" in refused and "epoch 0.0, never" not in refused
    assert "action:      the TLS handshake with the leader failed: both certificates" in refused
    assert "make the leader reachable" not in refused

    restarted = status(
        base(
            mode="holding",
            last_order_age_seconds=10.0,
            last_error="leader n0 at 10.0.0.1:7443: FAILED_PRECONDITION n0 does not lead yet: the"
            " leader key still names it, held by its previous run (or another gpud under the"
            " same cluster.node) until that lease expires, within cluster.lease_ttl_s",
        )
    )
    assert "action:      wait: the leader restarted within its previous run's lease" in restarted
    assert "make the leader reachable" not in restarted


TLS_ERROR = (
    "leader n0 at 10.0.0.1:7443: UNAVAILABLE failed to connect to all addresses; last error:"
    " UNKNOWN: ipv4:10.0.0.1:7443: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL:"
    " error:1a000064:ECDSA routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature"
    " failure: OK"
)


def test_a_failed_tls_handshake_shows_in_one_line_and_in_full_in_json() -> None:
    response = base(
        mode="holding",
        last_order_age_seconds=10.0,
        last_error=TLS_ERROR,
        problems=[
            pb.ClusterProblem(
                node="n4", message=TLS_ERROR, since_unix_seconds=time.time(), kind="tls_handshake"
            ),
            pb.ClusterProblem(node="n5", message="older", since_unix_seconds=time.time()),
        ],
    )
    text = status(response)
    short = (
        "leader n0 at 10.0.0.1:7443: UNAVAILABLE: TLS handshake failed (certificate signature"
        " failure; full text: --json)"
    )
    assert f"error:       {short}\n" in text
    assert text.count(short) == 2  # the problems table too
    assert "OPENSSL_internal" not in text and "TSI_PROTOCOL_FAILURE" not in text
    assert "action:      the TLS handshake with the leader failed" in text
    ctx = Answer(response, json_output=True)
    assert run_status(ctx, argparse.Namespace()) == 0
    data = json.loads(ctx.text.getvalue())
    assert data["last_error"] == TLS_ERROR
    assert data["problems"][0]["message"] == TLS_ERROR
    # what each problem is, for scripts; null from a node of an older gpud
    assert [p["kind"] for p in data["problems"]] == ["tls_handshake", None]


def test_an_etcd_that_refuses_is_not_called_unreachable() -> None:
    login = status(
        base(
            mode="local",
            store_ok=False,
            detail="etcd refused the login of user 'gpud' (etcdserver: authentication failed,"
            " invalid user ID or password): check cluster.etcd_username and the password in"
            " cluster.etcd_password_file (/etc/gpud/etcd/password)",
        )
    )
    assert "etcd:        reachable, REFUSES this node's calls (see detail)" in login
    assert "UNREACHABLE" not in login and "make etcd reachable" not in login
    assert "action:      do what the detail says (etcd's user and password" in login

    full = status(
        base(
            mode="local",
            store_ok=False,
            etcd_alarms=["NOSPACE"],
            detail="etcd refused /kv/put: etcd is out of space (alarm NOSPACE) and refuses"
            " every write",
        )
    )
    # out of space, reads work: only its writes are refused
    assert "etcd:        reachable, REFUSES writes: out of space (reads work)" in full
    assert "REFUSES this node's calls" not in full
    assert "action:      free space (etcdctl compact REV" in full
    assert full.count("action:") == 1

    down = status(base(store_ok=False, detail="etcd unreachable at http://10.0.0.9:2379: X"))
    assert "etcd:        UNREACHABLE" in down
    assert "action:      make etcd reachable from this node" in down


def test_a_node_refused_as_a_duplicate_is_told_to_rename_not_to_reach_the_leader() -> None:
    text = status(
        base(
            mode="holding",
            last_order_age_seconds=5.0,
            last_error="leader n0 at 10.0.0.1:7443: FAILED_PRECONDITION node 'n1' is reported"
            " by two gpuds, this one and the one at ipv4:10.0.0.8:54548: give each its own"
            " cluster.node (names compare without case)",
        )
    )
    assert "action:      give each gpud its own cluster.node: another gpud reports" in text
    assert "make the leader reachable" not in text


def test_a_gpud_held_as_a_duplicate_says_it_holds_and_why_and_exits_11() -> None:
    """Two gpuds under one cluster.node: the one the leader refuses holds the last order,
    and its status says so on the mode line and in its exit code, as a script checks it;
    its problem shows under the node's name with the gpud that published it, apart from
    the node's own."""
    error = "leader n0 at 10.0.0.1:7443: FAILED_PRECONDITION node 'n1' is reported by two gpuds"
    now = time.time()
    response = base(
        mode="holding",
        last_order_age_seconds=5.0,
        grace_seconds=30.0,
        last_error=error,
        last_error_kind="duplicate_node",
        problems=[
            pb.ClusterProblem(
                node="n1",
                message="leader n0 at 10.0.0.1:7443: UNAVAILABLE",
                since_unix_seconds=now,
                kind="leader_unreachable",
                gpud="host-a pid 10",
                mode="holding",
            ),
            pb.ClusterProblem(
                node="n1",
                message=error,
                since_unix_seconds=now,
                kind="duplicate_node",
                instance="0f1e2d3c4b5a6978",
                gpud="host-b pid 20",
                mode="holding",
            ),
        ],
    )
    code, text = exit_and_text(response, json_output=False)
    assert code == EXIT_PARTIAL
    assert (
        "mode:        holding (the leader refuses this gpud: another gpud reports as n1; the"
        " last order stays in force; local policy in 25.0 s unless an order comes)"
    ) in text
    rows = [line for line in text.splitlines() if line.startswith("n1 ")]
    assert [row.split("  ")[0] for row in rows] == ["n1", "n1 (host-b pid 20)"]
    assert f"holding: {error}" in text
    assert "holding: leader n0 at 10.0.0.1:7443: UNAVAILABLE" in text
    code, raw = exit_and_text(response, json_output=True)
    data = json.loads(raw)
    assert code == EXIT_PARTIAL
    assert [(p["instance"], p["gpud"], p["mode"]) for p in data["problems"]] == [
        ("", "host-a pid 10", "holding"),
        ("0f1e2d3c4b5a6978", "host-b pid 20", "holding"),
    ]
    # on its local policy after the grace period: still refused, still 11
    code, text = exit_and_text(
        base(mode="local", last_error=error, last_error_kind="duplicate_node"), json_output=False
    )
    assert code == EXIT_PARTIAL
    assert "mode:        local (the leader refuses this gpud: another gpud reports as n1;" in text
    # the gpud the leader takes follows, exit 0
    assert exit_and_text(base(mode="follower"), json_output=False)[0] == 0


NOSPACE_DETAIL = (
    "etcd refused /kv/txn: etcd is out of space (alarm NOSPACE) and refuses every write: no"
    " leader can be elected and no new tag saved, and the last order stays in force; free"
    " space (etcdctl compact REV, then etcdctl defrag), then run etcdctl alarm disarm"
    " (etcdserver: mvcc: database space exceeded)"
)


def test_etcds_state_comes_from_its_field_not_the_details_words() -> None:
    refused = status(
        base(mode="local", store_ok=False, store_state="refused", detail="login: wrong password")
    )
    assert "etcd:        reachable, REFUSES this node's calls (see detail)" in refused
    assert "action:      do what the detail says" in refused
    assert "make etcd reachable" not in refused
    down = status(base(store_ok=False, store_state="unreachable", detail="etcd refused? no"))
    assert "etcd:        UNREACHABLE" in down
    assert "action:      make etcd reachable from this node" in down
    ok = status(base(store_state="ok"))
    assert "etcd:        reachable\n" in ok and "action:" not in ok


def test_under_nospace_the_detail_is_short_as_the_alarm_says_it_all() -> None:
    text = status(
        base(
            mode="holding",
            last_order_age_seconds=5.0,
            store_ok=False,
            store_state="full",
            etcd_alarms=["NOSPACE"],
            detail=NOSPACE_DETAIL,
        )
    )
    assert "etcd:        reachable, REFUSES writes: out of space (reads work)\n" in text
    assert (
        "detail:      etcd refused a write: out of space (see the alarm above; full text:"
        " --json)\n" in text
    )
    assert text.count("etcdctl alarm disarm") == 1 and text.count("action:") == 1
    # a leader whose tags etcd refuses for space: its error, as shortly
    leader = status(
        base(
            mode="leader",
            leading=True,
            leader="n1",
            store_state="ok",
            etcd_alarms=["NOSPACE"],
            last_error=f"leader round failed: {NOSPACE_DETAIL}",
            last_error_kind="store_full",
        )
    )
    assert "error:       leader round failed: etcd refused a write: out of space" in leader
    assert leader.count("etcdctl alarm disarm") == 1
    # the alarm not read yet: the detail in full, and what it says to do
    unread = status(base(store_ok=False, store_state="full", detail=NOSPACE_DETAIL))
    assert f"detail:      {NOSPACE_DETAIL}\n" in unread
    # out of space, not refused for its login: the alarm's action, not the login's
    assert (
        "action:      free space (etcdctl compact REV; etcdctl defrag), then etcdctl alarm"
        " disarm: etcd is out of space" in unread
    )
    assert "do what the detail says" not in unread and unread.count("action:") == 1


def test_the_errors_kind_comes_from_its_field_not_the_messages_words() -> None:
    def held(kind: str, error: str) -> str:
        return status(
            base(
                mode="holding",
                last_order_age_seconds=10.0,
                last_error=error,
                last_error_kind=kind,
            )
        )

    duplicate = held("duplicate_node", "leader n0: FAILED_PRECONDITION two gpuds named n1")
    assert "action:      give each gpud its own cluster.node" in duplicate
    restarted = held("leader_not_ready", "leader n0: FAILED_PRECONDITION n0 starts soon")
    assert "action:      wait: the leader restarted within its previous run's lease" in restarted
    tls = held("tls_handshake", "leader n0: UNAVAILABLE certificate refused")
    assert "action:      the TLS handshake with the leader failed" in tls
    key = held("leader_key_held", "the leader key names n1 at a1, but ...")
    assert "action:      wait, or rename: etcd names this node the leader" in key
    # the words of another kind's action do not count
    reachable = held("leader_unreachable", "leader n0: handshake; does not lead yet")
    assert "action:      make the leader reachable from this node" in reachable
    assert "TLS handshake" not in reachable and "wait:" not in reachable
    assert "action:      make the leader reachable from this node" in held("a_later_kind", "x")
    assert "action:" not in status(base(last_error_kind=""))


def test_json_carries_the_fields_and_null_for_an_older_gpud() -> None:
    def as_json(response: pb.GetClusterStatusResponse) -> dict[str, Any]:
        ctx = Answer(response, json_output=True)
        assert run_status(ctx, argparse.Namespace()) == 0
        data: dict[str, Any] = json.loads(ctx.text.getvalue())
        return data

    newer = as_json(base(store_state="ok", last_error_kind=""))
    assert (newer["store_state"], newer["last_error_kind"]) == ("ok", "")
    older = as_json(base())
    assert (older["store_state"], older["last_error_kind"]) == (None, None)


def test_an_older_gpuds_answer_without_the_fields_is_read_from_its_words() -> None:
    from gpud.cli.cluster import error_kind, store_state

    def state(**fields: Any) -> str:
        return store_state(base(**fields))

    assert state() == "ok"
    assert state(store_ok=False, detail="etcd unreachable at http://e:2379: X") == "unreachable"
    assert state(store_ok=False, detail="etcd refused the login of user 'gpud'") == "refused"
    assert state(store_ok=False, detail=NOSPACE_DETAIL) == "full"

    def kind(error: str) -> str:
        return error_kind(base(last_error=error))

    assert kind("") == ""
    assert kind(TLS_ERROR) == "tls_handshake"
    assert kind("leader n0: FAILED_PRECONDITION node 'n1' is reported by two gpuds") == (
        "duplicate_node"
    )
    assert kind("leader n0: FAILED_PRECONDITION n0 does not lead yet: the key") == (
        "leader_not_ready"
    )
    assert kind("leader n0 at a0: UNAVAILABLE") == "leader_unreachable"
    # as gpuctl shows it: the alarm's lines, and the detail shortly
    text = status(base(store_ok=False, etcd_alarms=["NOSPACE"], detail=NOSPACE_DETAIL))
    assert "detail:      etcd refused a write: out of space (see the alarm above" in text
    assert text.count("etcdctl alarm disarm") == 1


class _Watching(Answer):
    """A context whose daemon streams ``answers`` to a watch of the attributes."""

    def __init__(self, answers: list[pb.GetAttributesResponse], *, json_output: bool) -> None:
        super().__init__(base(), json_output=json_output)
        self._answers = answers

    def WatchAttributes(self, request: pb.GetAttributesRequest) -> Any:  # the stub method
        answers = self._answers

        class Stream:
            def __iter__(self) -> Any:
                return iter(answers)

            def cancel(self) -> None:
                pass

        return Stream()

    @property
    def GetAttributes(self) -> Any:  # the stub method run_attributes names
        return None


def test_watching_attributes_under_json_is_one_object_a_line() -> None:
    """JSON Lines, as `gpuctl events --follow --json`: each answer on a line of its own,
    which `jq -c`, `while read` and a line-by-line json.loads all take."""
    answers = [
        pb.GetAttributesResponse(
            epoch=epoch,
            seq=epoch,
            attributes=[pb.JobAttributes(job="a", epoch=epoch, nodes=["n1"])],
        )
        for epoch in (1, 2)
    ]
    ctx = _Watching(answers, json_output=True)
    assert run_attributes(ctx, argparse.Namespace(job=[], watch=True)) == 0
    lines = ctx.text.getvalue().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    assert json.loads(lines[0])["attributes"][0]["job"] == "a"
    # without --watch, one document as every other command's --json
    ctx = _Watching(answers, json_output=True)
    ctx._response = answers[0]  # type: ignore[assignment]
    assert run_attributes(ctx, argparse.Namespace(job=[], watch=False)) == 0
    assert json.loads(ctx.text.getvalue())["epoch"] == 1


def test_problems_etcd_cannot_give_are_said_unknown_not_shown_as_none() -> None:
    # etcd unreachable from this node: it cannot read the nodes' problems, and an empty
    # table would read as "no node has a problem"
    unreachable = base(store_ok=False, store_state="unreachable", problems_state="unreachable")
    code, text = exit_and_text(unreachable, json_output=False)
    assert code == EXIT_PARTIAL == 11
    assert "problems:    etcd unreachable from this node: problems unknown" in text
    assert "PROBLEM SINCE" not in text
    code, text = exit_and_text(unreachable, json_output=True)
    assert code == 11 and json.loads(text)["problems_state"] == "unreachable"
    # etcd out of space: no node can record a problem; those recorded before are listed
    full = base(
        store_state="full",
        etcd_alarms=["NOSPACE"],
        problems_state="full",
        problems=[pb.ClusterProblem(node="n2", message="m", since_unix_seconds=time.time())],
    )
    code, text = exit_and_text(full, json_output=False)
    assert code == 11
    assert (
        "problems:    etcd REFUSES writes (NOSPACE): problems cannot be recorded"
        " (those listed were recorded before)"
    ) in text
    assert "PROBLEM SINCE" in text
    refused = base(store_ok=False, store_state="refused", problems_state="refused")
    code, text = exit_and_text(refused, json_output=False)
    assert code == 11 and "etcd REFUSES this node's calls (see detail): problems unknown" in text
    # read, and recordable: no line, exit 0, whether or not any node has a problem
    code, text = exit_and_text(base(store_state="ok", problems_state="ok"), json_output=False)
    assert code == 0 and "problems:" not in text
    # an older gpud sends no problems_state: its store_state stands for it
    older = base(store_ok=False, detail="etcd unreachable at http://e:2379")
    code, text = exit_and_text(older, json_output=False)
    assert code == 11 and "problems unknown" in text
    # no etcd (single): nothing to say
    code, text = exit_and_text(base(election="single", store_state=""), json_output=False)
    assert code == 0 and "problems:" not in text


def test_an_older_gpuds_problems_are_read_from_its_alarms_and_the_list_it_sent() -> None:
    # no problems_state: the NOSPACE alarm says no node can record one, whatever the
    # store_state of its last call
    older = base(store_state="ok", etcd_alarms=["NOSPACE"])
    code, text = exit_and_text(older, json_output=False)
    assert code == 11 and "problems cannot be recorded" in text
    # etcd unreachable at its last call, yet it sent the problems: it read them
    listed = base(
        store_ok=False,
        store_state="unreachable",
        problems=[pb.ClusterProblem(node="n2", message="m", since_unix_seconds=time.time())],
    )
    code, text = exit_and_text(listed, json_output=False)
    assert code == 0 and "problems unknown" not in text and "PROBLEM SINCE" in text
    # ... and without any: unknown
    code, text = exit_and_text(base(store_ok=False, store_state="refused"), json_output=False)
    assert code == 11 and "problems unknown" in text


def test_the_leader_keys_lease_is_shown_in_hex_as_etcdctl_prints_it() -> None:
    """The lease the leader key is attached to, as a follower last read it: in hex, as
    etcdctl lease timetolive takes it, on the leader line (the etcd leader line on a
    hint), and in --json as leader_lease; an older gpud's answer has none."""
    follower = status(base(leader_lease="694d7a2b1c3e4f10"))
    assert "leader:      n0 at 10.0.0.1:7443, epoch 7, lease 694d7a2b1c3e4f10\n" in follower
    hinted = status(
        base(leader="n2", leader_address="10.0.0.2:7443", leader_source="hint", leader_lease="5")
    )
    assert "etcd leader: n0 at 10.0.0.1:7443, epoch 7, lease 5, as this node last" in hinted
    assert "leader:      n0 at 10.0.0.1:7443, epoch 7\n" in status(base())
    _, text = exit_and_text(base(leader_lease="694d7a2b1c3e4f10"), json_output=True)
    assert json.loads(text)["leader_lease"] == "694d7a2b1c3e4f10"
    _, older = exit_and_text(base(), json_output=True)
    assert json.loads(older)["leader_lease"] is None


def test_a_leader_that_answers_it_does_not_lead_is_not_said_unreachable() -> None:
    """etcd stopped: the leader steps down and answers this node's report "does not lead".
    Reaching the leader mends nothing: with etcd unreachable here too, the action is etcd's
    alone; with etcd readable, the node waits for the successor etcd names."""
    error = "leader n0 at 10.0.0.1:7443: FAILED_PRECONDITION n0 does not lead"
    cut_off = status(
        base(
            mode="local",
            store_ok=False,
            store_state="unreachable",
            detail="etcd unreachable at http://e:2379 (no answer within 1 s, ...)",
            last_error=error,
            last_error_kind="not_leader",
        )
    )
    actions = [line for line in cut_off.splitlines() if line.startswith("action:")]
    assert actions == [
        "action:      make etcd reachable from this node (cluster.etcd_endpoints, etcd's TLS"
        " and auth files; the detail says why it fails): it learns of a new leader only"
        " from etcd"
    ]
    waiting = status(base(mode="holding", last_error=error, last_error_kind="not_leader"))
    assert "action:      wait: the leader etcd named answered that it no longer leads" in waiting
    assert "make the leader reachable" not in waiting


def test_a_report_the_leader_refuses_is_said_refused_with_its_words_not_unreachable() -> None:
    """The leader answered and refused this node's report: the mode line says so, the error
    is the leader's words, and no action sends the operator to the network between them."""
    error = (
        "leader n0 at 10.0.0.1:7443: INVALID_ARGUMENT jobs[2].job: 'a' is reported twice,"
        " at jobs[0] too"
    )
    for fields in ({"last_error_kind": "report_refused"}, {}):  # {}: an older gpud's answer
        text = status(base(mode="holding", last_error=error, **fields))
        assert (
            "mode:        holding (the leader answers and refuses this node's report, as the error says;"
            in text
        )
        assert f"error:       {error}" in text
        assert "action:      the leader is reachable and refuses this node's report" in text
        assert "no leader reachable" not in text
        assert "make the leader reachable" not in text
    _, shown = exit_and_text(
        base(mode="holding", last_error=error, last_error_kind="report_refused"), json_output=True
    )
    assert json.loads(shown)["last_error_kind"] == "report_refused"


def test_a_refusal_an_earlier_gpud_typed_unreachable_is_said_refused() -> None:
    """A gpud of 2026-12-06 typed the leader's answered refusal ``leader_unreachable``: its
    error's code (also with no words after it) tells gpuctl the leader answered."""
    for error in (
        "leader n0 at 10.0.0.1:7443: INVALID_ARGUMENT jobs[0].job: longer than 256 characters",
        "leader n0 at 10.0.0.1:7443: PERMISSION_DENIED",
    ):
        text = status(base(mode="holding", last_error=error, last_error_kind="leader_unreachable"))
        assert "mode:        holding (the leader answers and refuses this node's report" in text
        assert "action:      the leader is reachable and refuses this node's report" in text
        assert "make the leader reachable" not in text
    down = "leader n0 at 10.0.0.1:7443: UNAVAILABLE failed to connect to all addresses"
    text = status(base(mode="holding", last_error=down, last_error_kind="leader_unreachable"))
    assert "refuses this node's report" not in text


def test_a_leader_is_given_no_action_for_a_refusal_of_a_report_it_no_longer_sends() -> None:
    """A node that leads (it took over since the refusal) reports to no leader: the
    refusal's action is not for it, as none of the other leader kinds' is."""
    error = "leader n0 at 10.0.0.1:7443: INVALID_ARGUMENT jobs[0].job: 'old\\n': letters"
    leading = {"leading": True, "leader": "n1", "elected_leader": "n1"}
    text = status(
        base(mode="leading", last_error=error, last_error_kind="report_refused", **leading)
    )
    assert "refuses this node's report" not in text
