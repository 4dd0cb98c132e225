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


@pytest.mark.parametrize("san", ["edge.example.com", "*.region-us.example", "10.0.0.5", "::1", "localhost",
                                 "host-1.internal."])
def test_host_names_and_addresses_are_accepted_as_alternative_names(ca_dir, tmp_path, san):
    files = issue(ca_dir, tmp_path, role="edge", node_id="edge-us", sans=(san,))
    names = x509.load_pem_x509_certificate(files.cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san in {str(v) for v in names.get_values_for_type(x509.DNSName)} | {
        str(v) for v in names.get_values_for_type(x509.IPAddress)}


@pytest.mark.parametrize("san", ["https://edge.example.com", "edge.example.com:4433", "two words", "",
                                 "a..b", "-edge.example", "edge-.example", "x" * 64 + ".example", "10.0.0.5/24",
                                 "*"])
def test_a_malformed_alternative_name_is_refused_and_nothing_is_written(ca_dir, tmp_path, san):
    with pytest.raises(CertError, match="neither an IP address nor a DNS host name"):
        issue(ca_dir, tmp_path, role="edge", node_id="edge-us", sans=(san,))
    assert not list(tmp_path.iterdir())
