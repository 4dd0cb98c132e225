"""The launcher: a cluster's addresses are distinct and never a port handed out before it;
stopping leaves no node running."""

import asyncio
import signal
import subprocess
import sys

import pytest

from kvcompassd.launcher import DeploymentSpec, LocalDeployment, NodeProcess, build_cluster
from kvcompassd.loopback_ports import free_loopback_port


def test_a_port_handed_out_before_the_cluster_is_not_one_of_its_addresses():
    # A test picks a node's --metrics port, then builds its cluster: the cluster must not get it
    # (seen as "two sockets on one host cannot share a port" at start-up).
    metrics = free_loopback_port()
    assert metrics not in {int(a.rsplit(":", 1)[1]) for a in _addresses(build_cluster(DeploymentSpec()))}


def _addresses(cfg) -> list[str]:
    return [a for w in cfg.workers for a in (w.http, w.kv_events, w.agent) if a] + \
        [a for e in cfg.edges for a in (e.http, e.quic) if a] + [m.quic for m in cfg.maintenance]


def test_cluster_addresses_are_distinct():
    cfg = build_cluster(DeploymentSpec())
    addresses = [w.http for w in cfg.workers] + [w.agent for w in cfg.workers] \
        + [w.kv_events for w in cfg.workers] + [e.quic for e in cfg.edges] + [e.http for e in cfg.edges] \
        + [m.quic for m in cfg.maintenance]
    ports = [int(str(a).rsplit(":", 1)[1]) for a in addresses]
    assert len(ports) == len(set(ports))


@pytest.fixture
def stubborn_node():
    """A process that ignores SIGTERM (and has said so before we go on)."""
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


async def test_a_cancelled_stop_still_kills_and_reaps_every_node(tmp_path, stubborn_node):
    # stop() is left waiting for a node that ignores SIGTERM when it is cancelled (a second
    # Ctrl-C, the demo shutting down): it must not leave the node running.
    dep = LocalDeployment(DeploymentSpec(wan=False), tmp_path)
    dep.nodes["agent:stubborn"] = NodeProcess("stubborn", "agent", "us", [], tmp_path / "stubborn.log", stubborn_node)
    stopping = asyncio.create_task(dep.stop())
    await asyncio.sleep(0)  # stop() sends SIGTERM and suspends waiting for the node
    assert stubborn_node.poll() is None
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stubborn_node.returncode == -signal.SIGKILL  # killed and reaped, not left behind
