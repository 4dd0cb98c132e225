"""The edge's forwarding path over real QUIC: a request that has no first token yet moves to the
next best worker when its agent's connection is gone, dies under it, or crawls (no first token
within the deadline; the abandoned agent is told to stop). After its first token a request that
stalls ends with a 504 and the agent is told to stop; one whose client goes away is aborted at
the agent; an engine's 4xx reaches the client as is, with no failover and no suspicion. Two
agents of the edge's own region, both reached over QUIC (``local_http=False``); idle and empty,
they tie and a-0 is tried first.

Deadlines here are parameters of the path under test, not assertions on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import numpy as np
import pytest
import pytest_asyncio
import structlog
import structlog.testing

from clusters import make_cluster
from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.certs import init_ca, issue
from kvcompassd.core.events import PrefixCached, Tier
from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
from kvcompassd.core.keys import namespace_salt, prefix_keys
from kvcompassd.core.layout import IndexLayout
from kvcompassd.core.levels import LevelPlan
from kvcompassd.core.migration import MODES, MigrationPlanned
from kvcompassd.core.router import Router
from kvcompassd.forwarding import (
    FirstTokenLate,
    ForwardError,
    ForwardRequest,
    Forwarder,
    OutputStalled,
    SuspectWorkers,
    TokensGenerated,
    _Deadlines,
)
from kvcompassd.metrics import EdgeMetrics
from kvcompassd.transport import QuicNode, TransportOptions
from kvcompassd.wire import (
    MigrationRequested,
    NodeIdentity,
    RequestForwarded,
    RequestRejected,
    ResponseChunked,
    ResponseCompleted,
    Role,
)

GUARD_S = 30.0  # hang guard only


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    init_ca(root / "ca", cluster_name="test")
    return {node_id: issue(root / "ca", root / "nodes", role=role, node_id=node_id)
            for node_id, role in [("edge-a", "edge"), ("a-0", "agent"), ("a-1", "agent"), ("b-0", "agent"),
                                  ("c-0", "agent")]}


class Agent:
    """A real agent endpoint whose behaviour on a forwarded request is chosen by the test:
    "serve" (two tokens, then completion), "stall" (never answer; wait to be aborted),
    "stall_after_first" (one token, then nothing; wait to be aborted), "reject" (the engine's
    400, as the agent passes it on), "vanish" (close the whole node, like a process that
    died) or "serve_unsaid" (as "serve", without the engine's own time for the request)."""

    def __init__(self, pki, worker: str, behaviour: str):
        self.worker, self.behaviour = worker, behaviour
        self.received: list[str] = []
        self.sampling: list[dict] = []  # each forwarded request's sampling params, as they came
        self.migrations: asyncio.Queue[MigrationRequested] = asyncio.Queue()
        self.aborted = asyncio.Event()
        self.node = QuicNode(NodeIdentity(Role.AGENT, worker), pki[worker], on_message=self._on_message,
                             options=TransportOptions(idle_timeout=10.0))

    async def _on_message(self, peer, message, channel) -> None:
        if isinstance(message, MigrationRequested):
            self.migrations.put_nowait(message)
        if not isinstance(message, RequestForwarded):
            return
        self.received.append(message.request_id)
        self.sampling.append(dict(message.sampling_params))
        stream = channel.stream
        if self.behaviour == "stall":
            await stream.wait_aborted()
            self.aborted.set()
        elif self.behaviour == "stall_after_first":
            await stream.send(ResponseChunked(message.request_id, (7,), "7", False))
            await stream.wait_aborted()
            self.aborted.set()
        elif self.behaviour == "slow_pieces":  # a piece, a long gap (a whole piece's decode), the rest
            await stream.send(ResponseChunked(message.request_id, (7,), "7", False))
            await asyncio.sleep(SLOW_PIECE_GAP_S)
            await stream.send(ResponseChunked(message.request_id, (8,), "8", False))
            await stream.send(ResponseCompleted(message.request_id, self.worker, 0, len(message.input_ids), 2,
                                                "length", (), WORKER_LATENCY_S), end=True)
        elif self.behaviour == "reject":
            await stream.send(RequestRejected(message.request_id, self.worker, 400, REJECTION), end=True)
        elif self.behaviour == "vanish":
            await self.node.close()
        else:
            for token in (7, 8):
                await stream.send(ResponseChunked(message.request_id, (token,), str(token), False))
            # the engine's own time for the request, as SGLang's e2e_latency ("unsaid": none)
            latency = -1.0 if self.behaviour == "serve_unsaid" else WORKER_LATENCY_S
            await stream.send(ResponseCompleted(message.request_id, self.worker, 0, len(message.input_ids), 2,
                                                "length", (), latency), end=True)


REJECTION = "top_p must be in (0, 1], got 2.0."
SLOW_PIECE_GAP_S = 1.0  # over the fixture's inter_token_s (0.5), under it plus 199 tokens at 10 ms
WORKER_LATENCY_S = 0.003
LONG_PROMPT = np.random.default_rng(8).integers(1, 30000, 2000, dtype=np.uint32)


def holding(cfg, shard, view, workers) -> None:
    """Register ``workers`` as holding all of LONG_PROMPT (as the agents' reports would)."""
    plan = LevelPlan.from_config(cfg)
    keys = prefix_keys(LONG_PROMPT, plan.registration_lengths_upto(len(LONG_PROMPT)), namespace_salt(cfg.model))
    shard.apply([PrefixCached(w, int(k), Tier.VRAM) for w in workers for k in keys])
    assert view.apply_next(shard.flush()) is None


def router_for(regions: dict[str, int], holders: tuple[str, ...] = (), **score: float):
    cfg = make_cluster(regions, shards=1, **score)
    layout = IndexLayout.from_config(cfg)
    view = EdgeIndexView(layout, 1, edge="edge-a")
    shard = MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=64)
    view.install_snapshot(shard.snapshot())
    if holders:
        holding(cfg, shard, view, holders)
    return cfg, Router(cfg, "a", view, now=0.0)


