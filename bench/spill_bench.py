"""Spilled boundary activations in an evaluation: the step's peak and the bytes moved
under the spilling policies, as ratios against speedloader in the same run.

TinyGPT (vocab 32, d_model 64, seq 32, 4 blocks), batch 32, K=8, activations on
nvme, `torch.no_grad()`. The peak is measured from torch's allocations (loads where
the profiler sees them) and predicted by the memory model. Writes
bench/results/spill_bench.json. Run: `python -m bench.spill_bench`.
"""

from __future__ import annotations

import json
import pathlib

import torch

import slcompile
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.memory import measured_peak_bytes, predict_memory
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import collect_garbage, reset_runtime_stats, runtime_stats
from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
from slcompile.runtime.storage.tiers import PAGE_BYTES

OUT = pathlib.Path(__file__).parent / "results" / "spill_bench.json"
POLICIES = ("speedloader", "spilling", "zigzag_spilling")


def measure(model, idx, targets, schedule: str) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0, "num_subbatches": 8,
        "schedule": schedule, "on_refusal": "raise"})

    def step():
        with torch.no_grad():
            return compiled(idx, targets)

    with buffers_seen_by_profiler():
        step()
        collect_garbage()
        reset_runtime_stats()
        measured = measured_peak_bytes(step)
        moved = sum(runtime_stats().bytes_moved.values())
    report = slcompile.compile_reports()[-1]
    pages = MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES)
    predicted = predict_memory(report.graphs["inference"], graph_kind="inference", machine=pages).step_peak_bytes
    return {"policy": schedule, "measured_peak_bytes": measured, "predicted_peak_bytes": predicted,
            "bytes_moved": moved, "spilled_outputs": len(report.spilled_boundaries.names)}


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=2, n_layers=4)
    model, (idx, targets) = TinyGPT(config), make_gpt_batch(config, 32)
    rows = [measure(model, idx, targets, policy) for policy in POLICIES]
    base = rows[0]["measured_peak_bytes"]
    for row in rows:
        row["peak_vs_speedloader"] = round(row["measured_peak_bytes"] / base, 4)
        print(row)
    OUT.write_text(json.dumps({"config": "TinyGPT vocab 32, d 64, seq 32, 4 blocks, batch 32, K=8, nvme, eval",
                               "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
