"""TLS material for a throw-away local control plane (:func:`generate`).

One self-signed CA, the apiserver's serving certificate, client certificates for the admin, the
scheduler and the controller-manager, and the service-account signing key pair: ECDSA P-256 PEM
files, keys unencrypted and valid a week, for tests and the sandbox only.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=7)


@dataclasses.dataclass(frozen=True)
class CertPair:
    """A certificate and its private key on disk."""

    cert: pathlib.Path
    """PEM certificate."""
    key: pathlib.Path
    """PEM private key (PKCS#8, unencrypted)."""


@dataclasses.dataclass(frozen=True)
class Pki:
    """Every file the control plane's components are started with."""

    ca: CertPair
    """Signs every certificate below; also the client CA of the apiserver."""
    serving: CertPair
    """kube-apiserver's serving certificate."""
    admin: CertPair
    """Client certificate of user ``admin`` in group ``system:masters``."""
    scheduler: CertPair
    """Client certificate of user ``system:kube-scheduler``."""
    controller_manager: CertPair
    """Client certificate of user ``system:kube-controller-manager``."""
    service_account_key: pathlib.Path
    """Private key that signs service-account tokens."""
    service_account_pub: pathlib.Path
    """Its public key, which the apiserver verifies tokens with."""


def generate(directory: pathlib.Path, *, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Create a CA and every certificate and key in ``directory``.

    ``extra_ips``: more addresses the apiserver's serving certificate names
    (where it listens besides loopback).
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshtrain-local-ca")])
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca = _write(directory, "ca", ca_cert, ca_key)

    def leaf(
        stem: str, common_name: str, *, org: str | None = None, serving: bool = False
    ) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if org:
            attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        builder = (
            _builder(x509.Name(attributes), ca_name, key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
        )
        if serving:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            ).add_extension(x509.SubjectAlternativeName(_serving_names(extra_ips)), critical=False)
        else:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
        return _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)

    sa_key = ec.generate_private_key(ec.SECP256R1())
    sa_key_path = directory / "sa.key"
    sa_pub_path = directory / "sa.pub"
    _write_private(sa_key_path, sa_key)
    sa_pub_path.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(
        ca=ca,
        serving=leaf("apiserver", "kube-apiserver", serving=True),
        admin=leaf("admin", "admin", org="system:masters"),
        scheduler=leaf("scheduler", "system:kube-scheduler"),
        controller_manager=leaf("controller-manager", "system:kube-controller-manager"),
        service_account_key=sa_key_path,
        service_account_pub=sa_pub_path,
    )


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew
        .not_valid_after(now + _VALIDITY)
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not ca,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _serving_names(extra_ips: tuple[str, ...]) -> list[x509.GeneralName]:
    """Loopback plus the names pods use for the in-cluster ``kubernetes`` Service."""
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    ips = [
        "127.0.0.1",
        "::1",
        "10.0.0.1",
        *extra_ips,
    ]  # 10.0.0.1: first of --service-cluster-ip-range
    return [x509.DNSName(name) for name in dns] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips
    ]


def _write(
    directory: pathlib.Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertPair:
    pair = CertPair(cert=directory / f"{stem}.crt", key=directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(pair.key, key)
    return pair


def _write_private(path: pathlib.Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