@pytest_asyncio.fixture
async def edge(pki, request):
    param = getattr(request, "param", ({"a": 2}, ()))
    regions, holders, score = param[0], param[1], (param[2] if len(param) > 2 else {})
    async with asyncio.timeout(GUARD_S):
        cfg, router = router_for(regions, holders, **score)
        node = QuicNode(NodeIdentity(Role.EDGE, "edge-a"), pki["edge-a"], on_message=lambda *a: None,
                        options=TransportOptions(idle_timeout=10.0))
        peers: dict[str, object] = {}
        async with WorkerConnections() as session:
            forwarder = Forwarder("edge-a", router, peers.get, session, clock=lambda: 0.0, metrics=EdgeMetrics(),
                                  local_http=False, first_token_floor_s=0.5, first_token_factor=0.0,
                                  inter_token_s=0.5)
            forwarder.peers, forwarder.node, forwarder.agents = peers, node, []
            try:
                yield forwarder
            finally:
                await node.close()
                for agent in forwarder.agents:
                    await agent.node.close()


async def start_agents(pki, forwarder, behaviours: dict[str, str], *, connect: tuple[str, ...] = ("a-0", "a-1")):
    for worker, behaviour in behaviours.items():
        agent = Agent(pki, worker, behaviour)
        address = await agent.node.listen("127.0.0.1", 0)
        forwarder.agents.append(agent)
        if worker in connect:
            forwarder.peers[worker] = await forwarder.node.connect(address, expected_role=Role.AGENT,
                                                                   expected_id=worker)
    return {a.worker: a for a in forwarder.agents}


async def run(forwarder, request_id: str = "r1", tokens=np.arange(1, 40, dtype=np.uint32), *, stream: bool = True,
              sampling: dict | None = None):
    request = ForwardRequest(request_id, tokens, {"max_new_tokens": 2} if sampling is None else sampling, stream)
    async with asyncio.timeout(GUARD_S):
        items = [item async for item in forwarder.generate(request)]
    return items[:-1], items[-1]


async def test_an_agent_without_a_first_token_in_time_is_abandoned_for_the_next_best(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "stall", "a-1": "serve"})
    tokens, done = await run(edge)
    assert agents["a-0"].received == ["r1"] and agents["a-1"].received == ["r1"]
    assert done.worker == "a-1" and done.attempts == 2
    assert [t.token_ids for t in tokens] == [(7,), (8,)]
    async with asyncio.timeout(GUARD_S):
        await agents["a-0"].aborted.wait()  # told to stop: it does not keep computing for nobody


