"""The agent's discovery of its engine's replay socket, against real HTTP servers answering as
SGLang (``/server_info`` with the ``--kv-events-config`` JSON) and vLLM (no ``/server_info``)
do. A vLLM worker without ``kv_events_replay`` must still be followed (without replay), not
waited for forever."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import aiohttp
import pytest
import structlog
import zmq.asyncio
from aiohttp import web

from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd import certs
from kvcompassd.agent import AgentNode
from kvcompassd.daemon import tls_files
from kvcompassd.emulator.publisher import KvEventPublisher
from kvcompassd.engine.client import EngineClient
from kvcompassd.engine.kvevents import BlockStored, EventBatch
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.wire import PrefillDecodeForwarded, Role

GUARD_S = 30.0  # hang guard only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, wan=False))
    tmp = tmp_path_factory.mktemp("agent-tls")
    certs.init_ca(Path(tmp), cluster_name=cfg.name)
    certs.issue(Path(tmp), Path(tmp), role=Role.AGENT, node_id=cfg.workers[0].id)
    return cfg, tls_files(str(tmp), cfg.workers[0].id)


async def serve(routes: dict) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def replay_found(cluster, routes: dict) -> str | None:
    cfg, tls = cluster
    agent = AgentNode(cfg, cfg.workers[0], tls)
    runner, url = await serve(routes)
    try:
        async with WorkerConnections() as http:
            agent.engine = EngineClient(url, http)
            async with asyncio.timeout(GUARD_S):
                return await agent.find_replay_endpoint()
    finally:
        await runner.cleanup()
        await agent.node.close()


async def test_sglang_reports_its_replay_endpoint_in_server_info(cluster):
    async def server_info(_):  # SGLang: server_args.kv_events_config is the JSON string given
        config = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
        return web.json_response({"kv_events_config": json.dumps(config), "version": "0.5.23"})

    host = cluster[0].workers[0].kv_events.removeprefix("tcp://").rsplit(":", 1)[0]
    assert await replay_found(cluster, {"/server_info": server_info}) == f"tcp://{host}:5558"


async def test_an_engine_without_server_info_is_followed_without_replay(cluster):
    # vLLM serves no /server_info: aiohttp's router answers 404, as vLLM's FastAPI app does
    async def models(_):
        return web.json_response({"object": "list", "data": []})

    assert await replay_found(cluster, {"/v1/models": models}) is None


async def test_an_engine_that_is_not_ready_is_asked_again(cluster):
    answers = [web.Response(status=503), web.Response(status=503)]

    async def server_info(_):
        if answers:
            return answers.pop()
        return web.json_response({"kv_events_config": json.dumps({"replay_endpoint": "tcp://10.0.0.9:5558"})})

    assert await replay_found(cluster, {"/server_info": server_info}) == "tcp://10.0.0.9:5558"
    assert not answers


async def test_a_failure_while_applying_engine_events_does_not_end_the_following(cluster):
    """A bug on some engine input (the block tree raising, say) is logged; the agent follows
    the stream on from the same position, so later batches are still mirrored."""
    cfg, tls = cluster
    ctx = zmq.asyncio.Context()
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx)
    await pub.start()
    worker = dataclasses.replace(cfg.workers[0], kv_events=pub.endpoint, kv_events_replay=pub.replay_endpoint)
    agent = AgentNode(cfg, worker, tls)
    apply, failures = agent.tree.apply_events_with_lengths, []

    def apply_failing_once(events):  # fault injection: the first batch raises
        if not failures:
            failures.append(events)
            raise RuntimeError("injected")
        return apply(events)

    agent.tree.apply_events_with_lengths = apply_failing_once  # what the agent calls
    pub.publish([BlockStored((1,), None, tuple(range(16)), 16)])
    pub.publish([BlockStored((2,), None, tuple(range(100, 116)), 16)])
    task = asyncio.create_task(agent._follow_engine_events())
    try:
        async with asyncio.timeout(GUARD_S):
            while len(agent.tree) < 1 or agent.subscriber.tracker.last_applied != 1:
                await asyncio.sleep(0.01)
            pub.publish([BlockStored((3,), 2, tuple(range(116, 132)), 16)])  # live, after the failure
            while len(agent.tree) < 2:
                await asyncio.sleep(0.01)
        assert failures and not task.done()
        assert len(agent.tree) == 2  # blocks 2 and 3: batch 0 failed, and the following went on
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        await agent.node.close()
        ctx.destroy(linger=0)


async def test_engine_batches_within_the_report_window_leave_as_one_report_per_shard(cluster):
    """[sync] report_delay_ms: a burst of engine batches inside the window reaches the units as
    one report per shard, and a lone batch is reported within the window (not at once)."""
    cfg, tls = cluster
    cfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, report_delay_ms=50.0))
    agent = AgentNode(cfg, cfg.workers[0], tls)
    loop = asyncio.get_running_loop()
    sent = []  # (loop time, shard, reported keys)

    def send(shard, report):
        sent.append((loop.time(), shard, report.events.key_array().tolist()))
        return True

    agent.reports._send = send  # what the agent's QUIC send would get
    batches = iter(range(1, 100))

    async def engine_batch(root: int) -> None:  # a 64-token prompt: one indexed length, one key
        stored = BlockStored(tuple(range(root, root + 4)), None, tuple(range(root * 64, root * 64 + 64)), 16)
        await agent._on_engine_events(EventBatch(next(batches), 0.0, (stored,)))

    try:
        began = loop.time()
        for root in (100, 200, 300, 400):
            await engine_batch(root)
        assert sent == []
        await asyncio.sleep(0.2)  # due after the window's timer, so it runs after it
        keys = sorted(key for _, _, reported in sent for key in reported)
        assert len(keys) == 4 and len(sent) == len({shard for _, shard, _ in sent}) <= cfg.shards
        assert all(at >= began + 0.05 - 1e-3 for at, _, _ in sent)
        assert keys == sorted(agent.tree.registered())
        burst_reports, lone_at = len(sent), loop.time()
        await engine_batch(500)
        assert len(sent) == burst_reports
        await asyncio.sleep(0.2)
        assert len(sent) == burst_reports + 1 and len(sent[-1][2]) == 1
        assert lone_at + 0.05 - 1e-3 <= sent[-1][0]
    finally:
        await agent.node.close()


async def test_an_idle_engine_is_read_at_the_idle_period_and_kv_events_wake_the_reader(cluster):
    """Idle, the agent backs off its /v1/loads readings; the KV events of a request arriving at
    the engine bring the next reading at once, not after the idle period (here 60 s, past the
    hang guard, so a missed wake-up fails the test instead of passing late)."""
    from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings

    cfg, tls = cluster
    engine = EmulatedWorker(EmulatorSettings(port=0, kv_events_endpoint="tcp://127.0.0.1:*",
                                             kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0,
                                             worker_id=cfg.workers[0].id, block_size=cfg.index.block_size))
    await engine.start()
    worker = dataclasses.replace(cfg.workers[0], http=engine.http_url, kv_events=engine.kv_events_endpoint,
                                 kv_events_replay=engine.kv_replay_endpoint)
    agent = AgentNode(cfg, worker, tls, load_interval=0.01, load_idle_interval=60.0)
    readings = []
    async with aiohttp.ClientSession() as session, WorkerConnections() as http:
        agent._http = session
        agent.engine = EngineClient(engine.http_url, http)
        load = agent.engine.load

        async def counted(beta):
            readings.append(1)
            if len(readings) == 1:
                await asyncio.sleep(0.5)
            return await load(beta)

        agent.engine.load = counted
        sleeping_long, sleep = asyncio.Event(), agent._sleep_until_next_reading

        async def noted_sleep():
            # Only the idle period's sleep is the agent's own: the backoff's shorter ones are cut
            # to 10 ms. Taken whole, the last one before it could be 41 s, past the hang guard
            # (a failed run); the schedule's doubling itself is tests/test_pacing.py's.
            if agent.load_schedule.delay_s >= 60.0:
                sleeping_long.set()
                await sleep()
            else:
                await asyncio.sleep(0.01)

        agent._sleep_until_next_reading = noted_sleep
        tasks = [asyncio.create_task(agent._follow_engine_events()), asyncio.create_task(agent._load_loop())]
        try:
            async with asyncio.timeout(GUARD_S):
                # Backed off: 0.01 s doubling to 60 s. Until the loop sleeps at 60 s, since a
                # reading still in flight (the first is a change) sets the period back to 0.01 s.
                while not sleeping_long.is_set():
                    agent.load_schedule.observed(changed=False, busy=False)
                    await asyncio.sleep(0.01)
                # Now no reading until the 60 s have passed, or a wake-up.
                before = len(readings)
                async with session.post(f"{engine.http_url}/generate", json={
                        "input_ids": list(range(3 * cfg.index.block_size)),
                        "sampling_params": {"max_new_tokens": 1}}) as resp:
                    assert resp.status == 200
                while len(readings) == before:
                    await asyncio.sleep(0.01)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await agent.node.close()
            await engine.stop()


async def test_kv_events_wake_the_backed_off_reader_at_most_once_per_broadcast_period(cluster):
    """KV events (work the engine did) bring a reading at once after a quiet spell, then no
    sooner than the queue broadcast period after the previous reading, however many batches
    come; a forwarded request (work arriving) cuts that wait to a fast period."""
    cfg, tls = cluster
    agent = AgentNode(cfg, cfg.workers[0], tls, load_interval=0.01, load_idle_interval=60.0)
    spacing = cfg.score.broadcast_period_ms / 1000.0
    assert agent.load_schedule.done_spacing_s == spacing
    loop = asyncio.get_running_loop()
    try:
        for _ in range(20):  # readings that showed an idle, unchanged engine: backed off to 60 s
            agent.load_schedule.observed(changed=False, busy=False)

        async def sleep_with_signs(arrival_at: float | None) -> float:
            """One sleep after a reading started now, KV events every 5 ms (and a forwarded
            request at ``arrival_at``): seconds until the next reading."""
            began = agent._reading_started = time.monotonic()
            sleeping = asyncio.create_task(agent._sleep_until_next_reading())
            async with asyncio.timeout(GUARD_S):
                while not sleeping.done():
                    agent._work_arriving(done=True)
                    if arrival_at is not None and time.monotonic() - began >= arrival_at:
                        agent._work_arriving()
                    await asyncio.sleep(0.005)
            return time.monotonic() - began

        agent._reading_started = float("-inf")  # a quiet spell: the first batch reads at once
        agent._load_wake.clear()
        sleeping = asyncio.create_task(agent._sleep_until_next_reading())
        await asyncio.sleep(0.02)
        woke_at = loop.time()
        agent._work_arriving(done=True)
        await asyncio.wait_for(sleeping, GUARD_S)
        assert loop.time() - woke_at < spacing / 2
        assert await sleep_with_signs(None) >= spacing - 1e-3
        assert await sleep_with_signs(0.03) < spacing - 0.03  # the request's fast period, not the spacing
    finally:
        await agent.node.close()


def test_a_prefill_workers_agent_runs_pairs_only_with_a_decode_worker_of_its_region(tmp_path):
    cfg = build_cluster(DeploymentSpec.disaggregated(prefill=2, decode=1, regions=("us", "eu"), wan=False,
                                                     one_way_ms={("us", "eu"): 10.0}))
    certs.init_ca(tmp_path, cluster_name=cfg.name)
    for worker in ("us-p0", "us-d0"):
        certs.issue(tmp_path, tmp_path, role=Role.AGENT, node_id=worker)

    def refusal(agent_worker: str, decode_worker: str) -> str | None:
        agent = AgentNode(cfg, cfg.worker(agent_worker), tls_files(str(tmp_path), agent_worker))
        message = PrefillDecodeForwarded("r", "edge-us", "us", (1, 2), {}, True, 0, decode_worker, 5)
        return agent._pair_refusal(message)

    assert refusal("us-p0", "us-d0") is None
    assert "not a decode worker of region us" in refusal("us-p0", "eu-d0")
    assert "not a decode worker of region us" in refusal("us-p0", "us-p1")
    assert "unknown decode worker" in refusal("us-p0", "nowhere")
    assert "is a decode worker, not a prefill worker" in refusal("us-d0", "us-d0")


class _SentOnStream:
    """The QUIC stream a forwarded request's answer goes back on, as the messages sent on it."""

    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, message, *, end: bool = False) -> None:
        self.sent.append(message)


