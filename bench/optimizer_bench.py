"""A training step with the optimizer off the device, against the optimizer on it.

Usage:
    python bench/optimizer_bench.py [--quick] [--repeats 3] [--out bench/results/optimizer_bench.json]

Configurations (AdamW, the same model, batch and K; each in its own process, so peak
RSS is its own):
- ``resident``: every weight on the device (`weights="device"`), `torch.optim.AdamW`
  over the parameters: weights, gradients and optimizer state all on the device.
- ``gathered``: block weights on nvme, `torch.optim.AdamW` stepped inside
  `slcompile.gathered_weights(model)`: every weight comes back to the device for the
  step (P loaded, P stored), with gradients and state on the device.
- ``offloaded_host``: block weights on nvme, `slcompile.offload_optimizer(...,
  states="host", gradients="host")`: gradients leave once per block, blocks step
  on a host thread during the backward.
- ``offloaded_nvme``: the same with gradients and optimizer state in nvme files.

Reported per configuration: the median over ``--repeats`` steps after two warm-up
steps of the step time (forward + backward + `step()`), of the time `step()` itself
blocks, bytes per (kind, source tier, destination tier) per step, the device peak
the compiled plan predicts (`CompileReport.memory`; on a CPU machine host memory is
the device's, so the process RSS counts both) and the process's peak RSS.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CONFIGS = ("resident", "gathered", "offloaded_host", "offloaded_nvme")


def run_one(spec: dict) -> dict:
    """Runs one configuration in this process and returns its figures."""
    import torch

    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.runtime import mark_step

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=spec["vocab"], seq_len=spec["seq_len"], d_model=spec["d_model"],
                    n_heads=spec["n_heads"], n_layers=spec["n_layers"])
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, spec["batch"])
    name = spec["config"]
    options = {"lowering": "aot_eager", "num_subbatches": spec["k"], "offload_dir": spec["offload_dir"],
               "weights": "device" if name == "resident" else "nvme"}
    adamw = {"lr": 1e-4, "weight_decay": 0.1}
    if name.startswith("offloaded"):
        tier = name.split("_")[1]
        opt = slcompile.offload_optimizer(model, torch.optim.AdamW, states=tier, gradients=tier, **adamw)
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step() -> float:
        compiled(idx, targets)[1].backward()
        started = time.perf_counter()
        if name == "gathered":
            with slcompile.gathered_weights(model):
                opt.step()
        else:
            opt.step()
        waited = time.perf_counter() - started
        opt.zero_grad()
        return waited

    for _ in range(2):
        step()
    mark_step()
    times, waits, moved = [], [], []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        waits.append(step())
        times.append(time.perf_counter() - started)
        moved.append(mark_step().bytes_moved)
    report = slcompile.compile_reports()[-1]
    last = moved[-1]
    return {
        **spec,
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
        "step_call_seconds": statistics.median(waits),
        "tokens_per_second": spec["batch"] * spec["seq_len"] / statistics.median(times),
        "bytes_per_step": {f"{k.value}:{s.value}->{d.value}": n for (k, s, d), n in sorted(last.items())},
        "streamed_bytes": report.streamed_bytes,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "predicted_device_peak_bytes": report.memory.peak_bytes["device"] if report.memory else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        # Other work on the machine slows every configuration; this says how much there was.
        "load_average_1min": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "optimizer_bench.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a JSON spec: run it here, print the result
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    model = ({"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab": 64, "seq_len": 16, "batch": 4, "k": 2}
             if args.quick else
             {"d_model": 256, "n_heads": 8, "n_layers": 8, "vocab": 512, "seq_len": 64, "batch": 8, "k": 4})
    repeats = 3 if args.quick else args.repeats
    results = []
    with tempfile.TemporaryDirectory(prefix="slc-optimizer-bench-") as offload_dir:
        for config in CONFIGS:
            spec = {**model, "config": config, "repeats": repeats, "offload_dir": offload_dir}
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"configuration {config} failed")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.pop("offload_dir")
            results.append(result)
            print(f"{config:>15}: step {result['step_seconds'] * 1e3:8.1f} ms, step() blocks "
                  f"{result['step_call_seconds'] * 1e3:7.1f} ms, peak RSS {result['peak_rss_bytes'] / 2**20:7.1f} MiB, "
                  f"bytes {result['bytes_per_step']}")
    if args.quick and args.out == parser.get_default("out"):
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "results": results}, handle, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
