"""The admin token file is written atomically: concurrent starts agree on one token, and no crash or
concurrent start ever sees (or leaves) an empty file.

``resolve_admin_token`` is what ``python -m control_plane`` calls at start-up; here it is called
from many threads and processes at once, the way several control planes sharing a data directory start.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control_plane import auth
from control_plane.auth import TOKEN_FILE, TokenError, resolve_admin_token

NO_ENV: dict[str, str] = {}


def _resolve_after(barrier: threading.Barrier, data_dir: Path) -> str:
    barrier.wait()
    return resolve_admin_token(None, data_dir, NO_ENV).value


def test_concurrent_starts_in_threads_all_get_the_same_token(tmp_path: Path) -> None:
    for round_ in range(20):  # fresh directory each round: every round races on the creation
        data_dir = tmp_path / f"round-{round_}"
        barrier = threading.Barrier(8)
        with ThreadPoolExecutor(8) as pool:
            tokens = list(pool.map(lambda _: _resolve_after(barrier, data_dir), range(8)))
        assert len(set(tokens)) == 1 and tokens[0], tokens
        assert (data_dir / TOKEN_FILE).read_text().strip() == tokens[0]
        assert not [p.name for p in data_dir.iterdir() if p.name.endswith(".tmp")]  # no temporary left


def _process_start(data_dir: str, start: multiprocessing.synchronize.Event,  # type: ignore[name-defined]
                   results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    start.wait(30)
    try:
        results.put(resolve_admin_token(None, Path(data_dir), NO_ENV).value)
    except Exception as exc:  # the test reports it
        results.put(f"error: {exc!r}")


@pytest.mark.subprocess
def test_concurrent_starts_in_processes_all_get_the_same_token(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_process_start, args=(str(tmp_path), start, results)) for _ in range(6)]
    try:
        for p in procs:
            p.start()
        start.set()
        tokens = [results.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert len(set(tokens)) == 1 and not tokens[0].startswith("error"), tokens
    assert (tmp_path / TOKEN_FILE).read_text().strip() == tokens[0]
    assert stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode) == 0o600


def test_an_empty_file_left_by_a_crash_is_replaced_with_a_warning(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / TOKEN_FILE).write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="inferlb.control_plane.auth"):
        token = resolve_admin_token(None, tmp_path, NO_ENV)
    assert token.value and token.source == "generated"
    assert (tmp_path / TOKEN_FILE).read_text().strip() == token.value
    assert any(r.levelno == logging.WARNING and "empty" in r.getMessage() for r in caplog.records)
    assert resolve_admin_token(None, tmp_path, NO_ENV).value == token.value  # and it is kept from now on


def test_a_crash_while_writing_leaves_no_empty_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(auth.os, "write", disk_full)
    with pytest.raises(TokenError, match="No space left on device"):
        resolve_admin_token(None, tmp_path, NO_ENV)
    monkeypatch.undo()
    assert not (tmp_path / TOKEN_FILE).exists()  # nothing, rather than an empty token
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    token = resolve_admin_token(None, tmp_path, NO_ENV)  # the next start just makes one
    assert token.value and (tmp_path / TOKEN_FILE).read_text().strip() == token.value


def test_a_file_with_a_bad_token_is_still_an_error_not_replaced(tmp_path: Path) -> None:
    (tmp_path / TOKEN_FILE).write_text("two words\n")
    os.chmod(tmp_path / TOKEN_FILE, 0o600)
    with pytest.raises(TokenError, match="whitespace or control characters"):
        resolve_admin_token(None, tmp_path, NO_ENV)
    assert (tmp_path / TOKEN_FILE).read_text() == "two words\n"


def test_a_symlinked_token_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("secret\n")
    (tmp_path / TOKEN_FILE).symlink_to(target)
    with pytest.raises(TokenError, match="symbolic link"):
        resolve_admin_token(None, tmp_path, NO_ENV)
