#!/usr/bin/env python
"""Worker benchmark: raw ONNX Runtime against the HTTP worker, batch-1 against
micro-batching, fp32 against int8, all in one run on this machine.

Prints a table and writes JSON. Targets (issue: foundation):
  - HTTP path >= 80% of the raw session's tokens/s (int8, mixed lengths);
  - int8 >= 2x fp32 (raw session, mixed lengths);
  - micro-batching >= 1.25x batch-1 on short inputs, p99 no worse than 2x.

The HTTP load comes from wrk (Debian's package; `make bench` installs it), so
the load generator is not the bottleneck on a 2-core machine.

Usage: python scripts/bench_worker.py [--requests N] [--concurrency C] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.config import WorkerConfig, default_data_dir  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.model_store import prepare_models  # noqa: E402
from workers.tokenization import load_tokenizer  # noqa: E402

CORPUS = (
    "Load balancers for small models on CPUs must weigh each request by its size, because a request of "
    "two hundred tokens costs many times one of ten. Envoy proxies the bytes while a control plane pushes "
    "weights computed from telemetry, and an external processor picks the endpoint that will finish first. "
    "Embedding models turn sentences into vectors; classifiers label them; small language models answer. "
    "Machines differ in speed, noisy neighbours steal cycles, and queues build where nobody looks. "
)


@dataclass
class Result:
    name: str
    tokens_per_s: float
    inputs_per_s: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    mean_batch: float | None = None


def make_texts(tokenizer, lengths: Sequence[int]) -> list[str]:  # type: ignore[no-untyped-def]
    """Texts whose token count (with [CLS]/[SEP]) is the requested length, cut from the corpus."""
    words = (CORPUS * 20).split()
    rng = random.Random(1)
    texts = []
    for n in lengths:
        start = rng.randrange(0, len(words) - 300)
        lo, hi = 1, 300
        while lo < hi:  # the fewest words that reach n tokens
            mid = (lo + hi) // 2
            if len(tokenizer.encode(" ".join(words[start:start + mid])).ids) >= n:
                hi = mid
            else:
                lo = mid + 1
        texts.append(" ".join(words[start:start + lo]))
    return texts


def mixed_lengths(count: int, seed: int) -> list[int]:
    """70% 8-32 tokens, 25% 64-128, 5% 256."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        r = rng.random()
        out.append(rng.randint(8, 32) if r < 0.70 else rng.randint(64, 128) if r < 0.95 else 256)
    return out


def short_lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(8, 32) for _ in range(count)]


# -- raw session -------------------------------------------------------------
def length_batches(ids: list[list[int]], max_tokens: int, max_size: int) -> list[list[list[int]]]:
    """What the best offline batcher does: sort by length, fill up to the padded-token budget."""
    batches, current = [], []
    for seq in sorted(ids, key=len):
        if current and (len(seq) * (len(current) + 1) > max_tokens or len(current) >= max_size):
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches


def raw_session(name: str, engine: Engine, ids: list[list[int]], batched: bool) -> Result:
    defaults = WorkerConfig()
    batches = length_batches(ids, defaults.max_batch_tokens, defaults.max_batch_size) if batched else [[s] for s in ids]
    engine.embed(batches[0])  # warm
    start = time.perf_counter()
    for batch in batches:
        engine.embed(batch)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s) for s in ids)
    return Result(name, tokens / elapsed, len(ids) / elapsed, mean_batch=len(ids) / len(batches))


