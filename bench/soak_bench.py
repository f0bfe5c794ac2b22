"""Soak: many training steps with everything off the device, watching for leaks.

Usage:
    python bench/soak_bench.py [--steps 100] [--warmup 10] [--d-model 64] [--no-timeline]
                               [--out bench/results/soak.json]

The package's GPT with block weights and saved activations on the nvme tier and its
AdamW states on nvme too (`slcompile.offload_optimizer(states="nvme",
gradients="nvme")`), trained for ``--steps`` steps on one batch. After each step it
records the process's resident memory (VmRSS), its open file descriptors, the disk
bytes the nvme arena takes (allocated blocks of its file), the arena file's size and
the bytes moved between tiers in that step, and the events the runtime's timeline
holds (it keeps the last 20,000: their memory grows until it is full;
``--no-timeline`` records none), and how many runtime objects (weight streamers,
activation stashes, gradient sinks, engines) are alive. The summary says how much the resident
memory grew from the end of the warm-up to the last step, in percent and in bytes
per step (a least-squares slope); a leak shows as a slope that does not fall with
more steps. Prints one JSON object (the summary) and writes every step's figures to
``--out`` with a plot beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def resident_bytes() -> int:
    """The process's resident memory (VmRSS), bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def runtime_objects() -> int:
    """Live weight streamers, activation stashes, gradient sinks and engines: the
    registries the compiled graphs' ops look them up in (flat: one compile's worth)."""
    from slcompile.runtime import activations, gradients, weights
    from slcompile.runtime.storage import engine

    return len(weights._STREAMERS) + len(activations._STASHES) + len(gradients._SINKS) + len(engine._ENGINES)


def arena_figures(offload_dir: str) -> tuple[int, int]:
    """(disk bytes allocated, file size) of every arena file under ``offload_dir``."""
    disk = size = 0
    for name in os.listdir(offload_dir):
        path = os.path.join(offload_dir, name, "arena.bin")
        try:
            info = os.stat(path)
        except OSError:
            continue
        disk += info.st_blocks * 512
        size += info.st_size
    return disk, size


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0


def soak(steps: int, warmup: int, d_model: int, offload_dir: str, timeline_on: bool = True):
    import torch

    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.runtime import mark_step, reset_runtime_stats, set_timeline_enabled, timeline

    set_timeline_enabled(timeline_on)

    torch.manual_seed(0)
    cfg = GPTConfig(d_model=d_model, seq_len=32, n_layers=4, n_heads=4, vocab_size=256)
    model = TinyGPT(cfg)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-3, states="nvme", gradients="nvme")
    options = {
        "lowering": "aot_eager", "num_subbatches": 2, "weights": "nvme", "activations": "nvme",
        "min_offload_bytes": 4096, "offload_dir": offload_dir,
    }
    compiled = torch.compile(model, backend="speedloader", options=options)
    idx, targets = make_gpt_batch(cfg, 8)
    reset_runtime_stats()
    rows = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - started
        moved = mark_step().total_bytes()
        disk, size = arena_figures(offload_dir)
        rows.append({
            "step": step, "seconds": seconds, "loss": loss.item(), "rss_bytes": resident_bytes(),
            "open_fds": open_fds(), "arena_disk_bytes": disk, "arena_file_bytes": size,
            "moved_bytes": moved, "timeline_events": len(timeline()), "runtime_objects": runtime_objects(),
        })
    opt.close()
    from slcompile.runtime.storage.engine import get_engine

    get_engine(offload_dir).close()  # removes the arena's directory
    summary = {"d_model": d_model, "timeline": timeline_on,
               "parameters": sum(p.numel() for p in model.parameters()), **summarize(rows, warmup)}
    return summary, rows


def summarize(rows: list[dict], warmup: int) -> dict:
    """The growth figures of a soak's rows, from the end of the warm-up on."""
    from slcompile.runtime.stats import TIMELINE_CAPACITY

    after = rows[warmup - 1:]
    first, last = after[0], after[-1]
    # Until the timeline holds its last TIMELINE_CAPACITY events it grows the
    # resident memory by design; growth beyond that point would be a leak.
    full = [r for r in after if r["timeline_events"] >= TIMELINE_CAPACITY]
    return {
        "steps": len(rows), "warmup_steps": warmup,
        "rss_after_warmup_bytes": first["rss_bytes"], "rss_last_bytes": last["rss_bytes"],
        "rss_growth_after_warmup_percent": 100.0 * (last["rss_bytes"] - first["rss_bytes"]) / first["rss_bytes"],
        "rss_slope_bytes_per_step": slope([r["step"] for r in after], [r["rss_bytes"] for r in after]),
        "timeline_full_at_step": full[0]["step"] if full else None,
        "rss_slope_once_timeline_full_bytes_per_step":
            slope([r["step"] for r in full], [r["rss_bytes"] for r in full]) if len(full) > 1 else None,
        "open_fds_after_warmup": first["open_fds"], "open_fds_last": last["open_fds"],
        "arena_disk_after_warmup_bytes": first["arena_disk_bytes"], "arena_disk_last_bytes": last["arena_disk_bytes"],
        "moved_per_step_mean_bytes": sum(r["moved_bytes"] for r in after) / len(after),
        "moved_per_step_range_bytes": [min(r["moved_bytes"] for r in after), max(r["moved_bytes"] for r in after)],
        "timeline_events_last": last["timeline_events"],
        "runtime_objects_after_warmup": first["runtime_objects"], "runtime_objects_last": last["runtime_objects"],
        "median_step_seconds": sorted(r["seconds"] for r in after)[len(after) // 2],
    }


def plot(rows: list[dict], warmup: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    figure, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    panels = (
        ("rss_bytes", "resident memory (MiB)", 1 << 20),
        ("arena_disk_bytes", "arena on disk (MiB)", 1 << 20),
        ("open_fds", "open file descriptors", 1),
        ("moved_bytes", "bytes moved per step (MiB)", 1 << 20),
    )
    for axis, (key, title, unit) in zip(axes.flat, panels):
        axis.plot(steps, [r[key] / unit for r in rows])
        axis.axvline(warmup, color="grey", linestyle=":", linewidth=1)
        axis.set_title(title)
        axis.set_ylim(bottom=0)
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle("soak: weights, activations and AdamW states on nvme")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the growth is measured")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--no-timeline", action="store_true",
                        help="record no timeline events (the timeline keeps the last 20,000, which grows the "
                             "resident memory until it is full)")
    parser.add_argument("--offload-dir", default=None, help="parent of the arena (default: a fresh temp dir)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = parser.parse_args()
    if args.steps < 2 or not 1 <= args.warmup < args.steps:
        parser.error("need --steps >= 2 and 1 <= --warmup < --steps")
    import torch

    offload_dir = args.offload_dir or tempfile.mkdtemp(prefix="slc-soak-")
    summary, rows = soak(args.steps, args.warmup, args.d_model, offload_dir, not args.no_timeline)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "torch": torch.__version__, "command": " ".join(["python", "-m", "bench", "soak", *sys.argv[1:]]),
            "summary": summary, "rows": rows,
        }, f, indent=1)
    plot(rows, args.warmup, os.path.splitext(args.out)[0] + ".png")
    if not args.offload_dir:
        os.rmdir(offload_dir)  # empty: the arena's directory went with its engine
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
