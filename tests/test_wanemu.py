"""The user-space WAN relay: delays, loss and ordering on real UDP sockets."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from kvcompassd.core.config import parse_config
from kvcompassd.wanemu import WanEmulator, WanEmulatorError, WanRelay

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    def runner(coroutine):
        async def guarded():
            async with asyncio.timeout(30):
                return await coroutine

        with asyncio.Runner(loop_factory=LOOPS[request.param]) as loop_runner:
            return loop_runner.run(guarded())

    return runner


class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        self.transport.sendto(data, addr)


class Collector(asyncio.DatagramProtocol):
    def __init__(self):
        self.received: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()

    def datagram_received(self, data, addr):
        self.received.put_nowait((data, time.monotonic()))


async def echo_server() -> tuple[asyncio.DatagramTransport, tuple[str, int]]:
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    return transport, transport.get_extra_info("sockname")[:2]


async def client_to(address):
    collector = Collector()
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: collector, remote_addr=address)
    return transport, collector


def test_relay_delays_both_directions(run):
    async def scenario():
        server, server_address = await echo_server()
        relay = WanRelay(("127.0.0.1", 0), server_address, 30.0, return_delay_ms=10.0)
        address = await relay.start()
        client, collector = await client_to(address)
        try:
            for i in range(5):
                sent_at = time.monotonic()
                client.sendto(b"ping %d" % i)
                data, received_at = await collector.received.get()
                assert data == b"ping %d" % i
                assert received_at - sent_at >= 0.040
            assert relay.forward_stats.sent == relay.backward_stats.sent == 5
        finally:
            client.close()
            await relay.stop()
            server.close()

    run(scenario())


def test_loss_is_seeded_and_counted(run):
    async def scenario():
        server, server_address = await echo_server()
        outcomes = []
        for _ in range(2):
            relay = WanRelay(("127.0.0.1", 0), server_address, 1.0, loss=0.3, seed=42)
            address = await relay.start()
            client, collector = await client_to(address)
            for i in range(200):
                client.sendto(b"%d" % i)
            # Every packet is either dropped or echoed back (possibly dropped on the way back).
            while relay.forward_stats.received < 200 or (
                relay.forward_stats.sent + relay.forward_stats.dropped < 200
                or relay.backward_stats.sent + relay.backward_stats.dropped < relay.forward_stats.sent
            ):
                await asyncio.sleep(0.01)
            outcomes.append((relay.forward_stats.dropped, relay.backward_stats.dropped))
            assert 20 < relay.forward_stats.dropped < 100
            client.close()
            await relay.stop()
        server.close()
        assert outcomes[0][0] == outcomes[1][0]  # the same seed drops the same forward packets

    run(scenario())


@pytest.mark.parametrize("allow_reorder", [False, True])
def test_jitter_keeps_order_unless_reordering_is_allowed(run, allow_reorder):
    async def scenario():
        sink = Collector()
        loop = asyncio.get_running_loop()
        sink_transport, _ = await loop.create_datagram_endpoint(lambda: sink, local_addr=("127.0.0.1", 0))
        relay = WanRelay(
            ("127.0.0.1", 0), sink_transport.get_extra_info("sockname")[:2], 5.0, jitter=0.9, seed=1, allow_reorder=allow_reorder
        )
        address = await relay.start()
        client, _ = await client_to(address)
        for i in range(300):
            client.sendto(i.to_bytes(2, "big"))
            if i % 10 == 0:
                await asyncio.sleep(0.001)  # spread sends over time so jitter can overtake
        order = [int.from_bytes((await sink.received.get())[0], "big") for _ in range(300)]
        client.close()
        await relay.stop()
        sink_transport.close()
        assert sorted(order) == list(range(300))
        if not allow_reorder:
            assert order == list(range(300))

    run(scenario())


def test_invalid_relay_parameters_are_refused():
    with pytest.raises(WanEmulatorError, match="loss"):
        WanRelay(("127.0.0.1", 0), ("127.0.0.1", 1), 1.0, loss=1.0)
    with pytest.raises(WanEmulatorError, match="delay_ms"):
        WanRelay(("127.0.0.1", 0), ("127.0.0.1", 1), -1.0)
    with pytest.raises(WanEmulatorError, match="jitter"):
        WanRelay(("127.0.0.1", 0), ("127.0.0.1", 1), 1.0, jitter=2.0)


WORKER = {"vram_kv_tokens": 1000, "dram_kv_tokens": 1000, "max_running": 4}
CONFIG = {
    "cluster": {"name": "t", "model": "m", "shards": 1, "intra_region_one_way_ms": 0.5},
    "regions": [{"name": "us"}, {"name": "eu"}],
    "links": [{"between": ["us", "eu"], "one_way_ms": 25.0}],
    "workers": [
        {"id": "us-0", "region": "us", "prefill_ms_per_token": 0.1, "decode_ms_per_token": 10.0, **WORKER},
        {"id": "eu-0", "region": "eu", "prefill_ms_per_token": 0.1, "decode_ms_per_token": 10.0, **WORKER},
    ],
}


def test_emulator_builds_relays_for_every_node_of_a_cluster(run):
    async def scenario():
        data = dict(CONFIG)
        data["edges"] = [
            {"id": "edge-us", "region": "us", "quic": "127.0.0.1:7401"},
            {"id": "edge-eu", "region": "eu", "quic": "127.0.0.1:7402"},
        ]
        data["maintenance"] = [{"id": "mnt-0", "shard": 0, "quic": "127.0.0.1:7450"}]
        data["workers"] = [dict(w, agent=f"127.0.0.1:{7500 + i}") for i, w in enumerate(CONFIG["workers"])]
        config = parse_config(data, "test")
        emulator = WanEmulator(config)
        await emulator.add_cluster(config, maintenance_regions={"mnt-0": "us"})
        assert len(emulator.relays) == 5 * 2  # 5 nodes, each reachable from 2 regions
        assert emulator.relays[("eu", "mnt-0")].delay_ms == 25.0
        assert emulator.relays[("us", "mnt-0")].delay_ms == 0.5
        assert emulator.relays[("us", "eu-0")].target == ("127.0.0.1", 7501)
        await emulator.stop()

    run(scenario())


def test_emulator_routes_region_pairs_through_relays_with_matrix_delays(run):
    async def scenario():
        config = parse_config(CONFIG, "test")
        server, server_address = await echo_server()
        emulator = WanEmulator(config, relay_same_region=False)
        await emulator.add_node("edge-eu", "eu", server_address, from_regions=("us", "eu"))
        assert await emulator.address_for("eu", "edge-eu") == server_address  # same region: direct
        via = await emulator.address_for("us", "edge-eu")
        assert via != server_address
        assert emulator.relays[("us", "edge-eu")].delay_ms == config.one_way_ms("us", "eu") == 25.0
        client, collector = await client_to(via)
        sent_at = time.monotonic()
        client.sendto(b"hello")
        data, received_at = await collector.received.get()
        assert data == b"hello" and received_at - sent_at >= 0.050
        with pytest.raises(KeyError):
            await emulator.address_for("us", "nobody")
        client.close()
        await emulator.stop()
        server.close()

    run(scenario())
