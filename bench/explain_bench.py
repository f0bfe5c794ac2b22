"""Resident memory of a sweep of `slcompile.explain` calls on one model, with the
guards of each capture released (as shipped) and kept (Dynamo's finalizers left
attached, as before `compat._detach_guard_finalizers`), each in a fresh process.

Usage:
    python bench/explain_bench.py [--calls 200] [--out bench/results/explain_bench.json]

Model: the package's GPT, 2 blocks, d_model 32, batch 8, K=2, `lowering="aot_eager"`,
no machine profile. Each arm runs 3 calls to warm the caches, then `--calls` calls,
reading VmRSS after a garbage collection every 25 calls. Per arm: the growth from
the warm-up's end, in MB and per call; the ratio of the two arms' growth. Writes the
JSON record and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def arm(calls: int, keep_guards: bool) -> dict:
    """One arm in this process: the VmRSS growth over `calls` explain calls."""
    import torch

    import slcompile
    from slcompile import compat
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.runtime import collect_garbage

    if keep_guards:
        compat._detach_guard_finalizers = lambda before: None
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=32)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 8)

    def explain():
        slcompile.explain(model, idx, targets, num_subbatches=2, lowering="aot_eager", profile=None)

    for _ in range(3):
        explain()
    collect_garbage()
    start = resident_mb()
    growth = []
    for call in range(1, calls + 1):
        explain()
        if call % 25 == 0 or call == calls:
            collect_garbage()
            growth.append((call, resident_mb() - start))
    return {"keep_guards": keep_guards, "calls": calls, "growth_mb": growth[-1][1],
            "mb_per_call": growth[-1][1] / calls, "growth_by_call": growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--arm", choices=("released", "kept"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "explain_bench.json"))
    args = parser.parse_args()
    if args.arm is not None:
        print(json.dumps(arm(args.calls, args.arm == "kept")))
        return
    rows = {}
    for name in ("released", "kept"):
        done = subprocess.run([sys.executable, __file__, "--calls", str(args.calls), "--arm", name],
                              check=True, capture_output=True, text=True)
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    import torch

    record = {
        "command": " ".join(["python", "bench/explain_bench.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "rows": rows,
        "growth_ratio_released_to_kept": rows["released"]["growth_mb"] / rows["kept"]["growth_mb"],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
