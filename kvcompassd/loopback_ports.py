"""Free loopback ports for local deployments (the demo, the tests), never handed out twice on a host.

A port is picked before the node that listens on it starts, so "it binds now" is not enough:
until the node binds it, another pick can return it again. Two rules close that window:

- in one process, every port handed out is remembered and never handed out again;
- across processes (two test suites, a demo beside a suite), a port is also reserved host-wide
  by creating ``<reservations>/<port>`` with ``O_EXCL``; the file names its owner (pid and start
  time), is removed when the owner exits, and is reclaimed from an owner that is gone.

Ports come from below the kernel's ephemeral range: listen ports picked inside it raced the
nodes' own outgoing sockets (a node dialling a peer binds an ephemeral UDP port, which could be
the one a node started a moment later was told to listen on).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

# Every port handed out in this process, by any _Ports.
_HANDED_OUT: set[int] = set()
# The host-wide reservation files this process created, removed when it exits.
_RESERVED: set[Path] = set()


def _ephemeral_port_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing sockets are bound from there on)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def reservations_dir() -> Path:
    """Where host-wide reservations live: ``$KVCOMPASSD_PORT_RESERVATIONS``, else per user in the temp dir."""
    override = os.environ.get("KVCOMPASSD_PORT_RESERVATIONS")
    return Path(override) if override else Path(tempfile.gettempdir()) / f"kvcompassd-ports-{os.getuid()}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a pid from a later reuse of it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields count from its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def _owner_tag(pid: int) -> str:
    return f"{pid} {_start_time(pid)}"


def _owner_alive(tag: str) -> bool:
    try:
        pid_text, started = tag.split()
        pid = int(pid_text)
    except ValueError:
        return False  # unreadable or half-written by a crashed owner: not a reservation to honour
    return _start_time(pid) == started


def _release_all() -> None:
    for path in list(_RESERVED):
        with contextlib.suppress(OSError):
            path.unlink()
        _RESERVED.discard(path)


atexit.register(_release_all)


def reserve_host_wide(port: int, directory: Path | None = None) -> bool:
    """Reserve ``port`` on this host for this process; False if a live process holds it."""
    directory = directory or reservations_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / str(port)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                tag = path.read_text()
            except OSError:
                continue  # removed meanwhile: try again
            if _owner_alive(tag) or (tag == "" and _young(path)):
                return False
            with contextlib.suppress(OSError):
                path.unlink()  # its owner is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(_owner_tag(os.getpid()))
        _RESERVED.add(path)
        return True
    return False


def _young(path: Path) -> bool:
    """An empty file just created by an owner that has not written its tag yet."""
    try:
        return time.time() - path.stat().st_mtime < 5.0
    except OSError:
        return False


class _Ports:
    """Free loopback ports, each handed out once per host, from below the kernel's ephemeral range.

    ``p + 1`` is reserved too where asked (the engine's replay socket)."""

    def __init__(self, rng: random.Random | None = None, reservations: Path | None = None) -> None:
        self.taken: set[int] = set()
        self._rng = rng or random.Random()
        self._reservations = reservations
        ephemeral_low = _ephemeral_port_low()
        self._low, self._high = max(1024, ephemeral_low // 2), max(1025, ephemeral_low - 2)

    @staticmethod
    def _bindable(port: int, kind: int) -> bool:
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    def _reserve(self, wanted: list[int]) -> bool:
        reserved: list[int] = []
        for port in wanted:
            if not reserve_host_wide(port, self._reservations):
                for held in reserved:  # a pair is reserved whole or not at all
                    path = (self._reservations or reservations_dir()) / str(held)
                    with contextlib.suppress(OSError):
                        path.unlink()
                    _RESERVED.discard(path)
                return False
            reserved.append(port)
        return True

    def get(self, kind: int = socket.SOCK_STREAM, pair: bool = False) -> int:
        for _ in range(500):
            port = self._rng.randint(self._low, self._high)
            wanted = [port, port + 1] if pair else [port]
            if any(p in self.taken or p in _HANDED_OUT for p in wanted) or not all(
                    self._bindable(p, kind) for p in wanted):
                continue
            if not self._reserve(wanted):
                continue
            self.taken.update(wanted)
            _HANDED_OUT.update(wanted)
            return port
        raise RuntimeError("no free loopback port found")


def free_loopback_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port below the ephemeral range that binds now (e.g. a node's ``--metrics``)."""
    return _Ports().get(kind)
