"""Block weights sharded across ranks: numerics against eager on the whole batch,
exact collective byte counts, the predicted bytes of the weights' tier against the
runtime's, and DCP checkpoints (`save_sharded` / `load_sharded`: a resumed run
equals the uninterrupted one bit for bit, each rank writes its own shards) and
`max_grad_norm` (the whole model's norm, as `clip_grad_norm_`), with two CPU
processes over gloo; training and the padded shard layout with four.

The baseline, FSDP2 (`fully_shard`) with gradient accumulation over K micro-batches,
is measured in the same processes: its collective bytes grow with K where the
sharded schedule's do not.

One spawn of each size checks everything that needs its process group, to pay its
start-up once.
"""

import copy
import datetime
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import slcompile
from conftest import fetched_weight_bytes
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import Tier, TransferKind, collect_garbage, mark_step, reset_runtime_stats, runtime_stats
from slcompile.runtime.collectives import shard_group

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench/
from bench.distributed_bench import counted_collectives  # noqa: E402

WORLD = 2
CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)
BATCH = 8  # the global batch; each rank runs half of it
STEPS = 3
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
COLLECTIVE = {kind: (kind, Tier.DEVICE, Tier.DEVICE)
              for kind in (TransferKind.ALL_GATHER, TransferKind.REDUCE_SCATTER, TransferKind.ALL_REDUCE)}


