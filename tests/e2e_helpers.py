"""Shared helpers of the tests that run real deployments (test_e2e, test_faults)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from kvcompassd.ctl import query


def doc(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(n))


async def generate(dep, region: str, text: str, max_new_tokens: int = 4) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(dep.edge_url(region) + "/generate",
                          json={"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


MAX_FRONT_DOOR_CONNECTIONS = 64  # SO_REUSEPORT hashes each new connection: P(all on one of 2) = 2^-63


async def session_per_process(dep, region: str, processes: int = 2) -> dict[int, aiohttp.ClientSession]:
    """One keep-alive connection to each process of ``region``'s ``edge --workers N``: {front
    door pid, or 0 for the edge process: session}. A connection stays on the process that
    accepted it, so a session speaks to one process. Close the sessions when done."""
    found: dict[int, aiohttp.ClientSession] = {}
    for _ in range(MAX_FRONT_DOOR_CONNECTIONS):
        s = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with s.get(dep.edge_url(region) + "/health") as r:
            body = await r.json()
        key = body.get("front_door", 0)
        if key in found or not body["ready"]:
            await s.close()
        else:
            found[key] = s
        if len(found) == processes:
            break
    assert len(found) == processes, f"connections reached only {sorted(found)}"
    return found


async def admin(dep, node: str, what: str, args: dict | None = None) -> dict:
    return await query(dep.cfg, dep.tls_dir, "admin", node, what, args or {})


class NotYet:
    """A falsy check result that says what was seen instead (``eventually`` shows the last)."""

    def __init__(self, detail: str):
        self.detail = detail

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return self.detail


async def eventually(check, timeout: float = 30.0, interval: float = 0.1):
    """Wait until ``check()`` is truthy. A check that cannot reach a daemon (a restarted one still
    starting, a busy machine's slow handshake) is "not yet", not a failure: the last such error
    is shown if the condition is never met."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await check()
        except (ConnectionError, TimeoutError) as exc:  # TransportError and HandshakeFailed among them
            result = NotYet(f"{type(exc).__name__}: {exc}")
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition {getattr(check, '__qualname__', check)!r} not met within {timeout} s "
                                 f"(last result {result!r})")
        await asyncio.sleep(interval)


async def lists_worker(fetch, worker):
    return any(h["worker"] == worker for h in await fetch())


async def assert_views_converged(dep, edges=None, timeout: float = 15.0):
    await eventually(lambda: dep.views_converged(edges), timeout=timeout, interval=0.3)
