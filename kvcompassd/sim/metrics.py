"""Metrics of one simulation run (paper §5.1-5.8): latency percentiles, throughput, load factor,
reuse (overall and by prompt length), false lookups and the cross-region-only share.

Reuse by prompt length (issue 28): the share of prompt tokens reused among the measured requests
whose prompt is under 8 K tokens, 8-32 K, and 32 K or more (to the model's context, 128 K on the
shipped configs). ``reuse_by_length_table`` sets each scheme's beside Dynamo's exact match, whose
reuse is what an index that sees every block can find."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .engine import SimResult
from .policy import (FALSE_INDEX_BEHIND, FALSE_KEYLESS, FALSE_LOST_IN_FLIGHT, FALSE_NO_VRAM_ROOM, FALSE_PENDING,
                     FALSE_VIEW_AHEAD, FALSE_VIEW_BEHIND, FALSE_WITHIN_PAGE)


# (lower bound, upper bound or None, Summary field suffix, label): prompt tokens in [lower, upper).
PROMPT_BUCKETS = ((0, 8192, "lt8k", "<8K"), (8192, 32768, "8k_32k", "8-32K"), (32768, None, "ge32k", ">=32K"))


@dataclass(frozen=True, slots=True)
class Summary:
    scheme: str
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    throughput_tok_s: float          # (prompt + output) tokens of the run over its duration (see summarize)
    output_tok_s: float              # output tokens of the run over its duration
    window_tok_s: float              # (prompt + output) tokens finished inside the measurement window, per second
    reused_tokens: int
    recomputed_tokens: int
    hit_rate: float                  # reused / prompt tokens
    # The same by prompt length (PROMPT_BUCKETS; NaN where no measured request falls), and how
    # many measured requests fall there.
    reuse_lt8k: float
    reuse_8k_32k: float
    reuse_ge32k: float
    requests_lt8k: int
    requests_8k_32k: int
    requests_ge32k: int
    dram_share_of_reuse: float
    false_lookup_rate: float         # requests whose worker reused less than the policy claimed
    false_lookup_rate_claimed: float  # ... among requests with a positive claim
    # The false lookups split by cause (share of requests; NaN if untracked; policy.FALSE_*):
    false_lost_in_flight: float      # the worker held the claim when chosen, lost it before the request came
    false_no_vram_room: float        # ... held it still when the request came, in DRAM, and had no VRAM to reload it into
    false_within_page: float         # the prompt diverges inside the page holding the claimed length
    false_view_ahead: float          # the worker held less than claimed already when chosen (stale or false entry)
    # ... of which, where the policy can tell (KVCompass; policy.FALSE_INDEX_BEHIND etc.):
    false_index_behind: float        # the index still listed the worker (its eviction not yet applied)
    false_view_behind: float         # the index had dropped it; the edge's view had not caught up
    false_keyless: float             # the view was current: a keyless false hit
    false_pending: float             # the edge's pending ledger credited a prompt it had just sent there
    cross_region_share: float        # requests served outside their edge's region
    remote_only_share: float         # of requests with a >=1024-token reusable prefix, held only remotely (NaN if untracked)
    load_factor_peak: float          # hottest worker's time-averaged load / mean
    lookup_ms_mean: float
    queue_mean_ms: float             # mean wait at the worker before prefill started
    wall_s: float
    sim_requests_per_wall_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def measured_mask(result: SimResult, warmup_s: float = 0.0) -> np.ndarray:
    return result.records["arrival_s"] >= warmup_s


def load_factors(result: SimResult, warmup_s: float = 0.0) -> np.ndarray:
    """Workers x bins: each worker's GPU compute sent per bin over that bin's mean over workers
    (NaN for empty bins). Bins before ``warmup_s`` are dropped."""
    bins = result.load_bins[:, int(warmup_s // result.load_bin_s):]
    mean = bins.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, bins / mean, np.nan)


def load_factor_peak(result: SimResult, warmup_s: float = 0.0) -> float:
    """Paper Fig. 14: the hottest worker's time-averaged load factor relative to the balanced
    mean, i.e. max over workers of (its total compute) / (mean total compute)."""
    totals = result.load_bins[:, int(warmup_s // result.load_bin_s):].sum(axis=1)
    return float(totals.max() / totals.mean()) if totals.mean() > 0 else float("nan")


def summarize(result: SimResult, *, warmup_s: float = 0.0) -> Summary:
    r = result.records
    m = measured_mask(result, warmup_s)
    if not m.any():
        m = np.ones_like(r["id"], dtype=bool)
    ttft, e2e = r["ttft_ms"][m], r["e2e_ms"][m]
    prompt = r["prompt_tokens"][m]
    reused, claimed, dram = r["reused_tokens"][m], r["claimed_tokens"][m], r["dram_tokens"][m]
    # Throughput as vLLM's and SGLang's serving benchmarks define it ("total token throughput"):
    # every token of the run over its duration, first arrival to last completion. Below capacity
    # that is the offered load; past it, the rate at which the pool works off the backlog, which
    # both reuse (less prefill per token) and balance (no worker idle while others drain) raise.
    duration = max(float(r["finish_s"].max() - r["arrival_s"].min()), 1e-9)
    all_out = float(r["output_tokens"].sum())
    all_tokens = float(r["prompt_tokens"].sum()) + all_out
    # Tokens of the requests that finished inside the measurement window (after warm-up, up to
    # the last arrival), over the window. Kept for comparison only: a short window past capacity
    # holds a few hundred completions, mostly early arrivals, and a handful of long prompts
    # swing it (Mixed 4000 req/s, 1.9 s: 477 completions for KVCompass).
    start, end = max(warmup_s, float(r["arrival_s"].min())), float(r["arrival_s"].max())
    span = max(end - start, 1e-9)
    in_window = (r["finish_s"] >= start) & (r["finish_s"] <= end)
    window_tokens = float(r["prompt_tokens"][in_window].sum() + r["output_tokens"][in_window].sum())
    false = claimed > reused
    has_claim = claimed > 0
    cause = r["false_cause"][m]
    known = cause >= 0

    def cause_share(*codes: int) -> float:
        return float(np.isin(cause, codes).sum() / known.sum()) if known.any() else float("nan")
    by_length = reuse_by_length(prompt, reused)
    remote_only = r["remote_only"][m]
    tracked = remote_only >= 0
    n = int(m.sum())
    return Summary(
        scheme=result.scheme,
        requests=n,
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
        ttft_mean_ms=float(ttft.mean()),
        e2e_p50_ms=float(np.percentile(e2e, 50)),
        e2e_p99_ms=float(np.percentile(e2e, 99)),
        throughput_tok_s=all_tokens / duration,
        output_tok_s=all_out / duration,
        window_tok_s=window_tokens / span,
        reused_tokens=int(reused.sum()),
        recomputed_tokens=int((prompt - reused).sum()),
        hit_rate=float(reused.sum() / prompt.sum()),
        **{f"reuse_{suffix}": share for suffix, (share, _) in by_length.items()},
        **{f"requests_{suffix}": count for suffix, (_, count) in by_length.items()},
        dram_share_of_reuse=float(dram.sum() / reused.sum()) if reused.sum() else 0.0,
        false_lookup_rate=float(false.mean()),
        false_lookup_rate_claimed=float(false[has_claim].mean()) if has_claim.any() else 0.0,
        false_lost_in_flight=cause_share(FALSE_LOST_IN_FLIGHT),
        false_no_vram_room=cause_share(FALSE_NO_VRAM_ROOM),
        false_within_page=cause_share(FALSE_WITHIN_PAGE),
        false_view_ahead=cause_share(FALSE_VIEW_AHEAD, FALSE_INDEX_BEHIND, FALSE_VIEW_BEHIND, FALSE_KEYLESS,
                                     FALSE_PENDING),
        false_index_behind=cause_share(FALSE_INDEX_BEHIND),
        false_view_behind=cause_share(FALSE_VIEW_BEHIND),
        false_keyless=cause_share(FALSE_KEYLESS),
        false_pending=cause_share(FALSE_PENDING),
        cross_region_share=float((r["edge_region"][m] != r["worker_region"][m]).mean()),
        remote_only_share=float((remote_only[tracked] == 1).mean()) if tracked.any() else float("nan"),
        load_factor_peak=load_factor_peak(result, warmup_s),
        lookup_ms_mean=float(r["lookup_ms"][m].mean()),
        queue_mean_ms=float(r["queue_ms"][m].mean()),
        wall_s=result.wall_s,
        sim_requests_per_wall_s=result.completed / result.wall_s if result.wall_s > 0 else float("inf"),
    )


def reuse_by_length(prompt: np.ndarray, reused: np.ndarray) -> dict[str, tuple[float, int]]:
    """Per ``PROMPT_BUCKETS`` suffix: (reused / prompt tokens, requests) of the requests whose
    prompt length falls in it; NaN share for an empty bucket."""
    out = {}
    for lower, upper, suffix, _ in PROMPT_BUCKETS:
        inside = (prompt >= lower) & (prompt < upper) if upper is not None else prompt >= lower
        tokens = float(prompt[inside].sum())
        out[suffix] = (float(reused[inside].sum()) / tokens if tokens else float("nan"), int(inside.sum()))
    return out


def reuse_by_length_table(rows: list[dict], title: str, reference: str = "dynamo") -> str:
    """Markdown: per (workload, rate) and scheme, reuse by prompt length, and the points it is
    above (+) or below (-) the ``reference`` scheme's (Dynamo's exact match) at the same point."""
    head = " | ".join(f"{label} reuse % (n) | vs {reference}" for *_, label in PROMPT_BUCKETS)
    lines = [f"# {title}", "", f"| workload | rate | scheme | {head} |",
             "|---|---|---|" + "---|---|" * len(PROMPT_BUCKETS)]
    ref = {(r.get("workload"), r.get("rate")): r for r in rows if r["scheme"] == reference}
    for r in rows:
        other = ref.get((r.get("workload"), r.get("rate")))
        cells = []
        for *_, suffix, _ in PROMPT_BUCKETS:
            share, n = r.get(f"reuse_{suffix}", float("nan")), r.get(f"requests_{suffix}", 0)
            cells.append(f"{100 * share:.1f} ({n})" if n else "-")
            if other is None or not n or not other.get(f"requests_{suffix}"):
                cells.append("")
            else:
                cells.append(f"{100 * (share - other[f'reuse_{suffix}']):+.1f}")
        rate = r.get("rate", "")
        lines.append(f"| {r.get('workload', '')} | {rate:g} | {r['scheme']} | " + " | ".join(cells) + " |"
                     if rate != "" else f"| {r.get('workload', '')} |  | {r['scheme']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
