"""``inferlb bench worker``: its workload, its figures, and one wrk run against a real (simulated) worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from inferlb.bench.worker.worker_bench import (Result, batches_and_inputs, http_run, length_batches, mixed_lengths, ratios,
                                        short_lengths, wrk_script)
from inferlb.bench.load.wrk import lua_string
from inferlb.cli import build_parser


def test_mixed_and_short_lengths_follow_the_mix() -> None:
    mixed = mixed_lengths(2000, 11)
    assert all(8 <= n <= 32 or 64 <= n <= 128 or n == 256 for n in mixed)
    assert 0.6 < sum(n <= 32 for n in mixed) / len(mixed) < 0.8
    assert mixed == mixed_lengths(2000, 11)  # seeded
    assert all(8 <= n <= 32 for n in short_lengths(100, 12))


def test_length_batches_sort_and_respect_the_padded_budget() -> None:
    ids = [[0] * n for n in (30, 5, 200, 5, 60, 10)]
    batches = length_batches(ids, max_tokens=64, max_size=3)
    assert [len(s) for b in batches for s in b] == sorted(len(s) for s in ids)
    assert all(len(b) <= 3 and len(b[-1]) * len(b) <= 64 or len(b) == 1 for b in batches)


def test_batches_and_inputs_from_worker_metrics() -> None:
    text = ("# TYPE inferlb_worker_batch_size histogram\n"
            'inferlb_worker_batch_size_bucket{le="+Inf"} 7.0\ninferlb_worker_batch_size_count 7.0\n'
            "inferlb_worker_batch_size_sum 21.0\n"
            "# TYPE inferlb_worker_inputs counter\ninferlb_worker_inputs_total 21.0\n")
    assert batches_and_inputs(text) == (7.0, 21.0)


def test_wrk_script_escapes_the_bodies(tmp_path: Path) -> None:
    assert lua_string('say "hi" \\ there') == '"say \\"hi\\" \\\\ there"'
    script = wrk_script(tmp_path, "t", ['a "quoted" text'], [5]).read_text()
    assert '\\"input\\": \\"a \\\\\\"quoted\\\\\\" text\\"' in script and "local tokens = {5}" in script


def test_ratios_name_their_targets() -> None:
    results = [Result("raw int8 mixed, length-batched", 1000, 10), Result("raw fp32 mixed, length-batched", 400, 4),
               Result("http int8 mixed, micro-batched", 900, 9),
               Result("http int8 short, micro-batched", 600, 30, 5.0, 20.0),
               Result("http int8 short, batch-1", 400, 20, 4.0, 10.0)]
    assert ratios(results) == {"http int8 mixed / raw int8 mixed (>= 0.80)": 0.9,
                               "raw int8 / raw fp32, mixed (>= 2.0)": 2.5,
                               "http micro-batched / batch-1, short (>= 1.25)": 1.5,
                               "http p99 micro-batched / batch-1, short (<= 2.0)": 2.0}


def test_the_subcommand_and_its_quick_mode_parse() -> None:
    args = build_parser().parse_args(["bench", "worker", "--quick", "--json", "out.json"])
    assert args.quick and args.json == Path("out.json") and args.func.__module__ == "inferlb.bench.worker.worker_bench"


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.model
@pytest.mark.wrk
def test_http_run_measures_a_real_worker_with_wrk(tmp_path: Path) -> None:
    """The HTTP half end to end, on a simulated worker (no model): wrk's figures and the mean batch from the
    worker's own counters; the worker is stopped afterwards."""
    script = wrk_script(tmp_path, "short", ["one two three four"] * 4, [6] * 4)
    result = asyncio.run(http_run("http sim", tmp_path / "data", tmp_path, script, 4, 1, "--simulate",
                                  "--sim-fixed-ms", "0.1", "--log-level", "warning"))
    assert result.inputs_per_s > 0 and result.tokens_per_s == pytest.approx(result.inputs_per_s * 6, rel=0.05)
    assert result.mean_batch is not None and result.mean_batch >= 1
    assert result.p50_ms is not None and result.p99_ms is not None


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.model
@pytest.mark.wrk
def test_http_run_computes_every_input_on_a_real_worker(tmp_path: Path, data_dir: Path) -> None:
    """A real int8 worker: wrk repeats its texts, and the worker's per-input cache would answer them without the
    model (mean batch 0, throughput many times the model's); http_run turns it off, so every input is computed."""
    script = wrk_script(tmp_path, "short", ["the cat sat on the mat"] * 4, [8] * 4)
    result = asyncio.run(http_run("http int8", data_dir, tmp_path, script, 4, 1, "--log-level", "warning"))
    assert result.inputs_per_s > 0
    assert result.mean_batch is not None and result.mean_batch >= 1
