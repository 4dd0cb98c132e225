"""kvcompassctl: its certificate flow, its renderings, and the real command against a running
deployment: every query, and every error as one line on stderr with a non-zero status."""

from __future__ import annotations

import asyncio
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from kvcompassd import certs
from kvcompassd.certs import load_certificate, peer_identity
from kvcompassd.core.config import dump_config
from kvcompassd.ctl import QUERIES, AdminSession, NodeUnreachable, QueryRefused, main, query, render, table
from kvcompassd.launcher import DeploymentSpec, LocalDeployment, free_loopback_port
from kvcompassd.wire import NodeIdentity, Role


def test_certs_init_then_issue_and_rotate(tmp_path, capsys):
    assert main(["certs", "init", "--dir", str(tmp_path), "--cluster", "prod"]) == 0
    assert (tmp_path / "ca.pem").exists() and (tmp_path / "ca.key").stat().st_mode & 0o077 == 0
    assert main(["certs", "issue", "--dir", str(tmp_path), "--role", "edge", "--id", "edge-us", "--san", "10.0.0.5"]) == 0
    first = load_certificate(tmp_path / "edge-us.pem")
    assert peer_identity(first) == NodeIdentity(Role.EDGE, "edge-us")
    # Rotation: issuing again replaces the key and certificate under the same CA.
    assert main(["certs", "issue", "--dir", str(tmp_path), "--role", "edge", "--id", "edge-us"]) == 0
    assert load_certificate(tmp_path / "edge-us.pem").serial_number != first.serial_number
    # A second CA in the same directory is refused rather than locking every node out.
    assert main(["certs", "init", "--dir", str(tmp_path), "--cluster", "other"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bad_node_id_is_refused_with_a_message(tmp_path, capsys):
    main(["certs", "init", "--dir", str(tmp_path), "--cluster", "c"])
    assert main(["certs", "issue", "--dir", str(tmp_path), "--role", "agent", "--id", "bad id!"]) == 2
    assert "node id" in capsys.readouterr().err


def test_renderings_are_tables():
    out = table([{"worker": "us-0", "queue_ms": 1.5, "age_s": None}])
    lines = out.splitlines()
    assert lines[0].split() == ["worker", "queue_ms", "age_s"] and lines[2].split() == ["us-0", "1.5", "-"]
    holders = render("holders", {"prompt_tokens": 10, "lambda": 0.0, "chosen": "us-0",
                                 "holders": [{"worker": "us-0", "region": "us", "matched": 64, "tier": "VRAM"}],
                                 "candidates": [{"worker": "us-0", "total_ms": 1.0}]})
    assert "chosen: us-0" in holders and "VRAM" in holders
    assert "pending" not in holders
    holders = render("holders", {"prompt_tokens": 10, "lambda": 0.0, "chosen": "us-1", "holders": [],
                                 "pending": [{"worker": "us-1", "region": "us", "matched": 64, "view_matched": 0}],
                                 "candidates": [{"worker": "us-1", "total_ms": 1.0}]})
    assert "not yet in the view (pending)" in holders and "view_matched" in holders
    queues = render("queues", {"workers": [{"worker": "eu-0", "queue_ms": 12.0}], "correction_ms": {"eu": 3.5}})
    assert "eu-0" in queues and "selection correction" in queues and queues.splitlines()[-1].split() == ["eu", "3.5"]
    queues = render("queues", {"workers": [], "correction_ms": {"eu": 3.5}, "herd_factor": {"eu": 2.25}})
    assert queues.splitlines()[-1].split() == ["eu", "3.5", "2.25"]
    migrations = render("migrations", {"migrations": [], "hot_prefix_misses": [
        {"trigger": "recompute", "outcome": "no_idle_worker", "misses": 7}]})
    assert migrations.splitlines()[0] == "(none)" and "hot prefix families" in migrations
    assert migrations.splitlines()[-1].split() == ["recompute", "no_idle_worker", "7"]


# -- the real kvcompassctl against a running deployment ----------------------------------------
#
# No WAN relays (wan=False): nothing of the deployment runs in this process, so the CLI runs as a
# plain subprocess and the fixture needs no event loop between tests.

SPEC = DeploymentSpec(workers={"us": 1, "eu": 1}, one_way_ms={("us", "eu"): 10.0}, shards=1, wan=False,
                      prefill_ms_per_token=0.01, decode_ms_per_token=0.1)


MNT_METRICS = f"127.0.0.1:{free_loopback_port()}"
AGENT_METRICS = f"127.0.0.1:{free_loopback_port()}"


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = LocalDeployment(SPEC, tmp_path_factory.mktemp("ctl"), time_scale=0.0,
                        node_args={"maintenance:mnt-0": ("--metrics", MNT_METRICS),
                                   "agent:eu-0": ("--metrics", AGENT_METRICS)})
    asyncio.run(d.start())
    try:
        yield d
    finally:
        asyncio.run(d.stop())


def ctl(*args: str, config: Path | None = None, tls_dir: Path | None = None, dep=None) -> subprocess.CompletedProcess:
    head = []
    if dep is not None:
        head = ["--config", str(config or dep.configs["us"]), "--tls-dir", str(tls_dir or dep.tls_dir)]
    return subprocess.run([sys.executable, "-m", "kvcompassd.ctl", *head, *args], capture_output=True, text=True,
                          timeout=120, check=False)


def assert_fails(out: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    """An error: the given exit status, and one line on stderr naming the reason."""
    assert out.returncode == status, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("kvcompassctl: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert out.stdout == ""


def test_help_lists_every_query_of_every_role_one_line_each():
    out = ctl("--help")
    assert out.returncode == 0 and out.stderr == ""
    for role, queries in QUERIES.items():
        for name, line in queries.items():
            assert f"  {name}" in out.stdout and line.split()[0] in out.stdout, (role, name)
    assert "exit status" in out.stdout
    query_help = ctl("query", "--help")
    assert query_help.returncode == 0 and all(q in query_help.stdout for q in QUERIES[Role.EDGE])


def test_subcommand_help_shows_the_subcommands_own_usage():
    for args, usage in ((("certs", "--help"), "usage: kvcompassctl certs [-h]"),
                        (("certs", "issue", "--help"), "usage: kvcompassctl certs issue [-h]"),
                        (("query", "--help"), "usage: kvcompassctl query [-h]")):
        out = ctl(*args)
        assert out.returncode == 0 and out.stdout.startswith(usage), out.stdout[:300]


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(tmp_path, timeout):
    # Checked before the config is read (it does not exist here): no traceback from the transport.
    out = ctl("--config", str(tmp_path / "absent.toml"), "--tls-dir", str(tmp_path), "--timeout", timeout, "edge-us")
    assert_fails(out, 2, "--timeout")


def test_holders_takes_one_prompt_not_both(tmp_path):
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    out = ctl("--config", str(tmp_path / "absent.toml"), "--tls-dir", str(tmp_path), "edge-us", "holders",
              "--text", "a prompt", "--tokens-file", str(tmp_path / "ids.json"))
    assert_fails(out, 2, "--tokens-file", "--text")


def test_each_role_answers_its_queries(dep):
    for what in QUERIES[Role.EDGE]:
        args = ("--text", "what does the document say") if what == "holders" else ()
        out = ctl("edge-us", what, *args, dep=dep)
        assert out.returncode == 0 and out.stderr == "" and out.stdout.strip(), (what, out.stderr)
    assert "shard" in ctl("mnt-0", "status", dep=dep).stdout
    assert "engine_up" in ctl("us-0", dep=dep).stdout


def test_edge_views_report_the_entries_their_shard_holds_and_bits_per_entry(dep):
    body = json.dumps({"text": "z" * 600, "sampling_params": {"max_new_tokens": 2}}).encode()
    request = urllib.request.Request(dep.edge_url("us") + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200

    def shard_and_view_entries():
        # edge-us follows the us stream (the lengths a us edge looks up, the prompt's among them):
        # its views are that stream's tables.
        tables = json.loads(ctl("mnt-0", "--json", dep=dep).stdout)["streams"]["us"]["tables"]
        views = json.loads(ctl("edge-us", "views", "--json", dep=dep).stdout)["views"]
        return ({t["group"]: t["entries"] for t in tables}, {v["group"]: v["entries"] for v in views}, views)

    deadline = time.monotonic() + 60
    while True:  # until the batches carrying the prompt's entries reached the edge
        shard, view, rows = shard_and_view_entries()
        if sum(shard.values()) > 0 and shard == view:
            break
        assert time.monotonic() < deadline, (shard, view)
        time.sleep(0.2)
    for row in rows:
        if row["entries"]:
            assert row["bits_per_entry"] == round(8 * row["memory_bytes"] / row["entries"], 1)
    assert "entries_at_snapshot" not in ctl("edge-eu", "views", dep=dep).stdout


def _sample(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url, timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):  # name carries its labels
                return float(line.rsplit(" ", 1)[1])
    return None


def test_the_views_sync_position_is_exported_beside_the_shards(dep):
    # The dashboard's sync lag is the shard's seq minus each view's: both series must exist and
    # agree once the views caught up (the previous test's prompt put batches through).
    deadline = time.monotonic() + 60
    while True:
        # Each edge follows its region's stream; the unit exports every stream's position.
        shards = [_sample(f"http://{MNT_METRICS}/metrics", f'kvcompass_shard_seq{{shard="0",stream="{r}"}}')
                  for r in ("us", "eu")]
        views = [_sample(dep.edge_url(r) + "/metrics", f'kvcompass_view_seq{{shard="0",stream="{r}"}}')
                 for r in ("us", "eu")]
        if None not in shards and max(shards) > 0 and views == shards:
            break
        assert time.monotonic() < deadline, (shards, views)
        time.sleep(0.2)
    epoch = _sample(f"http://{MNT_METRICS}/metrics", 'kvcompass_shard_epoch{shard="0",stream="us"}')
    assert epoch == _sample(dep.edge_url("us") + "/metrics", 'kvcompass_view_epoch{shard="0",stream="us"}') and epoch > 0


def test_an_agents_engine_queue_is_exported_with_its_worker_and_region(dep):
    # The dashboard's per-region queue panel sums by region: the agent says which, with no
    # label in the operator's scrape config.
    assert _sample(f"http://{AGENT_METRICS}/metrics", 'kvcompass_engine_queue_ms{region="eu",worker="eu-0"}') is not None


def test_a_query_outside_the_nodes_role_is_refused_not_answered_with_its_status(dep):
    assert_fails(ctl("us-0", "holders", "--text", "x", dep=dep), 2, "us-0", "agent", "holders")
    assert_fails(ctl("mnt-0", "views", dep=dep), 2, "mnt-0", "maintenance", "views")
    assert_fails(ctl("edge-us", "levels", "--text", "x", dep=dep), 2, "--text")
    assert_fails(ctl("edge-us", "bogus", dep=dep), 2, "bogus")
    assert_fails(ctl("nobody", dep=dep), 2, "no node 'nobody'", "edge-us")


async def test_the_nodes_themselves_refuse_queries_of_other_roles(dep):
    # What the CLI checks first, the nodes check too (another client, an older kvcompassctl).
    for node, what in (("mnt-0", "views"), ("us-0", "holders"), ("edge-us", "entries")):
        with pytest.raises(QueryRefused, match=f"unknown query '{what}'"):
            await query(dep.cfg, dep.tls_dir, "admin", node, what, {})
    with pytest.raises(QueryRefused, match="tokens must be"):
        await query(dep.cfg, dep.tls_dir, "admin", "edge-us", "holders", {"tokens": ["a"]})


async def test_an_admin_session_asks_many_queries_over_one_connection(dep):
    async with AdminSession(dep.cfg, dep.tls_dir, "admin", "edge-us") as edge:
        first = await edge.ask("queues")
        # a refused query is that query's error; the connection carries the next one
        with pytest.raises(QueryRefused, match="unknown query 'entries'"):
            await edge.ask("entries")
        second = await edge.ask("queues")
        status = await edge.ask("status")
    assert {q["worker"] for q in first["workers"]} == {q["worker"] for q in second["workers"]} == {"us-0", "eu-0"}
    assert status["mode"] == "edge"
    # `kvcompassd edge` makes its views on huge pages, and they are there
    huge = status["huge_page_views"]
    assert huge["enabled"] and huge["live"] > 0 and huge["reserved"] >= huge["live"] + huge["kept"]
    with pytest.raises(NodeUnreachable, match="session is closed"):
        await edge.ask("queues")


def test_holders_needs_a_prompt_and_a_readable_tokens_file(dep, tmp_path):
    assert_fails(ctl("edge-us", "holders", "--text", "", dep=dep), 2, "--text")
    assert_fails(ctl("edge-us", "holders", dep=dep), 2, "--text")
    assert_fails(ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "missing.json"), dep=dep), 2,
                 "missing.json", "No such file")
    assert_fails(ctl("edge-us", "holders", "--tokens-file", str(tmp_path), dep=dep), 2, "--tokens-file")
    (tmp_path / "bad.json").write_text("[1, 2,")
    assert_fails(ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "bad.json"), dep=dep), 2, "not JSON")
    (tmp_path / "words.json").write_text('["a", "b"]')
    assert_fails(ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "words.json"), dep=dep), 2, "token ids")
    (tmp_path / "ids.json").write_text(json.dumps(list(range(100, 180))))
    out = ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "ids.json"), "--json", dep=dep)
    assert out.returncode == 0 and json.loads(out.stdout)["prompt_tokens"] == 80
    # A long prompt goes packed: more ids than an admin message may carry as separate values.
    (tmp_path / "long.json").write_text(json.dumps([i % 250 for i in range(20_000)]))
    out = ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "long.json"), "--json", dep=dep)
    assert out.returncode == 0 and json.loads(out.stdout)["prompt_tokens"] == 20_000, out.stderr
    (tmp_path / "huge.json").write_text(json.dumps([1] * 200_001))
    assert_fails(ctl("edge-us", "holders", "--tokens-file", str(tmp_path / "huge.json"), dep=dep), 2,
                 "more than 200000")


