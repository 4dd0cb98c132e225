"""kvcompassctl's certificate flow and its renderings (queries are tested against running
daemons in test_e2e)."""

from __future__ import annotations

from kvcompassd.certs import load_certificate, peer_identity
from kvcompassd.ctl import main, render, table
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
