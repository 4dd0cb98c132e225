"""What the per-decision object shortcuts save: ``Router.decide`` with the exec-generated
positional constructors (``slot_constructor``) and ScoreResult's direct slot writes, against
the same decisions with the plain dataclass constructors and ``object.__setattr__``.

    .venv/bin/python tools/bench_constructors.py [--entries 200000] [--rounds 15] [--repeat 2000]

Both variants decide for the same prompt on the same view in alternating rounds (one thread);
printed: the median per-decision time of each and the share of a decision the shortcuts save.
Issue 25 keeps a shortcut only if it saves >= 5 % of a decision.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_forward import CONFIG_DIR, build_view, with_levels  # noqa: E402

from kvcompassd.core import lookup, router, score  # noqa: E402
from kvcompassd.core.config import load_config  # noqa: E402
from kvcompassd.core.lookup import LookupResult  # noqa: E402
from kvcompassd.core.router import ForwardDecided, Router  # noqa: E402

PATCHED = {
    (router, "_new_forward_decided"): ForwardDecided,
    (router, "new_lookup_result"): LookupResult,
    (lookup, "new_lookup_result"): LookupResult,
}


def _plain_score_init(self, chosen, worker, lam, scores, scorer, prompt_len, matched, tier, queue, belief, ablation):
    """ScoreResult.__init__ as a frozen class usually writes its fields."""
    setattr_ = object.__setattr__
    setattr_(self, "chosen", chosen)
    setattr_(self, "worker", worker)
    setattr_(self, "lam", lam)
    setattr_(self, "scores", scores)
    setattr_(self, "_scorer", scorer)
    setattr_(self, "_prompt_len", prompt_len)
    setattr_(self, "_matched", matched)
    setattr_(self, "_tier", tier)
    setattr_(self, "_queue", queue)
    setattr_(self, "_belief", belief)
    setattr_(self, "_ablation", ablation)


def plain(on: bool, saved: dict) -> None:
    """Switch between the shortcuts (``on=False``) and plain constructors (``on=True``)."""
    for (module, name), replacement in PATCHED.items():
        setattr(module, name, replacement if on else saved[(module, name)])
    score.ScoreResult.__init__ = _plain_score_init if on else saved["ScoreResult.__init__"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="testbed-3continent")
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    cfg = with_levels(load_config(CONFIG_DIR / f"{args.config}.toml"), 5)
    prompt = np.random.default_rng(0).integers(0, 128_256, size=args.tokens, dtype=np.uint32)
    view, _, _ = build_view(cfg, args.entries, prompt, 0)
    region = cfg.region_names()[0]
    r = Router(cfg, region, view, now=0.0)
    for w in cfg.workers_in(region):
        r.queues.set_local(w.id, 0.0, now=0.0)
    saved = {key: getattr(*key) for key in PATCHED} | {"ScoreResult.__init__": score.ScoreResult.__init__}
    times: dict[bool, list[float]] = {False: [], True: []}
    now = 1.0
    for _ in range(args.rounds):
        for variant in (False, True):
            plain(variant, saved)
            start = time.process_time()
            for _ in range(args.repeat):
                now += 1e-4
                r.decide(prompt, now=now)
            times[variant].append((time.process_time() - start) / args.repeat * 1e6)
    plain(False, saved)
    fast, slow = statistics.median(times[False]), statistics.median(times[True])
    print(f"decision with shortcuts {fast:.2f} us, with plain constructors {slow:.2f} us (CPU time, median of "
          f"{args.rounds} rounds x {args.repeat}): the shortcuts save {(slow - fast) / slow:.1%} of a decision")


if __name__ == "__main__":
    main()