def test_an_unusable_admin_certificate_or_config_is_named(dep, tmp_path):
    assert_fails(ctl("--admin-id", "nobody", "edge-us", dep=dep), 2, "nobody.pem", "missing")
    assert_fails(ctl("--admin-id", "edge-us", "edge-us", dep=dep), 2, "issued to edge:edge-us")
    assert_fails(ctl("edge-us", config=tmp_path / "absent.toml", dep=dep), 2, "absent.toml")
    (tmp_path / "broken.toml").write_text("[cluster\n")
    assert_fails(ctl("edge-us", config=tmp_path / "broken.toml", dep=dep), 2, "broken.toml", "TOML")
    assert_fails(ctl("--config", "x.toml", "edge-us"), 2, "--tls-dir")  # argparse's usage error, one line


def test_a_certificate_from_another_cluster_is_refused_with_the_reason(dep, tmp_path):
    certs.init_ca(tmp_path, cluster_name="elsewhere")
    certs.issue(tmp_path, tmp_path, role=Role.ADMIN, node_id="admin")
    assert_fails(ctl("edge-us", tls_dir=tmp_path, dep=dep), 1, "edge-us", "TLS handshake failed", "certificate")


def test_an_unreachable_node_is_reported_as_unreachable_within_the_timeout(dep, tmp_path):
    silent = f"127.0.0.1:{free_loopback_port(socket.SOCK_DGRAM)}"  # nothing listens there
    cfg = dep.cfg
    moved = replace(cfg, edges=tuple(replace(e, quic=silent) if e.id == "edge-us" else e for e in cfg.edges))
    (tmp_path / "moved.toml").write_text(dump_config(moved))
    out = ctl("--timeout", "1", "edge-us", config=tmp_path / "moved.toml", dep=dep)
    assert_fails(out, 1, "edge-us", "unreachable", silent)


def test_a_closed_stdout_ends_quietly(dep):
    # The reader is gone before the answer is written (as with `| head -1` on a long answer).
    proc = subprocess.Popen([sys.executable, "-m", "kvcompassd.ctl", "--config", str(dep.configs["us"]),
                             "--tls-dir", str(dep.tls_dir), "edge-us", "status"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""
    # Through a shell pipe, as an operator types it: head's line, and nothing on stderr.
    command = shlex.join([sys.executable, "-m", "kvcompassd.ctl", "--config", str(dep.configs["us"]),
                          "--tls-dir", str(dep.tls_dir), "edge-us", "status"])
    shell = subprocess.run(f"{command} | head -1", shell=True, capture_output=True, text=True, timeout=120,
                           check=False)
    assert shell.returncode == 0 and shell.stdout.split()[0] == "edge" and shell.stderr == ""


def test_a_tiny_negative_trend_prints_as_zero():
    assert table([{"trend_ms_per_ms": -0.0001}]).splitlines()[2].strip() == "0"
