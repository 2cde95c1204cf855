"""`free_port`: ports for children to bind later, picked so that two picks never collide."""

from __future__ import annotations

import socket

import pytest

from llumnix.launch import pair
from llumnix.launch.pair import PICKED_PORTS, free_port


def test_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(port in PICKED_PORTS for port in ports)


def test_a_port_something_is_bound_to_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        free = next(p for p in PICKED_PORTS if p not in pair._handed_out and p != busy)
        picks = iter([busy, busy, free])
        monkeypatch.setattr(pair, "PICKED_PORTS", range(min(busy, free), max(busy, free) + 1))
        monkeypatch.setattr(pair.random, "choice", lambda _: next(picks))
        assert free_port() == free
