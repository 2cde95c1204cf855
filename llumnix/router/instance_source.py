"""Where the router learns which llumlets exist. Instances appear and disappear at run time (scaling,
failures): a source reports the whole current set of llumlet gRPC addresses whenever it changes.

A static list (`--instances`), a file that is re-read when it changes (`--instances-file`) and a DNS
name re-resolved periodically (`--instances-dns`, a Kubernetes headless Service) are here; local mode
plugs in its own source."""

from __future__ import annotations

import asyncio
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from pathlib import Path


class InstanceSource(ABC):
    @abstractmethod
    def updates(self) -> AsyncIterator[frozenset[str]]:
        """Yields the current set of llumlet gRPC addresses (host:port), then every change."""


class ListInstanceSource(InstanceSource):
    """A list held in memory; `set_addresses` replaces it (tests, local mode)."""

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        self._addresses = frozenset(addresses)
        self._changed = asyncio.Event()

    @property
    def addresses(self) -> frozenset[str]:
        return self._addresses

    def set_addresses(self, addresses: Iterable[str]) -> None:
        self._addresses = frozenset(addresses)
        self._changed.set()

    async def updates(self) -> AsyncIterator[frozenset[str]]:
        while True:
            self._changed.clear()
            yield self._addresses
            await self._changed.wait()


def parse_addresses(text: str) -> frozenset[str]:
    """Addresses separated by commas, whitespace or lines; `#` starts a comment."""
    found = set()
    for line in text.splitlines():
        for item in line.split("#", 1)[0].replace(",", " ").split():
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"llumlet address {item!r} is not host:port")
            found.add(item)
    return frozenset(found)


class FileInstanceSource(InstanceSource):
    """A file of addresses, re-read when its modification time changes (a ConfigMap, a script)."""

    def __init__(self, path: Path, poll_interval_s: float = 1.0) -> None:
        self.path = path
        self.poll_interval_s = poll_interval_s

    def read(self) -> frozenset[str]:
        try:
            return parse_addresses(self.path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read the instances file {self.path}: {exc.strerror}") from None

    async def updates(self) -> AsyncIterator[frozenset[str]]:
        current = self.read()
        stamp = os.stat(self.path).st_mtime_ns
        yield current
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                new_stamp = os.stat(self.path).st_mtime_ns
                if new_stamp == stamp:
                    continue
                stamp = new_stamp
                addresses = self.read()
            except (OSError, ValueError):
                continue  # a file being rewritten: keep the last good set
            if addresses != current:
                current = addresses
                yield current


class DnsInstanceSource(InstanceSource):
    """Every address a DNS name resolves to, at one port, re-resolved periodically. A Kubernetes
    headless Service publishes one A record per ready pod, so the set follows scaling and failures."""

    def __init__(self, host: str, port: int, poll_interval_s: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.poll_interval_s = poll_interval_s

    @classmethod
    def parse(cls, target: str, poll_interval_s: float = 2.0) -> DnsInstanceSource:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--instances-dns {target!r} is not NAME:PORT")
        return cls(host, int(port), poll_interval_s)

    async def resolve(self) -> frozenset[str] | None:
        """The current addresses; empty when the name does not exist (a headless Service with no ready
        pod), None on other lookup failures (keep the last good set)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            no_such_name = exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
            return frozenset() if no_such_name else None
        return frozenset(f"[{ip}]:{self.port}" if family == socket.AF_INET6 else f"{ip}:{self.port}"
                         for family, _, _, _, (ip, *_) in infos)

    async def updates(self) -> AsyncIterator[frozenset[str]]:
        current = await self.resolve() or frozenset()
        yield current
        while True:
            await asyncio.sleep(self.poll_interval_s)
            addresses = await self.resolve()
            if addresses is not None and addresses != current:
                current = addresses
                yield current
