"""What the daemon modes share: the transport options they take from the cluster config."""

import copy

from kvcompassd.core.config import parse_config
from kvcompassd.daemon import DAEMON_TRANSPORT, daemon_transport
from kvcompassd.launcher import DeploymentSpec, build_cluster

from test_config import minimal


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
