"""Throwaway PKI for the TLS tests (trustme): PEM files on disk, where the services read them.

One :class:`Pki` per test: a CA, and identities it signs (each certificate carries clientAuth and
serverAuth, so one kind of file serves the control plane and its clients alike).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

from inferlb_runtime.tls import PemFiles


@dataclass(frozen=True)
class Identity:
    cert: Path  # the leaf first, then the rest of the chain
    key: Path
    ca: Path  # the CA that signed it (and, in these tests, every peer)

    def pem(self) -> PemFiles:
        return PemFiles(self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes())


class Pki:
    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.authority = trustme.CA()
        self.directory = directory
        self.ca = directory / f"{name}.pem"
        self.authority.cert_pem.write_to_path(str(self.ca))

    def issue(self, name: str, *identities: str) -> Identity:
        """A certificate for ``identities`` (DNS names or IPs; default ``127.0.0.1``)."""
        leaf = self.authority.issue_cert(*(identities or ("127.0.0.1",)), common_name=name)
        cert, key = self.directory / f"{name}-cert.pem", self.directory / f"{name}-key.pem"
        leaf.private_key_pem.write_to_path(str(key))
        with open(cert, "wb") as chain:
            for blob in leaf.cert_chain_pems:
                chain.write(blob.bytes())
        return Identity(cert, key, self.ca)

    def trusting(self) -> ssl.SSLContext:
        """A client context that trusts this CA (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca))
