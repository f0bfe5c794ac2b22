"""bench/gpu_check.py, the CUDA validation in one command: its goals from rows, its
time limits, and (slow) its whole path on the CPU (`--cpu-smoke`), so that the command
a GPU machine runs cannot rot where no GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_check  # noqa: E402


def _row(name, k, step, *, first=10.0, peak=1000, transfer=0.0, regime=None):
    spec = {"row": name, "k": k, **({"regime": regime} if regime else {})}
    return {"spec": spec, "step_seconds": step, "tokens_per_second": 1.0 / step,
            "first_step_seconds": first, "peak_bytes": peak, "host_device_bytes_per_step": int(transfer * 1e9)}


def _goals(rows, ks):
    gpu_check.describe_bounds(rows, {"host_to_device_bytes_per_second": 1e9, "device_to_host_bytes_per_second": 2e9})
    return gpu_check.evaluate_goals(rows, ks)


def test_goals_are_ratios_to_resident_inductor_in_the_same_run():
    rows = [
        _row("resident_inductor", 1, 1.0, first=10.0, peak=1000),
        _row("weights_host", 4, 1.02, first=14.0, transfer=0.5),  # 98% of resident, compute-bound
        _row("weights_host", 8, 2.5, first=20.0, transfer=2.0),  # 40%, link-bound (2 s at 1 GB/s)
        _row("grad_accumulation", 8, 16.0, transfer=16.0),  # 6.4x speedloader's K=8 step, under 0.9 x 8
        _row("weights_activations_host_recompute", 4, 1.25, peak=450),  # 80% at 45% of the peak
        _row("weights_activations_host", 4, 1.1, peak=700),  # fast but over half the peak
        {"spec": {"row": "grad_accumulation", "k": 4}, "skipped": "12 s left of the budget"},
    ]
    goals = _goals(rows, [4, 8])
    by = {(g["goal"], g.get("k")): g for g in goals if g.get("regime", "compute") == "compute"}
    assert by["weights_host_throughput", 4]["status"] == "met"
    assert by["weights_host_throughput", 4]["bound_is"] == "compute"
    assert by["weights_host_throughput", 8]["status"] == "missed"
    assert by["weights_host_throughput", 8]["bound_is"] == "link"
    assert by["weights_host_throughput", 8]["bound_ratio"] == pytest.approx(0.5)  # 1 s of compute, 2 s of link
    assert by["compile_time", 4]["status"] == "met" and by["compile_time", 8]["status"] == "missed"
    speedup = by["speedloader_over_grad_accumulation", 8]
    assert speedup["status"] == "missed" and speedup["ratio"] == pytest.approx(6.4)
    assert speedup["bound_ratio"] == pytest.approx(8.0) and speedup["target"] == pytest.approx(7.2)
    activations = by["activations_host_memory_and_throughput", None]
    assert activations["status"] == "met"
    assert [r["met"] for r in activations["rows"]] == [True, False]
    # The link-bound pair has its own resident baseline (the same model, fewer tokens).
    io = next(g for g in goals if g.get("regime") == "io_bound")
    assert io["status"] == "not measured" and "weights_host not in this run" in io["reason"]
    rows += [_row("resident_inductor", 1, 0.1, regime="io_bound"),
             _row("weights_host", 8, 0.42, transfer=0.4, regime="io_bound"),
             _row("grad_accumulation", 8, 3.3, transfer=3.2, regime="io_bound")]
    io = next(g for g in _goals(rows, [4, 8]) if g.get("regime") == "io_bound")
    assert io["status"] == "met" and io["speedloader_bound_is"] == "link"
    assert io["bound_ratio"] == pytest.approx(8.0) and io["ratio"] == pytest.approx(3.3 / 0.42)


def test_expected_weight_bytes_are_two_passes_over_the_blocks_and_k_times_that_for_grad_accumulation():
    # The 2026-11-23 H100 run moved 2.429 GB per step for the full model (2 P of its blocks).
    full = {"device": "cuda:0", "dtype": "bfloat16", "shape": gpu_check.gpu_bench.MODELS["full"]}
    assert gpu_check.expected_weight_bytes({**full, "row": "weights_host", "k": 4}) == 2_428_698_624
    assert gpu_check.expected_weight_bytes({**full, "row": "grad_accumulation", "k": 8}) == 8 * 2_428_698_624
    assert gpu_check.expected_weight_bytes({**full, "row": "resident_inductor", "k": 1}) is None
    small = {**full, "shape": gpu_check.gpu_bench.MODELS["small"], "row": "weights_activations_host", "k": 4}
    assert gpu_check.expected_weight_bytes(small) == 202_407_936
    assert gpu_check.expected_weight_bytes({**small, "device": "cpu"}) == 0


def test_goals_without_their_rows_say_why():
    rows = [_row("resident_inductor", 1, 1.0), _row("weights_host", 8, 1.0, transfer=0.1),
            {"spec": {"row": "weights_host", "k": 4}, "error": "ran out of its 150 s", "timed_out": True}]
    by = {(g["goal"], g.get("k")): g for g in _goals(rows, [4, 8]) if g.get("regime", "compute") == "compute"}
    assert by["weights_host_throughput", 4] == {**by["weights_host_throughput", 4], "status": "not measured",
                                                "reason": "weights_host: ran out of its 150 s"}
    assert by["speedloader_over_grad_accumulation", 8]["reason"] == "grad_accumulation not in this run"
    # Compute bounds speedloader's K=8 step: the K-fold goal does not apply, its figures stay.
    rows.append(_row("grad_accumulation", 8, 3.0, transfer=0.8))
    speedup = next(g for g in _goals(rows, [4, 8]) if g.get("regime") == "compute")
    assert speedup["status"] == "not applicable" and speedup["ratio"] == pytest.approx(3.0)
    no_baseline = _goals([{"spec": {"row": "resident_inductor", "k": 1}, "error": "CUDA out of memory"}], [4])
    assert {g["status"] for g in no_baseline} == {"not measured"}
    assert "CUDA out of memory" in no_baseline[0]["reason"]


def test_a_step_out_of_time_is_killed_and_rows_past_the_budget_are_skipped(tmp_path):
    started = time.monotonic()
    code, seconds, timed_out = gpu_check.run_limited(
        [sys.executable, "-c", "import time; time.sleep(60)"], 0.5, env=dict(os.environ),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert (code, timed_out) == (None, True) and time.monotonic() - started < 30
    args = gpu_check.parse(["--cpu-smoke", "--out", str(tmp_path)])
    clock = gpu_check.Clock(budget_s=1.0, reserve_s=10)  # nothing left
    rows = gpu_check.run_rows(args, {"device": "cpu"}, clock)
    assert [r["spec"]["row"] for r in rows] == ["resident_inductor", "weights_host"]
    assert all("skipped" in r for r in rows)


def test_junit_summary_counts_outcomes_and_leaves_out_a_test_a_timeout_interrupted(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite errors="0" failures="1" skipped="1" tests="3" time="2.5">'
        '<testcase classname="tests.a" name="test_ok" time="1.0" />'
        '<testcase classname="tests.a" name="test_bad" time="1.0"><failure message="assert 1 == 2">tb</failure>'
        '</testcase><testcase classname="tests.b" name="test_cuda" time="0"><skipped message="no CUDA" />'
        '</testcase><testcase time="0.015" /></testsuite></testsuites>')
    summary = gpu_check.junit_summary(str(path))
    assert {key: summary[key] for key in ("tests", "passed", "failures", "skipped")} == {
        "tests": 3, "passed": 1, "failures": 1, "skipped": 1}
    assert [(c["test"], c["outcome"]) for c in summary["cases"]] == [
        ("tests.a::test_ok", "passed"), ("tests.a::test_bad", "failed"), ("tests.b::test_cuda", "skipped")]
    assert summary["cases"][1]["message"] == "assert 1 == 2"


def test_rows_needed_by_the_goals_come_first():
    order = [(r["row"], r["k"]) for r in gpu_check.row_order([4, 8])]
    assert order[:6] == [("resident_inductor", 1), ("weights_host", 4), ("weights_activations_host_recompute", 4),
                         ("resident_inductor_cudagraphs", 1), ("weights_host_cudagraphs", 4), ("weights_host", 8)]
    rows = gpu_check.row_order([4, 8])
    assert [(r["row"], r["k"]) for r in rows[6:9] if r.get("regime") == "io_bound"] == [
        ("resident_inductor", 1), ("weights_host", 8), ("grad_accumulation", 8)]
    keys = [(r["row"], r["k"], r.get("regime")) for r in rows]
    assert len(keys) == len(set(keys))


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_writes_one_json_and_one_plot(tmp_path):
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}  # no xdist worker
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "--check", "--cpu-smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert files == ["gpu_check.json", "gpu_check.png", "pytest.log", "pytest_junit.xml"]
    assert all(os.path.getsize(out / name) < 16 << 20 for name in files)
    record = json.loads((out / "gpu_check.json").read_text())
    for key in ("device_name", "torch", "cuda", "transformers", "python", "bandwidth", "goals", "goals_text"):
        assert key in record, key
    assert record["tests"]["status"] == "passed" and record["tests"]["summary"]["passed"] == 1
    assert [r["spec"]["row"] for r in record["rows"]] == ["resident_inductor", "weights_host"]
    assert all("bound_seconds" in r and "bound_is" in r for r in record["rows"])
    assert {g["goal"] for g in record["goals"]} == {
        "weights_host_throughput", "activations_host_memory_and_throughput", "compile_time",
        "speedloader_over_grad_accumulation"}
    assert record["status"]["rows_ran"] is True
