"""A machine profile fitted to how this package's compiled steps run here.

`measure_profile` measures the machine's rates (`slcompile.measure.measure_rates`:
matmul, memory bandwidth, op and call overheads, the links, the disk) and, with
`steps=True`, fits the compute thread's fixed costs on top from compiled steps and
generation passes run here: the time per op and per byte of large outputs beyond
the roofline, the host time of each kind of transfer op, and a generation's costs
per layer step and per pass. `machine_profile`, `profile_key` and `profile_path`
(the cache of measured rates) live in `slcompile.measure` and are named here too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

from slcompile.analysis.machine import MachineProfile
from slcompile.measure import default_device, default_dtype, machine_profile, measure_rates, profile_key, profile_path

__all__ = ["machine_profile", "measure_profile", "profile_key", "profile_path"]


def measure_profile(device: str | torch.device | None = None, *, dtype: torch.dtype | None = None,
                    offload_dir: str | None = None, nvme: bool = True, steps: bool = False,
                    generation: bool = True) -> MachineProfile:
    """Measures this machine's rates (a few seconds; `measure_rates`).

    Args:
        device: the compute device (default: CUDA if present, else the CPU).
        dtype: the compute dtype of the matmul (default: bf16 on CUDA, fp32 on CPU).
        offload_dir: the directory the nvme tier would use (default: the temp dir).
        nvme: measure the disk (else its rates are left infinite).
        steps: also fit the compute thread's fixed costs from compiled steps (two
            small GPTs on the device and one on nvme, aot_eager; about 8 s more,
            in a child process, so that nothing is compiled in this one): the time
            per op beyond the roofline, with a scale of the roofline on a CPU or a
            time per byte of large outputs elsewhere (`_fit_compute`), and per
            transfer op (instead of the transfer engine's own calls alone); and,
            where transformers is installed, a generation's costs per layer step and
            per pass beyond its ops (`_measure_generation`: a few seconds more).
        generation: with `steps`, measure the generation's costs too (else they
            stay 0: a profile for training steps alone).
    """
    began = time.perf_counter()
    profile = measure_rates(device, dtype=dtype, offload_dir=offload_dir, nvme=nvme)
    if not steps:
        return profile
    device = default_device(device)
    dtype = default_dtype(device, dtype)
    profile = dataclasses.replace(profile, **_fit_in_child(profile, device, offload_dir, nvme=nvme,
                                                           generation=generation))
    source = (f"measured on {socket.gethostname()} ({device.type}, {torch.get_num_threads()} threads, "
              f"{dtype}) in {time.perf_counter() - began:.1f} s")
    return dataclasses.replace(profile, source=source)


def _fit_in_child(profile: MachineProfile, device: torch.device, offload_dir, *, nvme: bool,
                  generation: bool) -> dict:
    """The fields `_fit` measures, measured by a child process with this one's
    threads and import path.

    The compiled steps stay out of this process's Dynamo: its caches, and the sizes
    it records of the example model's code, with which a later compile of that model
    at other sizes (a benchmark's, a user's) would trace symbolic sizes and a
    different plan (every saved tensor past `min_offload_bytes` at its largest).

    Raises:
        RuntimeError: the child failed; the message ends with its error output.
    """
    request = {"profile": profile.to_json(), "device": str(device), "offload_dir": offload_dir, "nvme": nvme,
               "generation": generation, "threads": torch.get_num_threads()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    with tempfile.TemporaryDirectory(prefix="slc-profile-") as folder:
        out = os.path.join(folder, "fitted.json")
        done = subprocess.run([sys.executable, "-c", "from slcompile.profile import _fit_here; _fit_here()", out],
                              input=json.dumps(request), text=True, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, check=False)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"measuring the compiled steps failed (exit status {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
        with open(out) as f:
            fitted = json.load(f)
    fitted["transfer_op_costs"] = tuple(tuple(cost) for cost in fitted["transfer_op_costs"])
    return fitted


def _fit_here() -> None:
    """The child of `_fit_in_child`: reads its request from stdin and writes the
    fitted fields as JSON to the path in its first argument."""
    request = json.load(sys.stdin)
    torch.set_num_threads(request["threads"])
    profile = MachineProfile.from_json(request["profile"])
    fitted = _fit(profile, torch.device(request["device"]), request["offload_dir"], nvme=request["nvme"],
                  generation=request["generation"])
    with open(sys.argv[1], "w") as f:
        json.dump(fitted, f)


def _fit(profile: MachineProfile, device: torch.device, offload_dir, *, nvme: bool, generation: bool) -> dict:
    """The compute thread's fixed costs, as `MachineProfile` fields (those left
    out keep `profile`'s values): from compiled steps where `nvme`, from a
    generation's decode passes where `generation`."""
    fitted: dict = {"transfer_op_costs": profile.transfer_op_costs}
    if nvme:
        fitted.update(_measure_steps(offload_dir, profile, device))
        profile = dataclasses.replace(profile, **fitted)
    if generation:
        fitted["layer_step_seconds"], fitted["pass_seconds"] = _measure_generation(profile, offload_dir, device)
    return fitted


