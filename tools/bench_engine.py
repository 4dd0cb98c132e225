"""Benchmark of the engine side: KV-event decoding (against the validating constructors),
block-tree mirroring (a batch per pass against an event at a time), the prefix cache and the
emulated worker's HTTP path. Prints medians and ratios against a reference measured in the
same run. Usage: python tools/bench_engine.py [--quick]"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import time

import aiohttp
import msgpack
import numpy as np

from kvcompassd.worker.prefixcache import PrefixCache
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.engine.blocktree import BlockTree
from kvcompassd.engine.kvevents import (
    BlockRemoved,
    BlockStored,
    PayloadDecoder,
    canonical_hash,
    decode_message,
    encode_batch,
)


def sha_keys(tokens: np.ndarray, lengths) -> list[int]:
    data = np.asarray(tokens, dtype="<u4").tobytes()
    return [int.from_bytes(hashlib.sha256(data[: 4 * n]).digest()[:8], "little") >> 1 for n in lengths]


def constructed(payload: bytes) -> list:
    """A map-form payload's events built by the validating constructors (the reference)."""
    out = []
    for raw in msgpack.unpackb(payload, strict_map_key=False)[1]:
        if raw["type"] == "BlockStored":
            parent = raw.get("parent_block_hash")
            out.append(BlockStored(tuple(canonical_hash(h) for h in raw["block_hashes"]),
                                   None if parent is None else canonical_hash(parent), tuple(raw["token_ids"]),
                                   raw["block_size"], raw.get("lora_id"), raw.get("medium"), raw.get("lora_name"),
                                   raw.get("group_idx")))
        elif raw["type"] == "BlockRemoved":
            out.append(BlockRemoved(tuple(canonical_hash(h) for h in raw["block_hashes"]), raw.get("medium"),
                                    raw.get("group_idx")))
    return out


def median_rate(fn, units: int, repeats: int) -> float:
    """Units per second of this process's CPU time (not wall time: on a shared machine the
    wall clock also counts the waits for a core), median over ``repeats``."""
    rates = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        rates.append(units / max(1e-9, time.process_time() - start))
    return statistics.median(rates)


def workload(n_prompts: int, seed: int = 1) -> list[list[int]]:
    rnd = random.Random(seed)
    systems = [[rnd.randrange(32000) for _ in range(rnd.choice([512, 1024, 2048]))] for _ in range(20)]
    return [systems[rnd.randrange(20)] + [rnd.randrange(32000) for _ in range(rnd.randrange(64, 1024))]
            for _ in range(n_prompts)]


