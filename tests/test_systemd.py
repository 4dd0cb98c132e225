"""The systemd units: verified by systemd-analyze where the machine has it, parsed otherwise."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parent.parent / "systemd"


def _parse(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read_string(path.read_text())
    return parser


def test_daemon_unit_is_notify_hardened_and_reloadable():
    unit = _parse(UNITS / "kvcompassd@.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert "kvcompassd %i" in service["ExecStart"] and "--tls-dir" in service["ExecStart"]
    assert "HUP" in service["ExecReload"]
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "DynamicUser": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": ""}.items():
        assert service[key] == value, key
    assert service["StateDirectory"] and service["ConfigurationDirectory"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not on this machine")
@pytest.mark.parametrize("unit,instance", [("kvcompassd@.service", "edge"), ("kvcompass-emulated-worker@.service", "us-0")])
def test_units_pass_systemd_analyze_verify(tmp_path, unit, instance):
    # verify insists that ExecStart exists: point it at this environment's entry point.
    exe = Path(sys.executable).with_name("kvcompassd")
    text = (UNITS / unit).read_text().replace("/opt/kvcompass/venv/bin/kvcompassd", str(exe))
    (tmp_path / unit).write_text(text)
    name = unit.replace("@.", f"@{instance}.")
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True, cwd=tmp_path)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if unit.split("@")[0] in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
