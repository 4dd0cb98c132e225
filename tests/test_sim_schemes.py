"""Scheme and workload look-up: the traces the package ships, and ``--traces`` as an override."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import pytest

from kvcompassd.sim.schemes import TRACES, make_workload, prompt_lengths, traces_dir
from kvcompassd.sim.workloads import WorkloadError

# The sha256 each trace's SOURCE.md records: the shipped copy is the published one, whole.
SHIPPED = {
    "mooncake/synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    "azure_llm_2023/AzureLLMInferenceTrace_code.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    "azure_llm_2023/AzureLLMInferenceTrace_conv.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
}


def test_the_package_ships_each_trace_with_its_licence_and_source():
    assert traces_dir() == TRACES
    for rel, digest in SHIPPED.items():
        assert hashlib.sha256((TRACES / rel).read_bytes()).hexdigest() == digest, rel
    assert (TRACES / "mooncake" / "LICENSE-APACHE").is_file()
    assert (TRACES / "azure_llm_2023" / "LICENSE-CC-BY-4.0").is_file()
    assert digest in (TRACES / "azure_llm_2023" / "SOURCE.md").read_text()


def test_traces_override_is_used_and_a_missing_one_is_an_error(tmp_path):
    assert traces_dir(tmp_path) == tmp_path
    with pytest.raises(WorkloadError, match="does not exist"):
        traces_dir(tmp_path / "nope")
    with pytest.raises(WorkloadError, match="does not exist"):
        make_workload("mooncake", 1.0, {"us": 1.0}, traces=tmp_path / "nope")


def test_trace_workloads_load_from_the_package_without_an_override():
    for name in ("mooncake", "azure-conv", "azure-code"):
        first = next(make_workload(name, 5.0, {"us": 1.0, "eu": 1.0}, seed=1))
        assert len(first.tokens) > 0 and first.region in ("us", "eu"), name


FORMAT = Path(__file__).parent / "data" / "mooncake_format"


def test_traces_pointing_at_a_file_is_an_error_not_a_fall_back():
    with pytest.raises(WorkloadError, match="is a file, not a directory"):
        traces_dir(FORMAT / "good.jsonl")
    with pytest.raises(WorkloadError, match="is a file"):
        make_workload("mooncake", 1.0, {"us": 1.0}, traces=FORMAT / "good.jsonl")


def test_a_trace_file_replays_as_the_mooncake_workload_at_the_asked_rate():
    reqs = list(make_workload("mooncake", 20.0, {"us": 1.0}, seed=1, trace=FORMAT / "good.jsonl"))
    assert [r.prompt_tokens for r in reqs] == [1100, 700, 1700, 300, 1024, 2100]
    # Native rate: 5 gaps over 0.9 s; at 20 req/s the same gaps scaled to span 0.25 s.
    assert reqs[-1].arrival_s == pytest.approx(5 / 20.0)
    assert reqs[1].arrival_s == pytest.approx(0.120 * (5 / 0.9) / 20.0)
    with pytest.raises(WorkloadError, match="workload 'mooncake', not 'mixed'"):
        make_workload("mixed", 1.0, {"us": 1.0}, trace=FORMAT / "good.jsonl")
    with pytest.raises(WorkloadError, match=r"bad_json\.jsonl:3: not JSON"):
        make_workload("mooncake", 1.0, {"us": 1.0}, trace=FORMAT / "bad_json.jsonl")
    with pytest.raises(WorkloadError, match="does not exist"):
        make_workload("mooncake", 1.0, {"us": 1.0}, trace=FORMAT / "nope.jsonl")


@pytest.mark.parametrize("name", ["mixed", "mixed-hot", "long", "wildchat", "azure-code", "mooncake"])
def test_prompt_lengths_are_the_workloads_own_in_order(name):
    """What the no-reuse capacity reads: drawn without tokens for the synthetic workloads, and
    the same lengths, in the same order, as the requests the workload yields."""
    weights = {"us": 2.0, "eu": 1.0}
    requests = list(itertools.islice(make_workload(name, 50.0, weights, seed=3), 300))
    lengths = list(itertools.islice(prompt_lengths(name, 50.0, weights, seed=3), 300))
    assert lengths == [r.prompt_tokens for r in requests] and len(set(lengths)) > 10
