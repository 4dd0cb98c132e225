"""Record what SGLang's and vLLM's own ``ZmqEventPublisher`` send, live and on replay.

Loads ``kv_events.py`` straight out of the engines' wheels (nothing else of the engines: the
heavy modules it imports, torch among them, are replaced by the few names it uses), starts the
publisher on loopback, publishes a fixed script of batches and records, byte for byte:

- every live message a SUB socket receives (``[topic, seq, payload]``);
- replay exchanges: what a DEALER receives after asking for ``start_seq`` (``[b"", topic, seq,
  payload]`` per batch, then the end marker).

The result is one msgpack file per engine and topic under ``tests/data/engine_events/``, read
by the tests (which never need the engines). Re-capture only to follow a new engine release:

    python -m venv /tmp/capvenv && /tmp/capvenv/bin/pip install msgspec pyzmq pydantic msgpack
    pip download --no-deps -d /tmp/wheels sglang==0.5.23 vllm==0.34.0
    /tmp/capvenv/bin/python tools/capture_engine_events.py \
        --sglang-wheel /tmp/wheels/sglang-0.5.23-*.whl --vllm-wheel /tmp/wheels/vllm-0.34.0-*.whl

The script (block size 16, token ids 100.. so each block's tokens say where it sits):

0. BlockStored root block A (GPU).
1. BlockStored B, C under A in one event (32 tokens); vLLM: C's hash above the int64 range.
2. BlockStored A copied to host memory, then BlockRemoved A from GPU, in one batch.
3. BlockRemoved C (GPU).
4. vLLM: BlockStored D under B in KV-cache group 1 (hybrid models), a LoRA block E (lora_id,
   lora_name) and a partial-block entry F (block_size 8); SGLang: a LoRA block E.
5. AllBlocksCleared.
6. BlockStored G (GPU), after the clear.

Replays recorded: from 0 (everything), from 3, and from 7 (past the newest: only the marker).
A second capture with a buffer of 4 batches records a replay from 0 that cannot reach back.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheel_modules import load_from_wheel, stub_module  # noqa: E402

BLOCK = 16
HASH_A, HASH_B, HASH_C = -8211977001010843013, 4_242_424_242_424_242, 17_000_000_000_000_000_001
HASH_D, HASH_E, HASH_F, HASH_G = 1_111, 2_222, 3_333, 4_444
SGLANG_HASH_C = 5_555_555_555  # SGLang declares list[int]: int64 range


def tokens(start_block: int, blocks: int = 1, size: int = BLOCK) -> list[int]:
    return list(range(100 + start_block * BLOCK, 100 + start_block * BLOCK + blocks * size))


def load_sglang(wheel: Path, tmp: Path) -> types.ModuleType:
    for package in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        stub_module(package, __path__=[])
    stub_module("sglang.srt.runtime_context", get_parallel=lambda: None)

    class NetworkAddress:  # only describe_local_source uses it; the capture does not
        @staticmethod
        def parse(text: str) -> Any:
            raise ValueError(text)

    stub_module("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
    return load_from_wheel(wheel, "sglang/srt/disaggregation/kv_events.py", "sglang.srt.disaggregation.kv_events", tmp)


def load_vllm(wheel: Path, tmp: Path) -> types.ModuleType:
    import logging
    from dataclasses import dataclass

    for package in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        stub_module(package, __path__=[])

    @dataclass
    class KVEventsConfig:  # vllm.config.kv_events, fields only (the publisher only stores it)
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    stub_module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub_module("vllm.logger", init_logger=logging.getLogger)
    stub_module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
            is_valid_ipv6_address=lambda ip: False, split_zmq_path=lambda p: tuple(p.rsplit(":", 2)))
    stub_module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return load_from_wheel(wheel, "vllm/distributed/kv_events.py", "vllm.distributed.kv_events", tmp)


def script(engine: str, kv: types.ModuleType) -> list[list[Any]]:
    """The batches' events, built with the engine's own event classes."""
    if engine == "sglang":
        def stored(hashes, parent, toks, medium=None, size=BLOCK, **extra):
            return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=size,
                                  lora_id=extra.pop("lora_id", None), medium=medium, **extra)
        hash_c, host = SGLANG_HASH_C, kv.StorageMedium.CPU.value
        extras = [stored([HASH_E], None, tokens(7), "GPU", lora_id=3, lora_name="adapter-a")]
    else:
        def stored(hashes, parent, toks, medium=None, size=BLOCK, **extra):
            return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=size,
                                  lora_id=extra.pop("lora_id", None), medium=medium,
                                  lora_name=extra.pop("lora_name", None), **extra)
        hash_c, host = HASH_C, kv.MEDIUM_CPU
        extras = [
            stored([HASH_D], HASH_B, tokens(3), "GPU", group_idx=1, kv_cache_spec_kind="sliding_window",
                   kv_cache_spec_sliding_window=64),
            stored([HASH_E], None, tokens(7), "GPU", lora_id=3, lora_name="adapter-a", group_idx=0),
            stored([HASH_F], HASH_B, tokens(3, size=8), "GPU", size=8, group_idx=0),
        ]
    return [
        [stored([HASH_A], None, tokens(0), "GPU")],
        [stored([HASH_B, hash_c], HASH_A, tokens(1, 2), "GPU")],
        [stored([HASH_A], None, tokens(0), host), kv.BlockRemoved(block_hashes=[HASH_A], medium="GPU")],
        [kv.BlockRemoved(block_hashes=[hash_c], medium="GPU")],
        extras,
        [kv.AllBlocksCleared()],
        [stored([HASH_G], None, tokens(9), "GPU")],
    ]


def _publisher(engine: str, kv: types.ModuleType, pub: str, replay: str, topic: str, buffer_steps: int) -> Any:
    rank = {"attn_dp_rank": 0} if engine == "sglang" else {"data_parallel_rank": 0}
    return kv.ZmqEventPublisher(**rank, endpoint=pub, replay_endpoint=replay, topic=topic, buffer_steps=buffer_steps)


def _recv_all(sock: zmq.Socket, timeout_ms: int) -> list[list[bytes]]:
    out = []
    while sock.poll(timeout_ms):
        out.append(sock.recv_multipart())
    return out


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    frames = []
    while dealer.poll(5000):
        reply = dealer.recv_multipart()
        frames.append(reply)
        if len(reply) >= 2 and reply[-2] == b"\xff" * 8:
            break
    dealer.close()
    return frames


def capture(engine: str, kv: types.ModuleType, topic: str, buffer_steps: int, replays: list[int]) -> dict[str, Any]:
    ctx = zmq.Context.instance()
    ports = []
    for _ in range(2):  # plain sockets free their port on close (a ZMQ socket's I/O thread may not yet)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    pub_endpoint, replay_endpoint = (f"tcp://127.0.0.1:{p}" for p in ports)
    # "127.0.0.1" is not a bind address for the engines' heuristic: pass a wildcard to bind
    publisher = _publisher(engine, kv, f"tcp://*:{ports[0]}", f"tcp://*:{ports[1]}", topic, buffer_steps)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(pub_endpoint)
    time.sleep(0.5)  # a SUB misses what is published before it has joined
    batch_cls = kv.KVEventBatch
    rank_field = "attn_dp_rank" if engine == "sglang" else "data_parallel_rank"
    for i, events in enumerate(script(engine, kv)):
        publisher.publish(batch_cls(ts=1_764_000_000.0 + i, events=events, **{rank_field: None}))
    live = _recv_all(sub, 2000)
    exchanges = [{"start_seq": start, "replies": _replay(ctx, replay_endpoint, start)} for start in replays]
    publisher.shutdown()
    sub.close(linger=0)
    return {"engine": engine, "topic": topic, "buffer_steps": buffer_steps, "block_size": BLOCK,
            "live": live, "replays": exchanges}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-wheel", type=Path, required=True)
    parser.add_argument("--vllm-wheel", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data/engine_events")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"sglang": load_sglang(args.sglang_wheel, Path(tmp)), "vllm": load_vllm(args.vllm_wheel, Path(tmp))}
        version = {"sglang": args.sglang_wheel.name.split("-")[1], "vllm": args.vllm_wheel.name.split("-")[1]}
        for engine, kv in engines.items():
            for name, topic, steps, replays in (("default", "", 10_000, [0, 3, 7]), ("topic", "kv-events", 10_000, [2]),
                                               ("short-buffer", "", 4, [0])):
                record = capture(engine, kv, topic, steps, replays)
                record["version"] = version[engine]
                path = args.out / f"{engine}-{name}.msgpack"
                path.write_bytes(msgpack.packb(record, use_bin_type=True))
                print(f"{path}: {len(record['live'])} live, "
                      f"{[len(x['replies']) for x in record['replays']]} replay frames")


if __name__ == "__main__":
    main()
