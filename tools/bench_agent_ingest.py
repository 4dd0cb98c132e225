"""An agent's ingestion of its engine's KV events on the zero-delay gateway workload: decode each
published batch (``PayloadDecoder(coalesce=True)``, the agent's decoder) and mirror it in the block
tree (salted keys, ``apply_events_with_lengths``, one pass per batch). The engine is the
emulator's prefix cache fed the prompts ``bench_gateway.py`` sends (8 groups of a 1,500-token
prefix plus a unique 500-token suffix, 16-token pages, 200,000 tokens of VRAM: once it is full,
every batch also evicts, one event per page). Prints the median CPU per batch of this checkout
and, with ``--reference-checkout DIR`` (another checkout of the project, e.g. main), of that
one on the same batches, the two alternated ABAB (each arm a fresh process importing its own
checkout), their ratio, and whether both produced the same index events. Usage:
python tools/bench_agent_ingest.py [--reference-checkout DIR] [--rounds N] [--quick]"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (64, 128, 256, 512, 1024, 1232, 1456, 1728, 2048, 2560, 3184, 3952)  # the testbed's first levels
WARM = 600  # 200,000 VRAM tokens hold 12,500 pages: ~400 prompts' new pages fill them


def prompts(n: int, groups: int = 8, prefix: int = 1500, suffix: int = 500, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(32, 127) for _ in range(prefix)] for _ in range(groups)]
    return [heads[rng.randrange(groups)] + [rng.randrange(97, 107) for _ in range(suffix)] for _ in range(n)]


def payloads(n: int) -> list[bytes]:
    from kvcompassd.engine.kvevents import encode_payload
    from kvcompassd.worker.prefixcache import PrefixCache

    cache = PrefixCache(block_size=16, vram_tokens=200_000)
    out = []
    for i, p in enumerate(prompts(n)):
        events = cache.insert(p, now=float(i))
        if events:
            out.append(encode_payload(float(i), events))
    return out


def one_arm(n: int) -> dict:
    """This process's checkout: CPU seconds per measured batch, and a digest of every index event."""
    from kvcompassd.engine.blocktree import BlockTree
    from kvcompassd.engine.kvevents import PayloadDecoder

    data = payloads(n)
    tree = BlockTree("w", LENGTHS, salt=b"bench", page_size=16)
    out = []
    for payload in data[:WARM]:
        decoder = PayloadDecoder(payload, 0, coalesce=True)
        decoder.step(1 << 30)
        out.append(tree.apply_events_with_lengths(decoder.result.events))
    start = time.process_time()
    for payload in data[WARM:]:
        decoder = PayloadDecoder(payload, 0, coalesce=True)
        decoder.step(1 << 30)
        out.append(tree.apply_events_with_lengths(decoder.result.events))
    seconds = (time.process_time() - start) / max(1, len(data) - WARM)
    digest = hashlib.sha256(repr(out).encode()).hexdigest()[:16]
    events = sum(payload.count(b"block_hashes") for payload in data[WARM:]) / max(1, len(data) - WARM)
    return {"us_per_batch": seconds * 1e6, "digest": digest, "index_events": sum(len(e) for e, _ in out),
            "events_per_batch": events, "batches": len(data) - WARM}


def run_arm(checkout: Path, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, __file__, "--one-arm", str(n)], env=env, check=True, capture_output=True,
                          text=True)
    return dict(json.loads(done.stdout), load=os.getloadavg()[0])  # the machine's other load, at this arm's end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reference-checkout", type=Path, help="another checkout of the project (e.g. main)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one-arm", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_arm:
        print(json.dumps(one_arm(args.one_arm)))
        return
    n = WARM + (600 if args.quick else 2400)
    arms = {"this": Path(__file__).resolve().parent.parent}
    if args.reference_checkout:
        arms["reference"] = args.reference_checkout.resolve()
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, checkout in arms.items():  # ABAB: the arms alternate within each round
            results[name].append(run_arm(checkout, n))
    first = results["this"][0]
    print(f"{first['batches']} measured batches (after {WARM} that fill VRAM), {first['events_per_batch']:.0f} "
          f"engine events each; load average {os.getloadavg()[0]:.2f}")
    medians = {}
    for name, checkout in arms.items():
        times = [r["us_per_batch"] for r in results[name]]
        medians[name] = statistics.median(times)
        print(f"{name:<10} ({checkout}) decode + mirror: median {medians[name]:.1f} us per batch "
              "(rounds: " + ", ".join(f"{r['us_per_batch']:.1f} at load {r['load']:.2f}" for r in results[name]) + ")")
    if "reference" in arms:
        same = {r["digest"] for r in results["this"] + results["reference"]}
        print(f"this / reference: {medians['this'] / medians['reference']:.2f}; "
              f"index events equal: {len(same) == 1} ({first['index_events']} index events)")
        if len(same) != 1:
            raise SystemExit("the two checkouts' index events differ")


if __name__ == "__main__":
    main()