# -- HTTP worker ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerUnderTest:
    def __init__(self, data_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers", "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def __enter__(self) -> WorkerUnderTest:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError("worker not ready in 120 s")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def batches_and_inputs(self) -> tuple[float, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith(("inferlb_worker_batch_size_count", "inferlb_worker_inputs_total")):
                name, value = line.split()
                values[name] = float(value)
        return values["inferlb_worker_batch_size_count"], values["inferlb_worker_inputs_total"]


WRK_SCRIPT = """
-- Generated by scripts/bench_worker.py: cycle through real OpenAI embeddings bodies,
-- count the tokens sent, and print the figures as one JSON line.
local bodies = {%(bodies)s}
local tokens = {%(tokens)s}
local threads = {}
i = 0     -- globals: thread:get() reads them in done()
sent = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
function setup(thread) table.insert(threads, thread) end
function init(args) i = 0; sent = 0 end
function request()
  i = i %% #bodies + 1
  sent = sent + tokens[i]
  return wrk.format(nil, "/v1/embeddings", nil, bodies[i])
end
function done(summary, latency, requests)
  local total = 0
  for _, t in ipairs(threads) do total = total + t:get("sent") end
  io.write(string.format('{"requests": %%d, "seconds": %%f, "tokens": %%d, "errors": %%d, "p50_ms": %%f, "p99_ms": %%f}\\n',
    summary.requests, summary.duration / 1e6, total,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def wrk_load(url: str, texts: list[str], tokens: list[int], concurrency: int, seconds: float) -> dict:
    """Closed loop at saturation with wrk (C, cheap): the load generator must not be the bottleneck
    on a 2-core machine. One input per request, bodies cycled in order."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench_worker: wrk is needed for the HTTP measurements (apt-get install wrk; `make bench` does)")
    bodies = ", ".join(_lua_string(json.dumps({"input": t, "encoding_format": "base64"})) for t in texts)
    script = WRK_SCRIPT % {"bodies": bodies, "tokens": ", ".join(map(str, tokens))}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(script)
    try:
        out = subprocess.run(  # type: ignore[assignment]
            [wrk, "-t1", f"-c{concurrency}", f"-d{seconds:.0f}s", "--timeout", "30s", "-s", fh.name, url],
            capture_output=True, text=True, timeout=seconds + 60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr or out.stdout}")
        out = out.stdout
    finally:
        os.unlink(fh.name)
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def http_run(name: str, data_dir: Path, texts: list[str], tokens: list[int], concurrency: int, seconds: float,
             *args: str) -> Result:
    with WorkerUnderTest(data_dir, *args) as worker:
        wrk_load(worker.url, texts, tokens, concurrency, 2)  # warm
        b0, i0 = worker.batches_and_inputs()
        figures = wrk_load(worker.url, texts, tokens, concurrency, seconds)
        b1, i1 = worker.batches_and_inputs()
    if figures["errors"]:
        print(f"  warning: {figures['errors']} errors in {name}", flush=True)
    return Result(
        name, figures["tokens"] / figures["seconds"], figures["requests"] / figures["seconds"],
        figures["p50_ms"], figures["p99_ms"], (i1 - i0) / max(1.0, b1 - b0),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500, help="inputs per measurement (default 1500)")
    parser.add_argument("--concurrency", type=int, default=32, help="HTTP connections at saturation (default 32)")
    parser.add_argument("--seconds", type=float, default=15, help="length of each HTTP measurement (default 15)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    data_dir = default_data_dir()
    artifacts = prepare_models(data_dir, progress=lambda m: print(f"[model] {m}", flush=True))
    tokenizer = load_tokenizer(artifacts.tokenizer)
    mixed_texts = make_texts(tokenizer, mixed_lengths(args.requests, 11))
    short_texts = make_texts(tokenizer, short_lengths(args.requests, 12))
    mixed_ids = [e.ids for e in tokenizer.encode_batch(mixed_texts)]
    short_ids = [e.ids for e in tokenizer.encode_batch(short_texts)]
    print(f"workload: {len(mixed_ids)} mixed inputs, mean {np.mean([len(s) for s in mixed_ids]):.1f} tokens; "
          f"{len(short_ids)} short inputs, mean {np.mean([len(s) for s in short_ids]):.1f} tokens", flush=True)

    results: list[Result] = []

    def record(result: Result) -> None:
        results.append(result)
        extra = f", p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms" if result.p99_ms is not None else ""
        print(f"  {result.name:<42} {result.tokens_per_s:8.0f} tokens/s {result.inputs_per_s:7.1f} inputs/s"
              f"  mean batch {result.mean_batch or 0:.1f}{extra}", flush=True)

    print("raw ONNX Runtime session (1 intra-op thread, no spinning):", flush=True)
    for precision, path in (("int8", artifacts.int8), ("fp32", artifacts.fp32)):
        engine = Engine(path, intra_op_threads=1)
        record(raw_session(f"raw {precision} mixed, length-batched", engine, mixed_ids, batched=True))
        record(raw_session(f"raw {precision} mixed, batch-1", engine, mixed_ids, batched=False))
        record(raw_session(f"raw {precision} short, length-batched", engine, short_ids, batched=True))
        del engine

    print(f"HTTP worker at saturation (wrk, {args.concurrency} connections, one input per request):", flush=True)
    mixed_tokens = [len(s) for s in mixed_ids]
    short_tokens = [len(s) for s in short_ids]
    secs = args.seconds
    record(http_run("http int8 mixed, micro-batched", data_dir, mixed_texts, mixed_tokens, args.concurrency, secs))
    record(http_run("http int8 short, micro-batched", data_dir, short_texts, short_tokens, args.concurrency, secs))
    record(http_run("http int8 short, batch-1", data_dir, short_texts, short_tokens, args.concurrency, secs,
                    "--max-batch-size", "1"))
    record(http_run("http fp32 mixed, micro-batched", data_dir, mixed_texts, mixed_tokens, args.concurrency, secs,
                    "--precision", "fp32"))

    by = {r.name: r for r in results}
    checks = {
        "http int8 mixed / raw int8 mixed (>= 0.80)":
            by["http int8 mixed, micro-batched"].tokens_per_s / by["raw int8 mixed, length-batched"].tokens_per_s,
        "raw int8 / raw fp32, mixed (>= 2.0)":
            by["raw int8 mixed, length-batched"].tokens_per_s / by["raw fp32 mixed, length-batched"].tokens_per_s,
        "http micro-batched / batch-1, short (>= 1.25)":
            by["http int8 short, micro-batched"].tokens_per_s / by["http int8 short, batch-1"].tokens_per_s,
        "http p99 micro-batched / batch-1, short (<= 2.0)":
            (by["http int8 short, micro-batched"].p99_ms or 0) / (by["http int8 short, batch-1"].p99_ms or 1),
    }
    print("ratios:", flush=True)
    for name, value in checks.items():
        print(f"  {name:<50} {value:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor()},
            "results": [asdict(r) for r in results],
            "ratios": checks,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
