"""The admin API's bearer token: where it comes from, and the check.

Where from, first found wins:

1. ``INFERLB_ADMIN_TOKEN`` in the environment;
2. ``admin_token`` in the config (file table ``[control_plane]`` or
   ``INFERLB_CP_ADMIN_TOKEN``);
3. the file ``<data_dir>/admin-token``: reused when it exists; otherwise a
   new token (``secrets.token_urlsafe(32)``) is written there, mode 0600 (the
   directory, when it has to be created, 0700: ``private_files``).

Writing it is atomic: the token goes to a temporary file in the same
directory (mode 0600), is fsynced, and only then renamed to its name (and
the directory fsynced), so the name never holds a partial or empty token,
whatever crashes when. Creating or repairing it happens under an exclusive
lock (``flock`` on ``admin-token.lock``): of several processes starting at
once, one writes the token and every other reads that one. An empty file
(left by a crash of a version that wrote in place) is replaced by a new
token, with a warning; a file with anything else unusable is an error.

The token itself is never logged or printed, only where it is. The check is
constant-time (``hmac.compare_digest``). A mutation without a valid token
gets 401 with ``WWW-Authenticate: Bearer`` and changes nothing. Reads are
open to loopback clients; with ``admin_auth_reads`` (or from any other
address, when the admin port is bound beyond loopback) they need the token
too. That rule and the check of each request are ``admin.access``'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import ipaddress
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .private_files import make_private_dir, restrict_to_owner

log = logging.getLogger("inferlb.control_plane.auth")

TOKEN_FILE = "admin-token"
LOCK_FILE = "admin-token.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
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
        make_private_dir(Path(data_dir))
        return _read_or_create(path)
    except OSError as exc:
        raise TokenError(f"{path}: cannot read or create the admin token file: {exc.strerror or exc}") from exc


def _read_or_create(path: Path) -> AdminToken:
    """The file's token; else, under the lock, a new one (unless another process wrote it meanwhile)."""
    token = _read(path)
    if token is not None:
        return token
    with _locked(path.with_name(LOCK_FILE)):
        token = _read(path)
        if token is not None:
            return token
        if path.exists():
            log.warning("the admin token file is empty (a crash while it was written?): generating a new token",
                        extra={"token_file": str(path)})
        value = secrets.token_urlsafe(32)
        _write_atomically(path, value + "\n")
    log.info("generated a new admin token", extra={"token_file": str(path)})
    return AdminToken(value, "generated", path)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_path`` (released by the kernel if the process dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_atomically(path: Path, text: str) -> None:
    """A complete, fsynced temporary file renamed over ``path``, then the directory fsynced."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o600)  # mkstemp's mode already, whatever the umask; said explicitly
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _read(path: Path) -> AdminToken | None:
    """The token in ``path``; None when there is no file or it is empty (whitespace only)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TokenError(f"{path}: the admin token file is a symbolic link; refusing it") from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TokenError(f"{path}: the admin token file is not a regular file")
        restrict_to_owner(fd, path, log)
        data = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    if not data.strip():
        return None
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