def _model(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(CFG)
    # As in test_offload_optimizer: the key part of a fused qkv bias has an exactly-zero
    # gradient, where Adam turns rounding noise into steps of size lr.
    for block in model.layers:
        block.attn.qkv.register_parameter("bias", None)
    return model


def _batch(size, seed):
    """A batch whose every target counts: the global batch's mean loss is then the
    mean of the ranks' mean losses (ignored targets would weigh the halves unequally)."""
    idx, targets = make_gpt_batch(CFG, size, seed=seed)
    return idx, targets.clamp(min=0)


def _train_sharded(rank, k, weights, offload_dir, checkpoint=None, max_grad_norm=None):
    """Three AdamW steps on this rank's 1/W of each batch, against eager AdamW on
    the whole batch; returns the figures of each step, the streamed bytes, the bytes
    the graphs fetch per step, the bytes of the replicated parameters and the last
    step's loss, parameters and optimizer state. With `checkpoint`, saves one there
    after the second step. With `max_grad_norm`, eager clips with `clip_grad_norm_`
    over the whole model's gradients, and the norm must be small enough to clip."""
    world = dist.get_world_size()
    eager = _model()
    eager_opt = torch.optim.AdamW(eager.parameters(), **ADAMW)
    model = copy.deepcopy(eager)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, max_grad_norm=max_grad_norm, **ADAMW)
    options = {"lowering": "aot_eager", "num_subbatches": k, "weights": weights, "shard_weights": True,
               "offload_dir": offload_dir}
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    explained = None
    if checkpoint is not None:  # once: `explain` predicts what the compiled step below measures
        idx, targets = _batch(BATCH, 0)
        explained = slcompile.explain(model, idx[half], targets[half], **options).graphs[0].memory
        torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader", options=options)
    steps = []
    collect_garbage()  # what earlier runs left on the tiers goes now, not during the steps
    reset_runtime_stats()
    resident_before = runtime_stats().resident_bytes
    for step in range(STEPS):
        idx, targets = _batch(BATCH, step)
        with torch.no_grad():
            expected_local_loss = eager(idx[half], targets[half])[1]
        eager(idx, targets)[1].backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), max_grad_norm)
        loss = compiled(idx[half], targets[half])[1]
        loss.backward()
        opt.step()
        steps.append(mark_step())
        torch.testing.assert_close(loss.detach(), expected_local_loss, atol=1e-5, rtol=1e-5)
        if max_grad_norm is not None:
            # Every rank's shards and the replicated parameters once: the whole model's norm.
            torch.testing.assert_close(opt.last_grad_norm, norm, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"k={k} step {step}: grad norm: {m}")
            assert max_grad_norm / (norm + 1e-6) < 0.9, norm  # it clips
        # Replicated parameters: their .grad is the ranks' average, the whole batch's.
        streamed = {name for name, _ in slcompile.offloaded_parameters(model)}
        assert streamed, "no weight is streamed"
        for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
            if name not in streamed:
                torch.testing.assert_close(param.grad, expected.grad, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"k={k} step {step}: grad of {name}: {m}")
            else:
                assert param.grad is None, name
        eager_opt.step()
        eager_opt.zero_grad()
        opt.zero_grad()
        if checkpoint is not None and step == STEPS - 2:
            slcompile.save_sharded(model, opt, checkpoint)
            # What a load without sharding must read back: the whole weights, eager AdamW's state.
            whole = {name: value.clone() for name, value in model.state_dict().items()}
            states = {name: {key: value.clone() for key, value in eager_opt.state[param].items()}
                      for name, param in eager.named_parameters()}
            at_checkpoint = (whole, states)
            mark_step()  # the next step's figures leave out the gathers of state_dict()
    resident = runtime_stats().resident_bytes
    # Each step's loss above already read the weights the step before wrote.
    with slcompile.gathered_weights(model):
        final = {name: param.detach().clone() for name, param in model.named_parameters()}
        for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"k={k}: {name} after {STEPS} steps: {m}")
    # state_dict() all-gathers each streamed weight from the optimizer's shards.
    state = model.state_dict()
    for name, expected in eager.state_dict().items():
        torch.testing.assert_close(state[name], expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # The optimizer state of a streamed weight is this rank's shard of eager AdamW's.
    shards = shard_group()
    saved = opt.state_dict()["state"]
    for name, param in eager.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            expected = eager_opt.state[param][key]
            expected = shards.shard(expected) if name in streamed else expected
            torch.testing.assert_close(saved[name][key], expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} {key}: {m}")
    report = slcompile.compile_reports()[-1]
    fetched = fetched_weight_bytes(report)
    # The memory model: the weights' tier holds this rank's padded shard of each
    # streamed weight, as the runtime measures it; the optimizer's host copies too.
    params = dict(eager.named_parameters())
    shard_bytes = sum(shards.shard_numel(params[name].numel()) * params[name].element_size() for name in streamed)
    assert shard_bytes < report.streamed_bytes
    tier = Tier(weights)
    assert report.memory.peak_bytes[weights] == resident[tier] - resident_before[tier] == shard_bytes, (
        report.memory.peak_bytes, resident, resident_before)
    masters = sum(opt.host_copy(param).nbytes for name, param in model.named_parameters() if name in streamed)
    assert report.memory.optimizer.host_master_bytes == masters == shard_bytes
    if explained is not None:
        assert explained.peak_bytes[weights] == shard_bytes, explained.peak_bytes
        assert explained.optimizer.host_master_bytes == shard_bytes
    replicated = sum(p.nbytes for name, p in eager.named_parameters() if name not in streamed)
    opt.close()
    last = (loss.detach(), final, saved, at_checkpoint if checkpoint is not None else None)
    return steps, report.streamed_bytes, fetched, replicated, last


def _resume(rank, k, weights, offload_dir, checkpoint, last):
    """A fresh model (other initial values) and optimizer, the checkpoint of step 2
    loaded before the compile, then step 3: the loss, parameters and optimizer state
    of the uninterrupted run `last`, bit for bit. Loaded again into the compiled,
    sharded model, step 3 once more: the same again."""
    expected_loss, expected_params, expected_state, _ = last
    torch._dynamo.reset()
    model = _model(seed=1)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, **ADAMW)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "num_subbatches": k, "weights": weights, "shard_weights": True,
        "offload_dir": offload_dir})
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    idx, targets = _batch(BATCH, STEPS - 1)
    for when in ("before the compile", "into the sharded model"):
        slcompile.load_sharded(model, opt, checkpoint)
        loss = compiled(idx[half], targets[half])[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss.detach(), expected_loss, rtol=0, atol=0, msg=lambda m: f"{when}: {m}")
        with slcompile.gathered_weights(model):
            for name, param in model.named_parameters():
                torch.testing.assert_close(param, expected_params[name], rtol=0, atol=0,
                                           msg=lambda m: f"{when}: {name}: {m}")
        state = opt.state_dict()["state"]
        assert state.keys() == expected_state.keys()
        for name, values in expected_state.items():
            for key, value in values.items():
                torch.testing.assert_close(state[name][key], value, rtol=0, atol=0,
                                           msg=lambda m: f"{when}: {name} {key}: {m}")
    streamed = {name for name, _ in slcompile.offloaded_parameters(model)}
    opt.close()
    return streamed


