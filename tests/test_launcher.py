"""The launcher: listen ports never collide with each other nor with the kernel's ephemeral
ports, which the nodes' own outgoing sockets take; stopping leaves no node running."""

import asyncio
import random
import signal
import socket
import subprocess
import sys

import pytest

from kvcompassd.launcher import (
    DeploymentSpec,
    LocalDeployment,
    NodeProcess,
    _ephemeral_port_low,
    _HANDED_OUT,
    _Ports,
    build_cluster,
    free_loopback_port,
)


def test_ports_are_unique_below_the_ephemeral_range_and_pairs_reserve_the_next_port():
    ports = _Ports(random.Random(7))
    low = _ephemeral_port_low()
    handed = []
    for i in range(200):
        pair = i % 3 == 0
        port = ports.get(socket.SOCK_DGRAM if i % 2 else socket.SOCK_STREAM, pair=pair)
        handed += [port, port + 1] if pair else [port]
    assert len(handed) == len(set(handed))
    assert all(1024 <= p < low for p in handed)


def test_a_port_in_use_is_not_handed_out():
    rng_seed = 11
    first = _Ports(random.Random(rng_seed)).get(socket.SOCK_DGRAM)
    _HANDED_OUT.discard(first)  # as if another process had picked it: only the bind check stands
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", first))
        again = _Ports(random.Random(rng_seed)).get(socket.SOCK_DGRAM)  # same draws, first one busy
    assert again != first


def test_a_port_handed_out_but_not_yet_bound_is_not_handed_out_again_in_the_process():
    # A test picks a node's --metrics port, then builds its cluster: the same draws must not give
    # the cluster that port (seen as "two sockets on one host cannot share a port" at start-up).
    first = _Ports(random.Random(23)).get()
    assert _Ports(random.Random(23)).get() != first
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
