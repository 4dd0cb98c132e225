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

The edge asks its own region's workers over HTTP (the path its requests take) and other
regions' workers through their agents (TokenizationRequested: the agent asks its engine the same
way and answers with the ids). A worker that cannot be reached is retried with backoff and
withheld until it answers; the edge's readiness waits for every worker's first verdict or a
grace period, whichever is first.
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
from kvcompassd.transport import Peer, TransportError
from kvcompassd.wire import ErrorReported, TokenizationAnswered, TokenizationRequested

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

    def show(ids: list[int]) -> int | str:
        return ids[at] if at < len(ids) else "end"

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
        raise WorkerUnreachable(f"{url}: {str(exc) or type(exc).__name__}") from exc
    except (aiohttp.ClientError, UnicodeDecodeError) as exc:
        raise ValueError(f"{url}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class EngineTokenization:
    """What a worker's engine said about the probes."""

    text_ids: tuple[int, ...]
    chat_ids: tuple[int, ...]
    emulator: bool  # its /server_info describes the emulated worker (SGLang's never does)
    tokenizer_path: str  # from /model_info, for the operator ("" if unknown)


async def ask_engine(session: aiohttp.ClientSession, base_url: str, text: str,
                     messages: Sequence[dict]) -> EngineTokenization:
    """The engine's ids for ``text`` and ``messages`` (SGLang's ``/v1/tokenize``). Raises
    WorkerUnreachable (try again) or BadAnswer/ValueError (its reason refuses the worker).
    Used by the edge for its own region's workers and by each agent for its engine."""
    base = base_url.rstrip("/")
    try:
        info = await _call(session, "GET", f"{base}/server_info")
    except ValueError:
        info = None  # then it is not the emulator, which always serves it
    emulator = isinstance(info, dict) and isinstance(info.get("emulator"), dict)
    ids = []
    for what, body in (("the text probe", {"prompt": text}), ("the chat probe", {"messages": list(messages)})):
        answer = await _call(session, "POST", f"{base}{TOKENIZE_PATH}", body)
        try:
            ids.append(tuple(parse_tokenize_answer(answer)))
        except BadAnswer as exc:
            raise BadAnswer(f"{TOKENIZE_PATH} answer to {what}: {exc}") from None
    try:
        model = await _call(session, "GET", f"{base}/model_info")
    except (WorkerUnreachable, ValueError):
        model = None  # only a hint for the operator
    path = model.get("tokenizer_path") if isinstance(model, dict) else None
    return EngineTokenization(ids[0], ids[1], emulator, _excerpt(path) if isinstance(path, str) else "")


def judge(worker: WorkerConfig, tokenizer: Tokenizer, answer: EngineTokenization) -> WorkerVerdict:
    """Compare the engine's ids with this edge's; a worker marked emulated must say it is."""
    if worker.emulated and not answer.emulator:
        return WorkerVerdict(worker.id, False, "is marked `emulated = true` but its /server_info does not "
                                               "describe an emulated worker (a real engine?)")
    try:
        expected = (("the text probe", tokenizer.encode(PROBE_TEXT), answer.text_ids),
                    ("the chat probe", tokenizer.apply_chat_template(list(PROBE_MESSAGES)), answer.chat_ids))
    except TokenizerError as exc:  # the edge's own tokenizer cannot render the probe
        return WorkerVerdict(worker.id, False, f"the edge's tokenizer cannot tokenise the probe: {exc}")
    for what, edge_ids, worker_ids in expected:
        reason = compare_ids(what, edge_ids, worker_ids)
        if reason is not None:
            served = f"; the worker serves tokenizer {answer.tokenizer_path!r}" if answer.tokenizer_path else ""
            return WorkerVerdict(worker.id, False, reason + served)
    return WorkerVerdict(worker.id, True)


async def probe_worker(session: aiohttp.ClientSession, worker: WorkerConfig, tokenizer: Tokenizer) -> WorkerVerdict:
    """Ask ``worker``'s engine over HTTP to tokenise the probes and compare; raises
    WorkerUnreachable to retry."""
    if not worker.http:
        return WorkerVerdict(worker.id, False, "has no http address to check its tokenizer at")
    try:
        answer = await ask_engine(session, worker.http, PROBE_TEXT, PROBE_MESSAGES)
    except ValueError as exc:
        return WorkerVerdict(worker.id, False, str(exc)[:MAX_REASON_CHARS])
    return judge(worker, tokenizer, answer)


async def probe_via_agent(peer: Peer, edge_id: str, worker: WorkerConfig, tokenizer: Tokenizer) -> WorkerVerdict:
    """The same check for a worker this edge reaches through its agent (another region's): the
    agent asks its engine (TokenizationRequested/Answered). Raises WorkerUnreachable to retry."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT.total):
            await peer.wait_connected()
            async with peer.open_stream() as exchange:
                await exchange.send(TokenizationRequested(edge_id, PROBE_TEXT, {"messages": list(PROBE_MESSAGES)}))
                reply = await anext(aiter(exchange), None)  # the agent answers with one message
    except (TimeoutError, TransportError) as exc:
        raise WorkerUnreachable(f"agent {worker.id}: {str(exc) or type(exc).__name__}") from exc
    if isinstance(reply, ErrorReported):
        return WorkerVerdict(worker.id, False, f"its agent refused the probe: {reply.detail}"[:MAX_REASON_CHARS])
    if not isinstance(reply, TokenizationAnswered) or reply.worker != worker.id:
        raise WorkerUnreachable(f"agent {worker.id} sent no tokenization answer")
    if reply.unreachable:
        raise WorkerUnreachable(f"agent {worker.id}: {reply.error}")
    if reply.error:
        return WorkerVerdict(worker.id, False, reply.error[:MAX_REASON_CHARS])
    return judge(worker, tokenizer, EngineTokenization(reply.text_ids, reply.chat_ids, reply.emulator,
                                                       reply.tokenizer_path))


async def answer_for_agent(session: aiohttp.ClientSession, worker: WorkerConfig,
                           msg: TokenizationRequested) -> TokenizationAnswered:
    """An agent's answer to TokenizationRequested: its engine's ids, or why there are none."""
    messages = msg.chat.get("messages")
    try:
        if not worker.http:
            raise ValueError("the worker has no http address")
        if not isinstance(messages, list):
            raise BadAnswer("the probe's chat has no 'messages' list")
        a = await ask_engine(session, worker.http, msg.text, messages)
        return TokenizationAnswered(worker.id, a.text_ids, a.chat_ids, a.emulator, a.tokenizer_path, "", False)
    except WorkerUnreachable as exc:
        return TokenizationAnswered(worker.id, (), (), False, "", str(exc)[:MAX_REASON_CHARS], True)
    except ValueError as exc:  # includes ids beyond the message's bound
        return TokenizationAnswered(worker.id, (), (), False, "", str(exc)[:MAX_REASON_CHARS] or "bad answer", False)


class TokenizerVerifier:
    """Checks ``workers`` with ``probe`` until each has a verdict (the caller withholds them
    beforehand), reported through ``on_verdict``; ``settled`` once all have one or after the
    grace period."""

    def __init__(self, workers: Sequence[WorkerConfig], probe: Callable[[WorkerConfig], Awaitable[WorkerVerdict]],
                 on_verdict: Callable[[WorkerVerdict], None], *, tokenizer_name: str = "", grace_s: float = 30.0,
                 retry_s: tuple[float, float] = (0.1, 5.0),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.workers = tuple(workers)
        self.probe = probe
        self.tokenizer_name = tokenizer_name
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
                verdict = await self.probe(worker)
                break
            except WorkerUnreachable as exc:
                log.debug("tokenizer check: worker not reachable yet", worker=worker.id, error=str(exc))
            except Exception:  # a bug must not leave the worker unchecked for good
                log.exception("tokenizer check failed unexpectedly; retrying", worker=worker.id)
            await self._sleep(delay)
            delay = min(cap, delay * 2)
        self.verdicts[worker.id] = verdict
        self._pending.discard(worker.id)
        if verdict.agrees:
            log.info("worker tokenizer verified", worker=worker.id, tokenizer=self.tokenizer_name)
        else:
            log.error("worker refused: its tokenizer check failed", worker=worker.id, reason=verdict.reason)
        self.on_verdict(verdict)
        if not self._pending:
            self.settled.set()
