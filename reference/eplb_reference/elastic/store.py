"""The coordinator's TCP store, listening on the address the operator chose and nowhere else.

torch's ``TCPStore`` listens on every interface whatever host it is given (the host only says where
clients connect): a socket bound here first, and handed over as ``master_listen_fd``, makes it
listen on that address alone. Loopback unless the operator says otherwise (``serve --host``); any
other address is logged once, naming what it exposes (SECURITY.md).

A member's gloo groups listen where it reaches the store from (``address_towards``): gloo's default
device listens on whatever the machine's hostname resolves to, a public address on many hosts.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("eplb_graph.elastic.store")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: loopback only if every address it resolves to is
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def warn_if_exposed(host: str) -> None:
    if not is_loopback(host):
        log.warning("the coordinator's store listens on %s: whoever reaches it reads and writes every key of the "
                    "run (offers, results, fences, the stop); keep it on a trusted network (SECURITY.md)", host)


def listening_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The master store on ``host:port`` (port 0: a free one, ``store.port`` names it)."""
    warn_if_exposed(host)
    listener = socket.create_server((host, port))
    try:
        return dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    finally:
        listener.close()  # after detach(): closes nothing, the store owns the descriptor


def address_towards(host: str, port: int) -> str:
    """The local address this machine reaches ``host:port`` from (no packet is sent): loopback for a
    store on loopback, else the address of the route to it, where the other members reach this one."""
    if is_loopback(host):
        return "127.0.0.1"
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)  # a datagram socket's connect only picks the route
        return probe.getsockname()[0]
