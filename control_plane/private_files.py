"""Operator state on disk readable by its owner only: directories 0700 when we create them, files 0600.

The state database holds tenants, key hashes, quotas and usage; the token
file holds the key to routing. A directory the control plane creates for them
is 0700. One that already exists is left as it is (it may be the operator's,
shared with other things): the files in it are 0600 whatever the directory.
A file of ours found readable by others is tightened, with a warning.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(path: Path) -> None:
    """``path`` created 0700 when missing (parents as the umask says); an existing one untouched."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def restrict_to_owner(fd: int, path: Path, log: logging.Logger) -> None:
    """Set the open file ``fd`` (at ``path``) to 0600 if others could read or write it, and say so."""
    if os.fstat(fd).st_mode & 0o077:
        os.fchmod(fd, FILE_MODE)
        log.warning("a state file was readable by others: set its mode to 0600", extra={"path": str(path)})


def ensure_private_file(path: Path, log: logging.Logger, *, create: bool = True) -> None:
    """``path`` a regular file of mode 0600: created so (``create``), or tightened (a symbolic link's target:
    an operator may keep the database elsewhere). Missing and not ``create``: nothing. OSError otherwise."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except FileNotFoundError:
        if create:
            raise
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path}: not a regular file")
        restrict_to_owner(fd, path, log)
    finally:
        os.close(fd)
