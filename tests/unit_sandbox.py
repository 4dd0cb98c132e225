"""Run a command under a systemd unit's own sandbox, without systemd as PID 1.

``tests/test_systemd.py`` reads a unit from ``systemd/``, turns its [Service] settings into a
spec (:func:`sandbox_spec`) and runs ``kvcompassd <mode>`` through this file as a script::

    python tests/unit_sandbox.py SPEC.json -- /path/to/kvcompassd edge --config ...

The script applies the spec the way systemd's exec code does just before ``execve``: the file
system view (``ProtectSystem=strict``, ``ProtectHome=yes``, ``ProtectProc=``/``ProcSubset=`` in
a private mount namespace),
resource limits, an empty capability bounding set, the unit's user and group, its umask,
``NoNewPrivileges``, then the seccomp filters, and execs the command. The seccomp part follows
systemd 252 (``src/core/load-fragment.c``, ``src/shared/seccomp-util.c``):

- ``SystemCallFilter=``: lines in order; the first decides allow- or deny-listing, an
  allow-list starts from ``@default``, later lines add (no ``~``) or remove (``~``) names. The
  ``@groups`` are expanded by ``systemd-analyze syscall-filter``: the installed systemd's own
  definitions. A call outside the allow-list kills the process (SIGSYS), systemd's default.
- ``SystemCallArchitectures=native``: libseccomp's default context (native ABI only).
- ``RestrictAddressFamilies=``, ``MemoryDenyWriteExecute=``, ``RestrictRealtime=``,
  ``RestrictNamespaces=``, ``LockPersonality=``: each its own stacked filter returning the errno
  systemd returns, as systemd installs them.

libseccomp is used through ctypes (``libseccomp.so.2``, which every Debian with systemd has).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

# ---------------------------------------------------------------- reading a unit


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as ``{section: [(key, value), ...]}`` in file order (keys repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            raise ValueError(f"{path}: line continuations are not supported here: {raw!r}")
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        if current is None or not sep:
            raise ValueError(f"{path}: cannot read {raw!r}")
        current.append((key.strip(), value.strip()))
    return sections


def values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def single(section: list[tuple[str, str]], key: str, default: str | None = None) -> str | None:
    found = values(section, key)
    if len(found) > 1:
        raise ValueError(f"{key}= is given {len(found)} times")
    return found[0] if found else default


@functools.cache
def expand_group(name: str) -> frozenset[str]:
    """The system calls of ``@name`` (nested groups expanded) as the installed systemd defines them."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    if not lines or lines[0].strip() != name:
        raise ValueError(f"systemd-analyze does not know {name}: {out.stdout[:200]!r}")
    names: set[str] = set()
    for line in lines[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        names |= expand_group(item) if item.startswith("@") else {item}
    return frozenset(names)


def _names(word: str) -> frozenset[str]:
    if ":" in word:
        raise ValueError(f"per-call errno suffixes are not supported here: {word!r}")
    return expand_group(word) if word.startswith("@") else frozenset({word})


def syscall_allow_list(lines: list[str]) -> frozenset[str]:
    """The allowed system calls of an allow-listing ``SystemCallFilter=`` sequence."""
    allowed: set[str] | None = None
    for line in lines:
        if not line:
            allowed = None  # an empty assignment resets the filter
            continue
        invert = line.startswith("~")
        words = line.lstrip("~").split()
        if allowed is None:
            if invert:
                raise ValueError("a deny-listing SystemCallFilter= is not what these units use")
            allowed = set(expand_group("@default"))
        for word in words:
            if invert:
                allowed -= _names(word)
            else:
                allowed |= _names(word)
    if allowed is None:
        raise ValueError("the unit has no SystemCallFilter=")
    return frozenset(allowed)


def _yes(value: str | None) -> bool:
    return value is not None and value.lower() in ("yes", "true", "on", "1")


def sandbox_spec(service: list[tuple[str, str]], *, uid: int, gid: int, expose: tuple[str, ...] = ()) -> dict:
    """What :func:`apply` needs, from a unit's [Service] section; the unit's User=/Group= run
    as ``uid``/``gid`` (the test's stand-ins for the ``kvcompass`` system user); ``expose``
    are directories under the home directories that stay readable (the test's interpreter)."""
    arch = single(service, "SystemCallArchitectures")
    if arch != "native":
        raise ValueError(f"SystemCallArchitectures={arch!r}: only 'native' is emulated")
    families = single(service, "RestrictAddressFamilies", "")
    if families.startswith("~"):
        raise ValueError("a deny-listing RestrictAddressFamilies= is not emulated")
    protect_system = single(service, "ProtectSystem")
    if protect_system not in (None, "strict"):
        raise ValueError(f"ProtectSystem={protect_system}: only 'strict' is emulated")
    limit = single(service, "LimitNOFILE")
    umask = single(service, "UMask", "0022")
    return {
        "uid": uid,
        "gid": gid,
        "protect_system": protect_system,
        "protect_home": _yes(single(service, "ProtectHome")),
        "proc_options": _proc_options(service),
        "expose": list(expose),
        "umask": int(umask, 8),
        "nofile": None if limit is None else int(limit),
        "no_new_privileges": _yes(single(service, "NoNewPrivileges")),
        "drop_bounding_set": single(service, "CapabilityBoundingSet") == "",
        "syscalls": sorted(syscall_allow_list(values(service, "SystemCallFilter"))),
        "address_families": [getattr(__import__("socket"), f) for f in families.split()] if families else None,
        "memory_deny_write_execute": _yes(single(service, "MemoryDenyWriteExecute")),
        "restrict_realtime": _yes(single(service, "RestrictRealtime")),
        "restrict_namespaces": _yes(single(service, "RestrictNamespaces")),
        "lock_personality": _yes(single(service, "LockPersonality")),
    }


def _proc_options(service: list[tuple[str, str]]) -> str:
    options = []
    protect = single(service, "ProtectProc")
    if protect not in (None, "default"):
        options.append(f"hidepid={protect}")
    subset = single(service, "ProcSubset")
    if subset not in (None, "all"):
        options.append(f"subset={subset}")
    return ",".join(options)


def expand_exec(line: str, *, instance: str, env: dict[str, str]) -> list[str]:
    """``ExecStart=`` as systemd expands it: ``%i``, ``${VAR}`` as one word, ``$VAR`` split."""
    words = []
    for word in line.replace("%i", instance).split():
        if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", word):
            words += env.get(word[1:], "").split()
            continue
        words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
    return words


def read_environment_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().strip('"')
    return env


# ---------------------------------------------------------------- applying it (the child)

_ACT_KILL_PROCESS = 0x80000000
_ACT_ALLOW = 0x7FFF0000
_CMP_NE, _CMP_EQ, _CMP_GT, _CMP_MASKED_EQ = 1, 4, 6, 7
_PF_MAX = 46  # glibc 2.36's AF_MAX: families at or above it are refused too
_PROT_WRITE, _PROT_EXEC, _SHM_EXEC = 0x2, 0x4, 0o100000
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 38, 24


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


class _Seccomp:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCmp)]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        self.lib = lib

    def number(self, name: str) -> int | None:
        nr = self.lib.seccomp_syscall_resolve_name(name.encode())
        return None if nr == -1 else nr  # -1: unknown to this libseccomp (systemd skips those too)

    def load(self, default: int, rules: list[tuple[int, str, list[tuple[int, int, int, int]]]]) -> None:
        ctx = self.lib.seccomp_init(default)
        if not ctx:
            raise OSError("seccomp_init failed")
        try:
            for action, name, comparisons in rules:
                nr = self.number(name)
                if nr is None:
                    continue
                array = (_ArgCmp * max(1, len(comparisons)))(*[_ArgCmp(*c) for c in comparisons])
                rc = self.lib.seccomp_rule_add_array(ctx, action, nr, len(comparisons), array)
                if rc < 0 and nr >= 0:
                    raise OSError(-rc, f"seccomp rule for {name} {comparisons}: {os.strerror(-rc)}")
            rc = self.lib.seccomp_load(ctx)
            if rc < 0:
                raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
        finally:
            self.lib.seccomp_release(ctx)


