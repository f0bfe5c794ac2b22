"""The product benchmark on one CUDA GPU: a Llama with 7B-class layers (hidden 4096,
sequence 2048) trained by speedloader with its weights on pinned host memory, against
plain resident Inductor where the model fits and against FSDP2 with CPU offload where
it does not; the goals are ratios within the run.

Usage (on a CUDA machine with the package installed, from the repository root; calls
of at most 10 minutes; bench/README.md says which wheels to carry to the lent GPU):
    PYTHONUNBUFFERED=1 python3 -m bench gpu --product --only E0,E1,E2 --out $OUT/gpu_product_e.json
    PYTHONUNBUFFERED=1 python3 -m bench gpu --product --only B1 --budget-s 570 --out $OUT/gpu_product_b.json
    PYTHONUNBUFFERED=1 python3 -m bench gpu --product --only P1 --out $OUT/gpu_product_p.json
    python bench/gpu_product.py --cpu-smoke     # the same code path, tiny sizes, on the CPU

Model: ``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, nothing from a
hub): hidden 4096, intermediate 11008, 32 heads (as many key/value heads), vocabulary
32000 (head not tied), sequence 2048, bf16, SDPA attention, no KV cache. It is built on
the device in bf16, so the host never holds an fp32 copy of it. Each row runs in its
own process (gpu_check.run_row) with a fresh Inductor and Triton cache, so every first
step pays its whole compile, within a time limit (below).

Rows:
- E0 ``resident_inductor``: 12 layers (2.69 B parameters), 4 x 2048 tokens, plain
  ``torch.compile`` (Inductor), everything resident; forward and backward, no
  optimizer, gradients cleared between steps. The 100% of E1 and E2.
- E1 ``weights_host_k4``: the same model and tokens under speedloader: K = 4, block
  weights on pinned host (``weights="host"``), their gradients sent to the host
  (``gradients="host"``), activations on the device, ``recompute="none"``,
  ``live_blocks=2``; the device capped at ``--e-cap-gb`` (20 GB) by
  ``torch.cuda.set_per_process_memory_fraction`` and ``memory_budget`` at
  BUDGET_SHARE of it. A backward that sends gradients to the host needs an offloaded
  optimizer to receive them (it raises without one), so the row makes
  ``slcompile.offload_optimizer(model, torch.optim.SGD, lr=0)``, the cheapest
  consumer, and runs its ``step()`` after each timed step (timed apart:
  ``untimed_optimizer_seconds``). Its block steps still run on a host thread during
  the backward: what they take from the issuing thread shows in
  ``host_issue_seconds``.
- E2 ``weights_host_k4_cudagraphs``: E1 with ``cudagraphs=True``.
- B1 ``beyond_device``: 24 layers (5.12 B parameters: 10.2 GB of bf16 weights, about
  60 GB more on the host for AdamW's fp32 copies and states), K = 8, 16 x 2048 tokens,
  weights on pinned host, ``recompute="blocks"``, ``slcompile.offload_optimizer(model,
  torch.optim.AdamW, lr=1e-4)`` with states and gradients on the host, the device
  capped at ``--b-cap-gb`` (40 GB): a whole training step, the optimizer's included
  (``optimizer_step_seconds``: from the backward's end to the step's).
- P1 ``fsdp2_cpu_offload``: what a user would pick instead of B1: FSDP2
  ``fully_shard`` per decoder layer and on the root with ``CPUOffloadPolicy()`` in a
  one-process group (gpu_bench.fsdp2_cpu_offload: nccl; gloo on the CPU), each layer
  under ``checkpoint_wrapper`` (activation checkpointing per block), eager, and
  ``torch.optim.AdamW`` with B1's options stepping the parameters on the CPU; B1's
  model, tokens per step and cap, in as few micro-batches (gradient accumulation) as
  the cap allows: 1, 2, 4, 8, 16 tried in order, a try that raises
  ``torch.OutOfMemoryError`` undone (gradients dropped, layers resharded, cache
  emptied) before the next (``micro_batches`` and ``micro_batch_tries``). Where FSDP2
  cannot run the row says why (``unavailable``).

Model FLOPs per step (MODEL_FLOPS_FORMULA, also in the JSON): 6 x N x T + 12 x L x H x S
x T, where N counts the parameters but the token embedding (the LM head included), T
the tokens of a step, L the layers, H the hidden size and S the sequence: the matmuls'
forward and backward and attention's score and value products (PaLM's convention, no
causal halving; block recompute is not counted). MFU = model FLOPs per step / (step
seconds x the device's dense bf16 peak), the peak from PEAK_BF16 by device name and
multiprocessor count (132: H100 SXM, 114: H100 PCIe), named in the JSON with its source;
none on another device (MFU then null, its goal "not measured").

Per row: median step seconds over ``--repeats`` timed steps (3) after the first
(compile included: ``first_step_seconds``) and ``--warmup`` (1), tokens/s, model
FLOPs and MFU, peak ``torch.cuda.max_memory_allocated`` (and reserved) over the timed
steps and over all, the child's peak resident host memory, pinned host bytes
(``slcompile.runtime_stats()``; FSDP2's pinned parameter shards for P1), bytes per step
per (kind, source, destination) and per tier from the median step's
``slcompile.mark_step()`` window (gpu_bench.tier_bytes) beside those the tiers imply
(``expected_bytes_per_step``: 2 P weight bytes host->device and P gradient bytes
device->host, P the block weights' bytes; none on the CPU, where the host tier copies
nothing), ``host_issue_seconds`` (the thread CPU time of the forward and backward until
issued), and for B1 and P1 ``optimizer_step_seconds``; for a speedloader row, what
its compile report says (``fallback_reason``, blocks, ``streamed_bytes`` P, the
predicted peak per tier, ``cudagraphs_skipped``): a row that fell back to a plain
compile counts for no goal.

Goals (GOALS; ratios within one run, so each call's JSON decides those of its rows):
E1 tokens/s >= 95% of E0's; B1 MFU >= 40%; B1 tokens/s >= 1.5x P1's; E1's first step
<= 1.5x E0's. Each is recorded as met, missed or not measured (with the reason), with
the figures it read.

The JSON (``--out``, default bench/results/gpu_product/gpu_product.json) records the
commit (and whether tracked files changed), torch, transformers, the device's name,
memory and multiprocessor count, and is rewritten after every row, so a command cut
off from outside keeps the rows done. Rows run in order within ``--budget-s`` (540);
a row starts only when what is left covers its estimate (ROW_ESTIMATE_S), else it is
recorded as skipped with the reason, and it may run until what is left is the
estimates of the rows after it. One status line per row goes to stderr; stdout gets
the goals. Exit status: 0 when every row ran (or was unavailable), 1 otherwise, 2
without CUDA unless ``--cpu-smoke``, or when the package does not import or
``torch.compile`` does not know ``backend="speedloader"`` (gpu_check.preflight: the
package is not installed), before any row.

``--cpu-smoke`` runs every row on the CPU with tiny shapes (SMOKE_SHAPES: 2 layers
of hidden 64, batch 4 and 8), fp32, the host tier memory of its own that transfers
copy (``SLC_SEPARATE_HOST=1``: the bytes per step are those of a GPU), aot_eager for
speedloader and the resident row,
no cap, P1 over gloo with unpinned parameters, no warm-up and one timed step, to a
temporary directory: it checks that the command works end to end; its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import gpu_bench  # noqa: E402
import gpu_check  # noqa: E402

LLAMA = dict(hidden=4096, intermediate=11008, heads=32, vocab=32000, seq=2048)
SHAPES = {"E": dict(LLAMA, layers=12, batch=4), "B": dict(LLAMA, layers=24, batch=16)}
SMOKE_LLAMA = dict(hidden=64, intermediate=128, heads=4, vocab=256, seq=16)
# Batches that K = 4 and K = 8 divide.
SMOKE_SHAPES = {"E": dict(SMOKE_LLAMA, layers=2, batch=4), "B": dict(SMOKE_LLAMA, layers=2, batch=8)}

MODEL_FLOPS_FORMULA = (
    "6 x N x T + 12 x L x H x S x T: N the parameters but the token embedding (the LM head included), T the "
    "tokens of a step, L layers, H hidden size, S sequence length (attention's two matmuls, forward and "
    "backward, PaLM's convention without causal halving; block recompute not counted)")

# Dense bf16 tensor-core peaks (NVIDIA's datasheets, without sparsity): (a word of the
# device name, multiprocessors or None for any, FLOP/s, what it is).
PEAK_BF16 = (
    ("NVL", None, 835e12, "H100 NVL / H200 NVL (NVIDIA datasheets, dense BF16 835 TFLOPS)"),
    ("H200", None, 989e12, "H200 SXM (NVIDIA datasheet, dense BF16 989 TFLOPS)"),
    ("H100", 132, 989e12, "H100 SXM (NVIDIA datasheet, dense BF16 989 TFLOPS)"),
    ("H100", 114, 756e12, "H100 PCIe (NVIDIA datasheet, dense BF16 756 TFLOPS)"),
)

GOAL_E1_THROUGHPUT = 0.95  # of E0's tokens/s
GOAL_B1_MFU = 0.40
GOAL_B1_OVER_P1 = 1.5  # x P1's tokens/s
GOAL_E1_FIRST_STEP = 1.5  # x E0's first step
GOALS = {
    "e1_throughput": f"E1 (weights on host, K=4) tokens/s >= {GOAL_E1_THROUGHPUT:.0%} of E0's (resident Inductor)",
    "b1_mfu": f"B1 (24 layers beyond the device cap, AdamW on the host) MFU >= {GOAL_B1_MFU:.0%}",
    "b1_over_p1": f"B1 tokens/s >= {GOAL_B1_OVER_P1}x P1's (FSDP2 with CPU offload, same model, tokens and cap)",
    "e1_first_step": f"E1's first step (compile included) <= {GOAL_E1_FIRST_STEP}x E0's",
}

ADAMW = {"lr": 1e-4}  # torch's defaults otherwise (weight decay 0.01), the same for B1 and P1
# The plan's peak is within 10% of the allocator's (tests/test_device_tiers.py), and
# the allocator reserves more than it hands out: the budget leaves that room under the cap.
BUDGET_SHARE = 0.9
MICRO_BATCH_TRIES = (1, 2, 4, 8, 16)
# Seconds a row needs on an H100 (start, build, a fresh compile, five steps): a row
# starts only when this much is left.
# B1's first step compiled for more than 295 s on an H200 (2026-11-28).
ROW_ESTIMATE_S = {"E0": 90, "E1": 110, "E2": 120, "B1": 450, "P1": 230}
SMOKE_ROW_ESTIMATE_S = 10


# -- the model and its FLOPs --------------------------------------------------------


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=shape["layers"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"], vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"], tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa",
    )


def build_model(shape: dict, device, dtype):
    """The Llama of `shape`, built on `device` in `dtype`: no copy of it in another
    dtype or on another device is ever made."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(llama_config(shape))
    finally:
        torch.set_default_dtype(previous)


