"""Record what SGLang's own ``/v1/loads`` handler answers, for the agent's load-report tests.

Loads ``load_snapshot.py`` (the per-rank ``LoadSnapshot`` and its ``to_dict``) and
``v1_loads.py`` (the handler that builds the JSON body) straight out of SGLang's wheel; the
modules they import for other work (device names, the parallel layout, shared memory, zmq) are
replaced by the few names they use. The handler is called with a tokenizer manager that returns
the snapshots below, as SGLang's scheduler publishes them, and its answer is written as the JSON
bytes FastAPI would send (``fastapi.encoders.jsonable_encoder`` then ``json.dumps``):

- ``sglang-two-ranks.json``: two data-parallel ranks under load (rank 0 holds 60,000 of its
  100,000 KV tokens for 3 running requests, rank 1 20,000 for 1, with 2 waiting).
- ``sglang-idle.json``: one idle rank (nothing held).
- ``sglang-memory-bound.json``: one rank whose 30 running requests hold 90,000 of its 100,000
  KV tokens, 3 prompts (12,000 tokens) waiting for room.

    python -m venv /tmp/capvenv && /tmp/capvenv/bin/pip install msgspec fastapi
    pip download --no-deps -d /tmp/wheels sglang==0.5.23
    /tmp/capvenv/bin/python tools/capture_engine_loads.py --sglang-wheel /tmp/wheels/sglang-0.5.23-*.whl
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheel_modules import load_from_wheel, sglang_capture_args, stub_module, wheel_version  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "engine_loads"


def load_sglang(wheel: Path, tmp: Path) -> tuple[types.ModuleType, types.ModuleType, str]:
    for package in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.managers", "sglang.srt.entrypoints"):
        stub_module(package, __path__=[])
    version = wheel_version(wheel)
    parallel = types.SimpleNamespace(tp_size=1, pp_size=1, attn_dp_enabled=False, num_dp_ranks=1)
    stub_module("sglang.version", __version__=version)
    stub_module("sglang.srt.environ", envs=types.SimpleNamespace())
    stub_module("sglang.srt.runtime_context", get_parallel=lambda: parallel, get_serving=lambda: None)
    stub_module("sglang.srt.utils", __path__=[], get_device_name=lambda: None)
    stub_module("sglang.srt.utils.network", is_zmq_endpoint_ipv6=lambda *a: False, restrict_zmq_peers=lambda *a: None,
            zmq_connect=lambda *a, **k: None)
    snapshots = load_from_wheel(wheel, "sglang/srt/managers/load_snapshot.py", "sglang.srt.managers.load_snapshot", tmp)
    handler = load_from_wheel(wheel, "sglang/srt/entrypoints/v1_loads.py", "sglang.srt.entrypoints.v1_loads", tmp)
    return snapshots, handler, version


def capture(snapshots: types.ModuleType, handler: types.ModuleType, loads: list[Any]) -> bytes:
    from fastapi.encoders import jsonable_encoder

    class TokenizerManager:  # what the handler asks of it: the scheduler's published snapshots
        async def get_loads(self, include=None, dp_rank=None):
            return loads

    body = asyncio.run(handler.get_loads(dp_rank=None, include=None, format=None,
                                         tokenizer_manager=TokenizerManager()))
    return json.dumps(jsonable_encoder(body), indent=1).encode() + b"\n"


def main() -> None:
    args = sglang_capture_args(__doc__, OUT)
    with tempfile.TemporaryDirectory() as tmp:
        snapshots, handler, version = load_sglang(args.sglang_wheel, Path(tmp))
        S = snapshots.LoadSnapshot
        cases = {
            "sglang-two-ranks.json": [
                S(timestamp=1.0, dp_rank=0, num_running_reqs=3, num_waiting_reqs=0, num_used_tokens=60_000,
                  num_total_tokens=60_000, num_active_tokens=60_000, max_total_num_tokens=100_000,
                  max_running_requests=64, token_usage=0.6, utilization=3 / 64),
                S(timestamp=1.0, dp_rank=1, num_running_reqs=1, num_waiting_reqs=2, num_waiting_uncached_tokens=9_000,
                  num_used_tokens=20_000, num_total_tokens=29_000, num_active_tokens=29_000,
                  max_total_num_tokens=100_000, max_running_requests=64, token_usage=0.2, utilization=1 / 64)],
            "sglang-idle.json": [S(timestamp=1.0, dp_rank=0, max_total_num_tokens=100_000, max_running_requests=64)],
            # the running requests hold 90 % of the pool; the 3 waiting prompts do not fit
            "sglang-memory-bound.json": [
                S(timestamp=1.0, dp_rank=0, num_running_reqs=30, num_waiting_reqs=3, num_waiting_uncached_tokens=12_000,
                  num_used_tokens=90_000, num_total_tokens=102_000, num_active_tokens=102_000,
                  max_total_num_tokens=100_000, max_running_requests=64, token_usage=0.9, utilization=30 / 64)],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        for name, loads in cases.items():
            (args.out / name).write_bytes(capture(snapshots, handler, loads))
            print(f"wrote {args.out / name} (SGLang {version})")


if __name__ == "__main__":
    main()