def _filters(spec: dict) -> list[tuple[int, list]]:
    """(default action, rules) of each filter, in the order systemd installs them."""
    filters = []
    eperm = _errno_action(errno.EPERM)
    if spec["address_families"] is not None:
        refused = [f for f in range(_PF_MAX) if f not in spec["address_families"]]
        rules = [(_errno_action(errno.EAFNOSUPPORT), "socket", [(0, _CMP_EQ, f, 0)]) for f in refused]
        rules.append((_errno_action(errno.EAFNOSUPPORT), "socket", [(0, _CMP_GT, _PF_MAX - 1, 0)]))
        filters.append((_ACT_ALLOW, rules))
    if spec["restrict_namespaces"]:
        filters.append((_ACT_ALLOW, [
            (eperm, "setns", []),
            *[(eperm, "unshare", [(0, _CMP_MASKED_EQ, bit, bit)]) for bit in _bits(_CLONE_NEW)],
            *[(eperm, "clone", [(0, _CMP_MASKED_EQ, bit, bit)]) for bit in _bits(_CLONE_NEW)],
            # clone3's flags sit in memory seccomp cannot read: systemd answers ENOSYS, so libc
            # falls back to clone(), whose flags it can check.
            (_errno_action(errno.ENOSYS), "clone3", []),
        ]))
    if spec["memory_deny_write_execute"]:
        filters.append((_ACT_ALLOW, [
            (eperm, "mmap", [(2, _CMP_MASKED_EQ, _PROT_WRITE | _PROT_EXEC, _PROT_WRITE | _PROT_EXEC)]),
            (eperm, "mprotect", [(2, _CMP_MASKED_EQ, _PROT_EXEC, _PROT_EXEC)]),
            (eperm, "pkey_mprotect", [(2, _CMP_MASKED_EQ, _PROT_EXEC, _PROT_EXEC)]),
            (eperm, "shmat", [(2, _CMP_MASKED_EQ, _SHM_EXEC, _SHM_EXEC)]),
        ]))
    if spec["restrict_realtime"]:
        # SCHED_OTHER (0), SCHED_BATCH (3) and SCHED_IDLE (5) stay; FIFO, RR and above do not.
        rules = [(eperm, "sched_setscheduler", [(1, _CMP_EQ, p, 0)]) for p in (1, 2, 4)]
        rules.append((eperm, "sched_setscheduler", [(1, _CMP_GT, 5, 0)]))
        filters.append((_ACT_ALLOW, rules))
    if spec["lock_personality"]:
        # Only the running persona (PER_LINUX = 0). systemd also lets the query 0xffffffff
        # through; one libseccomp rule cannot compare an argument twice, so this is stricter.
        filters.append((_ACT_ALLOW, [(eperm, "personality", [(0, _CMP_NE, 0, 0)])]))
    filters.append((_ACT_KILL_PROCESS, [(_ACT_ALLOW, name, []) for name in spec["syscalls"]]))
    return filters


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(32) if mask >> i & 1]


