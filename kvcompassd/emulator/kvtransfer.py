"""The emulated workers' prefill-to-decode KV hand-over: a bootstrap rendezvous by room over TCP.

SGLang's disaggregation protocol, as its router drives it: the router sends one request to a
prefill server and the same request to a decode server, both carrying ``bootstrap_host`` and
``bootstrap_port`` (the prefill server's bootstrap server) and a random 63-bit
``bootstrap_room``. The decode instance connects to that bootstrap server and waits for the KV
of its room; the prefill instance computes the prompt and sends its KV there. The emulated
workers do the same on loopback (or any network): the prefill worker listens on its bootstrap
port (:class:`KvSender`), the decode worker dials it (:func:`receive_kv`) and registers its room;
when the prefill's first token is out the sender waits the modelled transfer time
(:class:`~kvcompassd.worker.kvtransfer.KvTransferTiming`, as the simulator charges it) and sends
what the decode needs to continue: the first token, the reused-token count, and the prompt's
digest (the decode checks it ran the same prompt). No KV bytes travel: there are none to send.

Frames: a 4-byte big-endian length, then a JSON object; at most :data:`MAX_FRAME` bytes. Every
wait is bounded (``timeout_s``), and so is the number of rooms waiting at once
(:data:`MAX_ROOMS`): a decode that never comes, a prefill that never finishes or a peer that
sends garbage ends in a :class:`TransferFailed` with a clear reason, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcompassd.engine.disaggregated import FAKE_BOOTSTRAP_HOST
from kvcompassd.worker.kvtransfer import KvTransferTiming

log = logging.getLogger(__name__)

MAX_FRAME = 64 * 1024
MAX_ROOMS = 4096  # rooms waiting at once on one prefill worker
MAX_ROOM = (1 << 63) - 1
HANDSHAKE_TIMEOUT_S = 5.0  # a connected decode names its room within this


class TransferFailed(Exception):
    """The KV hand-over did not happen; the message says why."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The bootstrap fields of a disaggregated request (SGLang's ``GenerateReqInput``)."""

    host: str
    port: int
    room: int

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Bootstrap | None:
        """The fields of a ``/generate`` body; None if it has none. Raises ValueError if they
        are incomplete or out of range."""
        host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
        if host is None and port is None and room is None:
            return None
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise ValueError(f"bootstrap_host must be a host name, got {host!r}")
        if host == FAKE_BOOTSTRAP_HOST and port is None:
            port = 0
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"bootstrap_port must be a port number, got {port!r}")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
            raise ValueError(f"bootstrap_room must be an int in [0, 2**63), got {room!r}")
        return cls(host, port, room)

    @property
    def fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST


@dataclass(frozen=True, slots=True)
class KvReceived:
    """What the decode instance got from the prefill: enough to continue the request."""

    first_token: int
    cached_tokens: int
    prompt_tokens: int
    transfer_ms: float


def prompt_digest(prompt: list[int]) -> str:
    return hashlib.blake2b(np.asarray(prompt, dtype="<u4").tobytes(), digest_size=16).hexdigest()


async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    try:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > MAX_FRAME:
            raise TransferFailed(f"peer sent a {size}-byte frame (at most {MAX_FRAME})")
        data = json.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        raise TransferFailed("peer closed the connection") from None
    except (ValueError, RecursionError) as exc:
        raise TransferFailed(f"peer sent a malformed frame: {exc}") from None
    if not isinstance(data, dict):
        raise TransferFailed("peer sent a frame that is not a JSON object")
    return data


def _frame(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":")).encode()
    return len(data).to_bytes(4, "big") + data


