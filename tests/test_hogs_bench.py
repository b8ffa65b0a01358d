"""``inferlb bench hogs``: a tiny run end to end through the real stack (real ONNX workers, control plane,
ext_proc, Envoy) for two scheduling options, its bad inputs, and how it judges the target. No timing
thresholds: the end-to-end run checks what must hold whatever the host's speed (every sentence and hog
answered, each option run, every process stopped)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.fairness.hogs import HogsPlan, render, verdict

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)


def hogs(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "hogs", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_tiny_hogs_run_compares_the_options_and_stops_everything(out: Path, tmp_path: Path,  # noqa: F811
                                                                    data_dir: Path) -> None:
    report_file = tmp_path / "hogs.json"
    # 3 hogs of 48 short inputs per worker: more than one batch (64 inputs) and one hog must be seen queued.
    # Identical hogs that the workers' cache coalesced never queued past the first, and the run failed.
    done = subprocess.run([*INFERLB, "bench", "hogs", "--schedulings", "las,fifo", "--hog-inputs", "48",
                           "--hog-tokens", "16", "--inputs-per-worker", "144", "--sentences", "4", "--rate", "20",
                           "--out", str(out), "--json", str(report_file), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "INFERLB_DATA_DIR": str(data_dir)})
    assert done.returncode == 0, done.stderr
    assert "| las |" in done.stdout and "| fifo |" in done.stdout
    assert "[1/2] scheduling las" in done.stderr and "[2/2] scheduling fifo" in done.stderr
    report = json.loads(report_file.read_text())
    assert [r["scheduling"] for r in report["runs"]] == ["las", "fifo"] and report["failures"] == []
    for run in report["runs"]:
        assert run["sentences_sent"] == run["sentences_completed"] == 4 and run["sentence_errors"] == 0
        assert run["hogs"] == run["hogs_ok"] == 6  # 3 per worker, 2 workers
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (("--schedulings", "las,lifo"), "comma-separated list of las, round_robin, fifo"),
    (("--hog-inputs", "65"), "over the workers' max_request_tokens of 16384"),
    (("--hog-tokens", "300"), "hog-tokens must be 3..256"),
    (("--inputs-per-worker", "10"), "less than one hog"),
    (("--sentences", "-1"), "sentences must be >= 1"),
])
def test_bad_arguments_exit_2_saying_why(args: tuple[str, ...], message: str) -> None:
    done = hogs(*args, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.subprocess
def test_help_names_the_target_and_the_options() -> None:
    done = hogs("--help", timeout=60)
    assert done.returncode == 0
    assert "p99 <= 100 ms" in done.stdout and "las, round_robin, fifo" in done.stdout


def run(**changes: object) -> dict:
    base = {"scheduling": "las", "sentences_sent": 10, "sentences_completed": 10, "sentence_errors": 0,
            "sentence_p50_s": 0.02, "sentence_p99_s": 0.08, "sentence_max_s": 0.09, "hogs": 64, "hogs_ok": 64,
            "hogs_done_at_last_sentence_sent": 0, "hog_makespan_s": 60.0}
    return {**base, **changes}


def test_the_target_is_judged_as_the_issue_states_it() -> None:
    assert verdict(run()) == "met"
    assert verdict(run(sentence_p99_s=0.1001)) == "MISSED"
    assert verdict(run(sentence_errors=1)) == "MISSED (errors)"
    # a run whose hogs had all gone before its last sentence was sent did not measure a loaded worker
    assert verdict(run(hogs_done_at_last_sentence_sent=64)).startswith("INVALID")
    assert verdict(run(hogs_done_at_last_sentence_sent=10)) == "met"
    text = render({"plan": vars(HogsPlan()), "runs": [run(), run(scheduling="fifo", sentence_p99_s=40.0)],
                   "failures": [{"scheduling": "round_robin", "error": "boom"}]})
    assert "| las | 10/10 | 20.0 | 80.0 |" in text and "| fifo |" in text and "FAILED: boom" in text
    assert "32 hogs of 64 x 256 tokens" in text
