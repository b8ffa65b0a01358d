"""``inferlb bench hogs``: a tiny run end to end through the real stack (real ONNX workers, control plane,
ext_proc, Envoy) in each mode, its bad inputs, its run list, and how it judges the targets. No timing
thresholds: the end-to-end run checks what must hold whatever the host's speed (every sentence answered,
each mode and order run, the figures recorded, every process stopped)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.fairness.hogs_load import EARLY, ERROR, OK, OTHER_429, WAITED, kind_of
from inferlb.bench.fairness.hogs_plan import HogsPlan, RunSpec, default_schedulings, plan_runs
from inferlb.bench.fairness.hogs_report import (TARGET_P99_S, medians, refusal_verdict, render, sentence_verdict,
                                                throughput_verdict)

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)


def hogs(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "hogs", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


ENVOY_FIGURES = ("hog_tokens_per_s_alone", "hog_tokens_per_s_with_sentences", "hog_throughput_ratio", "hog_429s",
                 "hog_429_early", "hog_429_after_waiting", "hog_429_p99_s", "hog_errors")


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
@pytest.mark.model
def test_a_tiny_hogs_run_in_every_mode_and_order_stops_everything(out: Path, tmp_path: Path,  # noqa: F811
                                                                  data_dir: Path) -> None:
    report_file = tmp_path / "hogs.json"
    # direct: 3 hogs of 48 short inputs per worker, more than one batch (64 inputs), so one must be seen queued.
    done = subprocess.run([*INFERLB, "bench", "hogs", "--quick", "--orders", "smallest,fifo", "--hog-inputs", "48",
                           "--hog-tokens", "16", "--hog-concurrency", "4", "--inputs-per-worker", "144",
                           "--sentences", "4", "--rate", "20", "--alone-seconds", "1", "--ramp-seconds", "0.5",
                           "--out", str(out), "--json", str(report_file), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "INFERLB_DATA_DIR": str(data_dir)})
    assert done.returncode == 0, done.stderr
    for mode in ("same-client", "other-client", "other-tenant"):
        for order in ("smallest", "fifo"):
            assert f"| {mode} | {order} | las |" in done.stdout
    assert "| direct | smallest | las |" in done.stdout and "| direct | fifo |" not in done.stdout
    assert "[1/7] round 1 mode same-client order smallest scheduling las" in done.stderr
    report = json.loads(report_file.read_text())
    assert report["failures"] == [] and len(report["runs"]) == 7 and len(report["medians"]) == 7
    for run in report["runs"]:
        assert run["sentences_sent"] == run["sentences_completed"] == 4 and run["sentence_errors"] == 0
        assert run["hogs_ok"] >= 1 and run["hog_errors"] == 0
        if run["mode"] == "direct":
            assert run["hogs_ended"] == run["hogs_ok"] == 6  # 3 per worker, 2 workers
        else:
            assert all(name in run for name in ENVOY_FIGURES)
            assert run["hog_tokens_per_s_alone"] > 0
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (("--modes", "same-client,nearby"), "--modes takes a comma-separated list of same-client, other-client"),
    (("--orders", "smallest,smallest"), "--orders takes a comma-separated list of smallest, fifo (each once)"),
    (("--schedulings", "las,lifo"), "comma-separated list of las, round_robin, fifo"),
    (("--rounds", "0"), "rounds must be >= 1"),
    (("--hog-concurrency", "0"), "hog-concurrency must be >= 1"),
    (("--hog-inputs", "65"), "over the workers' max_request_tokens of 16384"),
    (("--hog-tokens", "300"), "hog-tokens must be 3..256"),
    (("--inputs-per-worker", "10"), "less than one hog"),
    (("--sentences", "-1"), "sentences must be >= 1"),
    (("--alone-seconds", "0"), "alone-seconds and timeout must be > 0"),
])
def test_bad_arguments_exit_2_saying_why(args: tuple[str, ...], message: str) -> None:
    done = hogs(*args, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.subprocess
def test_help_names_the_targets_and_the_modes() -> None:
    done = hogs("--help", timeout=60)
    assert done.returncode == 0
    assert "p99 <= 100 ms" in done.stdout and ">= 90%" in done.stdout and "p99 <= 5 ms" in done.stdout
    assert "(same-client, other-client, other-tenant, direct)" in done.stdout


def test_the_runs_rotate_each_round_and_direct_runs_once_per_scheduling() -> None:
    runs = plan_runs(["same-client", "direct"], ["smallest", "fifo"], ["las"], 2)
    assert [(r.round, r.mode, r.order) for r in runs] == [
        (1, "same-client", "smallest"), (1, "same-client", "fifo"), (1, "direct", "smallest"),
        (2, "same-client", "fifo"), (2, "direct", "smallest"), (2, "same-client", "smallest")]
    assert default_schedulings(["direct"]) == ["las", "round_robin", "fifo"]
    assert default_schedulings(["other-client", "direct"]) == ["las"]
    assert RunSpec.from_name(RunSpec("other-tenant", "fifo", "las").name, 3) == RunSpec("other-tenant", "fifo",
                                                                                          "las", 3)


def test_each_429_is_sorted_by_what_ext_proc_said() -> None:
    assert kind_of(200, "") == OK
    assert kind_of(429, "this request's turn would come in about 7.5 s") == EARLY
    assert kind_of(429, "this request did not get its turn within 5 s") == WAITED
    assert kind_of(429, "rate_limit_exceeded") == OTHER_429
    assert kind_of(503, "") == kind_of(None, "") == ERROR


def row(**changes: object) -> dict:
    base = {"mode": "same-client", "order": "smallest", "scheduling": "las", "round": 1, "sentences_sent": 10,
            "sentences_completed": 10, "sentence_errors": 0, "sentence_p50_s": 0.02, "sentence_p99_s": 0.08,
            "sentence_max_s": 0.09, "hogs_ended": 64, "hogs_ok": 60, "hog_p50_s": 4.0, "hog_429s": 4,
            "hog_429_early": 4, "hog_429_after_waiting": 0, "hog_429_other": 0, "hog_429_p50_s": 0.001,
            "hog_429_p99_s": 0.003, "hog_errors": 0, "hog_tokens_per_s_alone": 10_000.0,
            "hog_tokens_per_s_with_sentences": 9_500.0, "hog_throughput_ratio": 0.95}
    return {**base, **changes}


def test_the_targets_are_judged_as_the_issue_states_them() -> None:
    assert sentence_verdict(row()) == "met"
    assert sentence_verdict(row(sentence_p99_s=TARGET_P99_S + 1e-4)) == "MISSED"
    assert sentence_verdict(row(sentence_errors=1)) == "MISSED (errors)"
    # a direct run whose hogs had all gone before its last sentence was sent did not measure a loaded worker
    direct = row(mode="direct", hogs_ended=6, hogs_done_at_last_sentence_sent=6)
    assert sentence_verdict(direct).startswith("INVALID") and throughput_verdict(direct) == "-"
    assert throughput_verdict(row()) == "met" and throughput_verdict(row(hog_throughput_ratio=0.89)) == "MISSED"
    assert refusal_verdict(row()) == "met" and refusal_verdict(row(hog_429_p99_s=0.006)) == "MISSED"
    assert refusal_verdict(row(hog_429_after_waiting=1)) == "MISSED (1 after waiting)"
    assert refusal_verdict(row(hog_429s=0, hog_429_p99_s=None)) == "met (no 429)"


def test_the_medians_over_rounds_and_the_tables() -> None:
    runs = [row(), row(round=2, sentence_p99_s=0.04, hog_throughput_ratio=0.85), row(round=3, sentence_p99_s=0.5),
            row(mode="other-client")]
    [same, other] = medians(runs)
    assert same["rounds"] == 3 and same["sentence_p99_s"] == 0.08 and same["hog_throughput_ratio"] == 0.95
    assert (same["sentence_p99_min_s"], same["sentence_p99_max_s"]) == (0.04, 0.5) and same["hogs_ended"] == 192
    assert other["rounds"] == 1
    text = render({"plan": vars(HogsPlan()), "runs": runs, "medians": [same, other],
                   "failures": [{"round": 1, "run": "direct:smallest:las", "error": "boom"}]})
    assert "32 hogs of 32 x 256 tokens" in text and "round 3:" in text and "medians over 3 rounds" in text
    assert "| same-client | smallest | las | 30/30 | 20.0 | 80.0 (40.0-500.0) | 0 | met |" in text
    assert "FAILED: round 1 direct:smallest:las: boom" in text
