"""The admin API's bearer token: where it comes from, and the check.

Where from, first found wins:

1. ``INFERLB_ADMIN_TOKEN`` in the environment;
2. ``admin_token`` in the config (file table ``[control_plane]`` or
   ``INFERLB_CP_ADMIN_TOKEN``);
3. the file ``<data_dir>/admin-token``: reused when it exists; otherwise a
   new token (``secrets.token_urlsafe(32)``) is written there, mode 0600,
   created exclusively so two starting processes never overwrite each other.

The token itself is never logged or printed, only where it is. The check is
constant-time (``hmac.compare_digest``). A mutation without a valid token
gets 401 with ``WWW-Authenticate: Bearer`` and changes nothing. Reads are
open to loopback clients; with ``admin_auth_reads`` (or from any other
address, when the admin port is bound beyond loopback) they need the token
too.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("inferlb.control_plane.auth")

TOKEN_FILE = "admin-token"
ENV_TOKEN = "INFERLB_ADMIN_TOKEN"


class TokenError(RuntimeError):
    """The token cannot be set up; the message says where and why."""


@dataclass(frozen=True)
class AdminToken:
    value: str
    source: str  # "environment" | "config" | "file" | "generated"
    path: Path | None = None  # the file, for "file" and "generated"

    def __repr__(self) -> str:  # never the value
        return f"AdminToken(source={self.source!r}, path={self.path!r})"

    __str__ = __repr__

    def where(self) -> str:
        """A human description of where the token is, for logs and banners."""
        if self.source == "environment":
            return f"the environment variable {ENV_TOKEN}"
        if self.source == "config":
            return "the control plane's config (admin_token)"
        return str(self.path)

    def matches(self, candidate: str | None) -> bool:
        if not candidate:
            return False
        return hmac.compare_digest(candidate.encode("utf-8", "surrogateescape"), self.value.encode("utf-8"))


def _valid(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise TokenError(f"the admin token from {where} is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise TokenError(f"the admin token from {where} contains whitespace or control characters")
    return token


def resolve_admin_token(configured: str | None, data_dir: Path, environ: Mapping[str, str] | None = None
                        ) -> AdminToken:
    """The token per the module docstring; TokenError saying what is wrong."""
    env = os.environ if environ is None else environ
    if env.get(ENV_TOKEN):
        return AdminToken(_valid(env[ENV_TOKEN], ENV_TOKEN), "environment")
    if configured:
        return AdminToken(_valid(configured, "the config"), "config")
    path = Path(data_dir) / TOKEN_FILE
    try:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        return _read_or_create(path)
    except OSError as exc:
        raise TokenError(f"{path}: cannot read or create the admin token file: {exc.strerror or exc}") from exc


def _read_or_create(path: Path) -> AdminToken:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        return _read(path)
    token = secrets.token_urlsafe(32)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    log.info("generated a new admin token", extra={"token_file": str(path)})
    return AdminToken(token, "generated", path)


def _read(path: Path) -> AdminToken:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TokenError(f"{path}: the admin token file is a symbolic link; refusing it") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"{path}: the admin token file is not a regular file")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning("the admin token file was readable by others: set its mode to 0600",
                        extra={"token_file": str(path)})
        data = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    return AdminToken(_valid(data, str(path)), "file", path)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None
