"""``kvcompassd demo`` as an operator runs it: ``--keep`` keeps KVCompass's deployment and says
where it is; SIGTERM and Ctrl-C (SIGINT) stop every node the demo started and still print what
was measured. The demo runs in its own process group, so every node it started can be found."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from kvcompassd.core.config import load_config
from kvcompassd.demo import RUNS, bundled_workload, ctl_command


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


def test_the_suggested_kvcompassctl_is_found_without_the_venv_on_path(monkeypatch):
    # README's first command runs .venv/bin/kvcompassd without activating the venv.
    beside = Path(sys.executable).parent / "kvcompassctl"
    assert beside.is_file(), "pip install puts kvcompassctl beside the interpreter"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert ctl_command() == str(beside)
    monkeypatch.setenv("PATH", os.pathsep.join([str(beside.parent), "/usr/bin", "/bin"]))
    assert ctl_command() == "kvcompassctl"


def test_keep_keeps_the_kvcompass_deployment_and_sigterm_stops_every_node(tmp_path):
    demo = Demo("--requests", "4", "--concurrency", "2", "--time-scale", "0", "--keep", "--workdir", str(tmp_path))
    try:
        demo.wait_for(r"^KVCompass deployment kept running")
        try_line = demo.wait_for(r"^\s+try\s+\S*kvcompassctl ")
    except BaseException:
        demo.proc.kill()
        raise
    table = "\n".join(demo.seen)
    assert table.index("KVCompass  ") < table.index("kept running")  # the table comes before the wait
    # What is kept is KVCompass's deployment: its edges run with cross-region reuse on.
    edges = [cmd for _, cmd in group_members(demo.proc.pid) if " edge " in cmd]
    assert len(edges) == 3 and not any("--no-cross-region" in cmd for cmd in edges)
    config = Path(re.search(r"--config (\S+)", try_line).group(1))
    assert config.is_file() and (config.parent / "logs").is_dir()
    edge = load_config(config).edges[0]
    with urllib.request.urlopen(f"http://{edge.http}/health", timeout=30) as resp:
        assert resp.status == 200
    # The suggested command runs as printed.
    suggested = try_line.split("try", 1)[1].strip()
    asked = subprocess.run(suggested, shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert asked.returncode == 0 and asked.stdout.startswith("edge "), (suggested, asked.stderr)
    code, out = demo.finish(signal.SIGTERM)
    assert code == 0 and "stopped every node" in out
    assert "Traceback" not in demo.proc.stderr.read()


def test_ctrl_c_while_measuring_stops_every_node_and_prints_what_was_measured(tmp_path):
    concurrency = 2
    requests = 4000  # far more than are served before the interrupt
    demo = Demo("--requests", str(requests), "--concurrency", str(concurrency), "--time-scale", "1",
                "--workdir", str(tmp_path))
    try:
        demo.wait_for(r"replaying")
        # Interrupt once the demo's clients have results: with one request in flight per client,
        # more finished at the edges than there are clients means a client has one.
        edges = load_config(tmp_path / "run0" / "cluster-us.toml").edges
        deadline = time.monotonic() + 300
        while _requests_finished(edges) <= concurrency:
            assert time.monotonic() < deadline and demo.proc.poll() is None
            time.sleep(0.2)
    except BaseException:
        demo.proc.kill()
        raise
    code, out = demo.finish(signal.SIGINT)
    assert code == 128 + signal.SIGINT and "interrupted by SIGINT" in out
    row = next(line for line in out.splitlines() if line.startswith(f"{RUNS[0][0]} (interrupted)"))
    measured = int(row.split("(interrupted)")[1].split()[0])
    assert 0 < measured < requests
    assert "Traceback" not in demo.proc.stderr.read()


def _requests_finished(edges) -> int:
    total = 0
    for edge in edges:
        try:
            with urllib.request.urlopen(f"http://{edge.http}/metrics", timeout=30) as resp:
                text = resp.read().decode()
        except OSError:  # a busy edge: this poll counts nothing from it, the next one asks again
            continue
        for line in text.splitlines():
            if line.startswith("kvcompass_request_seconds_count"):
                total += int(float(line.split()[-1]))
    return total


def test_the_bundled_workload_is_fixed_by_its_seed():
    regions = ["us", "eu", "asia"]
    assert bundled_workload(20, regions) == bundled_workload(20, regions)
    assert {r.region for r in bundled_workload(200, regions)} == set(regions)


def test_a_deployment_that_cannot_start_is_one_error_not_a_traceback(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "kvcompassd", "demo", "--requests", "2", "--time-scale", "0",
                          "--workdir", str(blocked / "demo")], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("kvcompassd demo: ") and "Not a directory" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "kvcompassd", "demo", "--requests", "0"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "kvcompassd demo: --requests and --concurrency must be at least 1"


def test_the_demo_cluster_carries_the_fingerprint_bits_its_budget_needs():
    from kvcompassd.core.fingerprints import budget_shortfall, fingerprint_choice_for_config
    from kvcompassd.demo import _with_budget_fingerprints
    from kvcompassd.launcher import DeploymentSpec, build_cluster

    spec = _with_budget_fingerprints(DeploymentSpec())
    choice = fingerprint_choice_for_config(build_cluster(spec))
    assert spec.fingerprint_bits == choice.needed_bits > 0 and budget_shortfall(choice) is None
