"""How ringrun reads -H host lists and hostfiles."""

from __future__ import annotations

import pytest

from ringplug.run.hosts.spec import (
    Host,
    HostSpecError,
    format_host_list,
    parse_host_list,
    parse_hostfile,
)


def test_host_list_gives_slots_per_host_in_order():
    assert parse_host_list("a:2,b:3") == [Host("a", 2), Host("b", 3)]


def test_host_without_slots_counts_as_one_slot():
    assert parse_host_list("a,b:2") == [Host("a", 1), Host("b", 2)]


def test_host_listed_twice_gets_the_sum_of_its_slots():
    assert parse_host_list(["a:1", "b:1", "a:2"]) == [Host("a", 3), Host("b", 1)]


def test_hostfile_accepts_all_three_forms_and_comments(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# training nodes\nnode1:2\n\nnode2 slots=4   # the big one\nnode3\n")
    assert parse_hostfile(hostfile) == [Host("node1", 2), Host("node2", 4), Host("node3", 1)]


def test_hostfile_error_names_file_and_line(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2 slots=many\n")
    with pytest.raises(HostSpecError, match=r"hosts:2: slot count 'many'"):
        parse_hostfile(hostfile)


def test_zero_slots_is_rejected():
    with pytest.raises(HostSpecError, match="at least 1"):
        parse_host_list("a:0")


def test_host_list_formats_the_way_both_launchers_read_it():
    assert format_host_list([Host("a", 2), Host("b", 1)]) == "a:2,b:1"
