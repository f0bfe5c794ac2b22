"""Predicted against measured step time: the time model on this machine, and on paper
against the H100 measurements.

Usage:
    python bench/time_bench.py [--rounds 7] [--threads 1] [--no-h100] [--out bench/results/time_model.json]
    python bench/time_bench.py --paper-only

Part 1 (this machine): the machine's profile is measured first
(`slcompile.profile.measure_profile`, not the cache: the same conditions as the
steps). Then, for each configuration (K, where the block weights and the saved
activations rest, recomputation) of the package's GPT (`lowering="aot_eager"`), the
step is compiled and warmed up (2 steps); the configurations' steps are then timed
round-robin, `--rounds` rounds, so that a burst of load from another process on a
shared machine falls on all of them alike. Each row keeps the fastest step (the
profile keeps best-of rates too) and the median, and the prediction of
`slcompile.analysis.time.predict_time` from the compiled step's partitioned graphs.
The training rows' ranking (Spearman's rho, predictions against medians) is
reported, and the configuration the model predicts fastest (what `tune` would choose
among them) with its measured median against the fastest measured one.

Generation passes (this machine): a 4-layer Llama (hidden 256, random weights)
generates 8 tokens for a batch of 16 prompts of 64 tokens, 4 sub-batches, with its
weights and KV cache on the device and on nvme (`slcompile.generate`, layer steps
compiled by Inductor). Each pass's wall time is measured (`GenerationStep.seconds`);
the prefill and the middle decode pass are compared with `explain_generation(...,
profile=...)`'s timelines of the same passes. The fastest of `--rounds` calls counts.

Part 2 (on paper): the rows of ../shared/measurements/h100-2026-11-23.md (one H100,
PCIe, Llama 738M bf16, batch 16 x 512) predicted with the named profile
"h100-pcie5-nvme" through `slcompile.explain(..., profile=...)`, the model built on
the meta device (no weights; nothing runs). Compared: the step time of each row,
the rows' ranking (Spearman's rho) and the resource the model says bounds each row.

Part 3 (on paper): the rows of the last `python -m bench gpu --check`
(results/gpu_check/gpu_check.json: measured steps read from it) predicted the same
way, with the named profile "h100-pcie5-nvme", each row's model shape on the meta
device; the rows with CUDA graphs are left out (the model has none). `--paper-only`
runs parts 2 and 3 alone (a few minutes, nothing timed) into
results/time_model_paper.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.timing import add_model_arguments, prediction_fields, spearman, time_round_robin  # noqa: E402

CPU_CONFIGS = (  # (K, weights, activations, recompute)
    (1, "device", "device", "none"),
    (4, "device", "device", "none"),
    (8, "device", "device", "none"),
    (4, "device", "device", "blocks"),
    (1, "nvme", "device", "none"),
    (4, "nvme", "device", "none"),
    (8, "nvme", "device", "none"),
    (1, "nvme", "nvme", "none"),
    (4, "nvme", "nvme", "none"),
    (4, "nvme", "nvme", "blocks"),
    (8, "nvme", "nvme", "none"),
)

# ../shared/measurements/h100-2026-11-23.md: (lowering, label, options, measured step s).
H100_ROWS = (
    ("inductor", "plain torch.compile, all resident", {"num_subbatches": 1}, 0.0663),
    ("inductor", "speedloader, weights host, K=4", {"num_subbatches": 4, "weights": "host"}, 0.0853),
    ("inductor", "weights + activations host, recompute blocks, K=4",
     {"num_subbatches": 4, "weights": "host", "activations": "host", "recompute": "blocks"}, 0.1971),
    ("inductor", "weights + activations host, every saved tensor moved, K=4",
     {"num_subbatches": 4, "weights": "host", "activations": "host", "recompute": "none"}, 0.6497),
    ("aot_eager", "eager schedule, resident, K=1", {"num_subbatches": 1}, 0.1018),
    ("aot_eager", "speedloader, resident, K=4", {"num_subbatches": 4}, 0.2130),
    ("aot_eager", "speedloader, weights host, K=4", {"num_subbatches": 4, "weights": "host"}, 0.1908),
    ("aot_eager", "grad_accumulation, weights host, K=4",
     {"num_subbatches": 4, "weights": "host", "schedule": "grad_accumulation"}, 0.3564),
    ("aot_eager", "speedloader, weights host, K=8", {"num_subbatches": 8, "weights": "host"}, 0.2837),
    ("aot_eager", "grad_accumulation, weights host, K=8",
     {"num_subbatches": 8, "weights": "host", "schedule": "grad_accumulation"}, 0.7986),
    ("aot_eager", "speedloader, weights + activations host, K=4",
     {"num_subbatches": 4, "weights": "host", "activations": "host", "recompute": "none"}, 0.8834),
)


def build_step(k, weights, activations, recompute, args):
    import torch

    import slcompile
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

    torch.manual_seed(0)
    cfg = GPTConfig(d_model=args.d_model, seq_len=args.seq_len, n_layers=args.layers, n_heads=4)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, args.batch)
    options = {"lowering": "aot_eager", "num_subbatches": k, "weights": weights, "activations": activations,
               "recompute": recompute, "live_blocks": 2}
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        _, loss = compiled(idx, targets)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(2):
        step()
    return step, slcompile.compile_reports()[-1]


def cpu_rows(args, profile) -> list[dict]:
    from tqdm import tqdm

    from slcompile.analysis.time import predict_time

    built = []
    for k, weights, activations, recompute in tqdm(CPU_CONFIGS, desc="compiling"):
        step, report = build_step(k, weights, activations, recompute, args)
        tiers = {"fetch": weights, "stash": activations, "unstash": activations, "store_grad": "device"}
        graphs = report.partitioned
        prediction = predict_time(graphs["forward"], graphs["backward"], profile=profile, tiers=tiers,
                                  tokens=args.batch * args.seq_len)
        built.append(((k, weights, activations, recompute), step, prediction))
    # Each timed step follows one of its own, as in a training loop (`time_round_robin`).
    times, cpu = time_round_robin([step for _, step, _ in built], args.rounds, warm=1)
    rows = []
    for ((k, weights, activations, recompute), _, prediction), measured, thread in zip(built, times, cpu):
        best, median = min(measured), statistics.median(measured)
        rows.append({
            "k": k, "weights": weights, "activations": activations, "recompute": recompute,
            "measured_step_seconds": best, "measured_median_seconds": median, "measured_all": measured,
            # The compute thread's CPU time: what the compute lane did, whatever the load.
            "measured_compute_thread_cpu_seconds": min(thread),
            **prediction_fields(prediction, best, median),
        })
    return rows


GENERATION_CONFIGS = (("device", "device"), ("nvme", "nvme"))  # (weights, kv cache)


def generation_rows(args, profile) -> list[dict]:
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    from slcompile.generate import explain_generation, generate

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1024, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (16, 64))
    new_tokens, middle = 8, 8 // 2
    rows = []
    for weights, kv in tqdm(GENERATION_CONFIGS, desc="generation"):
        options = {"num_subbatches": 4, "prefill_subbatches": 4, "weights": weights, "kv_cache": kv}
        explained = explain_generation(model, ids.shape, new_tokens, profile=profile, **options)
        measured: dict[str, list[float]] = {"prefill": [], "decode": []}
        for _ in range(args.rounds + 1):  # the first call compiles
            steps = generate(model, ids, max_new_tokens=new_tokens, return_dict_in_generate=True, progress=False,
                             **options).steps
            measured["prefill"].append(steps[0].seconds)
            measured["decode"].append(steps[middle].seconds)
        for phase, timeline in (("prefill", explained.prefill_time), ("decode", explained.decode_time)):
            times = measured[phase][1:]
            best, median = min(times), statistics.median(times)
            rows.append({
                "pass": phase, "k": 4, "weights": weights, "activations": kv, "recompute": "-",
                "measured_step_seconds": best, "measured_median_seconds": median, "measured_all": times,
                **prediction_fields(timeline, best, median),
            })
    return rows


def h100_rows(args) -> list[dict]:
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    import slcompile

    config = LlamaConfig(num_hidden_layers=12, hidden_size=2048, intermediate_size=5504, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=512, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(16, 512, dtype=torch.long, device="meta")
    rows = []
    for lowering, label, options, measured in tqdm(H100_ROWS, desc="H100 rows on paper"):
        explanation = slcompile.explain(model, ids, kwargs={"labels": ids}, lowering=lowering,
                                        profile="h100-pcie5-nvme", **options)
        predicted = explanation.time
        rows.append({
            "lowering": lowering, "row": label, "options": options, "measured_step_seconds": measured,
            "predicted_step_seconds": predicted.step_seconds,
            "error": (predicted.step_seconds - measured) / measured,
            "predicted_bound": predicted.bound,
            "predicted_compute_seconds": predicted.compute_seconds,
            "predicted_lane_seconds": predicted.lane_seconds(),
            "predicted_lane_bytes": predicted.lane_bytes(),
            "predicted_tokens_per_second": predicted.tokens_per_second,
            "predicted_peak_device_bytes": (explanation.predicted_peak_bytes or {}).get("device"),
        })
    return rows


GPU_CHECK = os.path.join(HERE, "results", "gpu_check", "gpu_check.json")


def gpu_check_rows(path: str = GPU_CHECK) -> dict:
    """Part 3: the measured rows of a gpu_check run against their prediction."""
    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    import slcompile
    from bench.gpu_bench import speedloader_options

    with open(path) as f:
        record = json.load(f)
    models = {}
    rows = []
    measured = [r for r in record["rows"] if "step_seconds" in r and "cudagraphs" not in r["spec"]["row"]]
    for row in tqdm(measured, desc="gpu_check rows on paper"):
        spec, shape = row["spec"], row["spec"]["shape"]
        key = json.dumps(shape, sort_keys=True)
        if key not in models:
            config = LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                                 intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
                                 num_key_value_heads=shape["heads"], vocab_size=shape["vocab"],
                                 max_position_embeddings=shape["seq"], use_cache=False)
            with torch.device("meta"):
                models[key] = LlamaForCausalLM(config).to(getattr(torch, spec["dtype"]))
        options = speedloader_options(spec["row"], spec["k"], "inductor") or {"num_subbatches": 1}
        ids = torch.zeros(shape["batch"], shape["seq"], dtype=torch.long, device="meta")
        predicted = slcompile.explain(models[key], ids, kwargs={"labels": ids}, profile="h100-pcie5-nvme",
                                      **{"lowering": "inductor", **options}).time
        rows.append({
            "row": f"{spec['row']} K={spec['k']}" + (f" ({spec['regime']})" if spec.get("regime") else ""),
            "options": options, "measured_step_seconds": row["step_seconds"],
            "predicted_step_seconds": predicted.step_seconds,
            "error": (predicted.step_seconds - row["step_seconds"]) / row["step_seconds"],
            "predicted_bound": predicted.bound, "predicted_compute_seconds": predicted.compute_seconds,
        })
    return {"source": os.path.relpath(path, os.path.dirname(HERE)), "device_name": record.get("device_name"),
            "torch": record.get("torch"), "profile": "h100-pcie5-nvme", "rows": rows}


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("this machine (CPU, nvme tier)", record["cpu"]["rows"])] if record.get("cpu") else []
    if record.get("h100"):
        panels.append(("H100 rows on paper (profile h100-pcie5-nvme)", record["h100"]["rows"]))
    if record.get("gpu_check"):
        panels.append((f"{record['gpu_check']['device_name']} rows of gpu_check on paper", record["gpu_check"]["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 6))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (title, rows) in zip(axes, panels):
        measured = [r["measured_step_seconds"] * 1e3 for r in rows]
        predicted = [r["predicted_step_seconds"] * 1e3 for r in rows]
        ax.scatter(measured, predicted)
        top = max(measured + predicted) * 1.1
        ax.plot([0, top], [0, top], color="gray", lw=1, label="prediction = measurement")
        ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="gray", alpha=0.15, label="within 15%")
        for r, x, y in zip(rows, measured, predicted):
            label = r.get("row") or (f"{r['pass']} K={r['k']} w={r['weights']} kv={r['activations']}" if "pass" in r
                                     else f"K={r['k']} w={r['weights']} a={r['activations']} rc={r['recompute']}")
            ax.annotate(label, (x, y), fontsize=6)
        ax.set_xlabel("measured step (ms)")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, rounds=7, batch=8)
    parser.add_argument("--no-h100", action="store_true", help="skip the H100 rows on paper")
    parser.add_argument("--no-generation", action="store_true", help="skip the generation passes")
    parser.add_argument("--quick", action="store_true", help="smoke settings: 2 rounds, d_model 64, no H100 rows")
    parser.add_argument("--paper-only", action="store_true", help="parts 2 and 3 alone (nothing timed)")
    parser.add_argument("--out", default=None, help="default results/time_model.json "
                                                    "(results/time_model_paper.json with --paper-only)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.d_model, args.no_h100 = 2, 64, True
    args.out = args.out or os.path.join(HERE, "results",
                                        "time_model_paper.json" if args.paper_only else "time_model.json")
    if args.paper_only:
        write_paper(args)
        return
    import torch

    from slcompile.profile import measure_profile

    torch.set_num_threads(args.threads)
    # Every configuration compiles the same forward again (a new model each): keep them all compiled.
    torch._dynamo.config.recompile_limit = 4 * len(CPU_CONFIGS)
    profile = measure_profile(steps=True)
    rows = cpu_rows(args, profile)
    if not args.no_generation:
        rows += generation_rows(args, profile)
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    training = [r for r in rows if "pass" not in r]
    ranking = spearman([r["predicted_step_seconds"] for r in training], [r["measured_median_seconds"] for r in training])
    print(f"profile: {profile.source}")
    print(profile.describe())
    if profile.trust_problem() is not None:
        print(f"the profile cannot be trusted: {profile.trust_problem()}")
    print(f"training rows: predicted against measured medians rank with Spearman {ranking:.2f}")
    # What `tune` would choose: the configuration predicted fastest, among all, and
    # among those that stream the weights (a budget the weights exceed).
    choice = {name: _choice([r for r in training if keep(r)]) for name, keep in (
        ("all", lambda r: True), ("weights_streamed", lambda r: r["weights"] != "device"))}
    for name, chosen in choice.items():
        print(f"{name}: the predicted fastest ({chosen['chosen']}) measures {chosen['chosen_over_fastest']:+.1%} "
              f"against the measured fastest ({chosen['fastest_measured']}); the goal: within 5%")
    print(f"{'K':>2} {'weights':7} {'acts':6} {'recomp':7} {'best ms':>8} {'median':>8} {'pred ms':>8} "
          f"{'err':>7} {'err/med':>7} {'cpu ms':>7} {'pred c':>7} bound")
    for r in rows:
        print(f"{r['k']:>2} {r['weights']:7} {r['activations']:6} {r.get('pass', r['recompute']):7} "
              f"{r['measured_step_seconds'] * 1e3:>8.1f} {r['measured_median_seconds'] * 1e3:>8.1f} "
              f"{r['predicted_step_seconds'] * 1e3:>8.1f} {r['error']:>+7.1%} {r['error_vs_median']:>+7.1%} "
              f"{r.get('measured_compute_thread_cpu_seconds', float('nan')) * 1e3:>7.1f} "
              f"{r['predicted_compute_seconds'] * 1e3:>7.1f} "
              f"{r['predicted_bound']}")
    print(f"within 15% of the fastest step: {within} of {len(rows)} (load average at the end: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    record = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "load_average_at_end": os.getloadavg()},
        "torch": torch.__version__,
        "command": "python bench/time_bench.py " + " ".join(sys.argv[1:]),
        "model": {"d_model": args.d_model, "seq_len": args.seq_len, "layers": args.layers, "batch": args.batch,
                  "lowering": "aot_eager"},
        "profile": json.loads(profile.to_json()),
        "profile_trust_problem": profile.trust_problem(),
        "cpu": {"rows": rows, "within_15_percent": within, "training_spearman": ranking, "tune_choice": choice},
    }
    if not args.no_h100:
        add_paper(record, args)
    save(record, args.out)


def _choice(rows: list[dict]) -> dict:
    """The row predicted fastest, the row measured fastest (medians), and how much
    slower the first measured."""
    chosen = min(rows, key=lambda r: r["predicted_step_seconds"])
    fastest = min(rows, key=lambda r: r["measured_median_seconds"])
    return {"chosen": _config_name(chosen), "fastest_measured": _config_name(fastest),
            "chosen_over_fastest": chosen["measured_median_seconds"] / fastest["measured_median_seconds"] - 1}


def _config_name(row: dict) -> str:
    """`K=4 weights nvme, activations device, recompute none`."""
    return (f"K={row['k']} weights {row['weights']}, activations {row['activations']}, "
            f"recompute {row['recompute']}")


def add_paper(record: dict, args) -> None:
    """Parts 2 and 3 into `record`, each printed."""
    h100 = h100_rows(args)
    rho = spearman([r["measured_step_seconds"] for r in h100], [r["predicted_step_seconds"] for r in h100])
    record["h100"] = {"source": "../shared/measurements/h100-2026-11-23.md", "profile": "h100-pcie5-nvme",
                      "rows": h100, "spearman_rank_correlation": rho}
    print(f"\nH100 rows on paper (profile h100-pcie5-nvme): Spearman rank correlation {rho:.2f}")
    print(f"{'lowering':9} {'row':58} {'measured':>9} {'predicted':>9} {'err':>7} bound")
    for r in h100:
        print(f"{r['lowering']:9} {r['row']:58} {r['measured_step_seconds']:>9.4f} "
              f"{r['predicted_step_seconds']:>9.4f} {r['error']:>+7.1%} {r['predicted_bound']}")
    if os.path.exists(GPU_CHECK):
        record["gpu_check"] = gpu_check_rows()
        print(f"\n{record['gpu_check']['device_name']} rows of gpu_check on paper (profile h100-pcie5-nvme)")
        for r in record["gpu_check"]["rows"]:
            print(f"{r['row']:58} {r['measured_step_seconds']:>9.4f} {r['predicted_step_seconds']:>9.4f} "
                  f"{r['error']:>+7.1%} {r['predicted_bound']}")


def write_paper(args) -> None:
    import torch

    record = {"torch": torch.__version__, "command": "python bench/time_bench.py " + " ".join(sys.argv[1:])}
    add_paper(record, args)
    save(record, args.out)


def save(record: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    plot(record, os.path.splitext(out)[0] + ".png")


if __name__ == "__main__":
    main()
