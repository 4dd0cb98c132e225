"""Dedicated fuzz run of every decoder that reads bytes from outside the process.

    .venv/bin/python tools/fuzz_decoders.py            # 10^5 inputs per decoder
    .venv/bin/python tools/fuzz_decoders.py --quick    # 10^3 inputs per decoder
    .venv/bin/python tools/fuzz_decoders.py --only wire.decode -n 20000 --seed 3

Decoders and their documented errors:

- ``kvcompassd.wire.decode`` (QUIC frames from peers, plain and compressed): ``WireError`` only.
- ``kvcompassd.engine.kvevents.decode_message`` / ``decode_payload`` / ``PayloadDecoder`` with
  ``coalesce`` (the agent's: the C scan ``kvc_kvevents_scan`` first) (the engine's ZMQ KV-event
  stream): ``KvEventError`` only.
- ``LudoView.from_snapshot`` (snapshot blobs from a maintenance unit or peer edge): ``LudoError``.
- ``LudoView.apply`` on a live view (update-record blobs and snapshots): ``LudoError``, and a
  rejected blob leaves the view byte-for-byte unchanged (its exported snapshot is compared).
- A report's columns applied to a live shard (``wire.decode`` of a ``PrefixEventsReported``,
  then ``MaintenanceShard.apply_columns``, as a maintenance unit does): ``WireError`` from the
  decode only; the vectorised apply never raises, and its outcome and end state equal applying
  the same events one by one (``MaintenanceShard.apply``).
- The edge's HTTP front door (``FrontDoor`` app in-process through aiohttp's TestClient, its
  workers unreachable): never a 5xx other than 502/503 (no worker could serve a valid body),
  always a JSON error body naming what was wrong.

Inputs per decoder are a mix of mutations of valid encodings (byte flips, inserts, deletions,
truncations, splices, interesting integers; and structural mutations of the decoded msgpack or
JSON tree), random structures, and random bytes. Each input runs under a time bound (SIGALRM
for the in-process decoders, asyncio.timeout for HTTP); exceeding it counts as a hang. The
exit status is 1 if any input raised an undocumented exception, hung, or changed state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import string
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvcompassd.engine.http1 import WorkerConnections
from kvcompassd.core.events import PrefixCached, PrefixEvicted, Tier, TierChanged
from kvcompassd.core.ludo import LudoError, LudoTable, LudoView
from kvcompassd.engine import kvevents
from kvcompassd.engine.kvevents import KvEventError
from kvcompassd import wire
from kvcompassd.wire import WireError

INTERESTING_INTS = (0, 1, -1, 2, 16, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                    2**63 - 1, -(2**63), 2**64 - 1, -129, -32768)


class Hang(Exception):
    """An input exceeded the per-input time bound."""


# -- generators -----------------------------------------------------------------------------------


def random_text(rng: random.Random, n: int) -> str:
    pools = (string.ascii_letters + string.digits + "-_.:@", string.printable, "\u00e9\u4e2d\U0001f600\u0000\u202e")
    pool = rng.choice(pools)
    return "".join(rng.choice(pool) for _ in range(n))


def random_int(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.4:
        return rng.choice(INTERESTING_INTS)
    if r < 0.7:
        return rng.randint(-300, 300)
    return rng.randint(-(2**63), 2**64 - 1)


def random_obj(rng: random.Random, depth: int = 0, json_safe: bool = False) -> Any:
    """A random msgpack- (or JSON-) encodable structure."""
    kinds = ["none", "bool", "int", "float", "str", "list", "dict"] + ([] if json_safe else ["bytes"])
    if depth >= 3:
        kinds = [k for k in kinds if k not in ("list", "dict")]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        v = random_int(rng)
        return max(min(v, 2**63 - 1), -(2**63)) if json_safe else v
    if kind == "float":
        return rng.choice([0.0, -0.0, 1e308, -1e-308, 0.5, rng.uniform(-1e6, 1e6)] +
                          ([] if json_safe else [math.nan, math.inf, -math.inf]))
    if kind == "str":
        return random_text(rng, rng.choice([0, 1, 3, 8, 40, 200]))
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 1, 8, 33, 200]))
    if kind == "list":
        return [random_obj(rng, depth + 1, json_safe) for _ in range(rng.choice([0, 1, 2, 3, 5, 9]))]
    keys = ["type", "ts", "events", "text", "prompt", "input_ids", "messages", "role", "content",
            "max_tokens", "stream", "sampling_params", "max_new_tokens", "block_hashes", "token_ids"]
    out = {}
    for _ in range(rng.choice([0, 1, 2, 4])):
        k = rng.choice(keys) if rng.random() < 0.7 else random_text(rng, 4)
        out[k if json_safe or rng.random() < 0.9 else random_int(rng)] = random_obj(rng, depth + 1, json_safe)
    return out


def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3, 4])):
        op = rng.randrange(9)
        n = len(buf)
        if op == 0 and n:  # flip bits
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # interesting byte (msgpack markers among them)
            buf[rng.randrange(n)] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCF, 0xD3, 0xDC,
                                                0xDD, 0xDE, 0xDF, 0x90, 0x9F, 0xA0, 0xBF, 0x92, 0x93])
        elif op == 2:  # insert random bytes
            i = rng.randrange(n + 1)
            buf[i:i] = rng.randbytes(rng.choice([1, 2, 4, 9]))
        elif op == 3 and n:  # delete a range
            i = rng.randrange(n)
            del buf[i:i + rng.choice([1, 2, 4, 16])]
        elif op == 4 and n:  # truncate
            del buf[rng.randrange(n):]
        elif op == 5 and n:  # duplicate a range
            i = rng.randrange(n)
            j = min(n, i + rng.choice([1, 4, 16, 64]))
            buf[j:j] = buf[i:j]
        elif op == 6 and others:  # splice with another valid sample
            other = rng.choice(others)
            i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
            buf = buf[:i] + other[j:]
        elif op == 7 and n >= 4:  # overwrite with an interesting 1/2/4/8-byte integer
            width = rng.choice([1, 2, 4, 8])
            i = rng.randrange(max(1, n - width + 1))
            v = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
            buf[i:i + width] = v.to_bytes(width, rng.choice(["big", "little"]))[: n - i]
        elif op == 8:  # append garbage
            buf += rng.randbytes(rng.choice([1, 3, 8]))
    return bytes(buf)


def mutate_tree(rng: random.Random, obj: Any, json_safe: bool = False) -> Any:
    """Replace, perturb, drop or duplicate one random node of a decoded structure."""
    if isinstance(obj, list) and obj and rng.random() < 0.75:
        obj = list(obj)
        i = rng.randrange(len(obj))
        op = rng.randrange(4)
        if op == 0:
            obj[i] = mutate_tree(rng, obj[i], json_safe)
        elif op == 1:
            del obj[i]
        elif op == 2:
            obj.insert(i, obj[i] if rng.random() < 0.5 else random_obj(rng, 2, json_safe))
        else:
            obj[i] = random_obj(rng, 1, json_safe)
        return obj
    if isinstance(obj, dict) and obj and rng.random() < 0.75:
        obj = dict(obj)
        k = rng.choice(list(obj))
        op = rng.randrange(3)
        if op == 0:
            obj[k] = mutate_tree(rng, obj[k], json_safe)
        elif op == 1:
            del obj[k]
        else:
            obj[k] = random_obj(rng, 1, json_safe)
        return obj
    if isinstance(obj, bool):
        return not obj
    if isinstance(obj, int):
        v = rng.choice([obj + 1, obj - 1, -obj, obj * 1000, random_int(rng)])
        return max(min(v, 2**63 - 1), -(2**63)) if json_safe else max(min(v, 2**64 - 1), -(2**63))
    if isinstance(obj, str):
        return rng.choice(["", obj * 50, obj[:-1], random_text(rng, len(obj) + 1)])
    if isinstance(obj, (bytes, bytearray)):
        return mutate_bytes(rng, bytes(obj), [])
    return random_obj(rng, 1, json_safe)


def pack(obj: Any) -> bytes | None:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return None


def msgpack_input(rng: random.Random, valid: list[bytes]) -> bytes:
    """A mutation of a valid encoding (bytes or tree), a random structure, or random bytes."""
    r = rng.random()
    if r < 0.45:
        return mutate_bytes(rng, rng.choice(valid), valid)
    if r < 0.85:
        tree = msgpack.unpackb(rng.choice(valid), raw=False, strict_map_key=False)
        for _ in range(rng.choice([1, 1, 2, 3])):
            tree = mutate_tree(rng, tree)
        data = pack(tree)
        if data is not None:
            return data
    if r < 0.95:
        data = pack(random_obj(rng))
        if data is not None:
            return data
    return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 100, 1000]))


# -- decoders -------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    allowed: str
    inputs: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    max_ms: float = 0.0
    seconds: float = 0.0


def wire_samples() -> list[bytes]:
    events = (PrefixCached("us-0", 12345678901234, Tier.VRAM), TierChanged("us-0", 42, Tier.DRAM),
              PrefixEvicted("us-0", 7))
    messages = [
        wire.PrefixEventsReported("us-0", 5, events),
        wire.WorkerWithdrawn("us-0"),
        wire.WorkerRegistered("us-0", 1_700_000_000_000_000_000),
        wire.UpdatesSubscribed("edge-us", 1, 123456, 9),
        wire.ResyncRequested("edge-us", 0, 123456, 3),
        wire.UpdateBatchPublished(0, 123456, 10, ((0, b"\x01\x02records"), (1, b"more"))),
        wire.ShardSnapshotSent(1, 123456, 10, ((0, bytes(64)),)),
        wire.SnapshotTransferStarted(1, 123456, 10, 77, 5, 3000, 1024, 3, ((0, 1000), (1, 2000))),
        wire.SnapshotChunkSent(1, 77, 2, 0x1234ABCD, b"\x07chunk"),
        wire.SnapshotResumeRequested("edge-us", 1, 77, 2),
        wire.QueueVectorBroadcast("us", "eu", 1234.5, (("us-0", 3.5), ("us-1", 0.0))),
        wire.ViewCopyRequested("edge-eu"),
        wire.RequestForwarded("req-1", "edge-us", "us", (1, 2, 3, 65535), {"max_new_tokens": 4, "stop": ["x"]}, True, 16),
        wire.MigrationRequested("req-2", (5, 6, 7), "us-0", "eu-1", "recompute"),
        wire.ResponseChunked("req-1", (9, 10), "hello", False),
        wire.ResponseCompleted("req-1", "us-0", 16, 32, 4, "stop", (("us-0", 1.0),)),
        wire.RequestFailed("req-1", "us-0", "engine down", True),
        wire.RequestRejected("req-1", "us-0", 400, "top_p must be in (0, 1], got 2.0."),
        wire.WorkerLoadReported("us-0", 12.5, 3, 1),
        wire.PiggybackSent("us-0", "eu"),
        wire.ErrorReported("malformed", "bad"),
        wire.AdminQueried("holders", {"text": "a prompt", "top": 5}),
        wire.AdminAnswered("status", {"mode": "edge", "views": [{"shard": 0}]}),
        wire.TokenizationRequested("edge-us", "probe text", {"messages": [{"role": "user", "content": "hi"}]}),
        wire.TokenizationAnswered("us-0", (0, 5, 9), (0, 2, 3), False, "/models/x", "", False),
    ]
    assert {type(m) for m in messages} == {spec.cls for spec in wire.MESSAGE_SPECS.values()}, "a message lacks a sample"
    big_batch = wire.UpdateBatchPublished(0, 123456, 11, ((0, bytes(2000) + b"\x07records"),))
    compressed = [wire.encode(big_batch, compress=True), wire.encode(messages[0], compress=True)]
    assert wire.encode(big_batch, compress=True) != wire.encode(big_batch), "no compressed sample"
    return [wire.encode(m) for m in messages] + compressed


def kv_payload_samples() -> list[bytes]:
    stored = ["BlockStored", [111, 222], 99, list(range(32)), 16, None, "GPU"]
    stored_short = ["BlockStored", [b"\x01" * 32], None, list(range(5)), 16]
    removed = ["BlockRemoved", [111, 2**64 - 5], "CPU"]
    cleared = ["AllBlocksCleared"]
    stored_map = {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None,
                  "token_ids": list(range(40)), "block_size": 16, "lora_id": None, "medium": "GPU",
                  "extra_keys": None}
    removed_map = {"type": "BlockRemoved", "block_hashes": [3], "medium": None}
    batches = [
        [1.5, [stored, removed]],
        [2.5, [stored_short, cleared, removed], 0],
        {"ts": 3.5, "events": [stored_map, removed_map, {"type": "AllBlocksCleared"}], "data_parallel_rank": 1},
        [4.5, [stored + ["lora-name", [], 0]]],
        [5.5, [stored_map, {**stored_map, "block_hashes": [4], "parent_block_hash": 3, "token_ids": list(range(16))},
               removed_map, removed_map, {"type": "AllBlocksCleared"}], 0],  # the agent's C scan takes it
    ]
    out = [msgpack.packb(b, use_bin_type=True) for b in batches]
    for payload in out:
        kvevents.decode_payload(payload, 1)  # each sample is valid
    return out


def frames_input(rng: random.Random, payloads: list[bytes]) -> list[bytes]:
    frames = [b"kv", (rng.choice([0, 1, 77, 2**62])).to_bytes(8, "big"), msgpack_input(rng, payloads)]
    r = rng.random()
    if r < 0.1:
        frames[1] = mutate_bytes(rng, frames[1], [])
    elif r < 0.15:
        frames = frames[: rng.randrange(3)] if rng.random() < 0.5 else frames + [rng.randbytes(3)]
    elif r < 0.2:
        frames[0] = rng.randbytes(rng.randrange(4))
    return frames


REPORT_WORKER = "a-1"


def report_fixture():
    """(make a live shard, valid encoded reports of REPORT_WORKER against its state)."""
    from kvcompassd.core.index import MaintenanceShard
    from kvcompassd.core.layout import IndexLayout
    from kvcompassd.launcher import DeploymentSpec, build_cluster

    cfg = build_cluster(DeploymentSpec(workers={"a": 3}, one_way_ms={}, shards=2, wan=False))
    layout = IndexLayout.from_config(cfg)
    prior = [PrefixCached(w, k, Tier.DRAM if w == "a-0" else Tier.VRAM) for w in ("a-0", REPORT_WORKER)
             for k in range(0, 40, 4)]

    def live_shard() -> MaintenanceShard:
        shard = MaintenanceShard(layout, 0, 2, epoch=1, initial_capacity=64)
        shard.apply(prior)
        shard.flush()
        return shard

    rng = random.Random(5)
    reports = []
    for n in (1, 3, 8, 30):
        events = []
        for _ in range(n):
            key = rng.randrange(0, 48, 2)
            tier = rng.choice([Tier.VRAM, Tier.DRAM])
            events.append(rng.choice([PrefixCached(REPORT_WORKER, key, tier), TierChanged(REPORT_WORKER, key, tier),
                                      PrefixEvicted(REPORT_WORKER, key)]))
        reports.append(wire.encode(wire.PrefixEventsReported(REPORT_WORKER, n, tuple(events))))
    return live_shard, reports


def ludo_fixture() -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """Valid snapshots of small tables, and (view state before, blob) pairs of update blobs
    (record batches and a snapshot after a grow) that apply cleanly to that state."""
    rng = random.Random(11)
    snapshots = []
    steps = []
    for value_bits, fp_bits in ((32, 0), (64, 0), (32, 8)):
        table = LudoTable(64, value_bits=value_bits, fingerprint_bits=fp_bits, seed=value_bits + fp_bits)
        keys = rng.sample(range(1, 2**63 - 1), 400)
        for k in keys[:40]:
            table.insert(k, rng.randrange(1, 2**value_bits))
        table.take_updates()
        base = table.snapshot()
        snapshots.append(base)
        view = LudoView.from_snapshot(base)
        for batch in (keys[40:50], keys[50:120]):  # the second batch makes the table grow
            for k in batch:
                table.insert(k, rng.randrange(1, 2**value_bits))
            table.update(keys[0], 5)
            table.remove(keys[1])
            keys.remove(keys[1])
            for blob in table.take_updates():
                before = view.snapshot()
                view.apply(blob)
                steps.append((before, blob))
        snapshots.append(table.snapshot())
    return snapshots, steps


class Runner:
    def __init__(self, n: int, seed: int, bound_s: float):
        self.n, self.seed, self.bound_s = n, seed, bound_s

    def run_sync(self, name: str, allowed: tuple[type[BaseException], ...], make: Callable[[random.Random], Any],
                 call: Callable[[Any], Any], check: Callable[[Any, BaseException | None], str | None] | None = None,
                 ) -> Result:
        rng = random.Random(f"{self.seed}:{name}")
        result = Result(name, "/".join(a.__name__ for a in allowed))
        t0 = time.perf_counter()
        for _ in range(self.n):
            data = make(rng)
            result.inputs += 1
            error: BaseException | None = None
            started = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, self.bound_s)
            try:
                call(data)
                result.accepted += 1
            except Hang:
                result.violations.append(f"hang (> {self.bound_s} s) on {_show(data)}")
                continue
            except allowed as exc:
                error = exc
                result.rejected[type(exc).__name__] += 1
            except Exception as exc:  # noqa: BLE001 - the point is to catch the undocumented ones
                error = exc
                result.violations.append(f"{type(exc).__name__}: {exc} on {_show(data)}\n{traceback.format_exc(limit=4)}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            result.max_ms = max(result.max_ms, (time.perf_counter() - started) * 1000)
            if check is not None:
                problem = check(data, error)
                if problem:
                    result.violations.append(f"{problem} on {_show(data)}")
        result.seconds = time.perf_counter() - t0
        return result


def _show(data: Any) -> str:
    if isinstance(data, (bytes, bytearray)):
        return f"{len(data)} bytes {bytes(data[:80]).hex()}{'...' if len(data) > 80 else ''}"
    text = repr(data)
    return text[:300] + ("..." if len(text) > 300 else "")


def _alarm(signum, frame):
    raise Hang()


# -- the front door -------------------------------------------------------------------------------


ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
VALID_BODIES = {
    "/v1/completions": [{"model": "m", "prompt": "hello there", "max_tokens": 3},
                        {"prompt": [1, 2, 3], "max_tokens": 1, "stream": True, "temperature": 0.5, "stop": ["x"]}],
    "/v1/chat/completions": [{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                             {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                              "stream": True}],
    "/generate": [{"text": "hello", "sampling_params": {"max_new_tokens": 2}},
                  {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "stream": True}],
}


def http_input(rng: random.Random) -> tuple[str, bytes]:
    route = rng.choice(ROUTES)
    valid = VALID_BODIES[route]
    r = rng.random()
    if r < 0.45:
        body = rng.choice(valid)
        for _ in range(rng.choice([1, 1, 2, 3])):
            body = mutate_tree(rng, body, json_safe=True)
        return route, json.dumps(body).encode()
    if r < 0.7:
        return route, mutate_bytes(rng, json.dumps(rng.choice(valid)).encode(), [])
    if r < 0.9:
        return route, json.dumps(random_obj(rng, json_safe=True)).encode()
    return route, rng.randbytes(rng.choice([0, 1, 10, 300]))


async def fuzz_frontdoor(n: int, seed: int, bound_s: float, concurrency: int = 16) -> Result:
    import aiohttp

    from kvcompassd.core.index import EdgeIndexView, MaintenanceShard
    from kvcompassd.core.layout import IndexLayout
    from kvcompassd.core.router import Router
    from kvcompassd.forwarding import Forwarder
    from kvcompassd.frontdoor import FrontDoor, FrontDoorSettings
    from kvcompassd.launcher import DeploymentSpec, build_cluster
    from kvcompassd.metrics import EdgeMetrics
    from kvcompassd.tokenizer import ByteTokenizer

    # A real front door and forwarder; the region's workers listen nowhere, so a body that
    # parses is answered 502/503 by failover running out of workers (fast: connection refused).
    cfg = build_cluster(DeploymentSpec(workers={"a": 2}, one_way_ms={}, shards=1, wan=False))
    layout = IndexLayout.from_config(cfg)
    view = EdgeIndexView(layout, 1, edge=cfg.edges[0].id)
    view.install_snapshot(MaintenanceShard(layout, 0, 1, epoch=1, initial_capacity=64).snapshot())
    router = Router(cfg, "a", view, now=0.0)
    metrics = EdgeMetrics()
    result = Result("frontdoor (HTTP)", "4xx / 502 / 503 JSON error")
    rng = random.Random(f"{seed}:frontdoor")
    inputs = [http_input(rng) for _ in range(n)]
    t0 = time.perf_counter()
    async with WorkerConnections() as http:
        forwarder = Forwarder(cfg.edges[0].id, router, lambda w: None, http, clock=time.monotonic, metrics=metrics)
        frontdoor = FrontDoor(forwarder, ByteTokenizer(), FrontDoorSettings(model="m", max_prompt_tokens=4096), metrics)
        _, port = await frontdoor.serve("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as client:
            queue = iter(inputs)

            async def worker():
                for route, body in queue:
                    result.inputs += 1
                    started = time.perf_counter()
                    try:
                        async with asyncio.timeout(bound_s):
                            async with client.post(url + route, data=body,
                                                   headers={"Content-Type": "application/json"}) as resp:
                                text = await resp.text()
                    except TimeoutError:
                        result.violations.append(f"hang (> {bound_s} s) on {route} {_show(body)}")
                        continue
                    result.max_ms = max(result.max_ms, (time.perf_counter() - started) * 1000)
                    status = resp.status
                    if status == 200:
                        result.accepted += 1
                        result.violations.append(f"200 without any worker on {route} {_show(body)}")
                        continue
                    result.rejected[str(status)] += 1
                    if status >= 500 and status not in (502, 503):
                        result.violations.append(f"HTTP {status} {text[:200]} on {route} {_show(body)}")
                        continue
                    try:
                        message = json.loads(text)["error"]["message"]
                        assert isinstance(message, str) and message
                    except Exception:  # noqa: BLE001
                        result.violations.append(f"HTTP {status} without a JSON error: {text[:200]!r} on {route} {_show(body)}")

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        await frontdoor.close()
    result.seconds = time.perf_counter() - t0
    return result


# -- main -----------------------------------------------------------------------------------------


def run_all(n: int, seed: int, bound_s: float, only: set[str] | None, http_n: int) -> list[Result]:
    runner = Runner(n, seed, bound_s)
    results = []

    def want(name: str) -> bool:
        return only is None or name in only

    if want("wire.decode"):
        valid = wire_samples()
        results.append(runner.run_sync("wire.decode", (WireError,), lambda rng: msgpack_input(rng, valid), wire.decode))
    payloads = kv_payload_samples()
    if want("kvevents.decode_payload"):
        results.append(runner.run_sync("kvevents.decode_payload", (KvEventError,),
                                       lambda rng: msgpack_input(rng, payloads),
                                       lambda data: kvevents.decode_payload(data, 1)))
    if want("kvevents.PayloadDecoder(coalesce)"):  # the agent's decoder: the C scan first, then Python
        def coalesced(data: bytes) -> None:
            decoder = kvevents.PayloadDecoder(data, 1, coalesce=True)
            while not decoder.step(7):
                pass

        results.append(runner.run_sync("kvevents.PayloadDecoder(coalesce)", (KvEventError,),
                                       lambda rng: msgpack_input(rng, payloads), coalesced))
    if want("kvevents.decode_message"):
        results.append(runner.run_sync("kvevents.decode_message", (KvEventError,),
                                       lambda rng: frames_input(rng, payloads), kvevents.decode_message))
    snapshots, steps = ludo_fixture()
    blobs = snapshots + [blob for _, blob in steps]
    if want("LudoView.from_snapshot"):
        def snap_input(rng):
            return mutate_bytes(rng, rng.choice(snapshots), snapshots) if rng.random() < 0.9 else rng.randbytes(rng.randrange(200))
        results.append(runner.run_sync("LudoView.from_snapshot", (LudoError,), snap_input, LudoView.from_snapshot))
    if want("LudoView.apply"):
        views: dict[int, LudoView] = {}

        def apply_input(rng):
            i = rng.randrange(len(steps))
            before, blob = steps[i]
            r = rng.random()
            if r < 0.85:
                blob = mutate_bytes(rng, blob, blobs)
            elif r < 0.95:
                blob = rng.choice(blobs)  # a valid blob for another state or table
            else:
                blob = rng.randbytes(rng.randrange(100))
            return i, blob

        def apply(item):
            i, blob = item
            view = views.get(i)
            if view is None:
                view = views[i] = LudoView.from_snapshot(steps[i][0])
            view.apply(blob)
            del views[i]  # accepted: the view changed legitimately; rebuild it next time

        def unchanged(item, error):
            i, _ = item
            if error is None:
                return None
            now = views[i].snapshot()
            return None if now == steps[i][0] else "a rejected blob changed the view"

        results.append(runner.run_sync("LudoView.apply", (LudoError,), apply_input, apply, unchanged))
    if want("report apply_columns"):
        live_shard, reports = report_fixture()

        def apply_report(data):
            report = wire.decode(data)
            if not isinstance(report, wire.PrefixEventsReported):
                return None
            shard = live_shard()
            return report, shard.apply_columns(report.worker, report.events), shard

        def same_as_one_by_one(data, error):
            if error is not None:
                return None if isinstance(error, WireError) else "apply_columns raised"
            outcome = apply_report(data)
            if outcome is None:
                return None
            report, got, shard = outcome
            reference = live_shard()
            want_outcome = reference.apply(report.events.as_events(report.worker))
            if got != want_outcome:
                return f"apply_columns outcome {got} != one by one {want_outcome}"
            states = [{g: dict(zip(k.tolist(), v.tolist())) for g, (k, v) in s.group_items().items()}
                      for s in (shard, reference)]
            return None if states[0] == states[1] else "apply_columns left another state than one by one"

        results.append(runner.run_sync("report apply_columns", (WireError,), lambda rng: msgpack_input(rng, reports),
                                       apply_report, same_as_one_by_one))
    if want("frontdoor"):
        results.append(asyncio.run(fuzz_frontdoor(http_n, seed, max(bound_s, 10.0))))
    return results


def render(results: list[Result]) -> str:
    rows = [("decoder", "inputs", "accepted", "rejected (by type)", "max ms", "s", "violations")]
    for r in results:
        rejected = ", ".join(f"{k} {v}" for k, v in r.rejected.most_common())
        rows.append((r.name, str(r.inputs), str(r.accepted), rejected or "-", f"{r.max_ms:.1f}", f"{r.seconds:.1f}",
                     str(len(r.violations))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=None, help="inputs per decoder (default 10^5; --quick 10^3)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=2.0, help="per-input time bound in seconds")
    parser.add_argument("--only", action="append", default=None,
                        help="wire.decode, kvevents.decode_payload, kvevents.PayloadDecoder(coalesce), kvevents.decode_message, "
                             "LudoView.from_snapshot, LudoView.apply, report apply_columns, frontdoor")
    args = parser.parse_args(argv)
    n = args.n or (1_000 if args.quick else 100_000)
    signal.signal(signal.SIGALRM, _alarm)
    import structlog
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    results = run_all(n, args.seed, args.bound, set(args.only) if args.only else None, n)
    print(render(results))
    bad = [r for r in results if r.violations]
    for r in bad:
        print(f"\n{r.name}: {len(r.violations)} violations; first ones:")
        for v in r.violations[:5]:
            print("  " + v.replace("\n", "\n    "))
    total = sum(r.inputs for r in results)
    print(f"\n{total} inputs in all; documented exceptions only: {'yes' if not bad else 'NO'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
