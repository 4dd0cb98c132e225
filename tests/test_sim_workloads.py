"""Workload sources: Mooncake loader on the real trace head, Azure reader, generators."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvcompassd.sim.blockmirror import chain_keys
from kvcompassd.sim.schemes import traces_dir
from kvcompassd.core.config import load_config
from kvcompassd.sim.synthetic import (ChatWorkload, LongContextParams, LongContextWorkload, MixedWorkload, ZipfSampler,
                                     servable_prompt_tokens)
from kvcompassd.sim.workloads import (
    ArrivalProcess, Request, WorkloadError, limit_stream, mooncake_requests, mooncake_sessions, read_azure,
    read_mooncake, rescale, trace_rate, weighted_choice,
)

# The traces the package ships; a missing file fails the tests that read it.
MOONCAKE = traces_dir() / "mooncake" / "synthetic_trace.jsonl"
AZURE = traces_dir() / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
W = {"us": 3.0, "eu": 1.0}


def test_mooncake_head_expands_blocks_into_shared_prefixes():
    recs = read_mooncake(MOONCAKE, limit=300)
    reqs = list(mooncake_requests(MOONCAKE, W, seed=1, limit=300))
    assert len(reqs) == 300
    for rec, r in zip(recs, reqs):
        assert r.prompt_tokens == rec.input_length and r.output_tokens == max(1, rec.output_length)
        assert r.arrival_s == rec.timestamp_ms / 1000
    # Equal leading block ids give equal tokens; a differing block gives different tokens.
    by_first: dict[int, Request] = {}
    checked = 0
    for rec, r in zip(recs, reqs):
        other = by_first.get(rec.hash_ids[0])
        if other is not None:
            o_rec = recs[other.id]
            same = next(i for i, (a, b) in enumerate(zip(rec.hash_ids + (-1,), o_rec.hash_ids + (-2,))) if a != b)
            n = min(same * 512, r.prompt_tokens, other.prompt_tokens)
            assert np.array_equal(r.tokens[:n], other.tokens[:n])
            checked += 1
        by_first.setdefault(rec.hash_ids[0], r)
    assert checked > 10
    # Follow-up turns inherit their session's region.
    regions: dict[int, str] = {}
    for r in reqs:
        assert regions.setdefault(r.session, r.region) == r.region
    again = list(mooncake_requests(MOONCAKE, W, seed=1, limit=300))
    assert [r.region for r in again] == [r.region for r in reqs]


def test_mooncake_sessions_follow_whole_prompt_extensions(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 3, 4]},  # follow-up
        {"timestamp": 2, "input_length": 700, "output_length": 5, "hash_ids": [1, 9]},  # shares only block 1
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert mooncake_sessions(read_mooncake(path)) == [0, 0, 1]


def test_mooncake_sessions_same_document_questions_are_separate_roots(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 1104, "output_length": 9, "hash_ids": [1, 2, 4]},  # other question, same doc
        {"timestamp": 2, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 3]},  # exact repeat
        {"timestamp": 3, "input_length": 1400, "output_length": 5, "hash_ids": [1, 2, 5]},  # follow-up of the repeat
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert mooncake_sessions(read_mooncake(path)) == [0, 1, 2, 2]


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('not json', "JSON"),
])
def test_mooncake_bad_lines_name_the_problem(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=field):
        read_mooncake(path)


def test_azure_trace_and_shaped_arrivals():
    trace = read_azure(AZURE)
    assert len(trace.offsets_s) == 19_366
    assert 5.0 < trace.mean_rate < 6.0
    times = list(itertools.islice(ArrivalProcess(1000.0, seed=1, azure=trace).times(), 20_000))
    assert np.all(np.diff(times) >= 0)
    assert 700 < len(times) / times[-1] < 1400  # the trace's burstiness around the target rate


def test_azure_bad_header(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(WorkloadError, match="header"):
        read_azure(path)


def test_request_validation():
    with pytest.raises(WorkloadError):
        Request(0, 0.0, "us", 0, np.array([], dtype=np.uint32), 1)
    with pytest.raises(WorkloadError):
        Request(0, 0.0, "us", 0, np.arange(3, dtype=np.int64), 1)
    with pytest.raises(WorkloadError):
        Request(0, float("nan"), "us", 0, np.arange(3, dtype=np.uint32), 1)


@pytest.mark.parametrize("make", [
    lambda s: MixedWorkload(500.0, W, seed=s),
    lambda s: ChatWorkload(500.0, W, flavour="wildchat", seed=s),
    lambda s: ChatWorkload(500.0, W, flavour="lmsys", seed=s),
])
def test_generators_are_seeded_ordered_and_lazy(make):
    a = list(itertools.islice(iter(make(7)), 400))
    b = list(itertools.islice(iter(make(7)), 400))
    c = list(itertools.islice(iter(make(8)), 400))
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert [r.id for r in a] == list(range(400))
    assert {r.region for r in a} == set(W)
    # Follow-up turns extend their session's previous prompt.
    last: dict[int, Request] = {}
    follow = 0
    for r in a:
        prev = last.get(r.session)
        if prev is not None:
            assert np.array_equal(r.tokens[: prev.prompt_tokens], prev.tokens)
            follow += 1
        last[r.session] = r
    assert follow > 0


def test_mixed_tenants_share_only_their_own_system_prompt():
    reqs = list(itertools.islice(iter(MixedWorkload(500.0, W, seed=3)), 2000))
    by_tenant: dict[str, list[Request]] = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, []).append(r)
    assert len(by_tenant) == 50
    t0, t1 = (v for _, v in zip(range(2), by_tenant.values()))
    assert np.array_equal(t0[0].tokens[:64], t0[1].tokens[:64])
    assert not np.array_equal(t0[0].tokens[:64], t1[0].tokens[:64])


def test_rescale_and_limits():
    reqs = list(itertools.islice(iter(MixedWorkload(100.0, W, seed=1)), 300))
    native = trace_rate(reqs)
    fast = list(rescale(reqs, 4 * native, native))
    assert trace_rate(fast) == pytest.approx(4 * native)
    assert len(list(limit_stream(iter(reqs), max_requests=10))) == 10
    assert all(r.arrival_s < 1.0 for r in limit_stream(iter(reqs), duration_s=1.0))
    with pytest.raises(WorkloadError):
        ArrivalProcess(0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=200), st.integers(0, 2**32 - 1), st.integers(0, 199))
def test_chain_keys_equal_exactly_for_equal_prefixes(tokens, replacement, position):
    a = np.array(tokens, dtype=np.uint32)
    b = a.copy()
    pos = position % len(a)
    b[pos] = replacement
    ka, kb = chain_keys(a, 16), chain_keys(b, 16)
    first_diff = pos // 16 if a[pos] != b[pos] else len(ka)
    assert np.array_equal(ka[:first_diff], kb[:first_diff])
    assert not np.any(ka[first_diff:] == kb[first_diff:])


def test_zipf_is_skewed():
    rng = np.random.default_rng(0)
    z = ZipfSampler(1000, 1.0)
    counts = np.bincount([z.sample(rng) for _ in range(5000)], minlength=1000)
    assert counts[0] > counts[10] > 0 and counts[0] > 300


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=80), st.sampled_from([4, 16, 32]))
def test_event_block_hashes_match_the_vectorised_ones(tokens, block_size):
    from kvcompassd.sim.blockmirror import _event_block_hashes, block_hashes

    expected = block_hashes(np.array(tokens, dtype=np.uint32), block_size).tolist()
    assert _event_block_hashes(tokens, block_size) == expected


def test_mixed_matches_the_papers_service_time_statistics():
    # The paper's simulated Mixed (§3.5, Fig. 9): no-reuse capacity ~667 req/s on 64 workers
    # at beta = 0.085 ms/token, service-time CV^2 = 5.4. The generator is calibrated to both.
    regions = {"us": 30, "cn": 13, "de": 8, "jp": 3, "sg": 3, "uk": 3, "kr": 2, "au": 2}
    reqs = list(itertools.islice(MixedWorkload(1000.0, regions, seed=0), 30_000))
    service_ms = 0.085 * np.array([r.prompt_tokens for r in reqs], dtype=float)
    lambda0 = 64 * 1000.0 / service_ms.mean()
    cv2 = (service_ms ** 2).mean() / service_ms.mean() ** 2 - 1
    assert 600 <= lambda0 <= 730
    assert 4.5 <= cv2 <= 6.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1e6), min_size=1, max_size=20).filter(lambda w: sum(w) > 0),
       st.integers(0, 2**32 - 1))
def test_weighted_choice_draws_what_generator_choice_draws(weights, seed) -> None:
    """Same names from the same seed as ``rng.choice(n, p=...)``, and the streams stay in step."""
    named = {f"r{i}": w for i, w in enumerate(weights)}
    names, p = list(named), np.array(weights, dtype=float)
    ours, reference = np.random.default_rng(seed), np.random.default_rng(seed)
    for _ in range(50):
        assert weighted_choice(ours, named) == names[int(reference.choice(len(names), p=p / p.sum()))]
    assert ours.random() == reference.random()


# ---------------------------------------------------------------------------- a trace a user brings

FORMAT = Path(__file__).parent / "data" / "mooncake_format"


def test_a_users_mooncake_format_trace_replays_its_prompts_and_sessions():
    recs = read_mooncake(FORMAT / "good.jsonl")
    assert [r.input_length for r in recs] == [1100, 700, 1700, 300, 1024, 2100]  # the blank line skipped
    reqs = list(mooncake_requests(FORMAT / "good.jsonl", W, seed=2))
    assert [r.prompt_tokens for r in reqs] == [1100, 700, 1700, 300, 1024, 2100]
    assert reqs[3].output_tokens == 1  # an output_length of 0 still decodes the first token
    # Turn 2 carries turn 1 (blocks 0-1 whole) and so continues its session and region.
    assert reqs[2].session == reqs[0].session and reqs[2].region == reqs[0].region
    assert reqs[4].session == reqs[1].session and reqs[3].session not in (reqs[0].session, reqs[1].session)
    assert np.array_equal(reqs[2].tokens[:1024], reqs[0].tokens[:1024])
    assert not np.array_equal(reqs[1].tokens[:512], reqs[0].tokens[:512])


def test_the_block_size_of_a_trace_is_a_parameter():
    recs = read_mooncake(FORMAT / "good_block16.jsonl", block_tokens=16)
    assert len(recs[0].hash_ids) == 69  # ceil(1100 / 16)
    reqs = list(mooncake_requests(FORMAT / "good_block16.jsonl", W, block_tokens=16))
    assert [r.prompt_tokens for r in reqs] == [1100, 700, 1700, 300, 1024, 2100]
    # At 512 tokens a block the same file's counts do not fit: named, with the hint.
    with pytest.raises(WorkloadError, match=r"good_block16\.jsonl:1: .*block size 512"):
        read_mooncake(FORMAT / "good_block16.jsonl")
    with pytest.raises(WorkloadError, match="block size must be a positive"):
        read_mooncake(FORMAT / "good.jsonl", block_tokens=0)


@pytest.mark.parametrize(("name", "line", "what"), [
    ("bad_json.jsonl", 3, "not JSON"),
    ("bad_missing_field.jsonl", 2, "missing field 'output_length'"),
    ("bad_block_count.jsonl", 4, "'hash_ids' has 2 blocks for input_length 1100"),
    ("bad_timestamp_order.jsonl", 3, "earlier than the previous record"),
    ("bad_types.jsonl", 1, "'input_length' must be a positive int"),
    ("bad_not_object.jsonl", 2, "expected a JSON object"),
    ("bad_bool.jsonl", 2, "'output_length' must be a non-negative int"),
])
def test_a_malformed_trace_line_is_named_by_file_and_line(name, line, what):
    with pytest.raises(WorkloadError) as err:
        read_mooncake(FORMAT / name)
    assert f"{FORMAT / name}:{line}: " in str(err.value) and what in str(err.value)


def test_a_missing_empty_or_non_file_trace_is_an_error(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        read_mooncake(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="is not a file"):
        read_mooncake(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no records"):
        read_mooncake(tmp_path / "empty.jsonl")
    first = (FORMAT / "good.jsonl").read_bytes().splitlines()[0]
    (tmp_path / "binary.jsonl").write_bytes(first + b'\n\xff\xfe\n')
    with pytest.raises(WorkloadError, match=r"binary\.jsonl:2: not UTF-8"):
        read_mooncake(tmp_path / "binary.jsonl")


_json_values = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                            max_leaves=12)
_fields = st.fixed_dictionaries({}, optional={"timestamp": _json_values, "input_length": _json_values,
                                              "output_length": _json_values, "hash_ids": _json_values})


@settings(max_examples=200, deadline=None)
@given(lines=st.lists(st.one_of(_fields.map(json.dumps), st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
                                st.just("[" * 5000)), min_size=1, max_size=4))
def test_any_trace_file_is_records_or_a_named_error(tmp_path_factory, lines):
    """Whatever a file holds, the reader returns valid records or raises WorkloadError naming
    the file: never another exception (a huge int, deep nesting, bytes that are not UTF-8)."""
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    try:
        recs = read_mooncake(path)
    except WorkloadError as exc:
        assert str(path) in str(exc)
        return
    for r in recs:
        assert r.input_length >= 1 and len(r.hash_ids) == -(-r.input_length // 512)


def test_a_huge_input_length_is_a_named_error_not_an_overflow(tmp_path):
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 10**400, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(WorkloadError, match=r"huge\.jsonl:1: field 'hash_ids' has 1 blocks"):
        read_mooncake(path)


def test_long_context_sessions_are_long_multi_turn_and_shared_across_regions():
    params = LongContextParams(max_prompt_tokens=96_256)  # the testbed's cap
    make = lambda seed: iter(LongContextWorkload(2.0, W, seed=seed, params=params))  # noqa: E731
    a = list(itertools.islice(make(5), 150))
    b = list(itertools.islice(make(5), 150))
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:])) and [r.id for r in a] == list(range(150))
    lengths = np.array([r.prompt_tokens for r in a])
    assert lengths.min() >= 32_768 and lengths.max() <= 96_256
    last: dict[int, Request] = {}
    follow = 0
    for r in a:
        prev = last.get(r.session)
        if prev is not None:  # a follow-up turn extends its session's previous prompt
            assert r.prompt_tokens > prev.prompt_tokens and np.array_equal(r.tokens[: prev.prompt_tokens], prev.tokens)
            follow += 1
        last[r.session] = r
    assert follow > 30
    # Sessions of different regions open with the same 32 K tokens (a shared document or
    # repository after the tenant's system prompt): cross-region reuse exists to be found.
    regions_by_head: dict[bytes, set[str]] = {}
    for r in a:
        regions_by_head.setdefault(r.tokens[:32_768].tobytes(), set()).add(r.region)
    assert any(len(regions) > 1 for regions in regions_by_head.values())


def test_long_context_calibration():
    # The statistics its docstring states: ~64 K tokens per request over 2,000 planned
    # sessions (~4 turns each), ~60 K under the testbed's 96 K cap.
    full = LongContextWorkload(1.0, W, seed=0)
    assert 60_000 <= full.mean_prompt_tokens(2000) <= 68_000
    assert 4.2 <= full.mean_turns() <= 4.6  # planned: the parameters' 4.5, a few sessions capped
    testbed = load_config(Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml")
    assert servable_prompt_tokens(testbed) == 98_304 - 2048
    capped = LongContextWorkload(1.0, W, seed=0, params=LongContextParams(max_prompt_tokens=servable_prompt_tokens(testbed)))
    assert 56_000 <= capped.mean_prompt_tokens(2000) <= 64_000
    assert 3.9 <= capped.mean_turns() < full.mean_turns()  # more agent sessions end early under the cap
    # The request rate asked for is the rate the stream delivers (within sampling noise).
    stream = list(itertools.takewhile(lambda r: r.arrival_s < 200.0, iter(
        LongContextWorkload(2.0, W, seed=1, params=LongContextParams(max_prompt_tokens=96_256)))))
    assert 0.8 * 400 <= len(stream) <= 1.2 * 400
    with pytest.raises(WorkloadError, match="max_prompt_tokens"):
        LongContextWorkload(1.0, W, params=LongContextParams(max_prompt_tokens=20_000))
    with pytest.raises(WorkloadError, match="document_share"):
        LongContextWorkload(1.0, W, params=LongContextParams(document_share=1.5))
def test_hot_skew_mixed_is_full_size_with_a_hot_head():
    # App. C's hot-skew Mixed (synthetic.MIXED_HOT_SKEW): the testbed's full-size prompts put the
    # 7 prefill workers' no-reuse capacity just above the paper's 24 req/s, and a few prefixes
    # draw several per cent of all requests each.
    from collections import Counter

    from kvcompassd.sim.schemes import make_workload

    reqs = list(itertools.islice(make_workload("mixed-hot", 24.0, {"us": 5, "eu": 2, "asia": 3}, seed=0), 6000))
    prompt = np.array([r.prompt_tokens for r in reqs], dtype=float)
    lambda0 = 7 * 1000.0 / (0.085 * prompt.mean())
    assert 2_400 <= prompt.mean() <= 3_300 and 24 < lambda0 < 36
    heads = Counter(r.tokens[:1024].tobytes() for r in reqs if r.prompt_tokens >= 1024)
    assert heads.most_common(1)[0][1] / len(reqs) > 0.03
    assert len({r.tenant for r in reqs}) == 4
