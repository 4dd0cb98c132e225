"""How long one huge engine batch stalls the agent's event loop, whole vs in slices.

A PUB socket in its own thread (the engines' framing, encoded beforehand) sends one batch of ``--blocks`` blocks (``--shape``:
``requests``: 1-block BlockStored events chained in requests of 128 blocks, as SGLang sends
them; ``one-event``: a single BlockStored of every block; ``removal``: those blocks stored
first, then one BlockRemoved of them all). A real agent (``AgentNode``, not started: no peers,
so reports stay pending as while a maintenance unit is away) receives it through its real
subscriber, while a 1 ms heartbeat task records the longest gap between its ticks: what a QUIC
keep-alive or a load report would wait. ``whole`` decodes and applies the batch in one step each,
as the agent did before (and CPython's default GC thresholds); ``sliced`` is the agent now (the
subscriber decodes 2,048 events per step, ``_on_engine_events`` applies 2,048 blocks per step,
``tune_gc_for_large_mirrors`` as at its start). A single event is not split while decoding: an
engine's event is one request's blocks. ``idle`` is the same heartbeat with
no batch: the noise floor of a shared machine.

    python tools/bench_event_stall.py [--blocks 150000] [--shape requests] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

import zmq.asyncio

from kvcompassd import certs
from kvcompassd.agent import AgentNode, tune_gc_for_large_mirrors
from kvcompassd.daemon import tls_files
from kvcompassd.engine import subscriber as subscriber_module
from kvcompassd.engine.kvevents import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from kvcompassd.engine.subscriber import KvEventSubscriber
from kvcompassd.launcher import DeploymentSpec, build_cluster
from kvcompassd.wire import Role

BLOCK = 16
REQUEST_BLOCKS = 128


def batch_events(blocks: int, shape: str) -> tuple[list, list]:
    """(events published before, the huge batch's events)."""
    stores: list = []
    for start in range(0, blocks, REQUEST_BLOCKS):
        n = min(REQUEST_BLOCKS, blocks - start)
        parent = None
        tokens_base = start * BLOCK
        if shape == "one-event":
            break
        for i in range(n):
            h = start + i + 1
            stores.append(BlockStored((h,), parent, tuple(range(tokens_base + i * BLOCK, tokens_base + (i + 1) * BLOCK)),
                                      BLOCK, None, "GPU"))
            parent = h
    if shape == "one-event":
        return [], [BlockStored(tuple(range(1, blocks + 1)), None, tuple(i % 30000 for i in range(blocks * BLOCK)),
                                BLOCK, None, "GPU")]
    if shape == "removal":
        return stores, [BlockRemoved(tuple(range(1, blocks + 1)), "GPU")]
    return [], stores


def publish_from_thread(endpoint_box: list, frames_list: list[list[bytes]], go, joined) -> None:
    """A plain PUB in its own thread (as the engines' publisher thread): its encoding and
    sending never run on the agent's loop. Sends the first batch until the SUB has joined."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint_box.append(f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}")
    while not joined.is_set():
        pub.send_multipart(frames_list[0])
        time.sleep(0.01)
    go.wait()
    for frames in frames_list[1:]:
        pub.send_multipart(frames)
    time.sleep(0.5)
    pub.close()
    ctx.term()


async def one_run(node_factory, blocks: int, shape: str, mode: str) -> tuple[float, float]:
    import threading

    ctx = zmq.asyncio.Context()
    node = node_factory()
    before, huge = batch_events(blocks, shape)
    first = before or [BlockStored((10**9,), None, tuple(range(BLOCK)), BLOCK, None, "GPU")]
    frames_list = [encode_batch(0, 1.0, first), encode_batch(1, 2.0, huge)]  # encoded off the clock
    endpoint_box: list = []
    go, joined = threading.Event(), threading.Event()
    thread = threading.Thread(target=publish_from_thread, args=(endpoint_box, frames_list, go, joined))
    thread.start()
    while not endpoint_box:
        await asyncio.sleep(0.01)
    done = asyncio.Event()

    async def on_item(item) -> None:
        if isinstance(item, EventBatch):
            if mode == "whole":
                node._enqueue(node.tree.apply_batch(item))
            else:
                await node._on_engine_events(item)
            if item.seq == 0:
                joined.set()
            else:
                done.set()

    sub = KvEventSubscriber(endpoint_box[0], None, on_item, context=ctx, idle_probe=None)
    task = asyncio.create_task(sub.run())
    while not joined.is_set():
        await asyncio.sleep(0.01)
    worst = 0.0
    stop = False

    async def heartbeat() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    go.set()
    await done.wait()
    elapsed = time.perf_counter() - start
    stop = True
    await beat
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.to_thread(thread.join)
    ctx.destroy(linger=0)
    return worst * 1000, elapsed * 1000


async def idle_stall(seconds: float) -> float:
    worst, last = 0.0, time.perf_counter()
    end = last + seconds
    while last < end:
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=150_000)
    parser.add_argument("--shape", choices=("requests", "one-event", "removal"), default="requests")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sliced_decode = subscriber_module.DECODE_SLICE_EVENTS
    default_gc = gc.get_threshold()
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, wan=False))
    worker = cfg.workers[0]
    with tempfile.TemporaryDirectory() as tmp:
        certs.init_ca(Path(tmp), cluster_name=cfg.name)
        certs.issue(Path(tmp), Path(tmp), role=Role.AGENT, node_id=worker.id)
        tls = tls_files(tmp, worker.id)
        results = {}
        idle = statistics.median(asyncio.run(idle_stall(2.0)) for _ in range(args.repeats))
        print(f"idle  : longest loop stall {idle:8.1f} ms with no batch at all (this machine's noise floor)")
        for mode in ("whole", "sliced"):
            # whole: decode in one step too, as the subscriber did before
            subscriber_module.DECODE_SLICE_EVENTS = 1 << 62 if mode == "whole" else sliced_decode
            if mode == "whole":
                gc.set_threshold(*default_gc)
            else:
                tune_gc_for_large_mirrors()  # as AgentNode.start does
            runs = [asyncio.run(one_run(lambda: AgentNode(cfg, worker, tls), args.blocks, args.shape, mode))
                    for _ in range(args.repeats)]
            results[mode] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
            print(f"{mode:6s}: longest loop stall {results[mode][0]:8.1f} ms, batch applied in "
                  f"{results[mode][1]:8.1f} ms (median of {args.repeats}; {args.blocks} blocks, {args.shape})")
        print(f"stall ratio sliced/whole {results['sliced'][0] / results['whole'][0]:.3f}; "
              f"time ratio {results['sliced'][1] / results['whole'][1]:.2f}")


if __name__ == "__main__":
    main()