def _int(data: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TransferFailed(f"peer sent {name}={value!r}, expected an int in [{lo}, {hi}]")
    return value


@dataclass(slots=True)
class _Room:
    """One room on the prefill side: the decode's registration and the sender's completion."""

    registered: asyncio.Future  # -> (decode worker id, prompt digest), set by the decode's connection
    sent: asyncio.Future  # -> None once the KV went (or an exception), awaited by the connection
    decode: str = ""


class KvSender:
    """The prefill worker's bootstrap server: decode instances register rooms, the prefill hands
    each room its KV once computed (:meth:`hand_over`)."""

    def __init__(self, host: str, port: int, timing: KvTransferTiming, *, time_scale: float,
                 timeout_s: float) -> None:
        self.host, self.port = host, port
        self.timing, self.time_scale, self.timeout_s = timing, time_scale, timeout_s
        self._rooms: dict[int, _Room] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self.transfers = 0
        self.failures = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_FRAME + 4)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening; every waiting decode is told the prefill worker is stopping and every
        connection ends (not cancelled: asyncio logs a cancelled connection handler as an error)."""
        if self._server is not None:
            self._server.close()
        for room_id, room in list(self._rooms.items()):
            if not room.sent.done():
                room.sent.set_result({"room": room_id, "ok": False, "error": "the prefill worker is stopping"})
            if not room.registered.done():
                room.registered.cancel()
        for writer in self._connections.values():
            writer.close()  # a handshake still being read ends at once
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=HANDSHAKE_TIMEOUT_S)
        self._rooms.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _room(self, room: int) -> _Room:
        entry = self._rooms.get(room)
        if entry is None:
            if len(self._rooms) >= MAX_ROOMS:
                raise TransferFailed(f"too many rooms waiting ({MAX_ROOMS}) on this prefill worker")
            loop = asyncio.get_running_loop()
            entry = self._rooms[room] = _Room(loop.create_future(), loop.create_future())
        return entry

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        room_id: int | None = None
        entry: _Room | None = None
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                hello = await _read_frame(reader)
            room_id = _int(hello, "room", 0, MAX_ROOM)
            decode, digest = hello.get("decode"), hello.get("prompt_digest")
            if not isinstance(decode, str) or not 0 < len(decode) <= 128 or not isinstance(digest, str) \
                    or len(digest) > 64:
                raise TransferFailed("registration needs a decode id and a prompt digest")
            entry = self._room(room_id)
            if entry.registered.done():
                entry = None  # not ours to clean up
                raise TransferFailed(f"room {room_id} already has a decode instance")
            entry.decode = decode
            entry.registered.set_result((decode, digest))
            # The prefill side answers through entry.sent; a decode that hangs up early is noticed
            # at the write. Bounded by the sender's own timeout plus the transfer.
            try:
                async with asyncio.timeout(self.timeout_s + HANDSHAKE_TIMEOUT_S):
                    reply = await entry.sent
            except TimeoutError:
                raise TransferFailed(f"the prefill of room {room_id} did not finish within {self.timeout_s:.1f} s") from None
            except asyncio.CancelledError:
                if task.cancelling():
                    raise
                raise TransferFailed(f"the prefill of room {room_id} was abandoned") from None
            writer.write(_frame(reply))
            await writer.drain()
        except (TransferFailed, TimeoutError, ConnectionError, RuntimeError) as exc:
            reason = str(exc) or type(exc).__name__
            log.warning("bootstrap connection refused: %s", reason)
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(_frame({"room": room_id, "ok": False, "error": reason[:500]}))
                await writer.drain()
        finally:
            if entry is not None and room_id is not None and self._rooms.get(room_id) is entry:
                if not entry.sent.done():
                    entry.sent.cancel()  # the sender learns the decode went away
                del self._rooms[room_id]
            self._connections.pop(task, None)
            writer.close()

    def abandon(self, bootstrap: Bootstrap, reason: str) -> None:
        """The prefill of ``bootstrap.room`` ended without its KV (its client went away, it
        failed): a decode waiting for it hears so at once instead of at its timeout."""
        entry = self._rooms.get(bootstrap.room)
        if entry is not None and not entry.sent.done():
            entry.sent.set_result({"room": bootstrap.room, "ok": False, "error": reason[:500]})
        if entry is not None and not entry.registered.done():
            entry.registered.cancel()
            del self._rooms[bootstrap.room]

    async def hand_over(self, bootstrap: Bootstrap, prompt: list[int], first_token: int, cached_tokens: int) -> float:
        """Send the prompt's KV to the decode instance registered for ``bootstrap.room``, waiting
        for it at most ``timeout_s``; returns the modelled transfer time (ms). Raises
        :class:`TransferFailed`."""
        if bootstrap.fake:
            return 0.0
        if bootstrap.port != self.port:
            raise TransferFailed(f"request names bootstrap port {bootstrap.port}, this prefill worker's is {self.port}")
        entry = self._room(bootstrap.room)
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    decode, digest = await asyncio.shield(entry.registered)
            except TimeoutError:
                raise TransferFailed(f"no decode instance registered room {bootstrap.room} within "
                                     f"{self.timeout_s:.1f} s") from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                raise TransferFailed(f"room {bootstrap.room} was abandoned (the worker is stopping)") from None
            if digest != prompt_digest(prompt):
                entry.sent.set_result({"room": bootstrap.room, "ok": False,
                                       "error": "the decode instance runs another prompt than the prefill"})
                raise TransferFailed(f"decode {decode} registered room {bootstrap.room} for another prompt")
            transfer_ms = self.timing.transfer_ms(len(prompt))
            if self.time_scale > 0:
                await asyncio.sleep(transfer_ms / 1000.0 * self.time_scale)
            if entry.sent.done():  # cancelled: the decode hung up while the KV was on its way
                raise TransferFailed(f"decode {decode} went away during the transfer of room {bootstrap.room}")
            entry.sent.set_result({"room": bootstrap.room, "ok": True, "first_token": first_token,
                                   "cached_tokens": cached_tokens, "prompt_tokens": len(prompt),
                                   "kv_bytes": self.timing.kv_bytes(len(prompt)), "transfer_ms": transfer_ms})
            self.transfers += 1
            log.info("KV of room %d (%d tokens) sent to %s in %.2f ms (modelled)", bootstrap.room, len(prompt),
                     decode, transfer_ms)
            return transfer_ms
        except BaseException:
            self.failures += 1
            if not entry.sent.done():
                entry.sent.set_result({"room": bootstrap.room, "ok": False, "error": "the prefill failed"})
            if not entry.registered.done():
                entry.registered.cancel()
                self._rooms.pop(bootstrap.room, None)
            raise


async def receive_kv(bootstrap: Bootstrap, decode_id: str, prompt: list[int], *, timeout_s: float) -> KvReceived:
    """The decode instance's side: register ``bootstrap.room`` at the prefill's bootstrap server
    and wait (at most ``timeout_s`` in all) for the KV. Raises :class:`TransferFailed`."""
    if bootstrap.fake:
        raise TransferFailed("a decode instance cannot run a request with the fake bootstrap host")
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            try:
                reader, writer = await asyncio.open_connection(bootstrap.host, bootstrap.port, limit=MAX_FRAME + 4)
            except OSError as exc:
                raise TransferFailed(f"prefill bootstrap {bootstrap.host}:{bootstrap.port} unreachable: {exc}") from None
            writer.write(_frame({"room": bootstrap.room, "decode": decode_id, "prompt_digest": prompt_digest(prompt)}))
            await writer.drain()
            reply = await _read_frame(reader)
    except TimeoutError:
        raise TransferFailed(f"no KV for room {bootstrap.room} from {bootstrap.host}:{bootstrap.port} within "
                             f"{timeout_s:.1f} s") from None
    except ConnectionError as exc:
        raise TransferFailed(f"prefill bootstrap connection lost: {exc}") from None
    finally:
        if writer is not None:
            writer.close()
    if reply.get("room") != bootstrap.room:
        raise TransferFailed(f"prefill answered room {reply.get('room')!r}, not {bootstrap.room}")
    if reply.get("ok") is not True:
        raise TransferFailed(f"prefill refused room {bootstrap.room}: {str(reply.get('error'))[:500]}")
    prompt_tokens = _int(reply, "prompt_tokens", 0, 1 << 31)
    if prompt_tokens != len(prompt):
        raise TransferFailed(f"prefill sent the KV of {prompt_tokens} tokens, the prompt has {len(prompt)}")
    transfer_ms = reply.get("transfer_ms")
    return KvReceived(first_token=_int(reply, "first_token", 0, (1 << 32) - 1),
                      cached_tokens=_int(reply, "cached_tokens", 0, prompt_tokens),
                      prompt_tokens=prompt_tokens,
                      transfer_ms=float(transfer_ms) if isinstance(transfer_ms, (int, float)) else 0.0)
