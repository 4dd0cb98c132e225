"""The emulated workers' prefill-decode roles on loopback: SGLang's bootstrap fields on both
/generate requests, the KV handed over by room through the prefill's bootstrap server, bounded
waits with clear errors, and a decode worker that publishes nothing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import zmq.asyncio
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.emulator.kvtransfer import (
    FAKE_BOOTSTRAP_HOST,
    MAX_FRAME,
    Bootstrap,
    KvSender,
    TransferFailed,
    _read_frame,
    receive_kv,
)
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings, output_tokens
from kvcompassd.engine.client import EngineClient, EngineFinished
from kvcompassd.engine.disaggregated import BootstrapFields, DecodeFailed, PrefillFailed, generate_on_pair, new_bootstrap_room
from kvcompassd.worker.kvtransfer import KvTransferTiming

BS = 16


def settings(role: str, **overrides) -> EmulatorSettings:
    values = dict(port=0, kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*",
                  block_size=BS, vram_kv_tokens=4096, dram_kv_tokens=4096, time_scale=0.0, worker_id=f"emu-{role}",
                  role=role, bootstrap_port=0, transfer_timeout_s=5.0)
    values.update(overrides)
    return EmulatorSettings(**values)


class Pair:
    def __init__(self, **overrides) -> None:
        self.ctx = zmq.asyncio.Context()
        self.prefill = EmulatedWorker(settings("prefill", **overrides), context=self.ctx)
        self.decode = EmulatedWorker(settings("decode", **overrides), context=self.ctx)

    async def __aenter__(self) -> Pair:
        await self.prefill.start()
        await self.decode.start()
        self.session = aiohttp.ClientSession()
        self.http = WorkerConnections()  # the engine client's
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.http.close()
        await self.prefill.stop()
        await self.decode.stop()
        self.ctx.term()

    def bootstrap(self, room: int | None = None) -> BootstrapFields:
        return BootstrapFields.for_prefill(self.prefill.http_url, self.prefill.bootstrap_port,
                                           new_bootstrap_room() if room is None else room)

    async def run(self, prompt: list[int], max_new: int = 8, bootstrap: BootstrapFields | None = None):
        items = [item async for item in generate_on_pair(
            EngineClient(self.prefill.http_url, self.http), EngineClient(self.decode.http_url, self.http),
            bootstrap or self.bootstrap(), prompt, {"max_new_tokens": max_new}, rid=None)]
        assert isinstance(items[-1], EngineFinished)
        return [t for item in items[:-1] for t in item.token_ids], items[-1]


async def test_a_pair_serves_the_prompt_the_prefill_caches_and_the_decode_streams() -> None:
    async with Pair() as pair:
        prompt = list(range(1, 130))
        tokens, done = await pair.run(prompt)
        # The decode continues from the prefill's first token: the same answer a mixed worker gives.
        assert tokens == output_tokens(prompt, 8, 0)
        assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (129, 8, 0)
        tokens, done = await pair.run(prompt + [7, 7, 7])
        assert done.cached_tokens == 128  # the prefill worker's cache, reported through the decode
        assert pair.prefill.kv_sender.transfers == 2 and pair.decode.engine.kv_received == 2
        # Only the prefill publishes KV events; the decode has no publisher and says so.
        assert pair.decode.publisher is None and pair.prefill.publisher is not None
        async with pair.session.get(pair.decode.http_url + "/server_info") as resp:
            info = await resp.json()
        assert info["kv_events_config"] is None and info["disaggregation_mode"] == "decode"
        async with pair.session.get(pair.prefill.http_url + "/server_info") as resp:
            info = await resp.json()
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == pair.prefill.bootstrap_port
        assert pair.prefill.engine.cache.vram_used_tokens > 0 and pair.decode.engine.cache.vram_used_tokens == 0


async def test_prefill_response_is_sglangs_first_token_with_length_zero() -> None:
    async with Pair() as pair:
        prompt = list(range(1, 40))
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}, **pair.bootstrap().body()}
        prefill = pair.session.post(pair.prefill.http_url + "/generate", json=body)
        decode = pair.session.post(pair.decode.http_url + "/generate", json=body)
        p, d = await asyncio.gather(prefill, decode)
        pj, dj = await p.json(), await d.json()
        assert pj["output_ids"] == output_tokens(prompt, 1, 0)
        assert pj["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert dj["output_ids"] == output_tokens(prompt, 5, 0)
        assert dj["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_requests_without_bootstrap_fields_are_refused_by_both_roles() -> None:
    async with Pair() as pair:
        for url in (pair.prefill.http_url, pair.decode.http_url):
            async with pair.session.post(url + "/generate", json={"input_ids": [1, 2, 3]}) as resp:
                assert resp.status == 400
                assert "bootstrap_host" in (await resp.json())["error"]["message"]
            bad = {"input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": -1}
            async with pair.session.post(url + "/generate", json=bad) as resp:
                assert resp.status == 400 and "bootstrap_room" in await resp.text()
            async with pair.session.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
                assert resp.status == 400 and "disaggregation mode" in await resp.text()
        # SGLang's fake bootstrap host: the prefill computes and caches for nobody (a migration).
        body = {"input_ids": list(range(1, 50)), "sampling_params": {"max_new_tokens": 1},
                "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}
        async with pair.session.post(pair.prefill.http_url + "/generate", json=body) as resp:
            assert resp.status == 200
        assert pair.prefill.engine.cache.vram_used_tokens >= 48


async def test_a_decode_whose_kv_never_comes_fails_within_its_bound() -> None:
    async with Pair(transfer_timeout_s=0.3) as pair:
        decode = EngineClient(pair.decode.http_url, pair.http)
        with pytest.raises(Exception, match="no KV for room 42"):
            async for _ in decode.generate([1, 2, 3], {"max_new_tokens": 2}, stream=True,
                                           extra=pair.bootstrap(42).body()):
                pass
        # and a prefill whose decode never registers fails as clearly
        prefill = EngineClient(pair.prefill.http_url, pair.http)
        with pytest.raises(Exception, match="no decode instance registered room 43"):
            async for _ in prefill.generate([1, 2, 3], {"max_new_tokens": 2}, stream=False,
                                            extra=pair.bootstrap(43).body()):
                pass
        assert pair.prefill.kv_sender.failures == 1


async def test_pair_failures_blame_the_half_that_broke() -> None:
    async with Pair(transfer_timeout_s=0.5) as pair:
        # The prefill is unreachable: the decode's wait fails too, and the prefill is blamed.
        wrong = BootstrapFields("127.0.0.1", pair.prefill.bootstrap_port, 5)
        with pytest.raises(PrefillFailed):
            async for _ in generate_on_pair(EngineClient("http://127.0.0.1:9", pair.http),
                                            EngineClient(pair.decode.http_url, pair.http), wrong, [1, 2, 3],
                                            {"max_new_tokens": 2}):
                pass
        # The decode is unreachable: the prefill waits for a registration that never comes, but
        # the decode's failure comes first and is the one reported.
        with pytest.raises(DecodeFailed):
            async for _ in generate_on_pair(EngineClient(pair.prefill.http_url, pair.http),
                                            EngineClient("http://127.0.0.1:9", pair.http), pair.bootstrap(),
                                            [1, 2, 3], {"max_new_tokens": 2}):
                pass
        # The pair still serves afterwards.
        tokens, _ = await pair.run([5, 6, 7])
        assert tokens == output_tokens([5, 6, 7], 8, 0)


async def test_modelled_delays_on_a_pair() -> None:
    async with Pair(time_scale=0.01) as pair:
        prompt = list(range(1, 300))
        tokens, done = await pair.run(prompt, max_new=4)
        assert tokens == output_tokens(prompt, 4, 0) and done.completion_tokens == 4


async def test_sender_and_receiver_agree_on_the_modelled_transfer_and_check_the_prompt() -> None:
    timing = KvTransferTiming(bytes_per_token=1 << 17, gbps=100.0)
    sender = KvSender("127.0.0.1", 0, timing, time_scale=0.0, timeout_s=2.0)
    await sender.start()
    try:
        prompt = list(range(4096))
        boot = Bootstrap("127.0.0.1", sender.port, 7)
        got, sent_ms = await asyncio.gather(receive_kv(boot, "d", prompt, timeout_s=2.0),
                                            sender.hand_over(boot, prompt, first_token=65, cached_tokens=1024))
        assert got.transfer_ms == sent_ms == pytest.approx(4096 * 131072 / 12.5e9 * 1e3)
        assert (got.first_token, got.cached_tokens, got.prompt_tokens) == (65, 1024, 4096)
        # A decode registered for another prompt: both sides refuse the room.
        boot = Bootstrap("127.0.0.1", sender.port, 8)
        results = await asyncio.gather(receive_kv(boot, "d", [1, 2, 3], timeout_s=2.0),
                                       sender.hand_over(boot, [1, 2, 4], first_token=65, cached_tokens=0),
                                       return_exceptions=True)
        assert all(isinstance(r, TransferFailed) for r in results)
        assert "another prompt" in str(results[0]) and "another prompt" in str(results[1])
        # Garbage on the bootstrap port: an oversize frame is refused, the server carries on.
        reader, writer = await asyncio.open_connection("127.0.0.1", sender.port)
        writer.write((MAX_FRAME + 1).to_bytes(4, "big"))
        await writer.drain()
        assert b"frame" in await reader.read()
        writer.close()
        # A second decode for a room already taken is refused.
        boot = Bootstrap("127.0.0.1", sender.port, 9)
        first = asyncio.ensure_future(receive_kv(boot, "d1", [1], timeout_s=2.0))
        await asyncio.sleep(0)
        while 9 not in sender._rooms or not sender._rooms[9].registered.done():
            await asyncio.sleep(0.005)
        with pytest.raises(TransferFailed, match="already has a decode"):
            await receive_kv(boot, "d2", [1], timeout_s=2.0)
        await sender.hand_over(boot, [1], first_token=33, cached_tokens=0)
        assert (await first).first_token == 33
    finally:
        await sender.close()


async def test_sglangs_own_prefill_decode_router_is_served_by_an_emulated_pair() -> None:
    """sglang_router's mini_lb (SGLang's Python prefill-decode load balancer) picks the pair,
    adds the bootstrap fields and merges the responses exactly as it does in front of SGLang."""
    from sglang_router import mini_lb
    from sglang_router.router_args import RouterArgs

    async with Pair() as pair:
        mini_lb.lb = mini_lb.MiniLoadBalancer(RouterArgs(
            pd_disaggregation=True, policy="random", prefill_urls=[(pair.prefill.http_url, pair.prefill.bootstrap_port)],
            decode_urls=[pair.decode.http_url]))
        prompt = list(range(1, 70))
        response = await mini_lb.handle_generate_request({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}})
        assert response.status_code == 200
        body = json.loads(response.body)
        assert body["output_ids"] == output_tokens(prompt, 6, 0) and body["meta_info"]["completion_tokens"] == 6
        streamed = await mini_lb.handle_generate_request({"input_ids": prompt + [1], "stream": True,
                                                          "sampling_params": {"max_new_tokens": 6}})
        chunks = [json.loads(line[5:]) for piece in [c async for c in streamed.body_iterator]
                  for line in piece.decode().split("\n\n") if line.startswith("data: {")]
        assert chunks[-1]["output_ids"] == output_tokens(prompt + [1], 6, 0)
        assert chunks[-1]["meta_info"]["cached_tokens"] == 64  # the prefill's reuse, carried to the decode
        assert pair.prefill.kv_sender.transfers == 2 and pair.decode.engine.kv_received == 2


@hypothesis_settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64) | st.builds(lambda n, tail: n.to_bytes(4, "big") + tail,
                                          st.integers(0, 2 * MAX_FRAME), st.binary(max_size=64)))
def test_a_bootstrap_frame_is_a_json_object_or_a_transfer_failure(data):
    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await _read_frame(reader)

    try:
        assert isinstance(asyncio.run(read()), dict)
    except TransferFailed:
        pass


@hypothesis_settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["bootstrap_host", "bootstrap_port", "bootstrap_room", "x"]),
                       st.none() | st.booleans() | st.integers(-2, 2**64) | st.text(max_size=300), max_size=4))
def test_bootstrap_fields_are_complete_and_in_range_or_refused(body):
    try:
        boot = Bootstrap.from_body(body)
    except ValueError:
        return
    if boot is not None:
        assert 0 <= boot.room < 2**63 and 0 <= boot.port <= 65535 and 0 < len(boot.host) <= 255