async def test_a_forwarded_request_goes_back_with_the_engines_own_time_for_it(cluster):
    # The edge takes what it saw beyond the engine's e2e_latency out of its prefill samples
    # (core/rates.py); over QUIC the agent is where that figure comes from.
    from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
    from kvcompassd.wire import RequestForwarded, ResponseCompleted

    cfg, tls = cluster
    agent = AgentNode(cfg, cfg.workers[0], tls)
    worker = EmulatedWorker(EmulatorSettings(port=0, kv_events_endpoint="tcp://127.0.0.1:*",
                                             kv_replay_endpoint="tcp://127.0.0.1:*", block_size=16,
                                             vram_kv_tokens=4096, dram_kv_tokens=0, time_scale=1.0,
                                             worker_id=cfg.workers[0].id))
    await worker.start()
    try:
        async with WorkerConnections() as http:
            agent.engine = EngineClient(worker.http_url, http)
            stream = _SentOnStream()
            msg = RequestForwarded("r-1", "edge-x", cfg.workers[0].region, tuple(range(1, 40)),
                                   {"max_new_tokens": 2}, True, 0)
            async with asyncio.timeout(GUARD_S):
                await agent._run_forwarded(stream, msg, structlog.get_logger())
    finally:
        await worker.stop()
        await agent.node.close()
    done = stream.sent[-1]
    assert type(done) is ResponseCompleted and done.completion_tokens == 2
    assert 0.0 < done.worker_latency_s < GUARD_S


