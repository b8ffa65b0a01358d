"""Closed-loop saturation with wrk: the benches' way to find a ceiling.

At saturation the load generator must not be the bottleneck on a 2-core
machine, so the closed-loop runs use wrk (C, cheap; Debian's package, `make
bench` installs it) with a generated Lua script that cycles real request bodies
and prints its figures as one JSON line. The open-loop runs (latency under a
given rate) use ``loadgen.run_load`` instead.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "wrk is needed for the saturation measurements (apt-get install wrk; `make test` and `make bench` do)"


class WrkError(RuntimeError):
    """wrk is missing or failed; the message says which and shows its output."""


def lua_string(data: bytes | str) -> str:
    """``data`` as a Lua string literal."""
    text = data.decode() if isinstance(data, bytes) else data
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def lua_table(items: Sequence[bytes | str]) -> str:
    """The inside of a Lua table of string literals."""
    return ", ".join(lua_string(item) for item in items)


def find_wrk() -> str | None:
    return shutil.which("wrk")


async def run_wrk(script: Path, url: str, *, connections: int, seconds: float,
                  timeout_s: float = 10.0) -> tuple[dict[str, Any], float]:
    """wrk (one thread) for ``seconds`` against ``url`` with ``script``: the first JSON line it prints
    (the script's ``done``), and wrk's own CPU seconds (user + system, read once it has been reaped)."""
    wrk = find_wrk()
    if wrk is None:
        raise WrkError(INSTALL_HINT)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", f"{timeout_s:g}s",
        "-s", str(script), url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), seconds + 60)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise WrkError(f"wrk failed ({proc.returncode}): {err or out}")
    line = next((line for line in out.splitlines() if line.startswith("{")), None)
    if line is None:
        raise WrkError(f"wrk printed no figures: {out or err}")
    return json.loads(line), cpu_s