def non_embedding_parameters(shape: dict) -> int:
    """N: per layer q, k, v, o (as many key/value heads as heads), gate, up, down and two
    RMSNorm weights; the final norm and the untied LM head."""
    hidden = shape["hidden"]
    per_layer = 4 * hidden * hidden + 3 * hidden * shape["intermediate"] + 2 * hidden
    return shape["layers"] * per_layer + hidden + shape["vocab"] * hidden


def model_flops(shape: dict) -> int:
    """Model FLOPs of one training step of `shape` (MODEL_FLOPS_FORMULA)."""
    tokens = shape["batch"] * shape["seq"]
    attention = 12 * shape["layers"] * shape["hidden"] * shape["seq"] * tokens
    return 6 * non_embedding_parameters(shape) * tokens + attention


def peak_flops(device) -> dict:
    """The device's dense bf16 peak (`peak_for`); none on the CPU."""
    import torch

    if device.type != "cuda":
        return {"flops_per_second": None, "source": "no peak for the CPU (smoke run)"}
    return peak_for(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count)


def peak_for(name: str, multiprocessors: int) -> dict:
    """The dense bf16 peak of the device named `name` (PEAK_BF16) and where it comes
    from; None for a device off the table."""
    for word, count, flops, what in PEAK_BF16:
        if word in name and count in (None, multiprocessors):
            return {"flops_per_second": flops, "source": f"{what}, from the name {name!r} and "
                                                         f"{multiprocessors} multiprocessors"}
    return {"flops_per_second": None, "source": f"{name!r} with {multiprocessors} multiprocessors is not in "
                                                "the table of peaks"}


