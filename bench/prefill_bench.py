"""Forward-only prefill with weights on disk: speedloader against accelerate's
`disk_offload`, the same Hugging Face Llama built from a config, in one run.

Usage:
    python bench/prefill_bench.py [--repeats 3] [--out bench/results/prefill_bench.json]

- ``speedloader``: `torch.compile(model, backend="speedloader")` with
  `weights="nvme"`, K sub-batches, under `torch.no_grad()`: each block's weights are
  read from the O_DIRECT tier once per forward, shared by the K sub-batches.
- ``accelerate``: `accelerate.disk_offload(model, dir)`: weights in files on disk,
  loaded by per-module hooks for each forward; the batch fed as K micro-batches (one
  forward each), as a user of it would to bound activation memory.
- ``accelerate_cold``: the same, with its files evicted from the page cache
  (`posix_fadvise(DONTNEED)`) before each timed forward, so it reads the disk as the
  nvme tier does.

accelerate reads its offload files through the page cache: while the model fits in
RAM, after the first pass it reads from RAM. The nvme tier bypasses the page cache, so
every pass reads the disk. Each configuration runs in its own process; figures are the
median of ``--repeats`` forwards after a warm-up forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def build_model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=spec["layers"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"], vocab_size=spec["vocab"],
        max_position_embeddings=spec["seq_len"],
    )
    return LlamaForCausalLM(config).eval()


def evict_page_cache(directory: str) -> None:
    """Drops the cached pages of every file under `directory`."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_one(spec: dict) -> dict:
    import torch

    model = build_model(spec)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=gen)
    k = spec["k"]
    if spec["system"] == "speedloader":
        import slcompile
        from slcompile.runtime import mark_step

        runner = torch.compile(
            model, backend="speedloader",
            options={"num_subbatches": k, "weights": "nvme", "lowering": "aot_eager", "offload_dir": spec["dir"]},
        )

        def forward():
            return runner(ids).logits
    else:
        from accelerate import disk_offload

        disk_offload(model, os.path.join(spec["dir"], "accelerate"), execution_device=torch.device("cpu"))
        os.sync()

        offload_dir = os.path.join(spec["dir"], "accelerate")

        def forward():
            if spec["system"] == "accelerate_cold":
                evict_page_cache(offload_dir)
            return torch.cat([model(part).logits for part in ids.chunk(k)])

    with torch.no_grad():
        forward()  # compile / first read
        times = []
        for _ in range(spec["repeats"]):
            started = time.perf_counter()
            forward()
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    result = {"spec": spec, "seconds": seconds, "all_seconds": times,
              "tokens_per_second": spec["batch"] * spec["seq_len"] / seconds}
    if spec["system"] == "speedloader":
        report = slcompile.compile_reports()[-1]
        result["fallback_reason"] = report.fallback_reason
        result["streamed_bytes"] = report.streamed_bytes
        step = mark_step()
        result["weight_bytes_loaded_total"] = sum(
            n for (kind, _, dst), n in step.bytes_moved.items() if kind.value == "weight" and dst.value == "device"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "prefill_bench.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    from tqdm import tqdm

    directory = tempfile.mkdtemp(prefix="slc-prefill-")
    model = {"layers": 8, "hidden": 1024, "intermediate": 2816, "heads": 16, "vocab": 1024}
    specs = []
    for batch, seq_len in ((8, 16), (8, 128)):
        for k in (1, 8):
            for system in ("speedloader", "accelerate", "accelerate_cold"):
                specs.append(dict(model, batch=batch, seq_len=seq_len, k=k, system=system,
                                  repeats=args.repeats, dir=directory))
    results = []
    for spec in tqdm(specs, desc="prefill bench", unit="config"):
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"configuration {spec} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    print(f"{'tokens':>7} {'K':>2} {'speedloader tok/s':>18} {'accelerate tok/s':>17} {'ratio':>6} {'cold tok/s':>11} {'ratio':>6}")
    for batch, seq_len in ((8, 16), (8, 128)):
        for k in (1, 8):
            pair = {r["spec"]["system"]: r for r in results
                    if r["spec"]["seq_len"] == seq_len and r["spec"]["k"] == k}
            ours = pair["speedloader"]["tokens_per_second"]
            warm = pair["accelerate"]["tokens_per_second"]
            cold = pair["accelerate_cold"]["tokens_per_second"]
            rows.append({"tokens": batch * seq_len, "k": k, "speedloader_tokens_per_s": ours,
                         "accelerate_page_cache_tokens_per_s": warm, "ratio_page_cache": ours / warm,
                         "accelerate_cold_tokens_per_s": cold, "ratio_cold": ours / cold})
            print(f"{batch * seq_len:>7} {k:>2} {ours:18.1f} {warm:17.1f} {ours / warm:6.2f} {cold:11.1f} {ours / cold:6.2f}")
    import torch

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"command": f"python bench/prefill_bench.py --repeats {args.repeats}",
                   "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch": torch.__version__},
                   "summary": rows, "runs": results}, handle, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
