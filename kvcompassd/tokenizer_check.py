"""The edge's start-up check that a worker tokenises as the edge does.

SGLang (0.5.x, ``http_server.py``) serves ``POST /v1/tokenize`` (also ``/tokenize``):
``{"prompt": str}`` is encoded with the model's tokenizer (``add_special_tokens`` true unless
said otherwise) and ``{"messages": [...]}`` is rendered with the chat template exactly as for a
chat completion, then encoded without special tokens; the answer is
``{"tokens": [int, ...], "count": int, "max_model_len": int}``. The edge sends one text probe
and one multi-turn chat probe (non-ASCII, whitespace, digits, every role) and compares the ids
with its own; a worker that disagrees is refused (the edge routes nothing to it) with one log
line naming it and why. A worker marked ``emulated = true`` must also describe itself as the
emulator in ``/server_info`` (SGLang never does), so a real engine cannot pass as emulated.

A worker that cannot be reached is retried with backoff and withheld until it answers; the
edge's readiness waits for every worker's first verdict or a grace period, whichever is first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from kvcompassd.core.config import WorkerConfig
from kvcompassd.tokenizer import Tokenizer, TokenizerError

log = structlog.get_logger(__name__)

PROBE_TEXT = ("KV-cache probe: Größe, naïve café, 東京 and 🙂; tabs\tand  double spaces,\n"
              "numbers 1234567 3.14159, code `def f(x): return x**2`, URL https://example.com/a?b=c#d.")
PROBE_MESSAGES = (
    {"role": "system", "content": "You are a terse assistant. Réponds brièvement."},
    {"role": "user", "content": "What is 12 × 7? Show the steps.\n\nThanks!"},
    {"role": "assistant", "content": "12 × 7 = 84."},
    {"role": "user", "content": "And in 日本語?"},
)
TOKENIZE_PATH = "/v1/tokenize"
MAX_ANSWER_BYTES = 1 << 20  # the probes are a few hundred tokens; anything bigger is not an answer
MAX_REASON_CHARS = 300
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=15, sock_connect=5)  # per exchange; then retried


class WorkerUnreachable(Exception):
    """The worker did not answer (yet): try again later."""


class BadAnswer(ValueError):
    """The worker answered something that is not SGLang's shape: the refusal's reason."""


@dataclass(frozen=True, slots=True)
class WorkerVerdict:
    worker: str
    agrees: bool
    reason: str = ""


def compare_ids(what: str, edge: Sequence[int], worker: Sequence[int]) -> str | None:
    """Why the two tokenisations differ (first difference), or None when equal."""
    edge, worker = list(edge), list(worker)
    if edge == worker:
        return None
    at = next((i for i, (a, b) in enumerate(zip(edge, worker)) if a != b), min(len(edge), len(worker)))
    show = (lambda ids: ids[at] if at < len(ids) else "end")
    return (f"{what} tokenises differently: {len(worker)} tokens at the worker vs {len(edge)} at the edge, "
            f"first difference at token {at} (worker {show(worker)}, edge {show(edge)})")


def parse_tokenize_answer(data: Any) -> list[int]:
    """SGLang's ``TokenizeResponse`` for one prompt: ``tokens`` a list of ints, ``count`` its length."""
    if not isinstance(data, dict):
        raise BadAnswer("the answer is not a JSON object")
    tokens, count = data.get("tokens"), data.get("count")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadAnswer("'tokens' is not a list of token ids")
    if count != len(tokens):
        raise BadAnswer(f"'count' {count!r} is not the number of tokens {len(tokens)}")
    return tokens


async def _read_json(resp: aiohttp.ClientResponse) -> Any:
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise ValueError(f"the answer exceeds {MAX_ANSWER_BYTES} bytes")
    return json.loads(body)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 120 else text[:117] + "..."


async def _call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    """One JSON exchange; unreachable (connection, timeout, 502-504) raises WorkerUnreachable,
    any other failure a ValueError that becomes the refusal's reason."""
    try:
        async with session.request(method, url, json=body, timeout=PROBE_TIMEOUT) as resp:
            if resp.status in (502, 503, 504):
                raise WorkerUnreachable(f"{url} answered HTTP {resp.status}")
            if resp.status != 200:
                text = (await resp.content.read(4096)).decode("utf-8", "replace")
                raise ValueError(f"{url} answered HTTP {resp.status}: {_excerpt(text)}")
            return await _read_json(resp)
    except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
        raise WorkerUnreachable(f"{url}: {exc or type(exc).__name__}") from exc
    except (aiohttp.ClientError, UnicodeDecodeError) as exc:
        raise ValueError(f"{url}: {exc}") from exc


