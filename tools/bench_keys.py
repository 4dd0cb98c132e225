"""Benchmark prefix-key hashing against one SHA-256 pass over the same prompt.

    .venv/bin/python tools/bench_keys.py [--tokens 4096] [--repeat 2000]

Prints medians (µs) of: one SHA-256 over the prompt's uint32 bytes with hashlib (the reference),
and ``prefix_keys`` at the testbed's registration lengths that fit the prompt (about 18 for a
4096-token prompt with the default levels): the C hash on its automatic backend (SHA-NI where the
CPU has it) for uint32-array, int64-array and list inputs, forced onto the portable C backend,
and ``prefix_keys_reference`` (hashlib, one update/copy/digest per length).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcompassd.core.config import load_config  # noqa: E402
from kvcompassd.core.keys import namespace_salt, prefix_keys, prefix_keys_reference, sha256_backend  # noqa: E402
from kvcompassd.core.levels import LevelPlan  # noqa: E402


def median_us(fn, repeat: int) -> float:
    for _ in range(min(200, repeat)):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml"))
    args = parser.parse_args()

    cfg = load_config(args.config)
    plan = LevelPlan.from_config(cfg)
    salt = namespace_salt(cfg.model, cfg.tenant)
    rng = np.random.default_rng(0)
    tokens_i64 = rng.integers(0, 128_256, size=args.tokens)
    tokens_u32 = tokens_i64.astype("<u4")
    tokens_list = tokens_i64.tolist()
    data = tokens_u32.tobytes()

    # The testbed's registration lengths give 12 below 4096; pad with block multiples up to the
    # prompt so the count matches an edge that queries ~18 lengths (6 per region x 3 regions).
    lengths = list(plan.registration_lengths_upto(args.tokens))
    step = max(cfg.index.block_size, args.tokens // 32 // cfg.index.block_size * cfg.index.block_size)
    candidate = step
    while len(lengths) < 18 and candidate <= args.tokens:
        if candidate not in lengths:
            lengths.append(candidate)
        candidate += step
    lengths = sorted(lengths)

    sha = median_us(lambda: hashlib.sha256(salt + data).digest(), args.repeat)
    rows = [
        ("one SHA-256 over the prompt (reference)", sha),
        (f"prefix_keys ({sha256_backend()}), {len(lengths)} lengths, uint32 array",
         median_us(lambda: prefix_keys(tokens_u32, lengths, salt), args.repeat)),
        (f"prefix_keys ({sha256_backend()}), {len(lengths)} lengths, int64 array",
         median_us(lambda: prefix_keys(tokens_i64, lengths, salt), args.repeat)),
        (f"prefix_keys ({sha256_backend()}), {len(lengths)} lengths, Python list",
         median_us(lambda: prefix_keys(tokens_list, lengths, salt), args.repeat)),
        (f"prefix_keys (portable C), {len(lengths)} lengths, uint32 array",
         median_us(lambda: prefix_keys(tokens_u32, lengths, salt, backend="portable"), args.repeat)),
        (f"prefix_keys_reference (hashlib), {len(lengths)} lengths, uint32",
         median_us(lambda: prefix_keys_reference(tokens_u32, lengths, salt), args.repeat)),
    ]
    print(f"prompt: {args.tokens} tokens; lengths: {lengths}")
    print(f"{'case':<58} {'median µs':>10} {'x SHA':>7}")
    for name, us in rows:
        print(f"{name:<58} {us:>10.2f} {us / sha:>7.2f}")


if __name__ == "__main__":
    main()