def _measure_steps(offload_dir, profile: MachineProfile, device: torch.device) -> dict:
    """The compute thread's costs of compiled steps (aot_eager) on `device`, as
    `MachineProfile` fields: the compute's beyond the roofline (`_fit_compute`), the
    seconds per `slc::` transfer op and the host seconds of each kind of transfer
    op; in the child process of `_fit_in_child` (it resets Dynamo).

    Two GPTs' steps run with everything on the device: a tiny one (many small ops)
    and a wider one (fewer ops, large outputs); the thread's CPU time of each against
    the roofline of its ops at the profile's rates gives the compute's costs. The
    tiny one's step with its weights and activations on nvme, less that on the
    device, over its transfer ops gives the seconds per transfer op; that step run
    once more under `torch.profiler` (`slcompile.step_profile`) gives each op's
    median host time."""
    import slcompile
    from slcompile.analysis.time import count_cost
    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.step_profile import profile_step
    from slcompile.vocabulary import is_compute, transfer_kind

    tiny = GPTConfig(d_model=64, seq_len=32, n_layers=2, n_heads=2)
    runs = [  # (config, batch, K, tier)
        (tiny, 4, 2, "device"),
        (GPTConfig(d_model=192, seq_len=64, n_layers=2, n_heads=4), 4, 1, "device"),
        (tiny, 4, 2, "nvme"),
    ]
    if not profile.host_is_device:
        runs.append((tiny, 4, 2, "host"))  # host copies cost the host otherwise than disk reads
    cpu_seconds, graphs, op_costs = [], [], []
    for cfg, batch, k, tier in runs:
        # Each model traced with its own static sizes, as a step of one model is (in
        # `_fit_in_child`'s child, where nothing else is compiled).
        torch._dynamo.reset()
        idx, targets = (t.to(device) for t in make_gpt_batch(cfg, batch))
        model = TinyGPT(cfg).to(device)
        options = {"lowering": "aot_eager", "num_subbatches": k, "weights": tier, "activations": tier,
                   "live_blocks": 2, "min_offload_bytes": 0, "offload_dir": offload_dir}
        compiled = torch.compile(model, backend="speedloader", options=options)

        def step():
            compiled(idx, targets)[1].backward()
            model.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        best = math.inf
        for _ in range(5):
            start = time.thread_time()
            step()
            best = min(best, time.thread_time() - start)
        cpu_seconds.append(best)
        graphs.append(list(slcompile.compile_reports()[-1].partitioned.values()))
        if tier != "device":
            op_costs += [(f"{name.split('::')[1]}@{tier}", us * 1e-6)
                         for name, us in profile_step(step).slc_median_us().items()]
    bare = dataclasses.replace(profile, op_overhead_seconds=0.0, output_seconds_per_byte=0.0, compute_scale=1.0)
    rows = []
    for gms, seconds in zip(graphs[:2], cpu_seconds[:2]):
        costs = [count_cost(node) for gm in gms for node in gm.graph.nodes if is_compute(node)]
        rows.append((len(costs), sum(bare.compute_seconds(cost) for cost in costs),
                     sum(cost.large_output_bytes for cost in costs), seconds))
    transfers = sum(transfer_kind(node) is not None for gm in graphs[2] for node in gm.graph.nodes)
    return {**_fit_compute(rows, device),
            "transfer_op_seconds": max(cpu_seconds[2] - cpu_seconds[0], 0.0) / max(transfers, 1),
            "transfer_op_costs": tuple(sorted(op_costs))}