def expected_bytes(spec: dict) -> dict:
    """Bytes per step the tiers imply for a speedloader row: each block's weights loaded
    for the forward and for the backward (2 P) and its gradients stored once (P); none
    on the CPU, where the host tier is the device's memory, unless the engine keeps a
    host tier of its own there (`SLC_SEPARATE_HOST=1`, as the smoke run does)."""
    separate_host = os.environ.get("SLC_SEPARATE_HOST") == "1"
    if spec["kind"] != "speedloader" or (spec["device"].startswith("cpu") and not separate_host):
        return {}
    block_bytes = gpu_check.block_weight_bytes(spec["shape"], spec["dtype"])
    return {"weight/host/device": 2 * block_bytes, "gradient/device/host": block_bytes}


# -- the rows -------------------------------------------------------------------------


def row_specs(*, smoke: bool, e_cap_bytes: int | None, b_cap_bytes: int | None, lowering: str) -> list[dict]:
    """Every row, in order; a cap of None leaves the device and the plan uncapped."""
    shapes = SMOKE_SHAPES if smoke else SHAPES

    def budget(cap):
        return {} if cap is None else {"memory_budget": int(BUDGET_SHARE * cap)}

    streamed = {"lowering": lowering, "weights": "host", "gradients": "host", "live_blocks": 2}
    e1 = {**streamed, "num_subbatches": 4, "activations": "device", "recompute": "none", **budget(e_cap_bytes)}
    receiver = {"class": "SGD", "options": {"lr": 0.0}, "timed": False}
    adamw = {"class": "AdamW", "options": ADAMW, "timed": True}
    return [
        {"row": "E0", "name": "resident_inductor", "kind": "resident", "shape": shapes["E"], "k": 1},
        {"row": "E1", "name": "weights_host_k4", "kind": "speedloader", "shape": shapes["E"], "k": 4,
         "options": e1, "cap_bytes": e_cap_bytes, "optimizer": receiver},
        {"row": "E2", "name": "weights_host_k4_cudagraphs", "kind": "speedloader", "shape": shapes["E"], "k": 4,
         "options": {**e1, "cudagraphs": True}, "cap_bytes": e_cap_bytes, "optimizer": receiver},
        {"row": "B1", "name": "beyond_device", "kind": "speedloader", "shape": shapes["B"], "k": 8,
         "options": {**streamed, "num_subbatches": 8, "recompute": "blocks", **budget(b_cap_bytes)},
         "cap_bytes": b_cap_bytes, "optimizer": {**adamw, "states": "host"}},
        {"row": "P1", "name": "fsdp2_cpu_offload", "kind": "fsdp2", "shape": shapes["B"], "k": 1,
         "cap_bytes": b_cap_bytes, "optimizer": adamw, "micro_batches": list(MICRO_BATCH_TRIES)},
    ]