_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_HOME_DIRECTORIES = ("/home", "/root", "/run/user")


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source} on {target} ({fstype}, {flags:#x}): {os.strerror(code)}")


def _mounts() -> list[tuple[str, set[str]]]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        out.append((fields[4].replace("\\040", " "), set(fields[5].split(","))))
    return out


def _file_system_view(libc, spec: dict) -> None:
    """ProtectSystem=strict and ProtectHome=yes in a private mount namespace: every file system
    read-only but /dev, /proc and /sys; /home, /root and /run/user empty and inaccessible, but
    for ``expose`` (the test machine's interpreter, which lives under /root) bound read-only."""
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    exposed = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in spec["expose"]}
    if spec["protect_system"] == "strict":
        for target, options in _mounts():
            if target.startswith(("/dev", "/proc", "/sys")) or "ro" in options:
                continue
            kept = sum(flag for name, flag in (("nosuid", _MS_NOSUID), ("nodev", _MS_NODEV), ("noexec", _MS_NOEXEC))
                       if name in options)
            _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept)
    if spec["proc_options"]:
        # ProtectProc=/ProcSubset=: a procfs instance of its own, with only the process
        # directories (no /proc/cpuinfo, /proc/meminfo, /proc/sys) and others' processes hidden.
        _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, spec["proc_options"])
    if spec["protect_home"]:
        for hidden in _HOME_DIRECTORIES:
            if not os.path.isdir(hidden):
                continue
            inside = [p for p in exposed if p == hidden or p.startswith(hidden + "/")]
            mode = "mode=0755" if inside else "mode=0000"
            _mount(libc, "tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV, mode)
            for path in inside:
                os.makedirs(path, exist_ok=True)
                _mount(libc, f"/proc/self/fd/{exposed[path]}", path, None, _MS_BIND | _MS_REC)
                _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY)
            _mount(libc, None, hidden, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, mode)
    for fd in exposed.values():
        os.close(fd)


def apply(spec: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if os.getuid() == 0 and (spec["protect_system"] or spec["protect_home"] or spec["proc_options"]):
        _file_system_view(libc, spec)
    if spec["nofile"] is not None:
        # systemd raises the hard limit too; a container without CAP_SYS_RESOURCE cannot.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        limit = spec["nofile"] if hard == resource.RLIM_INFINITY else min(spec["nofile"], hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    if spec["drop_bounding_set"] and os.getuid() == 0:
        for cap in range(64):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
                raise OSError(ctypes.get_errno(), f"dropping capability {cap}")
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    os.umask(spec["umask"])
    if spec["no_new_privileges"] and libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    seccomp = _Seccomp()
    for default, rules in _filters(spec):
        seccomp.load(default, rules)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: unit_sandbox.py SPEC.json -- COMMAND [ARG...]")
    spec = json.loads(Path(argv[0]).read_text())
    command = argv[2:]
    apply(spec)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