def bench_codec_and_tree(quick: bool) -> None:
    prompts = workload(300 if quick else 1500)
    cache = PrefixCache(block_size=16, vram_tokens=200_000, dram_tokens=400_000)
    batches, now = [], 0.0
    for p in prompts:
        now += 0.01
        events = cache.insert(p, now=now)
        if events:
            batches.append(encode_batch(len(batches), now, events))
    n_events = sum(len(decode_message(b).events) for b in batches)
    payloads = [b[2] for b in batches]
    raw = median_rate(lambda: [msgpack.unpackb(p) for p in payloads], len(batches), 5)
    ours = median_rate(lambda: [decode_message(b) for b in batches], len(batches), 5)
    print(f"decode: {ours:,.0f} batches/s ({ours * n_events / len(batches):,.0f} events/s); "
          f"raw msgpack.unpackb {raw:,.0f}/s; ratio {ours / raw:.2f}")
    # The reference: every event through the validating constructors, as the decoder built
    # them before it checked the engines' usual shapes once itself (issue 30 item 4).
    validating = median_rate(lambda: [constructed(p) for p in payloads], len(batches), 5)
    print(f"decode via the validating constructors: {validating:,.0f} batches/s; decode ÷ it {ours / validating:.2f}")

    decoded = [decode_message(b) for b in batches]
    lengths = [64 * 2**i for i in range(6)] + [384, 768, 1536]
    lengths = sorted(set(lengths))
    registrations = []

    def mirror() -> None:
        tree = BlockTree("w", lengths, sha_keys)
        out = 0
        for batch in decoded:
            out += len(tree.apply_batch(batch))
        registrations.append(out)

    tree_rate = median_rate(mirror, n_events, 3)
    print(f"block tree: {tree_rate:,.0f} block events/s ({registrations[-1]} index events from {n_events} "
          f"block events, SHA-256 test keys); ratio to decoding {tree_rate / (ours * n_events / len(batches)):.2f}")

    # As the agent mirrors: salted incremental keys, a batch per pass (apply_events) against
    # the reference, one event at a time.
    def salted(one_pass: bool) -> None:
        tree = BlockTree("w", lengths, salt=b"bench", page_size=16)
        for batch in decoded:
            if one_pass:
                tree.apply_events(batch.events)
            else:
                for event in batch.events:
                    tree.apply(event)

    per_event = median_rate(lambda: salted(False), n_events, 3)
    per_batch = median_rate(lambda: salted(True), n_events, 3)
    print(f"agent's mirror (salted keys): one pass per batch {per_batch:,.0f} block events/s; one event at a time "
          f"{per_event:,.0f}/s; ratio {per_batch / per_event:.2f}")

    # The agent's whole ingestion of a batch: decoded with runs coalesced, mirrored in one pass;
    # the reference decodes through the validating constructors and mirrors one event at a time.
    def ingest(agent_path: bool) -> None:
        tree = BlockTree("w", lengths, salt=b"bench", page_size=16)
        for payload in payloads:
            if agent_path:
                decoder = PayloadDecoder(payload, 0, coalesce=True)
                decoder.step(1 << 30)
                tree.apply_events(decoder.result.events)
            else:
                for event in constructed(payload):
                    tree.apply(event)

    ingest_ref = median_rate(lambda: ingest(False), len(batches), 3)
    ingest_new = median_rate(lambda: ingest(True), len(batches), 3)
    print(f"agent's ingestion (decode + mirror): {ingest_new:,.0f} batches/s ({1e6 / ingest_new:.0f} us each); "
          f"reference {ingest_ref:,.0f}/s ({1e6 / ingest_ref:.0f} us); ratio {ingest_new / ingest_ref:.2f}")

    tokens = sum(len(p) for p in prompts)

    def fill() -> None:
        c = PrefixCache(block_size=16, vram_tokens=200_000, dram_tokens=400_000)
        for i, p in enumerate(prompts):
            c.insert(p, now=float(i))

    cache_rate = median_rate(fill, tokens, 3)
    sha_rate = median_rate(lambda: [hashlib.sha256(np.asarray(p, dtype="<u4").tobytes()).digest() for p in prompts],
                           tokens, 3)
    print(f"prefix cache insert: {cache_rate / 1e6:.2f} M tokens/s; one SHA-256 pass over the same tokens "
          f"{sha_rate / 1e6:.1f} M tokens/s; ratio {cache_rate / sha_rate:.3f}")


async def bench_http(quick: bool) -> None:
    worker = EmulatedWorker(EmulatorSettings(port=0, kv_events_endpoint="tcp://127.0.0.1:*",
                                             kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0))
    await worker.start()
    prompts = workload(64)
    n = 300 if quick else 1500
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            async def closed_loop(concurrency: int, path: str) -> tuple[float, float]:
                latencies: list[float] = []
                counter = iter(range(n))

                async def client() -> None:
                    for i in counter:
                        start = time.perf_counter()
                        if path == "/generate":
                            body = {"input_ids": prompts[i % len(prompts)], "sampling_params": {"max_new_tokens": 16}}
                            async with session.post(worker.http_url + path, json=body) as r:
                                await r.read()
                        else:
                            async with session.get(worker.http_url + path) as r:
                                await r.read()
                        latencies.append(time.perf_counter() - start)

                start = time.perf_counter()
                await asyncio.gather(*[client() for _ in range(concurrency)])
                return n / (time.perf_counter() - start), statistics.median(latencies) * 1000

            for concurrency in (1, 16):
                ref_rps, ref_p50 = await closed_loop(concurrency, "/health")
                rps, p50 = await closed_loop(concurrency, "/generate")
                print(f"emulator /generate c={concurrency}: {rps:,.0f} req/s, P50 {p50:.2f} ms; "
                      f"/health {ref_rps:,.0f} req/s, P50 {ref_p50:.2f} ms; throughput ratio {rps / ref_rps:.2f}")
    finally:
        await worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    bench_codec_and_tree(args.quick)
    asyncio.run(bench_http(args.quick))


if __name__ == "__main__":
    main()
