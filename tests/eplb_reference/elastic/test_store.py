"""The coordinator's store listens on the address asked for, read from the kernel's own table."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from eplb_reference.elastic.store import is_loopback, listening_store, warn_if_exposed

LISTEN = "0A"  # /proc/net/tcp's state for a listening socket


def listening_addresses(port: int) -> set[str]:
    """Every local address a socket listens on ``port`` at, as /proc/net/tcp{,6} write it (hex)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_store_listens_on_loopback_alone_and_serves(caplog):
    with caplog.at_level(logging.WARNING, logger="eplb_graph.elastic.store"):
        store = listening_store("127.0.0.1", 0, timeout_s=10)
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 / ::
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert caplog.records == []  # loopback: nothing to warn of


def test_torch_alone_listens_on_every_interface():
    """Why the store is bound by hand: the host given to torch says where clients connect only."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert listening_addresses(store.port) & {"00000000", "00000000000000000000000000000000"}


def test_an_address_beyond_loopback_is_warned_of_naming_what_it_exposes(caplog):
    with caplog.at_level(logging.WARNING, logger="eplb_graph.elastic.store"):
        warn_if_exposed("127.0.0.1")
        assert caplog.records == []
        warn_if_exposed("192.0.2.7")
    assert "192.0.2.7" in caplog.text and "reads and writes every key" in caplog.text
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("192.0.2.7")
