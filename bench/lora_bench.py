"""LoRA fine-tuning with the frozen base's block weights on nvme, against the same
fine-tuning with the base resident, in one run.

Usage:
    python bench/lora_bench.py [--quick] [--rounds 7] [--threads 1] [--out bench/results/lora_bench.json]

Model: a 2-layer Hugging Face Llama built from a config (hidden 1024, MLP 2816, 16
heads, 4 key-value heads, vocabulary 4096; random weights), wrapped by `peft` with
LoRA adapters (r=16) on `q_proj` and `v_proj`, its base frozen. Batch 8 x 128
tokens, K=4, `lowering="aot_eager"`, AdamW (lr 1e-4) over the adapters. The
configurations are compiled in one process and timed round robin (each round runs
one step of each), so that load from other work falls on all of them alike:

- ``resident``: `weights="device"`: the whole base on the device.
- ``nvme``: `weights="nvme"` (`trainable="auto"`): the base's block weights rest in
  O_DIRECT files and are loaded once per forward and once by the backward; the
  adapters stay on the device and `torch.optim.AdamW` steps them.
- ``nvme_adapters_streamed``: `weights="nvme", trainable="stream"` with
  `slcompile.offload_optimizer(model, torch.optim.AdamW)`: the adapters stream with
  their blocks and their gradients go to the optimizer's host thread.

Reported per configuration: step seconds (median and all rounds; forward, backward
and `step()`), tokens/s, its ratio to ``resident``, bytes per (kind, source tier,
destination tier) of a steady step (a second step after its own, closed by
`slcompile.mark_step()`), the bytes `CompileReport.weights` says stream and stay,
and the predicted device peak (`CompileReport.memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CONFIGS = ("resident", "nvme", "nvme_adapters_streamed")
FULL = {"hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 4096, "layers": 2,
        "batch": 8, "seq_len": 128, "k": 4, "rank": 16}
QUICK = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 256, "layers": 2,
         "batch": 8, "seq_len": 32, "k": 4, "rank": 4}


def _lora_llama(shape: dict):
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=shape["layers"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq_len"]))
    config = peft.LoraConfig(r=shape["rank"], target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, config)


def _configuration(name: str, shape: dict, offload_dir: str):
    """(the step of `name`, its model): the model compiled with its options, and an
    optimizer over its adapters."""
    import torch

    import slcompile

    model = _lora_llama(shape)
    adapters = [p for p in model.parameters() if p.requires_grad]
    options = {"lowering": "aot_eager", "num_subbatches": shape["k"], "offload_dir": offload_dir,
               "weights": "device" if name == "resident" else "nvme"}
    if name == "nvme_adapters_streamed":
        options["trainable"] = "stream"
        opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(adapters, lr=1e-4)
    compiled = torch.compile(model, backend="speedloader", options=slcompile.options(**options))
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq_len"]),
                        generator=torch.Generator().manual_seed(1))

    def step() -> None:
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()

    return step, model


def measure(shape: dict, rounds: int) -> list[dict]:
    """Every configuration's figures, timed round robin over `rounds` rounds."""
    import slcompile
    from timing import time_round_robin

    results = []
    steps = []
    with tempfile.TemporaryDirectory(prefix="slc-lora-bench-") as offload_dir:
        for name in CONFIGS:
            step, model = _configuration(name, shape, offload_dir)
            step()  # compiles; the weights leave the device
            report = slcompile.compile_reports()[-1]
            assert report.fallback_reason is None, report.fallback_reason
            step()
            slcompile.mark_step()
            step()
            moved = slcompile.mark_step().bytes_moved
            placement = report.weights
            parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            results.append({
                "config": name,
                "parameter_bytes": parameter_bytes,
                "adapter_bytes": adapter_bytes,
                "streamed_bytes": placement.streamed_bytes if placement is not None else 0,
                "streamed_frozen_bytes": placement.frozen_bytes if placement is not None else 0,
                "resident_reasons": sorted({why for _, why in placement.resident}) if placement is not None else [],
                "bytes_per_step": {f"{k.value}:{s.value}->{d.value}": n for (k, s, d), n in sorted(moved.items())},
                "predicted_device_peak_bytes": report.memory.peak_bytes["device"] if report.memory else None,
            })
            steps.append(step)
        times, _ = time_round_robin(steps, rounds)
    tokens = shape["batch"] * shape["seq_len"]
    resident = statistics.median(times[0])
    for result, measured in zip(results, times):
        median = statistics.median(measured)
        result.update(step_seconds=median, step_seconds_all=measured, tokens_per_second=tokens / median,
                      time_over_resident=median / resident)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads (default 1: leaves a core to the I/O threads on 2 cores)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "lora_bench.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else FULL
    results = measure(shape, 2 if args.quick else args.rounds)
    for result in results:
        print(f"{result['config']:>23}: step {result['step_seconds'] * 1e3:8.1f} ms "
              f"({result['time_over_resident']:.2f}x resident), bytes {result['bytes_per_step']}")
    if args.quick and args.out == parser.get_default("out"):
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                   "load_average_1min": os.getloadavg()[0], "shape": shape, "rounds": args.rounds,
                   "results": results}, handle, indent=2)
    print(f"wrote {args.out}")
    plot(results, os.path.splitext(args.out)[0] + ".png")


def plot(results: list[dict], path: str) -> None:
    """Step time against resident, and the bytes a step moves per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"].replace("_adapters_streamed", "\nadapters streamed") for r in results]
    kinds = sorted({key for r in results for key in r["bytes_per_step"]})
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.bar(range(len(results)), [r["step_seconds"] for r in results], color="tab:blue")
    for x, r in enumerate(results):
        left.annotate(f"{r['time_over_resident']:.2f}x", (x, r["step_seconds"]), ha="center", va="bottom")
    left.set_xticks(range(len(results)), names)
    left.set_title("step time (s, median): forward, backward, AdamW over the adapters", fontsize=10)
    bottom = [0.0] * len(results)
    for kind in kinds:
        values = [r["bytes_per_step"].get(kind, 0) / 2**20 for r in results]
        right.bar(range(len(results)), values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(results)), names)
    right.set_title("bytes moved per step (MiB)", fontsize=10)
    if kinds:
        right.legend(fontsize=8)
    figure.suptitle("LoRA on a 2-layer Llama: the frozen base on nvme against resident")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
