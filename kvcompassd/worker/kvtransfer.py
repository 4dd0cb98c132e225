"""Timing of a prefill-decode KV transfer (sans-IO), shared by the simulator and the emulated worker.

A disaggregated fleet computes a prompt on a prefill instance and moves the KV of the whole
prompt to a decode instance before the decode streams tokens (SGLang with Mooncake, the paper's
App. C). The move costs the KV's bytes over the link between the two:
``tokens * bytes_per_token / bandwidth``. The defaults are Llama-3.1-8B in BF16 (32 layers x 8
KV heads x 128 dims x K,V x 2 bytes = 128 KiB per token, as the worker model's reload cost) over
a 100 Gb/s RDMA NIC (12.5 GB/s; an ASSUMPTION: the paper names the transfer engine, not its
rate). The cluster config's ``[disaggregation]`` sets both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvTransferTiming:
    bytes_per_token: int = 131_072
    gb_per_s: float = 12.5

    def __post_init__(self) -> None:
        if isinstance(self.bytes_per_token, bool) or not isinstance(self.bytes_per_token, int) or self.bytes_per_token < 1:
            raise ValueError(f"bytes_per_token must be an int >= 1, got {self.bytes_per_token!r}")
        if not isinstance(self.gb_per_s, (int, float)) or not math.isfinite(self.gb_per_s) or self.gb_per_s <= 0:
            raise ValueError(f"gb_per_s must be a finite number > 0, got {self.gb_per_s!r}")

    @classmethod
    def from_config(cls, params: object) -> KvTransferTiming:
        """From the cluster config's ``DisaggregationParams``."""
        return cls(int(params.kv_bytes_per_token), float(params.kv_transfer_gb_per_s))

    def kv_bytes(self, tokens: int) -> int:
        return max(0, tokens) * self.bytes_per_token

    def transfer_ms(self, tokens: int) -> float:
        """Modelled time to move the KV of ``tokens`` prompt tokens from prefill to decode."""
        return self.kv_bytes(tokens) / (self.gb_per_s * 1e9) * 1000.0
