"""Generation with weights on disk: `slcompile.generate` against accelerate's
`disk_offload` + `model.generate` and against resident eager `model.generate`, the
same Hugging Face Llama built from a config, in one run.

Usage:
    python bench/generate_bench.py [--quick] [--out bench/results/generate_bench.json]

- ``speedloader_kv_host`` / ``speedloader_kv_nvme``: `slcompile.generate` with
  `weights="nvme"` and K sub-batches (``--prefill-k``: another K for the prefill):
  each decoder layer's weights are read from the O_DIRECT tier once per step for all
  K; the KV cache rests on the host (the device's own memory on a CPU machine:
  nothing moves) or on the nvme tier, where a decode step stores the position it
  adds (merged with the last stored segments, as a binary counter carries) and
  loads the positions the cache holds.
- ``speedloader_resident``: the same sub-batches with every weight resident and the
  KV cache on the host (`weights="device"`): the compute of the sub-batched
  generation alone, the ceiling of the two above on this machine.
- ``accelerate``: `accelerate.disk_offload(model, dir)` (weights in files, loaded by
  per-module hooks for each forward), `model.generate` on K micro-batches one after
  another, as a user bounding memory would: every weight is read once per token per
  micro-batch. Its files are read through the page cache (RAM, once warm).
- ``accelerate_cold``: the same, with its files evicted from the page cache before
  every decode step, so it reads the disk as the nvme tier does.
- ``eager``: resident `model.generate` on the whole batch (no offload).

The target problem (effective batch 32 to 256, 128-token prompts, 64 new tokens, a
model that stresses the disk) takes hours on a 2-core CPU; the default sizes keep its
batches (32 to 256, sub-batches of 8 sequences, as many accelerate micro-batches) and
scale the rest down (32-token prompts, 16 new tokens, a 100 MiB model), recorded in
the JSON. The layer steps compile with Inductor (``--backend``), as `generate`'s
default does; compiling is not timed. Each configuration runs in its own process;
a short generation first compiles (speedloader) or warms the page cache, then the
median of ``--repeats`` timed generations (default 1) gives tokens/s (generated tokens of the whole batch per wall-clock
second), tokens per CPU second of the process (less sensitive to other processes on
a shared machine; it does not see time spent waiting for the disk) and the bytes moved
per tier per generated token. The load average is recorded with each configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.prefill_bench import evict_page_cache  # noqa: E402

SYSTEMS = ("speedloader_resident", "speedloader_kv_host", "speedloader_kv_nvme", "accelerate", "accelerate_cold",
           "eager")


def build_model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=spec["layers"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"], vocab_size=spec["vocab"],
        max_position_embeddings=spec["prompt"] + spec["new_tokens"],
    )
    return LlamaForCausalLM(config).eval()


def run_one(spec: dict) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(spec["threads"])
    model = build_model(spec)
    block_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, spec["vocab"], (spec["batch"], spec["prompt"]), generator=gen)
    k, system = spec["k"], spec["system"]
    common = dict(do_sample=False, eos_token_id=[], pad_token_id=0)
    stats = passes = None
    if system.startswith("speedloader"):
        import slcompile

        def generate(new_tokens):
            nonlocal passes
            resident = system == "speedloader_resident"
            out = slcompile.generate(model, ids, max_new_tokens=new_tokens, num_subbatches=k,
                                     weights="device" if resident else "nvme",
                                     prefill_subbatches=spec.get("prefill_k") or k,
                                     kv_cache="host" if resident else system.rsplit("_", 1)[1],
                                     offload_dir=spec["dir"],
                                     backend=spec["backend"], progress=False, return_dict_in_generate=True,
                                     **common)
            passes = out.steps
            return out.sequences
    elif system.startswith("accelerate"):
        from accelerate import disk_offload

        offload_dir = os.path.join(spec["dir"], f"accelerate-{os.getpid()}")
        disk_offload(model, offload_dir, execution_device=torch.device("cpu"))
        os.sync()

        class EvictEachStep(LogitsProcessor):
            def __call__(self, input_ids, scores):
                evict_page_cache(offload_dir)
                return scores

        processors = LogitsProcessorList([EvictEachStep()] if system == "accelerate_cold" else [])

        def generate(new_tokens):
            if system == "accelerate_cold":
                evict_page_cache(offload_dir)
            return torch.cat([model.generate(part, max_new_tokens=new_tokens, logits_processor=processors, **common)
                              for part in ids.chunk(k)])
    else:
        def generate(new_tokens):
            return model.generate(ids, max_new_tokens=new_tokens, **common)

    with torch.no_grad():
        generate(2)  # compile (speedloader), offload, warm the page cache
        timings = []
        for _ in range(spec.get("repeats", 1)):
            if system.startswith("speedloader"):
                slcompile.reset_runtime_stats()
            started, cpu_started = time.perf_counter(), time.process_time()
            out = generate(spec["new_tokens"])
            timings.append((time.perf_counter() - started, time.process_time() - cpu_started))
            if system.startswith("speedloader"):
                stats = slcompile.runtime_stats().cumulative
        seconds, cpu_seconds = sorted(timings)[len(timings) // 2]
    generated = out.shape[0] * (out.shape[1] - spec["prompt"])
    result = {"spec": spec, "seconds": seconds, "all_seconds": [t[0] for t in timings],
              "tokens_per_second": generated / seconds,
              "cpu_seconds": cpu_seconds, "tokens_per_cpu_second": generated / cpu_seconds,
              "block_weight_bytes": block_bytes, "load_average": os.getloadavg()}
    if stats is not None:
        steps = out.shape[1] - spec["prompt"]
        result["bytes_per_step"] = {f"{kind.value} {src.value}->{dst.value}": n / steps
                                    for (kind, src, dst), n in stats.bytes_moved.items() if n}
        result["stall_seconds"] = stats.stall_seconds
        # Per pass, as generate measured it: the prefill, then each decode step.
        result["bytes_per_pass"] = [{f"{kind.value} {src.value}->{dst.value}": n
                                     for (kind, src, dst), n in step.bytes_moved.items()} for step in passes]
        result["subbatch_steps"] = sum(len(step.subbatches) for step in passes)
    return result


def default_specs(quick: bool, directory: str, backend: str, repeats: int = 1,
                  prefill_k: int | None = None) -> list[dict]:
    if quick:
        model = {"layers": 2, "hidden": 128, "intermediate": 352, "heads": 4, "kv_heads": 4, "vocab": 512}
        sizes, prompt, new_tokens = ((8, 2),), 8, 4
    else:
        model = {"layers": 8, "hidden": 512, "intermediate": 1408, "heads": 8, "kv_heads": 8, "vocab": 2048}
        sizes, prompt, new_tokens = ((32, 4), (64, 8), (128, 16), (256, 32)), 32, 16
    return [dict(model, batch=batch, k=k, prefill_k=prefill_k, prompt=prompt, new_tokens=new_tokens, system=system,
                 dir=directory,
                 backend=backend, repeats=repeats, threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
            for batch, k in sizes for system in SYSTEMS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a tiny model, to check that it runs")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the layer steps")
    parser.add_argument("--repeats", type=int, default=1, help="timed generations per configuration (median)")
    parser.add_argument("--prefill-k", type=int, default=None,
                        help="sub-batches of the speedloader prefill (default: the decode steps' K)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "generate_bench.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    import accelerate  # noqa: F401  (fail early: the baseline needs it)
    import torch
    from tqdm import tqdm

    directory = tempfile.mkdtemp(prefix="slc-generate-")
    load_before = os.getloadavg()
    results = []
    specs = default_specs(args.quick, directory, args.backend, args.repeats, args.prefill_k)
    for spec in tqdm(specs, desc="generate bench", unit="config"):
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"configuration {spec} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    header = f"{'batch':>5} {'K':>2} " + " ".join(f"{s:>20}" for s in SYSTEMS) + f" {'vs accelerate':>13} {'vs cold':>8}"
    print("tokens/s")
    print(header)
    for batch, k in sorted({(r["spec"]["batch"], r["spec"]["k"]) for r in results}):
        by = {r["spec"]["system"]: r for r in results if (r["spec"]["batch"], r["spec"]["k"]) == (batch, k)}
        speed = {s: by[s]["tokens_per_second"] for s in SYSTEMS}
        ours = speed["speedloader_kv_nvme"]
        rows.append({"batch": batch, "k": k, "tokens_per_s": speed,
                     "tokens_per_cpu_s": {s: by[s]["tokens_per_cpu_second"] for s in SYSTEMS},
                     "speedloader_kv_nvme_over_accelerate": ours / speed["accelerate"],
                     "speedloader_kv_nvme_over_accelerate_cold": ours / speed["accelerate_cold"],
                     "speedloader_kv_nvme_over_eager": ours / speed["eager"],
                     "bytes_per_step": {s: by[s].get("bytes_per_step") for s in SYSTEMS if s.startswith("speed")}})
        print(f"{batch:>5} {k:>2} " + " ".join(f"{speed[s]:20.1f}" for s in SYSTEMS)
              + f" {ours / speed['accelerate']:13.2f} {ours / speed['accelerate_cold']:8.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"command": "python bench/generate_bench.py" + (" --quick" if args.quick else "")
                   + (f" --repeats {args.repeats}" if args.repeats != 1 else "")
                   + (f" --prefill-k {args.prefill_k}" if args.prefill_k else ""),
                   "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__,
                               "load_average_before": load_before, "load_average_after": os.getloadavg()},
                   "summary": rows, "runs": results}, handle, indent=2)
    print(f"wrote {args.out}")
    plot(rows, os.path.splitext(args.out)[0] + ".png")


def plot(rows: list[dict], path: str) -> None:
    """Tokens/s of every system against the batch, and weight bytes read per
    generated token of the whole batch: speedloader's pass reads the block weights
    once for all its sub-batches, accelerate's reads them once per micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        axes[0].plot(batches, [r["tokens_per_s"][system] for r in rows], marker="o", label=system)
    axes[0].set(xlabel="batch (sub-batches / micro-batches of 8 sequences)", ylabel="generated tokens/s",
                title="generation, weights on disk", yscale="log")
    weights = [r["bytes_per_step"]["speedloader_kv_nvme"]["weight nvme->device"] / 2**20 for r in rows]
    axes[1].plot(batches, [w / b for w, b in zip(weights, batches)], marker="o", label="speedloader")
    axes[1].plot(batches, [w * r["k"] / b for w, r, b in zip(weights, rows, batches)], marker="x", linestyle="--",
                 label="accelerate: once per micro-batch (K x, computed)")
    axes[1].set(xlabel="batch", ylabel="weight MiB read per generated token", title="weight traffic per token",
                yscale="log")
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