async def probe_worker(session: aiohttp.ClientSession, worker: WorkerConfig, tokenizer: Tokenizer) -> WorkerVerdict:
    """Ask ``worker`` to tokenise the probes and compare; raises WorkerUnreachable to retry."""
    if not worker.http:
        return WorkerVerdict(worker.id, False, "has no http address to check its tokenizer at")
    base = worker.http.rstrip("/")
    try:
        if worker.emulated:
            info = await _call(session, "GET", f"{base}/server_info")
            if not isinstance(info, dict) or not isinstance(info.get("emulator"), dict):
                return WorkerVerdict(worker.id, False, "is marked `emulated = true` but its /server_info does not "
                                                       "describe an emulated worker (a real engine?)")
        expected = (("the text probe", {"prompt": PROBE_TEXT}, tokenizer.encode(PROBE_TEXT)),
                    ("the chat probe", {"messages": list(PROBE_MESSAGES)},
                     tokenizer.apply_chat_template(list(PROBE_MESSAGES))))
        for what, body, edge_ids in expected:
            answer = await _call(session, "POST", f"{base}{TOKENIZE_PATH}", body)
            try:
                worker_ids = parse_tokenize_answer(answer)
            except ValueError as exc:
                raise ValueError(f"{TOKENIZE_PATH} answer to {what}: {exc}") from None
            reason = compare_ids(what, edge_ids, worker_ids)
            if reason is not None:
                served = await _served_tokenizer(session, base)
                return WorkerVerdict(worker.id, False, reason + served)
    except TokenizerError as exc:  # the edge's own tokenizer cannot render the probe
        return WorkerVerdict(worker.id, False, f"the edge's tokenizer cannot tokenise the probe: {exc}")
    except ValueError as exc:
        return WorkerVerdict(worker.id, False, str(exc)[:MAX_REASON_CHARS])
    return WorkerVerdict(worker.id, True)


async def _served_tokenizer(session: aiohttp.ClientSession, base: str) -> str:
    """``; it serves <tokenizer_path>`` from SGLang's ``/model_info``, for the operator (best effort)."""
    try:
        info = await _call(session, "GET", f"{base}/model_info")
    except (WorkerUnreachable, ValueError):
        return ""
    path = info.get("tokenizer_path") if isinstance(info, dict) else None
    return f"; the worker serves tokenizer {_excerpt(path)!r}" if isinstance(path, str) else ""


class TokenizerVerifier:
    """Checks ``workers`` until each has a verdict: withheld (``on_verdict(worker, None)``
    beforehand, by the caller), then released or refused through ``on_verdict``."""

    def __init__(self, workers: Sequence[WorkerConfig], tokenizer: Tokenizer, session: aiohttp.ClientSession,
                 on_verdict: Callable[[WorkerVerdict], None], *, grace_s: float = 30.0,
                 retry_s: tuple[float, float] = (0.1, 5.0),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.workers = tuple(workers)
        self.tokenizer = tokenizer
        self.session = session
        self.on_verdict = on_verdict
        self.verdicts: dict[str, WorkerVerdict] = {}
        self.settled = asyncio.Event()
        self._pending = {w.id for w in self.workers}
        self._grace_s = grace_s
        self._retry_s = retry_s
        self._sleep = sleep
        if not self._pending:
            self.settled.set()

    async def run(self) -> None:
        grace = asyncio.get_running_loop().call_later(self._grace_s, self._grace_over)
        try:
            await asyncio.gather(*(self._check(w) for w in self.workers))
        finally:
            grace.cancel()
            self.settled.set()

    def _grace_over(self) -> None:
        if self._pending:
            log.warning("tokenizer check still waiting; serving without these workers until they answer",
                        workers=sorted(self._pending))
        self.settled.set()

    async def _check(self, worker: WorkerConfig) -> None:
        delay, cap = self._retry_s
        while True:
            try:
                verdict = await probe_worker(self.session, worker, self.tokenizer)
                break
            except WorkerUnreachable as exc:
                log.debug("tokenizer check: worker not reachable yet", worker=worker.id, error=str(exc))
                await self._sleep(delay)
                delay = min(cap, delay * 2)
        self.verdicts[worker.id] = verdict
        self._pending.discard(worker.id)
        if verdict.agrees:
            log.info("worker tokenizer verified", worker=worker.id, tokenizer=self.tokenizer.name)
        else:
            log.error("worker refused: tokenizer mismatch", worker=worker.id, reason=verdict.reason)
        self.on_verdict(verdict)
        if not self._pending:
            self.settled.set()
