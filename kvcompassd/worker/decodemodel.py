"""The decode side of prefill-decode disaggregation (paper App. C), sans-IO: the KV hand-over's
time and a decode worker's queue.

Shared by the simulator (``kvcompassd.sim.disaggregated``) and meant for the emulated decode
worker, as ``WorkerQueueModel`` is for a mixed or prefill worker; its step cost is
``WorkerTiming.decode_step_ms``, the same continuous-batching model.

A decode worker receives a request whose prompt KV a prefill worker computed and handed over
(SGLang's PD mode with Mooncake transfer). It prefills nothing. Its scheduler runs decode steps
back to back while it has requests; a request whose KV arrived joins the batch at the next step
boundary (or starts a step at once on an idle worker, or joins a step starting that very
instant) if one of ``max_running`` slots is free, else it waits FIFO. Its first token is streamed when the first step it takes part in ends: the
prefill's sampled token goes out with the first decode iteration, as SGLang's decode scheduler
emits it. It then takes ``max(1, output_tokens - 1)`` steps in all (the prefill produced the
first token; the colocated model charges the same ``output_tokens - 1`` decode steps).
"""

from __future__ import annotations

from collections import deque

from .kvtransfer import KvTransferTiming
from .workermodel import FirstTokenProduced, RequestFinished, WorkerEvent, WorkerModelError, WorkerTiming

# KV bytes per token of Llama-3.1-8B in BF16: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes.
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


def kv_transfer_ms(tokens: int, gbps: float, *, bytes_per_token: int = KV_BYTES_PER_TOKEN) -> float:
    """Milliseconds to move ``tokens`` tokens of KV over a ``gbps`` Gbit/s link (size / bandwidth)."""
    if tokens < 0:
        raise WorkerModelError(f"tokens must be >= 0, got {tokens}")
    try:
        return KvTransferTiming(bytes_per_token, gbps).transfer_ms(tokens)  # the emulator's formula too
    except ValueError as exc:
        raise WorkerModelError(str(exc)) from None


def decode_steps(output_tokens: int) -> int:
    """Decode steps a handed-over request takes on its decode worker."""
    return max(1, output_tokens - 1)


class DecodeQueueModel:
    """One decode worker's queue; times are seconds on the caller's clock. Same interface as
    ``WorkerQueueModel`` where it applies: ``admit``, ``advance``, ``next_event_time``,
    ``running``, ``waiting``; events ``FirstTokenProduced`` (first token streamed) and
    ``RequestFinished``."""

    def __init__(self, timing: WorkerTiming | None = None, *, start: float = 0.0) -> None:
        self.timing = timing or WorkerTiming()
        self._now = start
        self._waiting: deque[tuple[str, int]] = deque()  # (request id, steps), KV here, no slot yet
        self._batch: dict[str, list] = {}  # request id -> [steps left, first token streamed?]
        self._step_ends: float | None = None  # None: no step running (idle)
        self._step_started = start
        self._outbox: list[WorkerEvent] = []
        self._ids: set[str] = set()
        self.completed = 0
        self.steps = 0

    # ------------------------------------------------------------------------------ inputs

    def admit(self, request_id: str, output_tokens: int, *, now: float) -> None:
        """The request's KV arrived at ``now``."""
        if request_id in self._ids:
            raise WorkerModelError(f"request {request_id!r} is already in the model")
        if not isinstance(output_tokens, int) or output_tokens < 1:
            raise WorkerModelError(f"output_tokens must be an int >= 1, got {output_tokens!r}")
        self._run_until(now)
        self._ids.add(request_id)
        self._waiting.append((request_id, decode_steps(output_tokens)))
        if self._step_ends is not None and self._step_started == self._now and len(self._waiting) == 1:
            self._start_step()  # a step starting this very instant takes it too (same instant, same batch)
        self._run_until(now)  # an idle worker starts a step at once

    def advance(self, *, now: float) -> list[WorkerEvent]:
        """Run the model up to ``now``; return the events that happened, in time order."""
        self._run_until(now)
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------------------------ queries

    @property
    def now(self) -> float:
        return self._now

    @property
    def running(self) -> int:
        """Requests in the decode batch."""
        return len(self._batch)

    @property
    def waiting(self) -> int:
        """Requests whose KV arrived, waiting for a slot."""
        return len(self._waiting)

    def next_event_time(self) -> float | None:
        """When the next state change is due (the end of the running step), ``now`` while
        events await :meth:`advance`, None when idle."""
        if self._outbox:
            return self._now
        return self._step_ends

    # ------------------------------------------------------------------------------ engine

    def _run_until(self, t: float) -> None:
        if t < self._now - 1e-9:
            raise WorkerModelError(f"time went backwards: {t} < {self._now}")
        t = max(t, self._now)
        while True:
            if self._step_ends is None:
                if self._waiting:
                    self._start_step()
                    continue
                self._now = t
                return
            if self._step_ends > t:
                self._now = t
                return
            self._now = self._step_ends
            self._end_step()

    def _start_step(self) -> None:
        """Start a step now (or restart one that starts now) with the waiting requests that fit."""
        slots = self.timing.max_running
        while self._waiting and len(self._batch) < slots:
            request_id, steps = self._waiting.popleft()
            self._batch[request_id] = [steps, False]
        self._step_started = self._now
        self._step_ends = self._now + self.timing.decode_step_ms(len(self._batch)) / 1000.0

    def _end_step(self) -> None:
        self.steps += 1
        done = []
        for request_id, state in self._batch.items():
            state[0] -= 1
            if not state[1]:
                state[1] = True
                self._outbox.append(FirstTokenProduced(request_id, self._now))
            if state[0] <= 0:
                done.append(request_id)
        for request_id in done:  # in the order they joined (dicts keep insertion order)
            del self._batch[request_id]
            self._ids.discard(request_id)
            self.completed += 1
            self._outbox.append(RequestFinished(request_id, self._now))
        self._step_ends = None
        if self._batch or self._waiting:
            self._start_step()
