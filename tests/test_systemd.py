"""The systemd units, run for real: every mode starts under its unit's own sandbox.

``systemd-analyze verify`` checks the units' syntax but cannot see what the sandbox does to the
program: the shipped filter once killed every mode at start-up (numpy's ``mbind``). So this
test reads each unit, expands its ``SystemCallFilter=`` groups with the installed systemd
(``systemd-analyze syscall-filter``), and starts ``kvcompassd <mode>`` from the unit's own
``ExecStart=`` and ``EnvironmentFile=`` through ``tests/unit_sandbox.py``: the unit's seccomp
filters (libseccomp), its read-only file system view, an unprivileged stand-in for the
``kvcompass`` user that reads the config and key with the modes README prescribes, and
readiness over $NOTIFY_SOCKET. Then a request goes through the sandboxed edge, engine events
reach the sandboxed maintenance unit, the edge reloads its certificate, and every daemon stops
on SIGTERM with exit code 0.

systemd-analyze and libseccomp.so.2 come with Debian's systemd package (this project's machines
have it); without them the test fails rather than skips.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import aiohttp
import pytest
from daemon_helpers import NotifySocket, log_events, start, stop, tail
from e2e_helpers import eventually
from unit_sandbox import (
    expand_exec,
    expand_group,
    read_environment_file,
    read_unit,
    sandbox_spec,
    single,
    syscall_allow_list,
    values,
)

from kvcompassd import certs
from kvcompassd.core.config import dump_config
from kvcompassd.ctl import query
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.wire import Role

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "systemd"
SANDBOX = Path(__file__).resolve().parent / "unit_sandbox.py"
DAEMON_UNIT = UNITS / "kvcompassd@.service"
WORKER_UNIT = UNITS / "kvcompass-emulated-worker@.service"
INSTALLED_EXE = "/opt/kvcompass/venv/bin/kvcompassd"

# Every [Service] setting the units use, and how the sandbox test honours it. A setting not
# listed fails the test: a new one must be emulated, or say why start-up cannot depend on it.
EMULATED = {
    "SystemCallFilter", "SystemCallArchitectures", "RestrictAddressFamilies", "MemoryDenyWriteExecute",
    "RestrictRealtime", "RestrictNamespaces", "LockPersonality", "NoNewPrivileges", "CapabilityBoundingSet",
    "User", "Group", "UMask", "LimitNOFILE", "ProtectSystem", "ProtectHome", "ProtectProc", "ProcSubset",
    "Type", "NotifyAccess",
    "ExecStart", "EnvironmentFile", "ExecReload", "KillSignal",
}
NOT_EMULATED = {
    "AmbientCapabilities": "empty, and a non-root user has none anyway",
    "PrivateTmp": "nothing opens temporary files; the emulated ProtectSystem=strict keeps /tmp read-only",
    "PrivateDevices": "its seccomp part (@raw-io) is inside ~@privileged; no device is opened",
    "ProtectKernelTunables": "/proc/sys and /sys are only read",
    "ProtectKernelModules": "its seccomp part (@module) is inside ~@privileged",
    "ProtectKernelLogs": "its seccomp part (syslog) is outside @system-service",
    "ProtectControlGroups": "cgroups are not touched",
    "ProtectClock": "its seccomp part (@clock) is inside ~@privileged",
    "ProtectHostname": "its seccomp part (sethostname) is inside ~@privileged",
    "RestrictSUIDSGID": "no file is created at all",
    "TimeoutStopSec": "stop is tested by SIGTERM and exit code",
    "Restart": "restart policy", "RestartSec": "restart policy",
}

# The files README prescribes (its "systemd and certificates" steps): (path, mode, group-owned).
PRESCRIBED = [
    ("", 0o750, True),
    ("cluster.toml", 0o640, True),
    ("{role}.env", 0o640, True),
    ("tls", 0o750, True),
    ("tls/ca.pem", 0o644, False),
    ("tls/{id}.pem", 0o644, False),
    ("tls/{id}.key", 0o640, True),
]


def service(unit: Path) -> list[tuple[str, str]]:
    return read_unit(unit)["Service"]


def test_tools_the_sandbox_test_needs_are_installed():
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: apt-get install systemd"
    assert "mbind" in expand_group("@resources") and "setuid" in expand_group("@privileged")
    import ctypes

    ctypes.CDLL("libseccomp.so.2")


@pytest.mark.parametrize("unit", [DAEMON_UNIT, WORKER_UNIT], ids=lambda u: u.name)
def test_units_are_notify_run_as_kvcompass_and_use_only_settings_the_test_knows(unit):
    svc = service(unit)
    assert single(svc, "Type") == "notify" and single(svc, "NotifyAccess") == "main"
    assert single(svc, "User") == "kvcompass" and single(svc, "Group") == "kvcompass"
    assert not values(svc, "DynamicUser")  # files are group-readable by a static user
    assert single(svc, "ExecStart").startswith(INSTALLED_EXE + " ")
    unknown = {key for key, _ in svc} - EMULATED - set(NOT_EMULATED)
    assert not unknown, f"settings the sandbox test neither emulates nor explains: {unknown}"
    assert read_unit(unit)["Install"] == [("WantedBy", "multi-user.target")]


def test_the_daemon_unit_reloads_with_sighup():
    assert single(service(DAEMON_UNIT), "ExecReload") == "/bin/kill -HUP $MAINPID"


@pytest.mark.parametrize("unit", [DAEMON_UNIT, WORKER_UNIT], ids=lambda u: u.name)
def test_filter_is_system_service_less_privileged_and_resources_but_two_calls(unit):
    allowed = syscall_allow_list(values(service(unit), "SystemCallFilter"))
    base = expand_group("@system-service") - expand_group("@privileged") - expand_group("@resources")
    assert allowed - base == {"mbind", "sched_setscheduler"}
    assert base <= allowed
    assert not allowed & {"setuid", "ptrace", "mount", "setrlimit", "sched_setaffinity", "init_module"}


@pytest.mark.parametrize("unit", [DAEMON_UNIT, WORKER_UNIT], ids=lambda u: u.name)
def test_settings_whose_seccomp_part_is_not_emulated_refuse_nothing_the_filter_allows(unit):
    # PrivateDevices, ProtectKernelModules, ProtectKernelLogs, ProtectClock, ProtectHostname add
    # seccomp rules of their own; the allow-list already refuses every call they name.
    allowed = syscall_allow_list(values(service(unit), "SystemCallFilter"))
    theirs = (expand_group("@raw-io") | expand_group("@module") | expand_group("@clock")
              | {"syslog", "sethostname", "setdomainname"})
    assert not allowed & theirs, allowed & theirs


def test_the_filter_the_units_shipped_before_kills_numpy_at_import(tmp_path):
    """The harness reproduces what was reported: under @system-service minus @privileged and
    @resources (no mbind), importing numpy dies with SIGSYS."""
    svc = [(k, v) for k, v in service(DAEMON_UNIT) if not (k == "SystemCallFilter" and v in ("mbind", "sched_setscheduler"))]
    out = run_sandboxed(tmp_path, svc, [sys.executable, "-c", "import numpy"])
    assert out.returncode == -31 or out.returncode == 159, out


def test_numpy_zmq_uvloop_and_aioquic_load_under_the_unit_filter(tmp_path):
    out = run_sandboxed(tmp_path, service(DAEMON_UNIT),
                        [sys.executable, "-c", ("import numpy, zmq, uvloop, aioquic.quic.connection, cryptography.x509;"
                                                "import os; print(os.getuid())")])
    assert out.returncode == 0, out
    assert int(out.stdout) == stand_in_ids()[0]


def test_the_edges_hugging_face_tokenizer_loads_and_encodes_under_the_unit_filter(tmp_path):
    # A real deployment's edge names a Hugging Face tokenizer ([tokenizer] path): its Rust
    # library runs a thread pool the sandboxed modes above (byte tokenizer) never start.
    fixture = REPO / "tests" / "data" / "tokenizer-bpe"
    assert (fixture / "tokenizer.json").is_file(), fixture
    code = ("import sys; from kvcompassd.tokenizer import load_tokenizer; from tokenizers import Tokenizer;"
            f"t = load_tokenizer({str(fixture)!r}); ids = t.encode('hello world ' * 500);"
            f"t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}]);"
            f"raw = Tokenizer.from_file({str(fixture / 'tokenizer.json')!r});"
            "batch = raw.encode_batch(['hello world ' * 500] * 32);"  # the parallel path
            "print(len(ids), len(batch))")
    out = run_sandboxed(tmp_path, service(DAEMON_UNIT), [sys.executable, "-c", code])
    assert out.returncode == 0, out
    assert out.stdout.split()[1] == "32", out


def run_sandboxed(tmp_path: Path, svc, argv: list[str]) -> subprocess.CompletedProcess:
    spec_path = write_spec(tmp_path, svc)
    return subprocess.run([sys.executable, str(SANDBOX), str(spec_path), "--", *argv], capture_output=True, text=True,
                          timeout=300, check=False)


# ---------------------------------------------------------------- every mode, for real


def stand_in_ids() -> tuple[int, int]:
    """An unused uid and gid standing in for the kvcompass system user (root runs the tests;
    anyone else runs the daemons as themselves)."""
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    for candidate in range(61_000, 62_000):
        try:
            pwd.getpwuid(candidate)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(candidate)
        except KeyError:
            return candidate, candidate
    raise AssertionError("no free uid/gid in 61000-61999")


def interpreter_home() -> tuple[str, ...]:
    """What the daemons run from that lives under a home directory (this machine's Python is
    pyenv's, under /root; a checkout or its venv may be too), which ProtectHome=yes would hide
    (where the real units run /opt/kvcompass/venv): the sandbox leaves those readable."""
    paths = [sys.base_prefix, sys.prefix, str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    found = {os.path.realpath(p) for p in paths if p}
    return tuple(sorted(p for p in found if p.startswith(("/root/", "/home/"))))


def write_spec(tmp_path: Path, svc) -> Path:
    uid, gid = stand_in_ids()
    path = tmp_path / f"sandbox-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(sandbox_spec(svc, uid=uid, gid=gid, expose=interpreter_home())))
    return path


def install_files(etc: Path, *, role: str, node_id: str, source_tls: Path, cluster: Path, env_lines: list[str]) -> None:
    """/etc/kvcompass as README says to lay it out, owned root:kvcompass (the stand-in gid)."""
    _, gid = stand_in_ids()
    (etc / "tls").mkdir(parents=True, exist_ok=True)
    shutil.copy(cluster, etc / "cluster.toml")
    (etc / f"{role}.env").write_text("\n".join(env_lines) + "\n")
    for name in ("ca.pem", f"{node_id}.pem", f"{node_id}.key"):
        shutil.copy(source_tls / name, etc / "tls" / name)
    for pattern, mode, group_owned in PRESCRIBED:
        path = etc / pattern.format(role=role, id=node_id)
        if os.getuid() == 0:
            os.chown(path, 0, gid if group_owned else 0)
        os.chmod(path, mode)


class SandboxedDaemon:
    """One unit instance started as systemd would start it, under the unit's sandbox."""

    def __init__(self, tmp_path: Path, unit: Path, instance: str, etc: Path, name: str) -> None:
        svc = service(unit)
        env = {}
        env_file = single(svc, "EnvironmentFile")
        if env_file:
            env = read_environment_file(Path(env_file.replace("%i", instance).replace("/etc/kvcompass", str(etc))))
        argv = expand_exec(single(svc, "ExecStart"), instance=instance, env=env)
        assert argv[0] == INSTALLED_EXE
        # This checkout's entry point instead of the installed one, this test's files instead of /etc.
        argv = [str(Path(sys.executable).with_name("kvcompassd")),
                *[a.replace("/etc/kvcompass", str(etc)) for a in argv[1:]]]
        self.notify = NotifySocket(f"@kvcompass-test-{uuid.uuid4().hex}")
        self.log = tmp_path / f"{name}.log"
        spec = write_spec(tmp_path, svc)
        # systemd gives a service a clean environment; PYTHONPATH keeps this checkout's code.
        environ = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/", "LANG": "C.UTF-8",
                   "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
        self.proc = start([sys.executable, str(SANDBOX), str(spec), "--", *argv], self.log, self.notify, env=environ)
        self.name = name

    def ready(self) -> None:
        self.notify.expect("READY=1", self.proc, self.log)

    def close(self) -> int:
        code = stop(self.proc)
        self.notify.drain()
        self.notify.close()
        return code


@pytest.fixture
def host_root():
    """A directory the unprivileged stand-in can traverse (pytest's tmp_path sits under a 0700
    directory): the hosts' /etc/kvcompass trees go in it, each with the modes README gives."""
    root = Path(tempfile.mkdtemp(prefix="kvcompass-units-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_mode_starts_serves_reloads_and_stops_under_its_units_sandbox(tmp_path, host_root):
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(dump_config(cfg))
    ca = tmp_path / "ca"  # the offline admin machine's directory
    certs.init_ca(ca, cluster_name=cfg.name)
    nodes = {"maintenance": "mnt-0", "agent": "us-0", "edge": "edge-us"}
    for role, node_id in nodes.items():
        certs.issue(ca, ca, role=Role(role), node_id=node_id)
    certs.issue(ca, ca, role=Role.ADMIN, node_id="admin")
    for role, node_id in nodes.items():  # one host directory per role: each sees only its own key
        install_files(host_root / f"etc-{role}", role=role, node_id=node_id, source_tls=ca, cluster=cluster,
                      env_lines=[f"KVC_ID={node_id}", "KVC_ARGS=" + (
                          f"--metrics {free_metrics_address()}" if role == "edge" else "")])
    install_files(host_root / "etc-worker", role="worker", node_id="us-0", source_tls=ca, cluster=cluster, env_lines=[])

    daemons: list[SandboxedDaemon] = []
    try:
        for unit, instance, etc in ((WORKER_UNIT, "us-0", "etc-worker"), (DAEMON_UNIT, "maintenance", "etc-maintenance"),
                                    (DAEMON_UNIT, "agent", "etc-agent"), (DAEMON_UNIT, "edge", "etc-edge")):
            daemon = SandboxedDaemon(tmp_path, unit, instance, host_root / etc, name=instance)
            daemons.append(daemon)
            daemon.ready()
        edge = daemons[-1]

        async def exercise() -> None:
            async with aiohttp.ClientSession() as session:
                async def edge_ready():  # READY=1 means listening; /health says when it routes
                    async with session.get(f"http://{cfg.edges[0].http}/health") as response:
                        return response.status == 200 and (await response.json())["ready"]
                await eventually(edge_ready, timeout=60)
                body = {"text": "a prompt long enough to fill a few KV blocks " * 8,
                        "sampling_params": {"max_new_tokens": 4}}
                async with session.post(f"http://{cfg.edges[0].http}/generate", json=body) as response:
                    assert response.status == 200, await response.text()
                    assert (await response.json())["meta_info"]["kvcompass"]["worker"] == "us-0"

            # The engine's KV events reached the sandboxed agent (ZMQ) and, over QUIC, the
            # sandboxed maintenance unit.
            async def registered():
                for daemon in daemons:  # a call the filter refuses kills a daemon at any time
                    assert daemon.proc.poll() is None, f"{daemon.name} exited {daemon.proc.returncode}: {tail(daemon.log)}"
                return (await query(cfg, ca, "admin", "mnt-0", "status", {}))["entries"] > 0

            await eventually(registered, timeout=60)

        asyncio.run(exercise())

        # Reload under the sandbox: a rotated certificate, read as the kvcompass user.
        certs.issue(ca, ca, role=Role.EDGE, node_id="edge-us")
        install_files(host_root / "etc-edge", role="edge", node_id="edge-us", source_tls=ca, cluster=cluster,
                      env_lines=[])
        new_serial = f"{certs.load_certificate(ca / 'edge-us.pem').serial_number:x}"
        edge.proc.send_signal(signal.SIGHUP)
        edge.notify.expect("RELOADING=1", edge.proc, edge.log)
        edge.notify.expect("READY=1", edge.proc, edge.log)
        assert [r["certificate_serial"] for r in log_events(edge.log, "tls_reloaded")] == [new_serial], tail(edge.log)
    finally:
        codes = {d.name: d.close() for d in reversed(daemons)}
    assert codes == {"edge": 0, "agent": 0, "maintenance": 0, "us-0": 0}, {d.name: tail(d.log) for d in daemons}
    for daemon in daemons:
        assert any("STOPPING=1" in m.splitlines() for m in daemon.notify.received), daemon.name


def test_a_key_left_as_certs_issue_wrote_it_is_refused_with_a_clear_error(tmp_path, host_root):
    """``certs issue`` writes keys 0600 for the admin machine; copied as they are, the service
    user cannot read them, and the daemon says so instead of starting."""
    if os.getuid() != 0:
        pytest.fail("needs root: the point is a root-owned 0600 key read by another user")
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(dump_config(cfg))
    certs.init_ca(tmp_path / "ca", cluster_name=cfg.name)
    certs.issue(tmp_path / "ca", tmp_path / "ca", role=Role.MAINTENANCE, node_id="mnt-0")
    etc = host_root / "etc"
    install_files(etc, role="maintenance", node_id="mnt-0", source_tls=tmp_path / "ca", cluster=cluster,
                  env_lines=["KVC_ID=mnt-0", "KVC_ARGS="])
    os.chown(etc / "tls" / "mnt-0.key", 0, 0)
    os.chmod(etc / "tls" / "mnt-0.key", 0o600)
    daemon = SandboxedDaemon(tmp_path, DAEMON_UNIT, "maintenance", etc, name="maintenance")
    try:
        assert daemon.proc.wait(timeout=300) != 0
    finally:
        daemon.close()
    assert "Permission denied" in daemon.log.read_text() and "mnt-0.key" in daemon.log.read_text()


def free_metrics_address() -> str:
    from kvcompassd.launcher import free_loopback_port

    return f"127.0.0.1:{free_loopback_port()}"


@pytest.mark.parametrize("unit,instance", [(DAEMON_UNIT, "edge"), (WORKER_UNIT, "us-0")], ids=lambda v: str(v))
def test_units_pass_systemd_analyze_verify(tmp_path, unit, instance):
    # verify insists that ExecStart exists: point it at this environment's entry point.
    exe = Path(sys.executable).with_name("kvcompassd")
    text = unit.read_text().replace(INSTALLED_EXE, str(exe))
    (tmp_path / unit.name).write_text(text)
    name = unit.name.replace("@.", f"@{instance}.")
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True,
                         cwd=tmp_path, check=False)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if unit.name.split("@")[0] in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


def test_readme_prescribes_the_layout_this_test_installs():
    readme = (REPO / "README.md").read_text()
    for line in ("install -d -o root -g kvcompass -m 0750 /etc/kvcompass /etc/kvcompass/tls",
                 "install -o root -g kvcompass -m 0640 cluster.toml /etc/kvcompass/cluster.toml",
                 "install -o root -g kvcompass -m 0640 <role>.env /etc/kvcompass/<role>.env",
                 "install -o root -g root -m 0644 ca/ca.pem ca/<id>.pem /etc/kvcompass/tls/",
                 "install -o root -g kvcompass -m 0640 ca/<id>.key /etc/kvcompass/tls/<id>.key"):
        assert line in readme, f"README no longer says: {line}"
    assert {(p, m, g) for p, m, g in PRESCRIBED} == {
        ("", 0o750, True), ("tls", 0o750, True), ("cluster.toml", 0o640, True), ("{role}.env", 0o640, True),
        ("tls/ca.pem", 0o644, False), ("tls/{id}.pem", 0o644, False), ("tls/{id}.key", 0o640, True)}