@pytest.mark.parametrize("behaviour,latency", [("serve", WORKER_LATENCY_S), ("serve_unsaid", None)])
async def test_the_engines_own_time_for_a_request_comes_back_with_its_end(pki, edge, behaviour, latency):
    # (the learned rates take what the edge saw beyond it out of their samples: core/rates.py)
    await start_agents(pki, edge, {"a-0": behaviour}, connect=("a-0",))
    _, done = await run(edge)
    assert done.worker == "a-0" and done.worker_latency_s == latency


async def test_a_whole_answer_is_streamed_from_the_worker_in_pieces_and_a_clients_interval_is_kept(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "serve"}, connect=("a-0",))
    interval = edge.cfg.deadlines.worker_stream_interval
    _, done = await run(edge, "whole", stream=False)
    await run(edge, "streamed", stream=True)
    await run(edge, "own", stream=False, sampling={"max_new_tokens": 2, "stream_interval": 3})
    assert done.worker == "a-0" and agents["a-0"].received == ["whole", "streamed", "own"]
    assert agents["a-0"].sampling == [{"max_new_tokens": 2, "stream_interval": interval}, {"max_new_tokens": 2},
                                      {"max_new_tokens": 2, "stream_interval": 3}]


async def test_a_worker_that_failed_is_avoided_by_the_next_requests_until_it_serves(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "stall", "a-1": "serve"})
    assert (await run(edge, "r1"))[1].attempts == 2
    for request_id in ("r2", "r3"):  # the clock stands still: a-0 stays suspect
        _, done = await run(edge, request_id)
        assert done.worker == "a-1" and done.attempts == 1
    assert agents["a-0"].received == ["r1"]


@pytest.mark.parametrize("edge", [({"a": 2}, ("a-1",))], indirect=True)
async def test_at_debug_level_the_forward_line_breaks_every_candidates_score_into_its_terms(pki, edge):
    await start_agents(pki, edge, {"a-0": "serve", "a-1": "serve"})
    prompt = LONG_PROMPT  # a-1 holds it (the fixture's holding)
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            _, done = await run(edge, "r-debug", tokens=prompt)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        with structlog.testing.capture_logs() as info_logs:
            await run(edge, "r-info", tokens=prompt)
    finally:
        structlog.configure(**saved)
    line = next(entry for entry in logs if entry["event"] == "forward")
    terms = {t["worker"]: t for t in line["terms"]}
    assert set(terms) == {"a-0", "a-1"} and line["worker"] == done.worker == "a-1"
    holder, other = terms["a-1"], terms["a-0"]
    assert holder["matched"] > 0 and holder["tier"] == "vram" and other["matched"] == 0
    assert holder["prefill_ms"] < other["prefill_ms"] and holder["total"] <= other["total"]
    for t in (holder, other):
        assert t["total"] == pytest.approx(t["wan_ms"] + t["queue_ms"] + t["prefill_ms"] + t["reload_ms"] + t["copy_ms"],
                                            abs=2e-3)
    # At info level the line names the winner alone, without the breakdown.
    info = next(entry for entry in info_logs if entry["event"] == "forward")
    assert "terms" not in info and [w for w, _ in info["top"]] == ["a-1"]


@pytest.mark.parametrize("edge", [({"a": 2}, (), {"pending_hold_ms": 1000.0})], indirect=True)
async def test_a_worker_that_failed_is_not_credited_with_the_prompt_it_never_computed(pki, edge):
    await start_agents(pki, edge, {"a-0": "stall", "a-1": "serve"})
    _, done = await run(edge, tokens=LONG_PROMPT)
    assert done.worker == "a-1" and done.attempts == 2
    ledger = edge.router.pending
    assert ledger.held_by(edge.router.layout.worker_index("a-0")) == 0
    assert ledger.held_by(edge.router.layout.worker_index("a-1")) > 0


@pytest.mark.parametrize("edge", [({"a": 2}, (), {"pending_hold_ms": 1000.0})], indirect=True)
async def test_a_response_that_reused_less_than_the_ledger_credited_ends_that_credit(pki, edge):
    await start_agents(pki, edge, {"a-0": "serve", "a-1": "serve"})
    _, first = await run(edge, "r1", LONG_PROMPT)
    assert first.claimed_tokens == 0
    # Credited from r1's first token, the same prompt goes to the same worker ...
    _, second = await run(edge, "r2", LONG_PROMPT)
    assert second.worker == first.worker and second.claimed_tokens > 0 and second.pending_credited
    # ... which reports that it reused nothing (it never cached it): the credit ends there.
    assert second.cached_tokens == 0 and edge.router.pending.refuted > 0
    matched = np.zeros(len(edge.router.layout.worker_ids), dtype=np.int64)
    tier = np.zeros(len(matched), dtype=np.uint8)
    assert edge.router.pending_matches(LONG_PROMPT, matched, tier, now=0.0) is None
    assert edge.metrics.registry.get_sample_value("kvcompass_pending_refuted") == edge.router.pending.refuted


