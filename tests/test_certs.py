"""Cluster CA and node certificates: identities round-trip, keys are private, chains verify."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from kvcompassd.certs import CertError, NodeIdentity, Role, identity_uri, init_ca, issue, load_certificate, peer_identity
from kvcompassd.transport.aioquic_tweaks import verify_peer_chain


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ca")
    init_ca(directory, cluster_name="test")
    return directory


def test_ca_key_is_private_and_ca_is_a_ca(ca_dir):
    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    cert = load_certificate(ca_dir / "ca.pem")
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_init_ca_refuses_to_overwrite(ca_dir):
    with pytest.raises(CertError, match="already exists"):
        init_ca(ca_dir, cluster_name="test")


@pytest.mark.parametrize("role", list(Role))
def test_issued_certificate_names_role_and_id(ca_dir, tmp_path, role):
    files = issue(ca_dir, tmp_path, role=role, node_id=f"{role.value}-1")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    cert = load_certificate(files.cert)
    assert peer_identity(cert) == NodeIdentity(role, f"{role.value}-1")
    verify_peer_chain(cert, [], files.ca.read_bytes())


def test_node_id_with_special_characters_round_trips(ca_dir, tmp_path):
    files = issue(ca_dir, tmp_path, role="agent", node_id="us-0:gpu@host.a")
    assert peer_identity(load_certificate(files.cert)) == NodeIdentity(Role.AGENT, "us-0:gpu@host.a")


def test_reissue_rotates_key_under_the_same_ca(ca_dir, tmp_path):
    first = issue(ca_dir, tmp_path, role="edge", node_id="edge-us")
    first_key = first.key.read_bytes()
    second = issue(ca_dir, tmp_path, role="edge", node_id="edge-us")
    assert second.key.read_bytes() != first_key
    verify_peer_chain(load_certificate(second.cert), [], second.ca.read_bytes())


def test_certificate_of_another_ca_does_not_verify(ca_dir, tmp_path):
    other = tmp_path / "other"
    init_ca(other, cluster_name="other")
    files = issue(other, tmp_path / "n", role="edge", node_id="edge-x")
    with pytest.raises(ValueError):
        verify_peer_chain(load_certificate(files.cert), [], (ca_dir / "ca.pem").read_bytes())


def test_ca_bundle_accepts_both_cas_during_rotation(ca_dir, tmp_path):
    new = tmp_path / "new"
    init_ca(new, cluster_name="test")
    bundle = (ca_dir / "ca.pem").read_bytes() + (new / "ca.pem").read_bytes()
    old_node = issue(ca_dir, tmp_path / "a", role="edge", node_id="edge-a")
    new_node = issue(new, tmp_path / "b", role="edge", node_id="edge-b")
    verify_peer_chain(load_certificate(old_node.cert), [], bundle)
    verify_peer_chain(load_certificate(new_node.cert), [], bundle)


@pytest.mark.parametrize("bad_id", ["", "-x", "a/b", "x" * 200, "sp ace"])
def test_bad_node_ids_are_refused(ca_dir, tmp_path, bad_id):
    with pytest.raises(CertError, match="node id"):
        issue(ca_dir, tmp_path, role="edge", node_id=bad_id)


def test_unknown_role_is_refused(ca_dir, tmp_path):
    with pytest.raises(CertError, match="role"):
        issue(ca_dir, tmp_path, role="king", node_id="x")


def test_certificate_without_identity_is_refused(ca_dir):
    with pytest.raises(CertError, match="subjectAltName|kvc://"):
        peer_identity(load_certificate(ca_dir / "ca.pem"))


def test_identity_uri_format():
    assert identity_uri("edge", "edge-us") == "kvc://role/edge/id/edge-us"
