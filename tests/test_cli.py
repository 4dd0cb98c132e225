"""The kvcompassd entry point: modes, the simulator's own parser, errors before any socket."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompassd.cli import main


def test_sim_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--help"])
    assert exc.value.code == 0 and "kvcompassd sim" in capsys.readouterr().out


def test_a_bad_config_is_reported_before_anything_starts(tmp_path, capsys):
    bad = tmp_path / "cluster.toml"
    bad.write_text('[cluster]\nname = "x"\nmodel = "m"\nshards = 0\n')
    assert main(["edge", "--config", str(bad), "--id", "edge-us", "--tls-dir", str(tmp_path), "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert "cluster.toml" in err and "shards" in err


def test_missing_certificates_are_named(tmp_path, capsys):
    cfg = tmp_path / "cluster.toml"
    cfg.write_text((Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml").read_text())
    assert main(["maintenance", "--config", str(cfg), "--id", "mnt-0", "--tls-dir", str(tmp_path), "--log-level", "error"]) == 2
    assert "ca.pem" in capsys.readouterr().err


def test_a_metrics_address_on_a_configured_port_is_refused_before_anything_starts(tmp_path, capsys):
    from kvcompassd import certs

    cfg = tmp_path / "cluster.toml"
    cfg.write_text((Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml").read_text())
    certs.init_ca(tmp_path, cluster_name="t")
    certs.issue(tmp_path, tmp_path, role="maintenance", node_id="mnt-0")
    # 127.0.0.1:8080 is edge-us's HTTP front door in the testbed.
    assert main(["maintenance", "--config", str(cfg), "--id", "mnt-0", "--tls-dir", str(tmp_path),
                 "--metrics", "127.0.0.1:8080", "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert "(mnt-0) metrics (command line)" in err and "(edge-us) http" in err


@pytest.mark.parametrize("workers", ["0", "-2", "two"])
def test_edge_workers_must_be_a_positive_count(tmp_path, capsys, workers):
    with pytest.raises(SystemExit) as exc:
        main(["edge", "--config", str(tmp_path / "c.toml"), "--id", "edge-us", "--tls-dir", str(tmp_path),
              "--workers", workers])
    assert exc.value.code == 2 and "--workers" in capsys.readouterr().err