async def test_the_copy_price_metric_reads_the_routers_counts_when_scraped(edge):
    sample = edge.metrics.registry.get_sample_value
    assert [sample("kvcompass_copy_charged_decisions", {"outcome": o}) for o in ("moved", "kept")] == [0.0, 0.0]
    edge.router.copy_charges.update(moved=3, kept=5)
    assert [sample("kvcompass_copy_charged_decisions", {"outcome": o}) for o in ("moved", "kept")] == [3.0, 5.0]


def test_suspicion_doubles_with_each_failure_expires_and_is_cleared_by_a_served_request():
    suspects = SuspectWorkers(initial_s=5.0, max_s=12.0)
    assert suspects.failed(3, now=100.0) == 5.0 and suspects.current(now=104.9) == {3}
    assert suspects.current(now=105.0) == set()
    assert suspects.failed(3, now=106.0) == 10.0 and suspects.failed(3, now=107.0) == 12.0
    assert suspects.current(now=118.9) == {3} and len(suspects) == 1
    suspects.served(3)
    assert suspects.current(now=110.0) == set() and len(suspects) == 0
    assert suspects.failed(3, now=200.0) == 5.0  # back to the initial period


@pytest.mark.parametrize("edge", [({"a": 1, "b": 1, "c": 1}, ("b-0", "c-0"))], indirect=True)
async def test_a_request_that_waited_in_vain_on_a_remote_worker_stays_in_its_own_region(pki, edge):
    # b-0 and c-0 hold the long prompt: c-0 is the next best after b-0, but the request has
    # spent its first-token deadline on one WAN path already, so the local a-0 serves it.
    agents = await start_agents(pki, edge, {"a-0": "serve", "b-0": "stall", "c-0": "serve"},
                                connect=("a-0", "b-0", "c-0"))
    _, done = await run(edge, "r1", LONG_PROMPT)
    assert agents["b-0"].received == ["r1"] and agents["c-0"].received == []
    assert done.worker == "a-0" and done.attempts == 2


async def test_a_connection_that_dies_before_the_first_token_moves_the_request_on(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "vanish", "a-1": "serve"})
    tokens, done = await run(edge)
    assert agents["a-0"].received == ["r1"]
    assert done.worker == "a-1" and done.attempts == 2 and len(tokens) == 2


async def test_workers_whose_agent_is_not_connected_are_skipped_while_another_can_serve(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "serve", "a-1": "serve"}, connect=("a-1",))
    _, done = await run(edge)
    assert done.worker == "a-1" and done.attempts == 1 and agents["a-0"].received == []


async def test_every_worker_is_tried_once_before_the_request_fails(pki, edge):
    await start_agents(pki, edge, {"a-0": "stall", "a-1": "vanish"})
    with pytest.raises(ForwardError) as failure:
        await run(edge)
    assert failure.value.status == 503
    # a-1's connection dies; on a busy machine its 0.5 s first-token deadline may fire before the
    # loss is seen (a fresh-clone run at load 37): either way it was tried, once.
    reason = str(failure.value)
    assert "a-0: no first token" in reason
    assert "a-1: transport" in reason or "a-1: no first token" in reason
    assert reason.count("a-0:") == 1 and reason.count("a-1:") == 1


async def test_an_engine_rejection_is_the_clients_error_with_no_failover_and_no_suspicion(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "reject", "a-1": "serve"})
    with pytest.raises(ForwardError) as failure:
        await run(edge)
    assert failure.value.status == 400 and str(failure.value) == REJECTION
    assert agents["a-0"].received == ["r1"] and agents["a-1"].received == []
    assert len(edge.suspects) == 0 and edge.metrics.retries._value.get() == 0  # a-0 did nothing wrong


