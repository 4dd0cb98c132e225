"""The engines' own KV-event bytes, committed under ``tests/data/engine_events`` (see its README).

A missing capture raises (FileNotFoundError): tests that need them fail, never skip.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import msgpack

CAPTURES = Path(__file__).resolve().parent / "data" / "engine_events"
ENGINES = ("sglang", "vllm")

# the capture script's hashes (tools/capture_engine_events.py)
HASH_A = -8211977001010843013
HASH_B = 4_242_424_242_424_242
HASH_C = {"sglang": 5_555_555_555, "vllm": 17_000_000_000_000_000_001 - (1 << 64)}
HASH_D, HASH_E, HASH_F, HASH_G = 1_111, 2_222, 3_333, 4_444


@cache
def load_capture(engine: str, name: str = "default") -> dict[str, Any]:
    """``live``: list of frame lists; ``replays``: [{"start_seq", "replies": [frames...]}]."""
    record = msgpack.unpackb((CAPTURES / f"{engine}-{name}.msgpack").read_bytes(), raw=False)
    assert record["engine"] == engine and record["live"], f"capture {engine}-{name} is empty"
    return record


def tokens(start_block: int, blocks: int = 1, size: int = 16) -> tuple[int, ...]:
    return tuple(range(100 + start_block * 16, 100 + start_block * 16 + blocks * size))


class RecordedEngine:
    """Plays a capture's bytes back as its engine did: a real PUB socket for live batches and a
    real ROUTER answering replay requests from a buffer of the last ``buffer_steps`` batches,
    with the captured frames (``[b"", topic, seq, payload]``, then the captured end marker).

    ``publish(i)`` sends captured batch ``i`` (buffered first, as the engines do before they
    serve any replay); ``withhold=True`` buffers it without sending it live, which is what a
    dropped PUB message looks like to a subscriber. ``send_raw`` puts any frames on the PUB."""

    def __init__(self, record: dict[str, Any], ctx: Any, *, buffer_steps: int | None = None,
                 endpoints: tuple[str, str] = ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")) -> None:
        import collections

        import zmq

        self.record = record
        self.live: list[list[bytes]] = record["live"]
        self.end_marker: list[bytes] = record["replays"][0]["replies"][-1]
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps or record["buffer_steps"])
        self._pub = ctx.socket(zmq.PUB)
        self._router = ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self._endpoints = endpoints
        self.endpoint = self.replay_endpoint = ""
        self.topic = record["topic"]
        self.replay_requests = 0
        self._task: Any = None

    async def start(self) -> None:
        """Bind (retrying while a just-closed socket's port is still being released by ZMQ's
        I/O thread: a restarted engine on the same endpoints), then serve replays."""
        import asyncio

        from kvcompassd.emulator.publisher import _bind

        self.endpoint = await _bind(self._pub, self._endpoints[0], 10.0)
        self.replay_endpoint = await _bind(self._router, self._endpoints[1], 10.0)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self._router.recv_multipart()
            self.replay_requests += 1
            start_seq = int.from_bytes(start, "big")  # the engines read it unsigned
            for seq, frames in list(self._buffer):
                if seq >= start_seq:
                    await self._router.send_multipart([identity, b"", *frames])
            await self._router.send_multipart([identity, *self.end_marker])

    async def publish(self, i: int, *, withhold: bool = False) -> None:
        frames = self.live[i]
        self._buffer.append((int.from_bytes(frames[1], "big"), frames))
        if not withhold:
            await self._pub.send_multipart(frames)

    async def send_raw(self, frames: list[bytes], *, buffered: bool = False) -> None:
        """``buffered``: the engine's own thread sent it, so its replay buffer holds it too."""
        if buffered:
            self._buffer.append((int.from_bytes(frames[1], "big"), frames))
        await self._pub.send_multipart(frames)

    async def close(self) -> None:
        import asyncio

        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sock, endpoint in ((self._pub, self.endpoint), (self._router, self.replay_endpoint)):
            sock.unbind(endpoint)
            sock.close(linger=0)
