"""``kvcompassd demo`` as an operator runs it: ``--keep`` keeps KVCompass's deployment and says
where it is, and SIGTERM stops every node the demo started (Ctrl-C while it measures:
``test_demo_signals.py``); a deployment that cannot start is one error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from demo_helpers import Demo, group_members
from kvcompassd.core.config import load_config
from kvcompassd.demo import bundled_workload, ctl_command


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