async def test_a_stream_that_stalls_after_its_first_token_ends_with_a_504_and_the_agent_is_told(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "stall_after_first", "a-1": "serve"})
    request = ForwardRequest("r1", np.arange(1, 40, dtype=np.uint32), {"max_new_tokens": 2}, True)
    received = []
    with pytest.raises(ForwardError) as failure:
        async with asyncio.timeout(GUARD_S):
            async for item in edge.generate(request):
                received.append(item)
    assert [t.token_ids for t in received] == [(7,)]  # what the client already has stays its own
    assert failure.value.status == 504 and "no output for 0.5 s" in str(failure.value)
    assert agents["a-1"].received == []  # a request with output cannot move
    async with asyncio.timeout(GUARD_S):
        await agents["a-0"].aborted.wait()
    assert edge.suspects.current(now=0.0) == {edge.router.layout.worker_index("a-0")}


async def test_pieces_of_many_tokens_may_come_that_much_further_apart(pki, edge):
    # inter_token_s (0.5 s) is a gap between tokens; pieces of 200 tokens may be 199 decodes
    # (10 ms each, the config's rate) further apart: a 1 s gap then is no stall
    a0 = edge.router.layout.worker_index("a-0")
    assert edge._piece_gap_s(a0, 200) == pytest.approx(0.5 + 199 * 0.010) and edge._piece_gap_s(a0, 1) == 0.5
    await start_agents(pki, edge, {"a-0": "slow_pieces"}, connect=("a-0",))
    tokens, done = await run(edge, "pieces", sampling={"max_new_tokens": 200, "stream_interval": 200})
    assert [t.token_ids for t in tokens] == [(7,), (8,)] and done.worker == "a-0"
    with pytest.raises(ForwardError) as failure:  # a token at a time, the same gap is a stall
        await run(edge, "tokens")
    assert failure.value.status == 504
    with pytest.raises(ForwardError) as failure:  # a piece holds at most the answer: 2 tokens, 0.51 s
        await run(edge, "short", sampling={"max_new_tokens": 2, "stream_interval": 200})
    assert failure.value.status == 504


async def test_a_client_that_goes_away_aborts_the_request_at_the_agent(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "stall_after_first", "a-1": "serve"})
    request = ForwardRequest("r1", np.arange(1, 40, dtype=np.uint32), {"max_new_tokens": 2}, True)
    stream = edge.generate(request)
    async with asyncio.timeout(GUARD_S):
        first = await anext(stream)
        assert first.token_ids == (7,)
        await stream.aclose()  # what the front door does when its client disconnects
        await agents["a-0"].aborted.wait()
    assert len(edge.suspects) == 0  # the client left; the worker did nothing wrong


async def test_an_attempt_is_aborted_in_the_router_unless_it_ended(pki, edge):
    """A served request's end retires its dispatch (on_finished): nothing is aborted after it
    (a front door of ``edge --workers N`` would tell the others to drop what they no longer
    hold); an attempt that failed, and one the client left, are."""
    aborted = []
    on_aborted = edge.router.on_aborted
    edge.router.on_aborted = lambda dispatch, *, now: aborted.append(dispatch) or on_aborted(dispatch, now=now)
    agents = await start_agents(pki, edge, {"a-0": "stall_after_first", "a-1": "serve"})
    edge.suspects.failed(0, now=0.0)  # a-1 first
    _, done = await run(edge, "served")
    assert done.worker == "a-1" and aborted == []
    edge.suspects.served(0)
    edge.suspects.failed(1, now=0.0)  # a-0 now, which stalls after its first token
    stream = edge.generate(ForwardRequest("left", np.arange(1, 40, dtype=np.uint32), {"max_new_tokens": 2}, True))
    async with asyncio.timeout(GUARD_S):
        await anext(stream)
        await stream.aclose()
        await agents["a-0"].aborted.wait()
    assert len(aborted) == 1  # the attempt the client left


async def test_suspicion_ends_when_the_worker_is_back(pki, edge):
    await start_agents(pki, edge, {"a-0": "stall", "a-1": "serve"})
    await run(edge, "r1")
    a0 = edge.router.layout.worker_index("a-0")
    assert edge.suspects.current(now=0.0) == {a0}
    edge.worker_back("a-0", "agent connected")
    assert edge.suspects.current(now=0.0) == set()
    edge.worker_back("nobody", "unknown workers are ignored")


