"""Training step with block weights on the nvme tier: speedloader against gradient
accumulation and against everything resident, in one run.

Usage:
    python bench/train_bench.py [--quick] [--repeats 3] [--out bench/results/train_bench.json]

Schedules, all through the same backend, runtime and counters:
- ``speedloader``: one compiled step over the whole batch, K sub-batches layer-major,
  weights on nvme (each block's weights loaded once per forward and once per
  backward, shared by the K sub-batches), `live_blocks=2` prefetch.
- ``grad_accumulation``: the canonical baseline: the same compiled model with K=1,
  called on K micro-batches, each running the whole model forward and backward, so
  every weight is loaded once per micro-batch and direction.
- ``no_offload``: K=1 on the whole batch with every weight resident: the compute time
  of a step, and the ideal when the model fits.
- ``resident_subbatched``: K sub-batches layer-major with every weight resident: the
  compute time of the sub-batched step alone, so the cost of splitting the batch and
  the cost of offloading show apart.

Two regimes per K: few tokens per sub-batch (weight loads dominate: I/O-bound) and
many (compute dominates). Each configuration runs in its own process, so peak RSS is
its own, and reports the median of ``--repeats`` steps after a warm-up step:
time, tokens/s, bytes per (kind, tier, tier), stall time, peak RSS. The disk's O_DIRECT
read bandwidth is measured in the same run with dd, for the physical bound
max(compute time, bytes moved / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MiB = 2**20

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run_one(spec: dict) -> dict:
    """Runs one configuration in this process and returns its figures."""
    import torch

    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT
    from slcompile.runtime import mark_step, reset_runtime_stats

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=spec["vocab"], seq_len=spec["seq_len"], d_model=spec["d_model"],
        n_heads=spec["n_heads"], n_layers=spec["n_layers"],
    )
    model = TinyGPT(cfg)
    batch, k, schedule = spec["batch"], spec["k"], spec["schedule"]
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    options = {"lowering": spec["lowering"], "offload_dir": spec["offload_dir"]}
    if schedule == "speedloader":
        options.update(num_subbatches=k, weights="nvme", live_blocks=2)
        micro = [(idx, targets)]
    elif schedule == "grad_accumulation":
        options.update(num_subbatches=1, weights="nvme", live_blocks=2)
        micro = list(zip(idx.chunk(k), targets.chunk(k)))
    elif schedule == "resident_subbatched":
        options.update(num_subbatches=k, weights="device")
        micro = [(idx, targets)]
    else:
        options.update(num_subbatches=1, weights="device")
        micro = [(idx, targets)]
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        started = time.perf_counter()
        for x, y in micro:
            _, loss = compiled(x, y)
            (loss / len(micro)).backward()
        return time.perf_counter() - started

    compile_started = time.perf_counter()
    step()  # compiles, offloads the weights, warms the caches
    compile_seconds = time.perf_counter() - compile_started
    step()
    reset_runtime_stats()
    times, steps = [], []
    for _ in range(spec["repeats"]):
        mark_step()
        times.append(step())
        steps.append(mark_step())
    median = statistics.median_high(times)  # a measured step, so its counters go with it
    middle = steps[times.index(median)]
    report = slcompile.compile_reports()[-1]
    tokens = batch * cfg.seq_len
    return {
        "spec": spec,
        "fallback_reason": report.fallback_reason,
        "step_seconds": median,
        "all_step_seconds": times,
        "tokens_per_second": tokens / median,
        "bytes_moved": {"/".join(part.value for part in key): n for key, n in middle.bytes_moved.items()},
        "weight_load_bytes": sum(
            n for (kind, _, dst), n in middle.bytes_moved.items() if kind.value == "weight" and dst.value == "device"
        ),
        "stall_seconds": middle.stall_seconds,
        "io_busy_seconds": dict(middle.busy_seconds),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "streamed_bytes": report.streamed_bytes,
        "compile_and_first_step_seconds": compile_seconds,
    }


def dd_read_bandwidth(directory: str, nbytes: int = 1 << 30) -> float:
    """O_DIRECT read bandwidth of the disk under `directory`, in bytes/s (dd, 8 MiB)."""
    path = os.path.join(directory, "dd-bench")
    count = nbytes // (8 << 20)
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct"],
        check=True, capture_output=True,
    )
    started = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True, capture_output=True)
    seconds = time.perf_counter() - started
    os.unlink(path)
    return count * (8 << 20) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model and K in {1, 4}: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lowering", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--offload-dir", default=None, help="where the nvme tier's files go (default: a temp dir)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "train_bench.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    from tqdm import tqdm

    offload_dir = args.offload_dir or tempfile.mkdtemp(prefix="slc-bench-", dir=os.environ.get("TMPDIR", "/tmp"))
    if args.quick:
        model = {"d_model": 256, "n_heads": 4, "n_layers": 8, "vocab": 512}
        ks = [1, 4]
        regimes = {"io_bound": (8, 4), "compute_bound": (8, 64)}
    else:
        model = {"d_model": 1024, "n_heads": 16, "n_layers": 8, "vocab": 1024}
        ks = [1, 2, 4, 8]
        # (batch, tokens per sample). I/O-bound: 4 tokens per sub-batch at K=8, far
        # too little compute to hide a block's weight load. Compute-bound: 512 tokens.
        regimes = {"io_bound": (8, 4), "compute_bound": (8, 64)}
    bandwidth = dd_read_bandwidth(offload_dir)
    specs = []
    for regime, (batch, seq_len) in regimes.items():
        base = dict(model, batch=batch, seq_len=seq_len, regime=regime, repeats=args.repeats,
                    lowering=args.lowering, offload_dir=offload_dir)
        specs.append(dict(base, schedule="no_offload", k=1))
        for k in ks:
            specs.append(dict(base, schedule="speedloader", k=k))
            specs.append(dict(base, schedule="grad_accumulation", k=k))
            if k > 1:
                specs.append(dict(base, schedule="resident_subbatched", k=k))
    results = []
    for spec in tqdm(specs, desc="train bench", unit="config"):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"configuration {spec} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    summary = summarize(results, bandwidth)
    import torch

    record = {
        "command": "python bench/train_bench.py" + (" --quick" if args.quick else "") + f" --repeats {args.repeats}",
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__},
        "disk_read_bandwidth_bytes_per_s": bandwidth,
        "summary": summary,
        "runs": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    print_table(summary, bandwidth)
    plot(summary, args.out.replace(".json", ".png"))
    print(f"wrote {args.out}")


def summarize(results: list[dict], bandwidth: float) -> list[dict]:
    """Per regime and K: the ratios the goals are stated in."""
    rows = []
    by_key = {(r["spec"]["regime"], r["spec"]["schedule"], r["spec"]["k"]): r for r in results}
    for (regime, schedule, k), run in sorted(by_key.items()):
        if schedule != "speedloader":
            continue
        accumulation = by_key[(regime, "grad_accumulation", k)]
        resident = by_key[(regime, "no_offload", 1)]
        split = by_key.get((regime, "resident_subbatched", k), resident)
        bound = max(resident["step_seconds"], run["weight_load_bytes"] / bandwidth)
        rows.append({
            "regime": regime,
            "k": k,
            "speedloader_step_s": run["step_seconds"],
            "grad_accumulation_step_s": accumulation["step_seconds"],
            "no_offload_step_s": resident["step_seconds"],
            "speedup_vs_grad_accumulation": accumulation["step_seconds"] / run["step_seconds"],
            "fraction_of_no_offload_throughput": resident["step_seconds"] / run["step_seconds"],
            "time_over_physical_bound": run["step_seconds"] / bound,
            "resident_subbatched_step_s": split["step_seconds"],
            "time_over_subbatched_bound": run["step_seconds"]
            / max(split["step_seconds"], run["weight_load_bytes"] / bandwidth),
            "weight_load_bytes": run["weight_load_bytes"],
            "grad_accumulation_weight_load_bytes": accumulation["weight_load_bytes"],
            "streamed_bytes": run["streamed_bytes"],
            "stall_s": run["stall_seconds"],
            "peak_rss_bytes": run["peak_rss_bytes"],
            "no_offload_peak_rss_bytes": resident["peak_rss_bytes"],
            "tokens_per_second": run["tokens_per_second"],
        })
    return rows


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"disk O_DIRECT read bandwidth: {bandwidth / 1e9:.2f} GB/s")
    header = (
        f"{'regime':14} {'K':>2} {'sl s':>7} {'ga s':>7} {'none s':>7} {'split s':>7} {'x ga':>6} {'% none':>7} "
        f"{'/bound':>7} {'/sbound':>7} {'W load MiB':>10} {'ga W MiB':>9} {'RSS MiB':>7}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['regime']:14} {r['k']:>2} {r['speedloader_step_s']:7.3f} {r['grad_accumulation_step_s']:7.3f} "
            f"{r['no_offload_step_s']:7.3f} {r['resident_subbatched_step_s']:7.3f} {r['speedup_vs_grad_accumulation']:6.2f} "
            f"{100 * r['fraction_of_no_offload_throughput']:6.1f}% {r['time_over_physical_bound']:7.2f} "
            f"{r['time_over_subbatched_bound']:7.2f} "
            f"{r['weight_load_bytes'] / MiB:10.1f} {r['grad_accumulation_weight_load_bytes'] / MiB:9.1f} "
            f"{r['peak_rss_bytes'] / MiB:7.0f}"
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for regime in sorted({r["regime"] for r in rows}):
        sub = [r for r in rows if r["regime"] == regime]
        ks = [r["k"] for r in sub]
        axes[0].plot(ks, [r["speedup_vs_grad_accumulation"] for r in sub], marker="o", label=regime)
        axes[1].plot(ks, [r["weight_load_bytes"] / MiB for r in sub], marker="o", label=f"speedloader, {regime}")
        axes[1].plot(ks, [r["grad_accumulation_weight_load_bytes"] / MiB for r in sub], marker="x", linestyle="--",
                     label=f"grad accumulation, {regime}")
    axes[0].plot([1, max(r["k"] for r in rows)], [1, max(r["k"] for r in rows)], color="grey", linestyle=":", label="K (ideal)")
    axes[0].set(xlabel="K (sub-batches)", ylabel="step-time speedup over grad accumulation",
                title="speedloader vs gradient accumulation")
    axes[1].set(xlabel="K (sub-batches)", ylabel="weight bytes loaded per step (MiB)", title="weight traffic per step")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
