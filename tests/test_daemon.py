"""What the daemon modes share: the transport options they take from the cluster config, and
the reload (SIGHUP) that rotates a node's certificate, end to end with real daemons."""

import asyncio
import copy
import signal
import subprocess
from pathlib import Path

from daemon_helpers import NotifySocket, kvcompassd_argv, log_events, start, stop
from e2e_helpers import eventually
from test_config import minimal

from kvcompassd import certs
from kvcompassd.core.config import dump_config, parse_config
from kvcompassd.daemon import (
    DAEMON_TRANSPORT,
    daemon_transport,
    split_address,
    tls_files,
)
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.transport import QuicNode
from kvcompassd.wire import AdminAnswered, AdminQueried, NodeIdentity, Role


def test_datagram_size_is_by_path_unless_the_cluster_sets_one():
    by_path = parse_config(minimal(), "x.toml")
    assert by_path.max_datagram_size == 0 and daemon_transport(by_path) == DAEMON_TRANSPORT
    data = copy.deepcopy(minimal())
    data["cluster"]["max_datagram_size"] = 9000
    jumbo = daemon_transport(parse_config(data, "x.toml"))
    assert jumbo.max_datagram_size == 9000 and jumbo.idle_timeout == DAEMON_TRANSPORT.idle_timeout


def test_emulated_wan_deployments_send_wan_sized_packets():
    # The relays stand on loopback addresses, which would otherwise get 16 KiB packets.
    assert build_cluster(DeploymentSpec(wan=True)).max_datagram_size == 1200
    assert build_cluster(DeploymentSpec(wan=False)).max_datagram_size == 0


# ---------------------------------------------------------------- certificate rotation, end to end


async def admin_status(peer) -> dict:
    async with peer.open_stream() as exchange:
        await exchange.send(AdminQueried("status", {}))
        async for reply in exchange:
            assert isinstance(reply, AdminAnswered), reply
            return reply.body
    raise AssertionError("no answer")


