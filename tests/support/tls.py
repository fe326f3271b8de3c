"""Certificates for tests of the gRPC server's TLS."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any


def certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost and a client certificate, both signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def make(name: str, issuer: Any, signer: Any, ca: bool) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer or key, hashes.SHA256()), key

    ca_cert, ca_key = make("quiver-test-ca", None, None, True)
    paths = {}
    for role in ("server", "client"):
        cert, key = make("localhost", ca_cert.subject, ca_key, False)
        paths[f"{role}.crt"] = folder / f"{role}.crt"
        paths[f"{role}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{role}.key"] = folder / f"{role}.key"
        paths[f"{role}.key"].write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    paths["ca.crt"] = folder / "ca.crt"
    paths["ca.crt"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return paths


__all__ = ["certificates"]
