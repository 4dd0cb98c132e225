"""The edge's check that workers tokenise as it does: SGLang's /v1/tokenize as the emulated worker
serves it, the probe against real emulated workers on loopback (agreeing, byte, another chat
template, not up yet), and a whole deployment whose edge refuses the worker that disagrees and
serves a real tokenizer through the other."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompassd import certs
from kvcompassd.core.config import WorkerConfig, dump_config
from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings
from kvcompassd.launcher import DeploymentSpec, LocalDeployment, build_cluster, free_loopback_port
from kvcompassd.tokenizer import ByteTokenizer, load_tokenizer
from kvcompassd.tokenizer_check import (
    PROBE_MESSAGES,
    PROBE_TEXT,
    BadAnswer,
    EngineTokenization,
    TokenizerVerifier,
    WorkerUnreachable,
    answer_for_agent,
    compare_ids,
    judge,
    parse_tokenize_answer,
    probe_worker,
)
from kvcompassd.wire import Role, TokenizationRequested

DATA = Path(__file__).parent / "data" / "tokenizer-bpe"
ALT_TEMPLATE = DATA / "alt_chat_template.jinja"
REFERENCE = json.loads((DATA / "reference.json").read_text(encoding="utf-8"))


def emulator(port: int = 0, **overrides) -> EmulatedWorker:
    return EmulatedWorker(EmulatorSettings(port=port, kv_events_endpoint="tcp://127.0.0.1:*",
                                           kv_replay_endpoint="tcp://127.0.0.1:*", time_scale=0.0,
                                           vram_kv_tokens=4096, dram_kv_tokens=0, **overrides))


def worker_config(worker: EmulatedWorker | str, *, emulated: bool = True, wid: str = "us-0") -> WorkerConfig:
    http = worker if isinstance(worker, str) else worker.http_url
    return WorkerConfig(wid, "us", 0.1, 1.0, 4096, 0, http=http, emulated=emulated)


def test_comparison_names_the_first_difference():
    assert compare_ids("the text probe", [1, 2, 3], [1, 2, 3]) is None
    reason = compare_ids("the text probe", [1, 2, 3], [1, 5, 3, 4])
    assert reason == ("the text probe tokenises differently: 4 tokens at the worker vs 3 at the edge, "
                      "first difference at token 1 (worker 5, edge 2)")
    assert "token 2 (worker end, edge 3)" in compare_ids("p", [1, 2, 3], [1, 2])


def test_tokenize_answers_must_have_sglangs_shape():
    assert parse_tokenize_answer({"tokens": [1, 2], "count": 2, "max_model_len": 8}) == [1, 2]
    for bad in ([1, 2], {"tokens": [1, "2"], "count": 2}, {"tokens": [1, True], "count": 2},
                {"tokens": [1, 2], "count": 3}, {"count": 0}):
        with pytest.raises(BadAnswer):
            parse_tokenize_answer(bad)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
                     max_leaves=20)


@given(st.one_of(_JSON, st.fixed_dictionaries({"tokens": _JSON, "count": _JSON}),
                 st.lists(st.integers(), max_size=20).map(lambda t: {"tokens": t, "count": len(t)})))
def test_any_json_answer_is_either_token_ids_or_a_bad_answer(data):
    try:
        tokens = parse_tokenize_answer(data)
    except BadAnswer:
        return
    assert tokens == data["tokens"] and all(type(t) is int for t in tokens) and data["count"] == len(tokens)


def test_a_worker_marked_emulated_must_say_it_is_the_emulator():
    """A real engine never describes itself as the emulator, so `emulated = true` in the config
    cannot let the byte tokenizer (or anything) pass in front of it."""
    byte = ByteTokenizer()
    ids = (tuple(byte.encode(PROBE_TEXT)), tuple(byte.apply_chat_template(list(PROBE_MESSAGES))))
    real = EngineTokenization(*ids, emulator=False, tokenizer_path="/models/llama")
    verdict = judge(worker_config("http://10.0.0.1:30000"), byte, real)
    assert not verdict.agrees and "does not describe an emulated worker" in verdict.reason
    assert judge(worker_config("http://10.0.0.1:30000", emulated=False), byte, real).agrees
    assert judge(worker_config("http://10.0.0.1:30000"), byte, EngineTokenization(*ids, True, "byte-level")).agrees


async def test_an_agent_answers_for_its_engine_or_says_why_not():
    probe = TokenizationRequested("edge-us", PROBE_TEXT, {"messages": list(PROBE_MESSAGES)})
    worker = emulator()
    await worker.start()
    try:
        async with aiohttp.ClientSession() as s:
            answer = await answer_for_agent(s, worker_config(worker), probe)
            assert answer.text_ids == tuple(PROBE_TEXT.encode()) and answer.emulator and not answer.error
            assert answer.tokenizer_path == "byte-level"
            bad = await answer_for_agent(s, worker_config(worker), TokenizationRequested("edge-us", "x", {}))
            assert bad.error and not bad.unreachable and not bad.text_ids
            refused = await answer_for_agent(s, worker_config(worker), TokenizationRequested(
                "edge-us", "x", {"messages": [{"role": 3}]}))
            assert "answered HTTP 400" in refused.error and not refused.unreachable
            down = await answer_for_agent(s, worker_config(f"http://127.0.0.1:{free_loopback_port()}"), probe)
            assert down.unreachable and down.error
    finally:
        await worker.stop()


async def test_verifier_settles_after_the_grace_period_without_a_dead_worker():
    verdicts = []
    async with aiohttp.ClientSession() as s:
        dead = worker_config(f"http://127.0.0.1:{free_loopback_port()}")
        verifier = TokenizerVerifier([dead], lambda w: probe_worker(s, w, ByteTokenizer()), verdicts.append,
                                     grace_s=0.0, retry_s=(0.01, 0.05))
        task = asyncio.create_task(verifier.run())
        await asyncio.wait_for(verifier.settled.wait(), 60)  # readiness no longer waits for it...
        assert not task.done() and not verdicts  # ...but it is still withheld and still retried
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_emulated_worker_serves_sglangs_tokenize_routes():
    worker = emulator(tokenizer=str(DATA))
    await worker.start()
    bpe = load_tokenizer(str(DATA))
    try:
        async with aiohttp.ClientSession() as s:
            async def post(path, body, status=200):
                async with s.post(worker.http_url + path, json=body) as r:
                    assert r.status == status, await r.text()
                    return await r.json()

            case = REFERENCE["encode"][1]
            assert await post("/v1/tokenize", {"prompt": case["text"]}) == {
                "tokens": case["ids"], "count": len(case["ids"]), "max_model_len": 4096}
            plain = await post("/tokenize", {"prompt": [case["text"], "hi"], "add_special_tokens": False})
            assert plain["tokens"][0] == case["ids"][1:] and plain["count"] == [len(t) for t in plain["tokens"]]
            chat = next(c for c in REFERENCE["chats"] if not c["alt_template"] and c["add_generation_prompt"])
            assert (await post("/v1/tokenize", {"messages": chat["messages"]}))["tokens"] == chat["ids"]
            await post("/v1/tokenize", {"prompt": 7}, status=400)
            await post("/v1/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, status=400)
            # SGLang's TokenizeRequest: exactly one of prompt and messages; its refusals are the
            # flat OpenAI ErrorResponse (serving_base.create_error_response)
            for both_or_none in ({"prompt": "a", "messages": chat["messages"]}, {}):
                assert await post("/v1/tokenize", both_or_none, status=400) == {
                    "object": "error", "message": "Exactly one of 'prompt' or 'messages' must be provided.",
                    "type": "BadRequestError", "param": None, "code": 400}
            # add_generation_prompt given: the messages rendered as given, with it (Hugging Face's
            # apply_chat_template(tokenize=True)); a final assistant turn is not made a user one
            for given in (c for c in REFERENCE["chats"] if not c["alt_template"]):
                body = {"messages": given["messages"], "add_generation_prompt": given["add_generation_prompt"]}
                assert (await post("/v1/tokenize", body))["tokens"] == given["ids"]
            ending = next(c for c in REFERENCE["chats"] if not c["alt_template"]
                          and c["messages"][-1]["role"] == "assistant")
            # without it, as a chat completion: user, user -- which this template refuses
            refused = await post("/v1/tokenize", {"messages": ending["messages"]}, status=400)
            assert "Conversation roles must alternate" in refused["message"]
            assert await post("/v1/detokenize", {"tokens": case["ids"]}) == {"text": case["text"]}
            assert await post("/detokenize", {"tokens": [[], case["ids"]]}) == {"text": ["", case["text"]]}
            async with s.get(worker.http_url + "/model_info") as r:
                info = await r.json()
            assert info["tokenizer_path"] == str(DATA) and info["is_generation"] is True
            # The chat completion route runs the same tokens (its usage counts them).
            body = {"model": "m", "messages": chat["messages"], "max_tokens": 2}
            assert (await post("/v1/chat/completions", body))["usage"]["prompt_tokens"] == len(chat["ids"])
            assert bpe.apply_chat_template(chat["messages"]) == chat["ids"]
    finally:
        await worker.stop()


async def test_probe_accepts_an_agreeing_worker_and_refuses_others_with_a_reason():
    bpe = load_tokenizer(str(DATA))
    same, byte, other_chat = emulator(tokenizer=str(DATA)), emulator(), emulator(
        tokenizer=str(DATA), chat_template=str(ALT_TEMPLATE))
    for w in (same, byte, other_chat):
        await w.start()
    try:
        async with aiohttp.ClientSession() as s:
            verdict = await probe_worker(s, worker_config(same), bpe)
            assert verdict.agrees and verdict.worker == "us-0"
            # A byte worker: the text already disagrees; the reason says what the worker serves.
            verdict = await probe_worker(s, worker_config(byte, wid="us-1"), bpe)
            assert not verdict.agrees
            assert verdict.reason.startswith("the text probe tokenises differently: "
                                             f"{len(PROBE_TEXT.encode())} tokens at the worker vs "
                                             f"{len(bpe.encode(PROBE_TEXT))} at the edge")
            assert verdict.reason.endswith("the worker serves tokenizer 'byte-level'")
            # Same vocabulary, another chat template: only the chat probe catches it.
            verdict = await probe_worker(s, worker_config(other_chat), bpe)
            assert not verdict.agrees and verdict.reason.startswith("the chat probe tokenises differently")
            # The byte tokenizer at the edge agrees with a byte worker.
            assert (await probe_worker(s, worker_config(byte), ByteTokenizer())).agrees
            # A worker with no tokenize route (here: a path that serves nothing) is refused, not retried.
            verdict = await probe_worker(s, worker_config(byte.http_url + "/nothing-here"), ByteTokenizer())
            assert not verdict.agrees and "answered HTTP 404" in verdict.reason
            assert "the chat probe" not in PROBE_TEXT and len(PROBE_MESSAGES) == 4
    finally:
        for w in (same, byte, other_chat):
            await w.stop()


async def test_verifier_waits_for_a_worker_that_is_not_up_yet():
    port = free_loopback_port()
    verdicts = []
    async with aiohttp.ClientSession() as s:
        with pytest.raises(WorkerUnreachable):
            await probe_worker(s, worker_config(f"http://127.0.0.1:{port}"), ByteTokenizer())
        attempts = asyncio.Event()

        async def counted_sleep(delay):
            attempts.set()  # the verifier found it down and is backing off
            await asyncio.sleep(0)

        verifier = TokenizerVerifier([worker_config(f"http://127.0.0.1:{port}")],
                                     lambda w: probe_worker(s, w, ByteTokenizer()), verdicts.append,
                                     grace_s=3600, sleep=counted_sleep)
        task = asyncio.create_task(verifier.run())
        await attempts.wait()
        assert not verifier.settled.is_set() and not verdicts
        worker = emulator(port=port)
        await worker.start()
        try:
            await asyncio.wait_for(verifier.settled.wait(), 60)
            await task
        finally:
            await worker.stop()
    assert [(v.worker, v.agrees) for v in verdicts] == [("us-0", True)]


def test_edge_refuses_to_start_with_the_byte_tokenizer_before_real_engines(tmp_path):
    cfg = build_cluster(DeploymentSpec(workers={"us": 2}, one_way_ms={}, shards=1, wan=False))
    workers = (cfg.workers[0], replace(cfg.workers[1], emulated=False))  # us-1 is a real SGLang
    (tmp_path / "cluster.toml").write_text(dump_config(replace(cfg, workers=workers)))
    certs.init_ca(tmp_path, cluster_name=cfg.name)
    certs.issue(tmp_path, tmp_path, role=Role.EDGE, node_id="edge-us")
    run = subprocess.run([sys.executable, "-m", "kvcompassd", "edge", "--config", str(tmp_path / "cluster.toml"),
                          "--id", "edge-us", "--tls-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "edge edge-us refuses to start" in lines[0] and "us-1" in lines[0]


def test_a_missing_tokenizer_stops_the_edge_and_the_emulated_worker_before_they_serve(tmp_path):
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False,
                                       tokenizer=str(tmp_path / "no-such-model")))
    (tmp_path / "cluster.toml").write_text(dump_config(cfg))
    certs.init_ca(tmp_path, cluster_name=cfg.name)
    certs.issue(tmp_path, tmp_path, role=Role.EDGE, node_id="edge-us")
    common = ["--config", str(tmp_path / "cluster.toml"), "--log-json"]
    for argv in (["edge", "--id", "edge-us", "--tls-dir", str(tmp_path)],
                 ["emulate-worker", "--id", "us-0", "--tokenizer", str(tmp_path / "no-such-model")]):
        run = subprocess.run([sys.executable, "-m", "kvcompassd", argv[0], *common, *argv[1:]],
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 2, run.stderr
        assert "no-such-model" in run.stderr and "cannot load" in run.stderr


def test_the_emulated_worker_tokenises_with_the_clusters_tokenizer_unless_told_otherwise(tmp_path):
    # Its systemd unit passes no --tokenizer: it must read [tokenizer] as the edges do, or every
    # edge refuses it. A missing directory there stops it, named, before it serves.
    cfg = build_cluster(DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False,
                                       tokenizer=str(tmp_path / "no-such-model")))
    (tmp_path / "cluster.toml").write_text(dump_config(cfg))
    run = subprocess.run([sys.executable, "-m", "kvcompassd", "emulate-worker", "--config", str(tmp_path / "cluster.toml"),
                          "--id", "us-0", "--log-json"], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "no-such-model" in run.stderr, run.stderr


@pytest.fixture
async def refusing_deployment(tmp_path):
    # The cluster names the BPE. us-1's engine runs the byte tokenizer (a worker serving the wrong
    # model); eu-1's the same vocabulary with another chat template. The us edge checks us-1 over
    # HTTP and eu-1 through eu-1's agent.
    spec = DeploymentSpec(workers={"us": 2, "eu": 2}, one_way_ms={("us", "eu"): 5.0}, shards=1, wan=False,
                          tokenizer=str(DATA))
    dep = LocalDeployment(spec, tmp_path, time_scale=0.0,
                          node_args={"emulate-worker:us-1": ("--tokenizer", "byte"),
                                     "emulate-worker:eu-1": ("--chat-template", str(ALT_TEMPLATE))})
    async with dep:
        yield dep


def _refusals(dep, edge: str) -> dict[str, str]:
    log = (dep.workdir / "logs" / f"{edge}.edge.log").read_text()
    lines = [json.loads(line) for line in log.splitlines() if "worker refused" in line]
    refusals = {line["worker"]: line["reason"] for line in lines}
    assert len(refusals) == len(lines), "one line per refused worker"
    return refusals


async def test_edges_refuse_the_disagreeing_workers_and_serve_the_real_tokenizer(refusing_deployment):
    dep = refusing_deployment
    async with aiohttp.ClientSession() as s:
        for region in ("us", "eu"):
            async with s.get(dep.edge_url(region) + "/health") as r:
                health = await r.json()
            assert health["ready"] and health["tokenizer_checked"]
            assert health["workers_refused"] == ["eu-1", "us-1"]
        chat = next(c for c in REFERENCE["chats"] if not c["alt_template"] and c["add_generation_prompt"])
        served = set()
        for i in range(8):
            messages = chat["messages"] if i == 0 else [*chat["messages"], {"role": "assistant", "content": "ok"},
                                                          {"role": "user", "content": f"turn {i}"}]
            async with s.post(dep.edge_url("us") + "/v1/chat/completions",
                              json={"model": "kvcompass-demo", "messages": messages, "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            # Only agreeing workers serve, and they ran Hugging Face's ids for this chat.
            served.add(body["kvcompass"]["worker"])
            if i == 0:
                assert body["usage"]["prompt_tokens"] == len(chat["ids"])
        assert served <= {"us-0", "eu-0"}
    for edge in ("edge-us", "edge-eu"):
        refusals = _refusals(dep, edge)
        assert set(refusals) == {"us-1", "eu-1"}
        assert refusals["us-1"].startswith("the text probe tokenises differently")
        assert refusals["us-1"].endswith("the worker serves tokenizer 'byte-level'")
        assert refusals["eu-1"].startswith("the chat probe tokenises differently")
