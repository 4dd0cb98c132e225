"""Running real ``kvcompassd`` processes the way systemd does: readiness over $NOTIFY_SOCKET.

Shared by the tests that start daemons one at a time (test_daemon's rotation, test_systemd's
sandbox). A test waits for the daemon's own ``READY=1`` datagram, never for a time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# How long a daemon may take to say READY=1 on this shared 2-core machine: a hang guard only.
START_GUARD_S = 120.0


class NotifySocket:
    """The datagram socket systemd gives a Type=notify service as $NOTIFY_SOCKET."""

    def __init__(self, path: Path | str) -> None:
        """``path``: a file system path, or ``@name`` for an abstract socket (no file: reachable
        from a sandbox whatever its file system view and user)."""
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.path.startswith("@"):
            self.sock.bind("\0" + self.path[1:])
        else:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o666)  # a daemon running as another user may send to it
        self.received: list[str] = []

    def expect(self, state: str, proc: subprocess.Popen, log_path: Path, timeout: float = START_GUARD_S) -> str:
        """Wait for a datagram holding the line ``state`` (e.g. ``READY=1``); fail with the
        daemon's log if it exits first."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(0.2)
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                if proc.poll() is not None:
                    raise AssertionError(f"daemon exited with {proc.returncode} before {state}:\n"
                                         f"{tail(log_path)}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {state} within {timeout} s:\n{tail(log_path)}") from None
                continue
            self.received.append(message)
            if state in message.splitlines():
                return message

    def drain(self) -> list[str]:
        """Read what is queued (after the daemon exited: its STOPPING=1)."""
        self.sock.setblocking(False)
        try:
            while True:
                self.received.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            pass
        return self.received

    def close(self) -> None:
        self.sock.close()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def kvcompassd_argv(mode: str, config: Path, node_id: str, tls_dir: Path | None, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "kvcompassd", mode, "--config", str(config), "--id", node_id, "--log-json"]
    if tls_dir is not None:
        argv += ["--tls-dir", str(tls_dir)]
    return [*argv, *extra]


def start(argv: list[str], log_path: Path, notify: NotifySocket, **popen) -> subprocess.Popen:
    env = dict(popen.pop("env", os.environ), NOTIFY_SOCKET=notify.path, PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                **popen)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, as systemd stops a unit; kill only if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def log_events(log_path: Path, event: str) -> list[dict]:
    """The daemon's JSON log lines whose ``event`` is ``event``."""
    found = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found
