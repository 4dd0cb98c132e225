"""What the long indexed lengths cost (issue 28): lengths, index entries and registration work per
stored prompt, and the credit a holder gets, before (the paper's reach) and after (to the
model's context).

    python tools/bench_levels.py [--configs testbed-3continent,census-64x8] [--repeat 200]
        [--tokens 4096,16384,32768,65536,100000,131072]

Per deployment config, three plans:
- ``before``: the plan as it was, the paper's lengths only (``context_tokens`` below them);
- ``after``: the config as shipped (``[index] context_tokens`` 131072, ``long_growth``);
- ``paper@ctx``: the paper's rule continued to the context (remote steps of n1/2 and own-region
  doublings until both reach it); counted, not built (on the census it is thousands of lengths).

Per prompt length, for before and after (and the paper rule's count):
- ``keys``: lengths registered for one stored prompt of that length = index entries it adds
  (one Ludo entry per key and region group) = prefix keys its worker hashes and reports;
- ``credit own`` / ``credit far``: the share of a whole-prompt match an edge credits a holder
  in its own region, and in the farthest region from it (the longest length read <= the match);
- ``register µs``: median wall time of one registration on the index side, measured here:
  the prefix keys at those lengths (``prefix_keys``, C SHA-256), the shard's edit of them
  (``IndexEventColumns`` + ``MaintenanceShard.apply_columns`` into a fresh shard's tables) and
  its update batch (``flush`` + ``wire.encode``); ``batch B`` is that batch's encoded size.
  Its reference, measured in the same rounds: one SHA-256 over the prompt's bytes (``x SHA``).

The decision cost is tools/bench_forward.py's (``--context-tokens`` gives the before case).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcompassd import wire  # noqa: E402
from kvcompassd.core.config import ClusterConfig, load_config  # noqa: E402
from kvcompassd.core.events import IndexEventColumns, PrefixCached, Tier  # noqa: E402
from kvcompassd.core.index import MaintenanceShard  # noqa: E402
from kvcompassd.core.keys import namespace_salt, prefix_keys  # noqa: E402
from kvcompassd.core.layout import IndexLayout  # noqa: E402
from kvcompassd.core.levels import LevelPlan, remote_lengths  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def paper_reach(cfg: ClusterConfig) -> ClusterConfig:
    """The plan as it was before the long lengths: a context shorter than every length adds none."""
    return dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, context_tokens=cfg.index.block_size))


def paper_rule_lengths(cfg: ClusterConfig, context: int) -> tuple[int, ...]:
    """The registered union if the paper's rule went on to ``context``: each remote pair's
    steps of n1/2 and the own-region doublings, until each reaches the context."""
    index, union = cfg.index, set()
    for origin in cfg.region_names():
        for target in cfg.region_names():
            workers = cfg.workers_in(target)
            if origin == target or not workers:
                continue
            beta = max(w.prefill_ms_per_token for w in workers)
            n1 = remote_lengths(cfg.rtt_ms(origin, target), beta, index.block_size, 1)[0]
            levels = max(index.levels, math.ceil(2 * context / n1) - 1)  # (1 + k/2) n1 >= context
            union.update(c for c in remote_lengths(cfg.rtt_ms(origin, target), beta, index.block_size, levels)
                         if c <= context)
    own = index.same_region_min_tokens
    while own <= context:
        union.add(own)
        own *= 2
    return tuple(sorted(union))


def credit(lengths: tuple[int, ...], n: int) -> float:
    fitting = [c for c in lengths if c <= n]
    return fitting[-1] / n if fitting else 0.0


class Registration:
    """One stored prompt's registration on the index side, on a fresh shard each time."""

    def __init__(self, cfg: ClusterConfig, prompt: np.ndarray, lengths: tuple[int, ...]) -> None:
        self.layout = IndexLayout.from_config(cfg)
        self.worker = cfg.workers[0].id
        self.prompt, self.lengths = prompt, np.asarray(lengths, dtype=np.int64)
        self.salt = namespace_salt(cfg.model, cfg.tenant)
        self.shard_args = dict(epoch=1, initial_capacity=4096, fingerprint_bits=cfg.index.fingerprint_bits)
        self.batch_bytes = 0

    def run(self, shard: MaintenanceShard) -> None:
        keys = prefix_keys(self.prompt, self.lengths, self.salt)
        columns = IndexEventColumns.from_events(PrefixCached(self.worker, int(k), Tier.VRAM) for k in keys.tolist())
        shard.apply_columns(self.worker, columns)
        batch = shard.flush()
        self.batch_bytes = len(wire.encode(batch)) if batch is not None else 0

    def fresh_shard(self) -> MaintenanceShard:
        return MaintenanceShard(self.layout, 0, 1, **self.shard_args)