def make_step(forward, model, tokens, device, optimizer=None, *, optimizer_timed: bool = True,
              micro_batches: int = 1):
    """A training step: gradients cleared, forward and backward over `micro_batches`
    slices of `tokens`, then `optimizer.step()` inside the timed step or, when not
    `optimizer_timed`, after it. Returns its seconds and their parts."""
    chunks = [tokens] if micro_batches == 1 else list(tokens.chunk(micro_batches))

    def step() -> dict:
        for parameter in model.parameters():
            parameter.grad = None
        gpu_bench.synchronize(device)
        start, thread_start = time.perf_counter(), time.thread_time()
        for chunk in chunks:
            loss = forward(input_ids=chunk, labels=chunk).loss
            (loss if micro_batches == 1 else loss / micro_batches).backward()
        # Read before synchronizing: a synchronize may spin on the CPU.
        figures = {"issue_seconds": time.thread_time() - thread_start}
        gpu_bench.synchronize(device)
        backward_done = time.perf_counter()
        if optimizer is not None and optimizer_timed:
            optimizer.step()
            optimizer.zero_grad()
            gpu_bench.synchronize(device)
            figures["optimizer_seconds"] = time.perf_counter() - backward_done
        figures["seconds"] = time.perf_counter() - start
        if optimizer is not None and not optimizer_timed:
            untimed = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            gpu_bench.synchronize(device)
            figures["untimed_optimizer_seconds"] = time.perf_counter() - untimed
        return figures

    return step


