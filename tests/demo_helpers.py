"""Running ``kvcompassd demo`` as an operator does, for the demo's tests: in its own session
(so every node it started can be found by its process group), its output read line by line."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path


def group_members(pgid: int) -> list[tuple[int, str]]:
    """Live processes of a process group, with their command lines (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            found.append((int(entry.name), cmdline))
    return found


class Demo:
    """The demo in its own session; its stdout read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcompassd", "demo", "--log-level", "warning", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"demo ended before {pattern!r}:\n" + "\n".join(self.seen) + self.proc.stderr.read()
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, sig: int) -> tuple[int, str]:
        pgid = self.proc.pid  # start_new_session: the demo leads its own group
        assert len(group_members(pgid)) > 10  # the demo and the nodes it started
        self.proc.send_signal(sig)  # to the demo alone, as `kill <pid>` does
        code = self.proc.wait(timeout=180)
        rest = []
        while (line := self.lines.get(timeout=30)) is not None:
            rest.append(line)
        assert group_members(pgid) == [], "nodes left running"
        return code, "\n".join(self.seen + rest)
