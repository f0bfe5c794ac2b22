"""Integrity of what rests on the nvme tier: bytes changed on the disk are found when
read (a named error naming the tensor, the file and the offset), never used."""

import os

import pytest
import torch

import slcompile
from devices import flip_bits
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime.storage.engine import get_engine
from slcompile.runtime.weights import weight_home

CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)



def _fill(path: str, offset: int, nbytes: int) -> None:
    """Overwrites a range of the arena file with 0xFF bytes (NaNs as floats)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * nbytes, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _train_step(compiled, idx, targets):
    loss = compiled(idx, targets)[1]
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("damage", ["exponent bit", "0xff bytes"])
def test_corrupt_weight_on_nvme_raises_naming_it(tmp_path, damage):
    model = TinyGPT(CFG)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "weights": "nvme", "num_subbatches": 2, "offload_dir": str(tmp_path)})
    idx, targets = make_gpt_batch(CFG, 4)
    first = _train_step(compiled, idx, targets)
    model.zero_grad()
    assert torch.isfinite(first)
    # An untouched run reads the same weights again: the same loss, bit for bit.
    assert torch.equal(_train_step(compiled, idx, targets), first)
    model.zero_grad()
    param = dict(model.named_parameters())["layers.1.mlp.fc.weight"]
    engine, key, _ = weight_home(param)
    path, offset, nbytes = engine.nvme_location(key)
    if damage == "exponent bit":
        flip_bits(path, offset + 4 * 100 + 3)
    else:
        _fill(path, offset + nbytes // 2, 64)
    with pytest.raises(slcompile.CorruptDataError) as caught:
        _train_step(compiled, idx, targets)
    error = caught.value
    assert error.key == key and "layers_modules_1_modules_mlp_modules_fc_parameters_weight" in key
    assert error.path == path
    assert offset <= error.offset < offset + nbytes
    assert "corrupt data" in str(error) and path in str(error) and str(error.offset) in str(error)


def test_corrupt_stashed_activation_raises_naming_it(tmp_path):
    model = TinyGPT(CFG)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0, "num_subbatches": 2,
        "offload_dir": str(tmp_path)})
    idx, targets = make_gpt_batch(CFG, 4)
    expected = compiled(idx, targets)[1]
    expected.backward()  # untouched: the backward reads every stash back
    model.zero_grad()
    engine = get_engine(str(tmp_path))
    loss = compiled(idx, targets)[1]
    stashed = [key for key in engine.keys() if key.startswith("blk1.sb0.")]
    assert stashed, engine.keys()
    key = stashed[0]
    path, offset, nbytes = engine.nvme_location(key)
    flip_bits(path, offset + nbytes - 1)
    with pytest.raises(slcompile.CorruptDataError) as caught:
        loss.backward()
    assert caught.value.key == key and caught.value.path == path
    assert offset <= caught.value.offset < offset + nbytes


def test_corrupt_optimizer_state_on_nvme_raises_naming_it(tmp_path):
    model = TinyGPT(CFG)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-3, states="nvme", gradients="nvme")
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "weights": "nvme", "num_subbatches": 2, "offload_dir": str(tmp_path)})
    engine = get_engine(str(tmp_path))
    for seed in range(2):  # the second step reads the states the first one wrote: untouched, they pass
        _train_step(compiled, *make_gpt_batch(CFG, 4, seed=seed))
        opt.step()
        opt.zero_grad()
    [key] = [key for key in engine.keys() if ":layers.0.attn.proj.weight:exp_avg_sq#" in key]
    path, offset, nbytes = engine.nvme_location(key)
    _fill(path, offset, 8)
    _train_step(compiled, *make_gpt_batch(CFG, 4, seed=2))
    with pytest.raises(slcompile.CorruptDataError) as caught:
        opt.step()
    assert caught.value.key == key and caught.value.path == path and caught.value.offset == offset
    opt.close()
