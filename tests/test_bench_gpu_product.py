"""bench/gpu_product.py, the product benchmark: its model FLOPs against a count by
hand, the device peaks, its goals from rows, the budget's skip path, and (slow) its
whole path on the CPU (`--cpu-smoke`), so that the command a GPU machine runs first
cannot rot where no GPU is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_product  # noqa: E402


def test_model_flops_of_e0_are_six_n_t_plus_the_palm_attention_term():
    shape = gpu_product.SHAPES["E"]
    assert shape == {"layers": 12, "hidden": 4096, "intermediate": 11008, "heads": 32, "vocab": 32000,
                     "batch": 4, "seq": 2048}
    layers, hidden, intermediate, vocab, seq = 12, 4096, 11008, 32000, 2048
    # q, k, v, o (32 key/value heads: all four hidden x hidden), gate, up, down, two RMSNorms.
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    n = layers * per_layer + hidden + vocab * hidden  # the final norm and the untied head; no embedding
    tokens = 4 * seq
    assert gpu_product.non_embedding_parameters(shape) == n
    assert gpu_product.model_flops(shape) == 6 * n * tokens + 12 * layers * hidden * seq * tokens
    assert gpu_product.model_flops(shape) == pytest.approx(1.357e14, rel=1e-3)
    b = gpu_product.SHAPES["B"]
    assert gpu_product.non_embedding_parameters(b) == 24 * per_layer + hidden + vocab * hidden
    assert gpu_product.model_flops(b) == (6 * gpu_product.non_embedding_parameters(b) * 16 * seq
                                          + 12 * 24 * hidden * seq * 16 * seq)


def test_the_parameter_count_is_the_llama_that_transformers_builds():
    import torch
    from transformers import LlamaForCausalLM

    shape = gpu_product.SHAPES["E"]
    with torch.device("meta"):
        model = LlamaForCausalLM(gpu_product.llama_config(shape))
    embedding = model.model.embed_tokens.weight.numel()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) - embedding == gpu_product.non_embedding_parameters(shape)
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False


def test_the_peak_comes_from_the_device_name_and_its_multiprocessors():
    sxm = gpu_product.peak_for("NVIDIA H100 80GB HBM3", 132)
    assert sxm["flops_per_second"] == 989e12 and "H100 SXM" in sxm["source"] and "132" in sxm["source"]
    assert gpu_product.peak_for("NVIDIA H100 PCIe", 114)["flops_per_second"] == 756e12
    assert gpu_product.peak_for("NVIDIA H200", 132)["flops_per_second"] == 989e12
    assert gpu_product.peak_for("NVIDIA H100 NVL", 132)["flops_per_second"] == 835e12
    other = gpu_product.peak_for("NVIDIA A100-SXM4-80GB", 108)
    assert other["flops_per_second"] is None and "not in the table" in other["source"]


def _row(name, step, *, first=10.0, tokens=8192, mfu=None):
    return {"spec": {"row": name}, "step_seconds": step, "tokens_per_second": tokens / step,
            "first_step_seconds": first, "mfu": mfu}


PEAK = {"flops_per_second": 989e12, "source": "H100 SXM"}


def _by_name(goals):
    assert [g["goal"] for g in goals] == list(gpu_product.GOALS)
    return {g["goal"]: g for g in goals}


def test_goals_met_are_ratios_within_the_run():
    rows = [_row("E0", 1.0, first=60.0), _row("E1", 1.04, first=85.0), _row("E2", 0.9),
            _row("B1", 3.0, tokens=32768, mfu=0.42), _row("P1", 5.0, tokens=32768)]
    goals = _by_name(gpu_product.evaluate_goals(rows, PEAK))
    assert {g["status"] for g in goals.values()} == {"met"}
    assert goals["e1_throughput"]["ratio"] == pytest.approx(1 / 1.04)
    assert goals["e1_throughput"]["e0_tokens_per_second"] == pytest.approx(8192)
    assert goals["e1_first_step"]["ratio"] == pytest.approx(85 / 60)
    assert goals["b1_mfu"]["ratio"] == pytest.approx(0.42) and goals["b1_mfu"]["peak_flops_per_second"] == 989e12
    assert goals["b1_over_p1"]["ratio"] == pytest.approx(5 / 3)


def test_goals_missed_keep_their_figures():
    rows = [_row("E0", 1.0, first=60.0), _row("E1", 1.2, first=100.0),
            _row("B1", 4.0, tokens=32768, mfu=0.3), _row("P1", 5.0, tokens=32768)]
    goals = _by_name(gpu_product.evaluate_goals(rows, PEAK))
    assert {g["status"] for g in goals.values()} == {"missed"}
    assert goals["e1_throughput"]["ratio"] == pytest.approx(1 / 1.2) and goals["e1_throughput"]["target"] == 0.95
    assert goals["e1_first_step"]["ratio"] == pytest.approx(100 / 60)
    assert goals["b1_over_p1"]["ratio"] == pytest.approx(1.25)
    assert goals["b1_over_p1"]["p1_tokens_per_second"] == pytest.approx(32768 / 5)


def test_goals_without_their_rows_say_why():
    rows = [{"spec": {"row": "E0"}, "error": "OutOfMemoryError: CUDA out of memory"},
            {"spec": {"row": "E1"}, "skipped": "12 s left of the budget"},
            _row("B1", 3.0, tokens=32768),
            {"spec": {"row": "P1"}, "unavailable": "RuntimeError: no nccl"}]
    no_peak = {"flops_per_second": None, "source": "no peak for the CPU (smoke run)"}
    goals = _by_name(gpu_product.evaluate_goals(rows, no_peak))
    assert {g["status"] for g in goals.values()} == {"not measured"}
    assert goals["e1_throughput"]["reason"] == "E1: 12 s left of the budget; E0: OutOfMemoryError: CUDA out of memory"
    assert goals["b1_mfu"]["reason"] == "no peak for the CPU (smoke run)"
    assert goals["b1_over_p1"]["reason"] == "P1: RuntimeError: no nccl"
    goals = _by_name(gpu_product.evaluate_goals(rows[:1], PEAK))
    assert goals["b1_mfu"]["reason"] == "B1 not in this run"
    # A speedloader row compiled plainly measured Inductor: it decides no goal.
    plain = {**_row("E1", 1.0), "fallback_reason": "batch 3 not divisible by K=4", "blocks": 0}
    goals = _by_name(gpu_product.evaluate_goals([_row("E0", 1.0), plain], PEAK))
    assert goals["e1_throughput"]["status"] == "not measured"
    assert goals["e1_throughput"]["reason"] == "E1: compiled without speedloader: batch 3 not divisible by K=4"


def test_mfu_is_model_flops_over_step_time_and_peak():
    row = {"spec": {"row": "E0", "shape": gpu_product.SHAPES["E"]}, "step_seconds": 0.5}
    gpu_product.add_flops(row, 989e12)
    assert row["mfu"] == pytest.approx(gpu_product.model_flops(gpu_product.SHAPES["E"]) / (0.5 * 989e12))
    gpu_product.add_flops(row, None)
    assert row["mfu"] is None


def test_a_row_runs_until_the_later_rows_estimates_and_rows_past_the_budget_are_skipped(tmp_path, monkeypatch):
    estimates = gpu_product.ROW_ESTIMATE_S
    both = estimates["B1"] + estimates["P1"]
    assert gpu_product.time_limit("B1", ["P1"], both + 50, estimates) == both + 50 - estimates["P1"]
    assert gpu_product.time_limit("B1", ["P1"], both - 50, estimates) == estimates["B1"]
    assert gpu_product.time_limit("B1", ["P1"], estimates["B1"] - 50, estimates) == estimates["B1"] - 50
    out = tmp_path / "product.json"
    # main() sets it for the rows' children; it must not outlive this test in the process.
    monkeypatch.setenv("SLC_SEPARATE_HOST", "1")
    assert gpu_product.main(["--cpu-smoke", "--out", str(out), "--budget-s", "1"]) == 1
    record = json.loads(out.read_text())
    assert [r["spec"]["row"] for r in record["rows"]] == ["E0", "E1", "E2", "B1", "P1"]
    assert all("left of the budget" in r["skipped"] for r in record["rows"])
    assert {g["status"] for g in record["goals"]} == {"not measured"}
    assert record["status"]["rows_ran"] is False


def test_a_package_torch_compile_does_not_know_stops_before_any_row(tmp_path, monkeypatch, capsys):
    """Run from a checkout where the package is not installed, `backend="speedloader"`
    is unknown to torch.compile: every row would fail the same way after its
    imports, so nothing runs and the message says how to install it."""
    import torch

    from torch._dynamo.exc import InvalidBackend

    def unknown(name):
        raise InvalidBackend(name=name)

    monkeypatch.setattr(torch._dynamo, "lookup_backend", unknown)
    out = tmp_path / "product.json"
    assert gpu_product.main(["--cpu-smoke", "--out", str(out)]) == 2
    assert not out.exists()
    message = capsys.readouterr().err
    assert "Invalid backend: 'speedloader'" in message and "wheels" in message


@pytest.mark.slow
def test_cpu_smoke_runs_every_row_and_writes_the_goals_and_the_flop_formula(tmp_path):
    out = tmp_path / "gpu_product.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}  # no xdist worker
    proc = subprocess.run([sys.executable, "bench/gpu_product.py", "--cpu-smoke", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["model_flops_formula"] == gpu_product.MODEL_FLOPS_FORMULA
    assert record["peak_flops"]["flops_per_second"] is None
    for key in ("commit", "tracked_files_changed", "torch", "device_name", "goals_text"):
        assert key in record, key
    goals = _by_name(record["goals"])
    assert goals["b1_mfu"]["status"] == "not measured"
    rows = {r["spec"]["row"]: r for r in record["rows"]}
    assert list(rows) == ["E0", "E1", "E2", "B1", "P1"]
    for name, row in rows.items():
        assert "step_seconds" in row or (name == "P1" and row.get("unavailable")), (name, row.get("error"))
        if "step_seconds" not in row:
            continue
        shape = row["spec"]["shape"]
        assert row["model_flops_per_step"] == gpu_product.model_flops(shape) and row["mfu"] is None
        # The formula's N against the model each row built.
        assert row["parameters"] == gpu_product.non_embedding_parameters(shape) + shape["vocab"] * shape["hidden"]
    for name in ("E1", "E2", "B1"):
        row = rows[name]
        assert row["fallback_reason"] is None, row["fallback_reason"]  # speedloader's path, not a plain compile
        assert row["blocks"] == row["spec"]["shape"]["layers"]
        # The smoke run's host tier copies (SLC_SEPARATE_HOST=1): the bytes a GPU moves, unpinned.
        expected = row["expected_bytes_per_step"]
        assert expected["weight/host/device"] == 2 * row["streamed_bytes"] > 0
        assert {key: row["bytes_moved_per_step"].get(key) for key in expected} == expected
        assert row["pinned_host_bytes"] == 0
    assert rows["E1"]["untimed_optimizer_seconds"] >= 0 and "optimizer_step_seconds" not in rows["E1"]
    assert rows["B1"]["optimizer_step_seconds"] > 0
    if "step_seconds" in rows["P1"]:
        assert rows["P1"]["micro_batches"] == 1 and rows["P1"]["micro_batch_tries"] == []


def test_fsdp2_takes_the_fewest_micro_batches_that_do_not_run_out_of_memory(monkeypatch):
    import torch

    sharded = gpu_product.gpu_bench.fsdp2_cpu_offload

    def running_out_above_two_sequences(model, device):
        forward = sharded(model, device)

        def call(**kwargs):
            outputs = forward(**kwargs)  # FSDP2 has unsharded and resharded its layers, as a real OOM leaves them
            if kwargs["input_ids"].shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return outputs

        return call

    monkeypatch.setattr(gpu_product.gpu_bench, "fsdp2_cpu_offload", running_out_above_two_sequences)
    spec = next(s for s in gpu_product.row_specs(smoke=True, e_cap_bytes=None, b_cap_bytes=None,
                                                 lowering="aot_eager") if s["row"] == "P1")
    spec = {**spec, "device": "cpu", "dtype": "float32", "repeats": 1, "warmup": 0}
    row = gpu_product.run_row(spec)
    assert "unavailable" not in row, row.get("traceback_tail")
    assert row["micro_batches"] == 4  # 8 sequences: 8 and 4 per micro-batch ran out, 2 did not
    assert [t["micro_batches"] for t in row["micro_batch_tries"]] == [1, 2]
    assert all("simulated" in t["error"] for t in row["micro_batch_tries"])
    assert row["step_seconds"] > 0 and row["optimizer_step_seconds"] > 0
