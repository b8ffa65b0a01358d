"""TLS material as the services take it from their configuration: PEM files, all of a set or none.

The control plane's ADS server (mTLS), ext_proc's xDS client (mTLS) and the admin API (TLS) each
name a certificate chain, its key and, for mutual TLS, a CA. A set configured in part, a file that
cannot be read, or a key that does not match its certificate must stop the service at start-up with
a message naming the setting and the path. Left to the first handshake, gRPC only logs "handshake
failed" and every client sees UNAVAILABLE, and uvicorn exits with a bare SSL error.

The checks use the standard library's ``ssl`` module (OpenSSL parses the files exactly as it will
when serving), so nothing here hand-parses PEM.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


class TlsConfigError(ValueError):
    """TLS files that cannot be used; the message names the setting and the path."""


def all_or_none(settings: Mapping[str, object]) -> bool:
    """True when every setting is set, False when none is; ValueError naming the missing ones otherwise.

    For pydantic validators: ``settings`` maps a setting's name to its value (None: unset).
    """
    missing = [name for name, value in settings.items() if value is None]
    if missing and len(missing) < len(settings):
        given = [name for name in settings if name not in missing]
        raise ValueError(f"{', '.join(settings)} go together: {', '.join(given)} set but "
                         f"{', '.join(missing)} not (set all of them, or none for plaintext)")
    return not missing


@dataclass(frozen=True, slots=True)
class PemFiles:
    """A certificate chain, its private key and (mutual TLS) the CA that signs the peers, as PEM bytes."""

    certificate_chain: bytes
    private_key: bytes
    trusted_ca: bytes | None = None


def _read(setting: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise TlsConfigError(f"{setting}: {path} is empty")
    return data


def check_identity(cert: Path, key: Path, *, cert_setting: str, key_setting: str) -> tuple[bytes, bytes]:
    """Both files readable, a PEM certificate chain and the private key that matches it; their bytes."""
    chain, private_key = _read(cert_setting, cert), _read(key_setting, key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        raise TlsConfigError(f"{cert_setting}/{key_setting}: {cert} and {key} are not a PEM certificate "
                             f"chain and its matching private key ({exc})") from None
    return chain, private_key


def load_pem_files(cert: Path, key: Path, ca: Path | None = None, *,
                   settings: tuple[str, str, str] = ("cert", "key", "ca")) -> PemFiles:
    """Read and check the files; :class:`TlsConfigError` naming ``settings`` (cert, key, ca) if unusable."""
    cert_setting, key_setting, ca_setting = settings
    chain, private_key = check_identity(cert, key, cert_setting=cert_setting, key_setting=key_setting)
    trusted = None
    if ca is not None:
        trusted = _read(ca_setting, ca)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=trusted.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
            raise TlsConfigError(f"{ca_setting}: {ca} holds no PEM CA certificate ({exc})") from None
    return PemFiles(chain, private_key, trusted)
