"""KV-event recovery end to end: real maintenance units, edge and agent processes following an
emulated worker that speaks the engines' framing (live and replay, empty topic by default).

Worker ``us-1``'s emulator runs in this test's process (the others as daemons), so the test can
withhold live batches from its PUB socket (still buffered for replay: what a dropped ZMQ message
looks like), put odd sequence numbers on it, and read what the engine holds. Every scenario ends
with the index (maintenance units, and every edge's view of them) holding exactly what a mirror
fed every batch the engine published would register.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from e2e_helpers import admin, assert_views_converged, doc, eventually

from kvcompassd.core.keys import namespace_salt
from kvcompassd.core.levels import LevelPlan
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import decode_payload, encode_seq
from kvcompassd.launcher import DeploymentSpec, LocalDeployment
from kvcompassd.transport import TransportError

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=2, wan=False,
                      prefill_ms_per_token=0.02, decode_ms_per_token=1.0)
WORKER = "us-1"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("engine-events"), time_scale=0.0)
    async with d:
        yield d


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(dep):
    """``us-1``'s emulated worker, moved into this process: to the agent, an engine restart."""
    async with aiohttp.ClientSession() as s, s.post(  # the old process publishes something first
            dep.cfg.worker(WORKER).http + "/generate",
            json={"text": doc(1, 300), "sampling_params": {"max_new_tokens": 1}}) as r:
        assert r.status == 200
    await eventually(lambda: _agent_field(dep, "registered_keys", lambda n: n > 0), timeout=30)
    dep.kill("emulate-worker", WORKER)
    worker = EmulatedWorker(EmulatorSettings.from_worker_config(dep.cfg.worker(WORKER), time_scale=0.0))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


def engine_holds(dep, worker: EmulatedWorker) -> dict[int, str]:
    """Keys and tiers a mirror fed every batch this engine process published registers."""
    cfg = dep.cfg
    tree = BlockTree(WORKER, LevelPlan.from_config(cfg).registration_lengths(),
                     salt=namespace_salt(cfg.model, cfg.tenant), page_size=cfg.index.block_size)
    buffered = worker.publisher.buffered()
    assert not buffered or buffered[0][0] == 0, "the emulator's replay buffer no longer reaches back"
    for seq, payload in buffered:
        tree.apply_batch(decode_payload(payload, seq))
    return {key: tier.name for key, tier in tree.registered().items()}


async def agent(dep) -> dict:
    return await admin(dep, WORKER, "status")


async def index_equals_engine(dep, worker: EmulatedWorker) -> None:
    expected = engine_holds(dep, worker)

    async def equal():
        try:
            state = await agent(dep)
        except (RuntimeError, OSError, TransportError):  # the agent may still be starting
            return False
        if state["engine_last_seq"] != worker.publisher.next_seq - 1:
            return False
        held = await holders_of(dep, expected)
        return held == expected and state["registered_keys"] == len(expected)

    await eventually(equal, timeout=30)
    await assert_views_converged(dep)


async def holders_of(dep, keys) -> dict[int, str]:
    """Which of ``keys`` the maintenance units list ``us-1`` as holding, with its tier."""
    out = {}
    by_shard = {m.shard: m.id for m in dep.cfg.maintenance}
    for shard, unit in by_shard.items():  # one query per unit (one per key was hundreds of handshakes)
        mine = [key for key in keys if key % dep.cfg.shards == shard]
        if not mine:
            continue
        answer = await admin(dep, unit, "holders", {"keys": mine})
        for key in mine:
            tier = answer["holders"][str(key)].get(WORKER)
            if tier is not None:
                out[key] = tier
    return out


async def prompts(worker: EmulatedWorker, seeds: range, length: int = 700) -> None:
    """Distinct prompts straight to the engine (no edge): only its events tell the index."""
    async with aiohttp.ClientSession() as s:
        for seed in seeds:
            async with s.post(worker.http_url + "/generate",
                              json={"text": doc(seed, length), "sampling_params": {"max_new_tokens": 1}}) as r:
                assert r.status == 200, await r.text()


