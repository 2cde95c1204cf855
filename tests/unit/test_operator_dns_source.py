"""The router's DNS instance source (a headless Service's A records)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from llumnix.router.cli import add_arguments, build_source
from llumnix.router.instance_source import DnsInstanceSource


def test_parse_target() -> None:
    source = DnsInstanceSource.parse("llama-llumlets.prod.svc:50051")
    assert (source.host, source.port) == ("llama-llumlets.prod.svc", 50051)
    with pytest.raises(ValueError, match="NAME:PORT"):
        DnsInstanceSource.parse("llama-llumlets")


async def test_resolves_every_address_and_follows_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [
        ["10.0.0.1", "10.0.0.2"],
        ["10.0.0.1", "10.0.0.2"],
        ["10.0.0.2"],
        socket.gaierror(socket.EAI_AGAIN, "temporary failure"),
        socket.gaierror(socket.EAI_NONAME, "no such name"),
    ]

    async def getaddrinfo(host: str, port: int, **_: object) -> list:
        assert (host, port) == ("svc", 50051)
        answer = answers.pop(0) if answers else []
        if isinstance(answer, Exception):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    updates = DnsInstanceSource("svc", 50051, poll_interval_s=0.001).updates()
    assert await anext(updates) == {"10.0.0.1:50051", "10.0.0.2:50051"}
    assert await anext(updates) == {"10.0.0.2:50051"}  # the unchanged answer yielded nothing
    # A transient failure keeps the last set; a name that no longer exists empties it.
    assert await anext(updates) == frozenset()
    await updates.aclose()


def test_router_flag_selects_the_dns_source() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    source = build_source(parser.parse_args(["--model", "m", "--instances-dns", "svc.ns.svc:50051"]))
    assert isinstance(source, DnsInstanceSource) and source.port == 50051
    with pytest.raises(SystemExit):
        parser.parse_args(["--instances", "a:1", "--instances-dns", "svc:1"])


async def test_resolves_a_real_name() -> None:
    addresses = await DnsInstanceSource("localhost", 50051).resolve()
    assert addresses is not None and "127.0.0.1:50051" in addresses