def _check_checkpoint_files(checkpoint, streamed):
    """Each rank wrote its own file: its shard of every streamed weight and of its
    optimizer state (DCP chunk r of the tensor's 1-D view: elements [r*n, (r+1)*n)),
    and the replicated tensors once over all ranks; no rank wrote the whole model."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    payload = {rank: 0 for rank in range(WORLD)}  # tensor bytes each rank's file holds
    whole = 0
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        itemsize = torch.empty((), dtype=item.properties.dtype).element_size()
        whole += item.size.numel() * itemsize
        name = fqn.split("/")[1]
        chunks = [(chunk.offsets, chunk.sizes) for chunk in item.chunks]
        if name in streamed and item.size.numel() > 1:
            numel = item.size.numel()
            size = -(-numel // WORLD)
            assert item.size == (numel,), fqn
            assert chunks == [((r * size,), (min(numel, (r + 1) * size) - r * size,)) for r in range(WORLD)], fqn
        else:
            assert chunks == [((0,) * len(item.size), item.size)], fqn
        for index, info in metadata.storage_data.items():
            if index.fqn == fqn:
                rank = int(info.relative_path.split("_")[2])
                chunk = item.chunks[index.index]
                payload[rank] += chunk.sizes.numel() * itemsize
                if name in streamed and item.size.numel() > 1:
                    assert chunk.offsets[0] == rank * -(-item.size.numel() // WORLD), (fqn, info)
    assert sum(payload.values()) == whole
    for rank in range(WORLD):
        path = Path(checkpoint) / f"__{rank}_0.distcp"
        assert path.stat().st_size >= payload[rank] > 0, (rank, payload)
        assert payload[rank] < 0.7 * whole, (rank, payload, whole)


def _check_padding(rank):
    """A tensor whose size W does not divide: rank r keeps elements [4r, 4r + 4) of it,
    zero-padded; the bytes are those of (W - 1) padded shards."""
    shards = shard_group()
    full = torch.arange(7.0).view(7, 1) * (rank + 1)  # each rank's own values
    reset_runtime_stats()
    gathered = shards.wait(shards.all_gather("t", lambda: shards.shard(full), full.shape))
    reduced = shards.wait(shards.reduce_scatter("t", full))
    moved = mark_step().bytes_moved
    # Rank 0 gave elements 0-3 of its tensor, rank 1 elements 4-6 of its own (twice rank 0's).
    expected = torch.cat([torch.arange(4.0), torch.arange(4.0, 7.0) * 2]).view(7, 1)
    torch.testing.assert_close(gathered, expected, rtol=0, atol=0)
    average = torch.nn.functional.pad(torch.arange(7.0) * 1.5, (0, 1))
    torch.testing.assert_close(reduced, average[rank * 4:(rank + 1) * 4], rtol=0, atol=0)
    assert moved[COLLECTIVE[TransferKind.ALL_GATHER]] == (WORLD - 1) * 4 * 4
    assert moved[COLLECTIVE[TransferKind.REDUCE_SCATTER]] == (WORLD - 1) * 4 * 4


def _check_counted_collectives():
    """`counted_collectives` counts FSDP2's collectives as the shard group counts its
    own: for a tensor of 7 elements, each kind with its padded shards of 4."""
    shards = shard_group()
    full, shard = torch.zeros(8), torch.zeros(4)
    with counted_collectives() as moved:
        dist.all_gather_into_tensor(full, shard)
        dist.reduce_scatter_tensor(shard, full)
        dist.all_reduce(torch.zeros(7))
    assert moved == {COLLECTIVE[kind]: shards.received_bytes(kind, 7, 4) for kind in COLLECTIVE}, dict(moved)
    assert moved[COLLECTIVE[TransferKind.ALL_REDUCE]] == 2 * (WORLD - 1) * 4 * 4


def _shard_bytes(params):
    """Bytes of this rank's FSDP2 shards of `params`: dim 0 padded to a multiple of W."""
    return sum(-(-p.shape[0] // WORLD) * (p.numel() // p.shape[0]) * p.element_size() for p in params)


def _train_fsdp2(rank, k):
    """FSDP2 on each block and on the root, K micro-batches of this rank's half of
    each batch one after the other (FSDP2 reduce-scatters after each backward, its
    default), AdamW on the shards, against eager AdamW on the whole batch; returns the
    collective bytes each step receives (`counted_collectives`) and the eager model."""
    eager = _model()
    eager_opt = torch.optim.AdamW(eager.parameters(), **ADAMW)
    model = copy.deepcopy(eager)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    steps = []
    for step in range(STEPS):
        idx, targets = _batch(BATCH, step)
        micro = list(zip(idx[half].chunk(k), targets[half].chunk(k)))
        with torch.no_grad():
            expected = [eager(i, t)[1] for i, t in micro]
        eager(idx, targets)[1].backward()
        with counted_collectives() as moved:
            for (i, t), expected_loss in zip(micro, expected):
                loss = model(i, t)[1]
                (loss / k).backward()
                torch.testing.assert_close(loss.detach(), expected_loss, atol=1e-5, rtol=1e-5)
            opt.step()
            opt.zero_grad()
        steps.append(dict(moved))
        eager_opt.step()
        eager_opt.zero_grad()
    for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param.full_tensor(), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"fsdp2 k={k}: {name} after {STEPS} steps: {m}")
    return steps, eager


# The training runs of each spawn: (K, weights tier, max_grad_norm, save a checkpoint).
# On this CPU machine "host" is the device's memory: it streams (no bytes) only to shard.
RUNS = ((1, "nvme", None, False), (4, "nvme", None, True), (4, "host", None, False), (2, "nvme", 0.5, False))
RUNS_OF_FOUR = ((2, "nvme", None, False),)


def _worker(rank, world, runs, rendezvous, offload_dir, results):
    """The training `runs` at world size `world`; at world size 2, also the resumed
    checkpoint, the shard layout, the FSDP2 baseline and the refusals."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        if world == WORLD:
            _check_padding(rank)
            _check_counted_collectives()
        checkpoint = str(Path(offload_dir) / "checkpoint")
        for k, weights, max_grad_norm, save in runs:
            torch._dynamo.reset()
            steps, streamed_bytes, fetched, replicated, last = _train_sharded(
                rank, k, weights, offload_dir, checkpoint if save else None, max_grad_norm)
            if save:
                streamed = _resume(rank, k, weights, offload_dir, checkpoint, last)
                dist.barrier()
                _check_checkpoint_files(checkpoint, streamed)
                results["checkpoint", rank] = last[-1]
            for index, step in enumerate(steps):
                moved = step.bytes_moved
                # Each rank receives the (W-1)/W of every fetched weight it does not keep,
                # once per pass, whatever K; and (W-1)/W of every streamed gradient per step.
                assert moved[COLLECTIVE[TransferKind.ALL_GATHER]] == fetched * (world - 1) // world, (k, dict(moved))
                assert moved[COLLECTIVE[TransferKind.REDUCE_SCATTER]] == streamed_bytes * (world - 1) // world
                # The replicated gradients' average; with a clip, one fp32 scalar more (the
                # squared norms of the shards), which the counters take as one element a rank.
                norm_bytes = 2 * (world - 1) * 4 if max_grad_norm is not None else 0
                assert moved[COLLECTIVE[TransferKind.ALL_REDUCE]] == 2 * replicated * (world - 1) // world + norm_bytes
                # The tier holds this rank's shard only: each update writes it (from the
                # second step: the first also offloads). The updates take their place in
                # step(), which then issues the next forward's first loads: they may end
                # after the step's figures close, so only the writes are counted per step.
                if weights == "nvme" and index > 0:
                    assert moved[(TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME)] == streamed_bytes // world
            results[(rank, k, weights, max_grad_norm)] = moved[COLLECTIVE[TransferKind.ALL_GATHER]]
            results[("speedloader", rank, k, weights, max_grad_norm)] = {
                kind: moved[key] for kind, key in COLLECTIVE.items()}
        if world != WORLD:
            return
        # The baseline: FSDP2 with gradient accumulation. Each micro-batch all-gathers
        # every weight for its forward and the blocks' again for its backward (the
        # root's stay gathered in between), and reduce-scatters every gradient.
        for k in (1, 4):
            steps, model = _train_fsdp2(rank, k)
            every = _shard_bytes(model.parameters()) * (WORLD - 1)
            blocks = _shard_bytes(model.layers.parameters()) * (WORLD - 1)
            for moved in steps:
                assert moved == {COLLECTIVE[TransferKind.ALL_GATHER]: k * (every + blocks),
                                 COLLECTIVE[TransferKind.REDUCE_SCATTER]: k * every}, (k, moved)
            results[("fsdp2", rank, k)] = {key[0]: n for key, n in steps[-1].items()}
        # No offloaded optimizer: the shards of the gradients would have nowhere to go.
        torch._dynamo.reset()
        compiled = torch.compile(_model(), backend="speedloader",
                                 options={"lowering": "aot_eager", "weights": "nvme", "shard_weights": True,
                                          "offload_dir": offload_dir})
        idx, targets = _batch(BATCH // WORLD, 0)
        with pytest.raises(Exception, match="shard_weights.*offload_optimizer"):
            compiled(idx, targets)
        # FSDP2 shards the parameters itself: refused, pointing to shard_weights.
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        compiled = torch.compile(model, backend="speedloader",
                                 options={"lowering": "aot_eager", "on_refusal": "raise"})
        with pytest.raises(Exception, match="fully_shard.*shard_weights=True"):
            compiled(idx, targets)
    finally:
        dist.destroy_process_group()


def _check_unsharded_load(checkpoint, weights, states):
    """The checkpoint of two ranks, loaded by one process without a process group
    into a model not compiled: whole weights and whole optimizer states (DCP reads
    every rank's chunks of each)."""
    model = _model(seed=1)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, **ADAMW)
    slcompile.load_sharded(model, opt, checkpoint)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    saved = opt.state_dict()["state"]
    assert saved.keys() == states.keys()
    for name, values in states.items():
        for key, value in values.items():
            torch.testing.assert_close(saved[name][key], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} {key}: {m}")
    opt.close()


@pytest.mark.slow
def test_sharded_training_matches_eager_on_the_whole_batch(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        # A file rendezvous: no port that another test process could take first.
        mp.spawn(_worker, args=(WORLD, RUNS, str(tmp_path / "rendezvous"), str(tmp_path), results),
                 nprocs=WORLD, join=True)
        every = dict(results)
    _check_unsharded_load(tmp_path / "checkpoint", *every["checkpoint", 0])
    gathered = {key: n for key, n in every.items() if isinstance(key[0], int)}
    # All-gathered bytes per step depend neither on K, the tier nor the clip, and match across ranks.
    assert len(set(gathered.values())) == 1 and len(gathered) == len(RUNS) * WORLD, gathered
    assert next(iter(gathered.values())) > 0
    # FSDP2 with gradient accumulation moves K times its K=1 bytes, of each kind; the
    # sharded schedule moves the same bytes at K=1 and K=4, about FSDP2's at K=1.
    for rank in range(WORLD):
        fsdp2 = {k: every[("fsdp2", rank, k)] for k in (1, 4)}
        for kind in (TransferKind.ALL_GATHER, TransferKind.REDUCE_SCATTER):
            assert fsdp2[4][kind] == 4 * fsdp2[1][kind] > 0, (kind, fsdp2)
        ours = {k: sum(every[("speedloader", rank, k, "nvme", None)].values()) for k in (1, 4)}
        assert ours[1] == ours[4]
        assert sum(fsdp2[4].values()) > 3 * ours[4], (fsdp2, ours)


@pytest.mark.slow
def test_sharded_training_of_four_ranks_matches_eager_on_the_whole_batch(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(4, RUNS_OF_FOUR, str(tmp_path / "rendezvous"), str(tmp_path), results),
                 nprocs=4, join=True)
        gathered = {key: n for key, n in results.items() if isinstance(key[0], int)}
    # Every rank all-gathers the same bytes (in the worker: 3/4 of the fetched weights).
    assert len(set(gathered.values())) == 1 and len(gathered) == 4 * len(RUNS_OF_FOUR), gathered


def _padding_worker(rank, world, rendezvous):
    """World size 4 and tensors 4 does not divide: rank r keeps elements [r*n, (r+1)*n)
    zero-padded, n = ceil(numel / 4) (for 5 elements rank 3 keeps padding only);
    all-gather, reduce-scatter and all-reduce move (W-1) padded shards of bytes. Less
    the padding, a shard is the DTensor `Shard(0)` shard of the flat tensor, as
    checkpoints save it: DCP reads the whole tensor back from the four ranks' chunks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        shards = shard_group()
        mesh = init_device_mesh("cpu", (world,))
        saved, expected = {}, {}
        for numel in (5, 7, 9):
            size = -(-numel // world)
            full = torch.arange(1.0, numel + 1) * (rank + 1)  # each rank's own values
            mine = shards.shard(full)
            assert mine.numel() == size
            valid = max(0, min(numel, (rank + 1) * size) - rank * size)
            torch.testing.assert_close(mine[:valid], full[rank * size:rank * size + valid], rtol=0, atol=0)
            assert not mine[valid:].any()
            reset_runtime_stats()
            gathered = shards.wait(shards.all_gather("t", lambda: mine, full.shape))
            reduced = shards.wait(shards.reduce_scatter("t", full))
            averaged = shards.wait(shards.all_reduce("t", full.clone()))
            moved = mark_step().bytes_moved
            # Element i comes from the rank that keeps it: rank i // size, scaled by its rank + 1.
            owner = torch.arange(numel) // size
            torch.testing.assert_close(gathered, torch.arange(1.0, numel + 1) * (owner + 1), rtol=0, atol=0)
            mean = torch.arange(1.0, numel + 1) * sum(range(1, world + 1)) / world
            torch.testing.assert_close(averaged, mean)
            torch.testing.assert_close(reduced, torch.nn.functional.pad(mean, (0, size * world - numel))
                                       [rank * size:(rank + 1) * size])
            shard_bytes = (world - 1) * size * 4
            assert moved[COLLECTIVE[TransferKind.ALL_GATHER]] == shard_bytes
            assert moved[COLLECTIVE[TransferKind.REDUCE_SCATTER]] == shard_bytes
            assert moved[COLLECTIVE[TransferKind.ALL_REDUCE]] == 2 * shard_bytes
            saved[f"t{numel}"] = DTensor.from_local(mine[:valid], mesh, [Shard(0)], run_check=False,
                                                   shape=torch.Size([numel]), stride=(1,))
            expected[f"t{numel}"] = gathered
        checkpoint = str(Path(rendezvous).parent / "checkpoint")
        dcp.save(saved, checkpoint_id=checkpoint)
        loaded = {name: torch.zeros_like(value) for name, value in expected.items()}
        dcp.load(loaded, checkpoint_id=checkpoint)
        for name, value in expected.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        dist.barrier()  # no rank leaves while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_shards_of_four_ranks_are_padded(tmp_path):
    mp.spawn(_padding_worker, args=(4, str(tmp_path / "rendezvous")), nprocs=4, join=True)


def test_shard_weights_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="'shard_weights'.*init_process_group"):
        slcompile.options(shard_weights=True, weights="nvme")
