"""End to end through real daemon processes on loopback: maintenance units, edges, agents and
emulated SGLang workers, QUIC with mutual TLS, cross-region traffic through WAN relays.

One deployment serves the whole module (starting one costs seconds); tests use distinct
prompts so they do not see each other's caches.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import pytest_asyncio

from e2e_helpers import lists_worker, admin, assert_views_converged, doc, eventually, generate
from kvcompassd.launcher import DeploymentSpec, LocalDeployment, free_loopback_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

# 16 fingerprint bits: assertions about who claims a prefix must not meet a keyless false hit
# (tools/bench_false_hits.py measures those; here they would only make tests flaky).
SPEC = DeploymentSpec(workers={"us": 2, "eu": 2}, one_way_ms={("us", "eu"): 10.0}, shards=2,
                      prefill_ms_per_token=0.05, decode_ms_per_token=1.0, fingerprint_bits=16)
BLOCK = SPEC.block_size
MNT0_METRICS = f"127.0.0.1:{free_loopback_port()}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    # us-1's engine speaks the older positional event encoding; eu-1's agent loses half of its
    # engine's live event batches and must recover them through the replay socket.
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("e2e"), time_scale=1.0,
                        node_args={"emulate-worker:us-1": ("--kv-events-style", "positional"),
                                   "agent:eu-1": ("--chaos-drop-engine-batches", "0.5"),
                                   "maintenance:mnt-0": ("--metrics", MNT0_METRICS)})
    async with d:
        yield d


async def test_openai_client_is_served_with_the_serving_worker_reported(dep):
    def call():
        client = openai.OpenAI(base_url=dep.edge_url("us") + "/v1", api_key="unused")
        comp = client.completions.create(model="kvcompass-demo", prompt=doc(1, 300), max_tokens=5)
        chat = client.chat.completions.create(model="kvcompass-demo", max_tokens=3,
                                              messages=[{"role": "user", "content": doc(2, 200)}])
        stream = list(client.completions.create(model="kvcompass-demo", prompt=doc(3, 200), max_tokens=4, stream=True))
        return comp, chat, stream

    comp, chat, stream = await asyncio.to_thread(call)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5
    assert comp.model_extra["kvcompass"]["worker"] in ("us-0", "us-1", "eu-0", "eu-1")
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 3
    assert "".join(c.choices[0].text for c in stream) and stream[-1].choices[0].finish_reason == "length"


async def test_shared_prefix_goes_to_its_holder_and_cached_tokens_are_true(dep):
    shared = doc(10, 1200)
    first = (await generate(dep, "us", shared + " first question"))["meta_info"]
    holder = first["kvcompass"]["worker"]
    assert first["cached_tokens"] == 0

    async def registered():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " second question"})
        return body if any(h["worker"] == holder for h in body["holders"]) else None

    await eventually(registered)
    second = (await generate(dep, "us", shared + " second question"))["meta_info"]
    assert second["kvcompass"]["worker"] == holder
    # The emulated engine caches whole blocks: the truth is the block-aligned common prefix.
    common = len(shared) + len(" ")
    assert second["cached_tokens"] == (common // BLOCK) * BLOCK
    assert 0 < second["kvcompass"]["claimed_tokens"] <= second["cached_tokens"]


async def test_remote_region_reuses_a_long_prefix_across_the_wan(dep):
    shared = doc(20, 4000)
    first = (await generate(dep, "eu", shared + " one"))["meta_info"]
    holder = first["kvcompass"]["worker"]
    assert holder.startswith("eu-")

    async def visible_from_us():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " two"})
        return body if any(h["worker"] == holder for h in body["holders"]) else None

    await eventually(visible_from_us)

    async def holder_idle_as_seen_from_us():
        # The holder was busy with the first request; wait until its queue vector says idle.
        queues = {q["worker"]: q["queue_ms"] for q in (await admin(dep, "edge-us", "queues"))["workers"]}
        return queues[holder] == 0.0

    await eventually(holder_idle_as_seen_from_us)
    meta = (await generate(dep, "us", shared + " two"))["meta_info"]
    # 20 ms RTT at 0.05 ms/token: n1 = 400 tokens, levels up to 1408; crediting 1408 tokens
    # (70 ms of prefill) beats the 20 ms round trip, and the worker then reuses all it has.
    assert meta["kvcompass"]["worker"] == holder
    assert meta["cached_tokens"] >= 3900


async def test_loaded_holder_loses_to_an_idle_worker(dep):
    shared = doc(30, 2000)
    holder = (await generate(dep, "us", shared + " warm"))["meta_info"]["kvcompass"]["worker"]
    other = "us-1" if holder == "us-0" else "us-0"
    holder_url = dep.cfg.worker(holder).http

    async def visible():
        body = await admin(dep, "edge-us", "holders", {"text": shared + " q"})
        return any(h["worker"] == holder for h in body["holders"])

    await eventually(visible)
    # Queue ~8 x 6000 tokens x 0.05 ms = 2.4 s of prefill straight onto the holder.
    async with aiohttp.ClientSession() as s:
        async def direct(i):
            async with s.post(holder_url + "/generate", json={"input_ids": [(i * 7 + j) % 250 for j in range(6000)],
                                                              "sampling_params": {"max_new_tokens": 1}}) as r:
                await r.read()

        load = [asyncio.create_task(direct(i)) for i in range(8)]

        async def holder_reported_busy():
            body = await admin(dep, "edge-us", "queues")
            q = {w["worker"]: w["queue_ms"] for w in body["workers"]}
            return q[holder] > 500

        await eventually(holder_reported_busy, timeout=5)
        meta = (await generate(dep, "us", shared + " while busy"))["meta_info"]
        await asyncio.gather(*load)
    assert meta["kvcompass"]["worker"] != holder
    assert meta["kvcompass"]["worker"] == other or meta["kvcompass"]["region"] == "eu"


async def test_the_edge_learns_from_the_agent_when_a_workers_vram_frees_up(dep):
    # A 4,000-token prompt decoding 3,000 tokens (1 ms each) holds its KV on us-1 for ~3 s:
    # the emulator's /v1/loads says until when (room_steps), the agent sends it with its load
    # report (WorkerRoomReported) and the edge keeps it for the score (QueueEstimates.set_room).
    url = dep.cfg.worker("us-1").http
    async with aiohttp.ClientSession() as s:
        async def direct():
            async with s.post(url + "/generate", json={"input_ids": [(j * 13) % 250 for j in range(4000)],
                                                      "sampling_params": {"max_new_tokens": 3000}}) as r:
                await r.read()

        running = asyncio.create_task(direct())

        async def pinned(edge="edge-us"):
            body = await admin(dep, edge, "queues")
            room = {w["worker"]: w["room"] for w in body["workers"]}["us-1"]
            return room if room is not None and room[0][1] < room[-1][1] else None

        room = await eventually(pinned, timeout=5)
        # ... and sends it on to the other region's edge with its queue vector (RoomVectorBroadcast)
        abroad = await eventually(lambda: pinned("edge-eu"), timeout=5)
        await running
    assert room[-1][1] - room[0][1] >= 4000 - 16 and 0.0 < room[-1][0] <= 3500.0
    assert abroad[-1][1] - abroad[0][1] >= 4000 - 16 and 0.0 < abroad[-1][0] <= 3500.0


async def test_evicted_prefix_stops_attracting_requests(dep):
    shared = doc(40, 1500)
    holder = (await generate(dep, "eu", shared + " a"))["meta_info"]["kvcompass"]["worker"]

    async def holders():
        return (await admin(dep, "edge-eu", "holders", {"text": shared + " b"}))["holders"]

    await eventually(lambda: lists_worker(holders, holder))
    async with aiohttp.ClientSession() as s:
        async with s.post(dep.cfg.worker(holder).http + "/flush_cache") as r:
            assert r.status == 200

    async def gone():
        return not any(h["worker"] == holder for h in await holders())

    await eventually(gone)
    meta = (await generate(dep, "eu", shared + " c"))["meta_info"]
    assert meta["kvcompass"]["claimed_tokens"] == 0


async def test_every_edge_view_equals_the_maintenance_units_exact_state(dep):
    # A burst of distinct prompts straight to the engines: block events -> agents -> shards.
    async with aiohttp.ClientSession() as s:
        async def direct(w, i):
            async with s.post(dep.cfg.worker(w).http + "/generate",
                              json={"text": doc(1000 + i, 400 + 37 * i), "sampling_params": {"max_new_tokens": 1}}) as r:
                await r.read()

        await asyncio.gather(*(direct(w.id, i) for i, w in enumerate(dep.cfg.workers * 6)))
    await assert_views_converged(dep)
    # Positional events were decoded (us-1 registered keys) and eu-1's lost batches replayed.
    us1 = await admin(dep, "us-1", "status")
    eu1 = await admin(dep, "eu-1", "status")
    assert us1["registered_keys"] > 0
    assert eu1["engine_replays"] > 0 and eu1["registered_keys"] > 0


async def test_late_edge_converges_from_snapshots(dep):
    dep.kill("edge", "edge-eu")
    async with aiohttp.ClientSession() as s:
        async def direct(i):
            async with s.post(dep.cfg.worker("us-0").http + "/generate",
                              json={"text": doc(2000 + i, 500), "sampling_params": {"max_new_tokens": 1}}) as r:
                await r.read()
        await asyncio.gather(*(direct(i) for i in range(5)))
    dep.restart("edge", "edge-eu")
    await dep.wait_ready(60)
    await assert_views_converged(dep, edges=dep.cfg.edges_in("eu"))


async def test_request_id_is_in_the_response_and_in_edge_and_agent_logs(dep):
    shared = doc(50, 3000)
    await generate(dep, "eu", shared + " x")  # an eu holder, so the us request crosses the WAN
    async with aiohttp.ClientSession() as s:
        async with s.post(dep.edge_url("us") + "/generate", headers={"X-Request-Id": "trace-me-42"},
                          json={"text": shared + " y", "sampling_params": {"max_new_tokens": 2}}) as r:
            body = await r.json()
    assert r.headers["X-Request-Id"] == "trace-me-42" and body["meta_info"]["id"] == "trace-me-42"
    worker = body["meta_info"]["kvcompass"]["worker"]
    logs = dep.workdir / "logs"

    async def logged():
        edge = (logs / "edge-us.edge.log").read_text()
        agent = (logs / f"{worker}.agent.log").read_text() if worker.startswith("eu") else "trace-me-42"
        return "trace-me-42" in edge and "trace-me-42" in agent

    await eventually(logged, timeout=5)


async def test_metrics_count_decisions_and_sync(dep):
    await generate(dep, "us", doc(51, 500))  # at least one decision, whatever ran before
    async with aiohttp.ClientSession() as s:
        async with s.get(dep.edge_url("us") + "/metrics") as r:
            text = await r.text()
    assert r.status == 200
    assert 'kvcompass_decisions_total{outcome="local_hit"}' in text or 'kvcompass_decisions_total{outcome="recompute"}' in text
    assert "kvcompass_decision_seconds_bucket" in text and "kvcompass_update_batches_applied_total" in text
    # The queue estimates' per-region corrections, set with every broadcast round.
    for region in set(dep.cfg.region_names()) - {"us"}:
        assert f'kvcompass_queue_correction_ms{{region="{region}"}}' in text
        assert f'kvcompass_queue_herd_factor{{region="{region}"}} 1.0' in text
    # Hot-family misses by trigger and outcome, read from the Router when scraped: every pair
    # is exported, with the counts the admin 'migrations' query shows (no decision in between).
    hot = (await admin(dep, "edge-us", "migrations"))["hot_prefix_misses"]
    assert {(h["trigger"], h["outcome"]) for h in hot} == {
        (t, o) for t in ("copy", "recompute") for o in ("planned", "no_idle_worker", "no_remote_match")}
    async with aiohttp.ClientSession() as s:
        async with s.get(dep.edge_url("us") + "/metrics") as r:
            text = await r.text()
    for h in hot:
        sample = f'kvcompass_hot_prefix_misses_total{{outcome="{h["outcome"]}",trigger="{h["trigger"]}"}}'
        assert f"{sample} {float(h['misses'])}" in text


async def test_maintenance_metrics_show_each_groups_entries_and_load(dep):
    await generate(dep, "us", doc(52, 600))  # entries in both shards, whatever ran before

    async def scrape():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{MNT0_METRICS}/metrics") as r:
                assert r.status == 200
                text = await r.text()
        samples = {}
        for line in text.splitlines():
            if line.startswith(("kvcompass_shard_entries{", "kvcompass_shard_table_load{")):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples if any(v > 0 for k, v in samples.items() if k.startswith("kvcompass_shard_entries")) else None

    samples = await eventually(scrape, timeout=10)
    status = await admin(dep, "mnt-0", "status")
    for table in status["tables"]:  # the same figures the admin status shows, group by group
        labels = f'{{group="{table["group"]}",region="{table["region"]}"}}'
        assert f"kvcompass_shard_entries{labels}" in samples and f"kvcompass_shard_table_load{labels}" in samples
    loads = [v for k, v in samples.items() if k.startswith("kvcompass_shard_table_load")]
    assert all(0.0 <= v < 1.0 for v in loads) and any(v > 0.0 for v in loads)


async def test_kvcompassctl_cli_reports_a_running_deployment(dep):
    import subprocess
    import sys

    config = dep.configs["us"]

    async def ctl(*args):
        # In a thread: this process's event loop runs the WAN relays the CLI's packets cross.
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "kvcompassd.ctl", "--config", str(config), "--tls-dir",
                             str(dep.tls_dir), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    status = await ctl("edge-us", "status")
    assert "edge-us" in status and "bits_per_entry" in status
    views = json.loads(await ctl("edge-us", "views", "--json"))["views"]
    assert {v["shard"] for v in views} == {0, 1} and all(v["seq"] >= 0 for v in views)
    levels = json.loads(await ctl("edge-us", "levels", "--json"))
    assert levels["toward"]["us"][0] == SPEC.same_region_min_tokens
    queue_body = json.loads(await ctl("edge-us", "queues", "--json"))
    queues = queue_body["workers"]
    assert set(queue_body["correction_ms"]) == set(dep.cfg.region_names()) - {"us"}
    assert all(ms >= 0.0 for ms in queue_body["correction_ms"].values())
    assert set(queue_body["herd_factor"]) == set(queue_body["correction_ms"])
    assert all(k >= 1.0 for k in queue_body["herd_factor"].values())
    assert {q["worker"] for q in queues} == {w.id for w in dep.cfg.workers}
    assert all(q["trend_ms_per_ms"] == -1.0 for q in queues if q["region"] == "us")  # own region drains
    assert all(q["trend_ms_per_ms"] >= -1.0 for q in queues)
    shared = doc(60, 1000)
    await generate(dep, "us", shared + " p")

    async def holders():
        body = json.loads(await ctl("edge-us", "holders", "--text", shared + " q", "--json"))
        return body if body["holders"] else None

    body = await eventually(holders)
    assert body["candidates"][0]["total_ms"] >= 0 and "wan_ms" in body["candidates"][0]
    assert "shard" in await ctl("mnt-0") and "incarnation" in await ctl("us-0")
    assert "belief" in await ctl("edge-eu", "beliefs")
