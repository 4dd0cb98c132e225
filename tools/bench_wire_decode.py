"""What decoding the plane's most frequent messages costs: ``wire.decode`` against the path
before (every pair checked item by item, then every field checked again by the class's
constructor), on the same bytes, in alternating rounds (one thread).

    .venv/bin/python tools/bench_wire_decode.py [--rounds 15] [--repeat 2000]

The messages: an agent's load report and its room steps (none, 16 and 64 steps: one per
running request), a region's queue vector of 64 workers, and a maintenance unit's update
batch. Printed per message: the median µs per decode of each path, their ratio, and the load
average before and after its rounds (the machine is shared). The path before is rebuilt here
without the frame's size, version and tag checks, which ``wire.decode`` still makes: the ratio
errs against the change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import load_average  # noqa: E402

from kvcompassd import wire  # noqa: E402
from kvcompassd.core import messages  # noqa: E402


def samples() -> dict[str, bytes]:
    def room(n: int) -> tuple[tuple[float, int], ...]:
        return tuple((12.5 * i, 1000 + 640 * i) for i in range(n))

    vector = tuple((f"us-{i}", 3.25 * i) for i in range(64))
    batch = wire.UpdateBatchPublished(0, 1, 42, ((0, bytes(range(256)) * 2), (1, bytes(200))))
    built = {
        "load report": wire.WorkerLoadReported("us-0", 120.5, 17, 0),
        "room, 0 steps": wire.WorkerRoomReported("us-0", ()),
        "room, 16 steps": wire.WorkerRoomReported("us-0", room(16)),
        "room, 64 steps": wire.WorkerRoomReported("us-0", room(64)),
        "queue vector, 64": wire.QueueVectorBroadcast("us", "eu", 1.5, vector),
        "update batch": batch,
    }
    return {name: wire.encode(message) for name, message in built.items()}


def _pairs_of(field, out: list) -> None:
    if isinstance(field, messages.Pairs):
        out.append(field)
        _pairs_of(field.first, out)
        _pairs_of(field.second, out)


def decode_before(data: bytes):
    """The decode before: each field's from_wire, then the class's constructor checking them all again."""
    raw = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    spec = wire.MESSAGE_SPECS[raw[1]]
    name = spec.cls.__name__
    kwargs = {field_name: field_type.from_wire(value, f"{name}.{field_name}")
              for (field_name, field_type), value in zip(spec.fields, raw[2:])}
    return spec.cls(**kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    pairs: list = []
    for spec in wire.MESSAGE_SPECS.values():
        for _, field in spec.fields:
            _pairs_of(field, pairs)
    exact = {id(p): p._exact for p in pairs}

    def item_by_item(on: bool) -> None:
        for p in pairs:
            p._exact = None if on else exact[id(p)]

    print(f"{'message':18s} {'now us':>8s} {'before us':>10s} {'ratio':>6s}  load average before -> after")
    for name, data in samples().items():
        load_before = load_average()
        assert decode_before(data) == wire.decode(data)
        now, before = [], []
        for _ in range(args.rounds):
            for variant, times in (("now", now), ("before", before)):
                item_by_item(variant == "before")
                decode = wire.decode if variant == "now" else decode_before
                started = time.perf_counter()
                for _ in range(args.repeat):
                    decode(data)
                times.append((time.perf_counter() - started) / args.repeat * 1e6)
        item_by_item(False)
        a, b = statistics.median(now), statistics.median(before)
        print(f"{name:18s} {a:8.2f} {b:10.2f} {a / b:6.2f}  {load_before} -> {load_average()}")


if __name__ == "__main__":
    main()