def measure(step, spec: dict, device, first: dict | None = None) -> dict:
    """The first step (unless already run), the warm-up, then the timed steps, each in
    its own `slcompile.mark_step()` window; the median step's figures."""
    import torch

    import slcompile

    first = first or step()
    for _ in range(spec["warmup"]):
        step()
    cuda = device.type == "cuda"
    peak_all = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved_all = torch.cuda.max_memory_reserved(device) if cuda else None
    slcompile.reset_runtime_stats()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps, windows = [], []
    for _ in range(spec["repeats"]):
        slcompile.mark_step()
        steps.append(step())
        windows.append(slcompile.mark_step())
    times = [s["seconds"] for s in steps]
    median = statistics.median_high(times)  # a measured step, so that its counters go with it
    window = windows[times.index(median)]
    moved = gpu_bench.tier_bytes(window.bytes_moved)
    measured = {"/".join(part.value for part in key): n for key, n in window.bytes_moved.items()}
    expected = expected_bytes(spec)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    figures = {
        "step_seconds": median,
        "all_step_seconds": times,
        "tokens_per_second": spec["shape"]["batch"] * spec["shape"]["seq"] / median,
        "first_step_seconds": first["seconds"],
        "host_issue_seconds": statistics.median(s["issue_seconds"] for s in steps),
        "peak_bytes": peak,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "peak_bytes_all_steps": None if peak is None else max(peak, peak_all),
        "peak_reserved_bytes_all_steps": None if peak is None else max(reserved_all,
                                                                      torch.cuda.max_memory_reserved(device)),
        "bytes_moved_per_step": measured,
        "tier_bytes_per_step": moved["per_tier"],
        "host_device_bytes_per_step": moved["host_device"],
        "stall_seconds": window.stall_seconds,
        "pinned_host_bytes": slcompile.runtime_stats().pinned_host_bytes,
    }
    if spec["kind"] == "speedloader":
        figures["expected_bytes_per_step"] = expected
        # A prefetch still in flight when a window closes lands in the next one.
        figures["bytes_minus_expected"] = {key: measured.get(key, 0) - n for key, n in expected.items()}
    for part in ("optimizer_seconds", "untimed_optimizer_seconds"):
        values = [s[part] for s in steps if part in s]
        if values:
            name = "optimizer_step_seconds" if part == "optimizer_seconds" else part
            figures[name] = statistics.median(values)
    return figures


def cap_device(spec: dict, device) -> None:
    """Caps the caching allocator at ``spec["cap_bytes"]`` (a CUDA device only)."""
    import torch

    if device.type != "cuda" or not spec.get("cap_bytes"):
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_bytes"] / total), device)


def run_row(spec: dict) -> dict:
    """Runs one row in this process and returns its figures."""
    import torch

    import slcompile

    device = torch.device(spec["device"])
    cap_device(spec, device)
    shape = spec["shape"]
    model = build_model(shape, device, getattr(torch, spec["dtype"]))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=generator).to(device)
    row = {"spec": spec, "parameters": sum(p.numel() for p in model.parameters())}
    if spec["kind"] == "fsdp2":
        return {**row, **_fsdp2_row(spec, model, tokens, device)}
    optimizer = None
    if spec.get("optimizer"):
        # Before the first call: the compiled backward then sends the gradients to it.
        choice = spec["optimizer"]
        optimizer = slcompile.offload_optimizer(model, getattr(torch.optim, choice["class"]),
                                                states=choice.get("states", "host"), gradients="host",
                                                **choice["options"])
    if spec["kind"] == "resident":
        # A smoke run on the CPU may name a cheaper backend; the measured row is Inductor's.
        forward = torch.compile(model, backend=spec.get("resident_backend", "inductor"))
    else:
        forward = torch.compile(model, backend="speedloader", options=spec["options"])
    step = make_step(forward, model, tokens, device, optimizer,
                     optimizer_timed=bool(spec.get("optimizer", {}).get("timed", True)))
    figures = measure(step, spec, device)
    if spec["kind"] == "speedloader":
        figures.update(_compile_figures(slcompile.compile_reports()[-1]))
    if optimizer is not None:
        optimizer.close()
    return {**row, **figures, "host_peak_rss_bytes": _peak_rss()}


def _compile_figures(report) -> dict:
    """What speedloader compiled: whether it fell back to a plain compile, the blocks,
    the weight bytes streamed per pass (P) and the predicted peak per tier."""
    memory = report.memory
    return {"fallback_reason": report.fallback_reason, "blocks": len(report.blocks),
            "streamed_bytes": report.streamed_bytes, "cudagraphs_skipped": report.cudagraphs_skipped,
            "predicted_peak_bytes": None if memory is None else dict(memory.peak_bytes),
            "planned_recompute": None if memory is None else memory.recompute}


