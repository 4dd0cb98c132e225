"""Cluster certificates: one CA per cluster, one certificate per node naming its role and id.

A node's identity travels inside its certificate, so a peer learns *who* it talks to from the
TLS handshake alone:

- the subject CN is the node id (``edge-us``, ``mnt-0``, ``us-0``...);
- a URI subjectAltName ``kvc://role/<role>/id/<percent-encoded node id>`` carries role and id.
  The URI is authoritative; :func:`peer_identity` also insists that the CN agrees with it.

Files written (PEM): ``ca.pem`` / ``ca.key`` by :func:`init_ca`; ``<node_id>.pem`` /
``<node_id>.key`` by :func:`issue`. Private keys are EC P-256, written with mode 0600.

Rotation
--------
*Node certificates*: run :func:`issue` again for the same node (a fresh key and serial, the
same CA), install the files, and reload the node (SIGHUP, ``systemctl reload``): it re-reads its
certificate, key and CA bundle, checks they fit together, and presents the new certificate on
every connection made from then on (``QuicNode.reload_tls``); peers need no change because they
trust the CA, not the node certificate. Old node certificates stay valid until they expire, so keep ``days``
short enough for your revocation needs (there is no CRL).

*The CA itself*: create a new CA in a new directory, then distribute a *bundle* file holding
both CA certificates (concatenate the two ``ca.pem`` files; the transport accepts every CA in
the bundle), reissue every node certificate from the new CA, and finally ship a bundle holding
only the new CA, reloading the nodes after each step. At no point does a node lose the ability
to verify its peers.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvcompassd.wire import NodeIdentity, Role

__all__ = [
    "CaFiles",
    "CertError",
    "NodeIdentity",
    "Role",
    "TlsFiles",
    "identity_uri",
    "init_ca",
    "issue",
    "load_certificate",
    "peer_identity",
]

_URI_PATTERN = re.compile(r"^kvc://role/(?P<role>[a-z]+)/id/(?P<node_id>[^/]+)$")
_NODE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class CertError(ValueError):
    """A certificate or key is missing, malformed, or does not name a kvcompass node."""


@dataclass(frozen=True, slots=True)
class CaFiles:
    """Where a cluster CA lives on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Everything a node needs for mutual TLS: the CA bundle to trust, its certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            object.__setattr__(self, name, Path(getattr(self, name)))


def identity_uri(role: Role | str, node_id: str) -> str:
    """The subjectAltName URI that encodes a node's role and id."""
    return f"kvc://role/{Role(role).value}/id/{quote(node_id, safe='')}"


def _check_node_id(node_id: str) -> None:
    if not isinstance(node_id, str) or not _NODE_ID_PATTERN.match(node_id):
        raise CertError(
            f"node id must be 1-128 characters of letters, digits and ._:@- "
            f"(starting with a letter or digit), got {node_id!r}"
        )


def _write_private(path: Path, data: bytes) -> None:
    # Create with 0600 from the start so the key is never readable by others, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def init_ca(directory: str | os.PathLike[str], *, cluster_name: str, days: int = 3650) -> CaFiles:
    """Create a cluster CA (EC P-256) in ``directory`` as ``ca.pem`` and ``ca.key`` (0600).

    Refuses to overwrite an existing CA key: replacing a CA silently would lock every node out.
    """
    if not isinstance(cluster_name, str) or not cluster_name:
        raise CertError(f"cluster name must be a non-empty string, got {cluster_name!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    files = CaFiles(cert=out / "ca.pem", key=out / "ca.key")
    if files.key.exists():
        raise CertError(f"{files.key} already exists; use a new directory to create another CA")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvcompass"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"kvcompass CA {cluster_name}"),
        ]
    )
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(files.key, _key_pem(key))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


# RFC 1123 host names (a leading "*." wildcard allowed, as X.509 DNS names may carry one).
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _san_entry(value: str) -> x509.GeneralName:
    """An IP address or a DNS host name; anything else (a URL, a port, spaces, an empty label)
    would end up in the certificate and never match the name a peer dials, so it is refused."""
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        pass
    name = value[2:] if value.startswith("*.") else value
    labels = name.rstrip(".").split(".") if isinstance(name, str) else []
    if (not isinstance(value, str) or not name or len(name) > 253 or not labels
            or not all(_DNS_LABEL.fullmatch(label) for label in labels)):
        raise CertError(f"subject alternative name {value!r} is neither an IP address nor a DNS host name")
    return x509.DNSName(value)


def issue(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    role: Role | str,
    node_id: str,
    sans: tuple[str, ...] = ("127.0.0.1", "localhost"),
    days: int = 365,
) -> TlsFiles:
    """Issue a certificate for ``node_id`` acting as ``role``, signed by the CA in ``ca_dir``.

    ``sans`` are the host names / IP addresses the node is reached at (clients may check them).
    Writes ``<node_id>.pem`` and ``<node_id>.key`` (0600) into ``out_dir`` and returns the three
    paths a node needs. Calling it again for the same node rotates its key (see module docs).
    """
    try:
        role = Role(role)
    except ValueError:
        raise CertError(f"role must be one of {[r.value for r in Role]}, got {role!r}") from None
    _check_node_id(node_id)
    if days <= 0:
        raise CertError(f"days must be positive, got {days}")
    ca_path = Path(ca_dir)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_path / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((ca_path / "ca.key").read_bytes(), None)
    except (OSError, ValueError) as exc:
        raise CertError(f"cannot load the CA from {ca_path}: {exc}") from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{ca_path / 'ca.key'} is not an EC key")

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    alt_names: list[x509.GeneralName] = [_san_entry(s) for s in sans]
    alt_names.append(x509.UniformResourceIdentifier(identity_uri(role, node_id)))
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvcompass"),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                    x509.NameAttribute(NameOID.COMMON_NAME, node_id),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(ca=ca_path / "ca.pem", cert=out / f"{node_id}.pem", key=out / f"{node_id}.key")
    _write_private(files.key, _key_pem(key))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


def load_certificate(path: str | os.PathLike[str]) -> x509.Certificate:
    """Load one PEM certificate, raising :class:`CertError` with the path on failure."""
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"cannot load certificate {path}: {exc}") from exc


def peer_identity(cert: x509.Certificate) -> NodeIdentity:
    """The role and node id a kvcompass certificate names.

    Does *not* check the signature; the transport verifies the chain against the cluster CA
    before asking for the identity.
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except (x509.ExtensionNotFound, ValueError) as exc:
        raise CertError(f"certificate has no readable subjectAltName: {exc}") from exc
    matches = [m for m in (_URI_PATTERN.match(u) for u in uris) if m]
    if len(matches) != 1:
        raise CertError(f"certificate must carry exactly one kvc:// identity URI, found {uris!r}")
    match = matches[0]
    try:
        role = Role(match["role"])
    except ValueError:
        raise CertError(f"certificate names unknown role {match['role']!r}") from None
    node_id = unquote(match["node_id"])
    _check_node_id(node_id)
    if len(common_names) != 1 or common_names[0].value != node_id:
        raise CertError(
            f"certificate CN {[c.value for c in common_names]!r} disagrees with its identity "
            f"URI id {node_id!r}"
        )
    return NodeIdentity(role=role, node_id=node_id)
