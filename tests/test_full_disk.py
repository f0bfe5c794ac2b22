"""A full disk during a step leaves the previous step whole, and a retry once there is
room gives exactly what an uninterrupted run gives (bit for bit)."""

import copy
import errno

import pytest
import torch

import slcompile
from io_faults import fail_writes
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import DiskFullError, OffloadError
from slcompile.runtime.storage.engine import get_engine
from slcompile.runtime.storage.nvme import NvmeArena
from slcompile.runtime.weights import weight_home

CFG = GPTConfig(n_layers=4, d_model=32, vocab_size=64, seq_len=8)
BATCHES = [make_gpt_batch(CFG, 4, seed=seed) for seed in range(3)]


def _compiled(model, tmp_path, name, **options):
    offload_dir = str(tmp_path / name)
    return torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "weights": "nvme", "num_subbatches": 2, "live_blocks": 2,
        "offload_dir": offload_dir, **options})


def _stored_weights(model):
    """Every offloaded weight as the tier holds it, read straight from its key."""
    values = {}
    for name, param in slcompile.offloaded_parameters(model):
        engine, key, _ = weight_home(param)
        values[name] = engine.wait(engine.load(key)).view(param.shape).clone()
    return values


def _gathered(model):
    with slcompile.gathered_weights(model):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def _assert_same_bits(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


class _FailingAllocations:
    """Makes every `NvmeArena.allocate` after the first `allowed` raise DiskFullError,
    as a disk that fills up part way through a step would."""

    def __init__(self, monkeypatch, allowed):
        self.allowed = allowed
        self.calls = 0
        real = NvmeArena.allocate

        def allocate(arena, nbytes, key):
            self.calls += 1
            if self.calls > self.allowed:
                raise DiskFullError("injected: no room", key=key, path=arena.file_path)
            return real(arena, nbytes, key)

        monkeypatch.setattr(NvmeArena, "allocate", allocate)


def _sgd_step(compiled, model, opt, idx, targets):
    loss = compiled(idx, targets)[1]
    loss.backward()
    with slcompile.gathered_weights(model):
        opt.step()
    opt.zero_grad()
    return loss.detach()


def test_gathered_weights_on_a_full_disk_changes_nothing_and_a_retry_matches(tmp_path, monkeypatch):
    base = TinyGPT(CFG)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_compiled = _compiled(reference, tmp_path, "reference")
    compiled = _compiled(model, tmp_path, "interrupted")
    expected = [_sgd_step(reference_compiled, reference, reference_opt, *batch) for batch in BATCHES]

    assert torch.equal(_sgd_step(compiled, model, opt, *BATCHES[0]), expected[0])
    before = _gathered(model)
    stored_before = _stored_weights(model)
    momentum_before = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}
    loss = compiled(*BATCHES[1])[1]
    loss.backward()
    assert torch.equal(loss.detach(), expected[1])
    with monkeypatch.context() as patch:
        _FailingAllocations(patch, allowed=5)  # room for 5 of the 16 block weights
        with pytest.raises(DiskFullError):
            with slcompile.gathered_weights(model):
                opt.step()
    # Nothing changed: not the weights on the tier, not the resident parameters,
    # not the optimizer's state (its step never ran).
    _assert_same_bits(_stored_weights(model), stored_before)
    _assert_same_bits(_gathered(model), before)
    assert all(torch.equal(s["momentum_buffer"], momentum_before[id(p)]) for p, s in opt.state.items())
    assert not [key for key in get_engine(str(tmp_path / "interrupted")).keys() if key.endswith("~update")]
    # With room again, the same step and the next give what the uninterrupted run gave.
    with slcompile.gathered_weights(model):
        opt.step()
    opt.zero_grad()
    assert torch.equal(_sgd_step(compiled, model, opt, *BATCHES[2]), expected[2])
    _assert_same_bits(_gathered(model), _gathered(reference))


@pytest.mark.parametrize(("error", "raised"), [(errno.ENOSPC, DiskFullError), (errno.EIO, OffloadError)],
                         ids=["disk full", "I/O error"])
