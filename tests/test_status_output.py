"""`inferlb status` as a newcomer pipes it, and the `inferlb up` summary's pointer to it (no servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferlb.stack_state import ComponentStatus, StackLock, StackStatus, write_status
from inferlb.status import EXIT_NOT_READY, EXIT_NOT_RUNNING, status_hint

ROOT = Path(__file__).resolve().parents[1]


def status_into_closed_pipe(data_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`inferlb status` writing to a pipe whose reader is gone, as under `inferlb status --json | head -1`."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--data-dir", str(data_dir), *flags],
                              cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, check=False, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.subprocess
def test_status_into_a_closed_pipe_without_a_stack_is_quiet(tmp_path: Path) -> None:
    for flags in ((), ("--json",)):
        out = status_into_closed_pipe(tmp_path, *flags)
        assert out.stderr == "", out.stderr
        assert out.returncode == EXIT_NOT_RUNNING


@pytest.mark.subprocess
def test_status_json_into_a_closed_pipe_with_a_stack_is_quiet(tmp_path: Path) -> None:
    stack = StackStatus(supervisor_pid=os.getpid(), started_at=1000.0, data_dir=str(tmp_path), dataplane="envoy",
                        components=tuple(ComponentStatus(f"worker:{port}", "starting",
                                                         f"http://127.0.0.1:{port}/readyz", "w.log")
                                         for port in range(8101, 8141)),
                        links={"inference": "http://127.0.0.1:10000/v1/embeddings"})
    with StackLock(tmp_path):  # the subprocess sees a stack running on tmp_path
        write_status(tmp_path, stack)
        out = status_into_closed_pipe(tmp_path, "--json")
    assert out.stderr == "", out.stderr
    assert out.returncode == EXIT_NOT_READY  # the exit status still says what it would say on a terminal


@pytest.mark.subprocess
def test_status_json_still_prints_whole(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--json", "--data-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert json.loads(out.stdout) == {"running": False, "data_dir": str(tmp_path)}


def test_the_up_summary_says_where_the_cli_is(tmp_path: Path, monkeypatch) -> None:
    from inferlb.cli import StackPorts, stack_links, summary

    bindir = tmp_path / ".venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "inferlb").write_text("#!/bin/sh\n")
    (bindir / "inferlb").chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as in a new shell: the venv is not on the PATH
    hint = status_hint(Path("/d"), executable=str(bindir / "python"), cwd=tmp_path)
    assert hint == ("`.venv/bin/inferlb status --data-dir /d` shows what runs "
                    "(or `source .venv/bin/activate` first: then `inferlb` is on your PATH).")
    elsewhere = status_hint(Path("/d"), executable=str(bindir / "python"), cwd=tmp_path / "elsewhere")
    assert f"`{bindir}/inferlb status" in elsewhere  # outside the checkout: the absolute path
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")  # activated: the bare name works
    assert status_hint(Path("/d"), executable=str(bindir / "python"), cwd=tmp_path).startswith("`inferlb status")

    ports = StackPorts()
    text = summary(ports, "envoy", stack_links(ports, "envoy", ["http://127.0.0.1:8101"], tmp_path), tmp_path, False)
    assert f"{status_hint(tmp_path)} Ctrl-C stops everything." in text