def test_sighup_rotates_the_certificate_for_new_inbound_and_outbound_connections(tmp_path):
    """Real daemons: an edge and a maintenance unit run; the edge's certificate is reissued and
    the edge gets SIGHUP (systemctl reload). A new admin connection to the edge sees the new
    serial, the edge's first connection to a maintenance unit started after the reload presents
    it, and connections made before the reload carry on with the old session."""
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=2, wan=False))
    config = tmp_path / "cluster.toml"
    config.write_text(dump_config(cfg))
    tls = tmp_path / "tls"
    certs.init_ca(tls, cluster_name=cfg.name)
    for node_id, role in (("mnt-0", Role.MAINTENANCE), ("mnt-1", Role.MAINTENANCE), ("edge-us", Role.EDGE),
                          ("admin", Role.ADMIN)):
        certs.issue(tls, tls, role=role, node_id=node_id)
    old_serial = certs.load_certificate(tls / "edge-us.pem").serial_number
    procs: dict[str, tuple[subprocess.Popen, Path, NotifySocket]] = {}

    def launch(mode: str, node_id: str) -> None:
        notify = NotifySocket(tmp_path / f"{node_id}.notify")
        log = tmp_path / f"{node_id}.log"
        procs[node_id] = (start(kvcompassd_argv(mode, config, node_id, tls), log, notify), log, notify)
        notify.expect("READY=1", procs[node_id][0], log)

    def peer_up_from_edge(node_id: str) -> list[dict]:
        return [r for r in log_events(procs[node_id][1], "peer_up") if r["peer"] == "edge:edge-us"]

    def edge_peer_up(node_id: str) -> list[dict]:
        return [r for r in log_events(procs["edge-us"][1], "peer_up") if r["peer"] == f"maintenance:{node_id}"]

    async def scenario() -> None:
        edge_address = split_address(cfg.edges[0].quic, "edge")
        admin = QuicNode(NodeIdentity(Role.ADMIN, "admin"), tls_files(tls, "admin"), on_message=lambda *a: None)
        later_admin = QuicNode(NodeIdentity(Role.ADMIN, "admin"), tls_files(tls, "admin"), on_message=lambda *a: None)
        try:
            await asyncio.to_thread(launch, "maintenance", "mnt-0")
            await asyncio.to_thread(launch, "edge", "edge-us")
            established = await admin.connect(edge_address, expected_role=Role.EDGE)
            connection = established._connection
            assert established.certificate.serial_number == old_serial
            assert (await admin_status(established))["mode"] == "edge"
            await eventually(lambda: _async(peer_up_from_edge("mnt-0")))
            assert peer_up_from_edge("mnt-0")[0]["certificate_serial"] == f"{old_serial:x}"
            # ... and up at the edge's end too: the server side completes the handshake first, and
            # a dial still in flight at the reload is redone with the new certificate (below), so
            # a reload between the two ends would make a second connection to mnt-0.
            await eventually(lambda: _async(edge_peer_up("mnt-0")))

            certs.issue(tls, tls, role=Role.EDGE, node_id="edge-us")  # rotation: same id, new key
            new_serial = certs.load_certificate(tls / "edge-us.pem").serial_number
            proc, log, notify = procs["edge-us"]
            proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(notify.expect, "RELOADING=1", proc, log)
            await asyncio.to_thread(notify.expect, "READY=1", proc, log)
            assert [r["certificate_serial"] for r in log_events(log, "tls_reloaded")] == [f"{new_serial:x}"]

            # New inbound connection: the listener answers with the new certificate.
            fresh = await later_admin.connect(edge_address, expected_role=Role.EDGE)
            assert fresh.certificate.serial_number == new_serial
            assert (await admin_status(fresh))["mode"] == "edge"
            # New outbound connection: mnt-1 starts only now; the edge dials it with the new
            # certificate. (An attempt begun before the reload may complete first, with the old
            # one, when mnt-1 answers its retransmitted Initial; the edge then redials at once.)
            await asyncio.to_thread(launch, "maintenance", "mnt-1")
            await eventually(lambda: _async(f"{new_serial:x}" in [r["certificate_serial"]
                                                                   for r in peer_up_from_edge("mnt-1")]))
            # Connections made before the reload carry on, on their old session.
            assert (await admin_status(established))["mode"] == "edge"
            assert established._connection is connection and established.certificate.serial_number == old_serial
            assert len(peer_up_from_edge("mnt-0")) == 1
            assert not [r for r in log_events(procs["mnt-0"][1], "peer_down") if r["peer"] == "edge:edge-us"]

            # A half-copied rotation (a new key beside the current certificate) is refused on
            # reload, and the edge goes on presenting the certificate it has.
            spare = certs.issue(tls, tmp_path / "spare", role=Role.EDGE, node_id="edge-us")
            (tls / "edge-us.key").write_bytes(spare.key.read_bytes())
            proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(notify.expect, "RELOADING=1", proc, log)
            await asyncio.to_thread(notify.expect, "READY=1", proc, log)
            failures = [r for r in log_events(log, "reload failed; still running with the certificates loaded before")]
            assert len(failures) == 1 and "is not the key of" in failures[0]["error"]
            third = QuicNode(NodeIdentity(Role.ADMIN, "admin"), tls_files(tls, "admin"), on_message=lambda *a: None)
            try:
                peer = await third.connect(edge_address, expected_role=Role.EDGE)
                assert peer.certificate.serial_number == new_serial
                assert (await admin_status(peer))["mode"] == "edge"
            finally:
                await third.close()
        finally:
            await admin.close()
            await later_admin.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        codes = {node_id: stop(proc) for node_id, (proc, _, _) in procs.items()}
        for _, _, notify in procs.values():
            notify.close()
    assert codes == {"mnt-0": 0, "edge-us": 0, "mnt-1": 0}, codes


async def _async(value):
    return value
