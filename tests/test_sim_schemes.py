"""Scheme and workload look-up: the traces the package ships, and ``--traces`` as an override."""

from __future__ import annotations

import hashlib

import pytest

from kvcompassd.sim.schemes import TRACES, make_workload, traces_dir
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
