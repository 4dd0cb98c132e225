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