class _RecordingEdge:
    """An edge peer of the agent, as the datagrams sent to it."""

    is_connected = True

    def __init__(self) -> None:
        self.datagrams: list = []

    def send_datagram(self, message) -> None:
        self.datagrams.append(message)


async def _load_loop_until(cfg, tls, loads, until) -> tuple[AgentNode, _RecordingEdge]:
    """Run an agent's load loop against an engine stand-in answering ``/v1/loads`` with ``loads``
    until ``until(agent, edge)`` returns; its edge records the datagrams it was sent."""
    runner, url = await serve({"/v1/loads": loads})
    agent = AgentNode(cfg, cfg.workers[0], tls, load_interval=0.01)
    edge = _RecordingEdge()
    agent._edge_peers["edge-us"] = edge
    try:
        async with WorkerConnections() as http:
            agent.engine = EngineClient(url, http)
            task = asyncio.create_task(agent._load_loop())
            try:
                async with asyncio.timeout(GUARD_S):
                    await until(agent, edge)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        await runner.cleanup()
        await agent.node.close()
    return agent, edge


def _datagrams(count: int):
    async def until(agent, edge) -> None:
        while len(edge.datagrams) < count:
            await asyncio.sleep(0.01)
    return until


async def test_an_sglang_engines_kv_pool_use_goes_to_the_edges_with_its_load_report(cluster):
    """SGLang's /v1/loads gives no room steps but the KV its requests hold (num_used_tokens over
    max_total_num_tokens): the agent sends that share after its load report
    (WorkerPinnedReported); an engine that gives room steps sends those instead. The SGLang
    answer is what SGLang 0.5.23's own handler built (tests/data/engine_loads)."""
    from kvcompassd.wire import WorkerLoadReported, WorkerPinnedReported, WorkerRoomReported

    cfg, tls = cluster
    worker_id = cfg.workers[0].id
    sglang = json.loads((Path(__file__).parent / "data" / "engine_loads" / "sglang-two-ranks.json").read_bytes())
    entry = {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
             "num_used_tokens": 3_000, "num_total_tokens": 3_000, "max_total_num_tokens": 12_000}
    shapes = {"sglang": sglang, "emulated": {"loads": [{**entry, "room_steps": [[0.0, 9_000], [40.0, 12_000]]}]}}
    for shape, body in shapes.items():
        async def loads(request, body=body):
            return web.json_response(body)

        _, edge = await _load_loop_until(cfg, tls, loads, _datagrams(2))
        report, extra = edge.datagrams[:2]
        if shape == "sglang":  # two ranks: 4 running, 2 waiting with 9,000 uncached tokens; 80,000 of 200,000 held
            assert report == WorkerLoadReported(worker_id, 9_000 * cfg.workers[0].prefill_ms_per_token, 4, 2)
            assert extra == WorkerPinnedReported(worker_id, 0.4)
        else:
            assert report == WorkerLoadReported(worker_id, 0.0, 2, 0)
            assert extra == WorkerRoomReported(worker_id, ((0.0, 9_000), (40.0, 12_000)))
            assert not any(isinstance(m, WorkerPinnedReported) for m in edge.datagrams)


