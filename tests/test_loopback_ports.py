"""Loopback ports for local deployments: unique per host (in one process and across processes),
below the kernel's ephemeral range, never one that is bound now; a gone owner's reservations are
reclaimed."""

import os
import random
import socket
import subprocess
import sys

from kvcompassd.loopback_ports import (
    _HANDED_OUT,
    _ephemeral_port_low,
    _owner_tag,
    _Ports,
    free_loopback_port,
    reserve_host_wide,
)


def test_ports_are_unique_below_the_ephemeral_range_and_pairs_reserve_the_next_port(tmp_path):
    ports = _Ports(random.Random(7), reservations=tmp_path)
    low = _ephemeral_port_low()
    handed = []
    for i in range(200):
        pair = i % 3 == 0
        port = ports.get(socket.SOCK_DGRAM if i % 2 else socket.SOCK_STREAM, pair=pair)
        handed += [port, port + 1] if pair else [port]
    assert len(handed) == len(set(handed))
    assert all(1024 <= p < low for p in handed)
    assert {int(p.name) for p in tmp_path.iterdir()} == set(handed)  # each one reserved host-wide


def test_a_port_in_use_is_not_handed_out(tmp_path):
    rng_seed = 11
    first = _Ports(random.Random(rng_seed), reservations=tmp_path).get(socket.SOCK_DGRAM)
    _HANDED_OUT.discard(first)  # as if another process had picked it: only the bind check stands
    (tmp_path / str(first)).unlink()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", first))
        again = _Ports(random.Random(rng_seed), reservations=tmp_path).get(socket.SOCK_DGRAM)  # same draws
    assert again != first


def test_a_port_handed_out_but_not_yet_bound_is_not_handed_out_again_in_the_process():
    first = _Ports(random.Random(23)).get()
    assert _Ports(random.Random(23)).get() != first
    assert free_loopback_port() != first


def _reserve_in_another_process(directory, seed: int, count: int) -> tuple[subprocess.Popen, list[int]]:
    code = ("import random, sys; from pathlib import Path; from kvcompassd.loopback_ports import _Ports; "
            f"p = _Ports(random.Random({seed}), reservations=Path(sys.argv[1])); "
            f"print(' '.join(str(p.get()) for _ in range({count})), flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    ports = [int(p) for p in proc.stdout.readline().split()]
    return proc, ports


def test_a_port_another_live_process_holds_is_not_handed_out_even_with_the_same_draws(tmp_path):
    # Two test suites on one host: the other suite picked these ports and has not bound them yet.
    other, theirs = _reserve_in_another_process(tmp_path, seed=5, count=20)
    try:
        ours = [_Ports(random.Random(5), reservations=tmp_path).get() for _ in range(20)]
        assert not set(ours) & set(theirs)
    finally:
        other.stdin.close()
        other.wait()
    # The other process exited and removed its reservations.
    assert not {int(p.name) for p in tmp_path.iterdir()} & set(theirs)


def test_a_dead_owners_reservation_is_reclaimed_and_a_live_ones_is_honoured(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "20001").write_text(f"{int(dead.stdout)} 12345")  # that pid is gone (or reused since)
    assert reserve_host_wide(20001, tmp_path)
    (tmp_path / "20002").write_text(_owner_tag(os.getppid()))  # our parent lives
    assert not reserve_host_wide(20002, tmp_path)
    (tmp_path / "20003").write_text("garbage")  # half-written by an owner that crashed
    assert reserve_host_wide(20003, tmp_path)
