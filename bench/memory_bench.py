"""Predicted against measured peak device memory of a training step.

Usage:
    python bench/memory_bench.py [--d-model 128] [--out bench/results/memory_bench.json]

For each configuration (K, live_blocks, recompute) of the package's GPT with block
weights and saved activations on the nvme tier, compiles the step, runs two steps
to reach the steady state, then measures two steps and keeps the smaller peak (a first
profiled step can include one-time allocations; before each, prefetched weights are
dropped as an optimizer step inside `gathered_weights` does): the running sum of every
allocation and free of torch's CPU allocator that torch.profiler records, relative to
the step's start, with loads placed in allocator memory
(`buffers_seen_by_profiler`, which adds one page of alignment slack per loaded
buffer; the prediction printed next to it is told so). Also printed: the plan's own
prediction (no slack) and its per-tier peaks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def measured_peak_bytes(fn) -> int:
    from slcompile.analysis.memory import measured_peak_bytes as measure

    return measure(fn)


def run(k: int, live_blocks: int, recompute: str, d_model: int) -> dict:
    import torch

    import slcompile
    from slcompile.analysis.machine import MachineFacts
    from slcompile.analysis.memory import predict_memory
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
    from slcompile.runtime.storage.tiers import PAGE_BYTES

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=d_model, seq_len=64, n_layers=4, n_heads=4)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 8)
    options = {
        "lowering": "aot_eager", "num_subbatches": k, "weights": "nvme", "activations": "nvme",
        "live_blocks": live_blocks, "recompute": recompute, "min_offload_bytes": 16384,
    }
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        logits, loss = compiled(idx, targets)
        loss.backward()

    with buffers_seen_by_profiler():
        for _ in range(2):
            step()
            for p in model.parameters():
                p.grad = None
        peaks = []
        for _ in range(2):  # a profiled step can include one-time allocations
            for p in model.parameters():
                p.grad = None
            with slcompile.gathered_weights(model):  # where an optimizer step goes
                pass
            peaks.append(measured_peak_bytes(step))
        measured = min(peaks)
    report = slcompile.compile_reports()[-1]
    with_slack = predict_memory(
        report.graphs["forward"], report.graphs["backward"], live_blocks=live_blocks,
        machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES),
    ).step_peak_bytes
    return {
        "k": k, "live_blocks": live_blocks, "recompute": recompute,
        "measured_step_peak_bytes": measured,
        "measured_step_peak_bytes_each": peaks,
        "predicted_step_peak_bytes": with_slack,
        "error": (with_slack - measured) / measured,
        "plan_step_peak_bytes": report.memory.step_peak_bytes,
        "plan_peak_bytes_by_tier": report.memory.peak_bytes,
        "offloaded_activation_bytes": report.memory.offloaded_activation_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "memory_bench.json"))
    args = parser.parse_args()
    import torch
    from tqdm import tqdm

    grid = list(itertools.product((1, 2, 4, 8), (1, 2), ("none", "blocks")))
    rows = [run(k, lb, rc, args.d_model) for k, lb, rc in tqdm(grid, desc="configurations")]
    print(f"{'K':>2} {'live':>4} {'recompute':9} {'measured B':>11} {'predicted B':>11} {'error':>7} "
          f"{'plan B':>10} {'nvme B':>10}")
    for r in rows:
        print(f"{r['k']:>2} {r['live_blocks']:>4} {r['recompute']:9} {r['measured_step_peak_bytes']:>11} "
              f"{r['predicted_step_peak_bytes']:>11} {r['error']:>+7.2%} {r['plan_step_peak_bytes']:>10} "
              f"{r['plan_peak_bytes_by_tier']['nvme']:>10}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "torch": torch.__version__, "d_model": args.d_model, "rows": rows,
        }, f, indent=1)


if __name__ == "__main__":
    main()
