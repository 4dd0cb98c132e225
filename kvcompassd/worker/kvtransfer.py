"""Timing of a prefill-decode KV transfer (sans-IO), shared by the simulator and the emulated worker.

A disaggregated fleet computes a prompt on a prefill instance and moves the KV of the whole
prompt to a decode instance before the decode streams tokens (SGLang with Mooncake, the paper's
App. C). The move costs the KV's bytes over the link between the two:
``tokens * bytes_per_token * 8 / (gbps * 1e9)`` seconds. The defaults are Llama-3.1-8B in BF16
(32 layers x 8 KV heads x 128 dims x K,V x 2 bytes = 128 KiB per token, as the worker model's
reload cost) over a 100 Gbit/s RDMA NIC (an ASSUMPTION: the paper names the transfer engine,
not its rate). The config sets them: ``[disaggregation] kv_bytes_per_token`` for the model and
each prefill worker's ``kv_transfer_gbps`` for its link (:meth:`KvTransferTiming.for_worker`).
The simulator (``kvcompassd.sim.disaggregated``, through ``worker.decodemodel.kv_transfer_ms``),
the emulated prefill worker and the edge's first-token deadline all use this one formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KvTransferTiming:
    bytes_per_token: int = 131_072
    gbps: float = 100.0  # the prefill worker's link, Gbit/s

    def __post_init__(self) -> None:
        if isinstance(self.bytes_per_token, bool) or not isinstance(self.bytes_per_token, int) or self.bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be an int >= 1, got {self.bytes_per_token!r}")
        if (isinstance(self.gbps, bool) or not isinstance(self.gbps, (int, float)) or not math.isfinite(self.gbps)
                or self.gbps <= 0):
            raise ValueError(f"gbps must be a finite number > 0, got {self.gbps!r}")

    @classmethod
    def for_worker(cls, cfg: Any, worker: Any) -> KvTransferTiming:
        """A prefill worker's hand-overs: the model's KV size (``[disaggregation]``) over its link."""
        return cls(int(cfg.disaggregation.kv_bytes_per_token), float(worker.kv_transfer_gbps))

    def kv_bytes(self, tokens: int) -> int:
        return max(0, tokens) * self.bytes_per_token

    def transfer_ms(self, tokens: int) -> float:
        """Modelled time to move the KV of ``tokens`` prompt tokens from prefill to decode."""
        return self.kv_bytes(tokens) * 8 / (self.gbps * 1e9) * 1000.0
