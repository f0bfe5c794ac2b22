"""`slcompile.save_pretrained`: a model whose block weights rest on nvme, written in
Hugging Face's safetensors layout one block at a time, loads with `from_pretrained`
into a fresh eager model with the trained values."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import slcompile
from slcompile.runtime.storage.tiers import Tier, TransferKind


def _tied_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True))


def _index(path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_offloaded_weights_saved_block_by_block_load_with_from_pretrained(tmp_path):
    model = _tied_llama()
    options = slcompile.options(num_subbatches=2, lowering="aot_eager", weights="nvme", on_refusal="raise")
    compiled = torch.compile(model, backend="speedloader", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        compiled(ids, labels=ids).loss.backward()
        with slcompile.gathered_weights(model):
            optimizer.step()
        optimizer.zero_grad()
    offloaded = dict(slcompile.offloaded_parameters(model))
    blocks = {}
    for name, param in offloaded.items():
        block = name.split(".")[2]
        blocks[block] = blocks.get(block, 0) + param.numel() * param.element_size()
    assert sorted(blocks) == ["0", "1"]
    with slcompile.gathered_weights(model):
        trained = {name: p.detach().clone() for name, p in model.named_parameters()}

    # One file per block at the default size: the loads of one block at a time.
    slcompile.mark_step()
    resident = slcompile.runtime_stats().resident_bytes.get(Tier.DEVICE, 0)
    slcompile.save_pretrained(model, tmp_path / "whole")
    saving = slcompile.mark_step()
    assert saving.peak_bytes[Tier.DEVICE] - resident == max(blocks.values())
    assert saving.bytes_moved[(TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)] == sum(blocks.values())
    whole = _index(tmp_path / "whole")
    assert len(set(whole.values())) == 2 and not (tmp_path / "whole" / "model.safetensors").exists()

    # Small files: a block's weights over several of them.
    slcompile.save_pretrained(model, tmp_path / "small", max_shard_size="8KB")
    small = _index(tmp_path / "small")
    assert len(set(small.values())) > 4 and small.keys() == whole.keys()
    # The tied head is written once, under the embedding's name, as Hugging Face writes it.
    assert "model.embed_tokens.weight" in small and "lm_head.weight" not in small

    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "small")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert dict(loaded.named_parameters()).keys() == trained.keys()
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param.detach(), trained[name], rtol=0, atol=0, msg=name)
