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
- ``offloaded_nvme_grad_accumulation``: the same with `schedule="grad_accumulation"`
  (the K micro-batches one after the other, each through every block): the
  gradient bytes per step show what that schedule sends against speedloader's.
- ``deepspeed_zero3``: DeepSpeed ZeRO stage 3 with `offload_optimizer` and
  `offload_param` on `cpu` (`DS_ACCELERATOR=cpu`, one process, gloo),
  `gradient_accumulation_steps=K`, `torch.optim.AdamW` (`zero_force_ds_cpu_optimizer:
  false`), no gradient clipping; eager PyTorch. Skipped when `import deepspeed`
  fails (it is in the ``bench`` extra).

The offloaded configurations compile with `memory_budget` = the model's parameter
bytes, a quarter of what weights + gradients + AdamW's two states take: the plan
must fit it (compiling raises `BudgetError` otherwise). Not with ``--quick``, whose
model is too small for that (its activations outweigh its weights).

Reported per configuration: the median over ``--repeats`` steps after two warm-up
steps of the step time (forward + backward + `step()`), of the time `step()` itself
blocks, bytes per (kind, source tier, destination tier) per step, the device peak
the compiled plan predicts (`CompileReport.memory`; on a CPU machine host memory is
the device's, so the process RSS counts both) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
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

CONFIGS = ("resident", "gathered", "offloaded_host", "offloaded_nvme", "offloaded_nvme_grad_accumulation",
           "deepspeed_zero3")


def deepspeed_step(spec: dict, model, optimizer, idx, targets):
    """One DeepSpeed ZeRO-3 training step function (K micro-batches, one optimizer step)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    k, batch = spec["k"], spec["batch"]
    config = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // k,
        "gradient_accumulation_steps": k,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise; the others do not clip
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step() -> float:
        for part_idx, part_targets in zip(idx.chunk(k), targets.chunk(k)):
            engine.backward(engine(part_idx, part_targets)[1])
            started = time.perf_counter()
            engine.step()  # the optimizer steps at the accumulation boundary only
        return time.perf_counter() - started

    return step


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
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"lowering": "aot_eager", "num_subbatches": spec["k"], "offload_dir": spec["offload_dir"],
               "weights": "device" if name == "resident" else "nvme"}
    adamw = {"lr": 1e-4, "weight_decay": 0.1}
    if name.startswith("offloaded"):
        tier = name.split("_")[1]
        opt = slcompile.offload_optimizer(model, torch.optim.AdamW, states=tier, gradients=tier, **adamw)
        if spec["budget"]:
            options["memory_budget"] = parameter_bytes
        if name.endswith("grad_accumulation"):
            options["schedule"] = "grad_accumulation"
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    compiled = torch.compile(model, backend="speedloader", options=options)
    if name == "deepspeed_zero3":
        step = deepspeed_step(spec, model, opt, idx, targets)
    else:
        step = None

    def speedloader_step() -> float:
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

    step = step or speedloader_step
    for _ in range(2):
        step()
    mark_step()
    times, waits, moved = [], [], []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        waits.append(step())
        times.append(time.perf_counter() - started)
        moved.append(mark_step().bytes_moved)
    ours = name != "deepspeed_zero3"
    report = slcompile.compile_reports()[-1] if ours else None
    last = moved[-1]
    return {
        **spec,
        "step_seconds": statistics.median(times),
        "step_seconds_all": times,
        "step_call_seconds": statistics.median(waits),
        "tokens_per_second": spec["batch"] * spec["seq_len"] / statistics.median(times),
        "bytes_per_step": {f"{k.value}:{s.value}->{d.value}": n for (k, s, d), n in sorted(last.items())},
        "streamed_bytes": report.streamed_bytes if ours else None,
        "parameter_bytes": parameter_bytes,
        "memory_budget": options.get("memory_budget") if ours else None,
        "predicted_device_peak_bytes": report.memory.peak_bytes["device"] if ours and report.memory else None,
        "recompute": report.memory.recompute if ours and report.memory else None,
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
            env = dict(os.environ)
            if config == "deepspeed_zero3":
                if importlib.util.find_spec("deepspeed") is None:
                    print(f"{config:>15}: skipped (deepspeed is not installed: pip install -e '.[bench]')")
                    continue
                from deepspeed_bench import free_port

                env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                           RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            spec = {**model, "config": config, "repeats": repeats, "offload_dir": offload_dir,
                    "budget": not args.quick}
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                  capture_output=True, text=True, check=False, env=env)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"configuration {config} failed")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.pop("offload_dir")
            results.append(result)
            print(f"{config:>33}: step {result['step_seconds'] * 1e3:8.1f} ms, step() blocks "
                  f"{result['step_call_seconds'] * 1e3:7.1f} ms, peak RSS {result['peak_rss_bytes'] / 2**20:7.1f} MiB, "
                  f"bytes {result['bytes_per_step']}")
    if args.quick and args.out == parser.get_default("out"):
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "results": results}, handle, indent=2)
    print(f"wrote {args.out}")
    plot(results, os.path.splitext(args.out)[0] + ".png")


def plot(results: list[dict], path: str) -> None:
    """Step time, peak RSS and gradient bytes per step of each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"].replace("offloaded_", "offload_").replace("_grad_accumulation", "\ngrad_accum")
             for r in results]
    gradient_bytes = [sum(n for key, n in r["bytes_per_step"].items() if key.startswith("gradient:")
                          and key.endswith("->nvme")) for r in results]
    panels = [
        ("step time (s, median)", [r["step_seconds"] for r in results]),
        ("peak RSS (MiB)", [r["peak_rss_bytes"] / 2**20 for r in results]),
        ("gradient bytes to nvme per step (MB)", [b / 1e6 for b in gradient_bytes]),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    for axis, (title, values) in zip(axes, panels):
        axis.bar(range(len(values)), values, color="tab:blue")
        axis.set_xticks(range(len(values)), names, rotation=60, ha="right", fontsize=8)
        axis.set_title(title, fontsize=10)
    figure.suptitle("AdamW training step: optimizer off the device against on it, and DeepSpeed ZeRO-3 offload")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
