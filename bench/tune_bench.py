"""Tune's choice against the fastest measured plan: `slcompile.tune(..., profile=...)`
under a memory budget, and every plan that fits it timed on this machine.

Usage:
    python bench/tune_bench.py [--rounds 9] [--threads 1] [--budget-fraction 0.6] [--weights nvme]
                               [--activations device] [--quick] [--out bench/results/tune_bench.json]

The machine's profile is measured first (`slcompile.profile.measure_profile(steps=True)`,
not the cache: the same conditions as the steps). The model is the package's GPT
(batch 16, so that K = 1, 2, 4, 8, 16 divide it; `lowering="aot_eager"`, the block
weights and the saved activations on the tiers `--weights` and `--activations`).

The budget: `tune` is called twice with a budget nothing exceeds, once with
`recompute="none"` and once with `recompute="blocks"`, and `.tried` gives every
candidate's (K, live_blocks) predicted device peak under each (`Candidate.peak_bytes`). A candidate's least
peak is the smaller of the two (with `recompute="auto"`, tune's default, a candidate
whose peak without recomputation is over the budget recomputes blocks, so the peaks
without recomputation alone would exclude nothing). The budget B is
`--budget-fraction` of the way from the smallest least peak to the largest, so the
candidates whose least peak is over B are excluded and the others fit, some only by
recomputing. Then `tune(..., memory_budget=B, profile=profile)` (recompute left at
"auto") chooses the plan the time model predicts fastest of those that fit
(`.fitting`, each with its predicted time and recompute choice).

The grid: every candidate in `.fitting`, each compiled with the options tune
evaluated it with (`Candidate.options`: the fixed options, K, live_blocks,
`memory_budget=B` and the profile as `machine_profile`; recompute "auto"), so the
compile makes the same recompute (and stash) choice under the same budget; each
row records the compiled plan's recompute and peak, and whether both are the ones
tune predicted. Each plan is compiled and warmed up (2 steps, a new model each, seed
0); the plans' steps are then timed round-robin, `--rounds` rounds, so that a burst of
load from another process on a shared machine falls on all of them alike. Each row
keeps the fastest step and the median.

Reported: per row the predicted and measured step time and the error; the row tune
chose and the fastest measured row; `chosen_over_fastest` = measured(chosen) /
measured(fastest) - 1 (fastest steps), the goal being at most 5%; and Spearman's rank
correlation of the predicted against the measured times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.timing import add_model_arguments, spearman, time_round_robin  # noqa: E402

LIVE_BLOCKS = (2, 1)  # tune's default windows, preferred first
UNBOUNDED = 1 << 50  # a budget no candidate of these models comes near


def make_model(args):
    import torch

    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    torch.manual_seed(0)
    cfg = GPTConfig(d_model=args.d_model, seq_len=args.seq_len, n_layers=args.layers, n_heads=4)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, args.batch)
    return model, idx, targets


def fixed_options(args) -> dict:
    return {"lowering": "aot_eager", "weights": args.weights, "activations": args.activations}


def build_step(options, args):
    import torch

    import slcompile

    model, idx, targets = make_model(args)
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        _, loss = compiled(idx, targets)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(2):
        step()
    return step, slcompile.compile_reports()[-1]


def choose_budget(args, profile) -> dict:
    """Every candidate's predicted device peak without and with block recomputation,
    and the budget `--budget-fraction` of the way between the least peaks."""
    import slcompile

    model, idx, targets = make_model(args)
    peaks: dict[tuple[int, int], dict[str, int | None]] = {}
    for recompute in ("none", "blocks"):
        result = slcompile.tune(model, idx, targets, memory_budget=UNBOUNDED, live_blocks=LIVE_BLOCKS,
                                profile=profile, recompute=recompute, **fixed_options(args))
        for candidate in result.tried:
            peaks.setdefault((candidate.num_subbatches, candidate.live_blocks), {})[recompute] = candidate.peak_bytes
    candidates = []
    for (k, window), by_recompute in peaks.items():
        known = [p for p in by_recompute.values() if p is not None]
        candidates.append({"k": k, "live_blocks": window, "peak_bytes_recompute_none": by_recompute.get("none"),
                           "peak_bytes_recompute_blocks": by_recompute.get("blocks"),
                           "least_peak_bytes": min(known) if known else None})
    least = [c["least_peak_bytes"] for c in candidates if c["least_peak_bytes"] is not None]
    low, high = min(least), max(least)
    budget = int(low + args.budget_fraction * (high - low))
    return {"candidates": candidates, "least_peak_low_bytes": low, "least_peak_high_bytes": high,
            "fraction": args.budget_fraction, "budget_bytes": budget}


def grid_rows(args, budget: int, result) -> list[dict]:
    from tqdm import tqdm

    built = []
    for candidate in tqdm(result.fitting, desc="compiling"):
        # The options tune evaluated this candidate with: the same plan under the same budget.
        step, report = build_step(candidate.options, args)
        built.append((candidate, step, report))
    times, cpu = time_round_robin([step for _, step, _ in built], args.rounds)
    rows = []
    for (candidate, _, report), measured, thread in zip(built, times, cpu):
        best, median = min(measured), statistics.median(measured)
        peak = report.memory.peak_bytes["device"] if report.memory is not None else None
        recompute = report.memory.recompute if report.memory is not None else None
        predicted = candidate.seconds
        rows.append({
            "k": candidate.num_subbatches, "live_blocks": candidate.live_blocks, "recompute": recompute,
            "predicted_step_seconds": predicted,
            "measured_step_seconds": best, "measured_median_seconds": median, "measured_all": measured,
            # The compute thread's CPU time: what the compute lane did, whatever the load.
            "measured_compute_thread_cpu_seconds": min(thread),
            "error": (predicted - best) / best,
            "error_vs_median": (predicted - median) / median,
            "tune_peak_device_bytes": candidate.peak_bytes,
            "compiled_peak_device_bytes": peak,
            # The compiled plan is the one tune timed when their peaks and recompute agree.
            "same_plan_as_tune": peak == candidate.peak_bytes and recompute == candidate.recompute,
        })
    return rows


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    chosen, fastest = record["chosen"]["index"], record["fastest"]["index"]
    labels = [f"K={r['k']} lb={r['live_blocks']} rc={r['recompute']}" for r in rows]
    measured = [r["measured_step_seconds"] * 1e3 for r in rows]
    median = [r["measured_median_seconds"] * 1e3 for r in rows]
    predicted = [r["predicted_step_seconds"] * 1e3 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))

    left.scatter(measured, predicted, color="tab:blue", label="plan that fits")
    left.scatter([measured[chosen]], [predicted[chosen]], marker="*", s=250, color="tab:red",
                 label="tune's choice", zorder=3)
    left.scatter([measured[fastest]], [predicted[fastest]], marker="o", s=180, facecolors="none",
                 edgecolors="tab:green", linewidths=2, label="fastest measured", zorder=4)
    top = max(measured + predicted) * 1.1
    left.plot([0, top], [0, top], color="gray", lw=1, label="prediction = measurement")
    for label, x, y in zip(labels, measured, predicted):
        left.annotate(label, (x, y), fontsize=6)
    left.set_xlabel("measured step, fastest of rounds (ms)")
    left.set_ylabel("predicted step (ms)")
    left.set_title(f"predicted vs measured (Spearman {record['spearman_rank_correlation']:.2f})"
                   if record["spearman_rank_correlation"] is not None else "predicted vs measured")
    left.legend(fontsize=7)

    x = range(len(rows))
    colors = ["tab:red" if i == chosen else "tab:green" if i == fastest else "tab:blue" for i in x]
    edges = ["tab:green" if i == fastest else color for i, color in zip(x, colors)]
    right.bar(x, measured, color=colors, alpha=0.7, edgecolor=edges, linewidth=2,
              label="measured, fastest of rounds (red: chosen, green: fastest)")
    right.scatter(x, median, marker="_", s=200, color="black", label="measured, median")
    right.scatter(x, predicted, marker="D", color="tab:orange", label="predicted", zorder=3)
    right.axhline(measured[fastest] * 1.05, color="tab:green", ls="--", lw=1, label="fastest + 5%")
    right.set_xticks(list(x))
    right.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    right.set_ylabel("step (ms)")
    budget = record["budget"]["budget_bytes"] / 2**20
    right.set_title(f"plans under {budget:.1f} MiB: chosen {record['chosen_over_fastest']:+.1%} over the fastest")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, rounds=9, batch=16)
    parser.add_argument("--weights", default="nvme", help="tier of the block weights (default nvme)")
    parser.add_argument("--activations", default="device", help="tier of the saved activations (default device)")
    parser.add_argument("--budget-fraction", type=float, default=0.6,
                        help="the budget, as a fraction of the way from the smallest candidate's least predicted "
                             "peak to the largest's (default 0.6)")
    parser.add_argument("--quick", action="store_true", help="smoke settings: 2 rounds, d_model 64")
    parser.add_argument("--out", default=None,
                        help="the JSON (the plot beside it; default bench/results/tune_bench.json, with --quick a "
                             "temp dir)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.d_model = 2, 64
    if args.out is None:
        folder = tempfile.mkdtemp(prefix="slc-tune-bench-") if args.quick else os.path.join(HERE, "results")
        args.out = os.path.join(folder, "tune_bench.json")
    import torch

    import slcompile
    from slcompile.profile import measure_profile

    torch.set_num_threads(args.threads)
    # Every plan compiles the same forward again (a new model each), and tune and the
    # profile capture it too: keep them all compiled.
    candidates = sum(args.batch % k == 0 for k in range(1, args.batch + 1)) * len(LIVE_BLOCKS)
    torch._dynamo.config.recompile_limit = 4 * (candidates + 8)
    profile = measure_profile(steps=True)
    print(f"profile: {profile.source}")

    budget = choose_budget(args, profile)
    B = budget["budget_bytes"]
    mib = 2**20
    print(f"budget: {B} bytes ({B / mib:.2f} MiB), {args.budget_fraction:.0%} of the way from the least peaks "
          f"{budget['least_peak_low_bytes'] / mib:.2f} to {budget['least_peak_high_bytes'] / mib:.2f} MiB")
    print(f"{'K':>2} {'lb':>2} {'peak none MiB':>13} {'peak blocks MiB':>15}  under the budget")
    for c in budget["candidates"]:
        none, blocks = c["peak_bytes_recompute_none"], c["peak_bytes_recompute_blocks"]
        fits = ("refused" if c["least_peak_bytes"] is None else "no" if c["least_peak_bytes"] > B
                else "yes" if none is not None and none <= B else "recomputing blocks")
        print(f"{c['k']:>2} {c['live_blocks']:>2} {none / mib if none is not None else float('nan'):>13.2f} "
              f"{blocks / mib if blocks is not None else float('nan'):>15.2f}  {fits}")

    model, idx, targets = make_model(args)
    started = time.perf_counter()
    result = slcompile.tune(model, idx, targets, memory_budget=B, live_blocks=LIVE_BLOCKS, profile=profile,
                            **fixed_options(args))
    tune_seconds = time.perf_counter() - started
    del model
    print(f"tune ({tune_seconds:.1f} s): {result.why}")

    rows = grid_rows(args, B, result)
    chosen_key = (result.options["num_subbatches"], result.options["live_blocks"])
    chosen = next(i for i, r in enumerate(rows) if (r["k"], r["live_blocks"]) == chosen_key)
    fastest = min(range(len(rows)), key=lambda i: rows[i]["measured_step_seconds"])
    fastest_by_median = min(range(len(rows)), key=lambda i: rows[i]["measured_median_seconds"])
    over = rows[chosen]["measured_step_seconds"] / rows[fastest]["measured_step_seconds"] - 1
    over_median = (rows[chosen]["measured_median_seconds"] / rows[fastest_by_median]["measured_median_seconds"]
                   - 1)
    rho = (spearman([r["measured_step_seconds"] for r in rows], [r["predicted_step_seconds"] for r in rows])
           if len(rows) > 1 else None)

    print(f"{'K':>2} {'lb':>2} {'recomp':6} {'peak MiB':>8} {'pred ms':>8} {'best ms':>8} {'median':>8} "
          f"{'err':>7} {'err/med':>7} {'cpu ms':>7}")
    for i, r in enumerate(rows):
        marks = " <- tune" if i == chosen else ""
        marks += " <- fastest" if i == fastest else ""
        marks += "" if r["same_plan_as_tune"] else " (compiled peak differs from tune's)"
        peak = r["compiled_peak_device_bytes"]
        print(f"{r['k']:>2} {r['live_blocks']:>2} {r['recompute'] or '?':6} "
              f"{peak / mib if peak is not None else float('nan'):>8.2f} "
              f"{r['predicted_step_seconds'] * 1e3:>8.1f} {r['measured_step_seconds'] * 1e3:>8.1f} "
              f"{r['measured_median_seconds'] * 1e3:>8.1f} {r['error']:>+7.1%} {r['error_vs_median']:>+7.1%} "
              f"{r['measured_compute_thread_cpu_seconds'] * 1e3:>7.1f}{marks}")
    print(f"tune chose K={rows[chosen]['k']} live_blocks={rows[chosen]['live_blocks']}; fastest measured "
          f"K={rows[fastest]['k']} live_blocks={rows[fastest]['live_blocks']}; chosen over fastest {over:+.1%} "
          f"({'within' if over <= 0.05 else 'not within'} 5%; by medians {over_median:+.1%})")
    print(f"Spearman rank correlation, predicted vs measured: "
          f"{f'{rho:.2f}' if rho is not None else 'n/a (one row)'} (load average at the end: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")

    record = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "load_average_at_end": os.getloadavg()},
        "torch": torch.__version__,
        "command": "python bench/tune_bench.py " + " ".join(sys.argv[1:]),
        "model": {"d_model": args.d_model, "seq_len": args.seq_len, "layers": args.layers, "batch": args.batch,
                  "lowering": "aot_eager", "weights": args.weights, "activations": args.activations},
        "profile": json.loads(profile.to_json()),
        "budget": budget,
        "tune": {"options": {**result.options, "machine_profile": profile.name}, "why": result.why,
                 "recompute": result.memory.recompute, "tried": [c.describe() for c in result.tried],
                 "seconds": tune_seconds},
        "rows": rows,
        "chosen": {"index": chosen, "k": rows[chosen]["k"], "live_blocks": rows[chosen]["live_blocks"],
                   "recompute": rows[chosen]["recompute"]},
        "fastest": {"index": fastest, "k": rows[fastest]["k"], "live_blocks": rows[fastest]["live_blocks"],
                    "recompute": rows[fastest]["recompute"]},
        "chosen_over_fastest": over,
        "within_5_percent": over <= 0.05,
        "chosen_over_fastest_by_median": over_median,
        "spearman_rank_correlation": rho,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    plot(record, os.path.splitext(args.out)[0] + ".png")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
