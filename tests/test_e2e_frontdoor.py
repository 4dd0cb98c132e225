"""The front door's limits on a real ``kvcompassd edge`` process (one region, one emulated worker,
one maintenance unit on loopback), set through ``--frontdoor-limit``: each class of hostile
input is refused with a JSON error, counted in ``/metrics``, and leaves the edge serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import re

import aiohttp
import openai
import pytest
import pytest_asyncio

from kvcompassd.frontdoor import ROUTES
from kvcompassd.launcher import DeploymentSpec, LocalDeployment

SPEC = DeploymentSpec(workers={"us": 1}, one_way_ms={}, shards=1, wan=False)
LIMITS = {"header_timeout_s": 0.5, "body_timeout_s": 6.0, "max_body_bytes": 256 << 10,
          "body_budget_bytes": 1 << 20, "max_json_depth": 16}
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def dep(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-frontdoor")
    keys = root / "api-keys"
    keys.write_text("sk-good\n")
    args = ["--api-keys-file", str(keys)]
    for name, value in LIMITS.items():
        args += ["--frontdoor-limit", f"{name}={value}"]
    d = LocalDeployment(SPEC, root / "run", time_scale=0.0, edge_args=tuple(args))
    async with d:
        yield d


AUTH = {"Authorization": "Bearer sk-good"}


def address(dep) -> tuple[str, int]:
    host, _, port = dep.cfg.edges_in("us")[0].http.rpartition(":")
    return host, int(port)


async def metrics(dep) -> str:
    async with aiohttp.ClientSession() as s, s.get(dep.edge_url("us") + "/metrics") as r:
        return await r.text()


def refusals(text: str, reason: str) -> float:
    match = re.search(rf'kvcompass_frontdoor_refusals_total{{reason="{reason}"}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = int(re.search(r"(?i)content-length: (\d+)", head).group(1))
    return int(head.split()[1]), json.loads(await reader.readexactly(length))


async def test_slowloris_gets_a_json_408_from_the_edge_process(dep):
    before = refusals(await metrics(dep), "header_timeout")
    reader, writer = await asyncio.open_connection(*address(dep))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    status, body = await read_response(reader)
    writer.close()
    assert status == 408 and body["error"]["code"] == "header_timeout"
    assert refusals(await metrics(dep), "header_timeout") == before + 1


async def test_hostile_bodies_are_400s_and_413s_never_500s(dep):
    url = dep.edge_url("us") + "/generate"
    cases = [
        (b"[" * 50000 + b"]" * 50000, {}, 400, "json_too_deep"),
        (b'{"text": "a", "sampling_params": {"temperature": NaN}}', {}, 400, "invalid_number"),
        (gzip.compress(b'{"text": "' + b"a" * (8 << 20) + b'"}'), {"Content-Encoding": "gzip"}, 413,
         "request_too_large"),
        (json.dumps({"text": "a", "sampling_params": {"sampling_seed": 2**64}}).encode(), {}, 400, "invalid_value"),
        (json.dumps({"text": "a", "sampling_params": {"custom_params": {"a": [[[[[[1]]]]]]}}}).encode(), {}, 400,
         "invalid_value"),
    ]
    async with aiohttp.ClientSession(headers=AUTH) as s:
        for data, headers, status, code in cases:
            async with s.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
                body = await r.json()
                assert (r.status, body["error"]["code"]) == (status, code), body
        async with s.post(url, json={"text": "still serving", "sampling_params": {"max_new_tokens": 2}}) as r:
            assert r.status == 200 and len((await r.json())["output_ids"]) == 2


async def test_stalled_uploads_are_held_within_the_budget(dep):
    host, port = address(dep)
    uploads = []
    for _ in range(8):  # 8 x 192 KiB against a 1 MiB budget
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-good\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 250000\r\n\r\n" + b" " * (192 << 10))
        uploads.append((reader, writer))
    # Every stalled upload ends in a JSON refusal: 503 while the budget is full, else 408 at the
    # body deadline; none is a 500 or left hanging.
    answers = await asyncio.wait_for(asyncio.gather(*(read_response(reader) for reader, _ in uploads)), 60)
    for status, body in answers:
        assert (status, body["error"]["code"]) in ((503, "server_busy"), (408, "body_timeout")), body
    text = await metrics(dep)
    assert refusals(text, "body_budget") >= sum(status == 503 for status, _ in answers) >= 1
    held = float(re.search(r"^kvcompass_frontdoor_buffered_body_bytes (\S+)$", text, re.MULTILINE).group(1))
    assert held == 0  # all given back
    for _, writer in uploads:
        writer.close()


async def test_refused_random_paths_do_not_become_metric_labels(dep):
    async with aiohttp.ClientSession() as s:
        for i in range(500):
            async with s.post(f"{dep.edge_url('us')}/x{i}/{i * 7919}") as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    routes = set(re.findall(r'kvcompass_requests_total{route="([^"]*)"', await metrics(dep)))
    assert routes <= set(ROUTES) and "other" in routes


async def test_an_openai_client_sees_model_not_found(dep):
    def call():
        client = openai.OpenAI(base_url=dep.edge_url("us") + "/v1", api_key="sk-good", max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="not-this-one", prompt="hi", max_tokens=1)
        return caught.value.code

    assert await asyncio.to_thread(call) == "model_not_found"
