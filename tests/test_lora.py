"""LoRA over a base whose weights rest on nvme (`peft`): the frozen base streams from
its tier for the forward and for the input gradients of the backward, with no
gradient traffic and no optimizer state; the adapters (trainable weights in blocks
that also hold frozen ones) stay on the device under `trainable="auto"`, so a plain
`torch.optim.AdamW` steps them. Losses and adapters equal eager's, step by step."""

from __future__ import annotations

import copy

import pytest
import torch

import slcompile
from models import hf_llama
from slcompile.passes.stream_weights import resident_trainable
from slcompile.runtime.storage.tiers import Tier, TransferKind

peft = pytest.importorskip("peft")

ADAPTER_REASON = "trainable, in a block that also holds frozen weights (trainable='auto')"


def _lora_llama():
    torch.manual_seed(0)
    base = hf_llama(num_hidden_layers=2, hidden_size=32, vocab_size=96)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_lora_on_an_nvme_base_trains_like_eager_and_moves_only_the_frozen_weights(tmp_path):
    model = _lora_llama()
    eager = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    layers = {name: p for name, p in model.named_parameters() if ".layers." in name}
    adapters = [name for name, p in layers.items() if p.requires_grad]
    assert len(adapters) == 8  # lora_A and lora_B of q_proj and v_proj, per layer
    frozen_block_bytes = _nbytes(p for p in layers.values() if not p.requires_grad)
    # Nothing before block 0 requires grad, so its backward computes no gradient of its
    # input and does not load the weights only that gradient reads: the q, k and v
    # projections (the adapters' gradients read their input, not their weight) and the
    # input norm. Every other frozen weight is loaded once by the backward.
    block0_input_only = _nbytes(p for name, p in layers.items() if ".layers.0." in name and not p.requires_grad
                                and any(part in name for part in ("q_proj", "k_proj", "v_proj", "input_layernorm")))

    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(1))
    options = slcompile.options(num_subbatches=4, weights="nvme", offload_dir=str(tmp_path), lowering="aot_eager",
                                live_blocks=1)  # one live block: no load issued in one step for the next
    compiled = torch.compile(model, backend="speedloader", options=options)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    eager_opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    slcompile.mark_step()
    steps = []
    for _ in range(3):
        losses = []
        for net, optimizer in ((compiled, opt), (eager, eager_opt)):
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            if net is compiled:
                steps.append(slcompile.mark_step())
        torch.testing.assert_close(losses[0], losses[1])

    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    placement = report.weights
    assert sorted(name for name, why in placement.resident if why == ADAPTER_REASON) == sorted(adapters)
    assert placement.frozen == frozenset(name for block in placement.streamed for name in block)
    assert placement.streamed_bytes == placement.frozen_bytes == frozen_block_bytes
    loads = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)
    # The first step also stores the frozen block weights once, when they leave the device.
    assert dict(steps[0].bytes_moved) == {(TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME): frozen_block_bytes,
                                          loads: 2 * frozen_block_bytes - block0_input_only}
    for step in steps[1:]:
        assert dict(step.bytes_moved) == {loads: 2 * frozen_block_bytes - block0_input_only}
    assert all(kind is not TransferKind.GRADIENT for step in steps for kind, _, _ in step.bytes_moved)

    explained = slcompile.explain(model, kwargs={"input_ids": ids, "labels": ids}, **options)
    assert explained.weights == placement
    assert f" 8 {ADAPTER_REASON}: base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" \
        in str(explained)

    eager_params = dict(eager.named_parameters())
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, eager_params[name], msg=name)
            assert not torch.equal(param, before[name]), name
    with slcompile.gathered_weights(model):
        for name, param in model.named_parameters():
            if not param.requires_grad:
                assert torch.equal(param, before[name]), name


def test_the_trainable_option_keeps_adapters_only_where_it_says():
    frozen = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    adapter = torch.nn.Parameter(torch.zeros(2))
    trained = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    assert resident_trainable("auto", [frozen, adapter]) == {id(adapter): ADAPTER_REASON}
    assert resident_trainable("auto", trained) == {}  # full training streams every weight
    assert resident_trainable("stream", [frozen, adapter]) == {}
    assert resident_trainable("device", trained) == {id(p): "trainable (trainable='device')" for p in trained}
    assert resident_trainable("device", [frozen]) == {}
    with pytest.raises(ValueError, match="'trainable' must be one of 'auto', 'stream', 'device'"):
        slcompile.options(trainable="frozen")
