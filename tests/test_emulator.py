"""Emulated SGLang worker end to end on loopback: HTTP routes, truthful cached_tokens, the
KV-event stream mirrored through the subscriber and the block tree (with a gap recovered by
replay, and a restart), loads and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import zmq.asyncio
from openai import AsyncOpenAI

from kvcompassd.core.events import Tier
from kvcompassd.worker.workermodel import WorkerTiming
from kvcompassd.emulator.server import (
    EmulatedWorker,
    EmulatorConfigError,
    EmulatorSettings,
    Generation,
    apply_stop,
    output_tokens,
    piece_due,
)
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.client import parse_loads
from kvcompassd.engine.kvevents import EventBatch
from kvcompassd.engine.subscriber import KvEventSubscriber, PublisherRestarted

BS = 16
LENGTHS = [16, 32, 48, 64, 96, 128]


def prefix_key(tokens: np.ndarray, lengths: Sequence[int]) -> list[int]:
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return [int.from_bytes(hashlib.sha256(data[: 4 * n]).digest()[:8], "little") >> 1 for n in lengths]


def settings(**overrides) -> EmulatorSettings:
    values = dict(port=0, kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*",
                  block_size=BS, vram_kv_tokens=4096, dram_kv_tokens=4096, time_scale=0.0, worker_id="emu-t")
    values.update(overrides)
    return EmulatorSettings(**values)


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_generate_reports_truthful_cached_tokens_and_events_mirror_the_cache() -> None:
    ctx = zmq.asyncio.Context()
    worker = EmulatedWorker(settings(), context=ctx)
    await worker.start()
    tree = BlockTree("emu-t", LENGTHS, prefix_key)
    items: list = []

    def on_item(item) -> None:
        items.append(item)
        if isinstance(item, EventBatch):
            tree.apply_batch(item)
        elif isinstance(item, PublisherRestarted):
            tree.withdraw_all()

    dropped: set[int] = set()
    sub = KvEventSubscriber(worker.kv_events_endpoint, worker.kv_replay_endpoint, on_item, context=ctx,
                            drop=lambda seq: seq in dropped and not dropped.discard(seq))
    sub_task = asyncio.create_task(sub.run())
    try:
        async with aiohttp.ClientSession() as session:
            url = worker.http_url
            sub.connect()
            n = 0
            async with asyncio.timeout(10):
                while not items:  # ZMQ join: anything published before is replayed from seq 0
                    await post(session, f"{url}/generate", {"input_ids": [7, n] * 8, "sampling_params": {"max_new_tokens": 1}})
                    n += 1
                    await asyncio.sleep(0.01)

            # the subscriber will lose the next published batch and must replay it
            dropped.add(worker.publisher.next_seq)
            shared = list(range(1000, 1048))
            first = await post(session, f"{url}/generate",
                               {"input_ids": shared + list(range(5000, 5016)), "sampling_params": {"max_new_tokens": 8}})
            assert first["meta_info"]["cached_tokens"] == 0
            assert first["meta_info"]["prompt_tokens"] == 64 and first["meta_info"]["completion_tokens"] == 8
            assert first["output_ids"] == output_tokens(shared + list(range(5000, 5016)), 8, 0)
            assert first["text"] == bytes(first["output_ids"]).decode()
            assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
            second = await post(session, f"{url}/generate",
                                {"input_ids": shared + list(range(7000, 7032)), "sampling_params": {"max_new_tokens": 4}})
            assert second["meta_info"]["cached_tokens"] == 48  # three shared pages
            # identical prompt: all full pages but the one holding the last token
            again = await post(session, f"{url}/generate",
                               {"input_ids": shared + list(range(5000, 5016)), "sampling_params": {"max_new_tokens": 8}})
            assert again["meta_info"]["cached_tokens"] == 48
            longer = await post(session, f"{url}/generate", {"input_ids": shared + list(range(5000, 5016)) +
                                                            first["output_ids"][:7] + [1] * 20,
                                                            "sampling_params": {"max_new_tokens": 1}})
            assert longer["meta_info"]["cached_tokens"] == 64  # the prompt's 4 pages (the output page is partial)
            text = await post(session, f"{url}/generate", {"text": "hello " * 8, "sampling_params": {"max_new_tokens": 2}})
            assert text["meta_info"]["prompt_tokens"] == 48

            # the mirror, fed only by the event stream (one batch lost and replayed), agrees
            await until(lambda: sub.delivered == worker.publisher.next_seq)
            assert not dropped and sub.replays >= 1
            cached_prefix = shared + list(range(7000, 7032))
            key48 = prefix_key(np.array(cached_prefix, dtype=np.uint32), [48])[0]
            key80 = prefix_key(np.array(cached_prefix, dtype=np.uint32), [64])[0]
            assert tree.registered().get(key48) is Tier.VRAM and tree.registered().get(key80) is Tier.VRAM
            assert set(tree._blocks) == set(worker.engine.cache._pages)

            # loads and metrics after the fact (no delays: nothing running)
            async with session.get(f"{url}/v1/loads") as response:
                loads = await response.json()
            assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_running_reqs"] == 0
            assert loads["loads"][0]["cache_hit_rate"] > 0
            async with session.get(f"{url}/server_info") as response:
                info = await response.json()
            kv = json.loads(info["kv_events_config"])
            assert kv["endpoint"] == worker.kv_events_endpoint and kv["replay_endpoint"] == worker.kv_replay_endpoint
            assert kv["publisher"] == "zmq" and kv["topic"] == "" and info["page_size"] == BS  # the engines' default topic

            # flush: AllBlocksCleared withdraws everything
            async with session.post(f"{url}/flush_cache") as response:
                assert response.status == 200
            await until(lambda: sub.delivered == worker.publisher.next_seq)
            assert tree.registered() == {} and len(tree) == 0

        # restart on the same endpoints: seq starts again at 0 with an empty cache
        endpoints = worker.kv_events_endpoint, worker.kv_replay_endpoint
        await worker.stop()
        worker = EmulatedWorker(settings(kv_events_endpoint=endpoints[0], kv_replay_endpoint=endpoints[1]), context=ctx)
        await worker.start()
        items.clear()
        async with aiohttp.ClientSession() as session:
            n = 0
            async with asyncio.timeout(10):
                while not items:  # new prompts until the SUB has reconnected (each publishes)
                    reply = await post(session, f"{worker.http_url}/generate",
                                       {"input_ids": shared + [9, n] * 8, "sampling_params": {"max_new_tokens": 1}})
                    assert reply["meta_info"]["cached_tokens"] == (0 if n == 0 else 48)
                    n += 1
                    await asyncio.sleep(0.02)
        await until(lambda: sub.delivered and sub.tracker.last_applied == worker.publisher.next_seq - 1)
        assert isinstance(items[0], PublisherRestarted)
        assert set(tree._blocks) == set(worker.engine.cache._pages)
    finally:
        sub_task.cancel()
        await asyncio.gather(sub_task, return_exceptions=True)
        await worker.stop()
        ctx.destroy(linger=0)


async def test_streaming_generate_and_openai_routes() -> None:
    worker = EmulatedWorker(settings())
    await worker.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{worker.http_url}/generate",
                                    json={"text": "stream me please", "stream": True,
                                          "sampling_params": {"max_new_tokens": 5}}) as response:
                lines = [line for line in (await response.text()).split("\n\n") if line]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
            assert len(chunks[-1]["output_ids"]) == 5 and chunks[-1]["meta_info"]["completion_tokens"] == 5
            async with session.post(f"{worker.http_url}/generate", json={"input_ids": [1, 2, 3.5]}) as response:
                assert response.status == 400 and "token id" in (await response.json())["error"]["message"]
            async with session.post(f"{worker.http_url}/generate", data=b"{not json") as response:
                assert response.status == 400

        client = AsyncOpenAI(base_url=f"{worker.http_url}/v1", api_key="none")
        prompt = "The quick brown fox jumps over the lazy dog. " * 3
        one = await client.completions.create(model="m", prompt=prompt, max_tokens=6)
        two = await client.completions.create(model="m", prompt=prompt, max_tokens=6)
        assert one.choices[0].text == two.choices[0].text and len(one.choices[0].text) == 6
        assert one.usage.prompt_tokens == len(prompt) and one.usage.prompt_tokens_details.cached_tokens == 0
        assert two.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BS * BS
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            parts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(parts) == one.choices[0].text and usage.completion_tokens == 6

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content) == 4
        stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, stream=True)
        deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(deltas) == chat.choices[0].message.content
        await client.close()
    finally:
        await worker.stop()


async def test_loads_and_metrics_reflect_queued_and_running_requests() -> None:
    # prefill of 1 s/token in real time: nothing finishes while the test looks
    timing = WorkerTiming(prefill_ms_per_token=1000.0, max_running=1)
    worker = EmulatedWorker(settings(timing=timing, time_scale=1.0))
    await worker.start()
    session = aiohttp.ClientSession()
    url = worker.http_url
    tasks = [asyncio.create_task(session.post(f"{url}/generate", json={"input_ids": [i] * 64}))
             for i in range(3)]
    try:
        async def load() -> dict:
            async with session.get(f"{url}/v1/loads") as response:
                return (await response.json())["loads"][0]

        async with asyncio.timeout(10):
            while (current := await load())["num_waiting_reqs"] < 2:
                await asyncio.sleep(0.01)
        assert current["num_running_reqs"] == 1 and current["num_total_reqs"] == 3
        assert current["num_waiting_uncached_tokens"] > 64  # two queued prompts plus the rest of one
        assert current["estimated_queue_ms"] > 64 * 1000.0
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        assert 'sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0' in text
        assert 'sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0' in text
    finally:
        await worker.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()


@pytest.mark.parametrize("time_scale", [0.5, 2.0])
async def test_queue_readings_are_in_wall_milliseconds_at_any_time_scale(time_scale: float) -> None:
    # Edges age a reading at one wall ms per ms: a worker run at time_scale s waits s model ms
    # per model ms. Two 64-token prompts queued behind a third in prefill, at 1 s per token:
    # 128-192 s of model time ahead of a new arrival (one output token each: no decode), so
    # 128-192 s times the scale on the wall.
    timing = WorkerTiming(prefill_ms_per_token=1000.0, max_running=1)
    worker = EmulatedWorker(settings(timing=timing, time_scale=time_scale))
    await worker.start()
    session = aiohttp.ClientSession()
    url = worker.http_url
    body = {"sampling_params": {"max_new_tokens": 1}}
    tasks = [asyncio.create_task(session.post(f"{url}/generate", json={"input_ids": [i] * 64, **body}))
             for i in range(3)]
    try:
        async def load() -> dict:
            async with session.get(f"{url}/v1/loads") as response:
                return (await response.json())["loads"][0]

        async with asyncio.timeout(10):
            while (current := await load())["num_waiting_reqs"] < 2:
                await asyncio.sleep(0.01)
        assert 128_000 * time_scale <= current["estimated_queue_ms"] <= 193_000 * time_scale
        # When VRAM frees up, in wall ms too: the three prompts' pages are held until their one
        # token each, the last after every prefill ahead (what the agent passes on to its edges).
        room = current["room_steps"]
        assert room[0][0] == 0.0 and room[0][1] < current["max_total_num_tokens"] == room[-1][1]
        assert current["estimated_queue_ms"] <= room[-1][0] <= 193_000 * time_scale
        assert parse_loads({"loads": [current]}, 1.0).room_steps == tuple((ms, free) for ms, free in room)
    finally:
        await worker.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()


def test_settings_validation_and_from_worker_config() -> None:
    with pytest.raises(EmulatorConfigError, match="eviction"):
        EmulatorSettings(eviction="random")
    with pytest.raises(EmulatorConfigError, match="time_scale"):
        EmulatorSettings(time_scale=-1)

    class Worker:
        id = "us-0"
        prefill_ms_per_token = 0.085
        decode_ms_per_token = 12.0
        vram_kv_tokens = 250000
        dram_kv_tokens = 1000000
        max_running = 32
        http = "http://127.0.0.1:30000"
        kv_events = "tcp://127.0.0.1:5557"

    s = EmulatorSettings.from_worker_config(Worker(), time_scale=0.0)
    assert (s.host, s.port, s.worker_id, s.timing.max_running) == ("127.0.0.1", 30000, "us-0", 32)
    assert s.kv_replay_endpoint == "tcp://127.0.0.1:5558" and s.time_scale == 0.0


async def test_a_stream_interval_sends_the_first_token_at_once_then_every_that_many_then_the_end() -> None:
    # SGLang 0.5.23's output streamer, per request: first token, then whenever that many are unsent
    timing = WorkerTiming(prefill_ms_per_token=0.05, decode_ms_per_token=2.0, max_running=2)
    async with timed_worker(timing) as worker, aiohttp.ClientSession() as session:
        counts = {}
        for interval in (None, 4):
            params = {"max_new_tokens": 11, **({"stream_interval": interval} if interval else {})}
            body = {"input_ids": list(range(8, 40)), "stream": True, "sampling_params": params}
            async with session.post(f"{worker.http_url}/generate", json=body) as response:
                lines = [x for x in (await response.text()).split("\n\n") if x]
            counts[interval] = [len(json.loads(x.removeprefix("data: "))["output_ids"]) for x in lines[:-1]]
        # (how many pieces come depends on the host's pace: what each holds does not)
        for interval, seen in counts.items():
            assert seen[0] == 1 and seen[-1] == 11 and seen == sorted(set(seen))
            assert all((n - 1) % (interval or 1) == 0 for n in seen[:-1])
        assert all(b - a == 4 for a, b in zip(counts[4][:-1], counts[4][1:-1]))
        for bad in (-1, 1.5, True):
            body = {"input_ids": [1, 2, 3], "sampling_params": {"stream_interval": bad}}
            async with session.post(f"{worker.http_url}/generate", json=body) as response:
                assert response.status == 400 and "stream_interval" in (await response.json())["error"]["message"]


def test_a_streams_pieces_are_where_sglangs_own_streamer_sends_them():
    # tests/data/engine_streams: SGLang 0.5.23's output streamer driven a token a step
    # (tools/capture_engine_streams.py); the emulator's rule, a step at a time, sends the same
    captured = json.loads((Path(__file__).parent / "data" / "engine_streams" / "sglang-stream-intervals.json").read_text())
    assert captured["sglang"] == "0.5.23" and len(captured["cases"]) >= 8
    for case in captured["cases"]:
        interval, tokens = case["stream_interval"] or 1, case["tokens"]
        pieces, sent = [1], 1  # the first token at once
        for emitted in range(2, tokens):
            if piece_due(emitted, sent, interval):
                pieces.append(sent := emitted)
        pieces.append(tokens)  # the end, always
        assert pieces == case["sent_after_each_piece"], case


@contextlib.asynccontextmanager
async def timed_worker(timing: WorkerTiming):
    """An emulated worker running ``timing`` at real time (``time_scale`` 1), stopped after."""
    worker = EmulatedWorker(settings(timing=timing, time_scale=1.0))
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def test_modelled_delays_stream_tokens_and_finish() -> None:
    # real time at 1/10 speed-up of a fast worker: a few tens of ms per request
    timing = WorkerTiming(prefill_ms_per_token=0.5, decode_ms_per_token=4.0, max_running=2)
    async with timed_worker(timing) as worker:
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": list(range(64)), "stream": True, "sampling_params": {"max_new_tokens": 6}}
            results = []
            for _ in range(2):
                async with session.post(f"{worker.http_url}/generate", json=body) as response:
                    lines = [x for x in (await response.text()).split("\n\n") if x]
                results.append([json.loads(x.removeprefix("data: ")) for x in lines[:-1]])
            for chunks in results:
                counts = [len(c["output_ids"]) for c in chunks]
                assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 6
                assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            assert results[0][-1]["output_ids"] == results[1][-1]["output_ids"]
            assert results[1][-1]["meta_info"]["cached_tokens"] == 48
            # a second request under a running request's id is refused; the first still finishes
            slow = asyncio.create_task(post(session, f"{worker.http_url}/generate",
                                            {"rid": "same", "input_ids": [3] * 64, "sampling_params": {"max_new_tokens": 50}}))
            await until(lambda: "same" in worker.engine._waiters)
            async with session.post(f"{worker.http_url}/generate", json={"rid": "same", "input_ids": [4] * 8}) as r:
                assert r.status == 400 and "already running" in (await r.json())["error"]["message"]
            assert len((await slow)["output_ids"]) == 50
            concurrent = await asyncio.gather(*[
                post(session, f"{worker.http_url}/generate", {"input_ids": [i] * 32, "sampling_params": {"max_new_tokens": 3}})
                for i in range(5)])
            assert [len(r["output_ids"]) for r in concurrent] == [3] * 5
        assert worker.engine.model.running == 0 and worker.engine.model.completed == 8


def test_stops_cut_the_output_where_sglang_would() -> None:
    out = [ord(c) for c in "hello world, goodbye"]
    assert apply_stop(out, ("wor",), frozenset()) == (out[: len("hello wor")], "wor")
    assert apply_stop(out, (), frozenset({ord("o")})) == (out[: len("hello")], ord("o"))
    # min_new_tokens holds a stop back until that many tokens are out
    assert apply_stop(out, (), frozenset({ord("o")}), min_new_tokens=6) == (out[: len("hello wo")], ord("o"))
    assert apply_stop(out, ("zzz",), frozenset({0})) == (out, None)
    gen = Generation("r", [1], 20, stop=("wor",))
    assert gen.stop_at(out) == out[:9] and gen.text_end == len("hello ")
    gen = Generation("r", [1], 20, stop=("wor",), no_stop_trim=True)
    gen.stop_at(out)
    assert gen.text_end == len("hello wor")


async def test_stop_and_zero_new_tokens_on_the_routes() -> None:
    worker = EmulatedWorker(settings())
    await worker.start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{worker.http_url}/generate"
            whole = await post(session, url, {"text": "a prompt to stop", "sampling_params": {"max_new_tokens": 16}})
            stop = whole["text"][6:8]
            for stream in (False, True):
                body = {"text": "a prompt to stop", "stream": stream,
                        "sampling_params": {"max_new_tokens": 16, "stop": [stop]}}
                async with session.post(url, json=body) as response:
                    raw = await response.text()
                last = json.loads(raw.split("\n\n")[-3].removeprefix("data: ")) if stream else json.loads(raw)
                assert last["text"] == whole["text"][: whole["text"].index(stop)]
                assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            zero = await post(session, url, {"text": "prefill only", "sampling_params": {"max_new_tokens": 0}})
            assert zero["output_ids"] == [] and zero["text"] == "" and zero["meta_info"]["completion_tokens"] == 0
            assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
            again = await post(session, url, {"text": "prefill only!", "sampling_params": {"max_new_tokens": 1}})
            assert again["meta_info"]["cached_tokens"] == 0 or again["meta_info"]["cached_tokens"] % BS == 0
            client = AsyncOpenAI(base_url=f"{worker.http_url}/v1", api_key="none")
            chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=16, stop=stop)
            assert chat.choices[0].finish_reason in ("stop", "length")
            await client.close()
    finally:
        await worker.stop()


async def test_prompts_past_the_context_length_are_refused_with_sglangs_messages():
    worker = EmulatedWorker(settings())  # 4,096 tokens of VRAM: the context length it reports
    await worker.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{worker.http_url}/v1/tokenize", json={"prompt": "x"}) as response:
                assert (await response.json())["max_model_len"] == 4096
            async with session.post(f"{worker.http_url}/generate", json={"input_ids": [7] * 4096}) as response:
                assert response.status == 400
                assert (await response.json())["error"]["message"] == (
                    "The input (4096 tokens) is longer than the model's context length (4096 tokens).")
            async with session.post(f"{worker.http_url}/generate", json={
                    "input_ids": [7] * 4000, "sampling_params": {"max_new_tokens": 100}}) as response:
                assert response.status == 400
                assert "You requested a total of 4100 tokens" in (await response.json())["error"]["message"]
            await post(session, f"{worker.http_url}/generate",
                       {"input_ids": [7] * 4000, "sampling_params": {"max_new_tokens": 96}})
    finally:
        await worker.stop()


async def test_a_prefix_evicted_while_the_request_waits_is_not_credited() -> None:
    # SGLang matches a prompt's prefix when its prefill starts. VRAM holds 8 pages of 16 tokens
    # and there is no DRAM: a 64-token prompt is served and cached (4 pages); a 112-token one
    # then prefills, and the first prompt, sent again meanwhile, waits behind it with 48 tokens
    # (3 pages) of its prefix cached on arrival. The second's KV (7 pages) evicts 3 of the 4
    # when its prefill ends, so the waiting request reuses the 16 tokens left, and says so.
    # (Matched on arrival, it pinned its 48 tokens and was credited with them.)
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=1.0, max_running=4)
    worker = EmulatedWorker(settings(timing=timing, time_scale=1.0, vram_kv_tokens=128, dram_kv_tokens=0))
    await worker.start()
    engine = worker.engine
    one_token = {"sampling_params": {"max_new_tokens": 1}}
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{worker.http_url}/generate"
            prompt = list(range(1, 65))
            first = await post(session, url, {"input_ids": prompt, **one_token})
            assert first["meta_info"]["cached_tokens"] == 0
            assert engine.cache.match(prompt[:-1]).total_tokens == 48
            long = asyncio.create_task(post(session, url, {"input_ids": list(range(1000, 1112)), **one_token}))
            await until(lambda: engine.model.pending_prefill_tokens > 0)  # the long one is prefilling
            again = asyncio.create_task(post(session, url, {"input_ids": prompt, **one_token}))
            await until(lambda: engine.model.running == 2)  # queued behind it
            assert engine.cache.match(prompt[:-1]).total_tokens == 48 and engine.cache.pinned_vram_pages == 0
            long_meta = (await long)["meta_info"]
            again_meta = (await again)["meta_info"]
            assert long_meta["cached_tokens"] == 0
            assert again_meta["cached_tokens"] == 16  # 32 of its 48 evicted before its prefill started
            assert engine.cache.pinned_vram_pages == 0 and engine.model.running == 0
    finally:
        await worker.stop()


async def test_a_prompt_waiting_for_vram_room_shows_in_the_queue_report() -> None:
    # VRAM holds 16 pages: a 160-token prompt (10 pages) decodes for 50 steps of 10 ms while a
    # second 160-token one waits for its pages, then prefills in 160 ms. A new arrival waits for
    # both, and /v1/loads says so (at time scale 1, in wall ms).
    timing = WorkerTiming(prefill_ms_per_token=1.0, decode_ms_per_token=10.0, decode_batch_slope=0.0, max_running=4)
    worker = EmulatedWorker(settings(timing=timing, time_scale=1.0, vram_kv_tokens=256, dram_kv_tokens=0))
    await worker.start()
    engine = worker.engine
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{worker.http_url}/generate"
            holder = asyncio.create_task(post(session, url, {"input_ids": list(range(1, 161)),
                                                             "sampling_params": {"max_new_tokens": 51}}))
            await until(lambda: engine.model.decoding == 1)
            waiting = asyncio.create_task(post(session, url, {"input_ids": list(range(500, 660)),
                                                              "sampling_params": {"max_new_tokens": 1}}))
            await until(lambda: engine.model.head_blocked)
            async with session.get(f"{worker.http_url}/v1/loads") as response:
                load = (await response.json())["loads"][0]
            # as SGLang reports it: the running request's KV and the waiting prompt exceed the pool
            assert (load["num_used_tokens"], load["num_total_tokens"], load["max_total_num_tokens"]) == (160, 320, 256)
            # at most 500 ms of decode left, then 160 ms of prefill: far more than the 160 ms
            # a report blind to the wait would give
            queue_ms = load["estimated_queue_ms"]
            assert 160 + 250 <= queue_ms <= 160 + 500
            await holder
            assert (await waiting)["meta_info"]["cached_tokens"] == 0
    finally:
        await worker.stop()