def _fit_compute(rows, device: torch.device) -> dict:
    """The compute costs beyond the roofline, from two steps' (compute ops, roofline
    seconds at the measured rates, bytes of large outputs, CPU seconds).

    On a CPU the step's thread computes, so its time is `compute_scale * roofline +
    ops * op_overhead_seconds`: the two steps give both (the roofline's share moves
    with the level the rates were measured at; the scale carries it to every
    prediction alike). Elsewhere, or where that fit is not positive, the roofline is
    taken as measured and the rest is `ops * op_overhead_seconds + large output
    bytes * output_seconds_per_byte`."""
    (ops0, roof0, large0, seconds0), (ops1, roof1, large1, seconds1) = rows
    determinant = roof0 * ops1 - roof1 * ops0
    if device.type == "cpu" and determinant:
        scale = (seconds0 * ops1 - seconds1 * ops0) / determinant
        op_seconds = (roof0 * seconds1 - roof1 * seconds0) / determinant
        if scale > 0 and op_seconds >= 0:
            return {"op_overhead_seconds": op_seconds, "output_seconds_per_byte": 0.0, "compute_scale": scale}
    rest0, rest1 = seconds0 - roof0, seconds1 - roof1
    determinant = ops0 * large1 - ops1 * large0
    per_byte = max((ops0 * rest1 - ops1 * rest0) / determinant if determinant else 0.0, 0.0)
    return {"op_overhead_seconds": max((rest0 - per_byte * large0) / max(ops0, 1), 0.0),
            "output_seconds_per_byte": per_byte, "compute_scale": 1.0}


def _measure_generation(profile: MachineProfile, offload_dir, device: torch.device) -> tuple[float, float]:
    """(seconds per layer step, seconds per pass) that a generation's decode passes
    take beyond what `profile` predicts for them (their ops and compiled calls).

    Decode passes of a small Hugging Face Llama (random weights) with one layer and
    with five, one sub-batch, weights and cache on the device, layer steps
    compiled with Inductor (`generate`'s default): each model's median decode pass
    less its predicted one (`explain_generation(profile=...)`) is
    `passes * b + layer steps * a`; the two give a and b. (0, 0) without
    transformers."""
    import statistics

    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return 0.0, 0.0
    from slcompile.generate import explain_generation, generate

    rests = []
    for layers in (1, 5):
        torch.manual_seed(0)
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
        model = LlamaForCausalLM(config).eval().to(device)
        ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
        options = dict(num_subbatches=1, backend="inductor", offload_dir=offload_dir)
        tokens = dict(eos_token_id=[], pad_token_id=0, progress=False)
        generate(model, ids, max_new_tokens=3, **tokens, **options)  # compiles the layer steps
        out = generate(model, ids, max_new_tokens=24, return_dict_in_generate=True, **tokens, **options)
        measured = statistics.median(step.seconds for step in out.steps[1:])
        predicted = explain_generation(model, ids.shape, 24, profile=profile, **options).decode_time.step_seconds
        rests.append(measured - predicted)
    per_step = max((rests[1] - rests[0]) / 4, 0.0)
    return per_step, max(rests[0] - per_step, 0.0)

