"""``pfs certs``: a CA and the certificates of mutual-TLS mode (docs/security.md).

Writes into DIR: ``ca.pem``/``ca.key``, ``server.pem``/``server.key`` (shared by the
metaserver and the data servers; usable for both ends of a connection) and, per client,
``NAME.pem``/``NAME.key``. Keys are ECDSA P-256, mode 0600. A certificate's role and the
ids a client may claim are in its subject's OU: ``pfs:server`` or
``pfs:client:uids=LO-HI:gids=LO-HI``; the CA's signature is what makes them true.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAYS = 3650


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _name(cn: str, ou: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pfs"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _load_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def make_ca(d: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name("pfs CA", "pfs:ca")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_key(d / "ca.key", key)
    (d / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_cert(d: Path, name: str, ou: str, hosts: list[str]) -> tuple[Path, Path]:
    ca_cert, ca_key = _load_ca(d)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    b = (x509.CertificateBuilder().subject_name(_name(name, ou))
         .issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                               ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    pem, keyp = d / f"{name}.pem", d / f"{name}.key"
    _write_key(keyp, key)
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pem, keyp


def generate(d: Path, hosts: list[str] | None = None, clients: list[str] | None = None,
             uids: str = "0-4294967295", gids: str = "0-4294967295") -> list[Path]:
    """A CA (unless DIR holds one), the server certificate and client certificates."""
    from pfs.core.auth import parse_range

    lo, hi = parse_range(uids)
    glo, ghi = parse_range(gids)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    if not (d / "ca.pem").exists():
        make_ca(d)
    out = [d / "ca.pem"]
    if not (d / "server.pem").exists():
        make_cert(d, "server", "pfs:server", ["localhost", "127.0.0.1", "::1", *(hosts or [])])
    out.append(d / "server.pem")
    for c in clients or []:
        if c in ("ca", "server"):
            raise ValueError(f"client name {c!r} is reserved")
        out.append(make_cert(d, c, f"pfs:client:uids={lo}-{hi}:gids={glo}-{ghi}", [])[0])
    return out
