"""The control daemon's command protocol: commands, reply grammar, sizes."""

from __future__ import annotations

import pytest

from gpud.errors import InvalidArgument
from gpud.mps import protocol
from gpud.mps.protocol import MpsReplyError
from gpud.shared import GIB, MIB, format_size, parse_size


def test_commands_are_what_the_control_daemon_reads() -> None:
    assert protocol.get_server_list() == "get_server_list"
    assert protocol.start_server(1000) == "start_server -uid 1000"
    assert (
        protocol.set_default_active_thread_percentage(40)
        == "set_default_active_thread_percentage 40"
    )
    assert protocol.get_default_active_thread_percentage() == "get_default_active_thread_percentage"
    assert protocol.set_default_device_pinned_mem_limit(0, 20 * GIB) == (
        "set_default_device_pinned_mem_limit 0 20G"
    )
    assert (
        protocol.get_default_device_pinned_mem_limit(0) == "get_default_device_pinned_mem_limit 0"
    )
    assert protocol.set_active_thread_percentage(4242, 25) == "set_active_thread_percentage 4242 25"
    assert protocol.set_device_pinned_mem_limit(4242, 0, 1536 * MIB) == (
        "set_device_pinned_mem_limit 4242 0 1536M"
    )
    assert protocol.quit_() == "quit"


@pytest.mark.parametrize("bad", [0, 101, -5])
def test_percentages_outside_1_to_100_are_refused_naming_the_field(bad: int) -> None:
    with pytest.raises(InvalidArgument, match="threads"):
        protocol.set_default_active_thread_percentage(bad)


def test_memory_values_are_whole_gib_or_mib() -> None:
    assert protocol.format_memory(20 * GIB) == "20G"
    assert protocol.format_memory(1536 * MIB) == "1536M"
    assert protocol.format_memory(1536 * MIB + 10) == "1536M"  # rounded down
    with pytest.raises(InvalidArgument, match="memory"):
        protocol.format_memory(1000)


def test_the_driver_displays_limits_from_1g_up_in_whole_gib() -> None:
    assert protocol.displayed_memory(1044 * MIB) == "1G"
    assert protocol.displayed_memory(20 * GIB) == "20G"
    assert protocol.displayed_memory(512 * MIB) == "512M"


def test_client_memory_limit_variable_format() -> None:
    assert protocol.client_memory_limit_env({0: 20 * GIB}) == "0=20G"
    assert protocol.client_memory_limit_env({1: 512 * MIB, 0: 2 * GIB}) == "0=2G,1=512M"


def test_replies_parse() -> None:
    assert protocol.parse_server_list("c", "") == []
    assert protocol.parse_server_list("c", "4242\n4343\n") == [4242, 4343]
    assert protocol.parse_percent("c", "25.0\n") == 25.0
    assert protocol.parse_percent("c", "100") == 100.0
    assert protocol.parse_memory("c", "20G\n") == 20 * GIB
    assert protocol.parse_memory("c", "512M") == 512 * MIB
    assert protocol.parse_memory("c", "0") is None
    assert protocol.parse_memory("c", "") is None
    protocol.parse_empty("c", "\n")


def test_a_set_reply_may_echo_the_value_it_set() -> None:
    """The 580-series daemon prints ``100.0`` after ``set_default_active_thread_percentage
    100``; an echo of another value, or any other text, is a refusal."""
    protocol.parse_set("c", "", percent=100)
    protocol.parse_set("c", "100.0\n", percent=100)
    protocol.parse_set("c", "20G", num_bytes=20 * GIB)
    protocol.parse_set("c", "1G", num_bytes=1044 * MIB)  # as a read-back displays it
    for reply, kwargs in [
        ("40.0", {"percent": 100}),
        ("100.0", {"num_bytes": 100 * GIB}),
        ("20G", {"percent": 20}),
        ("Server 12 not found", {"percent": 12}),
        ("100.0\n100.0", {"percent": 100}),
    ]:
        with pytest.raises(MpsReplyError):
            protocol.parse_set("c", reply, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parse", "reply"),
    [
        (protocol.parse_server_list, "12\nabc"),
        (protocol.parse_percent, "25 %"),
        (protocol.parse_percent, "25.0\n26.0"),
        (protocol.parse_memory, "1024 MB"),
        (protocol.parse_memory, "1.5G"),
        (protocol.parse_memory, "10G\n10G"),
        (protocol.parse_empty, "Server 12 not found"),
    ],
)
def test_replies_outside_the_grammar_are_errors_carrying_command_and_reply(
    parse: object, reply: str
) -> None:
    with pytest.raises(MpsReplyError) as info:
        parse("get_x", reply)  # type: ignore[operator]
    assert info.value.command == "get_x"
    assert info.value.reply == reply.strip()
    assert repr(reply.strip()) in str(info.value)


def test_sizes_people_write() -> None:
    assert parse_size("20GiB") == 20 * GIB
    assert parse_size("20G") == 20 * GIB
    assert parse_size("20gb") == 20 * GIB
    assert parse_size("512MiB") == 512 * MIB
    assert parse_size("1.5G") == 1536 * MIB
    assert parse_size("4096") == 4096
    for bad in ("", "twenty", "0G", "20 XB"):
        with pytest.raises(InvalidArgument, match="memory"):
            parse_size(bad)
    assert format_size(20 * GIB) == "20GiB"
    assert format_size(1536 * MIB) == "1536MiB"