async def test_no_eligible_worker_left_is_a_503_that_names_it(pki, edge):
    for index in range(len(edge.router.layout.worker_ids)):
        edge.router.withhold(index)
    with pytest.raises(ForwardError) as failure:
        await run(edge)
    assert failure.value.status == 503 and "no eligible worker" in str(failure.value)



def migrating_decision(forwarder, tokens, destination: str):
    """A real decision for ``tokens``, with a migration plan onto ``destination`` added."""
    decision = forwarder.router.decide(tokens, now=0.0)
    source = next(w for w in forwarder.router.layout.worker_ids if w != destination)
    plan = MigrationPlanned(family_key=1, prefix_len=8, source_worker=source, destination_worker=destination,
                            mode=MODES[0])
    return dataclasses.replace(decision, migration=plan)


async def test_a_migration_request_is_sent_in_the_background_and_reaches_its_agent(pki, edge):
    agents = await start_agents(pki, edge, {"a-0": "serve", "a-1": "serve"})
    tokens = np.arange(1, 40, dtype=np.uint32)
    edge._start_migration(ForwardRequest("m1", tokens, {}, True), migrating_decision(edge, tokens, "a-1"))
    async with asyncio.timeout(GUARD_S):
        sent = await agents["a-1"].migrations.get()
    assert (sent.request_id, sent.destination_worker, sent.input_ids) == ("m1", "a-1", tuple(range(1, 9)))
    assert edge.migrations[-1]["sent"] is True


async def test_closing_the_forwarder_cancels_the_migration_requests_still_being_sent(pki, edge):
    await start_agents(pki, edge, {"a-0": "serve", "a-1": "serve"})
    tokens = np.arange(1, 40, dtype=np.uint32)
    edge._start_migration(ForwardRequest("m1", tokens, {}, True), migrating_decision(edge, tokens, "a-1"))
    [task] = edge._sending
    await edge.close()
    assert task.cancelled() and not edge._sending


# -- the per-item deadlines of an attempt ----------------------------------------------------

async def _stalling(items: int, cleaned: list[bool], gate: asyncio.Event | None = None):
    """``items`` tokens, then waits for ``gate`` (never set: a stall); notes its cleanup."""
    try:
        for i in range(items):
            yield TokensGenerated((i,), str(i))
        await (gate or asyncio.Event()).wait()
    finally:
        cleaned.append(True)


async def _within_deadlines(items, first_s, inter_s, *, progress=None, first_max_s=0.0):
    """``items`` waited for as ``Forwarder.generate`` waits for an attempt's: ``_Deadlines.wait``
    in a loop, ``items`` closed however it ends (its cleanup aborts the request at the worker)."""
    async with contextlib.aclosing(items):
        deadlines = _Deadlines(first_s, inter_s, progress, first_max_s)
        try:
            while True:
                try:
                    item = await deadlines.wait(items)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            deadlines.stop()


async def _drain(paced) -> list:
    out = []
    async for item in paced:
        out.append(item)
    return out


async def test_deadline_no_first_token_ends_the_attempt_and_cleans_up():
    cleaned: list[bool] = []
    task = asyncio.current_task()
    with pytest.raises(FirstTokenLate):
        await asyncio.wait_for(_drain(_within_deadlines(_stalling(0, cleaned), 0.05, 10.0)), GUARD_S)
    assert cleaned == [True]
    assert task.cancelling() == 0  # the deadline's cancellation was taken back


async def test_deadline_after_the_first_token_is_a_stall():
    cleaned: list[bool] = []
    paced = _within_deadlines(_stalling(3, cleaned), 10.0, 0.05)
    got = []
    with pytest.raises(OutputStalled):
        async for item in paced:
            got.append(item.token_ids)
    assert got == [(0,), (1,), (2,)] and cleaned == [True]
    assert asyncio.current_task().cancelling() == 0


async def test_deadline_never_fires_while_the_consumer_holds_the_item():
    """A deadline bounds the wait for an item, not the consumer's work on it (here: sleeping
    past the deadline after each item)."""
    cleaned: list[bool] = []
    gate = asyncio.Event()
    gate.set()
    paced = _within_deadlines(_stalling(4, cleaned, gate), 0.02, 0.02)
    got = []
    async for item in paced:
        got.append(item.token_ids)
        await asyncio.sleep(0.1)  # five deadlines long: the armed timer fires in here
    assert got == [(0,), (1,), (2,), (3,)] and cleaned == [True]