def timed_us(registration: Registration, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        shard = registration.fresh_shard()  # made outside the timing: its allocation is not per prompt
        t0 = time.perf_counter_ns()
        registration.run(shard)
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def sha_us(data: bytes, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        hashlib.sha256(data).digest()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def bench_config(name: str, args: argparse.Namespace) -> None:
    after_cfg = load_config(CONFIG_DIR / f"{name}.toml")
    before_cfg = paper_reach(after_cfg)
    context = after_cfg.index.context_tokens
    plans = {"before": LevelPlan.from_config(before_cfg), "after": LevelPlan.from_config(after_cfg)}
    rule = paper_rule_lengths(after_cfg, context)
    edge = after_cfg.region_names()[0]
    far = max((r for r in after_cfg.region_names() if r != edge and after_cfg.workers_in(r)),
              key=lambda r: after_cfg.rtt_ms(edge, r))
    print(f"\n== {name}: {len(after_cfg.workers)} workers, {len(after_cfg.region_names())} regions; "
          f"context_tokens {context}, long_growth {after_cfg.index.long_growth}; edge {edge!r}, farthest {far!r}")
    for label, plan in plans.items():
        own, remote = plan.lengths_toward(edge, edge), plan.lengths_toward(edge, far)
        print(f"{label:>9}: {len(plan.registration_lengths())} registered lengths (longest {plan.max_length}); "
              f"edge reads {len(own)} own-region, {len(remote)} toward {far}")
    print(f"paper@ctx: {len(rule)} registered lengths (the paper's rule continued to {context})")
    rng = np.random.default_rng(args.seed)
    header = (f"{'tokens':>7} {'plan':>9} {'keys':>5} {'credit own':>10} {'credit far':>10} "
              f"{'register µs':>11} {'x SHA':>6} {'batch B':>8}")
    print(header)
    for n in args.tokens:
        if n > context:
            continue
        prompt = rng.integers(0, 128_256, size=n, dtype=np.uint32)
        data = namespace_salt(after_cfg.model) + prompt.astype("<u4").tobytes()
        regs = {label: Registration(after_cfg if label == "after" else before_cfg, prompt,
                                    plan.registration_lengths_upto(n)) for label, plan in plans.items()}
        samples: dict[str, list[float]] = {label: [] for label in regs}
        sha: list[float] = []
        per_round = max(1, args.repeat // args.rounds)
        for _ in range(args.rounds):  # alternating rounds: load that comes and goes hits all alike
            sha += sha_us(data, per_round)
            for label, reg in regs.items():
                samples[label] += timed_us(reg, per_round)
        ref = statistics.median(sha)
        for label, plan in plans.items():
            med = statistics.median(samples[label])
            print(f"{n:>7} {label:>9} {len(regs[label].lengths):>5} "
                  f"{credit(plan.lengths_toward(edge, edge), n):>10.1%} {credit(plan.lengths_toward(edge, far), n):>10.1%} "
                  f"{med:>11.1f} {med / ref:>6.2f} {regs[label].batch_bytes:>8}")
        print(f"{n:>7} {'paper@ctx':>9} {sum(1 for c in rule if c <= n):>5}")
        print(f"{n:>7} {'SHA-256':>9} {'':>5} {'':>10} {'':>10} {ref:>11.1f} {1.0:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="testbed-3continent,census-64x8")
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[4096, 16384, 32768, 65536, 100000, 131072])
    parser.add_argument("--repeat", type=int, default=200, help="registrations timed per plan and length")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("load average (1/5/15 min): %.2f %.2f %.2f on %d CPUs" % (*os.getloadavg(), os.cpu_count() or 0))
    for name in args.configs.split(","):
        bench_config(name.strip(), args)


if __name__ == "__main__":
    main()
