"""Record when SGLang's own output streamer sends a streamed request's pieces, for the tests of
the emulated worker's ``stream_interval`` and of the edge's reliance on it (the first token at
once: it times the prefill).

Loads ``scheduler_components/output_streamer.py`` straight out of SGLang's wheel; the modules it
imports for other work (torch, zmq, beam search, the disaggregation modes, the environment, the
scheduler's types) are replaced by the few names it uses. For each (``stream_interval``, answer
length) below, one request gains a token per decode step, as the scheduler's batches do, and a
fresh ``_GenerationStreamAccumulator`` (one per step, as the scheduler makes them; Rust-server
mode, which skips only the detokenizer's bookkeeping) is given it: the tokens sent so far after
each piece it sends are written to ``sglang-stream-intervals.json``.

    python -m venv /tmp/capvenv
    pip download --no-deps -d /tmp/wheels sglang==0.5.23
    /tmp/capvenv/bin/python tools/capture_engine_streams.py --sglang-wheel /tmp/wheels/sglang-0.5.23-*.whl
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wheel_modules import load_from_wheel, sglang_capture_args, stub_module, wheel_version  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "engine_streams"
CASES = [(None, 5), (1, 5), (4, 11), (4, 12), (16, 8), (16, 16), (16, 17), (16, 40), (16, 256), (64, 300)]


class _Any:
    def __init__(self, *args, **kwargs) -> None:
        pass


class _Env:
    def __init__(self, value: int) -> None:
        self.value = value

    def get(self) -> int:
        return self.value


def load_streamer(wheel: Path, tmp: Path) -> tuple[types.ModuleType, str, type, type]:
    for package in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.scheduler_components",
                    "sglang.srt.beam_search", "sglang.srt.disaggregation", "sglang.srt.mem_cache",
                    "sglang.srt.sampling", "sglang.srt.speculative", "sglang.srt.utils"):
        stub_module(package, __path__=[])
    version = wheel_version(wheel)

    class DisaggregationMode(enum.Enum):
        NULL = "null"

    class SpeculativeAlgorithm(enum.Enum):
        NONE = 0

        def is_none(self) -> bool:
            return self is SpeculativeAlgorithm.NONE

    stub_module("torch", Tensor=type("Tensor", (), {}))
    stub_module("zmq")
    stub_module("sglang.srt.beam_search.output", beam_completion_tokens=lambda *a: 0,
                pack_beam_search_output=lambda *a, **k: None)
    stub_module("sglang.srt.disaggregation.utils", DisaggregationMode=DisaggregationMode)
    stub_module("sglang.srt.environ", envs=types.SimpleNamespace(SGLANG_FORCE_STREAM_INTERVAL=_Env(50),
                                                                 SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS=_Env(0)))
    stub_module("sglang.srt.managers.io_struct", BatchEmbeddingOutput=_Any, BatchTokenIDOutput=_Any,
                CachedTokensDetails=_Any, wrap_as_pickle=lambda x: x)
    stub_module("sglang.srt.managers.schedule_batch", BaseFinishReason=_Any, Req=_Any)
    stub_module("sglang.srt.mem_cache.base_prefix_cache", BasePrefixCache=_Any)
    stub_module("sglang.srt.runtime_context", get_observability=lambda: None, get_parallel=lambda: None,
                get_serving=lambda: None)
    stub_module("sglang.srt.sampling.sampling_mask", SamplingMaskChunk=_Any)
    stub_module("sglang.srt.server_args", ServerArgs=_Any)
    stub_module("sglang.srt.speculative.spec_info", SpeculativeAlgorithm=SpeculativeAlgorithm)
    stub_module("sglang.srt.utils.weight_versions", compute_weight_version_spans=lambda *a, **k: None)
    streamer = load_from_wheel(wheel, "sglang/srt/managers/scheduler_components/output_streamer.py",
                               "sglang.srt.managers.scheduler_components.output_streamer", tmp)
    return streamer, version, DisaggregationMode, SpeculativeAlgorithm


class StreamedRequest:
    """What the streamer reads of a scheduler ``Req``: a streamed one, no logprobs, no beams."""

    def __init__(self, interval: int | None) -> None:
        self.rid, self.stream, self.beam_group, self.is_beam_leader = "r", True, None, False
        self.sampling_params = types.SimpleNamespace(stream_interval=interval)
        self.output_ids: list[int] = []
        self.send_token_offset = self.send_output_token_logprobs_offset = 0
        self.finished_output, self.finished_len, self.finished_reason, self.done = False, None, None, False
        self.origin_input_ids, self.reasoning_tokens, self.cached_tokens, self.retraction_count = [1, 2, 3], 0, 0, 0
        self.weight_version_events, self.time_stats, self.customized_info = [], None, None
        self.return_hidden_states = self.return_routed_experts = self.return_indexer_topk = False
        self.return_logprob = False

    def finished(self) -> bool:
        return self.done

    def check_match_stop_str_prefix(self) -> bool:
        return False

    @property
    def output_ids_through_stop(self) -> list[int]:
        return self.output_ids

    def get_mm_token_counts(self) -> tuple[int, int, int]:
        return 0, 0, 0


def sent_after_each_piece(streamer, modes, interval: int | None, length: int) -> list[int]:
    disaggregation_mode, speculative_algorithm = modes
    accumulator = streamer._GenerationStreamAccumulator
    given = {"spec_algorithm": speculative_algorithm.NONE, "disaggregation_mode": disaggregation_mode.NULL,
             "default_stream_interval": 1, "default_force_stream_interval": 50,
             "get_cached_tokens_details": lambda req: None, "rust_server_mode": True, "return_logprob": False,
             "return_hidden_states": False, "return_routed_experts": False, "return_indexer_topk": False,
             "return_sampling_mask": False, "is_request_level_customized_info_key": lambda key: False,
             "current_weight_version": None}
    req, sent = StreamedRequest(interval), []
    for n in range(1, length + 1):
        req.output_ids.append(7)
        if n == length:
            req.done, req.finished_reason = True, types.SimpleNamespace(to_json=lambda: {"type": "length"})
        kwargs = {}
        for f in dataclasses.fields(accumulator):
            if f.name in given:
                kwargs[f.name] = given[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                kwargs[f.name] = f.default_factory()
        step = accumulator(**kwargs)
        step.accept(req=req)
        if step.output_ids:
            sent.append(req.send_token_offset)
    return sent


def main() -> None:
    args = sglang_capture_args(__doc__, OUT)
    with tempfile.TemporaryDirectory() as tmp:
        streamer, version, *modes = load_streamer(args.sglang_wheel, Path(tmp))
        cases = [{"stream_interval": interval, "tokens": length,
                  "sent_after_each_piece": sent_after_each_piece(streamer, modes, interval, length)}
                 for interval, length in CASES]
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "sglang-stream-intervals.json"
    out.write_text(json.dumps({"sglang": version, "cases": cases}, indent=1) + "\n")
    print(f"wrote {out} (SGLang {version})")


if __name__ == "__main__":
    main()