def _fsdp2_row(spec: dict, model, tokens, device) -> dict:
    """P1: FSDP2 with CPU offload and a checkpoint per layer, in as few micro-batches
    as fit; {"unavailable": why} where FSDP2 cannot run here (nor fit the cap at any
    micro-batch count), as gpu_bench's row does."""
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = model.model.layers
        for index, layer in enumerate(layers):
            layers[index] = checkpoint_wrapper(layer)
        forward = gpu_bench.fsdp2_cpu_offload(model, device)
    except Exception as error:  # the row's reason, not a failure of the bench
        return {"unavailable": f"{type(error).__name__}: {error}"}
    try:
        optimizer = getattr(torch.optim, spec["optimizer"]["class"])(model.parameters(),
                                                                     **spec["optimizer"]["options"])
        tries, first = [], None
        for count in [n for n in spec["micro_batches"] if spec["shape"]["batch"] % n == 0]:
            step = make_step(forward, model, tokens, device, optimizer, micro_batches=count)
            started = time.perf_counter()
            try:
                first = step()
            except torch.OutOfMemoryError as error:
                message = str(error).splitlines()[0][:400]
            else:
                break
            # Out of the except block: its traceback, which holds the step's tensors, is gone.
            tries.append({"micro_batches": count, "seconds": time.perf_counter() - started, "error": message})
            _free_after_oom(model, optimizer, device)
        if first is None:
            return {"unavailable": "out of device memory at every micro-batch count under the cap",
                    "micro_batch_tries": tries}
        figures = measure(step, spec, device, first)
        figures["pinned_host_bytes"] = _pinned_parameter_bytes(model)
    except Exception as error:
        import traceback

        return {"unavailable": f"{type(error).__name__}: {str(error)[:2000]}",
                "traceback_tail": traceback.format_exc()[-3000:]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {**figures, "micro_batches": count, "micro_batch_tries": tries, "compiled": False,
            "host_peak_rss_bytes": _peak_rss()}


def _free_after_oom(model, optimizer, device) -> None:
    """Undoes a step that ran out of device memory part way: the gradients, the layers
    left unsharded, the allocator's cached blocks."""
    import gc

    import torch
    from torch.distributed.fsdp import FSDPModule

    optimizer.zero_grad(set_to_none=True)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _pinned_parameter_bytes(model) -> int:
    """The bytes of FSDP2's parameter shards in pinned host memory, which
    `slcompile.runtime_stats()` does not see."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if local.device.type == "cpu" and local.is_pinned():
            total += local.nbytes
    return total


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# -- goals ----------------------------------------------------------------------------


def add_flops(row: dict, peak: float | None) -> None:
    """Model FLOPs of the row's step and, with a measured step and a peak, its MFU."""
    if "shape" not in row["spec"]:
        return
    row["model_flops_per_step"] = model_flops(row["spec"]["shape"])
    if "step_seconds" in row:
        row["mfu"] = None if peak is None else row["model_flops_per_step"] / (row["step_seconds"] * peak)


def find(rows: list[dict], name: str) -> dict | None:
    return next((r for r in rows if r["spec"]["row"] == name), None)


def _speedloader_only(row: dict | None) -> dict | None:
    """A speedloader row that compiled plainly measured Inductor, not speedloader: for
    the goals it is a row without figures, with the reason."""
    if row is None or "step_seconds" not in row or not (row.get("fallback_reason") or row.get("blocks") == 0):
        return row
    return {"spec": row["spec"], "error": "compiled without speedloader: "
                                          + (row.get("fallback_reason") or "no blocks found")}


def evaluate_goals(rows: list[dict], peak: dict) -> list[dict]:
    """Every goal of GOALS: met, missed or not measured (with the reason), with the figures read."""
    goal, measured, why_not = gpu_check.goal, gpu_check.measured, gpu_check.why_not
    e0, e1, b1, p1 = (find(rows, name) for name in ("E0", "E1", "B1", "P1"))
    e1, b1 = _speedloader_only(e1), _speedloader_only(b1)
    goals = []

    def ratio_goal(name: str, numerator: tuple, denominator: tuple, key: str, target: float,
                   at_least: bool) -> dict:
        """numerator[0][key] / denominator[0][key] against `target`; each a (row, its name)."""
        pair = (numerator, denominator)
        missing = [why_not(row, label) for row, label in pair if not measured(row)]
        if missing:
            return goal(name, GOALS[name], "not measured", reason="; ".join(missing), target=target)
        ratio = numerator[0][key] / denominator[0][key]
        met = ratio >= target if at_least else ratio <= target
        return goal(name, GOALS[name], "met" if met else "missed", ratio=ratio, target=target,
                    **{f"{label.lower()}_{key}": row[key] for row, label in pair})

    goals.append(ratio_goal("e1_throughput", (e1, "E1"), (e0, "E0"), "tokens_per_second", GOAL_E1_THROUGHPUT, True))
    if not measured(b1):
        goals.append(goal("b1_mfu", GOALS["b1_mfu"], "not measured", reason=why_not(b1, "B1"), target=GOAL_B1_MFU))
    elif peak.get("flops_per_second") is None or b1.get("mfu") is None:
        goals.append(goal("b1_mfu", GOALS["b1_mfu"], "not measured", reason=peak["source"], target=GOAL_B1_MFU,
                          b1_tokens_per_second=b1["tokens_per_second"]))
    else:
        goals.append(goal("b1_mfu", GOALS["b1_mfu"], "met" if b1["mfu"] >= GOAL_B1_MFU else "missed",
                          ratio=b1["mfu"], target=GOAL_B1_MFU, b1_step_seconds=b1["step_seconds"],
                          model_flops_per_step=b1.get("model_flops_per_step"),
                          peak_flops_per_second=peak["flops_per_second"]))
    goals.append(ratio_goal("b1_over_p1", (b1, "B1"), (p1, "P1"), "tokens_per_second", GOAL_B1_OVER_P1, True))
    goals.append(ratio_goal("e1_first_step", (e1, "E1"), (e0, "E0"), "first_step_seconds", GOAL_E1_FIRST_STEP,
                            False))
    return goals


# -- the command ----------------------------------------------------------------------


def log(message: str) -> None:
    print(f"gpu_product [{time.strftime('%H:%M:%S')}]: {message}", file=sys.stderr, flush=True)


def describe(row: dict) -> str:
    """A row's status line."""
    if "step_seconds" not in row:
        return row.get("error") or row.get("unavailable") or row.get("skipped") or "no figures"
    parts = [f"{row['step_seconds']:.3f} s/step", f"{row['tokens_per_second']:,.0f} tokens/s"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {row['mfu']:.1%}")
    parts.append(f"first step {row['first_step_seconds']:.1f} s")
    if row.get("peak_bytes") is not None:
        parts.append(f"peak {row['peak_bytes'] / 1e9:.1f} GB")
    if "optimizer_step_seconds" in row:
        parts.append(f"optimizer {row['optimizer_step_seconds']:.2f} s")
    if "micro_batches" in row:
        parts.append(f"{row['micro_batches']} micro-batches")
    for key, what in (("fallback_reason", "fell back"), ("cudagraphs_skipped", "CUDA graphs skipped")):
        if row.get(key):
            parts.append(f"{what}: {row[key]}")
    return ", ".join(parts)


def write_json(record: dict, path: str) -> None:
    """The record so far, replaced whole: a run killed while writing leaves the previous one."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(partial, path)


def time_limit(name: str, later: list[str], left: float, estimates: dict) -> float:
    """How long row `name` may run: what is left less the estimates of the rows after
    it, at least its own estimate, at most what is left."""
    return min(left, max(estimates[name], left - sum(estimates[n] for n in later)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench gpu --product", description=__doc__.split("\n\n")[0])
    parser.add_argument("--product", action="store_true", help=argparse.SUPPRESS)  # as `python -m bench gpu --product`
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the command works")
    parser.add_argument("--only", default=None, help="comma-separated rows of E0,E1,E2,B1,P1 (default: all)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_product/gpu_product.json; "
                                                    "a temp dir for --cpu-smoke)")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the command (default "
                                                                     "540; 300 for --cpu-smoke)")
    parser.add_argument("--e-cap-gb", type=float, default=20.0, help="device cap of E1 and E2, GB (1e9 bytes)")
    parser.add_argument("--b-cap-gb", type=float, default=40.0, help="device cap of B1 and P1, GB (1e9 bytes)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 3; 1 for --cpu-smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="steps after the first, before timing (default 1; "
                                                                 "0 for --cpu-smoke)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.budget_s = args.budget_s or (300 if smoke else 540)
    args.repeats = args.repeats or (1 if smoke else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if smoke else 1)
    if args.out is None:
        args.out = os.path.join(tempfile.mkdtemp(prefix="slc-gpu-product-") if smoke
                                else os.path.join(HERE, "results", "gpu_product"), "gpu_product.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.row is not None:
        spec = json.loads(args.row)
        try:
            row = run_row(spec)
        except Exception as error:  # one JSON line either way: Dynamo's errors end in advice, not the error
            import traceback

            row = {"spec": spec, "error": f"{type(error).__name__}: {str(error)[:2000]}",
                   "traceback_tail": traceback.format_exc()[-3000:]}
        print(json.dumps(row, default=str))
        return 0

    clock = gpu_check.Clock(args.budget_s, reserve_s=5)
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(f"gpu_product: no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda}); run it on "
              "a CUDA machine, or pass --cpu-smoke to check the command on the CPU", file=sys.stderr)
        return 2
    problem = gpu_check.preflight()
    if problem:
        print(f"gpu_product: {problem}", file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    if smoke:
        # The rows' children copy to and from a host tier of its own, as on a GPU: the
        # smoke run checks the bytes the tiers imply.
        os.environ["SLC_SEPARATE_HOST"] = "1"
    gb = 10**9
    specs = row_specs(smoke=smoke, e_cap_bytes=None if smoke else int(args.e_cap_gb * gb),
                      b_cap_bytes=None if smoke else int(args.b_cap_gb * gb),
                      lowering="aot_eager" if smoke else "inductor")
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {s["row"] for s in specs})
        if unknown:
            print(f"gpu_product: unknown row(s) {', '.join(unknown)}; choose from E0,E1,E2,B1,P1", file=sys.stderr)
            return 2
        specs = [s for s in specs if s["row"] in wanted]
    base = {"device": str(device), "dtype": "float32" if smoke else "bfloat16", "repeats": args.repeats,
            "warmup": args.warmup, **({"resident_backend": "aot_eager"} if smoke else {})}
    estimates = {s["row"]: SMOKE_ROW_ESTIMATE_S if smoke else ROW_ESTIMATE_S[s["row"]] for s in specs}
    peak = peak_flops(device)
    out = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    record = {
        "command": " ".join(["gpu_product", *(argv if argv is not None else sys.argv[1:])]),
        "smoke": smoke,
        **gpu_check.environment(device),
        "budget_seconds": args.budget_s,
        "peak_flops": peak,
        "model_flops_formula": MODEL_FLOPS_FORMULA,
        "goals_text": GOALS,
        "rows": [],
    }
    for index, spec in enumerate(specs):
        spec = {**base, **spec}
        name, label = spec["row"], f"{spec['row']} {spec['name']}"
        left = clock.left()
        if left < estimates[name]:
            row = {"spec": spec, "skipped": f"{max(left, 0):.0f} s left of the budget, under the row's estimate "
                                            f"of {estimates[name]} s"}
        else:
            limit = time_limit(name, [s["row"] for s in specs[index + 1:]], left, estimates)
            log(f"{label}: at most {limit:.0f} s")
            row = gpu_check.run_row(spec, limit, script="gpu_product.py")
        add_flops(row, peak["flops_per_second"])
        record["rows"].append(row)
        record["goals"] = evaluate_goals(record["rows"], peak)
        record["seconds"] = clock.elapsed()
        write_json(record, out)
        wall = f" ({row['wall_seconds']:.0f} s)" if "wall_seconds" in row else ""
        log(f"{label}: {describe(row)}{wall}")
    record["goals"] = evaluate_goals(record["rows"], peak)
    rows_ok = all("step_seconds" in r or "unavailable" in r for r in record["rows"])
    record["status"] = {"rows_ran": rows_ok, "goals": {s: sum(g["status"] == s for g in record["goals"])
                                                       for s in ("met", "missed", "not measured")}}
    record["seconds"] = clock.elapsed()
    write_json(record, out)
    gpu_check.print_goals(record)
    print(f"gpu_product: rows {'all ran' if rows_ok else 'not all ran'}, {record['seconds']:.0f} s; wrote {out}",
          flush=True)
    return 0 if rows_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