def test_gathered_weights_write_failing_on_exit_keeps_every_stored_weight_whole(tmp_path, monkeypatch, error,
                                                                               raised):
    model = TinyGPT(CFG)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = _compiled(model, tmp_path, "weights")
    _sgd_step(compiled, model, opt, *BATCHES[0])
    stored_before = _stored_weights(model)
    compiled(*BATCHES[1])[1].backward()
    writes = []

    def failing_after_five_writes(offset):
        writes.append(offset)
        return error if len(writes) > 5 else None

    with monkeypatch.context() as patch:
        fail_writes(patch, failing_after_five_writes)
        with pytest.raises(raised) as info:
            with slcompile.gathered_weights(model):
                opt.step()
    assert len(writes) > 5
    assert isinstance(info.value, DiskFullError) == (error == errno.ENOSPC)
    # Five weights were written, and none of them replaced its previous values.
    _assert_same_bits(_stored_weights(model), stored_before)
    assert not [key for key in get_engine(str(tmp_path / "weights")).keys() if key.endswith("~update")]
    for _, param in slcompile.offloaded_parameters(model):
        assert param.untyped_storage().nbytes() == 0
    # Once writes succeed again, the same update of the offloaded weights goes through
    # as in a run that never failed (resident parameters the failed block changed stay changed).
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_compiled = _compiled(reference, tmp_path, "reference")
    _sgd_step(reference_compiled, reference, reference_opt, *BATCHES[0])
    reference_compiled(*BATCHES[1])[1].backward()
    with slcompile.gathered_weights(reference):
        reference_opt.step()
    with slcompile.gathered_weights(model):
        opt.step()
    offloaded = {name for name, _ in slcompile.offloaded_parameters(model)}
    _assert_same_bits({name: value for name, value in _gathered(model).items() if name in offloaded},
                      {name: value for name, value in _gathered(reference).items() if name in offloaded})


def _offloaded_step(compiled, opt, idx, targets):
    loss = compiled(idx, targets)[1]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("states", ["host", "nvme"])
@pytest.mark.parametrize("failing_block", [0, 2], ids=["first block", "third block"])
def test_offloaded_optimizer_full_disk_undoes_every_block_and_a_retry_matches(tmp_path, monkeypatch, states,
                                                                             failing_block):
    base = TinyGPT(CFG)
    # Each block step writes its weights (and with nvme states, two AdamW states per
    # weight): the disk fills up two writes into the block that steps `failing_block`-th.
    writes_per_block = len(list(base.layers[0].parameters())) * (3 if states == "nvme" else 1)
    allowed = failing_block * writes_per_block + 2
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    options = {"lr": 1e-2, "weight_decay": 0.1}
    reference_opt = slcompile.offload_optimizer(reference, torch.optim.AdamW, states=states, **options)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, states=states, **options)
    reference_compiled = _compiled(reference, tmp_path, "reference")
    compiled = _compiled(model, tmp_path, "interrupted")
    expected = [_offloaded_step(reference_compiled, reference_opt, *batch) for batch in BATCHES]

    assert torch.equal(_offloaded_step(compiled, opt, *BATCHES[0]), expected[0])
    stored_before = _stored_weights(model)
    weights_before = model.state_dict()
    state_before = opt.state_dict()["state"]
    with monkeypatch.context() as patch:
        failing = _FailingAllocations(patch, allowed=allowed)
        loss = compiled(*BATCHES[1])[1]
        loss.backward()
        with pytest.raises(DiskFullError):
            opt.step()
    assert failing.calls > allowed
    assert torch.equal(loss.detach(), expected[1])
    opt.zero_grad()
    # Every block is as before the step: the weights on the tier, the host copies
    # (model.state_dict() reads them) and the optimizer state, bit for bit.
    _assert_same_bits(_stored_weights(model), stored_before)
    _assert_same_bits(model.state_dict(), weights_before)
    state = opt.state_dict()["state"]
    assert state.keys() == state_before.keys()
    for name in state_before:
        _assert_same_bits(state[name], state_before[name])
    engine = get_engine(str(tmp_path / "interrupted"))
    assert not [key for key in engine.keys() if key.endswith("~update")]
    # With room again, the same batch and the next give the uninterrupted run's.
    assert torch.equal(_offloaded_step(compiled, opt, *BATCHES[1]), expected[1])
    assert torch.equal(_offloaded_step(compiled, opt, *BATCHES[2]), expected[2])
    _assert_same_bits(model.state_dict(), reference.state_dict())
    _assert_same_bits(_stored_weights(model), _stored_weights(reference))
    opt.close()
    reference_opt.close()