async def test_a_busy_engines_readings_go_to_the_edges_once_they_move_past_the_tolerance(cluster):
    """An engine whose queue drains at one ms per ms, as the edges age it, is read every fast
    period but reported once; work arriving (the queue jumps) is reported at once. Each reading
    is counted as sent or held (``kvcompass_engine_load_readings_total``). The queue is long, so
    its 2 % tolerance (2 s) dwarfs any delay of a reading on a loaded machine; the heartbeat is 10 s."""
    from kvcompassd.wire import WorkerLoadReported

    cfg, tls = cluster
    cfg = dataclasses.replace(cfg, idle=dataclasses.replace(cfg.idle, heartbeat_ms=10_000.0, load_tolerance_ms=2.0,
                                                            load_tolerance_share=0.02))
    started, arrived = time.monotonic(), []

    async def loads(request):
        queue = max(0.0, 100_000.0 - 1000.0 * (time.monotonic() - started)) + (50_000.0 if arrived else 0.0)
        return web.json_response({"num_running_reqs": 3, "num_waiting_reqs": 0, "estimated_queue_ms": queue})

    def readings(agent: AgentNode, outcome: str) -> float:
        return agent.metrics.registry.get_sample_value("kvcompass_engine_load_readings_total", {"outcome": outcome})

    async def held_ten_then_arrival(agent, edge):
        while readings(agent, "held") < 10:
            await asyncio.sleep(0.01)
        arrived.append(True)
        await _datagrams(2)(agent, edge)

    agent, edge = await _load_loop_until(cfg, tls, loads, held_ten_then_arrival)
    first, after_arrival = edge.datagrams[:2]
    assert isinstance(first, WorkerLoadReported) and 90_000 < first.queue_ms <= 100_000
    assert isinstance(after_arrival, WorkerLoadReported) and after_arrival.queue_ms > 140_000
    assert readings(agent, "sent") == 2 and readings(agent, "held") >= 10