async def test_engine_restart_then_dropped_live_batches_end_with_the_engines_holdings(dep, engine):
    # the fixture replaced the engine process: the agent withdrew the old holdings on evidence
    await eventually(lambda: _agent_field(dep, "engine_restarts", lambda n: n >= 1), timeout=30)
    engine.publisher.withhold_live = lambda seq: seq % 3 == 1  # a third of the live batches never arrive
    try:
        await prompts(engine, range(100, 130))
    finally:
        engine.publisher.withhold_live = None
    await index_equals_engine(dep, engine)
    # the edge finds the whole cached prefix, not a fragment of it
    answer = await admin(dep, "edge-us", "holders", {"text": doc(129, 700) + " more"})
    (ours,) = [h for h in answer["holders"] if h["worker"] == WORKER]
    cached = 700 // dep.cfg.index.block_size * dep.cfg.index.block_size  # whole pages of the prompt
    assert ours["matched"] == max(n for n in LevelPlan.from_config(dep.cfg).registration_lengths() if n <= cached)


async def test_the_last_batches_before_a_quiet_spell_are_caught_up(dep, engine):
    engine.publisher.withhold_live = lambda seq: True  # nothing live; the engine then goes idle
    try:
        await prompts(engine, range(200, 203))
    finally:
        engine.publisher.withhold_live = None
    await index_equals_engine(dep, engine)


async def test_odd_sequence_numbers_withdraw_nothing(dep, engine):
    await index_equals_engine(dep, engine)
    before = await agent(dep)
    payload = engine.publisher.buffered()[-1][1]
    for seq in ((1 << 63) + 7, 0, 1 << 40):  # reads negative, went back, never published
        engine.publisher.send_frames([b"", seq.to_bytes(8, "big"), payload])
    await eventually(lambda: _agent_field(dep, "engine_odd_seqs", lambda n: n >= before["engine_odd_seqs"] + 3))
    after = await agent(dep)
    assert after["engine_restarts"] == before["engine_restarts"]
    await prompts(engine, range(300, 302))
    await index_equals_engine(dep, engine)


async def test_agent_restarted_while_its_engine_is_idle(dep, engine):
    await index_equals_engine(dep, engine)
    dep.restart("agent", WORKER)  # a new incarnation: the maintenance units drop its holdings
    await eventually(lambda: _agent_field(dep, "incarnation", lambda n: n > 0), timeout=30)
    await index_equals_engine(dep, engine)  # the engine published nothing since


async def test_agent_started_after_its_engine_published(dep, engine):
    dep.kill("agent", WORKER)
    await prompts(engine, range(400, 410))
    dep.restart("agent", WORKER)
    await index_equals_engine(dep, engine)


async def test_a_topic_mismatch_is_not_followed(dep, engine):
    # The engines' default topic is empty, and so is the config's: a batch under another topic
    # (another publisher on the same socket, or a misconfigured engine) is ignored.
    before = await agent(dep)
    engine.publisher.send_frames([b"other", encode_seq(engine.publisher.next_seq), engine.publisher.buffered()[-1][1]])
    await asyncio.sleep(0)
    await prompts(engine, range(500, 501))
    await index_equals_engine(dep, engine)
    assert (await agent(dep))["engine_restarts"] == before["engine_restarts"]


async def test_an_engine_whose_http_side_was_down_keeps_its_holdings(dep, engine):
    # The agent takes the worker out of the index while its engine does not answer; the engine
    # process (its cache, its event stream) is unchanged, so its holdings come back with it.
    await index_equals_engine(dep, engine)
    expected = engine_holds(dep, engine)
    engine.http_unavailable = True
    try:
        await eventually(lambda: _agent_field(dep, "engine_up", lambda up: not up), timeout=30)
        assert await holders_of(dep, expected) == {}  # withdrawn while it cannot serve
    finally:
        engine.http_unavailable = False
    await eventually(lambda: _agent_field(dep, "engine_up", bool), timeout=30)
    await index_equals_engine(dep, engine)
    await prompts(engine, range(600, 603))  # and what it caches next is indexed on top
    await index_equals_engine(dep, engine)


async def _agent_field(dep, name, check) -> bool:
    try:
        return check((await agent(dep))[name])
    except (RuntimeError, OSError, TransportError):  # the agent may still be starting
        return False
