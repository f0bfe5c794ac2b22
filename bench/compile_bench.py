"""Compile time of a training step: speedloader with Inductor against plain Inductor.

Usage:
    python bench/compile_bench.py [--quick] [--model gpt|llama] [--depths 2,4,8] [--ks 1,2,4] [--whole] [--dynamic]
                                  [--nested] [--out FILE]

Each configuration compiles the package's GPT (d_model 128; `--model llama`: a Hugging
Face Llama of hidden 64, batch 8 x 32 tokens, random weights) in its own process with an
empty Inductor cache (a fresh `TORCHINDUCTOR_CACHE_DIR`, FX graph cache off), and
reports the seconds of its first forward + backward, which compile both graphs, and
of a second step, which does not. Configurations:
- ``inductor``: `torch.compile(model)` (Inductor, everything resident).
- ``speedloader``: `backend="speedloader"`, `lowering="inductor"`, K sub-batches,
  everything resident (the compile cost of the layer-major rewrite alone), each
  distinct (block, sub-batch) unit traced by AOTAutograd once (`trace_units_once=True`,
  what the default "auto" does from 8 blocks) and each distinct region compiled once
  (`compile_regions=True`, the default).
- ``speedloader_whole``: the same with `compile_regions=False`: the whole step, which
  holds K copies of every block, handed to Inductor (``--whole`` adds these rows).
- ``speedloader_flat`` (``--flat`` adds these rows): the same with every op of every
  unit traced (`trace_units_once=False`).
- ``inductor_nested`` (``--nested``, HF Llama only): plain Inductor with each decoder
  layer's forward a `torch.compiler.nested_compile_region`, torch's own way to trace
  and lower a repeated block once: what compiling each distinct block once can give.
  ``--ks ""`` leaves the speedloader rows out.

With ``--lowering aot_eager`` every row compiles with AOTAutograd alone (plain rows:
`backend="aot_eager"`): the tracing and partitioning part of the compile, without
Inductor's code generation.

With ``--dynamic`` the batch dimension is marked dynamic
(`torch._dynamo.mark_dynamic`) in every configuration: the compile a batch that changed
size costs (its graphs have symbolic sizes). The results go to
`results/compile_bench.json`, `compile_bench_dynamic.json`, and with `--model llama`
`compile_bench_llama.json`, `compile_bench_llama_dynamic.json` by default.

Compile seconds = first step - second step. The ratio speedloader / inductor at the
same depth is the figure the goal (at most 1.5x at any K and depth) is about.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run_one(spec: dict) -> dict:
    """Compiles and runs one configuration in this process; returns its seconds."""
    import torch
    import torch._inductor.config as inductor_config

    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    inductor_config.fx_graph_cache = False
    torch.manual_seed(0)
    if spec.get("model", "gpt") == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=spec["d_model"], intermediate_size=2 * spec["d_model"], num_hidden_layers=spec["depth"],
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=spec["seq_len"]))
        ids = torch.randint(0, 256, (spec["batch"], spec["seq_len"]), generator=torch.Generator().manual_seed(0))
        inputs = (ids,)

        def loss(module):
            return module(ids, labels=ids).loss
    else:
        cfg = GPTConfig(d_model=spec["d_model"], seq_len=spec["seq_len"], n_layers=spec["depth"], vocab_size=256)
        model = TinyGPT(cfg)
        inputs = make_gpt_batch(cfg, spec["batch"])

        def loss(module):
            return module(*inputs)[1]
    if spec.get("dynamic"):
        for tensor in inputs:
            torch._dynamo.mark_dynamic(tensor, 0)
    if spec["config"] == "inductor_nested":
        # torch's own way to compile a repeated block once: every decoder layer's
        # forward a nested compile region (invoke_subgraph before AOTAutograd).
        layer_class = type(model.model.layers[0])
        layer_class.forward = torch.compiler.nested_compile_region(layer_class.forward)
    lowering = spec.get("lowering", "inductor")
    if spec["config"] in ("inductor", "inductor_nested"):
        compiled = torch.compile(model, backend="inductor" if lowering == "inductor" else "aot_eager")
    else:
        compiled = torch.compile(model, backend="speedloader", options=slcompile.options(
            num_subbatches=spec["k"], lowering=lowering, compile_regions=spec["config"] != "speedloader_whole",
            trace_units_once=spec["config"] != "speedloader_flat"))

    def step() -> float:
        started = time.perf_counter()
        loss(compiled).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    first, second = step(), step()
    reports = slcompile.compile_reports()
    return {
        **spec,
        "first_step_seconds": first,
        "second_step_seconds": second,
        "compile_seconds": first - second,
        "fallback": reports[-1].fallback_reason if spec["config"].startswith("speedloader") and reports else None,
        "regions": {kind: dataclasses.asdict(done) for kind, done in reports[-1].regions.items()}
        if spec["config"].startswith("speedloader") and reports else {},
    }


def _in_subprocess(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)],
            env=env, capture_output=True, text=True, check=False,
        )
    if done.returncode != 0:
        return {**spec, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="compile time: speedloader + Inductor vs plain Inductor")
    parser.add_argument("--quick", action="store_true", help="depth 2, K 2: checks that it runs")
    parser.add_argument("--depths", default="2,4,8")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--out", help="default: results/compile_bench.json (--dynamic: compile_bench_dynamic.json)")
    parser.add_argument("--whole", action="store_true", help="also speedloader with compile_regions=False")
    parser.add_argument("--flat", action="store_true",
                        help="rows speedloader_flat (trace_units_once=False) beside the speedloader rows")
    parser.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor",
                        help="aot_eager: AOTAutograd alone in every row (plain rows: backend='aot_eager')")
    parser.add_argument("--dynamic", action="store_true", help="a dynamic batch dimension (symbolic sizes)")
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="the package's GPT (d_model 128, 64 tokens) or a Hugging Face Llama "
                             "(hidden 64, 32 tokens, random weights)")
    parser.add_argument("--nested", action="store_true",
                        help="with --model llama, also plain Inductor with each decoder layer a "
                             "torch.compiler.nested_compile_region (a row 'inductor_nested')")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    depths = [2] if args.quick else [int(d) for d in args.depths.split(",")]
    ks = [2] if args.quick else [int(k) for k in args.ks.split(",") if k]
    base = {"model": args.model, "d_model": 128, "seq_len": 64, "batch": 8, "dynamic": args.dynamic,
            "lowering": args.lowering}
    if args.model == "llama":
        base.update(d_model=64, seq_len=32)
    name = "compile_bench" + ("_llama" if args.model == "llama" else "") + ("_dynamic" if args.dynamic else "")
    out = args.out or os.path.join(HERE, "results", f"{name}.json")
    from tqdm import tqdm

    specs = []
    for depth in depths:
        specs.append({**base, "depth": depth, "config": "inductor", "k": 1})
        if args.nested and args.model == "llama":
            specs.append({**base, "depth": depth, "config": "inductor_nested", "k": 1})
        specs += [{**base, "depth": depth, "config": "speedloader", "k": k} for k in ks]
        if args.whole:
            specs += [{**base, "depth": depth, "config": "speedloader_whole", "k": k} for k in ks]
        if args.flat:
            specs += [{**base, "depth": depth, "config": "speedloader_flat", "k": k} for k in ks]
    runs = [_in_subprocess(spec) for spec in tqdm(specs, desc="compile bench", unit="config")]
    plain = {r["depth"]: r.get("compile_seconds") for r in runs if r["config"] == "inductor"}
    for r in runs:
        if r["config"] != "inductor" and r.get("compile_seconds") and plain.get(r["depth"]):
            r["over_inductor"] = r["compile_seconds"] / plain[r["depth"]]
    result = {
        "command": " ".join(["python bench/compile_bench.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                    "load_average_before": os.getloadavg()},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'depth':>5} {'config':>17} {'K':>2} {'compile s':>10} {'step s':>8} {'x inductor':>10}")
    for r in runs:
        if "error" in r:
            print(f"{r['depth']:>5} {r['config']:>17} {r['k']:>2} failed: {r['error'].splitlines()[-1]}")
            continue
        ratio = f"{r['over_inductor']:.2f}" if "over_inductor" in r else ""
        print(f"{r['depth']:>5} {r['config']:>17} {r['k']:>2} {r['compile_seconds']:>10.1f} "
              f"{r['second_step_seconds']:>8.3f} {ratio:>10}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