async def test_gap_allowed_between_pieces_is_read_once_and_only_when_a_deadline_is_judged():
    """The inter-token deadline may be a function (the gap a worker's pieces may leave reads its
    learned decode rate): called once, when a wait after the first token is judged, and never
    for an answer that comes before any deadline passes."""
    calls: list[int] = []

    def gap_s() -> float:
        calls.append(1)
        return 0.02

    gate = asyncio.Event()
    gate.set()
    got = await asyncio.wait_for(_drain(_within_deadlines(_stalling(3, [], gate), 10.0, gap_s)), GUARD_S)
    assert len(got) == 3 and calls == []
    cleaned: list[bool] = []
    with pytest.raises(OutputStalled, match="0.0 s after the last"):
        await asyncio.wait_for(_drain(_within_deadlines(_stalling(2, cleaned), 0.01, gap_s)), GUARD_S)
    assert calls == [1] and cleaned == [True]


class _Judged:
    """A worker's output count as the first-token judge reads it: it moves at each reading
    (the worker serves others) and, at reading ``opens_at``, lets the request's own first
    token through (``gate``); with ``opens_at`` None it never does."""

    def __init__(self, gate: asyncio.Event, opens_at: int | None, moving: bool = True):
        self.gate, self.opens_at, self.moving, self.reads = gate, opens_at, moving, 0

    def __call__(self) -> int:
        self.reads += 1
        if self.reads == self.opens_at:
            self.gate.set()
        return self.reads if self.moving else 0


async def test_first_token_deadline_waits_on_while_the_worker_serves_others():
    cleaned: list[bool] = []
    gate = asyncio.Event()
    judged = _Judged(gate, opens_at=4)  # read once when the wait starts, then at each window
    paced = _within_deadlines(_gated(gate, 2, cleaned), 0.01, 10.0, progress=judged, first_max_s=60.0)
    got = await asyncio.wait_for(_drain(paced), GUARD_S)
    assert [item.token_ids for item in got] == [(0,), (1,)]
    assert judged.reads == 4  # three windows passed with output for others: no failure
    assert cleaned == [True]
    assert asyncio.current_task().cancelling() == 0


async def _gated(gate: asyncio.Event, items: int, cleaned: list[bool]):
    """Waits for ``gate`` (the request's turn at the worker), then ``items`` tokens."""
    try:
        await gate.wait()
        for i in range(items):
            yield TokensGenerated((i,), str(i))
    finally:
        cleaned.append(True)


async def test_first_token_deadline_fails_a_worker_that_serves_nobody():
    cleaned: list[bool] = []
    judged = _Judged(asyncio.Event(), opens_at=None, moving=False)
    with pytest.raises(FirstTokenLate, match="no output from the worker for any request"):
        await asyncio.wait_for(_drain(_within_deadlines(_stalling(0, cleaned), 0.01, 10.0, progress=judged,
                                                        first_max_s=60.0)), GUARD_S)
    assert judged.reads == 2  # at the start, then the first window: it ends there
    assert cleaned == [True]
    assert asyncio.current_task().cancelling() == 0


async def test_first_token_deadline_gives_up_on_a_serving_worker_at_the_limit():
    cleaned: list[bool] = []
    judged = _Judged(asyncio.Event(), opens_at=None)
    with pytest.raises(FirstTokenLate, match="the limit"):
        await asyncio.wait_for(_drain(_within_deadlines(_stalling(0, cleaned), 0.01, 10.0, progress=judged,
                                                        first_max_s=0.01)), GUARD_S)
    # The limit is one window: judged at its end, the worker's output moved, and the wait ends.
    assert judged.reads == 2
    assert cleaned == [True]
    assert asyncio.current_task().cancelling() == 0


async def test_first_token_judge_passes_an_outer_cancellation_through():
    cleaned: list[bool] = []
    started = asyncio.Event()
    judged = _Judged(asyncio.Event(), opens_at=None)

    async def consume():
        started.set()
        await _drain(_within_deadlines(_stalling(0, cleaned), 10.0, 10.0, progress=judged, first_max_s=60.0))

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), GUARD_S)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]


async def test_deadline_passes_an_outer_cancellation_through():
    """A client gone (its handler cancelled) is not a late worker: the cancellation propagates."""
    cleaned: list[bool] = []
    started = asyncio.Event()

    async def consume():
        async for _ in _within_deadlines(_stalling(1, cleaned), 10.0, 10.0):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), GUARD_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]