async def test_a_load_answer_no_report_can_carry_is_a_failed_reading_and_the_loop_goes_on(cluster):
    """An engine that answers /v1/loads with figures the load report cannot carry (a queue of
    10^12 ms, a negative count, a string) fails those readings; the next sane one is reported,
    marked resumed. Before, the report's own check raised in the agent's load loop and ended it:
    no load report again while the agent looked healthy."""
    from kvcompassd.wire import WorkerLoadReported

    cfg, tls = cluster
    answers = [{"estimated_queue_ms": 1e12}, {"num_running_reqs": -1}, {"num_running_reqs": "x"},
               {"num_running_reqs": 2, "estimated_queue_ms": 5.0}]

    async def loads(request):
        return web.json_response(answers.pop(0) if len(answers) > 1 else answers[0])

    _, edge = await _load_loop_until(cfg, tls, loads, _datagrams(1))
    assert edge.datagrams[0] == WorkerLoadReported(cfg.workers[0].id, 5.0, 2, 0, resumed=True)


async def test_a_busy_engine_only_one_edge_sends_work_to_is_read_at_the_sole_edge_period(cluster):
    """Busy, its KV pool under three quarters held, one edge connected and no other region's
    requests: the engine is read every ``[idle] sole_edge_poll_ms``. A second edge connecting,
    a request from another region, a pool three quarters held, or an answer without the pool's
    size each bring the fast period back at the next reading (``ReadingCadence``'s reasons)."""
    cfg, tls = cluster
    sole_s = cfg.idle.sole_edge_poll_ms / 1000.0
    answer = {"num_running_reqs": 4, "num_waiting_reqs": 1, "num_waiting_uncached_tokens": 500,
              "num_used_tokens": 4_000, "max_total_num_tokens": 16_000}
    served = []

    async def loads(request):
        served.append(1)
        return web.json_response(answer)

    async def next_reading(agent) -> tuple[float, str]:
        before = len(served)
        while len(served) < before + 2:  # (the reading in flight may predate the change)
            await asyncio.sleep(0.005)
        return agent.reading_period

    async def cases(agent, edge):
        fast = agent.reading_cadence.fast_s
        assert await next_reading(agent) == (sole_s, "one_edge")
        assert agent.load_schedule.delay_s == sole_s
        assert agent.describe()["reading_period_why"] == "one_edge"
        agent._work_arriving(done=True)  # a KV batch: the reading is due within that anyway
        assert not agent._load_wake.is_set()
        second = _RecordingEdge()
        agent._edge_peers["edge-us-2"] = second
        assert await next_reading(agent) == (fast, "several_edges")
        assert agent.load_schedule.delay_s == fast
        del agent._edge_peers["edge-us-2"]
        assert await next_reading(agent) == (sole_s, "one_edge")
        agent.vector_interest.remote_started(now=time.monotonic())
        assert await next_reading(agent) == (fast, "other_regions")
        agent.vector_interest.remote_ended(now=time.monotonic())
        assert agent.vector_interest.lapsed(now=time.monotonic() + 3600.0)  # (as the loop finds after the linger)
        assert await next_reading(agent) == (sole_s, "one_edge")
        answer["num_used_tokens"] = 12_000
        assert await next_reading(agent) == (fast, "memory_bound")
        del answer["max_total_num_tokens"]
        assert await next_reading(agent) == (fast, "pool_unreported")

    agent, _ = await _load_loop_until(cfg, tls, loads, cases)
    for why in ("one_edge", "several_edges", "other_regions", "memory_bound", "pool_unreported"):
        assert agent.metrics.registry.get_sample_value("kvcompass_engine_load_reading_periods_total", {"why": why}) >= 1
    assert agent.metrics.registry.get_sample_value("kvcompass_engine_load_reading_periods_total",
                                                   {"why": "decode_worker"}) == 0
    assert sole_s > 0.02  # the default is slower than the fast period this test runs at (10 ms)


async def test_sole_edge_poll_ms_0_reads_every_busy_engine_at_the_fast_period(cluster):
    cfg, tls = cluster
    cfg = dataclasses.replace(cfg, idle=dataclasses.replace(cfg.idle, sole_edge_poll_ms=0.0))
    answer = {"num_running_reqs": 4, "num_used_tokens": 1_000, "max_total_num_tokens": 16_000}

    async def loads(request):
        return web.json_response(answer)

    async def after_readings(agent, edge):
        while agent.reading_period[1] != "one_edge":
            await asyncio.sleep(0.005)

    agent, _ = await _load_loop_until(cfg, tls, loads, after_readings)
    assert agent.reading_period[0] == agent.reading_cadence.fast_s == agent.load_schedule.delay_s == 0.01
